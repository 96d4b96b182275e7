"""Stage services: a stage's workers set up once and used by every pass of a command that needs them.

A `StageService` holds `resources.concurrency` actors that ran `setup` once, so the short passes the RAG methods,
gates and grids alternate do not each load the model again. The driver sends rows to the actors
(`Services.run_frame`) with each pass's own stage: an actor lends it what it loaded when the `service_key`
matches (`Stage.adopt`), else loads the pass's stage in place of the old one. `Services` is the set one command
owns: one service per stage kind, one search pool per index, started on first use and ended at `close()`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any

import pandas as pd
import pyarrow as pa

from wbrag_ray.models.hardware import set_threads
from wbrag_ray.placement import pool_refusal, refuse_unplaceable
from wbrag_ray.placement.gpus import beside_generator
from wbrag_ray.placement.waits import wait_placed
from wbrag_ray.progress import running
from wbrag_ray.ray_runtime import (
    CLOSE_S,
    call_actors,
    end_child_processes,
    start_restartable,
)
from wbrag_ray.stages.base import (
    Resources,
    Stage,
    concurrency_fix,
    free_cpus,
    process_checked,
    require_stage_gpu,
)

if TYPE_CHECKING:
    from wbrag_ray.progress import PassProgress

log = logging.getLogger(__name__)


class _ServiceWorker:
    """A service's actor: the stage set up once; each call runs a pass's own stage on what it loaded, up to
    `Resources.calls` at once in threads. A call for another service key waits for those, then loads its own."""

    def __init__(self, stage: Stage):
        set_threads(stage.resources.threads or stage.resources.num_cpus)
        self.loaded: Stage | None = None
        self.cpus = None  # the loaded stage's `FreeCpus`
        self.setups = 0  # what this process really loaded (tests count it: a second pass loads nothing)
        self.running = 0  # calls running on the loaded setup
        self.most_running = 0  # the most calls that ran at once (tests read it)
        self.refused: tuple[Any, BaseException] | None = None  # (service key, what its setup raised)
        self._turn = threading.Condition()
        with contextlib.suppress(Exception):  # kept in self.refused: the pass's first call raises it
            self._load(stage)

    def _load(self, stage: Stage) -> None:
        """Set `stage` up in place of what was loaded. A setup that raises is kept with its key and raised again by
        every call for that key (an actor whose constructor raised would be dead, each call retried in vain)."""
        import gc

        # the old model (a vLLM engine's processes, their GPU memory) ends before the new one loads
        old, self.loaded, self.key, self.refused = self.loaded, None, None, None
        _close_stage(old)
        gc.collect()
        try:
            require_stage_gpu(stage)
            stage.setup()
        except Exception as exc:
            self.refused = (stage.service_key(), exc)
            raise
        self.setups += 1
        self.loaded, self.key, self.cpus = stage, stage.service_key(), free_cpus(stage)

    def stat(self, name: str) -> int:
        """A count of this actor's (`setups`, `most_running`), as `Services.actor_stats` reads it."""
        return getattr(self, name)

    def close(self) -> list[int]:
        """End what the loaded stage started (`Stage.close`) and any child process still up after it; their pids."""
        loaded, self.loaded, self.key = self.loaded, None, None
        _close_stage(loaded)
        return end_child_processes()

    def run(self, stage: Stage, batch):
        with self._turn:
            key = stage.service_key()
            while key != self.key and self.running:
                self._turn.wait()
            if key != self.key:
                if self.refused is not None and self.refused[0] == key:
                    raise self.refused[1]
                self._load(stage)
            stage.adopt(self.loaded)
            self.running += 1
            self.most_running = max(self.most_running, self.running)
        try:
            if self.cpus is not None:
                self.cpus.apply()
            return process_checked(stage, batch)
        finally:
            with self._turn:
                self.running -= 1
                self._turn.notify_all()


def _close_stage(stage: Stage | None) -> None:
    """`stage.close()` where a stage was set up; its failure said, not raised (what it started ends with the actor)."""
    if stage is None:
        return
    try:
        stage.close()
    except Exception as exc:  # noqa: BLE001
        log.warning("ending what the %s stage set up: %s", stage.name, exc)


def _placement(res: Resources) -> Resources:
    """What a service's actors hold and started with: a pass's batch size is its own."""
    return dataclasses.replace(res, batch_size=0)


