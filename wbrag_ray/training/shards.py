"""How a training's examples reach its Ray Train workers: as Ray Data, one dataset a worker holding a contiguous
slice of the examples (`example_shards`, on the driver), read whole by that worker alone (`own_shard`); each worker
draws its part of every step's batch (`local_batch`) from its own slice. The step loop is `training.workers`'."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

if TYPE_CHECKING:
    from wbrag_ray.training.workers import Training

# The examples travel as Ray Data: worker r reads dataset SHARD.format(r), a contiguous slice of the rows split on
# the driver (sizes differ by at most one), the same on every run of the same worker count, so a resumed worker
# holds the rows it held (Ray Data's streaming split deals blocks as they come, and its equal split drops rows).
SHARD = "examples-{}"
ROW, WEIGHT, GROUP = "_row", "_weight", "_group"  # columns fit adds: position, weight in a batch's mean, group


def shard_bounds(num_examples: int, world: int) -> list[int]:
    """The row positions where workers 1..world-1's shards start."""
    return [r * num_examples // world for r in range(1, world)]


def local_batch(batch: int, world: int, rank: int) -> int:
    """How many of a step's `batch` examples worker `rank` draws from its shard (the first ranks one more)."""
    return batch // world + (rank < batch % world)


def example_shards(training: Training, world: int) -> dict[str, Any]:
    """The training's examples as one Ray dataset a worker (`SHARD`), with the columns the step loop reads."""
    import ray

    frame = training.rows().reset_index(drop=True)
    n = len(frame)
    frame[ROW] = np.arange(n, dtype=np.int64)
    frame[WEIGHT] = np.asarray(training.weights if training.weights is not None else np.ones(n), dtype=np.float32)
    frame[GROUP] = np.asarray(training.groups if training.groups is not None else np.zeros(n), dtype=np.int64)
    # from_items builds its blocks in this process: from_pandas and split_at_indices run Ray tasks of a CPU, which
    # wait without a word where other work holds the cluster's CPUs (seen: a fit hung 10 min beside 1.5 held of 2)
    records = frame.to_dict("records")
    bounds = [0, *shard_bounds(n, world), n]
    return {SHARD.format(r): ray.data.from_items(records[bounds[r]:bounds[r + 1]]) for r in range(world)}


def own_shard(rank: int) -> pd.DataFrame:
    """This worker's examples, in their order."""
    import ray.train

    parts = list(ray.train.get_dataset_shard(SHARD.format(rank)).iter_batches(batch_format="pandas", batch_size=None))
    return pd.concat(parts, ignore_index=True).sort_values(ROW, ignore_index=True)
