"""Zero-RAG's LM pruner: a causal LM backbone with a one-output regression head, LoRA-tuned to predict a
sentence's mastery score in [0, 1].

The head reads the hidden state of the last real token (transformers' *ForSequenceClassification picks the
rightmost token that is not `pad_token_id`), so batches are padded on the right and the prediction of a
sentence does not depend on its batch. Predictions are sigmoid(logit): always in [0, 1].
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from wbrag_ray.config import GeneratorConfig, LMPrunerConfig
from wbrag_ray.generation.hf_loading import hf_model_source
from wbrag_ray.training.lora import loss_stats, save_adapter, seed_torch, train, training_threads, with_lora

STATS_FILE = "pruner.json"


def load_backbone(backbone: str, dtype):
    """(resolved source, model with a fresh 1-output head, right-padding tokenizer) for `backbone`."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    source = hf_model_source(GeneratorConfig(model=backbone))
    tokenizer = AutoTokenizer.from_pretrained(source)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"
    model = AutoModelForSequenceClassification.from_pretrained(source, num_labels=1, dtype=dtype)
    # Without a pad id the head reads the very last position, which is padding in every shorter row.
    model.config.pad_token_id = tokenizer.pad_token_id
    return source, model, tokenizer


def encode(tokenizer, texts: list[str], max_length: int) -> list[list[int]]:
    """Token ids per text, cut to `max_length`; an empty text becomes one pad token (a row needs a position)."""
    ids = tokenizer(list(texts), truncation=True, max_length=max_length)["input_ids"]
    return [row or [tokenizer.pad_token_id] for row in ids]


def train_lm_pruner(texts: list[str], scores: list[float], config: LMPrunerConfig, out_dir: str) -> dict[str, Any]:
    """LoRA-tune the backbone to regress mastery scores (MSE on sigmoid(logit)); save the adapter and
    `pruner.json` to the local folder `out_dir`. Returns the training stats."""
    import torch
    import torch.nn.functional as F

    if not texts or len(texts) != len(scores):
        raise ValueError(f"need one score per text, at least one: got {len(texts)} texts, {len(scores)} scores")
    target = torch.tensor(scores, dtype=torch.float32)
    if not bool(((target >= 0) & (target <= 1)).all()):
        raise ValueError("mastery scores must lie in [0, 1]")
    threads = training_threads(config)
    seed_torch(config.seed)
    source, model, tokenizer = load_backbone(config.backbone, torch.float32)
    # SEQ_CLS makes peft train the new head ("score") in full and save it with the adapter.
    model = with_lora(model, config, "SEQ_CLS")
    ids = encode(tokenizer, texts, config.max_length)

    def batch_loss(idx: list[int]) -> torch.Tensor:
        batch = tokenizer.pad({"input_ids": [ids[i] for i in idx]}, return_tensors="pt")
        logits = model(**batch).logits.squeeze(-1)
        return F.mse_loss(torch.sigmoid(logits), target[idx])

    losses, seconds = train(model, len(ids), batch_loss, config)
    stats = {
        "backbone": config.backbone,
        "source": source,
        "max_length": config.max_length,
        "examples": len(ids),
        "threads": threads,
        **loss_stats(losses, seconds, min(config.batch_size, len(ids))),
        "config": config.model_dump(mode="json"),
    }
    save_adapter(model, out_dir, STATS_FILE, stats)
    return stats


class LMPrunerPredictor:
    """Predicted mastery for sentences with a trained LM pruner (the adapter merged into the backbone).

    `setup()` loads the model (once per worker); torch's thread count is the caller's to set.
    """

    def __init__(self, model_dir: str, batch_size: int = 64, device: str | None = None, dtype: str = "auto"):
        self.model_dir = model_dir
        self.batch_size = batch_size
        self.device = device
        self.requested_dtype = dtype  # "auto": bf16 where the hardware has it natively

    def setup(self) -> None:
        import torch
        from peft import PeftModel

        from wbrag_ray.models.hardware import pick_device, pick_dtype

        meta = json.loads((Path(self.model_dir) / STATS_FILE).read_text())
        self.max_length = int(meta["max_length"])
        self.device = self.device or pick_device(1.0)
        # The backbone spec, not the resolved source: a GGUF cache folder is local to the training node.
        _, model, self.tokenizer = load_backbone(meta["backbone"], torch.float32)
        # Merge in fp32, then cast: rounding the merged weights once loses less than merging in bf16.
        model = PeftModel.from_pretrained(model, self.model_dir).merge_and_unload()
        self.dtype = pick_dtype(self.requested_dtype, self.device)
        self.model = model.to(device=self.device, dtype=self.dtype).eval()

    def predict(self, texts: list[str]) -> np.ndarray:
        """float32 predictions in [0, 1], one per text, in input order."""
        import torch

        out = np.empty(len(texts), dtype=np.float32)
        if not texts:
            return out
        ids = encode(self.tokenizer, texts, self.max_length)
        # Length-sorted batches pad little; results go back to the input positions.
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        with torch.inference_mode():
            for start in range(0, len(order), self.batch_size):
                idx = order[start : start + self.batch_size]
                batch = self.tokenizer.pad({"input_ids": [ids[i] for i in idx]}, return_tensors="pt").to(self.device)
                logits = self.model(**batch).logits.squeeze(-1).float()
                out[idx] = torch.sigmoid(logits).cpu().numpy()
        return out
