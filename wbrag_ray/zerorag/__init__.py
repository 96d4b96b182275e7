"""Zero-RAG, one module per step, in the order of the method: find the sentences the model already knows, and
prune them from the index.

    sampling:   a uniform, seeded sample of sentences (the same on any number of nodes)
    qa:         QA pairs of a sentence (cloze blanks or written by an LLM), parsed and scored
    mastery:    sample -> QA pairs -> the target model's closed-book answers -> mean EM per sentence
    pruners:    embedding head and / or LoRA LM regressor, trained on the scored sample, validated on a held-out part
    percentile: the corpus-wide cut (two-level histogram, only counts travel) and the keep mask
    prune:      every sentence's predicted mastery; per ratio the keep mask, pruned corpus and pruned index
    tune:       noise-tolerant LoRA tuning of the generator (relevant / distracting / no documents)
    router:     P(the generator answers without retrieval) from the query; mastered queries skip retrieval
    grid:       evaluation over pruning ratios x router x adapter x write-back, with latency and index size

The paths under RUN/zero_rag/ are named in wbrag_ray.layout (ZeroRagFolder). Each stage is a declared RunStage:
its settings never count as a changed run config; a complete stage refuses to be reused with others (pass
--force to redo it and the stages after it).
"""

from __future__ import annotations

from typing import Any

from wbrag_ray.config import WbragConfig
from wbrag_ray.run import RunFolder


def run_zero_rag(run: RunFolder, config: WbragConfig, force: bool = False) -> None:
    """The whole chain after the index: mastery -> pruners -> prediction -> every ratio -> [tune] -> [router]
    -> the evaluation grid (when eval.dataset is set)."""
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
    # The router's closed-book answers and the grid on one generator service: its actors, started for the
    # router, go on to the grid's cells (a model or adapter the cells need next loads in the same processes).
    with Services() as services:
        if config.zerorag.router:
            train_router(run, config, force=force, services=services)
        if config.eval.dataset:
            evaluate_grid(run, config, config.eval.dataset, force=force, services=services)


__all__: list[Any] = ["run_zero_rag"]
