"""Where a training worker's model goes: only the GPUs Ray assigned to it (`own_gpus`, `device_rule`: pure, so
the paper configs' shapes are tested without a GPU), the dtype, a layer split under ddp, FSDP2 sharding under fsdp
(`shard_fsdp`, hybrid over nodes), and how long collectives may wait. Whether the cluster holds the workers is
`wbrag_ray.placement`'s. No Ray at module level: benchmarks/gpu/check.py runs these rules without it."""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from wbrag_ray.config import ConfigError
from wbrag_ray.models.hardware import require_gpu
from wbrag_ray.models.size import model_size

if TYPE_CHECKING:
    from wbrag_ray.config import TrainerConfig

log = logging.getLogger(__name__)

# What the weights may fill of each GPU (accelerate's `max_memory`): the rest holds activations, the optimizer state
# and the CUDA context.
GPU_MEMORY_FRACTION = 0.85
# trainer.timeout_s 'auto': the first collective waits while worker 0 reads the whole model, at this rate (a slow
# network volume), and never less than Ray Train's own default.
LOAD_READ_BYTES_S = 50e6
TIMEOUT_FLOOR_S = 1800


@dataclass(frozen=True)
class DeviceRule:
    """`device`: the local CUDA index of a worker's first GPU (None: CPU); for several GPUs under ddp, `spread`:
    the indices a layer split places the model over, with `max_memory` (bytes) for each and no other GPU."""

    device: int | None
    spread: tuple[int, ...] = ()
    max_memory: dict[int, int] | None = None


def own_gpus(gpu_ids: list, visible: str | None) -> list[int]:
    """The local CUDA indices of the GPUs Ray assigned to this worker (`ray.get_gpu_ids()`) in its
    CUDA_VISIBLE_DEVICES (`visible`): Ray Train shows every worker all the node's training GPUs (for NCCL)."""
    order = [v.strip() for v in (visible or "").split(",") if v.strip()]
    ids = [str(g) for g in gpu_ids]
    if not order:  # nothing hidden: CUDA index i is GPU i
        return sorted(int(g) for g in ids)
    missing = [g for g in ids if g not in order]
    if missing:
        raise RuntimeError(f"GPUs {missing} assigned by Ray are not in CUDA_VISIBLE_DEVICES={visible!r}")
    return sorted(order.index(g) for g in ids)


def device_rule(assigned: list[int], visible: int, gpu_memory: int, model_bytes: float | None, strategy: str,
                shards: int, key: str, replicas: int = 1) -> DeviceRule:
    """A worker's rule from its own GPUs (`assigned`), the GPUs it sees, a GPU's memory and the frozen model's bytes
    (None: unknown): one GPU holds the model; several under ddp split its layers; fsdp shards it over `shards`
    workers (`replicas` nodes each holding a copy). A model that cannot fit is refused, naming `key`'s setting."""
    if not assigned:
        return DeviceRule(None)
    if len(set(assigned)) != len(assigned) or min(assigned) < 0 or max(assigned) >= visible:
        raise RuntimeError(f"a worker's GPUs {assigned} are not distinct GPUs among the {visible} it sees")
    if strategy == "fsdp" and len(assigned) > 1:
        raise ConfigError(f"{key}.trainer.strategy fsdp runs one worker per GPU; set {key}.trainer.num_gpus: 1")
    budget = int(gpu_memory * GPU_MEMORY_FRACTION)
    holds = budget * len(assigned)
    share = model_bytes / shards if model_bytes and strategy == "fsdp" else model_bytes
    if share and share > (budget if strategy == "fsdp" else holds):
        fix = (f"use nodes of more GPUs (fsdp shards the model over the {shards} workers of a node and replicates "
               f"it on each of the {replicas} nodes)" if strategy == "fsdp" and replicas > 1 else
               f"raise {key}.trainer.num_workers" if strategy == "fsdp" else
               f"set {key}.trainer.strategy: fsdp with num_gpus: 1 (the model sharded over every worker), or raise "
               f"{key}.trainer.num_gpus")
        raise ConfigError(f"{key}: the frozen model ({model_bytes / 2**30:.1f} GiB) does not fit a training worker's "
                          f"{len(assigned)} GPU{'s' * (len(assigned) > 1)} of {gpu_memory / 2**30:.0f} GiB "
                          f"({GPU_MEMORY_FRACTION:.0%} of each for weights, {strategy}); {fix}")
    if len(assigned) == 1:
        return DeviceRule(assigned[0])
    return DeviceRule(assigned[0], tuple(assigned), {i: budget for i in assigned})


