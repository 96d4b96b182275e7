"""vLLM's logging kept at WARNING in the processes that import vLLM unless -v, and no runtime env for any other
worker. vLLM reads VLLM_LOGGING_LEVEL from the environment of the process that imports it (a generator stage's
actor), so the setting has to reach those workers on a cluster the driver joins,
whose processes do not inherit the driver's environment. It travels in their own runtime env (`Resources.env`),
not the job's: a runtime env starts its worker through a second interpreter (Ray's setup_worker), and the job's
would make every worker of every command pay for it. No engine starts here: actors with a vLLM generator stage's
resources report the environment they got.

    python -m tests.test_worker_env quiet|verbose   (a driver joining RAY_ADDRESS's cluster; prints JSON)

And a local cluster's workers reach its own State API (Ray Train asks it about each training's controller),
whatever other clusters run on the machine:

    python -m tests.test_worker_env local
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from tests.conftest import joining_env, last_json_line
from wbrag_ray.config import GeneratorConfig
from wbrag_ray.generation.stage import GenerateStage
from wbrag_ray.ray_runtime import QUIET_VLLM_ENV, vllm_env
from wbrag_ray.stages.base import Stage

ROOT = Path(__file__).resolve().parents[1]
LEVEL = "VLLM_LOGGING_LEVEL"


def test_vllm_workers_get_warning_unless_verbose(monkeypatch):
    monkeypatch.delenv(LEVEL, raising=False)
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    assert QUIET_VLLM_ENV == {LEVEL: "WARNING"}
    assert vllm_env(verbose=False) == {LEVEL: "WARNING"}
    assert vllm_env(verbose=True) == {}  # vLLM's own default (INFO)


def test_a_level_the_user_set_reaches_the_workers_and_one_the_submitted_job_sets_is_left_to_the_job(monkeypatch):
    monkeypatch.setenv(LEVEL, "DEBUG")
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    assert vllm_env(verbose=False) == vllm_env(verbose=True) == {LEVEL: "DEBUG"}
    # a submitted job's runtime env already carries it to every worker: the job's value stays
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps({"runtime_env": {"env_vars": {LEVEL: "ERROR"}}}))
    assert vllm_env(verbose=False) == {}


def test_only_a_vllm_generator_stage_asks_for_an_environment(monkeypatch):
    monkeypatch.delenv(LEVEL, raising=False)
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    assert GenerateStage(GeneratorConfig(backend="vllm")).resources.env == ((LEVEL, "WARNING"),)
    assert GenerateStage(GeneratorConfig(backend="hf")).resources.env == ()


class EnvProbe(Stage):
    """Answers each row with the log level its worker process started with."""

    name = "env-probe"
    input_columns = ("x",)
    output_columns = ("level",)

    def __init__(self, resources, key: str | None):
        self._resources, self.key = resources, key

    @property
    def resources(self):
        return self._resources

    def service_key(self):
        return self.key

    def adopt(self, loaded: EnvProbe) -> None:
        pass  # nothing loaded

    def process_batch(self, batch: pd.DataFrame) -> pd.DataFrame:
        batch["level"] = os.environ.get(LEVEL, "")
        return batch


def local_state_api(trains: bool) -> None:
    """Start a local cluster as a `wbrag` command does (`init_ray`, no address) and print its dashboard's address
    and, where the command `trains`, what a worker of it learns from the State API about an actor of it: what Ray
    Train's placement-group cleaner asks each second about the training's controller."""
    import ray

    from wbrag_ray.config import RayConfig
    from wbrag_ray.ray_runtime import init_ray

    init_ray(RayConfig(num_cpus=2), trains=trains)
    if not trains:
        print(json.dumps({"dashboard": ray._private.worker.get_dashboard_url()}))
        return

    @ray.remote(num_cpus=0)
    class Alive:
        def ready(self) -> bool:
            return True

    @ray.remote(num_cpus=0.1)
    def state_of(actor_id: str) -> str:
        from ray.util.state import get_actor

        return get_actor(actor_id, timeout=30).state

    actor = Alive.remote()
    ray.get(actor.ready.remote())  # alive before it is asked about
    print(json.dumps({"state": ray.get(state_of.remote(actor._actor_id.hex()))}))


@pytest.mark.parametrize("mode", ["local-training", "local"])
def test_a_local_clusters_workers_reach_its_state_api_beside_other_clusters_where_it_trains(ray_cluster, mode):
    """Here beside the session's own cluster (and the other test worker's): a worker that looked for "the" cluster
    among the machine's failed ("Found multiple active Ray instances"), and one of a cluster started without its
    dashboard had no State API to ask. A command that does not train starts no dashboard (about 1 GB)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    out = subprocess.run([sys.executable, "-m", "tests.test_worker_env", mode], capture_output=True, text=True,
                         timeout=180, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert last_json_line(out.stdout) == ({"state": "ALIVE"} if mode == "local-training" else {"dashboard": ""})


def main(mode: str) -> None:
    """Join the cluster as a `wbrag` command does (`init_ray`), at INFO or, as -v sets it, DEBUG logging; print the
    job's runtime env, a plain task's, and the level the actors of a vLLM generator stage's resources got: a
    service's (the passes of a command) and a pool's (a pass of its own)."""
    import ray

    from wbrag_ray.config import RayConfig
    from wbrag_ray.ray_runtime import init_ray, local_dataset
    from wbrag_ray.stages.base import apply_stage
    from wbrag_ray.stages.service import Services

    logging.basicConfig(level=logging.DEBUG if mode == "verbose" else logging.INFO)
    init_ray(RayConfig())

    @ray.remote(num_cpus=0.1)
    def task_env() -> tuple[dict, str]:
        return ray.get_runtime_context().runtime_env or {}, os.environ.get(LEVEL, "")

    # what a vLLM generator's actors ask for, less CPU (nothing loads here)
    resources = dataclasses.replace(GenerateStage(GeneratorConfig(backend="vllm")).resources, num_cpus=0.25)
    frame = pd.DataFrame({"x": [1, 2]})
    with Services() as services:
        service = services.run_frame(frame, EnvProbe(resources, "probe"))["level"].tolist()
    pool = apply_stage(local_dataset(frame), EnvProbe(resources, None)).to_pandas()["level"].tolist()
    task_runtime_env, task_level = ray.get(task_env.remote())
    print(json.dumps({"job": (ray.get_runtime_context().runtime_env or {}).get("env_vars") or {},
                      "task": task_runtime_env.get("env_vars") or {}, "task_level": task_level,
                      "stage_env": dict(resources.env), "service": service, "pool": pool}))


@pytest.mark.parametrize("mode", ["quiet", "verbose"])
def test_the_level_reaches_the_vllm_workers_of_a_joined_cluster_and_no_other_worker_gets_a_runtime_env(
        ray_cluster, mode):
    env = {k: v for k, v in joining_env(ray_cluster).items() if k != LEVEL}
    out = subprocess.run([sys.executable, "-m", "tests.test_worker_env", mode], capture_output=True, text=True,
                         timeout=180, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = last_json_line(out.stdout)
    assert seen["job"] == {} and seen["task"] == {}  # a worker of the job starts without a runtime env
    if mode == "quiet":
        assert seen["stage_env"] == {LEVEL: "WARNING"}
        assert seen["service"] == seen["pool"] == ["WARNING", "WARNING"]
    else:  # -v: vLLM's INFO lines come through (the actors get what every worker of the cluster has)
        assert seen["stage_env"] == {} and seen["service"] == seen["pool"] == [seen["task_level"]] * 2


if __name__ == "__main__":
    if sys.argv[1].startswith("local"):
        local_state_api(trains=sys.argv[1] == "local-training")
    else:
        main(sys.argv[1])
