"""One LoRA (peft) training step, shared by the LM pruner and noise-tolerant tuning: adapters on the frozen model,
the model wrapped for its placement, fp32 trainable weights, the loss scaled to the world, clipped gradients.
Imports torch only: the GPU check runs it without Ray."""

from __future__ import annotations

from typing import Any

from wbrag_ray.config import _LoraSection
from wbrag_ray.training.placement import Placement, shard_fsdp

# Gradient-norm cap: a few badly scaled batches (long prompts, saturated sigmoids) must not wreck the adapter.
MAX_GRAD_NORM = 1.0


def with_lora(model, section: _LoraSection, task_type: str):
    """`model` with LoRA adapters on `section.target_modules`; only they (and a SEQ_CLS head) train."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=section.lora_r, lora_alpha=section.lora_alpha, lora_dropout=section.lora_dropout,
                      target_modules=list(section.target_modules), task_type=task_type)
    return get_peft_model(model, lora)


def wrap(model, place: Placement, world: int) -> tuple[Any, Any]:
    """(module the loss runs through, model whose parameters train): FSDP2, DDP or as is; trainable weights to fp32."""
    import torch

    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    if place.fsdp:
        model = shard_fsdp(model, place)
        return model, model
    if world > 1:
        one = place.device.type == "cuda" and not place.rule.spread
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=[place.device] if one else None), model
    return model, model


def optimizer_of(model, place: Placement, learning_rate: float) -> tuple[list, Any, Any]:
    """(trainable parameters, AdamW, gradient scaler active for fp16 only). Call after `wrap`."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=learning_rate)
    return params, optimizer, torch.amp.GradScaler("cuda", enabled=place.dtype == torch.float16)


def apply_gradients(loss, world: int, params: list, optimizer, scaler) -> float:
    """Backward of this worker's loss share (times `world`: DDP and FSDP average), then step; returns the norm."""
    import torch

    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss * world).backward()
    scaler.unscale_(optimizer)
    norm = torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)  # FSDP2's DTensor gradients: the global norm
    scaler.step(optimizer)
    scaler.update()
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def trainable_state(model, optimizer) -> tuple[dict, dict]:
    """(trainable weights, optimizer state), whole on the CPU by name; every rank must call it under fsdp."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                     ignore_frozen_params=True))
