"""Where a training worker's model goes: the GPUs Ray assigned to it and no other (`own_gpus`, `device_rule`: pure
functions of the worker's GPUs, the GPUs it sees, the model's size and the GPU's memory, so the paper configs'
shapes are tested without a GPU), the dtype, a layer split over its own GPUs under ddp, FSDP2 sharding over all the
workers under fsdp (`shard_fsdp`), and the device of the process group's collectives. The step loop is
`training.workers`'."""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Any

from wbrag_ray.config import ConfigError, TrainerConfig

log = logging.getLogger(__name__)

# What a layer split may fill of each of its GPUs: the rest holds activations, the adapter's optimizer state and
# the CUDA context (accelerate's `max_memory`, per GPU of the worker).
GPU_MEMORY_FRACTION = 0.85


@dataclass(frozen=True)
class DeviceRule:
    """Where one training worker's model goes: `device`, the local CUDA index of its first GPU (None: CPU), and,
    for a worker of several GPUs under ddp, `spread`: the local indices a layer split places the model over, with
    `max_memory` (bytes) for each and for no other GPU of the node."""

    device: int | None
    spread: tuple[int, ...] = ()
    max_memory: dict[int, int] | None = None


def own_gpus(gpu_ids: list, visible: str | None) -> list[int]:
    """The local CUDA indices of the GPUs Ray assigned to this worker (`ray.get_gpu_ids()`), in the worker's
    CUDA_VISIBLE_DEVICES (`visible`). Ray Train makes every training worker on a node see all the training GPUs of
    that node (so NCCL can use peer links): `torch.cuda.device_count()` is the node's count, not the worker's."""
    order = [v.strip() for v in (visible or "").split(",") if v.strip()]
    ids = [str(g) for g in gpu_ids]
    if not order:  # nothing hidden: CUDA index i is GPU i
        return sorted(int(g) for g in ids)
    missing = [g for g in ids if g not in order]
    if missing:
        raise RuntimeError(f"GPUs {missing} assigned by Ray are not in CUDA_VISIBLE_DEVICES={visible!r}")
    return sorted(order.index(g) for g in ids)


def device_rule(assigned: list[int], visible: int, gpu_memory: int, model_bytes: float | None, strategy: str,
                world: int, key: str) -> DeviceRule:
    """The device and map of a worker given its own GPUs (`assigned`, local indices), the GPUs it sees
    (`visible`), each GPU's memory in bytes, the frozen model's size in bytes (None: unknown) and the
    training's strategy over `world` workers. A worker never touches a GPU it was not assigned (its neighbours'
    ranks run there); one GPU: the model on it; several under ddp: a layer split over exactly those, each
    filled to GPU_MEMORY_FRACTION; fsdp: one GPU a rank, the model sharded over the ranks. A model that cannot
    fit is refused here, naming the setting, before any weight loads. `key`: the config section (zerorag.tune)."""
    if not assigned:
        return DeviceRule(None)
    if len(set(assigned)) != len(assigned) or min(assigned) < 0 or max(assigned) >= visible:
        raise RuntimeError(f"a worker's GPUs {assigned} are not distinct GPUs among the {visible} it sees")
    if strategy == "fsdp" and len(assigned) > 1:
        raise ConfigError(f"{key}.trainer.strategy fsdp runs one worker per GPU; set {key}.trainer.num_gpus: 1")
    budget = int(gpu_memory * GPU_MEMORY_FRACTION)
    holds = budget / world if strategy == "fsdp" else budget * len(assigned)
    share = model_bytes / world if model_bytes and strategy == "fsdp" else model_bytes
    if share and share > (budget if strategy == "fsdp" else holds):
        fix = (f"raise {key}.trainer.num_workers" if strategy == "fsdp" else
               f"set {key}.trainer.strategy: fsdp with num_gpus: 1 (the model sharded over every worker), or raise "
               f"{key}.trainer.num_gpus")
        raise ConfigError(f"{key}: the frozen model ({model_bytes / 2**30:.1f} GiB) does not fit a training worker's "
                          f"{len(assigned)} GPU{'s' * (len(assigned) > 1)} of {gpu_memory / 2**30:.0f} GiB "
                          f"({GPU_MEMORY_FRACTION:.0%} of each for weights, {strategy}); {fix}")
    if len(assigned) == 1:
        return DeviceRule(assigned[0])
    return DeviceRule(assigned[0], tuple(assigned), {i: budget for i in assigned})


