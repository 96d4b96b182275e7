"""Services kept from a command that ended, for the next command of the same process (`Services.close`): at
most one per stage kind and one search pool per index, taken over by the next command on the same Ray job, or
ended when their time is up, when something needs their CPUs (`release_kept`: an actor pool, a training, tasks of
a whole CPU), or when any other work waits for resources (a watcher reads the GCS's pending demand every `WATCH_S`).
A service that starts ends only the kept one it replaces, and the others only where it does not fit beside them
(`make_room`): a command takes over its services as it first uses them, so starting one must not end the next.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from wbrag_ray.cluster_nodes import free_nodes, room_for
from wbrag_ray.ray_runtime import BEFORE_HEAVY_TASKS, KEEP_S

if TYPE_CHECKING:
    from wbrag_ray.stages.service import StageService

log = logging.getLogger(__name__)

__all__ = ["KEEP_S", "KEPT", "make_room", "release_kept"]
# How often the watcher asks for the cluster's pending demand (a call of about 3 ms to the GCS).
WATCH_S = 0.2


class Kept:
    """What this process keeps (see the module's docstring). Its lock is held only to move handles in and out;
    actors are ended outside it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.services: dict[str, StageService] = {}
        self.pools: dict[tuple, Any] = {}
        self._job: str | None = None  # the Ray job they belong to: a later `ray.init` is another cluster
        self._timer: threading.Timer | None = None
        self._watcher: threading.Thread | None = None
        self._watched_job: str | None = None

    def keep(self, services: list[tuple[str, StageService]], pools: list[tuple[tuple, Any]], seconds: float) -> None:
        """Keep a closed command's services and search pools `seconds` from now (the time starts again with each
        command that leaves some); one kept before of the same kind (index) ends."""
        import ray

        if not (services or pools):
            return
        job = ray.get_runtime_context().get_job_id()
        with self._lock:
            ended = self._clear() if job != self._job else []
            self._job = job
            for name, service in services:
                if name in self.services:
                    ended.append(self.services[name])
                self.services[name] = service
            for key, pool in pools:
                if key in self.pools:
                    ended.append(self.pools[key])
                self.pools[key] = pool
            if self._timer is not None:
                self._timer.cancel()
            self._timer = threading.Timer(seconds, self.release)
            self._timer.daemon = True
            self._timer.start()
            if self._watcher is None or not self._watcher.is_alive() or self._watched_job != job:
                # one per job: the watcher of a job before (another cluster) ends at its next look
                self._watched_job = job
                self._watcher = threading.Thread(target=self._watch, args=(job,), name="wbrag-kept-watcher", daemon=True)
                self._watcher.start()
        _end(ended)

    def _watch(self, job: str) -> None:
        """While anything is kept: end it once work waits for resources (see the module's docstring)."""
        import time

        import ray

        try:
            gcs_address = ray.get_runtime_context().gcs_address
        except Exception as exc:  # a Ray Client driver (ray://) has no GCS to ask: the timer alone ends them
            log.debug("no GCS address to watch the cluster's demand: %s", exc)
            return
        while True:
            time.sleep(WATCH_S)
            with self._lock:
                if self._job != job or not (self.services or self.pools):
                    return
            if _work_waits(gcs_address):
                self.release()

    def take_service(self, name: str, placement: tuple) -> StageService | None:
        """The kept service of stage kind `name`, if its actors have `placement` (one that has not stays kept: the
        caller starts another and ends the kept ones first)."""
        with self._lock:
            service = self.services.get(name) if self._current() else None
            return self.services.pop(name) if service is not None and service.placement == placement else None

    def take_pool(self, key: tuple) -> Any:
        """The kept search pool of `key` ((index folder, placement)), if any."""
        with self._lock:
            return self.pools.pop(key, None) if self._current() else None

    def release(self) -> None:
        with self._lock:
            ended = self._clear()
        _end(ended)

    def release_one(self, name: str | None = None, index_dir: str | None = None) -> None:
        """End the kept service of stage kind `name`, or the kept search pools of the index at `index_dir`."""
        with self._lock:
            if not self._current():
                return
            ended = [self.services.pop(name)] if name in self.services else []
            ended += [self.pools.pop(key) for key in [k for k in self.pools if k[0] == index_dir]]
        _end(ended)

    def holds(self) -> bool:
        with self._lock:
            return bool(self.services or self.pools)

    def _current(self) -> bool:
        """Whether what is kept belongs to this process's Ray job (a lock holder calls it)."""
        if not self._job:
            return False
        import ray

        return ray.is_initialized() and ray.get_runtime_context().get_job_id() == self._job

    def _clear(self) -> list:
        held = [*self.services.values(), *self.pools.values()]
        ended = held if held and self._current() else []  # nothing kept: no call into Ray
        self.services, self.pools = {}, {}
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        return ended


def _work_waits(gcs_address: str) -> bool:
    """Whether a task, an actor or a placement group of the cluster waits for resources (the demand the GCS
    reports to the autoscaler). False where it cannot be read (Ray shut down meanwhile): the timer still ends
    what is kept."""
    try:
        from ray.autoscaler.v2.sdk import get_cluster_status

        demand = get_cluster_status(gcs_address, timeout=5).resource_demands
    except Exception as exc:
        log.debug("reading the cluster's pending demand: %s", exc)
        return False
    return bool(demand.ray_task_actor_demand or demand.placement_group_demand)


def _end(held: list) -> None:
    for service_or_pool in held:
        try:
            service_or_pool.close()
        except Exception as exc:  # Ray shut down meanwhile: its actors went with it
            log.debug("ending a kept service: %s", exc)


KEPT = Kept()


def kept_services() -> dict[str, list[str]]:
    """Per stage kind, the actor ids of the service kept from a command that ended (what the next can take over)."""
    with KEPT._lock:
        return {name: [a._actor_id.hex() for a in service.actors] for name, service in KEPT.services.items()}


def release_kept() -> None:
    """End the services kept from commands that ended (see `Services.close`): what runs next needs their CPUs."""
    KEPT.release()


def make_room(need: dict[str, float], count: int, name: str | None = None, index_dir: str | None = None) -> None:
    """Before `count` actors asking for `need` each start (a service of stage kind `name`, or the search pool of
    `index_dir`): end the kept one they replace, and the others unless the actors fit the nodes' free resources
    beside them (see the module's docstring). Where nodes hold others' work as well, a fit that no longer holds
    when the actors are placed leaves them waiting, and the watcher ends what is kept at its next look. A Ray
    Client driver has no watcher: everything kept ends."""
    if not KEPT.holds():
        return
    KEPT.release_one(name, index_dir)
    import ray

    if ray.util.client.ray.is_connected() or room_for(need, free_nodes()) < count:
        KEPT.release()


BEFORE_HEAVY_TASKS.append(release_kept)
