"""Both trainings (Zero-RAG's LM pruner and noise-tolerant tuning) run as Ray Train jobs: data-parallel workers
that ask for the CPUs or GPUs of `<section>.trainer`, with the run folder's stage checkpoint as Ray Train's
storage, so a training resumes from its last checkpoint after a lost worker (Ray Train restarts the group) or a
lost driver (the same command again: Ray Train finds the checkpoints under the same storage path and name). The
driver only starts the job and reads its result; it never loads the model.

What is trained is a `Training` (its module builds the model and the per-example loss on the worker); the step
loop here is the same for both. A step's batch is `batch_size` examples drawn from a seeded permutation per
epoch, split across the workers; each worker's loss is its share of the batch's weighted mean, so the averaged
gradients are those of the whole batch on one worker: more workers run the same optimization faster. (Not
bit for bit: a worker pads its share of the batch alone and draws its own dropout masks, and Adam amplifies
small differences in weights whose gradients are near zero. A resumed training on the same number of workers
is: its batches and dropout masks are functions of the step, and the checkpoint holds the optimizer state.)
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from wbrag_ray.config import ConfigError, TrainerConfig, _LoraSection
from wbrag_ray.storage import Location

# Gradient-norm cap: a few badly scaled batches (long prompts, saturated sigmoids) must not wreck the adapter.
MAX_GRAD_NORM = 1.0
STATE_FILE = "train_state.pt"  # in every checkpoint: trainable weights, optimizer, step, losses
ADAPTER_DIR = "adapter"  # in the last checkpoint: what the driver copies into the run folder


class Training(Protocol):
    """What one training needs from its module; pickled to the workers (it holds the examples)."""

    num_examples: int
    weights: np.ndarray | None  # each example's weight in a batch's mean (None: equal)
    groups: np.ndarray | None  # each example's group (e.g. a loss term), whose mean loss is logged per step
    group_names: tuple[str, ...]

    def build(self, place: Placement) -> tuple[Any, Any]:
        """(LoRA-wrapped model placed by `place`, per_example_loss(module, indices) -> 1-d tensor)."""

    def finish(self, model, out_dir: str, stats: dict[str, Any], place: Placement) -> dict[str, Any]:
        """On worker 0 after the last step: save the adapter to `out_dir`; return figures for the driver."""


@dataclass(frozen=True)
class Placement:
    """A worker's device and the dtype its frozen weights load in: fp32 on CPU (bf16 there is emulated on many
    CPUs, and LoRA's small updates lose precision in it); bf16 on GPUs that have it, else fp16."""

    device: Any
    dtype: Any
    spread: bool = False  # a worker with several GPUs: accelerate places the model's layers over them

    def load_kwargs(self) -> dict[str, Any]:
        """`from_pretrained` arguments of the frozen weights."""
        return {"dtype": self.dtype, **({"device_map": "auto"} if self.spread else {})}

    def place(self, model):
        return model if self.spread else model.to(self.device)

    @staticmethod
    def inputs_device(model):
        """Where a batch goes: the device of the input embeddings (the first layer when spread)."""
        return model.get_input_embeddings().weight.device

    @property
    def autocast(self):
        import torch

        if self.device.type != "cuda":
            return contextlib.nullcontext()
        return torch.autocast(device_type="cuda", dtype=self.dtype)


def worker_placement() -> Placement:
    import ray.train.torch
    import torch

    device = ray.train.torch.get_device()
    if device.type != "cuda":
        return Placement(torch.device("cpu"), torch.float32)
    dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return Placement(device, dtype, spread=torch.cuda.device_count() > 1)


def plan_steps(section: _LoraSection, num_examples: int, workers: int) -> tuple[int, int]:
    """(steps, examples per step): ceil(epochs x examples / batch), capped by max_steps. A batch is at most the
    whole set and gives every worker at least one example."""
    if num_examples < 1:
        raise ValueError("nothing to train on: no examples")
    batch = min(section.batch_size, num_examples)
    if batch < workers:
        raise ConfigError(f"a training step of {batch} examples cannot feed {workers} workers: lower "
                          "trainer.num_workers or raise batch_size")
    steps = max(1, math.ceil(section.epochs * num_examples / batch))
    return (min(steps, section.max_steps) if section.max_steps else steps), batch