class StageService:
    """The set-up actors of one stage kind with one set of resources; `key` is what its passes last loaded."""

    def __init__(self, stage: Stage):
        import ray

        self.key = stage.service_key()
        res = stage.resources
        self.placement = _placement(res)

        # actors that can never be placed would leave the pass waiting on them forever: refused first
        refuse_unplaceable(lambda nodes: pool_refusal(f"the {stage.name} service", res.concurrency, res.need, nodes))

        # A lost actor restarts from the stage in its creation spec. An actor whose setup starts processes gets a
        # concurrency group for its close, not to wait behind a running call (only there: its calls then run in a
        # thread whose OpenMP threads `set_threads` did not set).
        self.closes = stage.starts_processes
        remote = ray.remote(num_cpus=res.num_cpus, num_gpus=res.num_gpus or None, max_restarts=3,
                            max_task_retries=3, max_concurrency=res.calls,
                            **({"concurrency_groups": {"close": 1}} if self.closes else {}),
                            **res.remote_args())(_ServiceWorker)
        if stage.beside_generator:
            remote = remote.options(**beside_generator(res.num_gpus))
        self.actors = [start_restartable(remote, stage) for _ in range(res.concurrency)]
        try:  # placed, not set up: the model loads while the driver goes on (`Services.start`)
            wait_placed(self.actors, f"the {stage.name} service", res.need, concurrency_fix(stage.section))
        except BaseException:
            self.close()
            raise

    def run_frame(self, frame: pd.DataFrame, stage: Stage, progress: PassProgress | None = None,
                  on_batch: Callable[[int, pd.DataFrame], None] | None = None) -> pd.DataFrame:
        """Rows the driver holds through `stage`, sent straight to the actors in batches (no Ray Data plan: a few
        rows answer in milliseconds), back in their order; `on_batch(first_row, out)` as each batch is answered."""
        size = stage.resources.batch_size
        batches = [frame.iloc[i:i + size].reset_index(drop=True) for i in range(0, len(frame), size)]
        if stage.batch_format == "pyarrow":
            batches = [pa.Table.from_pandas(b, preserve_index=False) for b in batches]

        def done(i, out) -> None:
            if progress is not None:
                progress.advance(out.num_rows if hasattr(out, "num_rows") else len(out))
            if on_batch is not None:
                on_batch(i * size, out.to_pandas() if hasattr(out, "to_pandas") else out)

        # one call more than each actor runs at once waits in its queue: it starts as soon as one ends
        outs = call_actors(self.actors, "run", [(stage, b) for b in batches], on_result=done,
                           in_flight=stage.resources.calls + 1)
        outs = [o.to_pandas() if hasattr(o, "to_pandas") else o for o in outs]
        return pd.concat(outs, ignore_index=True) if outs else frame.iloc[:0].copy()

    def close(self) -> None:
        """End what each actor's setup started (up to `ray_runtime.CLOSE_S`), then the actors and the placement
        groups of their remote engines."""
        import ray

        ids = [actor._actor_id.hex() for actor in self.actors]
        if self.actors and self.closes:
            ends = [actor.close.options(concurrency_group="close").remote() for actor in self.actors]
            ray.wait(ends, num_returns=len(ends), timeout=CLOSE_S)
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
        if ids:  # a sharded engine's placement groups, which Ray keeps past a killed actor (`generation.parallel`)
            from wbrag_ray.generation.parallel import release_engine_groups

            release_engine_groups(ids)


