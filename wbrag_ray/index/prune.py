"""Pruned views of an index (Zero-RAG): the same index without the sentences the model already knows.

A pruned view is rebuilt from the stored embedding shards, never re-embedded, and reuses its source's
trained empty index: no retraining, the same coarse quantizer and codebooks, so the full and the pruned
index differ only in what they hold.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from wbrag_ray.index.faiss_index import TRAINED_FILE, IndexError_, build_index, load_manifest
from wbrag_ray.storage import Location, resolve


def drop_ids_from(spec: np.ndarray | list[int] | str | Location) -> np.ndarray:
    """Sorted unique int64 ids to drop, from an array, or from Parquet files (a file or a folder): with a
    boolean `keep` column (a keep mask: rows with keep = false are dropped), or else an `id` column of ids
    to drop."""
    if isinstance(spec, str | Location):
        loc = resolve(spec) if isinstance(spec, str) else spec
        import pyarrow.parquet as pq

        files = loc.list_files(".parquet")
        if not files:
            raise IndexError_(f"no Parquet files of ids to drop at {loc.uri}")
        schema = pq.read_schema(files[0].path, filesystem=files[0].fs)
        if "id" not in schema.names:
            raise IndexError_(f"{files[0].uri} has no 'id' column (columns: {schema.names}); expected id [, keep]")
        if "keep" in schema.names:
            table = loc.read_table(["id", "keep"])
            keep = table["keep"].to_numpy(zero_copy_only=False).astype(bool)
            ids = table["id"].to_numpy()[~keep]
        else:
            ids = loc.read_table(["id"])["id"].to_numpy()
    else:
        ids = np.asarray(spec)
    return np.unique(ids.astype(np.int64))


def prune_index(
    index_dir: str | Location,
    out_dir: str | Location,
    drop: np.ndarray | list[int] | str | Location,
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
        extra={"pruned_from": src.uri, "source_count": manifest["count"]},
    )
