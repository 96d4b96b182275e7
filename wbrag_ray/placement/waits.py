"""Waits for resources that end: a service's actors (`wait_placed`), a Ray Data actor pool (`pool_start_wait`), a
Ray Train worker group (`train_start_wait`) and an engine replica's placement group each wait at most
`ray.pending_timeout_s`, then fail naming what is missing, what is free and the setting that asks for less."""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from typing import Any

from wbrag_ray.config import ConfigError, GeneratorConfig
from wbrag_ray.placement import PENDING_TIMEOUT_S, _amount, amounts, free_nodes
from wbrag_ray.ray_runtime import environ_while

log = logging.getLogger(__name__)


def _placed(actor) -> bool:
    """Whether Ray has given `actor` a node and a process (its constructor may still be loading a model), from the
    GCS's actor table (the public state API needs a dashboard). Where the private table moved, True."""
    try:
        from ray._private.state import actors

        entry = actors(actor._actor_id.hex())
        return entry["State"] not in ("DEPENDENCIES_UNREADY", "PENDING_CREATION") or bool(entry["Pid"])
    except Exception:  # noqa: BLE001 - a private API
        return True


def wait_placed(actors: list, what: str, need: dict[str, float], fix: str, timeout_s: float | None = None) -> None:
    """Return once every actor of `actors` (each asking for `need`) is placed; a `ConfigError` naming what is missing
    when some still wait after `timeout_s` (default: `ray.pending_timeout_s`). `fix`: the setting that asks less."""
    import ray

    timeout_s = PENDING_TIMEOUT_S["seconds"] if timeout_s is None else timeout_s
    start = time.monotonic()
    said, pause = start, 0.02
    while True:
        waiting = sum(not _placed(a) for a in actors)
        if not waiting:
            return
        now = time.monotonic()
        if now - start >= timeout_s:
            break
        if now - said >= 60:
            said = now
            log.warning("%s: %d of %d actors still wait for resources after %.0f s (free now: %s); failing after "
                        "%g s (ray.pending_timeout_s)", what, waiting, len(actors), now - start,
                        amounts(ray.available_resources(), need), timeout_s)
        time.sleep(pause)
        pause = min(pause * 2, 1.0)
    raise ConfigError(_still_waiting(f"{what}: {waiting} of {len(actors)} actors", need,
                                     f"still wait for resources after {timeout_s:g} s", fix))


def _still_waiting(who: str, need: dict[str, float], waited: str, fix: str, why: str = "") -> str:
    """The message of a wait for resources that ended: `who` of `need` each, `waited`, what is free, and `fix`."""
    import ray

    free, total = ray.available_resources(), ray.cluster_resources()
    held = ", ".join(f"{_amount(r, free.get(r, 0.0))} of {_amount(r, total.get(r, 0.0))}" for r in need if need[r] > 0)
    return (f"{who} of {amounts(need, need)} each {waited}{why}. "
            f"Free now: {held}; the rest is held by other jobs or this run's other actors (`ray status` shows whom). "
            f"{fix[:1].upper() + fix[1:]}, free the resources, or raise ray.pending_timeout_s where an autoscaler is "
            "still adding nodes")


# Ray Data's own error when a pool's actors have not all started within DataContext.wait_for_min_actors_s
_POOL_START_TIMEOUT = "Timed out while starting actors"


def pool_start_timeout_s() -> float:
    """How long a Ray Data actor pool may take to start, its model's load included (`ray.pending_timeout_s`)."""
    return PENDING_TIMEOUT_S["seconds"]


@contextlib.contextmanager
def pool_start_wait(what: str, count: int, need: dict[str, float], fix: str):
    """Run a Ray Data pipeline holding the actor pool `what` (`count` actors asking for `need` each): where they do
    not start in time, Ray Data's bare GetTimeoutError becomes a `ConfigError` naming the pool, what is free and
    `fix`."""
    try:
        yield
        return
    except Exception as exc:
        import ray.exceptions

        if not (isinstance(exc, ray.exceptions.GetTimeoutError) and str(exc).startswith(_POOL_START_TIMEOUT)):
            raise
        timeout_s = pool_start_timeout_s()
        refusal = ConfigError(_still_waiting(
            f"{what}: its {count} actor{'s' * (count != 1)}", need, f"did not start within {timeout_s:g} s",
            fix, " (ray.pending_timeout_s: how long Ray Data waits for a pool's actors to be placed and to load "
            "their model)"))
        _drop_pool(exc)
    raise refusal  # outside the handler: the refusal holds no reference to Ray Data's error


