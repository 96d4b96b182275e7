"""Shared fixtures: one local Ray cluster per session, FlashRAG file writers, demo data paths."""

from __future__ import annotations

import faulthandler
import json
import os
import sys
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parents[1] / "wbrag_ray" / "data"
DEMO_CORPUS = DATA / "demo_corpus.jsonl"
DEMO_QA = DATA / "demo_qa.jsonl"

# Keep Ray quiet and the model cache inside the test session's own folder only when asked to; by default
# the converted-GGUF cache in ~/.cache/wbrag is shared with the demo so the 17 s conversion happens once.
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# `dtype: auto` means float32 on every CPU kind in tests (and in the Ray workers they start): exact checks of
# answers and scores must not depend on whether the CI machine has AVX512-BF16. A test of bf16 asks for it.
os.environ["WBRAG_CPU_BF16"] = "0"
# Ray Train's controller looks at its workers every 2 s, and a worker's report (a checkpoint) waits for that
# look: nothing next to a real step of seconds, most of a tiny test training that checkpoints every 2 steps of
# milliseconds. The session's cluster and every driver a test starts inherit this.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.25")
# Ray Train starts a preemption watcher (an actor: a process) beside each training, for the node drains a cloud
# announces; none comes here, and the tests lose workers and drivers by killing them.
os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
# Ray's log monitor (one per cluster: the session's, each multi-node script's) looks for new worker log files
# with a glob of the logs folder on every 0.1 s loop while it holds under this many; a session leaves hundreds
# (a worker process: two files), and those globs took about 190 of the suite's 4,200 CPU seconds (2026-12-03,
# per-process CPU over a full run). Every 0.5 s instead (LOG_NAME_UPDATE_INTERVAL_S): a new worker's first
# lines reach the driver that much later, nothing else changes.
os.environ.setdefault("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "0")
# torch's OpenMP threads (and faiss's) wait passively in this process and in everything it starts (the session's
# cluster, the drivers and multi-node clusters of the fault tests): two test workers and their actors share 2
# cores, and a thread spinning for work burns the CPU another process waits for. Measured 2026-12-03: the tiny
# generator's same answers beside a busy core took 1.77 CPU-s spinning and 0.88 passive; the adaptive-RAG and
# evaluation files 328 CPU-s spinning and 260 passive (wall 186 -> 150 s). Not a default of wbrag's own workers:
# a command alone on its cores (the demo) ran about 10% longer with passive threads (87 s against 79 s).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# A raylet ends an idle worker process once it has more than num_workers_soft_limit (default: its CPUs, 2 here)
# and the worker has been idle for idle_worker_killing_time_threshold_ms (default 1 s). A test runs pass after
# pass seconds apart, each of Ray Data's light tasks a worker: ended after each pass, the next pass started new
# ones, each importing ray, pandas, pyarrow and wbrag again. Kept (up to 8 a node, the ones past that for a
# minute), the processes are reused. Measured 2026-12-04, CPU-s of the whole machine, with idle workers past 8
# kept 10 minutes: the demo run's test files 146 and 154 -> 138 and 137 (two runs each); test_writeback_pipeline.py
# 191 -> 178 (40 -> 36 worker processes). The whole suite with these settings: 18:26 and 19:31 on the slow kind.
os.environ.setdefault("RAY_num_workers_soft_limit", "8")
os.environ.setdefault("RAY_idle_worker_killing_time_threshold_ms", "60000")

# The session fixtures a whole group of test files builds on, each minutes of work: under pytest-xdist
# (`make test` runs `-n 2 --dist loadgroup`) every file that uses one runs in one worker, so it is built once.
SHARED_BUILDS = ("chain", "built_run", "demo_run")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups into the tests' ids
def pytest_collection_modifyitems(config, items):
    """Under xdist's loadgroup: one group per test file (its module fixtures are built once), except that the
    files using a shared build form one group; those groups go first, then the files of slow tests, so the
    longest work starts earliest and the short files fill the end on both workers."""
    # xdist's workers, which collect, see `--dist loadgroup` as this flag (their own `dist` is "no")
    if not config.getoption("loadgroup", False):
        return
    group: dict[str, str] = {}
    for item in items:
        path = item.nodeid.split("::")[0]
        used = next((name for name in SHARED_BUILDS if name in getattr(item, "fixturenames", ())), None)
        if used or path not in group:
            group[path] = used or group.get(path, path)
    slow = {group[item.nodeid.split("::")[0]] for item in items if item.get_closest_marker("slow")}
    for item in items:
        item.add_marker(pytest.mark.xdist_group(group[item.nodeid.split("::")[0]]))

    def first(item) -> tuple[bool, bool]:  # the shared builds, then the groups holding slow tests, then the rest
        name = group[item.nodeid.split("::")[0]]
        return name not in SHARED_BUILDS, name not in slow

    items.sort(key=first)  # stable: files stay whole (`make test` keeps this order: --no-loadscope-reorder)


def pytest_collection_finish(session):
    """xdist's scheduler reads each test's group from its id ('...@group'); where the pytest installed lets no
    plugin change an id (9.2), the groups would be silently ignored and every worker build the shared runs."""
    if session.config.getoption("loadgroup", False) and session.items and "@" not in session.items[0].nodeid:
        raise pytest.UsageError("pytest-xdist's --dist loadgroup does not group tests under this pytest (9.2 and "
                                "later: pytest-xdist issue 1386); install the pyproject's pytest (<9.2)")


def _cpu_line() -> str:
    from wbrag_ray.models.hardware import cpu_kind, usable_cpus

    return f"cpu: {cpu_kind()}; {usable_cpus()} usable CPUs"


def pytest_report_header(config):
    """The CPU kind at the top of a run's output and again at its end (`pytest_terminal_summary`), beside its time:
    the suite took half again as long or more on an AVX2-only machine as on one with AVX512-BF16 (benchmarks/RESULTS.md), and a
    time read from a log means nothing without the kind it ran on."""
    return _cpu_line()


@pytest.hookimpl(trylast=True)  # after the 25 slowest, next to the run's total
def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(_cpu_line())


_CONFIG: list[pytest.Config] = []
_STDERR: list = []  # this process's stderr as it was before any test's output capture


def pytest_configure(config):
    _CONFIG.append(config)
    _STDERR.append(os.fdopen(os.dup(sys.stderr.fileno()), "w"))


# A minute past a test's own timeout (pytest-timeout's, which fails it gracefully where Python can be interrupted)
STUCK_GRACE_S = 60


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """The backstop for a test stuck where pytest-timeout cannot end it: its SIGALRM handler, and the timer thread
    of its other method, need the main thread to give up the GIL, which a native call deadlocked while holding it
    never does (Ray: an actor dying while the driver submits, ray-project/ray#26414). faulthandler's watchdog is a
    native thread: past the test's timeout and a minute, it writes every thread's stack to stderr (which reaches the
    terminal and CI's log from an xdist worker) and ends the process; xdist names the test and starts another
    worker for the tests left. Without it one such test kept CI running until its 90-minute limit killed the run,
    naming nothing (2026-12-04)."""
    marker = item.get_closest_marker("timeout")
    limit = float(marker.args[0]) if marker and marker.args else float(item.config.getini("timeout") or 0)
    if limit:
        faulthandler.dump_traceback_later(limit + STUCK_GRACE_S, exit=True, file=_STDERR[0])
    try:
        yield
    finally:
        if limit:
            faulthandler.cancel_dump_traceback_later()


def pytest_runtest_logreport(report):
    """A failure's test and error line when it happens, not only in the summary at the end: a run killed from
    outside still says what failed (CI, 2026-12-04: a test failed at 75% and the run was killed at its 90 minutes
    before the summary, naming nothing). Written by xdist's controller, which gets both workers' reports, or by a
    run in one process."""
    if not report.failed or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    terminal = _CONFIG[0].pluginmanager.get_plugin("terminalreporter")
    if terminal is None:  # -p no:terminal
        return
    crash = getattr(report.longrepr, "reprcrash", None)  # absent where a worker crashed (the backstop above)
    reason = (f"{crash.path}:{crash.lineno}: {crash.message}" if crash else str(report.longrepr)).strip()
    terminal.write("\n")
    terminal.write_line(f"FAILED {report.nodeid} ({report.when}, {report.duration:.0f} s): "
                        f"{reason.splitlines()[0][:300] if reason else ''}")


@pytest.fixture(scope="session")
def ray_cluster():
    """A real local Ray cluster (2 CPUs, as on the target machine), shared by every test that needs one."""
    import ray

    if not ray.is_initialized():
        # "local": never join another cluster that `ray start` left on this machine
        ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING")
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield ray
    ray.shutdown()


@pytest.fixture
def one_command():
    """A test whose passes are one command's (`Services`), started once the tests before gave every resource back."""
    import ray

    if ray.is_initialized():
        # a released search actor's memory that came back mid-test broke a count (2026-12-05)
        wait_idle(ray)
    yield


def joining_env(ray) -> dict[str, str]:
    """This process's environment with RAY_ADDRESS naming the session's cluster (`ray`: the `ray_cluster`
    fixture): a `wbrag` subprocess started with it joins that cluster, as a submitted job's driver joins its own,
    and killing it ends its tasks and actors, not the cluster."""
    return {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}


def wait_idle(ray, timeout_s: float = 30) -> None:
    """Return once every CPU of the session's cluster is free again: the actors of the tests before end as Ray
    frees them, and a test that reads or holds the free resources reads them after."""
    import time

    deadline = time.monotonic() + timeout_s
    while (free := ray.available_resources().get("CPU", 0.0)) < (total := ray.cluster_resources()["CPU"]):
        if time.monotonic() >= deadline:
            from tests.ray_actors import live_actors

            held = [(a["ActorClassName"], a["JobID"]) for a in live_actors("")]
            raise AssertionError(f"the session's cluster stayed busy: {free:g} of {total:g} CPUs free after "
                                 f"{timeout_s:g} s; live actors (class, job): {held}")
        time.sleep(0.1)


def last_json_line(stdout: str) -> dict:
    """The summary a driver subprocess printed last: its stdout's last line that is a JSON object. Ray writes to
    the driver's stdout too, at any time (the autoscaler's "(autoscaler +41s) Error: No available node types can
    fulfill..." came after the summary in CI, 2026-12-03), so the last line is not always the driver's."""
    for line in reversed(stdout.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise AssertionError(f"no JSON summary in the driver's output:\n{stdout[-3000:]}")


def write_jsonl(path: Path, records) -> Path:
    """Write records (dicts, or raw bytes lines for bad input) as a jsonl file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        for r in records:
            f.write(r if isinstance(r, bytes) else json.dumps(r, ensure_ascii=False).encode())
            f.write(b"\n")
    return path


def demo_records(n: int | None = None) -> list[dict]:
    lines = DEMO_CORPUS.read_text().splitlines()
    return [json.loads(line) for line in lines[:n]]


def demo_questions(n: int | None = None) -> list[dict]:
    lines = DEMO_QA.read_text().splitlines()
    return [json.loads(line) for line in lines[:n]]


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-compatible server (moto in server mode) on loopback, with one bucket; yields its env vars."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        "AWS_ACCESS_KEY_ID": "wbrag-test-key",
        "AWS_SECRET_ACCESS_KEY": "wbrag-test-secret",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                 aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name="us-east-1").create_bucket(Bucket="wbrag")
    yield env
    server.stop()


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    for k, v in s3_server.items():
        monkeypatch.setenv(k, v)
    return s3_server


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """Tiny random-weight models with the bundled models' architectures and tokenizers (tests/tiny_models.py):
    for tests of plumbing and decisions; tests of answer quality use the bundled models."""
    from tests.tiny_models import build_tiny_models

    return build_tiny_models(tmp_path_factory.mktemp("tiny-models"))


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory, ray_cluster, tiny):
    """The demo corpus (100 passages) ingested, embedded and indexed with the tiny models, and one evaluation named
    `qa` (naive RAG, 4 questions): a built run for tests of commands on it."""
    from wbrag_ray.cli import main

    d = tmp_path_factory.mktemp("mistakes")
    run, qa = d / "run", write_jsonl(d / "qa.jsonl", demo_questions(4))
    assert main(["ingest", str(run), "--corpus", str(DEMO_CORPUS), *tiny.set_args(),
                 "--set", "generator.max_new_tokens=16", "--set", "generator.num_cpus=1"]) == 0
    assert main(["embed", str(run)]) == 0
    assert main(["index", str(run)]) == 0
    assert main(["eval", str(run), "--dataset", str(qa), "--name", "qa", "--methods", "naive"]) == 0
    return run, qa


@pytest.fixture
def demo_run_copy(demo_run, tmp_path):
    """A copy of `demo_run` that a test may break (a stage stopped part way, a lease taken): the build copied, not
    made again."""
    import shutil

    run, qa = demo_run
    copy = tmp_path / "run"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("_lease.json"))
    return copy, qa

