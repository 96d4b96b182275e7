"""Pruned views of an index (Zero-RAG): the same index without the sentences the model already knows.

A pruned view is rebuilt from the stored embedding shards, never re-embedded, and reuses its source's
trained empty index: no retraining, the same coarse quantizer and codebooks, so the full and the pruned
index differ only in what they hold.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from wbrag_ray.index.faiss_index import TRAINED_FILE, IndexError_, build_index, load_manifest
from wbrag_ray.ray_runtime import is_object_ref
from wbrag_ray.storage import Location, resolve

if TYPE_CHECKING:
    from ray import ObjectRef


def scan_drop_ids(loc: Location) -> np.ndarray:
    """Sorted unique int64 ids to drop, from Parquet files (a file or a folder): with a boolean `keep` column (a
    keep mask: rows with keep = false are dropped), or else an `id` column of ids to drop. Streamed: a few
    batches of the files are held at a time, then only the ids."""
    import pyarrow.dataset as pads
    import pyarrow.parquet as pq

    files = loc.list_files(".parquet")
    if not files:
        raise IndexError_(f"no Parquet files of ids to drop at {loc.uri}")
    schema = pq.read_schema(files[0].path, filesystem=files[0].fs)
    if "id" not in schema.names:
        raise IndexError_(f"{files[0].uri} has no 'id' column (columns: {schema.names}); expected id [, keep]")
    dropped = (pads.field("keep") == False) if "keep" in schema.names else None  # noqa: E712 - an Arrow expression
    scanner = pads.dataset([f.path for f in files], filesystem=files[0].fs, format="parquet").scanner(
        columns=["id"], filter=dropped)
    parts = [batch.column(0).to_numpy().astype(np.int64, copy=False) for batch in scanner.to_batches()]
    return np.unique(np.concatenate(parts)) if parts else np.empty(0, np.int64)


def drop_ids_ref(loc: Location, num_cpus: float = 0.25) -> tuple[ObjectRef, int]:
    """(a reference to `scan_drop_ids(loc)` in Ray's object store, how many): the ids are collected by a Ray task
    and stay in the object store, where the index build's add tasks read them; the driver holds only the
    reference (the ids are 8 bytes a dropped sentence, 330 MB at 138M sentences and ratio 0.3, and their
    sort takes copies)."""
    import ray

    def scan(uri: str) -> tuple[np.ndarray, int]:
        ids = scan_drop_ids(resolve(uri))
        return ids, len(ids)

    ids, count = ray.remote(num_cpus=num_cpus, num_returns=2, max_retries=2)(scan).remote(loc.uri)
    return ids, ray.get(count)


def drop_ids_from(spec: np.ndarray | list[int] | str | Location | ObjectRef) -> np.ndarray | ObjectRef:
    """Sorted unique int64 ids to drop: from an array, from Parquet files (`scan_drop_ids`), or a reference
    to them in Ray's object store (`drop_ids_ref`), passed on as it is."""
    if is_object_ref(spec):
        return spec
    if isinstance(spec, str | Location):
        return scan_drop_ids(resolve(spec) if isinstance(spec, str) else spec)
    return np.unique(np.asarray(spec).astype(np.int64))


def prune_index(
    index_dir: str | Location,
    out_dir: str | Location,
    drop: np.ndarray | list[int] | str | Location | ObjectRef,
    *,
    num_shards: int | None = None,
    num_cpus: float = 1.0,
    parallel: bool | None = None,
) -> dict[str, Any]:
    """Write a pruned view of the index at `index_dir` into `out_dir`, leaving out the ids in `drop` (see
    `drop_ids_from`). Same factory, embedder, documents and shard count unless `num_shards` is given.
    Returns the build stats (rows_out = vectors kept, rows_dropped = vectors dropped)."""
    src = resolve(index_dir) if isinstance(index_dir, str) else index_dir
    out = resolve(out_dir) if isinstance(out_dir, str) else out_dir
    if src.uri.rstrip("/") == out.uri.rstrip("/"):
        raise ValueError(f"a pruned view must go to another folder than its source index {src.uri}")
    manifest = load_manifest(src)
    if "embeddings" not in manifest:
        raise IndexError_(f"index manifest {src.join('manifest.json').uri} does not name its embedding shards")
    trained_loc = src.join(manifest.get("trained", TRAINED_FILE))
    if not trained_loc.exists():
        raise IndexError_(f"trained index {trained_loc.uri} named by {src.join('manifest.json').uri} is missing")
    drop_ids = drop_ids_from(drop)
    return build_index(
        resolve(manifest["embeddings"]),
        out,
        manifest["factory"],
        manifest["embedder"],
        manifest.get("unit", "passage"),
        num_shards=num_shards or manifest.get("num_shards", len(manifest["files"])),
        num_cpus=num_cpus,
        parallel=parallel,
        trained=trained_loc.read_bytes(),
        drop_ids=drop_ids,
        docs=manifest.get("docs"),
        # a pruned view is searched as its source was measured (the same lists, fewer vectors in each)
        extra={"pruned_from": src.uri, "source_count": manifest["count"],
               **({"search": {**manifest["search"], "inherited_from": src.uri}} if manifest.get("search") else {})},
    )
