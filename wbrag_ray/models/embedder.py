"""The embedder: sentence-transformers, normalized vectors, e5 prefixes or the model's own query prompt."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from wbrag_ray.config import ConfigError, EmbedderConfig
from wbrag_ray.models.bundled import resolve_model
from wbrag_ray.models.hardware import pick_device, pick_dtype

log = logging.getLogger(__name__)

# Config keys whose remote code (stella_en_400M_v5's, Alibaba-NLP/new-impl) asserts that xformers is installed.
XFORMERS_KEYS = ("use_memory_efficient_attention", "unpad_inputs")


def xformers_imports() -> bool:
    try:
        import xformers.ops  # noqa: F401
    except Exception:  # noqa: BLE001 - a build for another torch or CUDA fails with any error: not importable
        return False
    return True


def model_config(config: EmbedderConfig, source: str, **kwargs: Any):
    """The model's transformers config (a local folder, the hub cache or the hub), as the embedder loads it; a
    ConfigError in one line where it cannot be read (not cached and no network, remote code not trusted)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(source, trust_remote_code=config.trust_remote_code, **kwargs)
    except (OSError, ValueError) as exc:
        why = next((line.strip().rstrip(".") for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        hint = "" if Path(source).exists() else (
            f"; without network, download it where there is one (`hf download {source}`) into this node's hub "
            "cache (HF_HOME), or name a local or s3:// copy")
        raise ConfigError(f"embedder.model {config.model}: its config cannot be read: {why}{hint}") from None


def load_kwargs(config: EmbedderConfig, source: str) -> tuple[dict[str, Any], str | None]:
    """The config_kwargs the model loads with: embedder.config_kwargs, and where the model's config asks for
    xformers' memory-efficient attention or unpadding and xformers does not import, both turned off (those the
    user did not set); with the line that says so (None where nothing was turned off)."""
    kwargs = dict(config.config_kwargs)
    if Path(source).is_dir() and not (Path(source) / "config.json").exists():
        return kwargs, None  # no transformers config at its top (a module layout of its own): nothing to decide
    asked = model_config(config, source, **kwargs)
    off = [k for k in XFORMERS_KEYS if k not in kwargs]
    if not off or not any(getattr(asked, k, False) for k in XFORMERS_KEYS) or xformers_imports():
        return kwargs, None
    kwargs.update(dict.fromkeys(off, False))
    return kwargs, (f"embedder {config.model}: its config asks for xformers' memory-efficient attention / unpadding "
                    f"and xformers does not import here: loaded with {', '.join(f'{k}=False' for k in off)} "
                    "(standard attention; embedder.config_kwargs sets them)")


def needs_e5_prefixes(model: str) -> bool:
    """e5 models were trained with 'query: ' / 'passage: ' prefixes and lose quality without them."""
    name = model.lower().rstrip("/").rsplit("/", 1)[-1]
    return name.startswith(("e5-", "multilingual-e5")) or "-e5-" in name


class Embedder:
    """`setup()` loads the model once per worker; `encode_passages` / `encode_queries` return float32 rows."""

    def __init__(self, config: EmbedderConfig):
        self.config = config
        self.source = resolve_model(config.model)
        self.e5 = needs_e5_prefixes(config.model) or needs_e5_prefixes(self.source)
        self.model = None

    def setup(self) -> None:
        from sentence_transformers import SentenceTransformer

        device = pick_device(self.config.num_gpus)
        kwargs, said = load_kwargs(self.config, self.source)
        if said:
            log.warning(said)
        self.model = SentenceTransformer(self.source, device=device, trust_remote_code=self.config.trust_remote_code,
                                         config_kwargs=kwargs)
        prompt = self.config.query_prompt
        if prompt is not None and prompt not in self.model.prompts:
            raise ConfigError(f"embedder.query_prompt {prompt!r}: {self.config.model} ships no such prompt (its "
                              f"prompts: {', '.join(sorted(self.model.prompts)) or 'none'})")
        dtype = pick_dtype(self.config.dtype, device)
        self.model.to(dtype)
        if self.config.max_seq_length:
            self.model.max_seq_length = self.config.max_seq_length

    @property
    def name(self) -> str:
        return self.config.model

    @property
    def dim(self) -> int:
        self._ensure()
        get_dim = getattr(self.model, "get_embedding_dimension", None) or self.model.get_sentence_embedding_dimension
        return int(get_dim())

    def _ensure(self) -> None:
        if self.model is None:
            self.setup()

    def _encode(self, texts: list[str], prompt_name: str | None = None) -> np.ndarray:
        self._ensure()
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        vecs = self.model.encode(
            texts,
            prompt_name=prompt_name,
            batch_size=self.config.batch_size,
            normalize_embeddings=True,
            convert_to_tensor=True,
            show_progress_bar=False,
        )
        # Normalized again in fp32, so inner products compare across indexes built in different dtypes.
        vecs = vecs.float()
        return (vecs / vecs.norm(dim=1, keepdim=True).clamp_min(1e-12)).cpu().numpy()

    def encode_passages(self, texts: list[str]) -> np.ndarray:
        return self._encode(["passage: " + t for t in texts] if self.e5 else list(texts))

    def encode_queries(self, texts: list[str]) -> np.ndarray:
        if self.config.query_prompt is not None:
            return self._encode(list(texts), prompt_name=self.config.query_prompt)
        return self._encode(["query: " + t for t in texts] if self.e5 else list(texts))
