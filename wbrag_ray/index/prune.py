"""Pruned views of an index (Zero-RAG): the index without the sentences the model knows, rebuilt from the
stored embeddings with the source's trained empty index."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from wbrag_ray.config import IndexConfig
from wbrag_ray.index.build import build_index
from wbrag_ray.index.files import IndexError_, load_manifest
from wbrag_ray.storage import Location, resolve

if TYPE_CHECKING:
    from ray import ObjectRef


def scan_drop_ids(loc: Location) -> np.ndarray:
    """Sorted unique int64 ids to drop, streamed from Parquet files (a `keep` mask column, or an `id` column)."""
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
    """(object-store reference to `scan_drop_ids(loc)`, count): collected by a Ray task, so the driver holds no ids."""
    import ray

    def scan(uri: str) -> tuple[np.ndarray, int]:
        ids = scan_drop_ids(resolve(uri))
        return ids, len(ids)

    ids, count = ray.remote(num_cpus=num_cpus, num_returns=2, max_retries=2)(scan).remote(loc.uri)
    return ids, ray.get(count)


def prune_index(
    index_dir: str | Location,
    out_dir: str | Location,
    drop: np.ndarray | list[int] | ObjectRef,
    *,
    num_cpus: float = 1.0,
) -> dict[str, Any]:
    """Write a pruned view of `index_dir` into `out_dir` without the ids in `drop` (an array, or an object-store
    reference to one: `drop_ids_ref`); returns the build stats."""
    src = resolve(index_dir) if isinstance(index_dir, str) else index_dir
    out = resolve(out_dir) if isinstance(out_dir, str) else out_dir
    if src.uri.rstrip("/") == out.uri.rstrip("/"):
        raise ValueError(f"a pruned view must go to another folder than its source index {src.uri}")
    manifest = load_manifest(src)
    trained_loc = src.join(manifest["trained"])
    if not trained_loc.exists():
        raise IndexError_(f"trained index {trained_loc.uri} named by {src.join('manifest.json').uri} is missing")
    return build_index(
        resolve(manifest["embeddings"]),
        out,
        manifest["embedder"],
        manifest["unit"],
        IndexConfig(factory=manifest["factory"], num_cpus=num_cpus, gpu=False, target_recall=None,
                    num_shards=manifest["num_shards"]),
        trained=trained_loc.read_bytes(),
        drop_ids=drop,
        docs=manifest["docs"],
        # a pruned view is searched as its source was measured (the same lists, fewer vectors in each)
        extra={"pruned_from": src.uri, "source_count": manifest["count"],
               **({"search": {**manifest["search"], "inherited_from": src.uri}} if manifest.get("search") else {})},
    )
