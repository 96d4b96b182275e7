"""One writer per run folder (wbrag_ray.lease), local and on the S3-compatible server on loopback: a second writer
is refused at once naming the holder; a killed holder's lease is taken over; another host's lease only once its
heartbeat expired; the holder's heartbeat keeps a long command's lease; readers take none."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from wbrag_ray.layout import RunLayout
from wbrag_ray.lease import LeaseHeld, RunLease, read_lease
from wbrag_ray.storage import put_if, resolve

WBRAG = str(Path(sys.executable).parent / "wbrag")
HOLDER = "wbrag eval RUN --dataset nq-test (the first writer)"
HOLD = ("import sys, time\nfrom wbrag_ray.lease import run_lease\n"
        "with run_lease(sys.argv[1], sys.argv[2]):\n    print('held', flush=True)\n    time.sleep(300)\n")


@pytest.fixture(params=["local", "s3"])
def run_uri(request, tmp_path):
    if request.param == "s3":
        request.getfixturevalue("s3_env")
        return f"s3://wbrag/lease-{tmp_path.name}/run"
    return str(tmp_path / "run")


def lease_record(uri: str) -> dict | None:
    current = read_lease(RunLayout(resolve(uri)).lease)
    return None if current is None else current[0]


def start_holder(uri: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """A writer in its own process, holding the run folder's lease until it is killed."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, uri, HOLDER], stdout=subprocess.PIPE, text=True,
                            env=env or dict(os.environ))
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_writer_exits_2_at_once_naming_the_holder_and_a_killed_holders_lease_is_taken_over(run_uri,
                                                                                                     tmp_path):
    holder = start_holder(run_uri)
    try:
        t0 = time.perf_counter()
        out = subprocess.run([WBRAG, "eval", run_uri, "--dataset", str(tmp_path / "nq" / "test.jsonl")],
                             capture_output=True, text=True, timeout=60)
        seconds = time.perf_counter() - t0
        assert out.returncode == 2, out.stderr
        line = out.stderr.strip().splitlines()[-1]
        assert "Traceback" not in out.stderr and line.startswith("wbrag eval: ")
        assert HOLDER in line and f"pid {holder.pid}" in line and socket.gethostname() in line, line
        assert f"{run_uri}/_lease.json" in line and "expires" in line, line  # how to break a stale one
        assert seconds < 5, f"refused after {seconds:.1f} s"
        assert lease_record(run_uri)["pid"] == holder.pid  # the refused writer left the holder's lease alone
    finally:
        holder.send_signal(signal.SIGKILL)
    # killed: no release, its lease is still there, and the next writer takes it over (its process is gone, though
    # not yet reaped by its parent: a zombie is no holder)
    time.sleep(0.5)
    assert lease_record(run_uri)["pid"] == holder.pid
    out = subprocess.run([WBRAG, "eval", run_uri, "--dataset", str(tmp_path / "nq" / "test.jsonl")],
                         capture_output=True, text=True, timeout=60)
    assert "took over the stale lease" in out.stderr and f"process {holder.pid} on this host is gone" in out.stderr
    assert out.returncode == 2 and "not a run folder" in out.stderr.strip().splitlines()[-1]  # past the lease
    assert lease_record(run_uri) is None  # released when the command ended
    holder.wait()


def test_another_hosts_lease_is_taken_over_only_after_its_heartbeat_expired(run_uri):
    root = resolve(run_uri)
    root.mkdir()
    planted = {"holder": "wbrag run jobs/configs/paper.yaml", "host": "another-node", "pid": 4242,
               "start": time.time(), "heartbeat": time.time(), "ttl_s": 2.0, "token": "theirs"}
    assert put_if(RunLayout(root).lease, json.dumps(planted).encode())
    with pytest.raises(LeaseHeld, match="being written by another command: `wbrag run jobs/configs/paper.yaml` "
                                        r"\(host another-node, pid 4242"):
        RunLease(root, "wbrag embed RUN").acquire()
    time.sleep(2.5)  # its heartbeat is now older than its time to live: a holder that died with its node
    lease = RunLease(root, "wbrag embed RUN").acquire()
    try:
        assert lease_record(run_uri)["token"] == lease.record["token"]
    finally:
        lease.release()
    assert lease_record(run_uri) is None


