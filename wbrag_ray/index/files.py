"""Index files: embedding shards in, faiss index files and the manifest out, and loading them back. Vectors are
normalized: inner product = cosine, and indices built with one embedder have comparable scores (the union relies on
it). Files go through `Location` (local or s3://); faiss reads and writes bytes or streams, never paths.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from wbrag_ray.storage import Location

MANIFEST = "manifest.json"
TRAINED_FILE = "trained.faiss"
PARTS_DIR = "_parts"
FORMAT = 2


class IndexError_(RuntimeError):
    """A missing, corrupt or mismatched index file; the message names the file or the mismatch."""


# --- embedding shards -----------------------------------------------------------------------------------


def vectors_of(table: pa.Table, column: str = "vector") -> np.ndarray:
    """A fixed-size-list (or list) column of float16 or float32 -> float32 matrix, without a Python loop."""
    col = table[column].combine_chunks()
    if len(col) == 0:
        return np.zeros((0, 0), np.float32)
    flat = col.flatten().to_numpy(zero_copy_only=False)
    return np.ascontiguousarray(flat.reshape(len(col), -1), dtype=np.float32)


ID_COLUMNS = ("id", "pid", "sid")


def embedding_files(loc: Location) -> list[Location]:
    files = loc.list_files(".parquet")
    if not files:
        raise IndexError_(f"no embedding shards at {loc.uri}; run `wbrag embed RUN` first")
    return files


def read_embedding_shard(f: Location) -> tuple[np.ndarray, np.ndarray]:
    """(ids int64, vectors float32) of one embedding shard; an unreadable file is named in the error."""
    try:
        names = pq.ParquetFile(f.path, filesystem=f.fs).schema_arrow.names
        # The id column keeps the unit's name (pid / sid) through the embed pipeline: Ray's row-level
        # checkpointing follows one id column from read to write.
        id_col = next((c for c in ID_COLUMNS if c in names), "id")
        t = pq.read_table(f.path, filesystem=f.fs, columns=[id_col, "vector"])
    except Exception as exc:  # pyarrow raises several types for truncated / garbage / missing files
        raise IndexError_(f"embedding shard {f.uri} is unreadable: {exc}") from exc
    return t[id_col].to_numpy().astype(np.int64), vectors_of(t)


def sample_vectors(files: list[Location], counts: list[int], n: int, dim: int,
                   seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(ids, vectors) of n vectors drawn from shards chosen at random (the corpus order groups topics), each shard
    read alone, into one preallocated array."""
    rng = np.random.default_rng(seed)
    total = sum(counts)
    n = min(n, total)
    # Read whole shards until twice the sample is covered, then take an even fraction of each.
    order, covered, chosen = rng.permutation(len(files)), 0, []
    for i in order:
        chosen.append(i)
        covered += counts[i]
        if covered >= min(total, 2 * n):
            break
    ids, sample = np.empty(n, np.int64), np.empty((n, dim), np.float32)
    filled = 0
    for i in sorted(chosen):
        if filled == n:
            break
        shard_ids, vecs = read_embedding_shard(files[i])
        take = min(len(vecs), math.ceil(n * len(vecs) / max(covered, 1)), n - filled)
        rows = rng.choice(len(vecs), take, replace=False) if take < len(vecs) else slice(None)
        ids[filled:filled + take], sample[filled:filled + take] = shard_ids[rows], vecs[rows]
        filled += take
        del vecs
    return ids[:filled], sample[:filled]


def shards_rows(files: list[Location], threads: int = 32) -> list[int]:
    """Every shard's row count from its Parquet footer, `threads` footers in flight at once (a round trip each to
    object storage)."""
    def rows(f: Location) -> int:
        try:
            return f.num_rows()
        except Exception as exc:
            raise IndexError_(f"embedding shard {f.uri} is unreadable: {exc}") from exc

    with ThreadPoolExecutor(max(1, min(threads, len(files)))) as pool:
        return list(pool.map(rows, files))


def vector_field(f: Location) -> pa.Field:
    """The `vector` column of one shard, from its schema (dtype; dimension of a fixed-size list)."""
    try:
        return pq.read_schema(f.path, filesystem=f.fs).field("vector")
    except Exception as exc:
        raise IndexError_(f"embedding shard {f.uri} is unreadable: {exc}") from exc


