"""FAISS index build and the manifest that describes it.

Vectors are normalized, so inner product = cosine and scores from different indices built with the same
embedder are comparable. The build streams embedding shards one file at a time: peak memory is one shard
plus the index, never all vectors at once.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from wbrag_ray.storage import Location

MANIFEST = "manifest.json"
INDEX_FILE = "index.faiss"


class IndexError_(RuntimeError):
    """A missing, corrupt or mismatched index file; the message names the file or the mismatch."""


def vectors_of(table: pa.Table, column: str = "vector") -> np.ndarray:
    """A fixed-size-list (or list) column -> float32 matrix, without a Python loop."""
    col = table[column].combine_chunks()
    if len(col) == 0:
        return np.zeros((0, 0), np.float32)
    flat = col.flatten().to_numpy(zero_copy_only=False)
    return np.ascontiguousarray(flat.reshape(len(col), -1), dtype=np.float32)


def iter_embedding_shards(loc: Location):
    """Yield (file, ids, vectors) for each embedding shard, in file-name order."""
    files = loc.list_files(".parquet")
    if not files:
        raise IndexError_(f"no embedding shards at {loc.uri}; run `wbrag embed RUN` first")
    for f in files:
        try:
            t = pq.read_table(f.path, filesystem=f.fs, columns=["id", "vector"])
        except Exception as exc:  # pyarrow raises several types for truncated / garbage files
            raise IndexError_(f"embedding shard {f.uri} is unreadable: {exc}") from exc
        yield f, t["id"].to_numpy().astype(np.int64), vectors_of(t)


def new_index(factory: str, dim: int):
    import faiss

    try:
        index = faiss.index_factory(dim, factory, faiss.METRIC_INNER_PRODUCT)
    except RuntimeError as exc:
        raise ValueError(f"index.factory {factory!r} is not a valid faiss factory string: {exc}") from None
    if faiss.try_extract_index_ivf(index) is None:
        # Flat and HNSW indices number vectors 0..n-1; an id map keeps our int64 pids / sids.
        index = faiss.IndexIDMap2(index)
    return index


def _train_sample(loc: Location, n: int, seed: int = 0) -> np.ndarray:
    """Up to n vectors drawn evenly from all shards, reading shard by shard."""
    files = loc.list_files(".parquet")
    counts = [pq.ParquetFile(f.path, filesystem=f.fs).metadata.num_rows for f in files]
    total = sum(counts)
    rng = np.random.default_rng(seed)
    parts = []
    for _f, _ids, vecs in iter_embedding_shards(loc):
        take = min(len(vecs), int(np.ceil(n * len(vecs) / max(total, 1))))
        parts.append(vecs[rng.choice(len(vecs), take, replace=False)] if take < len(vecs) else vecs)
    return np.concatenate(parts)[:n]


def build_index(
    embeddings: Location, out: Location, factory: str, embedder: str, unit: str, train_sample: int = 100_000
) -> dict[str, Any]:
    """Train (once, on a sample) and fill an index from embedding shards; write index.faiss and manifest.json."""
    import faiss

    t0 = time.perf_counter()
    index = None
    dim = None
    count = 0
    id_min, id_max = None, None
    for f, ids, vecs in iter_embedding_shards(embeddings):
        if index is None:
            dim = vecs.shape[1]
            index = new_index(factory, dim)
            if not index.is_trained:
                index.train(_train_sample(embeddings, train_sample))
        elif vecs.shape[1] != dim:
            raise IndexError_(f"embedding shard {f.uri} has dimension {vecs.shape[1]}, the others {dim}")
        index.add_with_ids(vecs, ids)
        count += len(ids)
        if len(ids):
            id_min = int(ids.min()) if id_min is None else min(id_min, int(ids.min()))
            id_max = int(ids.max()) if id_max is None else max(id_max, int(ids.max()))
    out.join(INDEX_FILE).write_bytes(faiss.serialize_index(index).tobytes())
    manifest = {
        "format": 1,
        "factory": factory,
        "dim": dim,
        "metric": "inner_product",
        "embedder": embedder,
        "unit": unit,
        "count": count,
        "id_min": id_min,
        "id_max": id_max,
        "files": [INDEX_FILE],
        "embeddings": embeddings.uri,
    }
    out.join(MANIFEST).write_json(manifest)
    return {"rows_in": count, "rows_out": index.ntotal, "seconds": round(time.perf_counter() - t0, 3), "dim": dim}


def load_index(loc: Location) -> tuple[Any, dict[str, Any]]:
    """(faiss index, manifest) from an index folder; clear errors for missing or corrupt files."""
    import faiss

    man_loc = loc.join(MANIFEST)
    if not man_loc.exists():
        raise IndexError_(f"no index manifest at {man_loc.uri}; build one with `wbrag index RUN`")
    manifest = man_loc.read_json()
    file = loc.join(manifest["files"][0])
    if not file.exists():
        raise IndexError_(f"index file {file.uri} named by {man_loc.uri} is missing")
    try:
        index = faiss.deserialize_index(np.frombuffer(file.read_bytes(), dtype=np.uint8))
    except RuntimeError as exc:
        raise IndexError_(f"index file {file.uri} is corrupt: {str(exc).splitlines()[0]}") from None
    if index.d != manifest["dim"]:
        raise IndexError_(f"index file {file.uri} has dimension {index.d}, its manifest says {manifest['dim']}")
    return index, manifest