def test_the_holders_heartbeat_keeps_its_lease_past_the_time_to_live_and_readers_take_none(run_uri, monkeypatch):
    monkeypatch.setenv("WBRAG_LEASE_TTL", "1")
    lease = RunLease(resolve(run_uri), HOLDER).acquire()
    try:
        first = lease_record(run_uri)["heartbeat"]
        time.sleep(2.5)  # past the time to live: a lease without heartbeats would be stale now
        assert lease_record(run_uri)["heartbeat"] > first
        with pytest.raises(LeaseHeld, match="being written by another command"):
            RunLease(resolve(run_uri), "wbrag index RUN").acquire()
        # readers are not refused by the lease (the folder is no run: their own error, not the lease's)
        for command in (["report", run_uri], ["inspect", run_uri], ["status", run_uri]):
            out = subprocess.run([WBRAG, *command], capture_output=True, text=True, timeout=60)
            assert out.returncode == 2 and "not a run folder" in out.stderr and "being written" not in out.stderr
    finally:
        lease.release()
    assert lease_record(run_uri) is None


def test_a_refused_writer_on_a_new_folder_leaves_no_folder(tmp_path):
    new = tmp_path / "new-run"
    out = subprocess.run([WBRAG, "eval", str(new), "--dataset", str(tmp_path / "missing.jsonl")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and not new.exists()


def test_the_lease_is_created_only_where_none_is_and_replaced_only_where_it_is_still_the_one_read(run_uri):
    """The two conditional writes that make two writers starting at the same moment safe: of two creates, the
    second fails (O_EXCL / If-None-Match); a replace of a version another writer has replaced since fails (the
    bytes compared under a host lock / If-Match)."""
    root = resolve(run_uri)
    root.mkdir()
    lease = RunLayout(root).lease
    assert put_if(lease, b'{"token": "a"}') and not put_if(lease, b'{"token": "b"}')
    record, version_a = read_lease(lease)
    assert record == {"token": "a"}
    assert put_if(lease, b'{"token": "c"}', version_a)  # the version read: replaced
    assert not put_if(lease, b'{"token": "d"}', version_a)  # read before c replaced it: refused
    assert read_lease(lease)[0] == {"token": "c"}


def test_writers_starting_at_the_same_moment_get_one_lease(run_uri):
    start = time.time() + 2
    race = ("import sys, time\nfrom wbrag_ray.lease import LeaseHeld, RunLease\nfrom wbrag_ray.storage import "
            "resolve\ntime.sleep(max(0, float(sys.argv[2]) - time.time()))\ntry:\n"
            "    RunLease(resolve(sys.argv[1]), 'racer').acquire()\n    print('held', flush=True)\n"
            "    time.sleep(4)\nexcept LeaseHeld:\n    print('refused', flush=True)\n")
    procs = [subprocess.Popen([sys.executable, "-c", race, run_uri, str(start)], stdout=subprocess.PIPE, text=True)
             for _ in range(4)]
    results = sorted(p.communicate(timeout=60)[0].strip() for p in procs)
    assert results == ["held", "refused", "refused", "refused"]


def stop_outside_its_lease_write(proc: subprocess.Popen, run: Path) -> None:
    """SIGSTOP `proc` at a moment it does not hold this host's lock of the run's lease (a process stopped inside
    its renewal holds it, and a taker waits HOST_LOCK_WAIT_S for it, then gives up: another test)."""
    import fcntl

    from wbrag_ray.storage import HOST_LOCK, lock_path

    lock_file = lock_path(str(run / "_lease.json"), HOST_LOCK)
    for _ in range(100):
        proc.send_signal(signal.SIGSTOP)
        with open(lock_file, "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return  # free: released when the file closes
            except BlockingIOError:
                proc.send_signal(signal.SIGCONT)
        time.sleep(0.05)
    raise AssertionError("the writer held its lease's lock at every look")


def test_a_writer_whose_lease_is_taken_stops_within_one_heartbeat_and_writes_nothing_more(demo_run_copy, ray_cluster,
                                                                                          tmp_path, monkeypatch):
    """Fencing: a `wbrag eval` stalled past its lease's time to live (SIGSTOP: a paused VM, a stuck process) finds,
    when it runs again, that another writer took the lease: it stops before its next write, its last line names the
    new holder (exit 2, no traceback), and nothing in the run folder changes after the takeover; the new holder's
    own run of the same evaluation then completes with every question answered once."""
    from tests.conftest import demo_questions, joining_env, write_jsonl
    from wbrag_ray.cli import main

    run, _ = demo_run_copy
    ttl = 3.0
    questions = [{**q, "question": f"{q['question']} (fenced)"} for q in demo_questions()]  # not answered before
    qa = write_jsonl(tmp_path / "qa.jsonl", questions)
    args = ["eval", str(run), "--dataset", str(qa), "--name", "fenced", "--methods", "naive",
            "--set", "generator.max_new_tokens=24"]
    old = subprocess.Popen([WBRAG, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env={**joining_env(ray_cluster), "WBRAG_LEASE_TTL": f"{ttl:g}"})
    deadline = time.time() + 120
    while not (run / "_lease.json").exists() and old.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)  # answering by now
    assert old.poll() is None, "finished before its lease was taken: nothing to test"
    stop_outside_its_lease_write(old, run)
    try:
        time.sleep(ttl + 1.0)  # its heartbeat is older than its time to live
        monkeypatch.setenv("WBRAG_LEASE_TTL", f"{ttl:g}")
        new = RunLease(resolve(str(run)), "wbrag eval RUN (the new holder)").acquire()
    finally:
        old.send_signal(signal.SIGCONT)
    try:
        def files() -> dict[str, int]:
            # the lease's own files left out: its conditional write's temporary file (`storage.put_if`) beside it
            # is how the old writer finds, on its next heartbeat, that the lease is no longer its own
            return {str(p.relative_to(run)): p.stat().st_mtime_ns for p in run.rglob("*")
                    if p.is_file() and "_lease.json" not in p.name}

        at_takeover = files()
        out, err = old.communicate(timeout=120)
        assert old.returncode == 2, err[-3000:]
        assert "Traceback" not in err, err[-3000:]
        line = err.strip().splitlines()[-1]
        assert line.startswith(f"wbrag eval: the lease of run folder {run} was taken by `wbrag eval RUN (the new "
                               f"holder)` (host {socket.gethostname()}, pid {os.getpid()})"), line
        assert files() == at_takeover  # nothing written, moved or removed after the takeover
        assert not (run / "eval" / "fenced-naive").exists()
    finally:
        new.release()
    monkeypatch.delenv("WBRAG_LEASE_TTL")
    assert main(args) == 0  # the new holder's run: what the old one committed is whole
    metrics = json.loads((run / "eval" / "fenced-naive" / "metrics.json").read_text())
    assert metrics["n"] == len(questions)


def test_a_pass_whose_lease_was_taken_commits_no_block_from_its_tasks(tmp_path, ray_cluster, monkeypatch):
    """Fenced block commits: a resumable Ray Data pass (`checkpoints.resumable_write`, as embedding and prediction
    run) whose lease another command takes after the driver's last own check, before its tasks write: each write task
    checks the lease's token before it commits its block (`lease.TaskFence`), so the pass fails naming the lease and
    nothing lands in its output folder."""
    import pandas as pd

    from wbrag_ray.checkpoints import resumable_write
    from wbrag_ray.config import WbragConfig
    from wbrag_ray.lease import run_lease
    from wbrag_ray.ray_runtime import local_dataset
    from wbrag_ray.run import RunFolder, RunStage
    from wbrag_ray.stages.base import Resources

    monkeypatch.setenv("WBRAG_LEASE_TTL", "600")  # no heartbeat during the test: only the tasks' check can see it
    run = RunFolder(str(tmp_path / "run"))
    out = run.root.join("rows")
    with run_lease(run.uri, "the first writer") as lease:
        def taken_then_built(placed: Resources):
            record, version = read_lease(lease.lease)  # another command takes the lease (its token replaces ours)
            assert put_if(lease.lease, json.dumps({**record, "token": "the new holder's"}).encode(), version)
            return local_dataset(pd.DataFrame({"id": range(40), "x": range(40)}))

        def work():
            return resumable_write(taken_then_built, out, "id", "rows", 1 << 16, "toy", 40,
                                   Resources(num_cpus=0.25, actors=False), None)

        with pytest.raises(Exception) as refused:
            run.execute(RunStage("toy"), WbragConfig(), work)
    assert "found the lease" in str(refused.value) and "committed nothing" in str(refused.value), refused.value
    written = sorted(Path(out.path).rglob("*.parquet")) if Path(out.path).exists() else []
    assert written == [], written