def fsdp_mesh_shape(node_ranks: list[int], min_shards: int = 1) -> tuple[int, int]:
    """(replicas, shards): FSDP's mesh for workers on nodes `node_ranks` (rank order). Several nodes of as many
    contiguous workers, at least `min_shards` each: hybrid, sharded within a node and replicated across, so the
    all-gathers never cross the network. Otherwise (1, workers)."""
    world = len(node_ranks)
    runs = [len(list(ranks)) for _, ranks in itertools.groupby(node_ranks)]
    if len(runs) > 1 and len(set(runs)) == 1 and len(runs) == len(set(node_ranks)) and runs[0] >= min_shards:
        return len(runs), runs[0]
    return 1, world


def process_group_timeout_s(timeout: int | str, model_bytes: float | None) -> int:
    """Seconds a collective may wait: `trainer.timeout_s`, or for 'auto' the time to read the model at
    LOAD_READ_BYTES_S, at least TIMEOUT_FLOOR_S."""
    if timeout != "auto":
        return int(timeout)
    return max(TIMEOUT_FLOOR_S, math.ceil(model_bytes / LOAD_READ_BYTES_S)) if model_bytes else TIMEOUT_FLOOR_S


def collective_device(backend: str, device):
    """Where a tensor for a collective of the process group lives: NCCL takes only CUDA tensors, gloo CPU ones."""
    import torch

    return device if backend == "nccl" else torch.device("cpu")


@dataclass(frozen=True)
class Placement:
    """A worker's device and the dtype its frozen weights load in: fp32 on CPU (bf16 is emulated on many CPUs and
    loses LoRA's small updates); bf16 on GPUs that have it, else fp16. Under fsdp, ranks above 0 build the model on
    the meta device; rank 0's weights reach them when it is sharded (`shard_fsdp`) over `mesh` (replicas, shards)."""

    device: Any
    dtype: Any
    rule: DeviceRule = DeviceRule(None)
    fsdp: bool = False
    rank: int = 0
    mesh: tuple[int, int] = (1, 1)

    @property
    def meta(self) -> bool:
        return self.fsdp and self.rank != 0

    def load(self, auto_cls, source: str, **kwargs):
        """`auto_cls.from_pretrained(source, ...)`, or an empty model on the meta device (fsdp ranks above 0)."""
        if self.meta:
            import torch
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(source, **kwargs)
            with torch.device("meta"):
                return auto_cls.from_config(config, dtype=self.dtype)
        load = {"dtype": self.dtype}
        if self.rule.spread:
            load.update(device_map="auto", max_memory=dict(self.rule.max_memory))
        return auto_cls.from_pretrained(source, **load, **kwargs)

    @property
    def model_device(self):
        """Where `place` moves the model; None where it stays as loaded (a layer split; fsdp materializes it)."""
        return None if self.rule.spread or self.fsdp else self.device

    @property
    def strategy(self) -> str:
        """ddp (one worker under fsdp too), layer split, fsdp or hybrid: for the stats."""
        if self.fsdp:
            return "fsdp" if self.mesh[0] == 1 else f"hybrid fsdp ({self.mesh[0]} nodes x {self.mesh[1]})"
        return "layer split" if self.rule.spread else "ddp"

    def place(self, model):
        return model if self.model_device is None else model.to(self.model_device)

    def inputs_device(self, model):
        """Where a batch goes: the input embeddings' device (the first layer when spread); the worker's under fsdp."""
        return self.device if self.fsdp else model.get_input_embeddings().weight.device

    @property
    def autocast(self):
        import torch

        if self.device.type != "cuda":
            return contextlib.nullcontext()
        return torch.autocast(device_type="cuda", dtype=self.dtype)


def placement_of(rule: DeviceRule, dtype, strategy: str, rank: int, mesh: tuple[int, int]) -> Placement:
    """A worker's placement from its rule, dtype and strategy over `mesh` (replicas, shards). fsdp over one worker
    is ddp, the model moved to the worker's device."""
    import torch

    device = torch.device("cpu") if rule.device is None else torch.device("cuda", rule.device)
    return Placement(device, dtype, rule, strategy == "fsdp" and mesh[0] * mesh[1] > 1, rank, mesh)


