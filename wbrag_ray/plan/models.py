"""How big a model is, and how much memory an actor that holds it takes, without loading it.

Parameter counts come, in this order, from the model's config.json when the model is a local folder (exact for
the usual decoder and BERT layouts), from a small table of the hub ids and bundled models the project's configs
name, or from a size in the name ("70B", "1B", "135M"); each says which, since the last two are estimates.

Memory per actor: weights = parameters x bytes per parameter (bf16 on GPUs, fp32 on CPUs: `dtype: auto` takes
bf16 only on CPUs with native bf16, which a plan cannot know), plus `SERVING_HEADROOM` of the weights for the KV
cache and activations of a batch (vLLM then fills what `gpu_memory_utilization` leaves with more KV cache), or
`TRAINING_HEADROOM` for a LoRA training worker (activations kept for the backward pass, the adapter's gradients
and optimizer state). A CPU process adds the worker's own base (`index.sizing.TASK_BASE_BYTES`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from wbrag_ray.index.sizing import TASK_BASE_BYTES

GB = 1e9
SERVING_HEADROOM = 0.2
TRAINING_HEADROOM = 0.3
BASE_GB = TASK_BASE_BYTES / GB


@dataclass(frozen=True)
class ModelSize:
    """What a plan knows of a model: parameters, hidden size (an embedder's vector dimension), attention heads
    (a tensor-parallel group must divide them), and where the figures came from; for a decoder, what sizes its KV
    cache (layers, key-value heads, head dimension), where known."""

    name: str
    params: float | None
    hidden: int | None = None
    heads: int | None = None
    source: str = "unknown"
    layers: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None

    def kv_bytes_per_token(self, bytes_per_value: int = 2) -> float | None:
        """Bytes of KV cache one token takes in every layer (keys and values at the key-value heads), or None
        where the layout is unknown."""
        if not (self.layers and self.kv_heads and self.head_dim):
            return None
        return 2.0 * self.layers * self.kv_heads * self.head_dim * bytes_per_value

    def describe(self) -> str:
        if self.params is None:
            return f"{self.name} (size unknown)"
        return f"{self.name} ({_count(self.params)} parameters, {self.source})"


# (parameters, hidden size, attention heads) of the models the project's configs and docs name; and of the
# decoders, (layers, key-value heads, head dimension) from their config.json files (KV cache sizing)
DECODER_LAYOUT: dict[str, tuple[int, int, int]] = {
    "meta-llama/llama-3.3-70b-instruct": (80, 8, 128),
    "meta-llama/llama-3.1-70b-instruct": (80, 8, 128),
    "meta-llama/llama-3.1-8b-instruct": (32, 8, 128),
    "meta-llama/llama-3.1-8b": (32, 8, 128),
    "meta-llama/llama-3.2-1b": (16, 8, 64),
    "meta-llama/llama-3.2-1b-instruct": (16, 8, 64),
    "google/gemma-3-12b-it": (48, 8, 256),
    "google/gemma-3-270m": (18, 1, 256),
    "huggingfacetb/smollm2-135m-instruct": (30, 3, 64),
    "bundled:smollm2": (30, 3, 64),
}
KNOWN: dict[str, tuple[float, int, int]] = {
    "meta-llama/llama-3.3-70b-instruct": (70.6e9, 8192, 64),
    "meta-llama/llama-3.1-70b-instruct": (70.6e9, 8192, 64),
    "meta-llama/llama-3.1-8b-instruct": (8.03e9, 4096, 32),
    "meta-llama/llama-3.1-8b": (8.03e9, 4096, 32),
    "meta-llama/llama-3.2-1b": (1.24e9, 2048, 32),
    "meta-llama/llama-3.2-1b-instruct": (1.24e9, 2048, 32),
    "google/gemma-3-12b-it": (12.2e9, 3840, 16),
    "google/gemma-3-270m": (268e6, 640, 4),
    "huggingfacetb/smollm2-135m-instruct": (134.5e6, 576, 9),
    "bundled:smollm2": (134.5e6, 576, 9),
    "intfloat/e5-base-v2": (109.5e6, 768, 12),
    "intfloat/e5-large-v2": (335e6, 1024, 16),
    "sentence-transformers/all-minilm-l6-v2": (22.7e6, 384, 12),
    "bundled:all-minilm-l6-v2": (22.7e6, 384, 12),
}

_SIZE_IN_NAME = re.compile(r"(?<![\d.])(\d+(?:\.\d+)?)\s*([bm])(?![a-z])", re.IGNORECASE)
_BERT_LIKE = {"bert", "roberta", "xlm-roberta", "mpnet", "distilbert", "electra"}  # two MLP matrices, not three


def model_size(model: str) -> ModelSize:
    """The size of `model` (a local folder, a GGUF file, an s3:// folder, a hub id or bundled:*)."""
    folder = Path(model)
    if "://" not in model and (folder / "config.json").is_file():
        try:
            cfg = json.loads((folder / "config.json").read_text())
            params, hidden, heads = params_from_config(cfg)
            text = cfg.get("text_config") or cfg
            layout = (int(text["num_hidden_layers"]), int(text.get("num_key_value_heads") or heads),
                      int(text.get("head_dim") or hidden // heads))
            return ModelSize(model, params, hidden, heads, "from its config.json", *layout)
        except (ValueError, KeyError, TypeError, OSError):
            pass  # an unusual layout: fall back to the name
    key = model.lower().rstrip("/")
    for known, (params, hidden, heads) in KNOWN.items():
        if key == known or key.endswith("/" + known.split("/")[-1]):
            return ModelSize(model, params, hidden, heads, "known model", *DECODER_LAYOUT.get(known, (None,) * 3))
    match = _SIZE_IN_NAME.search(model.rstrip("/").rsplit("/", 1)[-1])
    if match:
        params = float(match.group(1)) * (1e9 if match.group(2).lower() == "b" else 1e6)
        return ModelSize(model, params, None, None, f"estimated from '{match.group(0)}' in the name")
    return ModelSize(model, None)


def params_from_config(cfg: dict) -> tuple[float, int, int]:
    """(parameters, hidden size, attention heads) from a transformers config.json: embeddings (twice when the
    output layer is not tied), per layer attention (q and o full, k and v at the key-value heads) and the MLP
    (three matrices for gated decoders, two for BERT-like encoders)."""
    text = cfg.get("text_config") or cfg  # multimodal configs (Gemma 3) nest the language model's
    hidden = int(text["hidden_size"])
    layers = int(text["num_hidden_layers"])
    heads = int(text["num_attention_heads"])
    kv_heads = int(text.get("num_key_value_heads") or heads)
    head_dim = int(text.get("head_dim") or hidden // heads)
    inter = int(text.get("intermediate_size") or 4 * hidden)
    gated = cfg.get("model_type") not in _BERT_LIKE
    attention = hidden * head_dim * 2 * (heads + kv_heads)
    mlp = (3 if gated else 2) * hidden * inter
    tied = text.get("tie_word_embeddings", cfg.get("tie_word_embeddings", True))
    embeddings = int(text["vocab_size"]) * hidden * (1 if tied else 2)
    return float(layers * (attention + mlp) + embeddings), hidden, heads


def bytes_per_param(dtype: str, on_gpu: bool) -> int:
    if dtype == "float32":
        return 4
    if dtype == "bfloat16":
        return 2
    return 2 if on_gpu else 4  # auto: bf16 on GPUs; fp32 assumed on CPUs (bf16 only where native)


def weights_gb(size: ModelSize, dtype: str, on_gpu: bool) -> float | None:
    return None if size.params is None else size.params * bytes_per_param(dtype, on_gpu) / GB


def serving_gb(size: ModelSize, dtype: str, on_gpu: bool) -> float | None:
    """Memory of one model-serving actor (all its GPUs together on a GPU; host memory on a CPU)."""
    w = weights_gb(size, dtype, on_gpu)
    return None if w is None else w * (1 + SERVING_HEADROOM) + (0.0 if on_gpu else BASE_GB)


def training_gb(size: ModelSize, on_gpu: bool) -> float | None:
    """Memory of one LoRA training worker (bf16 weights on GPUs, fp32 on CPU, as the trainings load them)."""
    w = weights_gb(size, "auto", on_gpu)
    return None if w is None else w * (1 + TRAINING_HEADROOM) + (0.0 if on_gpu else BASE_GB)


def _count(n: float) -> str:
    return f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M"


MEMORY_RULE = (f"memory per actor = parameters x 2 bytes (bf16, GPU) or 4 bytes (fp32, CPU) + {SERVING_HEADROOM:.0%} "
               f"for the KV cache and activations ({TRAINING_HEADROOM:.0%} for a LoRA training worker), + "
               f"{BASE_GB:.1f} GB of process on CPU")
