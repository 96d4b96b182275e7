"""How big a model is, and how much memory an actor that holds it takes (`MEMORY_RULE`), without loading it.

The shape comes, in this order, from a local folder's config.json, a GGUF file's header, the Hugging Face cache's
config.json, a table of the models the project's configs name, or a size in the name ("70B", "135M"); each says
which, since the last two are estimates.
"""

from __future__ import annotations

import functools
import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from wbrag_ray.config import ConfigError
from wbrag_ray.index.sizing import TASK_BASE_BYTES
from wbrag_ray.models.bundled import bundled_path
from wbrag_ray.storage import resolve

GB = 1e9
SERVING_HEADROOM = 0.2
TRAINING_HEADROOM = 0.3
BASE_GB = TASK_BASE_BYTES / GB


@dataclass(frozen=True)
class ModelSize:
    """What a plan knows of a model: parameters, hidden size, attention heads, where the figures came from, and for
    a decoder what sizes its KV cache (layers, key-value heads, head dimension), where known."""

    name: str
    params: float | None
    hidden: int | None = None
    heads: int | None = None
    source: str = "unknown"
    layers: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    context: int | None = None  # the positions it was trained for (max_position_embeddings, GGUF context_length)

    def tensor_parallel_refusal(self, tp: int) -> str | None:
        """Why vLLM cannot shard this model's attention over `tp` ranks, or None (also where its heads are unknown):
        as vLLM's QKVParallelLinear, `tp` divides the attention heads, and divides the key-value heads or is a
        multiple of them."""
        if tp <= 1 or not self.heads:
            return None
        if self.heads % tp:
            return f"its {self.heads} attention heads do not split evenly over {tp} ranks"
        kv = self.kv_heads or self.heads
        if (kv % tp if tp < kv else tp % kv):
            return (f"its {kv} key-value heads neither split evenly over {tp} ranks nor repeat evenly on them "
                    f"({'a multiple' if tp > kv else 'a divisor'} of {kv} would)")
        return None

    def tensor_parallel_sizes(self, most: int = 64) -> list[int]:
        """The tensor-parallel sizes up to `most` that vLLM can shard this model over (`tensor_parallel_refusal`)."""
        return [tp for tp in range(1, most + 1) if self.tensor_parallel_refusal(tp) is None]

    def kv_bytes_per_token(self, bytes_per_value: int = 2) -> float | None:
        """Bytes of KV cache one token takes in every layer, or None where the layout is unknown."""
        if not (self.layers and self.kv_heads and self.head_dim):
            return None
        return 2.0 * self.layers * self.kv_heads * self.head_dim * bytes_per_value

    def describe(self) -> str:
        if self.params is None:
            return f"{self.name} (size unknown)"
        return f"{self.name} ({param_count(self.params)} parameters, {self.source})"


# The models the project's configs and docs name: (parameters, hidden size, attention heads), and for decoders
# (layers, key-value heads, head dimension) from their config.json files (KV cache sizing)
KNOWN: dict[str, tuple] = {
    "meta-llama/llama-3.3-70b-instruct": (70.6e9, 8192, 64, 80, 8, 128),
    "meta-llama/llama-3.1-70b-instruct": (70.6e9, 8192, 64, 80, 8, 128),
    "meta-llama/llama-3.1-8b-instruct": (8.03e9, 4096, 32, 32, 8, 128),
    "meta-llama/llama-3.1-8b": (8.03e9, 4096, 32, 32, 8, 128),
    "meta-llama/llama-3.2-1b": (1.24e9, 2048, 32, 16, 8, 64),
    "meta-llama/llama-3.2-1b-instruct": (1.24e9, 2048, 32, 16, 8, 64),
    "google/gemma-3-12b-it": (12.2e9, 3840, 16, 48, 8, 256),
    "google/gemma-3-270m": (268e6, 640, 4, 18, 1, 256),
    "huggingfacetb/smollm2-135m-instruct": (134.5e6, 576, 9, 30, 3, 64),
    "bundled:smollm2": (134.5e6, 576, 9, 30, 3, 64),
    "intfloat/e5-base-v2": (109.5e6, 768, 12),
    "intfloat/e5-large-v2": (335e6, 1024, 16),
    # its config.json (hidden_size 1024, 24 layers, a gated MLP of 4096: 434M) and its sentence-transformers
    # Dense layer 2_Dense_1024 (1024 -> 1024), the hub repository's files: 1024-d vectors
    "novasearch/stella_en_400m_v5": (434e6, 1024, 16),
    "sentence-transformers/all-minilm-l6-v2": (22.7e6, 384, 12),
    "bundled:all-minilm-l6-v2": (22.7e6, 384, 12),
}

