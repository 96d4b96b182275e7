"""One writer per run folder: the lease (`RUN/_lease.json`) a writing command takes first and gives back at its
end; a second writer is refused, naming the holder and how to break a stale lease. Read-only commands take none.
Every write below the folder checks the lease is still its own (fencing; docs/architecture.md, Design notes)."""

from __future__ import annotations

import _thread
import contextlib
import dataclasses
import datetime
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

from wbrag_ray import storage
from wbrag_ray.config import ConfigError
from wbrag_ray.layout import RunLayout
from wbrag_ray.storage import Location, before_write, guard_writes, put_if, read_versioned, resolve

log = logging.getLogger(__name__)

DEFAULT_TTL_S = 60.0


class LeaseHeld(ConfigError):
    """Another writer holds the run folder's lease: one line naming it and how to break a stale lease."""


class LeaseLost(ConfigError):
    """This command's lease was taken by another writer: it stops before its next write, naming the new holder."""


LOST_SIGNAL = signal.SIGUSR2  # sent to the main thread when a heartbeat finds the lease taken: it stops at once


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    try:  # killed but not yet reaped by its parent (a zombie): gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return True


def stale_reason(record: dict[str, Any]) -> str | None:
    """Why a lease no longer holds (its heartbeat expired, or its process on this host is gone), or None."""
    age = time.time() - float(record.get("heartbeat", 0))
    if age > float(record.get("ttl_s", DEFAULT_TTL_S)):
        return f"its last heartbeat was {age:.0f} s ago"
    if record.get("host") == socket.gethostname() and not _pid_alive(int(record.get("pid", 0))):
        return f"its process {record.get('pid')} on this host is gone"
    return None


def held_message(uri: str, record: dict[str, Any], lease_uri: str) -> str:
    beat = time.time() - float(record.get("heartbeat", 0))
    since = datetime.datetime.fromtimestamp(float(record.get("start", 0))).isoformat(timespec="seconds")
    return (f"run folder {uri} is being written by another command: `{record.get('holder')}` (host "
            f"{record.get('host')}, pid {record.get('pid')}, since {since}, last "
            f"heartbeat {beat:.0f} s ago); wait for it to end, or, if that process is gone, delete "
            f"{lease_uri} (a lease also expires {float(record.get('ttl_s', DEFAULT_TTL_S)):g} s after its "
            "last heartbeat)")