def shard_dim(f: Location) -> int:
    """The vector dimension of one shard."""
    field = vector_field(f)
    if pa.types.is_fixed_size_list(field.type):
        return field.type.list_size
    _ids, vecs = read_embedding_shard(f)  # variable-size lists: look at the rows
    return vecs.shape[1]


# --- faiss objects --------------------------------------------------------------------------------------


def new_index(factory: str, dim: int):
    """An empty inner-product index from a factory string; ids are always our int64 pids / sids."""
    import faiss

    try:
        index = faiss.index_factory(dim, factory, faiss.METRIC_INNER_PRODUCT)
    except RuntimeError as exc:
        raise ValueError(f"index.factory {factory!r} is not a valid faiss factory string: {exc}") from None
    # IVF indices (bare or behind a pre-transform such as OPQ) store given ids; every other type numbers
    # vectors 0..n-1, so an id map keeps our ids (it also merges, as the inner index does).
    inner = faiss.downcast_index(index.index) if isinstance(index, faiss.IndexPreTransform) else index
    if not isinstance(inner, faiss.IndexIVF):
        index = faiss.IndexIDMap2(index)
    return index


def to_bytes(index) -> bytes:
    import faiss

    return faiss.serialize_index(index).tobytes()


def from_bytes(data: bytes, what: str):
    """Deserialize an index; `what` (a file URI) is named when the bytes are not an index."""
    import faiss

    try:
        return faiss.deserialize_index(np.frombuffer(data, dtype=np.uint8))
    except RuntimeError as exc:
        raise IndexError_(f"index file {what} is corrupt: {str(exc).splitlines()[0]}") from None


def read_index_file(f: Location, named_by: str | None = None):
    """Stream an index file into faiss (no second copy of it in memory); errors name the file."""
    import faiss

    if not f.exists():
        by = f" named by {named_by}" if named_by else ""
        raise IndexError_(f"index file {f.uri}{by} is missing")
    with f.fs.open_input_stream(f.path) as stream:
        try:
            return faiss.read_index(faiss.PyCallbackIOReader(stream.read))
        except RuntimeError as exc:
            raise IndexError_(f"index file {f.uri} is corrupt: {str(exc).splitlines()[0]}") from None


def write_index_file(index, f: Location) -> int:
    """Stream an index into a file, piece by piece (a shard is never held twice); the bytes written."""
    import faiss

    with f.open_write() as stream:
        faiss.write_index(index, faiss.PyCallbackIOWriter(stream.write))
        return stream.tell()


def can_merge(index) -> bool:
    """Whether faiss can merge two filled copies of this (trained, empty) index (IVF, flat codes; not HNSW or
    refine), asked of faiss on two empty copies."""
    a, b = from_bytes(to_bytes(index), "(copy)"), from_bytes(to_bytes(index), "(copy)")
    try:
        a.merge_from(b, 0)
    except RuntimeError:
        return False
    return True


# --- loading --------------------------------------------------------------------------------------------


def load_manifest(loc: Location) -> dict[str, Any]:
    man_loc = loc.join(MANIFEST)
    if not man_loc.exists():
        raise IndexError_(f"no index manifest at {man_loc.uri}; build one with `wbrag index RUN`")
    try:
        manifest = man_loc.read_json()
    except ValueError as exc:
        raise IndexError_(f"index manifest {man_loc.uri} is not valid JSON: {exc}") from None
    missing = [k for k in ("dim", "embedder", "shards", "embeddings") if k not in manifest]
    if missing:
        raise IndexError_(f"index manifest {man_loc.uri} lacks {missing}; rebuild the index with `wbrag index RUN`")
    return manifest


def load_shard(loc: Location, name: str, dim: int, count: int) -> Any:
    """One index shard of the folder `loc`, checked against what its manifest says of it."""
    f = loc.join(name)
    index = read_index_file(f, loc.join(MANIFEST).uri)
    if index.d != dim:
        raise IndexError_(f"index file {f.uri} has dimension {index.d}, its manifest says {dim}")
    if index.ntotal != count:
        raise IndexError_(f"index file {f.uri} holds {index.ntotal} vectors, its manifest says {count}")
    return index


def named_shards(manifest: dict[str, Any]) -> list[tuple[str, int]]:
    """(file, vector count) of each shard a manifest names."""
    return [(s["file"], s["count"]) for s in manifest["shards"]]