def collective_device(backend: str, device):
    """Where a tensor for a collective of the process group lives: NCCL takes only CUDA tensors, gloo CPU ones."""
    import torch

    return device if backend == "nccl" else torch.device("cpu")


@dataclass(frozen=True)
class Placement:
    """A worker's device and the dtype its frozen weights load in: fp32 on CPU (bf16 there is emulated on many
    CPUs, and LoRA's small updates lose precision in it); bf16 on GPUs that have it, else fp16. Under fsdp, the
    workers other than rank 0 build the model on the meta device (no weights read): rank 0's are broadcast to
    them shard by shard once the model is sharded (`shard_fsdp`)."""

    device: Any
    dtype: Any
    rule: DeviceRule = DeviceRule(None)
    fsdp: bool = False
    rank: int = 0

    @property
    def spread(self) -> bool:
        return bool(self.rule.spread)

    @property
    def meta(self) -> bool:
        return self.fsdp and self.rank != 0

    def load(self, auto_cls, source: str, **kwargs):
        """`auto_cls.from_pretrained(source, ...)` where this worker holds weights; an empty model of the same
        architecture on the meta device where it receives them (fsdp ranks above 0)."""
        if self.meta:
            import torch
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(source, **kwargs)
            with torch.device("meta"):
                return auto_cls.from_config(config, dtype=self.dtype)
        load = {"dtype": self.dtype}
        if self.spread:
            load.update(device_map="auto", max_memory=dict(self.rule.max_memory))
        return auto_cls.from_pretrained(source, **load, **kwargs)

    def place(self, model):
        return model if self.spread or self.fsdp else model.to(self.device)

    def inputs_device(self, model):
        """Where a batch goes: the device of the input embeddings (the first layer when spread); the worker's own
        under fsdp (a rank's model is on the meta device until it is sharded)."""
        return self.device if self.fsdp else model.get_input_embeddings().weight.device

    @property
    def autocast(self):
        import torch

        if self.device.type != "cuda":
            return contextlib.nullcontext()
        return torch.autocast(device_type="cuda", dtype=self.dtype)


def worker_placement(trainer: TrainerConfig, rank: int, world: int, key: str, model: str | None = None) -> Placement:
    """This worker's placement (`device_rule` on the GPUs Ray assigned to it). A training configured for GPUs on
    a worker that sees none fails here, before any weight loads, naming the setting."""
    import ray
    import torch

    from wbrag_ray.models.hardware import require_gpu

    fsdp = trainer.strategy == "fsdp"
    if not trainer.num_gpus:
        return Placement(torch.device("cpu"), torch.float32, fsdp=fsdp, rank=rank)
    require_gpu(f"{key}'s training worker {rank}", f"{key}.trainer", trainer.num_gpus)  # before any weight loads
    assigned = own_gpus(ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES"))
    dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    model_bytes = None
    if model is not None:
        from wbrag_ray.plan.models import model_size

        params = model_size(model).params
        model_bytes = params * torch.finfo(dtype).bits / 8 if params else None
    rule = device_rule(assigned, torch.cuda.device_count(), torch.cuda.get_device_properties(assigned[0]).total_memory,
                       model_bytes, trainer.strategy, world, key)
    torch.cuda.set_device(rule.device)  # NCCL's and every default allocation's device: the worker's own
    if rule.spread:
        log.warning("%s: worker %d splits its model's layers over its %d GPUs (one busy at a time); "
                    "%s.trainer.strategy: fsdp with num_gpus: 1 keeps every GPU busy", key, rank, len(rule.spread), key)
    return Placement(torch.device("cuda", rule.device), dtype, rule, fsdp, rank)


def shard_fsdp(model, place: Placement):
    """`model` sharded with FSDP2 (`fully_shard` on each decoder layer, then the whole) over the process group,
    gradient checkpointing on, its weights materialized on the worker's device: rank 0's (loaded, the adapter
    initialized from the training's seed) broadcast to the others, whose model was built on the meta device.
    Returns the sharded model (the same object)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import fully_shard

    full = model.state_dict() if place.rank == 0 else {}
    # non-persistent buffers (rotary frequencies) are in no state dict: rank 0's values are sent as they are
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()} if place.rank == 0 else {}
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    layers = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]  # the decoder's is the longest
    for block in (max(layers, key=len) if layers else []):
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device=place.device)
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    comm = collective_device(dist.get_backend(), place.device)
    for name, buffer in model.named_buffers():
        value = buffers[name].to(comm) if place.rank == 0 else torch.empty_like(buffer, device=comm)
        dist.broadcast(value, src=0)
        buffer.copy_(value.to(buffer.device))
    return model