_SIZE_IN_NAME = re.compile(r"(?<![\d.])(\d+(?:\.\d+)?)\s*([bm])(?![a-z])", re.IGNORECASE)
_BERT_LIKE = {"bert", "roberta", "xlm-roberta", "mpnet", "distilbert", "electra"}  # two MLP matrices, not three


def model_size(model: str) -> ModelSize:
    """The size of `model` (a local folder, a GGUF file, an s3:// folder, a hub id or bundled:*)."""
    model = model.removeprefix("file://")
    for read, source in ((_folder_config, "from its config.json"), (_gguf_metadata, "from its GGUF metadata"),
                         (_cached_hub_config, "from its cached config.json")):
        try:
            cfg = read(model)
            if cfg is not None:
                return size_from_config(model, cfg, source)
        except (ValueError, KeyError, TypeError, OSError):
            pass  # an unusual layout: as its name says
    key = model.lower().rstrip("/")
    for known, (params, hidden, heads, *layout) in KNOWN.items():
        if key == known or key.endswith("/" + known.split("/")[-1]):
            return ModelSize(model, params, hidden, heads, "known model", *(layout or (None,) * 3))
    match = _SIZE_IN_NAME.search(model.rstrip("/").rsplit("/", 1)[-1])
    if match:
        params = float(match.group(1)) * (1e9 if match.group(2).lower() == "b" else 1e6)
        return ModelSize(model, params, None, None, f"estimated from '{match.group(0)}' in the name")
    return ModelSize(model, None)


