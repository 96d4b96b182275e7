"""Each stage worker sets torch's threads to its allocation (no oversubscription of a node's cores), in Ray
actors and in fused tasks alike.

Ray starts its workers with OMP_NUM_THREADS=1, which would give the 1-thread cases by itself: the probe stage
sets torch to 3 threads as it arrives in the worker (unpickled, before the worker sets threads), as a process
where torch took every core would start, so each expected count comes from the stage worker alone."""

import pandas as pd
import pytest

from wbrag_ray.stages.base import Resources, Stage, apply_stage

START_THREADS = 3  # none of the expected counts


class _ThreadProbe(Stage):
    name = "thread-probe"
    input_columns = ("id",)
    output_columns = ("id", "threads")

    def __init__(self, resources: Resources):
        self._resources = resources

    def __setstate__(self, state):
        import torch

        torch.set_num_threads(START_THREADS)  # in the worker, before the stage worker sets its threads
        self.__dict__.update(state)

    @property
    def resources(self) -> Resources:
        return self._resources

    def process_batch(self, batch: pd.DataFrame) -> pd.DataFrame:
        import torch

        return batch.assign(threads=torch.get_num_threads())


@pytest.mark.parametrize(
    ("resources", "expected"),
    [
        (Resources(num_cpus=0.5), 1),  # a fraction of a CPU still runs one thread
        (Resources(num_cpus=1.0), 1),
        (Resources(num_cpus=0.5, threads=2), 2),  # more threads than Ray CPUs only when asked for
        (Resources(num_cpus=1.0, actors=False), 1),
    ],
)
def test_workers_run_as_many_torch_threads_as_they_were_given(ray_cluster, resources, expected):
    import ray.data

    ds = apply_stage(ray.data.from_items([{"id": i} for i in range(8)]), _ThreadProbe(resources))
    assert set(ds.to_pandas()["threads"]) == {expected}
