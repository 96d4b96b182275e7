"""One optimizer step of a LoRA training, as every worker runs it: the trainable weights in fp32 whatever the frozen
ones load in, the model wrapped for its placement (FSDP2 sharding, DDP, or neither), the loss scaled to the world,
the gradients clipped to a global norm, and the trainable state gathered whole. The step loop around it (batches,
checkpoints, Ray Train's reports) is `training.workers`'.

Imports torch only, never Ray: the GPU check (benchmarks/gpu/check.py) runs these same steps on a GPU machine
that has no Ray, under a one-rank process group.
"""

from __future__ import annotations

from typing import Any

from wbrag_ray.training.placement import Placement, shard_fsdp

# Gradient-norm cap: a few badly scaled batches (long prompts, saturated sigmoids) must not wreck the adapter.
MAX_GRAD_NORM = 1.0


def wrap(model, place: Placement, world: int) -> tuple[Any, Any]:
    """(module the loss runs through, model whose parameters train): fsdp shards the model (the same object);
    several workers under ddp wrap it in DDP (one GPU: on it; a layer split: a module over several devices, no
    device_ids); one worker runs it as it is. The trainable weights become fp32 first (autocast computes in the
    frozen weights' bf16)."""
    import torch

    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    if place.fsdp:
        model = shard_fsdp(model, place)
        return model, model
    if world > 1:
        one = place.device.type == "cuda" and not place.spread
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=[place.device] if one else None), model
    return model, model


def optimizer_of(model, place: Placement, learning_rate: float) -> tuple[list, Any, Any]:
    """(trainable parameters, AdamW over them, gradient scaler: active only for fp16 weights, whose small
    gradients underflow). Called after `wrap`: FSDP replaces the parameters."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=learning_rate)
    return params, optimizer, torch.amp.GradScaler("cuda", enabled=place.dtype == torch.float16)


def apply_gradients(loss, world: int, params: list, optimizer, scaler) -> float:
    """Backward of this worker's share of the batch's loss, then the optimizer step; returns the gradients'
    global norm before clipping. DDP and FSDP average gradients over the workers, hence the loss times `world`."""
    import torch

    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss * world).backward()
    scaler.unscale_(optimizer)
    norm = torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)  # FSDP2's DTensor gradients: the global norm
    scaler.step(optimizer)
    scaler.update()
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def trainable_state(model, optimizer) -> tuple[dict, dict]:
    """(trainable weights, optimizer state), whole and on the CPU, keyed by parameter name: the same under ddp
    and fsdp (whose shards are gathered here, so every rank must call it; under fsdp only rank 0 receives them),
    and loadable by any worker count."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                     ignore_frozen_params=True))
