"""Synthetic embedding shards for the index tests: normalized vectors, sparse ids, one Parquet file per part."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from wbrag_ray.config import IndexConfig
from wbrag_ray.formats import embeddings_table


def clustered(n: int, dim: int, clusters: int = 20, seed: int = 0, spread: float = 0.3) -> np.ndarray:
    """Unit vectors around `clusters` random centres: the shape real sentence embeddings have, and where an
    IVF index's cells mean something (uniform random vectors make every IVF look bad)."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(clusters, dim))
    vecs = centres[rng.integers(clusters, size=n)] + spread * rng.normal(size=(n, dim))
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    return vecs.astype(np.float32)


def write_shards(folder: Path, vecs: np.ndarray, ids: np.ndarray | None = None, parts: int = 3,
                 dtype=np.float32) -> np.ndarray:
    """Write vectors as `parts` embedding shards (emb-NNNNNN.parquet) in `dtype`; return the ids (sparse by
    default, as ingest makes them)."""
    ids = np.arange(len(vecs), dtype=np.int64) * 1000 + 7 if ids is None else ids
    folder.mkdir(parents=True, exist_ok=True)
    for k, (i, v) in enumerate(zip(np.array_split(ids, parts), np.array_split(vecs, parts), strict=True)):
        pq.write_table(embeddings_table(i, v.astype(dtype)), folder / f"emb-{k:06d}.parquet")
    return ids


def exact_top_k(queries: np.ndarray, vecs: np.ndarray, ids: np.ndarray, k: int) -> np.ndarray:
    return ids[np.argsort(-(queries @ vecs.T), axis=1, kind="stable")[:, :k]]


def recall_at(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.mean([len(set(g) & set(w)) / len(w) for g, w in zip(got, want, strict=True)]))


def index_config(factory: str, **settings) -> IndexConfig:
    """`build_index`'s settings for a test: `factory` and `settings` over the defaults, on CPUs and without a recall
    measurement; not validated, so a test can hand the build a value the config would refuse."""
    return IndexConfig.model_construct(**{**IndexConfig().model_dump(), "gpu": False, "target_recall": None,
                                          "factory": factory, **settings})
