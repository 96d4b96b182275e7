"""The embedder as the export's readers need it: its manifest entry, and a loaded one for the adapters."""

from __future__ import annotations

import json
from typing import Any

from wbrag_ray.config import EmbedderConfig


def embedder_info(config: EmbedderConfig, dim: int) -> dict[str, Any]:
    """The embedder's name, source, prefixes, pooling and input length: what a reader needs to embed queries."""
    from wbrag_ray.models.embedder import Embedder

    embedder = Embedder(config)  # resolves the model; nothing is loaded
    pooling, max_length = _sentence_transformers_settings(embedder.source)
    return {
        "name": config.model,
        "path": embedder.source,
        "query_prefix": _query_prompt(embedder.source, config.query_prompt) if config.query_prompt
        else "query: " if embedder.e5 else "",
        "query_prompt": config.query_prompt,
        "passage_prefix": "passage: " if embedder.e5 else "",
        "dim": dim,
        "normalized": True,
        "pooling": pooling,
        "max_seq_length": config.max_seq_length or max_length,
    }


def _query_prompt(source: str, name: str) -> str:
    """The text of prompt `name` from a local sentence-transformers folder; empty where unreadable (a hub id)."""
    from pathlib import Path

    try:
        return json.loads((Path(source) / "config_sentence_transformers.json").read_text())["prompts"][name]
    except (OSError, KeyError, ValueError):
        return ""


def _sentence_transformers_settings(source: str) -> tuple[str, int | None]:
    """(pooling, max_seq_length) from a local sentence-transformers folder; ('mean', None) where unreadable."""
    from pathlib import Path

    folder = Path(source)
    pooling, max_length = "mean", None
    try:
        modules = json.loads((folder / "modules.json").read_text())
        path = next(m["path"] for m in modules if m["type"].endswith("Pooling"))
        conf = json.loads((folder / path / "config.json").read_text())
        pooling = "cls" if conf.get("pooling_mode_cls_token") else "mean"
        max_length = json.loads((folder / "sentence_bert_config.json").read_text()).get("max_seq_length")
    except (OSError, StopIteration, KeyError, ValueError):
        pass
    return pooling, max_length


def load_embedder(spec: str | EmbedderConfig | Any):
    """A loaded `Embedder` from a model spec (a path, hub id or bundled:*), an EmbedderConfig, or an Embedder."""
    from wbrag_ray.models.embedder import Embedder

    if isinstance(spec, Embedder):
        return spec
    config = spec if isinstance(spec, EmbedderConfig) else EmbedderConfig(model=str(spec), dtype="float32")
    embedder = Embedder(config)
    embedder.setup()
    return embedder