def batch_indices(step: int, batch: int, num_examples: int, seed: int) -> np.ndarray:
    """The examples of global step `step`: positions [step*batch, (step+1)*batch) of the concatenated seeded
    permutations (one per epoch), so any step's batch is known without replaying the run: a resumed worker
    takes the same batches an uninterrupted run would."""
    start = step * batch
    out = []
    while len(out) < batch:
        epoch, offset = divmod(start + len(out), num_examples)
        order = np.random.default_rng([seed, epoch]).permutation(num_examples)
        out.extend(order[offset : offset + batch - len(out)].tolist())
    return np.asarray(out, dtype=np.int64)


def train_loop(config: dict[str, Any]) -> None:
    """The body of every Ray Train worker."""
    import ray.train
    import torch
    import torch.distributed as dist

    training: Training = config["training"]
    section: _LoraSection = config["section"]
    if not config["verbose"]:  # each worker's load report and bars: -v shows them
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    threads = section.threads or max(1, math.ceil(section.trainer.num_cpus))
    torch.set_num_threads(threads)
    place = worker_placement()
    torch.manual_seed(section.seed)  # before the model loads: new heads and LoRA's A matrices draw from it
    model, per_example_loss = training.build(place)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:  # trainable weights in fp32 whatever the frozen ones load in (autocast computes in bf16)
        p.data = p.data.float()
    optimizer = torch.optim.AdamW(params, lr=section.learning_rate)
    scaler = torch.amp.GradScaler("cuda", enabled=place.dtype == torch.float16)
    module = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model

    steps, batch = plan_steps(section, training.num_examples, world)
    n_groups = len(training.group_names)
    state = _restore(model, optimizer)
    start_step = state["step"] if state else 0
    losses: list[float] = state["losses"] if state else []
    group_loss: list[list[float]] = state["group_loss"] if state else []
    seconds = state["seconds"] if state else 0.0
    resumes: list[int] = [*state["resumes"], start_step] if state else []  # every step this training resumed from
    weights = torch.as_tensor(training.weights if training.weights is not None
                              else np.ones(training.num_examples), dtype=torch.float32)
    groups = training.groups
    model.train()
    t0 = time.perf_counter()
    for step in range(start_step, steps):
        # LoRA dropout's masks from a seed of (seed, step, rank): a resumed worker draws what it would have drawn
        torch.manual_seed(int(np.random.SeedSequence([section.seed, step, rank]).generate_state(1)[0]))
        both = batch_indices(step, batch, training.num_examples, section.seed)
        mine = both[rank::world]
        with place.autocast:
            per_example = per_example_loss(module, mine.tolist()).float()
        w = weights[mine].to(per_example.device)
        # this worker's share of the batch's weighted mean; DDP averages gradients over the workers
        loss = (w * per_example).sum() / weights[both].sum().clamp(min=1e-12)
        figures = [float(loss.detach())]
        for g in range(n_groups):
            sel = torch.as_tensor(groups[mine] == g, device=per_example.device)
            figures += [float(per_example.detach()[sel].sum()), float(sel.sum())]
        if world > 1:
            summed = torch.tensor(figures, dtype=torch.float64)
            dist.all_reduce(summed)
            figures = summed.tolist()
        if not math.isfinite(figures[0]):
            raise FloatingPointError(f"training loss is {figures[0]} at step {step}; lower learning_rate")
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss * world).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
        scaler.step(optimizer)
        scaler.update()
        losses.append(figures[0])
        group_loss.append([figures[1 + 2 * g] / figures[2 + 2 * g] if figures[2 + 2 * g] else math.nan
                           for g in range(n_groups)])
        done = step + 1
        if done % section.trainer.checkpoint_steps == 0 and done < steps:
            _report(rank, {"step": done, "loss": figures[0]}, model, optimizer, losses, group_loss, resumes,
                    seconds + time.perf_counter() - t0)
    seconds += time.perf_counter() - t0
    model.eval()
    stats = {"steps": len(losses), "losses": losses, "group_loss": group_loss, "seconds": seconds,
             "resumed_from_steps": resumes, "examples": training.num_examples, "examples_per_step": batch,
             "examples_seen": len(losses) * batch, "epochs_seen": round(len(losses) * batch / training.num_examples, 4),
             "workers": world, "threads": threads, "device": place.device.type, "dtype": str(place.dtype).split(".")[-1]}
    with tempfile.TemporaryDirectory() as tmp:
        figures = {}
        if rank == 0:
            with place.autocast:
                figures = training.finish(model, str(Path(tmp) / ADAPTER_DIR), stats, place)
        _report(rank, {"step": len(losses), "final": True, **stats, **figures}, model, optimizer, losses, group_loss,
                resumes, seconds, tmp)


