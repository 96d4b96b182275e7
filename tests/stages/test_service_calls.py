"""How a service's actors are fed: each next call goes to the actor that just answered (not round-robin), and an
actor whose stage takes several calls at once (a vLLM engine's feed) runs them together on its one setup, a call
for another setup waiting until the running ones are done. The stages here sleep instead of loading a model:
what is tested is the feeding, which is the same for every stage."""

from __future__ import annotations

import re
import threading
import time

import pandas as pd
import pytest

from tests.conftest import wait_idle
from wbrag_ray.ray_runtime import call_actors
from wbrag_ray.stages.base import Resources, Stage
from wbrag_ray.stages.service import StageService, _ServiceWorker


class Sleepy(Stage):
    """Answers each row with the key it was set up with, after `seconds`; `gate`, when set (in-process tests), is
    waited on before answering."""

    name = "sleepy"
    input_columns = ("x",)
    output_columns = ("key",)

    def __init__(self, key: str, seconds: float = 0.0, calls: int = 1, gate: threading.Event | None = None):
        self.key, self.seconds, self.calls, self.gate = key, seconds, calls, gate
        self.loaded_key = None

    @property
    def resources(self) -> Resources:
        return Resources(num_cpus=0.25, concurrency=1, batch_size=2, calls=self.calls)

    def setup(self) -> None:
        self.loaded_key = self.key

    def service_key(self) -> str:
        return self.key

    def adopt(self, loaded: Sleepy) -> None:
        self.loaded_key = loaded.loaded_key

    def process_batch(self, batch: pd.DataFrame) -> pd.DataFrame:
        if self.gate is not None:
            assert self.gate.wait(10)
        time.sleep(self.seconds)
        batch["key"] = self.loaded_key
        return batch


class Timed:
    """An actor answering after its own delay, recording how many calls it took."""

    def __init__(self, seconds: float):
        self.seconds, self.calls = seconds, 0

    def run(self, i: int) -> int:
        time.sleep(self.seconds)
        self.calls += 1
        return i

    def count(self) -> int:
        return self.calls


def test_each_next_call_goes_to_the_actor_that_just_answered(ray_cluster):
    remote = ray_cluster.remote(num_cpus=0.25)(Timed)
    slow, fast = remote.remote(0.4), remote.remote(0.02)
    # both processes up first: on a busy machine one can take seconds to start, and the other would take the
    # calls meanwhile whatever the dispatch does (2026-12-03, beside the other test worker: [11, 13])
    assert ray_cluster.get([slow.count.remote(), fast.count.remote()]) == [0, 0]
    out = call_actors([slow, fast], "run", [(i,) for i in range(24)], in_flight=1)
    assert out == list(range(24))  # in the order of the calls
    took = ray_cluster.get([slow.count.remote(), fast.count.remote()])
    # round-robin would give each 12; the slow actor answers about once while the fast one answers 20 times
    assert sum(took) == 24 and took[0] <= 4, took


def test_a_worker_runs_calls_of_one_setup_together_and_loads_another_only_when_they_are_done():
    gate = threading.Event()
    worker = _ServiceWorker(Sleepy("a", calls=2))
    frame = pd.DataFrame({"x": [1, 2]})
    results: dict[str, pd.DataFrame] = {}

    def call(name: str, stage: Stage) -> None:
        results[name] = worker.run(stage, frame.copy())

    first = [threading.Thread(target=call, args=(n, Sleepy("a", calls=2, gate=gate))) for n in ("a1", "a2")]
    for t in first:
        t.start()
    deadline = time.time() + 10
    while worker.running < 2 and time.time() < deadline:
        time.sleep(0.01)
    assert worker.running == 2  # both calls on the loaded setup at once
    other = threading.Thread(target=call, args=("b", Sleepy("b", calls=2)))
    other.start()
    time.sleep(0.3)
    assert worker.setups == 1 and "b" not in results  # "b" waits: the running calls hold setup "a"
    gate.set()
    for t in [*first, other]:
        t.join(10)
    assert worker.setups == 2 and worker.most_running == 2
    assert results["a1"]["key"].tolist() == results["a2"]["key"].tolist() == ["a", "a"]
    assert results["b"]["key"].tolist() == ["b", "b"]


@pytest.mark.parametrize("calls", [1, 3])
def test_a_service_actor_takes_as_many_calls_at_once_as_its_stage_allows(ray_cluster, calls):
    service = StageService(Sleepy("a", seconds=0.3, calls=calls))
    try:
        frame = pd.DataFrame({"x": range(12)})  # 6 batches of 2
        out = service.run_frame(frame, Sleepy("a", seconds=0.3, calls=calls))
        assert out["x"].tolist() == list(range(12)) and set(out["key"]) == {"a"}
        assert ray_cluster.get([a.stat.remote("most_running") for a in service.actors]) == [calls]
    finally:
        service.close()


class Hungry(Sleepy):
    """Sleepy, two actors of a whole CPU each: what a model service asks of a node."""

    @property
    def resources(self) -> Resources:
        return Resources(num_cpus=1.0, concurrency=2, batch_size=2)


def test_a_service_whose_resources_are_held_elsewhere_fails_in_seconds_naming_them(ray_cluster, monkeypatch):
    """Two actors of 1 CPU fit the 2-CPU cluster (the capacity check lets them start), but another actor holds
    1.5 of its CPUs: the service fails once ray.pending_timeout_s (2 s here) has passed, with what is free and
    the setting to lower, instead of waiting forever; its waiting actors end with it, and once the CPUs are free
    the same service starts and answers."""
    from wbrag_ray.config import ConfigError
    from wbrag_ray.placement import PENDING_TIMEOUT_S

    monkeypatch.setitem(PENDING_TIMEOUT_S, "seconds", 2.0)
    wait_idle(ray_cluster)
    holder = ray_cluster.remote(num_cpus=1.5)(Timed).remote(0.0)
    ray_cluster.get(holder.count.remote())  # placed: the CPUs are held
    start = time.monotonic()
    with pytest.raises(ConfigError) as refused:
        StageService(Hungry("a"))
    took = time.monotonic() - start
    assert 2.0 <= took < 10, took
    message = str(refused.value)
    assert message.startswith("the sleepy service: 2 of 2 actors of 1 CPU each still wait for resources after 2 s")
    assert re.search(r"Free now: 0(\.5)? CPU of 2 CPU;", message) and "Lower its concurrency, free the" in message
    assert "ray.pending_timeout_s" in message
    ray_cluster.kill(holder)
    service = StageService(Hungry("a"))  # the CPUs the refused actors waited for were not taken by them
    try:
        out = service.run_frame(pd.DataFrame({"x": range(4)}), Hungry("a"))
        assert out["key"].tolist() == ["a"] * 4
    finally:
        service.close()
