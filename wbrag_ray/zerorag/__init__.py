"""Zero-RAG, one module per step: sampling, qa, mastery, pruners, percentile, prune, tune, router and grid (the
evaluation over ratios x router x adapter x write-back). Each step is a declared RunStage; paths under
RUN/zero_rag/ are named in wbrag_ray.layout (ZeroRagFolder)."""

from __future__ import annotations

from typing import Any

from wbrag_ray.config import WbragConfig
from wbrag_ray.run import RunFolder


def run_zero_rag(run: RunFolder, config: WbragConfig, force: bool = False) -> None:
    """The chain after the index: mastery -> pruners -> prediction -> every ratio -> [tune] -> [router] -> grid."""
    from wbrag_ray.stages.service import Services
    from wbrag_ray.zerorag.grid import evaluate_grid
    from wbrag_ray.zerorag.mastery import mastery
    from wbrag_ray.zerorag.prune import predict, prune
    from wbrag_ray.zerorag.pruners import train_pruner
    from wbrag_ray.zerorag.router import train_router
    from wbrag_ray.zerorag.tune import tune

    mastery(run, config, force=force)
    train_pruner(run, config, force=force)
    predict(run, config, force=force)
    for ratio in config.zerorag.ratios:
        if ratio > 0:
            prune(run, config, ratio, force=force)
    if config.zerorag.tune.enabled:
        tune(run, config, force=force)
    # The router's closed-book answers and the grid share one generator service.
    with Services() as services:
        if config.zerorag.router:
            train_router(run, config, force=force, services=services)
        if config.eval.dataset:
            evaluate_grid(run, config, config.eval.dataset, force=force, services=services)


__all__: list[Any] = ["run_zero_rag"]