def _report(rank: int, metrics: dict[str, Any], model, optimizer, losses, group_loss, resumes, seconds: float,
            folder: str | None = None) -> None:
    """Every worker reports (Ray Train's barrier); worker 0 attaches the checkpoint: the trainable weights and the
    optimizer's state (the frozen weights come from the model again), the step and the losses so far."""
    import ray.train
    import torch

    if rank != 0:
        ray.train.report(metrics, checkpoint=None)
        return
    with contextlib.ExitStack() as stack:
        folder = folder or stack.enter_context(tempfile.TemporaryDirectory())
        trainable = {n: p.detach().cpu() for n, p in model.named_parameters() if p.requires_grad}
        torch.save({"step": metrics["step"], "losses": losses, "group_loss": group_loss, "resumes": resumes,
                    "seconds": seconds,
                    "trainable": trainable, "optimizer": optimizer.state_dict()}, Path(folder) / STATE_FILE)
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(folder))


def _restore(model, optimizer) -> dict[str, Any] | None:
    """The last checkpoint's state loaded into `model` and `optimizer` (every worker loads the same one)."""
    import ray.train
    import torch

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as folder:
        state = torch.load(Path(folder) / STATE_FILE, map_location="cpu", weights_only=False)
    named = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in state["trainable"].items():
            named[name].copy_(value.to(named[name].device))
    optimizer.load_state_dict(state["optimizer"])
    return state


def placement_refusal(trainer: TrainerConfig, nodes: list[dict[str, float]], key: str) -> str | None:
    """Why a cluster whose nodes hold `nodes` (each node's resources as Ray reports them) cannot place
    `trainer.num_workers` workers of `trainer.num_cpus` CPUs and `trainer.num_gpus` GPUs each (a worker sits on one
    node), or None where it can. `key`: the config section named in the message."""
    from wbrag_ray.cluster_nodes import room_for

    need = {"CPU": trainer.num_cpus, **({"GPU": trainer.num_gpus} if trainer.num_gpus else {})}
    fits = room_for(need, nodes)  # whole workers per node
    if fits >= trainer.num_workers:
        return None
    worker = " and ".join(f"{amount:g} {r}" for r, amount in need.items())
    largest = max((n.get("GPU" if trainer.num_gpus else "CPU", 0.0) for n in nodes), default=0.0)
    fix = (f"set {key}.trainer.num_workers: {fits}" if fits else
           f"lower {key}.trainer.num_{'gpus' if trainer.num_gpus else 'cpus'} (the largest node has {largest:g})")
    return (f"{key}.trainer: {trainer.num_workers} training workers of {worker} each do not fit the cluster's "
            f"{len(nodes)} node{'s' * (len(nodes) != 1)} (room for {fits}); {fix}, or add nodes")


