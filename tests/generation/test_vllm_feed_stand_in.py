"""`EngineFeed`'s bookkeeping with a stand-in for vLLM's offline engine (named so: the real engine's feeding runs in
tests/generation/test_vllm_cpu.py, where vLLM's CPU build is installed). The stand-in keeps vLLM 0.32's contract
that the feed relies on: `enqueue` returns the ids it added under (the caller's id, "-", 8 random characters),
`llm_engine.step()` reports outputs under the caller's id, a request finishes some steps after it was added.
What is checked: each caller gets its own outputs in its order while other callers' requests share the steps; a
caller whose prompts the engine refuses fails alone; an engine that fails, or that loses requests, fails every
waiting caller instead of leaving it waiting (or stepping an empty engine forever)."""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass

import pytest

from wbrag_ray.generation.vllm_feed import EngineFeed


@dataclass
class Output:
    request_id: str
    text: str
    finished: bool


class StandInEngine:
    """Requests finish `len(prompt)` steps after they were added; `fail_at` makes a step raise; `lose` drops every
    request without reporting it."""

    def __init__(self) -> None:
        self.running: dict[str, list] = {}  # reported id -> [prompt, steps left]
        self.fail_at: int | None = None
        self.lose = False
        self.steps = 0
        self.batch_sizes: list[int] = []

    def step(self) -> list[Output]:
        self.steps += 1
        time.sleep(0.002)
        if self.fail_at is not None and self.steps >= self.fail_at:
            raise RuntimeError("engine core died")
        if self.lose:
            self.running.clear()
            return []
        self.batch_sizes.append(len(self.running))
        done = []
        for rid, state in list(self.running.items()):
            state[1] -= 1
            if state[1] <= 0:
                done.append(Output(rid, state[0].upper(), True))
                del self.running[rid]
        return done

    def has_unfinished_requests(self) -> bool:
        return bool(self.running)


class StandInLLM:
    def __init__(self) -> None:
        self.llm_engine = StandInEngine()
        self._ids = itertools.count()

    def enqueue(self, prompts: list[str]) -> list[str]:
        if any(not p for p in prompts):
            raise ValueError("an empty prompt")
        added = []
        for p in prompts:
            rid = str(next(self._ids))
            self.llm_engine.running[rid] = [p, len(p)]
            added.append(f"{rid}-abcdefgh")
        return added


def test_each_caller_gets_its_own_outputs_in_order_while_calls_share_the_steps():
    llm = StandInLLM()
    feed = EngineFeed(llm)
    calls = {i: [("x" * (1 + (i * 7 + j) % 9)) + str(i) for j in range(6)] for i in range(4)}
    got: dict[int, list[str]] = {}

    def call(i: int) -> None:
        got[i] = [o.text for o in feed.run(lambda engine, i=i: engine.enqueue(calls[i]))]

    threads = [threading.Thread(target=call, args=(i,)) for i in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert got == {i: [p.upper() for p in prompts] for i, prompts in calls.items()}
    assert feed.max_calls_in_batch >= 2 and max(llm.llm_engine.batch_sizes) > 6  # several calls in one step
    assert feed.run(lambda engine: []) == []  # nothing to add: answered at once


def test_a_refused_call_fails_alone():
    feed = EngineFeed(StandInLLM())
    with pytest.raises(ValueError, match="empty prompt"):
        feed.run(lambda engine: engine.enqueue(["ok", ""]))
    assert [o.text for o in feed.run(lambda engine: engine.enqueue(["fine"]))] == ["FINE"]


@pytest.mark.parametrize("failure", ["engine error", "lost requests"])
def test_an_engine_that_fails_or_loses_requests_fails_every_waiting_caller(failure):
    llm = StandInLLM()
    if failure == "engine error":
        llm.llm_engine.fail_at = 3
    else:
        llm.llm_engine.lose = True
    feed = EngineFeed(llm)
    errors: list[BaseException] = []

    def call() -> None:
        try:
            feed.run(lambda engine: engine.enqueue(["a" * 20]))
        except RuntimeError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=call) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(errors) == 3 and not any(t.is_alive() for t in threads)
    expected = "engine core died" if failure == "engine error" else "never reported finished"
    assert all(expected in str(e) for e in errors), errors


def test_an_idle_feed_holds_no_thread_so_its_engine_can_be_freed():
    """A service that loads another model drops the old generator and collects it before loading: a stepping
    thread that outlived its calls would keep the old engine (its memory, its GPU) alive."""
    import gc
    import weakref

    llm = StandInLLM()
    feed = EngineFeed(llm)
    assert [o.text for o in feed.run(lambda engine: engine.enqueue(["ab"]))] == ["AB"]
    deadline = time.time() + 5
    while feed._stepper is not None and time.time() < deadline:
        time.sleep(0.01)
    assert feed._stepper is None and not any(t.name == "vllm-feed" for t in threading.enumerate())
    engine = weakref.ref(llm)
    del feed, llm
    gc.collect()
    assert engine() is None
    again = EngineFeed(StandInLLM())  # and a feed that went idle starts stepping again for the next call
    for prompt in ("x", "yy"):
        assert [o.text for o in again.run(lambda engine, p=prompt: engine.enqueue([p]))] == [prompt.upper()]
