"""Drivers the resume tests kill: a command started in a process group of its own and SIGKILLed, with every
process it started, once half of a stage's rows are committed to the stage's checkpoint, as a lost driver would
leave them (tests/pipelines/test_resume.py, tests/index/test_build_resume.py, tests/cluster/multinode_zero_rag.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import time

from wbrag_ray.checkpoints import progress
from wbrag_ray.storage import Location


def start(args: list[str], env: dict[str, str], cwd: str | os.PathLike[str] | None = None) -> subprocess.Popen:
    """`args` running in its own process group (its stdout and stderr together), killed as a whole later."""
    return subprocess.Popen(args, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def kill_once_half_committed(driver: subprocess.Popen, checkpoint: Location, total: int,
                             timeout_s: float = 300, poll_s: float = 0.02) -> tuple[int, str]:
    """SIGKILL `driver`'s process group once the stage checkpoint at `checkpoint` holds `total / 2` committed rows
    (or the driver ended, or `timeout_s` passed), looking every `poll_s` (each look lists a few folders: on object
    storage, a few requests): (the rows committed after the kill, the driver's output)."""
    deadline = time.time() + timeout_s
    try:
        while time.time() < deadline and driver.poll() is None and progress(checkpoint)["committed"] < total / 2:
            time.sleep(poll_s)
    finally:
        os.killpg(driver.pid, signal.SIGKILL)
        log = driver.communicate(timeout=60)[0]
    return progress(checkpoint)["committed"], log