def check_placement(trainer: TrainerConfig, key: str) -> None:
    """A ConfigError before any worker starts when the connected cluster cannot place the training workers (Ray
    Train would wait for them); skipped where WBRAG_AUTOSCALING=1 says nodes come on demand."""
    from wbrag_ray.cluster_nodes import refuse_unplaceable

    refuse_unplaceable(lambda nodes: placement_refusal(trainer, nodes, key))


@contextlib.contextmanager
def _callers_sigint_handler():
    """The SIGINT handler of the caller's main thread, put back when the training ends. Ray Train's fit installs
    one that aborts its run and leaves it installed: afterwards Ctrl-C in the same process (the next steps of
    `wbrag run`, a notebook) only logged "Gracefully aborting the training run", the third press exited with
    status 0, and the handler's closure kept the finished run's controller actor alive."""
    if threading.current_thread() is not threading.main_thread():
        yield  # Ray Train installs none there
        return
    saved = signal.getsignal(signal.SIGINT)
    try:
        yield
    finally:
        if saved is not None:  # None: a handler not set from Python, which cannot be put back
            signal.signal(signal.SIGINT, saved)


def fit(training: Training, section: _LoraSection, out_dir: str, label: str, key: str,
        storage: Location | None = None) -> dict[str, Any]:
    """Run `training` as a Ray Train job and copy its adapter into the local folder `out_dir`; returns the
    stats worker 0 reported. `key`: the config section, for messages (zerorag.lm_pruner). `storage`: where Ray Train keeps its checkpoints, by default the running stage's
    checkpoint folder (removed when the stage completes); outside a stage, a temporary local folder."""
    import ray.train
    from ray.train.torch import TorchTrainer

    from wbrag_ray import checkpoints
    from wbrag_ray.stages.kept import release_kept

    trainer_config = section.trainer
    plan_steps(section, training.num_examples, trainer_config.num_workers)  # refuse before any worker starts
    check_placement(trainer_config, key)
    release_kept()  # the training workers need the CPUs (GPUs) a finished command's services hold
    stage = checkpoints.active()
    with contextlib.ExitStack() as stack:
        if storage is None and stage is not None:
            stage.record()  # the fingerprint first: a checkpoint of other settings is never resumed
            storage = stage.training
        elif storage is None:
            from wbrag_ray.storage import resolve

            storage = resolve(stack.enter_context(tempfile.TemporaryDirectory(prefix="wbrag-train-")))
        # Workers must not chdir into Ray Train's staging folder: relative model paths are the user's cwd's.
        os.environ.setdefault("RAY_CHDIR_TO_TRIAL_DIR", "0")
        gpus = trainer_config.num_gpus
        verbose = logging.getLogger().isEnabledFor(logging.DEBUG)
        trainer = TorchTrainer(
            train_loop,
            train_loop_config={"training": training, "section": section, "verbose": verbose},
            scaling_config=ray.train.ScalingConfig(
                num_workers=trainer_config.num_workers, use_gpu=gpus > 0,
                resources_per_worker={"CPU": trainer_config.num_cpus, **({"GPU": gpus} if gpus else {})}),
            run_config=ray.train.RunConfig(
                name=label, storage_path=storage.path, storage_filesystem=storage.fs,
                failure_config=ray.train.FailureConfig(max_failures=trainer_config.max_failures),
                checkpoint_config=ray.train.CheckpointConfig(num_to_keep=2),
                logging_config=ray.train.LoggingConfig(log_level="DEBUG" if verbose else "WARNING")),
        )
        stack.enter_context(_callers_sigint_handler())
        try:
            result = trainer.fit()
        except ray.train.WorkerGroupError as error:
            # A mistake in the inputs (a ConfigError, a diverging loss) is the user's to read as it was raised.
            for failure in error.worker_failures.values():
                if isinstance(failure, (ConfigError, FloatingPointError)):
                    raise failure from error
            raise
        with result.checkpoint.as_directory() as folder:
            shutil.copytree(Path(folder) / ADAPTER_DIR, out_dir, dirs_exist_ok=True)
        return {k: v for k, v in result.metrics.items() if k not in ("final", "step")}
