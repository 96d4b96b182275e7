"""Drivers the resume tests kill: a command started in a process group of its own and SIGKILLed, with every
process it started, once some of a stage's rows are committed to the stage's checkpoint, as a lost driver would
leave them (tests/pipelines/test_resume.py, tests/index/test_build_resume.py); or a driver that SIGKILLs itself
right after a commit brings its committed answers to N or more (tests/cluster/multinode_zero_rag.py,
the router's test in tests/pipelines/test_resume.py), run as

    python -m tests.drivers N MODULE ARGS...

Why both: a look from outside counts what the checkpoint holds, and its kill lands wherever the driver is then
(in a commit, between two). With the tiny models a batch of answers comes back in milliseconds and a look at a
checkpoint on object storage takes longer, so a kill from outside at "half" of 12 answers committed 4 at a time
can land after the last commit (CI, 2026-12-02: 12 of 12 committed at the kill). The self-kill lands between two
commits every time; the passes of many rows on a local disk keep the kill from outside.

What bounds a kill from outside: the tasks already running when the driver dies finish and commit; no task it had
not handed out yet runs. So a test that needs rows left after the kill lets fewer tasks run at once than the
commits it leaves (the index build's test: 12 add tasks, 2 at a time, killed at 6). The time a commit takes
bounds nothing: a Ray Data pass's model actor can finish every block before the first write commits (the LM
pruner's 4 blocks of 510 sentences: all 4 committed within 0.25 s, 15 s into the pass; CI, 2026-12-04: 510 of 510
committed at a kill at "half")."""

from __future__ import annotations

import contextlib
import os
import runpy
import signal
import subprocess
import sys
import threading
import time

from wbrag_ray.checkpoints import progress
from wbrag_ray.ray_runtime import LIGHT_CPUS
from wbrag_ray.storage import Location

# What a killed driver's model actor asks for so that one read or write task (LIGHT_CPUS) runs beside it on the
# session's 2-CPU cluster: its pass commits one block at a time, and a kill at the first commit leaves the rest.
ONE_WRITE_AT_A_TIME_CPUS = 2 - LIGHT_CPUS


def start(args: list[str], env: dict[str, str], cwd: str | os.PathLike[str] | None = None) -> subprocess.Popen:
    """`args` running in its own process group (its stdout and stderr together), killed as a whole later."""
    return subprocess.Popen(args, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def kill_once_committed(args: list[str], env: dict[str, str], checkpoint: Location, rows: float, ray_cluster,
                        cwd: str | os.PathLike[str] | None = None, timeout_s: float = 300,
                        poll_s: float = 0.02) -> tuple[int, str]:
    """Start `args` (`start`) on the session's idle cluster (`ray_cluster`, which `env` joins) and SIGKILL its
    process group once the stage checkpoint at `checkpoint` holds `rows` committed rows (or the driver ended, or
    `timeout_s` passed), looking every `poll_s` (each look lists a few folders: on object storage, a few
    requests): (the rows committed after the kill, the driver's output).

    Idle first: what bounds the rows committed after the kill is what runs at once, which the test sets through
    the resources its driver asks for; an actor an earlier test's work still holds would change that, or keep a
    driver whose actor needs most of the node waiting until the timeout. The driver's output is read as it
    comes: Ray forwards its workers' log lines to it, and a driver whose pipe nobody reads stops at 64 KiB.

    The rows are counted once the cluster is idle again: a task of the killed driver that was writing its output
    records it a moment after the driver is gone, until Ray ends the dead job's workers (CI, 2026-12-03: an index
    build's add task recorded after the kill, and the rerun resumed 8 shards where the count taken at the kill
    said 7): the rows returned are at most `rows` plus what the tasks running at the kill commit."""
    from tests.conftest import wait_idle

    wait_idle(ray_cluster, timeout_s=60)
    driver = start(args, env, cwd=cwd)
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(driver.stdout), daemon=True)
    reader.start()
    deadline = time.time() + timeout_s
    try:
        while time.time() < deadline and driver.poll() is None and progress(checkpoint)["committed"] < rows:
            time.sleep(poll_s)
    finally:
        with contextlib.suppress(ProcessLookupError):  # a driver that ended by itself, and all it started
            os.killpg(driver.pid, signal.SIGKILL)
        driver.wait(60)
        reader.join(60)
    wait_idle(ray_cluster, timeout_s=60)
    return progress(checkpoint)["committed"], "".join(output)


def die_once_half_committed(args: list[str], env: dict[str, str], checkpoint: Location, total: int,
                            cwd: str | os.PathLike[str] | None = None, timeout_s: float = 300) -> tuple[int, int, str]:
    """`python -m wbrag_ray.cli args...` run by a driver SIGKILLed right after the commit that brings its committed
    answers to `total // 2` or more (`__main__` below): (the rows committed to the stage checkpoint at
    `checkpoint`, the driver's exit status, its output)."""
    driver = start([sys.executable, "-m", "tests.drivers", str(total // 2), "wbrag_ray.cli", *args], env, cwd=cwd)
    log = driver.communicate(timeout=timeout_s)[0]
    return progress(checkpoint)["committed"], driver.returncode, log


def _die_after(rows: int) -> None:
    """Every AnswerStore of this process counts the answers it commits towards one total; the commit that
    reaches `rows` ends the process as a lost node would, with no exit handler run. (A commit holds a Ray batch
    of answers or more: `generator.batch_size` x 4 rows, at least `generator.checkpoint_rows`.)"""
    from wbrag_ray.checkpoints import AnswerStore

    commit = AnswerStore.flush
    committed = [0]

    def flush(self: AnswerStore) -> None:
        pending = len(self._pending)
        commit(self)
        committed[0] += pending
        if committed[0] >= rows:
            os.kill(os.getpid(), signal.SIGKILL)

    AnswerStore.flush = flush


if __name__ == "__main__":
    _die_after(int(sys.argv[1]))
    sys.argv = [sys.argv[2], *sys.argv[3:]]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
