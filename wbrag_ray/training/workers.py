"""Both trainings run as Ray Train jobs: data-parallel workers sized by `<section>.trainer`, checkpointing into
the stage's checkpoint folder so a lost worker or driver resumes (docs/architecture.md, Design notes). The step
loop here serves every `Training`; placement is `training.placement`'s, one step `training.lora`'s."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from wbrag_ray import checkpoints
from wbrag_ray.config import ConfigError, TrainerConfig, _LoraSection
from wbrag_ray.placement import check_workers
from wbrag_ray.placement.waits import TRAIN_START_FAILURE, train_start_wait
from wbrag_ray.storage import Location, resolve
from wbrag_ray.training.lora import apply_gradients, optimizer_of, trainable_state, wrap
from wbrag_ray.training.placement import (
    Placement,
    collective_device,
    model_bytes_of,
    process_group_timeout_s,
    worker_placement,
)

log = logging.getLogger(__name__)
STATE_FILE = "train_state.pt"  # in every checkpoint: trainable weights, optimizer, step, losses
ADAPTER_DIR = "adapter"  # in the last checkpoint: what the driver copies into the run folder
RESULT_FILE = "result.json"  # in the last checkpoint: worker 0's stats and figures (losses per step and the like)
# Worker r reads SHARD.format(r), a contiguous slice split on the driver, the same on every run of one worker count.
SHARD = "examples-{}"
ROW, WEIGHT, GROUP = "_row", "_weight", "_group"  # position (fit adds it), weight in a batch's mean, group


@dataclass
class Training:
    """One training: its examples, one row each (optional columns WEIGHT, an example's weight in a batch's mean,
    and GROUP, its loss term, whose mean loss is logged per step), and settings pickled to the workers. A subclass
    names its model, builds it with its loss, and says what its stats file (`stats_file`) beside the adapter holds."""

    examples: pd.DataFrame
    group_names = ()  # the names of the GROUP values
    stats_file = ""

    @property
    def model(self) -> str:
        """The frozen model's spec (path, hub id, bundled:*), for its size before it loads."""
        raise NotImplementedError

    def build(self, place: Placement) -> tuple[Any, Any]:
        """(placed LoRA-wrapped model, per_example_loss(module, positions in `examples`) -> 1-d tensor)."""
        raise NotImplementedError

    def finish(self, model, place: Placement) -> dict[str, Any]:
        """After the last step, on worker 0 (every worker under fsdp): figures for the driver."""
        return {}

    def summary(self, result: dict[str, Any]) -> dict[str, Any]:
        """On the driver, from worker 0's stats and figures: what the stats file holds."""
        raise NotImplementedError


def plan_steps(section: _LoraSection, num_examples: int, workers: int) -> tuple[int, int]:
    """(steps, examples per step): ceil(epochs x examples / batch), capped by max_steps."""
    if num_examples < 1:
        raise ValueError("nothing to train on: no examples")
    batch = min(section.batch_size, num_examples)
    if batch < workers:
        raise ConfigError(f"a training step of {batch} examples cannot feed {workers} workers: lower "
                          "trainer.num_workers or raise batch_size")
    steps = max(1, math.ceil(section.epochs * num_examples / batch))
    return (min(steps, section.max_steps) if section.max_steps else steps), batch


