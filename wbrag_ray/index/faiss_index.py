"""Sharded FAISS indices: the build pipeline, the manifest that describes them, and loading.

Vectors are normalized, so inner product = cosine and scores from different indices built with the same
embedder are comparable (the union of a base and a write-back index relies on that).

The build runs in three steps, each bounded by one shard, never by the corpus:
  1. train: one task trains an empty index on a sample of the embedding shards (`trained.faiss`);
  2. add: one task per embedding shard adds that shard's vectors to a copy of the trained empty index and
     writes it as a part (`_parts/part-NNNNNN.faiss`);
  3. merge: one task per index shard merges its parts with faiss `merge_from` (`index-NNNNN.faiss`).
Index types that faiss cannot merge (HNSW graphs, refine wrappers) skip step 3: their add tasks fill one
index shard each, from a group of embedding shards. The tasks are Ray tasks when Ray is initialized and
plain calls in this process otherwise (small jobs, tests, the single-process baseline of the benchmark).

All file access goes through `Location` (local or s3://); faiss reads and writes bytes, never paths.

Over 500 lines, not split yet: build, manifest and loading belong together until issue 15 reworks the
build for 138M vectors (factory and training sample chosen together, shard merges in parallel).
"""

from __future__ import annotations

import logging
import math
import os
import resource
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from wbrag_ray.storage import Location, resolve

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
INDEX_FILE = "index.faiss"  # the file name of a single-shard index (kept for indices built before sharding)
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


def shard_rows(f: Location) -> int:
    """Row count from the Parquet footer: no vectors are read."""
    try:
        return f.num_rows()
    except Exception as exc:
        raise IndexError_(f"embedding shard {f.uri} is unreadable: {exc}") from exc


def iter_embedding_shards(loc: Location) -> Iterator[tuple[Location, np.ndarray, np.ndarray]]:
    """Yield (file, ids, vectors) for each embedding shard, in file-name order."""
    for f in embedding_files(loc):
        yield (f, *read_embedding_shard(f))


def shard_dim(f: Location) -> int:
    """The vector dimension from the schema of one shard (fixed-size lists carry it)."""
    try:
        field = pq.read_schema(f.path, filesystem=f.fs).field("vector")
    except Exception as exc:
        raise IndexError_(f"embedding shard {f.uri} is unreadable: {exc}") from exc
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
    """Stream an index into a file, piece by piece: a shard is never held twice (index + serialized copy).
    Returns the bytes written."""
    import faiss

    with f.open_write() as stream:
        faiss.write_index(index, faiss.PyCallbackIOWriter(stream.write))
        return stream.tell()


def can_merge(index) -> bool:
    """Whether faiss can merge two filled copies of this (trained, empty) index: IVF and flat-code indices
    can, HNSW graphs and refine wrappers cannot. Asked of faiss itself on two empty copies."""
    a, b = from_bytes(to_bytes(index), "(copy)"), from_bytes(to_bytes(index), "(copy)")
    try:
        a.merge_from(b, 0)
    except RuntimeError:
        return False
    return True


