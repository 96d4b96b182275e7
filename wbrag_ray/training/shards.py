"""How a training's examples reach its Ray Train workers: one Ray Data dataset per worker, a contiguous slice."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

if TYPE_CHECKING:
    from wbrag_ray.training.workers import Training

# Worker r reads SHARD.format(r), a slice split on the driver, the same on every run of one worker count.
SHARD = "examples-{}"
ROW, WEIGHT, GROUP = "_row", "_weight", "_group"  # position (fit adds it), weight in a batch's mean, group


def shard_bounds(num_examples: int, world: int) -> list[int]:
    """The row positions where workers 1..world-1's shards start."""
    return [r * num_examples // world for r in range(1, world)]


def local_batch(batch: int, world: int, rank: int) -> int:
    """How many of a step's `batch` examples worker `rank` draws from its shard (the first ranks one more)."""
    return batch // world + (rank < batch % world)


def example_shards(training: Training, world: int) -> dict[str, Any]:
    """The training's examples as one Ray dataset a worker (`SHARD`), with the columns the step loop reads."""
    import ray

    frame = training.examples.reset_index(drop=True)
    n = len(frame)
    frame[ROW] = np.arange(n, dtype=np.int64)
    frame[WEIGHT] = frame[WEIGHT].astype(np.float32) if WEIGHT in frame else np.ones(n, np.float32)
    frame[GROUP] = frame[GROUP].astype(np.int64) if GROUP in frame else np.zeros(n, np.int64)
    # from_items builds blocks in this process (from_pandas would wait for a CPU a busy cluster may not free).
    records = frame.to_dict("records")
    bounds = [0, *shard_bounds(n, world), n]
    return {SHARD.format(r): ray.data.from_items(records[bounds[r]:bounds[r + 1]]) for r in range(world)}


def own_shard(rank: int) -> pd.DataFrame:
    """This worker's examples, in their order."""
    import ray.train

    parts = list(ray.train.get_dataset_shard(SHARD.format(rank)).iter_batches(batch_format="pandas", batch_size=None))
    return pd.concat(parts, ignore_index=True).sort_values(ROW, ignore_index=True)
