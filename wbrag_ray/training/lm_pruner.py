"""Zero-RAG's LM pruner: a causal LM with a one-output regression head, LoRA-tuned to predict a sentence's
mastery in [0, 1] (sigmoid of the logit at the last real token; right padding keeps it batch-independent)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from wbrag_ray.config import GeneratorConfig, LMPrunerConfig
from wbrag_ray.generation.hf_loading import hf_model_source
from wbrag_ray.models.hardware import pick_dtype
from wbrag_ray.training.lora import with_lora
from wbrag_ray.training.placement import Placement
from wbrag_ray.training.workers import Training, fit, loss_stats

STATS_FILE = "pruner.json"


def load_backbone(backbone: str, load):
    """(resolved source, model with a fresh 1-output head, right-padding tokenizer) for `backbone`, the model
    loaded by `load` (`Placement.load`)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    source = hf_model_source(GeneratorConfig(model=backbone))
    tokenizer = AutoTokenizer.from_pretrained(source)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"
    model = load(AutoModelForSequenceClassification, source, num_labels=1)
    # Without a pad id the head reads the very last position, which is padding in every shorter row.
    model.config.pad_token_id = tokenizer.pad_token_id
    return source, model, tokenizer


def encode(tokenizer, texts: list[str], max_length: int) -> list[list[int]]:
    """Token ids per text, cut to `max_length`; an empty text becomes one pad token (a row needs a position)."""
    ids = tokenizer(list(texts), truncation=True, max_length=max_length)["input_ids"]
    return [row or [tokenizer.pad_token_id] for row in ids]


def predicted_mastery(model, tokenizer, ids: list[list[int]], device):
    """sigmoid of the head's logit for each row of token ids (one batch, right-padded)."""
    import torch

    batch = tokenizer.pad({"input_ids": ids}, return_tensors="pt").to(device)
    return torch.sigmoid(model(**batch).logits.squeeze(-1).float())


@dataclass
class PrunerTraining(Training):
    """The regressor's Ray Train training on examples of `text` and `score`: squared error of sigmoid(logit);
    the workers that trained it predict the held-out set."""

    config: LMPrunerConfig
    val_texts: list[str]
    stats_file = STATS_FILE

    @property
    def model(self) -> str:
        return self.config.backbone

    def build(self, place: Placement):
        import torch

        self.source, model, self.tokenizer = load_backbone(self.config.backbone, place.load)
        # SEQ_CLS makes peft train the new head ("score") in full and save it with the adapter.
        model = place.place(with_lora(model, self.config, "SEQ_CLS"))
        ids = encode(self.tokenizer, self.examples["text"].tolist(), self.config.max_length)
        device = place.inputs_device(model)
        target = torch.tensor(self.examples["score"].to_numpy(), dtype=torch.float32, device=device)

        def per_example_loss(module, idx: list[int]):
            return (predicted_mastery(module, self.tokenizer, [ids[i] for i in idx], device) - target[idx]) ** 2

        return model, per_example_loss

    def finish(self, model, place: Placement) -> dict[str, Any]:
        predictor = LMPrunerPredictor.of_model(model, self.tokenizer, self.config.max_length,
                                               self.config.predict_batch_size, place.inputs_device(model))
        return {"source": self.source, "validation": predictor.predict(self.val_texts).tolist()}

    def summary(self, result: dict[str, Any]) -> dict[str, Any]:
        return {"backbone": self.config.backbone, "source": result["source"], "max_length": self.config.max_length,
                "examples": len(self.examples), **loss_stats(result), "config": self.config.model_dump(mode="json")}


def train_lm_pruner(texts: list[str], scores: list[float], config: LMPrunerConfig, out_dir: str,
                    val_texts: list[str] = ()) -> dict[str, Any]:
    """LoRA-tune the backbone to regress mastery on Ray Train workers; adapter and `pruner.json` go to `out_dir`.
    Returns the stats, with predictions for `val_texts` under "validation"."""
    if not texts or len(texts) != len(scores):
        raise ValueError(f"need one score per text, at least one: got {len(texts)} texts, {len(scores)} scores")
    if not all(0 <= s <= 1 for s in scores):
        raise ValueError("mastery scores must lie in [0, 1]")
    training = PrunerTraining(pd.DataFrame({"text": list(texts), "score": [float(s) for s in scores]}), config,
                              list(val_texts))
    return fit(training, config, out_dir, "lm-pruner", "zerorag.lm_pruner")


class LMPrunerPredictor:
    """Predicted mastery with a trained LM pruner (adapter merged); `setup()` loads the model once per worker."""

    def __init__(self, model_dir: str, batch_size: int = 64, device: str | None = None, dtype: str = "auto"):
        self.model_dir = model_dir
        self.batch_size = batch_size
        self.device = device
        self.requested_dtype = dtype  # "auto": bf16 where the hardware has it natively

    def setup(self) -> None:
        import torch
        from peft import PeftModel

        meta = json.loads((Path(self.model_dir) / STATS_FILE).read_text())
        self.max_length = int(meta["max_length"])
        self.device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")  # a GPU where there is one
        # The backbone spec, not the resolved source: a GGUF cache folder is local to the training node.
        _, model, self.tokenizer = load_backbone(meta["backbone"], Placement(torch.device("cpu"), torch.float32).load)
        # Merge in fp32, then cast: rounding the merged weights once loses less than merging in bf16.
        model = PeftModel.from_pretrained(model, self.model_dir).merge_and_unload()
        self.dtype = pick_dtype(self.requested_dtype, self.device)
        self.model = model.to(device=self.device, dtype=self.dtype).eval()

    @classmethod
    def of_model(cls, model, tokenizer, max_length: int, batch_size: int, device) -> LMPrunerPredictor:
        """A predictor over a model already in memory (the trained one, on the worker that trained it)."""
        predictor = cls("", batch_size=batch_size, device=device)
        predictor.model, predictor.tokenizer, predictor.max_length = model.eval(), tokenizer, max_length
        return predictor

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
                batch = [ids[i] for i in idx]
                out[idx] = predicted_mastery(self.model, self.tokenizer, batch, self.device).cpu().numpy()
        return out
