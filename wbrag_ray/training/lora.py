"""LoRA (peft) mechanics shared by the LM pruner and noise-tolerant tuning: wrap, train, save.

Training is fp32: on CPUs without native bf16 it would be emulated, and even where bf16 is native, LoRA's
small updates on bf16 weights lose precision. Prediction may still run in bf16 after the merge.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from wbrag_ray.config import _LoraSection
from wbrag_ray.models.hardware import set_threads

if TYPE_CHECKING:
    import torch

# Gradient-norm cap: a few badly scaled batches (long prompts, saturated sigmoids) must not wreck the adapter.
MAX_GRAD_NORM = 1.0


def training_threads(section: _LoraSection) -> int:
    """Set torch's thread count for training: `section.threads`, else every core this process may use."""
    affinity = getattr(os, "sched_getaffinity", None)  # Linux only; it honours container CPU limits
    cores = len(affinity(0)) if affinity else (os.cpu_count() or 1)
    return set_threads(section.threads or cores)


def seed_torch(seed: int) -> None:
    """Seed before the model loads: new heads and LoRA's A matrices are drawn from torch's generator."""
    import torch

    torch.manual_seed(seed)


def with_lora(model, section: _LoraSection, task_type: str, modules_to_save: list[str] | None = None):
    """`model` wrapped by peft with LoRA adapters on `section.target_modules`; only adapters (and
    `modules_to_save`, trained in full and saved with the adapter) require gradients."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=section.lora_r,
        lora_alpha=section.lora_alpha,
        lora_dropout=section.lora_dropout,
        target_modules=list(section.target_modules),
        task_type=task_type,
        modules_to_save=modules_to_save,
    )
    return get_peft_model(model, lora)


def train(
    model, num_examples: int, batch_loss: Callable[[list[int]], torch.Tensor], section: _LoraSection
) -> tuple[list[float], float]:
    """`section.max_steps` AdamW steps on batches of example indices (reshuffled every pass, seeded), with the
    gradient norm clipped. `batch_loss(indices)` returns the batch's scalar loss. Returns (losses, seconds);
    the model is left in eval mode."""
    import numpy as np
    import torch

    if num_examples < 1:
        raise ValueError("nothing to train on: no examples")
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=section.learning_rate)
    rng = np.random.default_rng(section.seed)
    batch_size = min(section.batch_size, num_examples)  # no duplicates inside one batch of a tiny set
    order, pos = np.empty(0, dtype=np.int64), 0
    losses: list[float] = []
    model.train()
    start = time.perf_counter()
    for step in range(section.max_steps):
        batch: list[int] = []
        while len(batch) < batch_size:
            if pos == len(order):
                order, pos = rng.permutation(num_examples), 0
            take = order[pos : pos + batch_size - len(batch)]
            batch.extend(take.tolist())
            pos += len(take)
        loss = batch_loss(batch)
        value = float(loss.detach())
        if not math.isfinite(value):
            raise FloatingPointError(f"training loss is {value} at step {step}; lower learning_rate")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
        optimizer.step()
        losses.append(value)
    seconds = time.perf_counter() - start
    model.eval()
    return losses, seconds


def loss_stats(losses: list[float], seconds: float, examples_per_step: int) -> dict[str, Any]:
    """Training statistics. `first_loss` / `last_loss` average the first / last quarter of the steps (at most
    5), since a single batch's loss is too noisy to compare."""
    window = max(1, min(5, len(losses) // 4))
    return {
        "losses": losses,
        "first_loss": sum(losses[:window]) / window,
        "last_loss": sum(losses[-window:]) / window,
        "steps": len(losses),
        "seconds": seconds,
        "seconds_per_step": seconds / max(1, len(losses)),
        "examples_per_s": len(losses) * examples_per_step / seconds if seconds > 0 else 0.0,
    }


def save_adapter(model, out_dir: str, stats_name: str, stats: dict[str, Any]) -> None:
    """The adapter (peft layout, loadable by `PeftModel.from_pretrained`), then the stats JSON, written last
    so that its presence means the adapter beside it is complete."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tmp = out / f".{stats_name}.tmp"
    tmp.write_text(json.dumps(stats, indent=2))
    tmp.replace(out / stats_name)
