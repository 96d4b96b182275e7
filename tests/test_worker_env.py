"""vLLM's logging kept at WARNING in the workers unless -v: vLLM reads VLLM_LOGGING_LEVEL from the environment of
the process that imports it (a generator service's actor, Ray Data LLM's engine stage), so the setting has to
reach the workers of a cluster the driver joins, whose processes do not inherit the driver's environment.
No engine starts here: a worker reports the environment it got.

    python -m tests.test_worker_env quiet|verbose   (a driver joining RAY_ADDRESS's cluster; prints JSON)
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import joining_env, last_json_line
from wbrag_ray.ray_runtime import QUIET_WORKER_ENV, worker_env_vars

ROOT = Path(__file__).resolve().parents[1]
LEVEL = "VLLM_LOGGING_LEVEL"


def test_workers_get_vllm_at_warning_unless_verbose(monkeypatch):
    monkeypatch.delenv(LEVEL, raising=False)
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    assert QUIET_WORKER_ENV == {LEVEL: "WARNING"}
    assert worker_env_vars(verbose=False) == {LEVEL: "WARNING"}
    assert worker_env_vars(verbose=True) == {}  # vLLM's own default (INFO)


def test_a_level_the_user_set_reaches_the_workers_and_one_the_submitted_job_sets_is_left_to_the_job(monkeypatch):
    monkeypatch.setenv(LEVEL, "DEBUG")
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    assert worker_env_vars(verbose=False) == worker_env_vars(verbose=True) == {LEVEL: "DEBUG"}
    # a submitted job's runtime env already carries it (Ray refuses a driver's runtime env that sets it again)
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps({"runtime_env": {"env_vars": {LEVEL: "ERROR"}}}))
    assert worker_env_vars(verbose=False) == {}


def main(mode: str) -> None:
    """Join the cluster as a `wbrag` command does (`init_ray`), at INFO or, as -v sets it, DEBUG logging; print the
    job's runtime env and the environment a worker task got, and one whose own runtime env sets a variable
    (Ray Data LLM's engine stage sets VLLM_BATCH_INVARIANT that way)."""
    import ray

    from wbrag_ray.config import RayConfig
    from wbrag_ray.ray_runtime import init_ray

    logging.basicConfig(level=logging.DEBUG if mode == "verbose" else logging.INFO)
    init_ray(RayConfig())

    @ray.remote(num_cpus=0.1)
    def worker_env() -> dict[str, str | None]:
        return {k: os.environ.get(k) for k in (LEVEL, "VLLM_BATCH_INVARIANT")}

    job_env = (ray.get_runtime_context().runtime_env or {}).get("env_vars") or {}
    own = worker_env.options(runtime_env={"env_vars": {"VLLM_BATCH_INVARIANT": "1"}})
    print(json.dumps({"job": job_env, "worker": ray.get(worker_env.remote()), "with_own_env": ray.get(own.remote())}))


@pytest.mark.parametrize("mode", ["quiet", "verbose"])
def test_the_level_reaches_the_workers_of_a_joined_cluster_through_the_jobs_runtime_env(ray_cluster, mode):
    env = {k: v for k, v in joining_env(ray_cluster).items() if k != LEVEL}
    out = subprocess.run([sys.executable, "-m", "tests.test_worker_env", mode], capture_output=True, text=True,
                         timeout=180, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = last_json_line(out.stdout)
    if mode == "quiet":
        assert seen["job"] == {LEVEL: "WARNING"}  # in the job's runtime env, so on every node
        assert seen["worker"][LEVEL] == "WARNING"
        # a task or actor with a runtime env of its own keeps the job's variables beside its own
        assert seen["with_own_env"] == {LEVEL: "WARNING", "VLLM_BATCH_INVARIANT": "1"}
    else:
        assert LEVEL not in seen["job"]  # -v: vLLM's INFO lines come through
        assert seen["with_own_env"]["VLLM_BATCH_INVARIANT"] == "1"


if __name__ == "__main__":
    main(sys.argv[1])
