"""Sharded FAISS indices: the public names of the build, the manifest that describes an index, and loading.

The implementation is split by what it is about:
  files.py   embedding shards in, faiss index files and the manifest out, loading them back;
  sizing.py  the factory, the training sample, the shard count and the train task's resources (pure rules);
  parts.py   add parts: codes only for IVFs (no copy of the quantizer), merged into an index shard;
  tasks.py   Ray tasks or plain calls, and each task's own peak memory;
  build.py   the build itself: plan, train once, add per embedding shard, merge per index shard.
"""

from __future__ import annotations

from wbrag_ray.index.build import build_index, shard_file
from wbrag_ray.index.files import (
    FORMAT,
    INDEX_FILE,
    MANIFEST,
    PARTS_DIR,
    TRAINED_FILE,
    IndexError_,
    can_merge,
    embedding_files,
    from_bytes,
    iter_embedding_shards,
    load_index,
    load_manifest,
    load_shards,
    new_index,
    read_embedding_shard,
    read_index_file,
    shard_dim,
    shard_rows,
    to_bytes,
    vectors_of,
    write_index_file,
)
from wbrag_ray.index.sizing import (
    MIN_POINTS_PER_CENTROID,
    TrainingPlan,
    balanced_groups,
    bytes_per_vector,
    choose_factory,
    plan_training,
    shards_for,
    train_resources,
    train_sample_cap,
)

__all__ = [
    "FORMAT", "INDEX_FILE", "MANIFEST", "MIN_POINTS_PER_CENTROID", "PARTS_DIR", "TRAINED_FILE", "IndexError_",
    "TrainingPlan", "balanced_groups", "build_index", "bytes_per_vector", "can_merge", "choose_factory",
    "embedding_files", "from_bytes", "iter_embedding_shards", "load_index", "load_manifest", "load_shards",
    "new_index", "plan_training", "read_embedding_shard", "read_index_file", "shard_dim", "shard_file",
    "shard_rows", "shards_for", "to_bytes", "train_resources", "train_sample_cap", "vectors_of",
    "write_index_file",
]