def batch_indices(step: int, batch: int, num_examples: int, seed: int, stream: int | None = None) -> np.ndarray:
    """The examples of global step `step` from seeded per-epoch permutations, so a resumed worker takes the
    batches an uninterrupted run would. `stream`: a worker's rank (None: one worker over all examples)."""
    start = step * batch
    out = []
    key = [seed] if stream is None else [seed, 1 << 20, stream]  # no stream's key is the single worker's
    while len(out) < batch:
        epoch, offset = divmod(start + len(out), num_examples)
        order = np.random.default_rng([*key, epoch]).permutation(num_examples)
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
    shard = own_shard(rank)
    training = replace(training, examples=shard)
    place = worker_placement(section.trainer, rank, world, config["key"], training.model)
    torch.manual_seed(section.seed)  # before the model loads: new heads and LoRA's A matrices draw from it
    model, per_example_loss = training.build(place)
    module, model = wrap(model, place, world)
    params, optimizer, scaler = optimizer_of(model, place, section.learning_rate)
    comm = collective_device(dist.get_backend(), place.device) if world > 1 else None

    num_examples = config["num_examples"]
    steps, batch = plan_steps(section, num_examples, world)
    n_groups = len(training.group_names)
    state = _restore(model, optimizer)
    if state:
        state["resumes"].append(state["step"])  # every step this training resumed from
    state = state or {"step": 0, "losses": [], "group_loss": [], "resumes": [], "seconds": 0.0}
    losses, group_loss = state["losses"], state["group_loss"]
    weights = torch.as_tensor(shard[WEIGHT].to_numpy(), dtype=torch.float32)
    groups = shard[GROUP].to_numpy()
    own = local_batch(batch, world, rank)
    model.train()
    t0 = time.perf_counter()
    for step in range(state["step"], steps):
        # LoRA dropout's masks from a seed of (seed, step, rank): a resumed worker draws what it would have drawn
        torch.manual_seed(int(np.random.SeedSequence([section.seed, step, rank]).generate_state(1)[0]))
        mine = batch_indices(step, own, len(shard), section.seed, stream=rank if world > 1 else None)
        with place.autocast:
            per_example = per_example_loss(module, mine.tolist()).float()
        w = weights[mine].to(per_example.device)
        weighted = (w * per_example).sum()
        # [weight, weighted loss, (loss sum, rows) per group], summed over the workers in one collective
        figures = [float(w.sum()), float(weighted.detach())]
        for g in range(n_groups):
            sel = torch.as_tensor(groups[mine] == g, device=per_example.device)
            figures += [float(per_example.detach()[sel].sum()), float(sel.sum())]
        if world > 1:
            summed = torch.tensor(figures, dtype=torch.float64, device=comm)
            dist.all_reduce(summed)
            figures = summed.tolist()
        total = max(figures.pop(0), 1e-12)
        figures[0] /= total  # the batch's weighted mean loss
        # this worker's share of that mean; DDP and FSDP average gradients over the workers (hence x world below)
        loss = weighted / total
        if not math.isfinite(figures[0]):
            raise FloatingPointError(f"training loss is {figures[0]} at step {step}; lower learning_rate")
        apply_gradients(loss, world, params, optimizer, scaler)
        losses.append(figures[0])
        group_loss.append([figures[1 + 2 * g] / figures[2 + 2 * g] if figures[2 + 2 * g] else math.nan
                           for g in range(n_groups)])
        done = step + 1
        if done % section.trainer.checkpoint_steps == 0 and done < steps:
            _report(rank, {"step": done, "loss": figures[0]}, model, optimizer,
                    {**state, "step": done, "seconds": state["seconds"] + time.perf_counter() - t0})
    state.update(step=len(losses), seconds=state["seconds"] + time.perf_counter() - t0)
    model.eval()
    stats = {"steps": len(losses), "losses": losses, "group_loss": group_loss, "seconds": state["seconds"],
             "resumed_from_steps": state["resumes"], "examples": num_examples, "examples_per_step": batch,
             "examples_seen": len(losses) * batch, "epochs_seen": round(len(losses) * batch / num_examples, 4),
             "workers": world, "threads": threads, "device": place.device.type, "dtype": str(place.dtype).split(".")[-1],
             "strategy": place.strategy}
    with tempfile.TemporaryDirectory() as tmp:
        figures = {}
        if rank == 0 or place.fsdp:  # an FSDP model's forward (the pruner's validation) needs every rank
            with place.autocast:
                figures = training.finish(model, place)
        if rank == 0:  # the figures with lists (losses per step) ride in the checkpoint, not the metrics
            (Path(tmp) / RESULT_FILE).write_text(json.dumps({**stats, **figures}))
        _report(rank, {"step": len(losses), "final": True, "loss": losses[-1]}, model, optimizer, state, tmp)