def model_bytes_of(model: str | None, dtype) -> float | None:
    """The frozen weights' bytes in `dtype` (None where the model or its size is unknown)."""
    if model is None:
        return None
    import torch

    params = model_size(model).params
    return params * torch.finfo(dtype).bits / 8 if params else None


def _node_ranks(world: int) -> list[int]:
    """Each worker's node (Ray Train's node rank), in rank order: a collective of the process group."""
    import ray.train
    import torch.distributed as dist

    nodes: list[int] = [0] * world
    dist.all_gather_object(nodes, ray.train.get_context().get_node_rank())
    return nodes


def worker_placement(trainer: TrainerConfig, rank: int, world: int, key: str, model: str | None = None) -> Placement:
    """This worker's placement (`device_rule` on its GPUs, `fsdp_mesh_shape` under fsdp). A training configured
    for GPUs on a worker that sees none fails here, before any weight loads, naming the setting."""
    import torch

    fsdp = trainer.strategy == "fsdp" and world > 1
    if trainer.strategy == "fsdp" and world == 1:
        log.warning("%s: one training worker has nothing to shard its model over: strategy fsdp trains as ddp (the "
                    "whole model on the worker's %s)", key, "GPU" if trainer.num_gpus else "CPU")
    if not trainer.num_gpus:
        mesh = fsdp_mesh_shape(_node_ranks(world)) if fsdp else (1, world)
        return placement_of(DeviceRule(None), torch.float32, trainer.strategy, rank, mesh)
    import ray

    require_gpu(f"{key}'s training worker {rank}", f"{key}.trainer", trainer.num_gpus)  # before any weight loads
    assigned = own_gpus(ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES"))
    # NCCL's and every default allocation's device: the worker's own, before the first collective below
    torch.cuda.set_device(assigned[0])
    dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    model_bytes = model_bytes_of(model, dtype)
    memory = torch.cuda.get_device_properties(assigned[0]).total_memory
    mesh = (1, world)
    if fsdp:
        need = math.ceil(model_bytes / (memory * GPU_MEMORY_FRACTION)) if model_bytes else 1
        mesh = fsdp_mesh_shape(_node_ranks(world), min_shards=need)
    rule = device_rule(assigned, torch.cuda.device_count(), memory, model_bytes, trainer.strategy, mesh[1], key,
                       replicas=mesh[0])
    if rule.spread:
        log.warning("%s: worker %d splits its model's layers over its %d GPUs (one busy at a time); "
                    "%s.trainer.strategy: fsdp with num_gpus: 1 keeps every GPU busy", key, rank, len(rule.spread), key)
    if fsdp and rank == 0:
        log.info("%s: fsdp over %d workers: %s", key, world, "sharded over all" if mesh[0] == 1 else
                 f"hybrid, sharded within each of {mesh[0]} nodes of {mesh[1]}, replicated across them")
    return placement_of(rule, dtype, trainer.strategy, rank, mesh)


def shard_fsdp(model, place: Placement):
    """`model` sharded with FSDP2 (each decoder layer, then the whole) over `place.mesh`, gradient checkpointing
    on, rank 0's weights (the adapter initialized from the seed) broadcast to the others' meta-device models."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    full = model.state_dict() if place.rank == 0 else {}
    # non-persistent buffers (rotary frequencies) are in no state dict: rank 0's values are sent as they are
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()} if place.rank == 0 else {}
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    layers = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]  # the decoder's is the longest
    # 1-D (every worker a shard) or 2-D (replicate across nodes, shard within one: FSDP2's hybrid sharding)
    shape, names = (place.mesh[1:], ("shard",)) if place.mesh[0] == 1 else (place.mesh, ("replicate", "shard"))
    mesh = init_device_mesh(place.device.type, shape, mesh_dim_names=names)
    for block in (max(layers, key=len) if layers else []):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device=place.device)
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    comm = collective_device(dist.get_backend(), place.device)
    for name, buffer in model.named_buffers():
        value = buffers[name].to(comm) if place.rank == 0 else torch.empty_like(buffer, device=comm)
        dist.broadcast(value, src=0)
        buffer.copy_(value.to(buffer.device))
    return model
