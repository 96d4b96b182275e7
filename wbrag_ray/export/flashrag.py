"""FlashRAG: corpus.jsonl ("title\\ntext" contents), index.faiss whose row i is line i, and the retriever settings
of a FlashRAG config (flashrag_retriever.yaml)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from wbrag_ray.config import WbragConfig
from wbrag_ray.export.embedder import embedder_info
from wbrag_ray.export.view import Document, View
from wbrag_ray.storage import Location

CORPUS_FILE = "corpus.jsonl"
INDEX_FILE = "index.faiss"
CONFIG_FILE = "flashrag_retriever.yaml"


def write(view: View, batches: Iterator[list[Document]], out: Location, config: WbragConfig) -> list[str]:
    """The corpus, one embedding shard at a time, then the retriever settings; the files' names."""
    import yaml

    with out.join(CORPUS_FILE).open_write() as f:
        for docs in batches:
            lines = (json.dumps({"id": d.id, "contents": d.contents, "metadata": d.metadata}, ensure_ascii=False)
                     for d in docs)
            f.write(("\n".join(lines) + "\n").encode("utf-8"))
    settings = retriever_settings(view, out, config)
    out.join(CONFIG_FILE).write_bytes(yaml.safe_dump(settings, sort_keys=False).encode("utf-8"))
    return [CORPUS_FILE, CONFIG_FILE]


def retriever_settings(view: View, out: Location, config: WbragConfig) -> dict[str, Any]:
    """The FlashRAG config keys that make its dense retriever search this export as `wbrag search` does."""
    embedder = embedder_info(config.embedder, view.dim)
    return {
        "retrieval_method": embedder["name"].rstrip("/").rsplit("/", 1)[-1].removeprefix("bundled:"),
        "retrieval_model_path": embedder["path"],
        "index_path": out.join(INDEX_FILE).uri,
        "corpus_path": out.join(CORPUS_FILE).uri,
        "retrieval_topk": config.retrieval.top_k,
        "retrieval_pooling_method": embedder["pooling"],
        "retrieval_query_max_length": embedder["max_seq_length"] or 512,
        "retrieval_use_fp16": False,
        "use_sentence_transformer": True,
        "instruction": _instruction(embedder["name"], embedder["query_prefix"]),
        "faiss_gpu": False,
    }


def _instruction(model: str, query_prefix: str) -> str | None:
    """FlashRAG's `instruction`: the query prefix; '' where FlashRAG would otherwise guess one from the name."""
    if query_prefix:
        return query_prefix
    name = model.lower()
    return "" if "e5" in name or "bge" in name else None
