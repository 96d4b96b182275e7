"""The embedder: sentence-transformers, normalized vectors, e5 prefixes or the model's own query prompt."""

from __future__ import annotations

import numpy as np

from wbrag_ray.config import ConfigError, EmbedderConfig
from wbrag_ray.models.bundled import resolve_model
from wbrag_ray.models.hardware import pick_device, pick_dtype


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
        self.model = SentenceTransformer(self.source, device=device, trust_remote_code=self.config.trust_remote_code)
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