def choose_factory(n: int, dim: int, memory_budget_gb: float) -> str:
    """The factory string `index.factory=auto` picks, autofaiss-style, from the vector count and the memory
    budget of the whole index (all shards, as one search process holds them):

    - n < 20,000: `Flat` (exact search is fast at that size and needs no training);
    - else an IVF with nlist = the power of two nearest 4*sqrt(n) (16*sqrt(n) from 10M vectors on, with an
      HNSW32 coarse quantizer: a flat one is too slow to probe with 2^16+ centroids), at most n/39 (faiss
      wants >= 39 training points per centroid); its codes are the most precise that fit the budget with 10% headroom:
      raw float32 (`Flat`), 8-bit scalar (`SQ8`, 1 byte per dimension), or product quantization `PQm` with
      the largest m that divides dim and fits (m bytes per vector), refined by nothing (a refine step needs
      the raw vectors in memory, which is what the budget ruled out).
    Per-vector overheads counted: 8 bytes of id, plus the code.
    """
    if n < 20_000:
        return "Flat"
    budget = memory_budget_gb * (1 << 30) * 0.9
    big = n >= 10_000_000
    nlist = 2 ** round(math.log2((16 if big else 4) * math.sqrt(n)))
    nlist = max(1, min(nlist, 2 ** int(math.log2(max(1, n // 39)))))
    coarse = f"IVF{nlist}_HNSW32" if big else f"IVF{nlist}"
    per_vector = budget / n - 8
    if per_vector >= 4 * dim:
        return f"{coarse},Flat"
    if per_vector >= dim:
        return f"{coarse},SQ8"
    fitting = [m for m in range(min(dim, int(per_vector)), 0, -1) if dim % m == 0 and m <= 96]
    if not fitting:
        need = n * (8 + 1) / (1 << 30) / 0.9
        raise ValueError(
            f"index.memory_budget_gb={memory_budget_gb} cannot hold {n:,} vectors even at one byte each "
            f"(needs about {need:.1f} GB); raise index.memory_budget_gb or set index.factory explicitly"
        )
    return f"{coarse},PQ{fitting[0]}"


# --- tasks: plain calls here, Ray tasks when Ray is up -------------------------------------------------


def _reset_peak_rss() -> float:
    """Start a task's own peak-memory count (Ray reuses worker processes, whose lifetime peak would
    include earlier tasks); returns the resident MiB at the start (interpreter, faiss, pyarrow)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux: reset VmHWM, the peak resident set size
        return _proc_status_mb("VmRSS")
    except OSError:
        return 0.0


def _proc_status_mb(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise OSError(key)


def _peak_rss_mb() -> float:
    """Peak resident MiB since the last `_reset_peak_rss` (Linux), else since the process started."""
    try:
        return _proc_status_mb("VmHWM")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux and BSD units differ; KiB here


def _run_tasks(fn: Callable[..., Any], shared: Any, items: Sequence[Any], num_cpus: float, parallel: bool) -> list[Any]:
    """fn(shared, item) for every item: Ray tasks (the shared argument put once in the object store) or a
    loop in this process. Errors of ours come back as themselves, so messages stay short and name files."""
    if not parallel:
        return [fn(shared, item) for item in items]
    import ray

    remote = ray.remote(num_cpus=num_cpus, max_retries=2)(fn)
    ref = ray.put(shared)
    refs = [remote.remote(ref, item) for item in items]
    try:
        return ray.get(refs)
    except ray.exceptions.RayTaskError as exc:
        if isinstance(exc.cause, IndexError_ | ValueError):
            raise exc.cause from None
        raise


def _set_threads(threads: int | None) -> None:
    """Ray tasks share the node: each uses the threads it asked Ray for, not every core."""
    if threads:
        import faiss

        faiss.omp_set_num_threads(threads)


def _train_task(shared: dict[str, Any], _item: None) -> tuple[bytes, float]:
    # Training runs alone (the add tasks wait for it): it may use every core of its node.
    _set_threads(shared["threads"] and max(1, os.cpu_count() or 1))
    _reset_peak_rss()
    files = [resolve(u) for u in shared["files"]]
    index = new_index(shared["factory"], shared["dim"])
    if not index.is_trained:
        index.train(_train_sample(files, shared["counts"], shared["train_sample"]))
    return to_bytes(index), _peak_rss_mb()


def _train_sample(files: list[Location], counts: list[int], n: int, seed: int = 0) -> np.ndarray:
    """About n vectors drawn from shards chosen at random, each shard read alone: the corpus order groups
    topics, so shards from all over it make a fair sample without reading every shard."""
    rng = np.random.default_rng(seed)
    total = sum(counts)
    # Read whole shards until twice the sample is covered, then take an even fraction of each.
    order, covered, chosen = rng.permutation(len(files)), 0, []
    for i in order:
        chosen.append(i)
        covered += counts[i]
        if covered >= min(total, 2 * n):
            break
    parts = []
    for i in sorted(chosen):
        _ids, vecs = read_embedding_shard(files[i])
        take = min(len(vecs), math.ceil(n * len(vecs) / max(covered, 1)))
        parts.append(vecs[rng.choice(len(vecs), take, replace=False)] if take < len(vecs) else vecs)
    return np.ascontiguousarray(np.concatenate(parts)[:n])


def _add_task(shared: dict[str, Any], item: tuple[str, list[str]]) -> dict[str, Any]:
    """Add the vectors of some embedding shards to a copy of the trained empty index; write it to `out`."""
    _set_threads(shared["threads"])
    out_uri, file_uris = item
    base_rss = _reset_peak_rss()
    t0 = time.perf_counter()
    index = from_bytes(shared["trained"], TRAINED_FILE)
    drop = shared["drop_ids"]
    count, dropped, id_min, id_max = 0, 0, None, None
    for uri in file_uris:
        f = resolve(uri)
        ids, vecs = read_embedding_shard(f)
        if len(ids) == 0:
            continue
        if vecs.shape[1] != index.d:
            raise IndexError_(f"embedding shard {f.uri} has dimension {vecs.shape[1]}, the index {index.d}")
        if drop is not None:
            keep = ~np.isin(ids, drop, assume_unique=False)
            dropped += int(len(ids) - keep.sum())
            ids, vecs = ids[keep], vecs[keep]
            if len(ids) == 0:
                continue
        index.add_with_ids(vecs, ids)
        count += len(ids)
        id_min = int(ids.min()) if id_min is None else min(id_min, int(ids.min()))
        id_max = int(ids.max()) if id_max is None else max(id_max, int(ids.max()))
        del vecs  # one shard's vectors at a time
    size = write_index_file(index, resolve(out_uri))
    return {"file": out_uri, "count": count, "dropped": dropped, "id_min": id_min, "id_max": id_max,
            "bytes": size, "peak_rss_mb": _peak_rss_mb(), "base_rss_mb": base_rss,
            "seconds": time.perf_counter() - t0}


def _merge_task(shared: dict[str, Any], item: tuple[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Merge parts into one index shard, one part in memory at a time besides the shard itself."""
    _set_threads(shared["threads"])
    out_uri, parts = item
    _reset_peak_rss()
    index = read_index_file(resolve(parts[0]["file"]))
    for part in parts[1:]:
        other = read_index_file(resolve(part["file"]))
        index.merge_from(other, 0)
        del other
    size = write_index_file(index, resolve(out_uri))
    return {"file": out_uri, "count": int(index.ntotal), **_id_range(parts), "bytes": size,
            "dropped": sum(p["dropped"] for p in parts), "peak_rss_mb": _peak_rss_mb()}


def _id_range(parts: list[dict[str, Any]]) -> dict[str, int | None]:
    lows = [p["id_min"] for p in parts if p["id_min"] is not None]
    highs = [p["id_max"] for p in parts if p["id_max"] is not None]
    return {"id_min": min(lows) if lows else None, "id_max": max(highs) if highs else None}


def balanced_groups(counts: Sequence[int], n: int) -> list[list[int]]:
    """Split positions 0..len-1 into min(n, len) contiguous, non-empty groups of about equal total count
    (contiguous keeps each index shard's id range narrow: embedding shards follow corpus order)."""
    n = max(1, min(n, len(counts)))
    total = sum(counts)
    groups: list[list[int]] = [[]]
    done = 0
    for i, c in enumerate(counts):
        if len(groups) < n and groups[-1]:
            # open the next group once this one holds its share, or when only enough items are left to
            # give every remaining group one
            if done >= total * len(groups) / n or len(counts) - i <= n - len(groups):
                groups.append([])
        groups[-1].append(i)
        done += c
    return groups


# --- the build ------------------------------------------------------------------------------------------


def shard_file(i: int, num_shards: int) -> str:
    return INDEX_FILE if num_shards == 1 else f"index-{i:05d}.faiss"


def build_index(
    embeddings: Location,
    out: Location,
    factory: str,
    embedder: str,
    unit: str,
    train_sample: int = 100_000,
    *,
    num_shards: int = 1,
    memory_budget_gb: float = 16.0,
    num_cpus: float = 1.0,
    parallel: bool | None = None,
    trained: bytes | None = None,
    drop_ids: np.ndarray | None = None,
    docs: str | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Build a sharded index from embedding shards into `out` (index shards, trained.faiss, manifest.json).

    factory: any faiss factory string, or "auto" (`choose_factory`). parallel: Ray tasks (default: when Ray
    is initialized) or calls in this process. trained: a trained empty index to reuse instead of training
    (pruned views reuse their source's). drop_ids: ids left out of the index. docs: where the documents of
    the ids live (an ingest folder or a Parquet folder of id, title, text), recorded in the manifest.
    Returns stage stats: counts, seconds per step, peak task memory.
    """
    t0 = time.perf_counter()
    if parallel is None:
        import ray

        parallel = ray.is_initialized()
    files = embedding_files(embeddings)
    counts = [shard_rows(f) for f in files]
    total = sum(counts)
    dim = shard_dim(files[0])
    requested = factory
    if factory.strip().lower() == "auto":
        factory = choose_factory(total, dim, memory_budget_gb)
        log.info("index.factory=auto chose %s for %d x %d vectors", factory, total, dim)
    threads = max(1, int(num_cpus)) if parallel else None
    manifest_loc = out.join(MANIFEST)
    manifest_loc.delete()  # a reader never pairs an old manifest with half-rewritten shards
    if drop_ids is not None:
        drop_ids = np.unique(np.asarray(drop_ids, dtype=np.int64))

    # 1. train once
    task_rss = [0.0]
    if trained is None:
        job = {"files": [f.uri for f in files], "counts": counts, "factory": factory, "dim": dim,
               "train_sample": train_sample, "threads": threads}
        trained, rss = _run_tasks(_train_task, job, [None], num_cpus, parallel)[0]
        task_rss.append(rss)
    trained_index = from_bytes(trained, TRAINED_FILE)
    if trained_index.d != dim:
        raise IndexError_(f"the trained index has dimension {trained_index.d}, the embedding shards at {embeddings.uri} {dim}")
    out.join(TRAINED_FILE).write_bytes(trained)
    t_train = time.perf_counter()

    # 2. add per embedding shard (mergeable types) or per index shard (the others)
    mergeable = can_merge(trained_index)
    del trained_index
    shared = {"trained": trained, "drop_ids": drop_ids, "threads": threads}
    if mergeable:
        parts_dir = out.join(PARTS_DIR)
        items = [(parts_dir.join(f"part-{i:06d}.faiss").uri, [f.uri]) for i, f in enumerate(files)]
    else:
        groups = balanced_groups(counts, num_shards)
        items = [(out.join(shard_file(j, len(groups))).uri, [files[i].uri for i in g]) for j, g in enumerate(groups)]
    added = _run_tasks(_add_task, shared, items, num_cpus, parallel)
    t_add = time.perf_counter()

    # 3. merge parts into index shards
    if mergeable:
        groups = balanced_groups([p["count"] for p in added], num_shards)
        merges = [(out.join(shard_file(j, len(groups))).uri, [added[i] for i in g]) for j, g in enumerate(groups)]
        shards = _run_tasks(_merge_task, {"threads": threads}, merges, num_cpus, parallel)
        parts_dir.delete()
    else:
        shards = added
    t_merge = time.perf_counter()

    count = sum(s["count"] for s in shards)
    dropped = sum(s["dropped"] for s in shards)
    if count + dropped != total:
        raise IndexError_(f"index holds {count} vectors and dropped {dropped}, but the shards at {embeddings.uri} hold {total}")
    out_prefix = out.uri.rstrip("/") + "/"
    shard_entries = [
        {"file": s["file"][len(out_prefix):], "count": s["count"], "id_min": s["id_min"], "id_max": s["id_max"],
         "bytes": s["bytes"]}
        for s in shards
    ]
    ranges = _id_range(shards)
    manifest = {
        "format": FORMAT,
        "factory": factory,
        "factory_requested": requested,
        "dim": dim,
        "metric": "inner_product",
        "embedder": embedder,
        "unit": unit,
        "count": count,
        "id_min": ranges["id_min"],
        "id_max": ranges["id_max"],
        "num_shards": len(shard_entries),
        "files": [s["file"] for s in shard_entries],
        "shards": shard_entries,
        "trained": TRAINED_FILE,
        "embeddings": embeddings.uri,
        "embedding_dtype": _storage_dtype(files[0]),
        "docs": docs,
        "dropped": dropped,
        **(extra or {}),
    }
    manifest_loc.write_json(manifest)  # last: its presence means every file it names is written
    # Memory of the tasks (in this process when not parallel): what one node must hold, whatever the corpus.
    peak = max(task_rss + [s["peak_rss_mb"] for s in added + (shards if mergeable else [])])
    add_rate = sum(a["count"] + a["dropped"] for a in added) / max(sum(a["seconds"] for a in added), 1e-9)
    return {
        "rows_in": total,
        "rows_out": count,
        "rows_dropped": dropped,
        "dim": dim,
        "factory": factory,
        "num_shards": len(shard_entries),
        "parallel": parallel,
        "add_tasks": len(items),
        "train_s": round(t_train - t0, 3),
        "add_s": round(t_add - t_train, 3),
        "merge_s": round(t_merge - t_add, 3),
        "seconds": round(time.perf_counter() - t0, 3),
        "index_bytes": sum(s["bytes"] for s in shard_entries),
        "peak_rss_mb": round(peak, 1),
        "task_base_rss_mb": round(min(a["base_rss_mb"] for a in added), 1),
        "add_vectors_per_task_s": round(add_rate, 1),
    }


def _storage_dtype(f: Location) -> str:
    field = pq.read_schema(f.path, filesystem=f.fs).field("vector")
    return str(field.type.value_type)


# --- loading --------------------------------------------------------------------------------------------


def load_manifest(loc: Location) -> dict[str, Any]:
    man_loc = loc.join(MANIFEST)
    if not man_loc.exists():
        raise IndexError_(f"no index manifest at {man_loc.uri}; build one with `wbrag index RUN`")
    try:
        manifest = man_loc.read_json()
    except ValueError as exc:
        raise IndexError_(f"index manifest {man_loc.uri} is not valid JSON: {exc}") from None
    missing = [k for k in ("dim", "embedder", "files") if k not in manifest]
    if missing:
        raise IndexError_(f"index manifest {man_loc.uri} lacks {missing}; rebuild the index with `wbrag index RUN`")
    return manifest


def load_shards(loc: Location) -> tuple[list[Any], dict[str, Any]]:
    """([faiss index per shard], manifest) from an index folder; each file is checked against the manifest."""
    manifest = load_manifest(loc)
    named_by = loc.join(MANIFEST).uri
    counts = [s.get("count") for s in manifest.get("shards", [])] or [None] * len(manifest["files"])
    shards = []
    for name, count in zip(manifest["files"], counts, strict=True):
        f = loc.join(name)
        index = read_index_file(f, named_by)
        if index.d != manifest["dim"]:
            raise IndexError_(f"index file {f.uri} has dimension {index.d}, its manifest says {manifest['dim']}")
        if count is not None and index.ntotal != count:
            raise IndexError_(f"index file {f.uri} holds {index.ntotal} vectors, its manifest says {count}")
        shards.append(index)
    return shards, manifest


def load_index(loc: Location) -> tuple[Any, dict[str, Any]]:
    """(one searchable faiss index, manifest): the shard itself, or a faiss IndexShards over all shards."""
    import faiss

    shards, manifest = load_shards(loc)
    if len(shards) == 1:
        return shards[0], manifest
    combined = faiss.IndexShards(manifest["dim"], True, False)  # threaded; shards keep their own ids
    for s in shards:
        combined.add_shard(s)  # faiss's wrapper keeps a Python reference: the shards live as long as it does
    return combined, manifest
