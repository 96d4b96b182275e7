"""Ray Jobs API: a real `ray start --head` on loopback, `wbrag submit`, status, logs, stop."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.conftest import demo_records, write_jsonl
from wbrag_ray.index.files import load_manifest
from wbrag_ray.jobs_api import dashboard_url, submission_id
from wbrag_ray.run import RunFolder

N_DOCS = 6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def _wbrag(args, env, timeout=600, cwd=None):
    return subprocess.run([sys.executable, "-m", "wbrag_ray.cli", *args], env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=cwd)


def test_dashboard_url_forms():
    assert dashboard_url("http://h:8265/") == "http://h:8265"
    assert dashboard_url("ray://h:10001") == "http://h:8265"
    assert dashboard_url("h:6379") == "http://h:8265"
    assert dashboard_url("h:9999") == "http://h:9999"
    assert dashboard_url("h") == "http://h:8265"


def test_submission_ids_are_stable_and_distinct():
    a = submission_id("index:\n  factory: Flat\n", "s3://b/runs/wiki")
    assert a == submission_id("index:\n  factory: Flat\n", "s3://b/runs/wiki") and a.startswith("wbrag-wiki-")
    assert a != submission_id("index:\n  factory: HNSW32\n", "s3://b/runs/wiki")


class _DroppingDashboard:
    """A stand-in for the Jobs API's client (a real dashboard does not drop a connection on demand): its first
    `submit_job` calls fail as a busy dashboard's do, mid-upload, the job accepted or not."""

    def __init__(self, failures: list[Exception]):
        self.failures, self.calls = failures, 0

    def submit_job(self, **kwargs):
        self.calls += 1
        if self.failures:
            raise self.failures.pop(0)
        return kwargs["submission_id"]


def test_a_dropped_submission_is_retried_and_a_job_it_already_made_is_not_made_twice():
    import requests

    from wbrag_ray.jobs_api import _submit_with_retry

    dropped = requests.exceptions.ConnectionError("('Connection aborted.', RemoteDisconnected(...))")
    taken = RuntimeError("Job with submission_id wbrag-x already exists. Please use a different submission_id.")
    # dropped before the job was made: the retry makes it
    client = _DroppingDashboard([dropped, dropped])
    assert _submit_with_retry(client, delay_s=0, submission_id="wbrag-x") == "wbrag-x" and client.calls == 3
    # dropped after: the retry finds its own id taken, which is this job, and makes no second one
    client = _DroppingDashboard([dropped, taken])
    assert _submit_with_retry(client, delay_s=0, submission_id="wbrag-x") == "wbrag-x" and client.calls == 2
    # an id taken without a dropped connection is someone's earlier job: an error, not success
    with pytest.raises(RuntimeError, match="already exists"):
        _submit_with_retry(_DroppingDashboard([taken]), delay_s=0, submission_id="wbrag-x")
    # a dashboard that never answers: the connection error after the last attempt
    with pytest.raises(requests.exceptions.ConnectionError):
        _submit_with_retry(_DroppingDashboard([dropped] * 3), attempts=3, delay_s=0, submission_id="wbrag-x")


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """`ray start --head --block` on loopback in its own process group; killed (not `ray stop`) at the end."""
    port, dash, agent = _free_port(), _free_port(), _free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    # as with an activated venv: the job's `python` is the one that has the project installed
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    proc = subprocess.Popen(
        [os.path.join(os.path.dirname(sys.executable), "ray"), "start", "--head", "--block",
         f"--port={port}", f"--dashboard-port={dash}", "--dashboard-host=127.0.0.1",
         # the session's other local cluster already holds the agent's default port (52365); without its
         # own, this head's job agent never comes up and every submission gets "No available agent"
         f"--dashboard-agent-listen-port={agent}",
         "--node-ip-address=127.0.0.1", "--num-cpus=2", "--include-dashboard=true", "--disable-usage-stats"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    url = f"http://127.0.0.1:{dash}"
    deadline = time.time() + 120
    while time.time() < deadline:
        # a `wbrag` process (2-3 s of imports) only once the dashboard listens: starting one every few seconds
        # meanwhile takes the CPUs the head needs to come up
        if _listening(dash):
            out = _wbrag(["status", "no-such-job", "--address", url], env, timeout=60)
            if "no job" in out.stderr:
                break
        time.sleep(0.5)
    else:
        os.killpg(proc.pid, signal.SIGTERM)
        pytest.fail("ray head did not come up")
    yield url, env
    os.killpg(proc.pid, signal.SIGTERM)
    try:  # `ray start --block` takes half a minute over a SIGTERM; the head's processes share its group
        proc.wait(5)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


@pytest.mark.slow
def test_submit_runs_a_pipeline_to_completion(ray_head, tmp_path, tiny):
    """The job builds a knowledge base with the tiny embedder (a local folder on this one-machine cluster): what is
    checked is the submission, the job's stages and the job commands, not the embeddings."""
    url, env = ray_head
    work = tmp_path / "project"
    write_jsonl(work / "corpus.jsonl", demo_records(N_DOCS))
    (work / "configs").mkdir()
    (work / "configs" / "build.yaml").write_text(
        "ingest:\n  corpus: corpus.jsonl\n" + tiny.yaml(embedder="  num_cpus: 1\n  threads: 2\n")
    )
    run = tmp_path / "run"
    out = _wbrag(["submit", "configs/build.yaml", "--address", url, "--run", str(run), "--working-dir", str(work)],
                 env, timeout=600, cwd=work)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert "SUCCEEDED" in out.stdout
    layout = RunFolder(str(run)).layout
    for stage in ("ingest", "embed", "index"):
        assert layout.stage(stage).success.exists(), stage
    assert load_manifest(layout.index)["count"] == N_DOCS
    sid = next(line.split()[1].rstrip(":") for line in out.stdout.splitlines() if line.startswith("submitted "))
    st = _wbrag(["status", sid, "--address", url], env, timeout=60)
    assert st.returncode == 0 and "SUCCEEDED" in st.stdout
    logs = _wbrag(["logs", sid, "--address", url], env, timeout=60)
    assert "[index] done" in logs.stdout
    # the same submission again is recognised, not run twice
    again = _wbrag(["submit", "configs/build.yaml", "--address", url, "--run", str(run), "--working-dir", str(work)],
                   env, timeout=120, cwd=work)
    assert again.returncode == 0 and "already succeeded" in again.stdout


def test_job_commands_on_unknown_ids_and_addresses(ray_head, tmp_path):
    url, env = ray_head
    out = _wbrag(["stop", "wbrag-nope", "--address", url], env, timeout=60)
    assert out.returncode == 2 and "no job 'wbrag-nope'" in out.stderr
    out = _wbrag(["status", "x", "--address", f"http://127.0.0.1:{_free_port()}"], env, timeout=120)
    assert out.returncode == 2 and "cannot reach the Ray Jobs API" in out.stderr