def read_lease(loc: Location) -> tuple[dict[str, Any], Any] | None:
    """(record, version) of the lease at `loc`, or None; the version is what `storage.put_if` compares (an ETag, or
    the bytes): a lease is created and replaced by the conditional writes a commit's pointer uses too."""
    got = read_versioned(loc)
    if got is None:
        return None
    try:
        record = json.loads(got[0].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        record = None
    return record if isinstance(record, dict) else {"holder": "an unreadable lease", "heartbeat": 0}, got[1]


# --- the lease ------------------------------------------------------------------------------------------------


class RunLease:
    """The lease of one run folder, held by this process: renewed by a heartbeat thread until `release`."""

    def __init__(self, root: Location, holder: str):
        self.root = root
        self.lease = RunLayout(root).lease
        self.ttl = float(os.environ.get("WBRAG_LEASE_TTL", DEFAULT_TTL_S))
        now = time.time()
        self.record = {"holder": holder, "host": socket.gethostname(), "pid": os.getpid(), "start": now,
                       "heartbeat": now, "ttl_s": self.ttl, "token": uuid.uuid4().hex}
        self.version: Any = None
        self.created_root = False
        self.lost: str | None = None  # the one line saying who took the lease, once it is found taken
        # when this holder last wrote the lease, on the takers' clock (a paused VM's monotonic clock may stand still)
        self.renewed = time.time()
        self._lock = threading.Lock()  # the heartbeat and a write's fence renew one after the other
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._previous_handler: Any = None
        self._interrupts = False  # whether a lost lease interrupts the main thread (it was taken there)

    def _data(self) -> bytes:
        return (json.dumps(self.record, indent=1) + "\n").encode("utf-8")

    def acquire(self) -> RunLease:
        if self.root.is_local and not os.path.isdir(self.root.path):
            self.root.mkdir()
            self.created_root = True
        try:
            for _ in range(5):  # a few rounds: another writer may create or replace it between a read and a write
                current = read_lease(self.lease)
                if current is None:
                    if put_if(self.lease, self._data()):
                        break
                    continue
                record, version = current
                why = stale_reason(record)
                if why is None:
                    raise LeaseHeld(held_message(self.root.uri, record, self.lease.uri))
                if put_if(self.lease, self._data(), version):
                    print(f"took over the stale lease of `{record.get('holder')}` on {self.root.uri} ({why})",
                          file=sys.stderr, flush=True)
                    break
            else:
                current = read_lease(self.lease)
                raise LeaseHeld(held_message(self.root.uri, current[0] if current else {"holder": "another command"},
                                             self.lease.uri))
        except BaseException:
            self._remove_created_root()
            raise
        self.version = read_lease(self.lease)[1]  # type: ignore[index]
        self.renewed = time.time()
        if threading.current_thread() is threading.main_thread():
            self._previous_handler = signal.signal(LOST_SIGNAL, self._on_lost_signal)
            self._interrupts = True
        guard_writes(self.root, self)
        self._thread = threading.Thread(target=self._beat, name="wbrag-lease-heartbeat", daemon=True)
        self._thread.start()
        return self

    def _renew(self) -> None:
        """Write the lease again with a new heartbeat where it is still this holder's version, else `LeaseLost`."""
        with self._lock:
            if self.lost is not None:
                raise LeaseLost(self.lost)
            started = time.time()
            self.record["heartbeat"] = started
            data = self._data()
            if not put_if(self.lease, data, self.version):
                self.lost = self._lost_message(started)
                raise LeaseLost(self.lost)
            self.version = data if self.root.is_local else read_lease(self.lease)[1]  # type: ignore[index]
            self.renewed = started

    def _lost_message(self, now: float) -> str:
        current = read_lease(self.lease)
        record = current[0] if current is not None else {}
        taker = (f"`{record.get('holder')}` (host {record.get('host')}, pid {record.get('pid')})" if record
                 else "another command (which has since given it back)")
        return (f"the lease of run folder {self.root.uri} was taken by {taker}: this command last renewed it "
                f"{now - self.renewed:.0f} s before (its time to live is {self.ttl:g} s; a stalled process or "
                "storage that did not answer), so it stopped before writing more; what it committed stays, and the "
                "new holder resumes from it")

    def fence(self, loc: Location | None = None, commit: bool = False) -> None:
        """Refuse a write below the run folder where the lease was taken; a commit, or a write after half the TTL,
        renews it first (a conditional write on the version held)."""
        if loc is not None and loc.path == self.lease.path:
            return
        if self.lost is not None:
            raise LeaseLost(self.lost)
        if commit or time.time() - self.renewed > self.ttl / 2:
            self._renew()

    def _beat(self) -> None:
        while not self._stop.wait(self.ttl / 4):
            try:
                self._renew()
            except LeaseLost:
                log.debug("the lease of %s was taken: interrupting the command", self.root.uri)
                if self._interrupts and not self._stop.is_set():
                    _thread.interrupt_main(LOST_SIGNAL)  # raises LeaseLost in the main thread (`_on_lost_signal`)
                return
            except Exception as exc:  # noqa: BLE001 - a missed beat (storage hiccup) is retried next time
                log.warning("could not renew the lease of %s: %s", self.root.uri, exc)

    def _on_lost_signal(self, signum: int, frame: Any) -> None:
        if self.lost is not None and not self._stop.is_set():
            raise LeaseLost(self.lost)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        guard_writes(self.root, None)
        if self._interrupts:
            signal.signal(LOST_SIGNAL, self._previous_handler if self._previous_handler is not None else signal.SIG_DFL)
            self._interrupts = False
        current = read_lease(self.lease)
        if current is not None and current[0].get("token") == self.record["token"]:
            self.lease.delete()
        self._remove_created_root()

    def _remove_created_root(self) -> None:
        """A folder this lease created and nothing else wrote into goes again (a refused command leaves nothing)."""
        if self.created_root:
            with contextlib.suppress(OSError):
                os.rmdir(self.root.path)


@dataclasses.dataclass(frozen=True)
class TaskFence:
    """What a Ray task checks before it commits a block below a leased run folder, where the driver's lease is out
    of reach: the lease still holds the token of the command that started the pass."""

    lease: str  # the lease file's URI
    token: str

    def check(self) -> None:
        current = read_lease(resolve(self.lease))
        if current is None or current[0].get("token") != self.token:
            holder = current[0].get("holder") if current is not None else None
            raise LeaseLost(f"a task of this command's pass found the lease {self.lease} taken"
                            f"{f' by `{holder}`' if holder else ''} before it committed its block: it committed "
                            "nothing, and the new holder resumes from what was committed")


def task_fence(loc: Location) -> TaskFence | None:
    """The fence of the lease this process holds on the run folder holding `loc` (None where it holds none)."""
    lease = storage.write_guard(loc)
    return TaskFence(lease.lease.uri, lease.record["token"]) if isinstance(lease, RunLease) else None


def fence(loc: Location) -> None:
    """A commit below a run folder: renew this process's lease now, `LeaseLost` where another took it."""
    before_write(loc, commit=True)


@contextlib.contextmanager
def run_lease(uri: str, holder: str) -> Iterator[RunLease]:
    """Hold the lease of the run folder at `uri` while the block runs; `LeaseHeld` where another writer holds it."""
    lease = RunLease(resolve(uri), holder).acquire()
    try:
        yield lease
    finally:
        lease.release()
