"""LoRA (peft) mechanics shared by the LM pruner and noise-tolerant tuning: wrap, summarize, save."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from wbrag_ray.config import _LoraSection


def with_lora(model, section: _LoraSection, task_type: str, modules_to_save: list[str] | None = None):
    """`model` with LoRA adapters on `section.target_modules`; only adapters and `modules_to_save` train."""
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


def loss_stats(stats: dict[str, Any]) -> dict[str, Any]:
    """A training's stats: `first_loss` / `last_loss` average the first / last quarter of steps (at most 5)."""
    losses = stats["losses"]
    window = max(1, min(5, len(losses) // 4))
    seconds = stats["seconds"]
    return {
        "losses": losses,
        "first_loss": sum(losses[:window]) / window,
        "last_loss": sum(losses[-window:]) / window,
        "steps": len(losses),
        "seconds": seconds,
        "seconds_per_step": seconds / max(1, len(losses)),
        "examples_per_s": stats["examples_seen"] / seconds if seconds > 0 else 0.0,
        **{k: stats[k] for k in ("examples_seen", "epochs_seen", "examples_per_step", "resumed_from_steps", "workers",
                                 "threads", "device", "dtype", "strategy")},
    }


def save_adapter(model, out_dir: str, stats_name: str, stats: dict[str, Any], state_dict: dict | None = None) -> None:
    """Save the adapter (peft layout), then the stats JSON last, so its presence means the adapter is complete."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), state_dict=state_dict)
    tmp = out / f".{stats_name}.tmp"
    tmp.write_text(json.dumps(stats, indent=2))
    tmp.replace(out / stats_name)
