"""The pipeline of `wbrag run`: every stage in run order, each declared beside its code (`run.Step`) and listed
here; `wbrag run` executes it, `wbrag plan` prices it. A new stage is a `Step` and its line here."""

from __future__ import annotations

from typing import Any

from wbrag_ray.build_kb import EMBED_STEP, INDEX_STEP, INGEST_STEP
from wbrag_ray.config import WbragConfig
from wbrag_ray.evaluation.evaluate import EVAL_STEP, EVAL_WRITEBACK_STEP
from wbrag_ray.run import RunFolder, Step
from wbrag_ray.stages.service import Services
from wbrag_ray.writeback.pipeline import WRITEBACK_STEP
from wbrag_ray.zerorag.grid import GRID_STEP
from wbrag_ray.zerorag.mastery import MASTERY_STEP
from wbrag_ray.zerorag.prune import PREDICT_STEP, PRUNE_STEP
from wbrag_ray.zerorag.pruners import PRUNER_STEPS
from wbrag_ray.zerorag.router import ROUTER_STEP
from wbrag_ray.zerorag.tune import TUNE_STEP

ZERO_RAG = (MASTERY_STEP, *PRUNER_STEPS, PREDICT_STEP, PRUNE_STEP, TUNE_STEP, ROUTER_STEP, GRID_STEP)
PIPELINE: list[Step] = [
    INGEST_STEP, EMBED_STEP, INDEX_STEP,  # the knowledge base
    WRITEBACK_STEP,  # WriteBack-RAG's training
    *ZERO_RAG,
    EVAL_STEP, EVAL_WRITEBACK_STEP,  # the evaluation, when Zero-RAG's grid does not evaluate
]


def instances(config: WbragConfig, only: tuple[Step, ...] | None = None) -> list[tuple[Step, dict[str, Any]]]:
    """Every (step, params) a run of `config` makes, in run order (of the steps `only`, where given)."""
    return [(step, params) for step in PIPELINE if only is None or step in only for params in step.instances(config)]


# What the run's services hold (`stages.service.Services`): a step that holds nothing else shares them
SERVICES = frozenset({"generator", "retrieval", "retrieval.query_embedder"})


def execute(folder: RunFolder, config: WbragConfig, force: bool = False, only: tuple[Step, ...] | None = None) -> None:
    """Make every stage of the run (of `only`), skipping complete ones. Consecutive steps that hold only the run's
    services share them (write-back training's generator and retrieval serve the evaluations after it, the router's
    the grid's); they end before a step that needs other CPUs or GPUs (tasks, a pool, Ray Train workers)."""
    services = Services()
    try:
        for step, params in instances(config, only):
            if not SERVICES.issuperset(step.resources):
                services.close()
                services = Services()
            step.run(folder, config, force, services, params)
    finally:
        services.close()