def _report(rank: int, metrics: dict[str, Any], model, optimizer, state: dict[str, Any],
            final: str | None = None) -> None:
    """Every worker reports; worker 0 attaches the checkpoint (`state`, trainable weights, optimizer), and to the
    last one (the folder `final`) the adapter."""
    import ray.train
    import torch

    trainable, optimizer_state = trainable_state(model, optimizer)  # every rank: a collective under fsdp
    if rank != 0:
        ray.train.report(metrics, checkpoint=None)
        return
    with contextlib.ExitStack() as stack:
        folder = final or stack.enter_context(tempfile.TemporaryDirectory())
        if final:
            model.save_pretrained(str(Path(folder) / ADAPTER_DIR), state_dict=trainable)
        torch.save({**state, "trainable": trainable, "optimizer": optimizer_state}, Path(folder) / STATE_FILE)
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(folder))


def _restore(model, optimizer) -> dict[str, Any] | None:
    """Load the last checkpoint into `model` and `optimizer` on every worker."""
    import ray.train
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as folder:
        state = torch.load(Path(folder) / STATE_FILE, map_location="cpu", weights_only=False)
    set_state_dict(model, optimizer, model_state_dict=state.pop("trainable"), optim_state_dict=state.pop("optimizer"),
                   options=StateDictOptions(full_state_dict=True, ignore_frozen_params=True, strict=False))
    return state


