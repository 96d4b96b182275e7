"""Stage services: a stage's workers set up once and used by every pass that needs them.

`apply_stage` gives each pass an actor pool of its own: every actor is a new worker process that imports torch
and transformers (or sentence-transformers) and loads its model or opens its index in `setup`, and the pool
ends with the pass. For a bulk stage over millions of rows that start is nothing. For the short passes the RAG
methods alternate (Self-RAG: retrieval judgement, search, relevance judgement, answer; FLARE: look-ahead,
search, rewrite per round), write-back's gates and distiller, mastery's QA writer and target, and grids of
evaluations, it was most of the time: a 6-row pass of a tiny generator took 8-14 s on 2 busy cores, the
generation in it 0.2 s.

A `StageService` holds `resources.concurrency` actors that ran `setup` once. A pass through it is a Ray Data
`map_batches` of light tasks, each sending its batch to one of the actors and returning the answer, so passes
still stream and compose with the rest of a pipeline. Every pass sends its own stage object (its columns,
mode, token budget); the actor lends it what the set-up stage holds (`Stage.adopt`). Stages with equal
`service_key`s share a service.

`Services` is the set one command owns (`GeneratorPasses.services`): a service starts on its first pass and
ends at `close()` (or when its owner is garbage-collected: Ray ends actors whose handles are gone). One
service per stage kind (`Stage.name`) lives at a time, so two generator roles (mastery's QA writer and target
model) never hold two model actors' CPUs at once, and a command closes its services before it runs stages
that need those CPUs (embedding, index builds).
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

from wbrag_ray.stages.base import Stage, apply_stage, process_checked

if TYPE_CHECKING:
    import ray.data

log = logging.getLogger(__name__)


class _ServiceWorker:
    """A service's actor: the stage set up once; each call runs a pass's own stage on what it loaded."""

    def __init__(self, stage: Stage):
        from wbrag_ray.models.hardware import set_threads

        set_threads(stage.resources.threads or stage.resources.num_cpus)
        stage.setup()
        self.loaded = stage

    def run(self, stage: Stage, batch):
        stage.adopt(self.loaded)
        return process_checked(stage, batch)


def _forward(batch, actors: list, stage: Stage):
    """A Ray Data task: send the batch to one of the service's actors and return its answer. (A task blocked
    on `ray.get` gives its CPU back to Ray while it waits.)"""
    import random

    import ray

    return ray.get(random.choice(actors).run.remote(stage, batch))


class StageService:
    """The set-up actors of one stage kind and service key."""

    def __init__(self, stage: Stage):
        import ray

        self.name = stage.name
        self.key = stage.service_key()
        res = stage.resources
        # A lost actor (a node gone) is started again and its call retried: setup runs again there.
        remote = ray.remote(num_cpus=res.num_cpus, num_gpus=res.num_gpus or None, max_restarts=3,
                            max_task_retries=3)(_ServiceWorker)
        self.actors = [remote.remote(stage) for _ in range(res.concurrency)]

    def apply(self, ds: ray.data.Dataset, stage: Stage) -> ray.data.Dataset:
        from wbrag_ray.ray_runtime import LIGHT_CPUS

        return ds.map_batches(_forward, fn_args=(self.actors, stage), batch_format=stage.batch_format,
                              batch_size=stage.resources.batch_size, num_cpus=LIGHT_CPUS)

    def close(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor)
        self.actors = []


class Services:
    """The stage services of one command, at most one per stage kind; a context manager that closes them."""

    def __init__(self) -> None:
        self._live: dict[str, StageService] = {}
        self.started: dict[str, int] = {}  # services started per stage kind (what a pass reuse saves)

    def apply(self, ds: ray.data.Dataset, stage: Stage) -> ray.data.Dataset:
        """`ds` through `stage`: on the stage's service when it has a service key (started on first use,
        replacing a live service of the same kind with another key), else as a pass of its own."""
        key: Hashable | None = stage.service_key()
        if key is None:
            return apply_stage(ds, stage)
        service = self._live.get(stage.name)
        if service is None or service.key != key:
            if service is not None:
                service.close()
            service = self._live[stage.name] = StageService(stage)
            self.started[stage.name] = self.started.get(stage.name, 0) + 1
            log.info("started the %s service (%d actors)", stage.name, len(service.actors))
        return service.apply(ds, stage)

    def close(self) -> None:
        for service in self._live.values():
            service.close()
        self._live.clear()

    def __enter__(self) -> Services:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