def _drop_pool(exc: BaseException) -> None:
    """End the actors of a Ray Data pool that did not start (Ray Data raises before its executor runs, so nothing
    shuts the pool down, and its actors would hold resources idle once placed). The operator is the frame that
    waited, in the traceback of the error Ray Data chained (its frames are dropped after)."""
    seen = exc
    while seen is not None:
        tb = seen.__traceback__
        while tb is not None:
            pool = getattr(tb.tb_frame.f_locals.get("self"), "_actor_pool", None)
            if pool is not None and hasattr(pool, "shutdown"):
                try:
                    pool.shutdown(force=True)
                except Exception as error:  # noqa: BLE001 - a private API: where it moved, the actors wait on
                    log.debug("ending a Ray Data pool that did not start: %s", error)
            tb = tb.tb_next
        following = seen.__context__
        seen.__traceback__ = seen.__context__ = seen.__cause__ = None
        seen = following


# Ray Train's wait for its worker group's placement group, read from the driver's environment at `fit()`; after
# it, the controller starts the group again, forever, unless the FailureConfig says otherwise (TRAIN_START_FAILURE)
TRAIN_START_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"
# The FailureConfig keywords of a training that ends when its workers cannot start in time
TRAIN_START_FAILURE = {"controller_failure_limit": 0}


@contextlib.contextmanager
def train_start_wait(what: str, num_workers: int, need: dict[str, float], fix: str, timeout_s: float | None = None):
    """Run a Ray Train `fit()` whose worker group may not be placed: with the trainer's
    `FailureConfig(**TRAIN_START_FAILURE, ...)`, a wait past `timeout_s` (default `ray.pending_timeout_s`) ends
    the fit, and its error becomes a `ConfigError` naming `what`, each worker's ask, what is free and `fix`."""
    timeout_s = PENDING_TIMEOUT_S["seconds"] if timeout_s is None else timeout_s
    try:
        with environ_while({TRAIN_START_TIMEOUT_ENV: f"{timeout_s:g}"}):
            yield
    except Exception as exc:
        if not train_start_timed_out(exc):
            raise
        raise ConfigError(_still_waiting(
            f"{what}: {num_workers} training worker{'s' * (num_workers != 1)}", need,
            f"still wait for resources after {timeout_s:g} s", fix)) from None


def train_start_timed_out(exc: BaseException) -> bool:
    """Whether `exc`, raised by a Ray Train `fit()`, says its worker group was not placed in time."""
    failure = getattr(exc, "controller_failure", None)
    try:
        from ray.train.v2._internal.exceptions import WorkerGroupStartupTimeoutError
    except ImportError:  # a private module: where it moved, by name
        return type(failure).__name__ == "WorkerGroupStartupTimeoutError"
    return isinstance(failure, WorkerGroupStartupTimeoutError)


def placement_wait_message(config: GeneratorConfig, spec: dict[str, Any], timeout_s: float) -> str:
    """What an engine replica's placement group still waits for after `timeout_s`, and each node's free resources."""
    tp, pp = config.parallel_sizes()
    total = collections.Counter()
    for bundle in spec["bundles"]:
        total.update(bundle)
    need = " + ".join(f"{v:g} {k}" for k, v in sorted(total.items(), key=lambda kv: kv[0] != "GPU"))
    where = "one node" if spec["strategy"] == "STRICT_PACK" else "as few nodes as fit"
    try:
        free = "; ".join(", ".join(f"{v:g} {k}" for k, v in sorted(n.items()) if k in ("CPU", "GPU")) or "nothing"
                         for n in free_nodes().values())
    except Exception:  # noqa: BLE001 - the message matters more than the detail
        free = "unknown"
    return (f"generator: no room for an engine replica of tensor_parallel_size={tp} x pipeline_parallel_size={pp} "
            f"after {timeout_s:g} s (ray.pending_timeout_s): its placement group needs {len(spec['bundles'])} "
            f"bundles of {spec['bundles'][0]} ({need}) on {where} ({spec['strategy']}), and the cluster has free "
            f"[{free}]: its resources are held by other work, or no node has that many (`ray status`); free them, "
            "add nodes, or raise ray.pending_timeout_s where an autoscaler is adding nodes")