def shard_bounds(num_examples: int, world: int) -> list[int]:
    """The row positions where workers 1..world-1's shards start."""
    return [r * num_examples // world for r in range(1, world)]


def local_batch(batch: int, world: int, rank: int) -> int:
    """How many of a step's `batch` examples worker `rank` draws from its shard (the first ranks one more)."""
    return batch // world + (rank < batch % world)


def example_shards(training: Training, world: int) -> dict[str, Any]:
    """The training's examples as one Ray dataset a worker (`SHARD`), with the columns the step loop reads."""
    import ray

    frame = training.examples.reset_index(drop=True)
    n = len(frame)
    frame[ROW] = np.arange(n, dtype=np.int64)
    frame[WEIGHT] = frame[WEIGHT].astype(np.float32) if WEIGHT in frame else np.ones(n, np.float32)
    frame[GROUP] = frame[GROUP].astype(np.int64) if GROUP in frame else np.zeros(n, np.int64)
    # from_items builds blocks in this process (from_pandas would wait for a CPU a busy cluster may not free).
    records = frame.to_dict("records")
    bounds = [0, *shard_bounds(n, world), n]
    return {SHARD.format(r): ray.data.from_items(records[bounds[r]:bounds[r + 1]]) for r in range(world)}


def own_shard(rank: int) -> pd.DataFrame:
    """This worker's examples, in their order."""
    import ray.train

    parts = list(ray.train.get_dataset_shard(SHARD.format(rank)).iter_batches(batch_format="pandas", batch_size=None))
    return pd.concat(parts, ignore_index=True).sort_values(ROW, ignore_index=True)


def first_last(values: list[float]) -> tuple[float | None, float | None]:
    """The means of the first and last quarter of `values` (at most 5 each, NaN left out); None where none."""
    seen = [v for v in values if not math.isnan(v)]
    window = max(1, min(5, len(seen) // 4))
    return (sum(seen[:window]) / window, sum(seen[-window:]) / window) if seen else (None, None)


def loss_stats(stats: dict[str, Any]) -> dict[str, Any]:
    """A training's stats from worker 0's: its losses, `first_loss` and `last_loss` (`first_last`), and rates."""
    losses, seconds = stats["losses"], stats["seconds"]
    first, last = first_last(losses)
    return {"losses": losses, "first_loss": first, "last_loss": last, "steps": len(losses), "seconds": seconds,
            "seconds_per_step": seconds / max(1, len(losses)),
            "examples_per_s": stats["examples_seen"] / seconds if seconds > 0 else 0.0,
            **{k: stats[k] for k in ("examples_seen", "epochs_seen", "examples_per_step", "resumed_from_steps",
                                     "workers", "threads", "device", "dtype", "strategy")}}


def torch_config(trainer: TrainerConfig, model: str | None):
    """Ray Train's process-group settings: collectives wait long enough for worker 0 to read the whole model."""
    import torch
    from ray.train.torch import TorchConfig

    dtype = torch.bfloat16 if trainer.num_gpus else torch.float32
    return TorchConfig(timeout_s=process_group_timeout_s(trainer.timeout_s, model_bytes_of(model, dtype)))


def fit(training: Training, section: _LoraSection, out_dir: str, label: str, key: str,
        storage: Location | None = None) -> dict[str, Any]:
    """Run `training` as a Ray Train job, copy its adapter into `out_dir` and write its summary beside it, last;
    return worker 0's stats with the summary. `storage`: where Ray Train checkpoints (default: the running stage's
    checkpoint folder, else a temporary one)."""
    import ray.train
    from ray.train.torch import TorchTrainer

    trainer_config = section.trainer
    plan_steps(section, len(training.examples), trainer_config.num_workers)  # refuse before any worker starts
    check_workers(trainer_config, key)
    stage = checkpoints.active()
    with contextlib.ExitStack() as stack:
        if storage is None and stage is not None:
            stage.record()  # the fingerprint first: a checkpoint of other settings is never resumed
            storage = stage.training
        elif storage is None:
            storage = resolve(stack.enter_context(tempfile.TemporaryDirectory(prefix="wbrag-train-")))
        # Workers must not chdir into Ray Train's staging folder: relative model paths are the user's cwd's.
        os.environ.setdefault("RAY_CHDIR_TO_TRIAL_DIR", "0")
        gpus = trainer_config.num_gpus
        verbose = logging.getLogger().isEnabledFor(logging.DEBUG)
        trainer = TorchTrainer(
            train_loop,
            # the settings; the examples go as Ray Data shards, one a worker
            train_loop_config={"training": replace(training, examples=training.examples.iloc[:0]), "section": section,
                               "verbose": verbose, "key": key, "num_examples": len(training.examples)},
            torch_config=torch_config(trainer_config, training.model),
            datasets=example_shards(training, trainer_config.num_workers),
            dataset_config=ray.train.DataConfig(datasets_to_split=[]),
            scaling_config=ray.train.ScalingConfig(
                num_workers=trainer_config.num_workers, use_gpu=gpus > 0,
                resources_per_worker={"CPU": trainer_config.num_cpus, **({"GPU": gpus} if gpus else {})}),
            run_config=ray.train.RunConfig(
                name=label, storage_path=storage.path, storage_filesystem=storage.fs,
                failure_config=ray.train.FailureConfig(max_failures=trainer_config.max_failures, **TRAIN_START_FAILURE),
                checkpoint_config=ray.train.CheckpointConfig(num_to_keep=2),
                logging_config=ray.train.LoggingConfig(log_level="DEBUG" if verbose else "WARNING")),
        )
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is not None:
            # Ray Train's fit leaves its own SIGINT handler installed: the caller's comes back after it
            stack.callback(signal.signal, signal.SIGINT, signal.getsignal(signal.SIGINT))
        try:
            # workers that cannot be placed within ray.pending_timeout_s end the fit, naming what is missing
            with train_start_wait(f"the {label} training", trainer_config.num_workers,
                                  {"CPU": trainer_config.num_cpus, "GPU": gpus}, f"lower {key}.trainer.num_workers"):
                result = trainer.fit()
        except ray.train.WorkerGroupError as error:
            # A mistake in the inputs (a ConfigError, a diverging loss) is the user's to read as it was raised.
            for failure in error.worker_failures.values():
                if isinstance(failure, (ConfigError, FloatingPointError)):
                    raise failure from error
            raise
        with result.checkpoint.as_directory() as folder:
            shutil.copytree(Path(folder) / ADAPTER_DIR, out_dir, dirs_exist_ok=True)
            stats = json.loads((Path(folder) / RESULT_FILE).read_text())
    summary = training.summary(stats)
    (Path(out_dir) / training.stats_file).write_text(json.dumps(summary, indent=2))  # last: the adapter is complete
    return {**stats, **summary}
