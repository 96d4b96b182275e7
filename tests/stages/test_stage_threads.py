"""Each stage worker sets torch's threads to its allocation (no oversubscription of a node's cores), in Ray
actors and in fused tasks alike."""

import pandas as pd
import pytest

from wbrag_ray.stages.base import Resources, Stage, apply_stage


class _ThreadProbe(Stage):
    name = "thread-probe"
    input_columns = ("id",)
    output_columns = ("id", "threads")

    def __init__(self, resources: Resources):
        self._resources = resources

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