def size_from_config(model: str, cfg: dict, source: str) -> ModelSize:
    """The size and shape of `model` from its transformers config (`cfg`, read from `source`): embeddings (twice
    when untied), each layer's attention (k and v at the key-value heads) and MLP (two matrices for BERT-likes)."""
    text = cfg.get("text_config") or cfg  # multimodal configs (Gemma 3) nest the language model's
    hidden = int(text["hidden_size"])
    layers = int(text["num_hidden_layers"])
    heads = int(text["num_attention_heads"])
    kv_heads = int(text.get("num_key_value_heads") or heads)
    head_dim = int(text.get("head_dim") or hidden // heads)
    inter = int(text.get("intermediate_size") or 4 * hidden)
    attention = hidden * head_dim * 2 * (heads + kv_heads)
    mlp = (2 if cfg.get("model_type") in _BERT_LIKE else 3) * hidden * inter
    tied = text.get("tie_word_embeddings", cfg.get("tie_word_embeddings", True))
    embeddings = int(text["vocab_size"]) * hidden * (1 if tied else 2)
    params = float(layers * (attention + mlp) + embeddings)
    return ModelSize(model, params, hidden, heads, source, layers, kv_heads, head_dim, context=_context(text))


# RoPE scalings whose max_position_embeddings is already the scaled context (vLLM's `_get_and_verify_max_len`,
# vllm/config/model.py, multiplies the others' by their factor, and takes Gemma 3's as it is)
_SCALED_ALREADY = {"default", "su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling"}


def _context(text: dict) -> int | None:
    """The tokens a decoder reads at once, as vLLM derives its longest max_model_len from a config."""
    positions = text.get("max_position_embeddings")
    if not positions:
        return None
    rope = text.get("rope_scaling") or text.get("rope_parameters") or {}
    kind = rope.get("rope_type") or rope.get("type") or "default"
    factor = rope.get("factor") if isinstance(rope, dict) and kind not in _SCALED_ALREADY else None
    scaled = "gemma3" not in str(text.get("model_type", "")) and factor
    return int(positions * float(factor)) if scaled else int(positions)


def _folder_config(model: str) -> dict | None:
    """The config.json of a model folder, local or on object storage."""
    if "://" in model:
        return _stored_config(model)
    path = Path(model) / "config.json"
    return json.loads(path.read_text()) if path.is_file() else None


@functools.lru_cache(maxsize=32)
def _stored_config(model: str) -> dict | None:
    """The config.json of a model folder on object storage, read once per process (every pass checks the shape)."""
    try:
        return resolve(model).join("config.json").read_json()
    except (OSError, ValueError):  # none there, or unreachable (ConfigError is a ValueError): the engine will say
        return None


def _gguf_metadata(model: str) -> dict | None:
    """The config of the GGUF file `model` names (a path, or a bundled model that is one), if any."""
    if model.startswith("bundled:"):
        try:
            path = bundled_path(model.split(":", 1)[1])
        except ConfigError:  # not installed here: the table of known models has it
            return None
    else:
        path = Path(model).expanduser()
    if path.suffix != ".gguf" or not path.is_file():
        return None
    return _gguf_config(str(path), path.stat().st_mtime_ns)


# GGUF's value types (its specification, ggml's docs/gguf.md): the struct format of each scalar type, by its code
_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


@functools.lru_cache(maxsize=16)
def _gguf_config(path: str, _mtime_ns: int) -> dict:
    """A transformers-style config from a GGUF file's header (version 2 or later): its key-value metadata and
    tensor names, skipping the weights and the tokenizer that the `gguf` package's reader parses (RESULTS.md)."""
    with open(path, "rb") as f:
        def read(fmt: str):
            data = f.read(struct.calcsize(fmt))
            if len(data) < struct.calcsize(fmt):
                raise ValueError(f"{path}: its GGUF header ends early")
            return struct.unpack(fmt, data)[0]

        def string() -> str:
            return f.read(read("<Q")).decode("utf-8", "replace")

        def value(kind: int):
            if kind == _GGUF_STRING:
                return string()
            if kind != _GGUF_ARRAY:
                return read(_GGUF_SCALARS[kind])
            item, count = read("<I"), read("<Q")
            if item == _GGUF_STRING:
                for _ in range(count):  # skipped: only how many there are is used (the vocabulary's size)
                    f.seek(read("<Q"), 1)
            elif item == _GGUF_ARRAY:
                raise ValueError("nested GGUF arrays")
            else:
                f.seek(count * struct.calcsize(_GGUF_SCALARS[item]), 1)
            return [count]  # an array stands for its length

        if f.read(4) != b"GGUF" or read("<I") < 2:
            raise ValueError(f"{path}: not a GGUF file of version 2 or later")
        tensors, kvs = read("<Q"), read("<Q")
        meta = {}
        for _ in range(kvs):
            key = string()
            meta[key] = value(read("<I"))
        names = set()
        for _ in range(tensors):
            names.add(string())
            f.seek(read("<I") * 8 + 4 + 8, 1)  # dimensions, type, offset
    arch = meta["general.architecture"]

    def get(name: str):
        found = meta.get(f"{arch}.{name}")
        return found[0] if isinstance(found, list) else found

    heads = get("attention.head_count")
    return {"model_type": arch, "hidden_size": get("embedding_length"), "num_hidden_layers": get("block_count"),
            "num_attention_heads": heads, "num_key_value_heads": get("attention.head_count_kv") or heads,
            "head_dim": get("attention.key_length"), "intermediate_size": get("feed_forward_length"),
            "vocab_size": get("vocab_size") or meta.get("tokenizer.ggml.tokens", [None])[0],
            "max_position_embeddings": get("context_length"), "tie_word_embeddings": "output.weight" not in names}


@functools.lru_cache(maxsize=64)
def _cached_hub_config(model: str) -> dict | None:
    """The config.json of a hub id in this machine's Hugging Face cache (no network), or None."""
    if model.count("/") != 1 or model.startswith(("/", ".", "~")) or ":" in model or Path(model).exists():
        return None
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(model, "config.json")
    return json.loads(Path(found).read_text()) if isinstance(found, str) else None


def embedding_dim(model: str, size: ModelSize) -> tuple[int | None, str]:
    """(a sentence-transformers model's vector dimension, its source): a local folder's last Dense module's or its
    pooling's (modules.json), else the hidden size."""
    folder = Path(model)
    if "://" not in model and (folder / "modules.json").is_file():
        try:
            modules = json.loads((folder / "modules.json").read_text())
            for m in reversed(modules):
                cfg = folder / m.get("path", "") / "config.json"
                if m.get("type", "").endswith("Dense") and cfg.is_file():
                    return int(json.loads(cfg.read_text())["out_features"]), f"its {m['path']} layer"
                if m.get("type", "").endswith("Pooling") and cfg.is_file():
                    return int(json.loads(cfg.read_text())["word_embedding_dimension"]), f"its {m['path']} config"
        except (ValueError, KeyError, TypeError, OSError):
            pass
    return size.hidden, ("its hidden size" if size.hidden else "unknown")


def lora_params(size: ModelSize, r: int, targets: list[str]) -> float:
    """Trainable parameters of LoRA at rank `r` on `targets` in every layer: r x (inputs + outputs) a module (k, v
    to the key-value heads; modules other than q, k, v, o taken as hidden -> hidden)."""
    hidden = size.hidden or 4096
    head_dim = size.head_dim or hidden // max(1, size.heads or 32)
    widths = {"q_proj": (size.heads or 32) * head_dim, "o_proj": (size.heads or 32) * head_dim,
              "k_proj": (size.kv_heads or size.heads or 32) * head_dim,
              "v_proj": (size.kv_heads or size.heads or 32) * head_dim}
    return float((size.layers or 32) * sum(r * (hidden + widths.get(t, hidden)) for t in targets))


def weights_gb(size: ModelSize, dtype: str, on_gpu: bool) -> float | None:
    # auto: bf16 on GPUs; fp32 assumed on CPUs (bf16 only where native)
    per_param = {"float32": 4, "bfloat16": 2}.get(dtype, 2 if on_gpu else 4)
    return None if size.params is None else size.params * per_param / GB


def serving_gb(size: ModelSize, dtype: str, on_gpu: bool) -> float | None:
    """Memory of one model-serving actor (all its GPUs together on a GPU; host memory on a CPU)."""
    w = weights_gb(size, dtype, on_gpu)
    return None if w is None else w * (1 + SERVING_HEADROOM) + (0.0 if on_gpu else BASE_GB)


def training_gb(size: ModelSize, on_gpu: bool) -> float | None:
    """Memory of one LoRA training worker (bf16 weights on GPUs, fp32 on CPU, as the trainings load them)."""
    w = weights_gb(size, "auto", on_gpu)
    return None if w is None else w * (1 + TRAINING_HEADROOM) + (0.0 if on_gpu else BASE_GB)


def param_count(n: float) -> str:
    return f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M"


MEMORY_RULE = (f"memory per actor = parameters x 2 bytes (bf16, GPU) or 4 bytes (fp32, CPU) + {SERVING_HEADROOM:.0%} "
               f"for the KV cache and activations ({TRAINING_HEADROOM:.0%} for a LoRA training worker), + "
               f"{BASE_GB:.1f} GB of process on CPU")
