"""One vLLM engine fed by several calls at once: the service actor's concurrent passes share its running batch.

`LLM.generate` / `chat` step the engine until one call's requests are done (it idles on their longest answers),
and its front end is not thread-safe. Here one stepping thread adds each call's requests (`LLM.enqueue` /
`enqueue_chat`) between two steps and hands each call its outputs once its last request finished. vLLM's
`AsyncLLM` does the same but always runs its engine core in a second process, which on CPUs costs most of an
engine's start (docs/architecture.md, "One engine path")."""

from __future__ import annotations

import queue
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


def reported_id(request_id: str) -> str:
    """The id vLLM (0.32) reports a request's outputs under, from the one adding it returned (the caller's id
    plus "-" and 8 random characters)."""
    return request_id.rsplit("-", 1)[0]


class _Call(Future):
    """One caller's requests: added by the stepping thread, its outputs collected as they finish (the result)."""

    def __init__(self, add: Callable[[Any], list[str]]):
        super().__init__()
        self.add = add
        self.order: dict[str, int] = {}
        self.outputs: list[Any] = []
        self.left = 0

    def added(self, request_ids: list[str]) -> None:
        self.order = {reported_id(rid): i for i, rid in enumerate(request_ids)}
        self.outputs, self.left = [None] * len(request_ids), len(request_ids)
        if not request_ids:
            self.set_result([])

    def finished(self, output) -> None:
        self.outputs[self.order[output.request_id]] = output
        self.left -= 1
        if self.left == 0:
            self.set_result(self.outputs)


def _threads_as_torch() -> None:
    """This thread's OpenMP thread count set to torch's (the process's; a new thread starts at OMP_NUM_THREADS):
    vLLM's CPU attention kernel, run in this thread, refuses metadata built for another thread count."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(torch.get_num_threads())


class EngineFeed:
    """Runs `add(llm) -> request ids` for each caller and returns that call's finished outputs in the order of its
    ids. One thread of its own touches the engine: it adds the calls' requests as they arrive, between two steps,
    and steps the engine while any request is unfinished."""

    def __init__(self, llm):
        self.llm = llm
        self._arrivals: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        self._calls: dict[str, _Call] = {}  # request id -> the call waiting for it (the stepping thread's own)
        self._stepper: threading.Thread | None = None
        self._start = threading.Lock()  # a call's arrival and the stepping thread's start or end, one at a time
        self._in_engine = 0  # calls with requests in the engine now
        self.max_calls_in_batch = 0  # the most calls with requests in the engine at once (tests read it)

    def run(self, add: Callable[[Any], list[str]]) -> list:
        call = _Call(add)
        with self._start:
            self._arrivals.put(call)
            if self._stepper is None:
                self._stepper = threading.Thread(target=self._step_while_busy, name="vllm-feed", daemon=True)
                self._stepper.start()
        return call.result()

    def _admit(self, call: _Call) -> None:
        try:
            call.added(list(call.add(self.llm)))  # vLLM renders, tokenizes and adds them (a bad prompt: its error)
        except Exception as exc:
            call.set_exception(exc)
            return
        for rid in call.order:
            self._calls[rid] = call
        if call.order:
            self._in_engine += 1
            self.max_calls_in_batch = max(self.max_calls_in_batch, self._in_engine)

    def _fail_all(self, error: BaseException) -> None:
        for call in set(self._calls.values()):
            call.set_exception(error)
        self._calls.clear()
        self._in_engine = 0

    def _step_while_busy(self) -> None:
        """Steps while any call waits, then ends: an idle feed holds no thread, so nothing but its owner keeps
        the engine alive (a service that loads another model frees this one first)."""
        _threads_as_torch()
        engine = self.llm.llm_engine
        while True:
            if not self._calls:
                with self._start:  # `run` adds under this lock: a call that came after this look starts a thread
                    if self._arrivals.empty():
                        self._stepper = None
                        return
            while not self._arrivals.empty():
                self._admit(self._arrivals.get())
            if not self._calls:
                continue
            if not engine.has_unfinished_requests():  # never step an empty engine in a loop: say what was lost
                self._fail_all(RuntimeError(
                    f"vLLM has no unfinished request but {len(self._calls)} of this feed's were never reported "
                    "finished (their ids: wbrag_ray.generation.vllm_feed.reported_id)"))
                continue
            try:
                outputs = engine.step()
            except BaseException as exc:  # the engine failed: every waiting call fails with it, none waits forever
                self._fail_all(exc)
                continue
            for output in outputs:
                if output.finished:
                    call = self._calls.pop(output.request_id, None)
                    if call is not None:
                        call.finished(output)
                        self._in_engine -= call.done()