class Services:
    """The stage services of one command, at most one per stage kind; a context manager that closes them."""

    def __init__(self) -> None:
        self._live: dict[str, StageService] = {}
        self.started: dict[str, int] = {}  # actor sets started per stage kind (what reusing them saves)
        self.loads: dict[str, int] = {}  # what was set up per stage kind: one per service key a pass needed
        self._pools: dict[tuple, Any] = {}  # retrieval: (index folder, placement) -> SearchPool

    def run_frame(self, frame: pd.DataFrame, stage: Stage, name: str | None = None,
                  on_batch: Callable[[int, pd.DataFrame], None] | None = None) -> pd.DataFrame:
        """Rows the driver holds through `stage` on its kind's service (`StageService.run_frame`), reported as one
        progress line under `name` (default: the stage's)."""
        if stage.service_key() is None:
            raise ValueError(f"stage {stage.name} declares no service key: run it as a pass (`apply_stage`)")
        with running(name or stage.name, len(frame)) as progress:
            return self._service(stage).run_frame(frame, stage, progress, on_batch)

    def start(self, stage: Stage) -> None:
        """Start `stage`'s service before its first pass, so its model loads while the driver works (a live one of
        the kind is left as it is)."""
        if stage.name not in self._live:
            self._service(stage)

    def wait_ready(self, stage: Stage) -> None:
        """Block until `stage`'s service has set its model up (each actor's constructor has returned)."""
        import ray

        ray.get([actor.stat.remote("setups") for actor in self._service(stage).actors])

    def _service(self, stage: Stage) -> StageService:
        """The live service of `stage`'s kind, set for its pass: a pass with another key is set up in the same
        actors when it asks for the same resources, else the old actors end and new ones start."""
        key: Hashable = stage.service_key()
        service = self._live.get(stage.name)
        if service is not None and service.placement != _placement(stage.resources):
            service.close()
            service = None
        if service is None:
            service = self._live[stage.name] = StageService(stage)
            self.started[stage.name] = self.started.get(stage.name, 0) + 1
            self.loads[stage.name] = self.loads.get(stage.name, 0) + 1
            log.info("started the %s service (%d actors)", stage.name, len(service.actors))
        if service.key != key:
            service.key = key  # its actors set the pass's stage up on its first batch
            self.loads[stage.name] = self.loads.get(stage.name, 0) + 1
        return service

    def actor_stats(self, name: str) -> dict[str, list[int]]:
        """Per live service, each actor's `setups` (stage setups run: model loads, index opens) or
        `most_running` (the most calls it ran at once, `Resources.calls`)."""
        import ray

        return {kind: ray.get([a.stat.remote(name) for a in s.actors]) for kind, s in self._live.items()}

    def actor_ids(self, kind: str) -> list[str]:
        """The ids of the actors of the live service of stage kind `kind` (none if there is none)."""
        service = self._live.get(kind)
        return [a._actor_id.hex() for a in service.actors] if service is not None else []


    def retrieval(self, members, index, retrieval):
        """The retrieval service over `members` ((index_dir, docs_dir, source), ...): each index's search pool
        started on first use and shared by later passes. One set of indices lives at a time: starting a pool ends
        the pools of indices this request does not name (a grid moving to its next pruned index)."""
        from wbrag_ray.retrieval.service import RetrievalService, Retriever, SearchPool, pool_placement
        from wbrag_ray.retrieval.union import UnionRule

        placement = pool_placement(index, retrieval)
        keys = [(index_dir, placement) for index_dir, _docs, _source in members]
        if any(key not in self._pools for key in keys):
            for key in [k for k in self._pools if k not in keys]:
                self._pools.pop(key).close()
            for key in keys:
                if key in self._pools:
                    continue
                self._pools[key] = SearchPool.start(key[0], index, retrieval)
                self.started["search"] = self.started.get("search", 0) + 1
                log.info("started the search pool of %s (%d shard groups x %d)", key[0],
                         len(self._pools[key].actors), retrieval.concurrency)
        return RetrievalService([Retriever(key[0], docs, source=source, pool=self._pools[key])
                                 for key, (_i, docs, source) in zip(keys, members, strict=True)],
                                UnionRule.of(retrieval))

    def end_search(self) -> None:
        """End the retrieval service (its query embedder) and the search pools: their memory goes before a long
        generator pass where nothing searches again."""
        live = self._live.pop("retrieve", None)
        pools, self._pools = list(self._pools.values()), {}
        for service_or_pool in [*([live] if live else []), *pools]:
            service_or_pool.close()

    def close(self) -> None:
        """End this command's services and search pools."""
        held = [*self._live.values(), *self._pools.values()]
        self._live.clear()
        self._pools.clear()
        for service_or_pool in held:
            service_or_pool.close()

    def __enter__(self) -> Services:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def shared_or_own(services: Services | None) -> contextlib.AbstractContextManager[Services]:
    """`services` where a caller shares its own, else a set of this block's own, closed at its end."""
    return contextlib.nullcontext(services) if services is not None else Services()
