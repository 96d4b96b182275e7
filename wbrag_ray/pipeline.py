"""The pipeline of `wbrag run`: every stage in run order, each declared beside its code (`run.RunStage`) and listed
here; `wbrag run` executes it, `wbrag plan` prices it. A new stage is a `RunStage` and its line here."""

from __future__ import annotations

import re
from typing import Any

from wbrag_ray.build_kb import EMBED, INDEX, INGEST
from wbrag_ray.config import WbragConfig
from wbrag_ray.evaluation.evaluate import EVALUATION, EVALUATION_WRITEBACK
from wbrag_ray.layout import subdirs
from wbrag_ray.run import RunFolder, RunStage
from wbrag_ray.stages.service import Services
from wbrag_ray.storage import sweep
from wbrag_ray.writeback.pipeline import WRITEBACK_TRAINING
from wbrag_ray.zerorag.grid import GRID
from wbrag_ray.zerorag.mastery import MASTERY
from wbrag_ray.zerorag.prune import PREDICT, PRUNE
from wbrag_ray.zerorag.pruners import PRUNERS
from wbrag_ray.zerorag.router import ROUTER
from wbrag_ray.zerorag.tune import TUNE

ZERO_RAG = (MASTERY, *PRUNERS.values(), PREDICT, PRUNE, TUNE, ROUTER, GRID)
PIPELINE: list[RunStage] = [
    INGEST, EMBED, INDEX,  # the knowledge base
    WRITEBACK_TRAINING,  # WriteBack-RAG's training
    *ZERO_RAG,
    EVALUATION, EVALUATION_WRITEBACK,  # the evaluation, when Zero-RAG's grid does not evaluate
]


def instances(config: WbragConfig, only: tuple[RunStage, ...] | None = None) -> list[tuple[RunStage, dict[str, Any]]]:
    """Every (stage, params) a run of `config` makes, in run order (of the stages `only`, where given)."""
    return [(stage, params) for stage in PIPELINE if only is None or stage in only
            for params in stage.instances(config)]


# What the run's services hold (`stages.service.Services`): a stage that holds nothing else shares them
SERVICES = frozenset({"generator", "retrieval", "retrieval.query_embedder"})


def execute(folder: RunFolder, config: WbragConfig, force: bool = False, only: tuple[RunStage, ...] | None = None) -> None:
    """Make every stage of the run (of `only`), skipping complete ones. Consecutive stages that hold only the run's
    services share them (write-back training's generator and retrieval serve the evaluations after it, the router's
    the grid's); they end before a stage that needs other CPUs or GPUs (tasks, a pool, Ray Train workers)."""
    services = Services()
    try:
        for stage, params in instances(config, only):
            if not SERVICES.issuperset(stage.resources):
                services.close()
                services = Services()
            stage.run(folder, config, force, services, params)
    finally:
        services.close()


def sweep_run(folder: RunFolder) -> None:
    """Remove what killed commits left in the run folder (`storage.sweep`: versions a commit pointer no longer
    names, files beside it) from every folder a stage of PIPELINE declares as an output, `{param}` and `<name>`
    parts matching any folder there. Every writing command runs it once it holds the run's lease."""
    for stage in PIPELINE:
        for pattern in stage.outputs:
            found = [folder.root]
            for part in pattern.split("/"):
                if "{" in part or "<" in part:
                    shape = re.compile(re.sub(r"\\\{[^}]*\\\}|<[^>]*>", ".+", re.escape(part)))
                    found = [loc.join(name) for loc in found for name in subdirs(loc) if shape.fullmatch(name)]
                else:
                    found = [loc.join(part) for loc in found]
            for loc in found:
                sweep(loc)
