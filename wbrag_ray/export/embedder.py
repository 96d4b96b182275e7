"""The embedder as the export's readers need it: its manifest entry, and a loaded one for the adapters."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from wbrag_ray.config import EmbedderConfig
from wbrag_ray.models.embedder import Embedder

MANIFEST_FILE = "wbrag_export.json"  # an export's view, counts and embedder; written last: the export is complete


def embedder_info(config: EmbedderConfig, dim: int) -> dict[str, Any]:
    """The embedder's name, source, prefixes, pooling and input length: what a reader needs to embed queries."""
    embedder = Embedder(config)  # resolves the model; nothing is loaded
    pooling, max_length = _sentence_transformers_settings(embedder.source)
    prompts = (_local_json(embedder.source, "config_sentence_transformers.json") or {}).get("prompts") or {}
    return {
        "name": config.model,
        "path": embedder.source,
        "query_prefix": prompts.get(config.query_prompt, "") if config.query_prompt
        else "query: " if embedder.e5 else "",
        "query_prompt": config.query_prompt,
        "passage_prefix": "passage: " if embedder.e5 else "",
        "dim": dim,
        "normalized": True,
        "pooling": pooling,
        "max_seq_length": config.max_seq_length or max_length,
    }


def _local_json(source: str, *names: str) -> Any:
    """A JSON file of a local sentence-transformers folder; None where unreadable (a hub id)."""
    try:
        return json.loads(Path(source, *names).read_text())
    except (OSError, ValueError):
        return None


def _sentence_transformers_settings(source: str) -> tuple[str, int | None]:
    """(pooling, max_seq_length) from a local sentence-transformers folder; ('mean', None) where unreadable."""
    path = next((m.get("path") for m in _local_json(source, "modules.json") or []
                 if m.get("type", "").endswith("Pooling")), None)
    pooling = _local_json(source, path, "config.json") if path is not None else None
    settings = _local_json(source, "sentence_bert_config.json")
    if pooling is None or settings is None:
        return "mean", None
    return "cls" if pooling.get("pooling_mode_cls_token") else "mean", settings.get("max_seq_length")


def load_embedder(spec: str | EmbedderConfig | Any, folder: str | None = None):
    """A loaded `Embedder` from a model spec (a path, hub id or bundled:*), an EmbedderConfig, or an Embedder;
    None: the embedder the export in `folder` names in its manifest."""
    if spec is None:
        spec = json.loads((Path(folder) / MANIFEST_FILE).read_text())["embedder"]["name"]
    if isinstance(spec, Embedder):
        return spec
    config = spec if isinstance(spec, EmbedderConfig) else EmbedderConfig(model=str(spec), dtype="float32")
    embedder = Embedder(config)
    embedder.setup()
    return embedder
