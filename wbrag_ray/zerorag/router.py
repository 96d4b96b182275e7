"""Zero-RAG's query router: P(the generator answers without retrieval) from the query embedding; mastered
queries skip retrieval. Labels are the generator's closed-book correctness (with the tuned adapter if any)."""

from __future__ import annotations

import tempfile
from typing import Any

import numpy as np
import pandas as pd

from wbrag_ray import prompts
from wbrag_ray.config import WbragConfig
from wbrag_ray.formats import input_params, plain_table
from wbrag_ray.generation.passes import GeneratorPasses
from wbrag_ray.generation.stage import GenerateStage
from wbrag_ray.metrics import metric
from wbrag_ray.models.router import QueryRouter
from wbrag_ray.retrieval.stage import query_gpu_refusal, query_vectors
from wbrag_ray.run import RunFolder, RunStage
from wbrag_ray.stages.service import Services
from wbrag_ray.work import Embed, Generate, Pass, Sizes
from wbrag_ray.zerorag.tune import TUNE, train_questions, with_adapter


def train_router(run: RunFolder, config: WbragConfig, train: str | None = None, force: bool = False,
                 services: Services | None = None) -> dict[str, Any]:
    """Label training questions by closed-book correctness and train the router on their embeddings."""
    train, questions, rejected = train_questions(config.zerorag, train)

    stats = run.execute(ROUTER, config, lambda: _train(run, config, questions, rejected, services),
                        params=input_params(train, "zerorag.train"), force=force)
    print(f"query router: {stats['positives']} of {stats['rows_out']} training questions answered closed-book; "
          f"held-out accuracy {stats['val_accuracy']}, AUC {stats['val_auc']}", flush=True)
    return stats


def _train(run: RunFolder, config: WbragConfig, questions: pd.DataFrame, rejected: int,
           services: Services | None) -> dict[str, Any]:
    from sklearn.metrics import roc_auc_score

    z = config.zerorag
    query_gpu_refusal("the query router", config.embedder, config.retrieval)  # before the generator's pass
    adapter = run.is_complete(TUNE.name)
    df = questions[["id", "question", "golden_answers"]].copy()
    df["prompt"] = [prompts.dumps(prompts.no_retrieval_messages(q)) for q in df["question"]]
    with GeneratorPasses(with_adapter(run, config.generator) if adapter else config.generator, services) as passes:
        answered = passes.generate("closed_book", df, "prompt", "prediction").sort_values("id", ignore_index=True)
        actors = passes.services.actor_ids(GenerateStage.name)
        # as the evaluation's retrieval actors embed them (on their GPUs where the query embedder asks for some)
        vectors = query_vectors(answered["question"].tolist(), config.embedder, config.retrieval, passes.services)
    labels = np.array([metric(z.router_metric, p, list(g)) > 0
                       for p, g in zip(answered["prediction"], answered["golden_answers"], strict=True)])
    order = np.random.default_rng(z.seed).permutation(len(answered))
    n_val = max(1, int(round(len(order) * z.val_fraction))) if len(order) > 4 else 0
    val, fit = order[:n_val], order[n_val:]
    router = QueryRouter.train(vectors[fit], labels[fit], z.router_threshold, seed=z.seed)
    p_val = router.probability(vectors[val])
    metrics = {
        "n_train": int(len(fit)), "n_val": int(len(val)), "positives": int(labels.sum()),
        "positive_rate": round(float(labels.mean()), 4), "threshold": z.router_threshold,
        "val_accuracy": round(float(((p_val >= z.router_threshold) == labels[val]).mean()), 4) if len(val) else None,
        "val_auc": round(float(roc_auc_score(labels[val], p_val)), 4)
        if len(val) and 0 < labels[val].sum() < len(val) else None,
        "val_skip_rate": round(float((p_val >= z.router_threshold).mean()), 4) if len(val) else None,
        "adapter": adapter, "generator_calls": passes.calls,
    }
    folder = run.layout.zero_rag
    out = run.output(folder.router)  # beside the trained router while --force redoes it
    with tempfile.TemporaryDirectory() as tmp:
        router.save(tmp, {"settings": run.fingerprint(ROUTER, config), **metrics})
        out.upload_dir(tmp)
    out.join(folder.router_metrics.name).write_json(metrics)
    answered = answered.assign(label=labels, p_mastered=router.probability(vectors))
    out.join(folder.router_labels.name).write_table(plain_table(answered[["id", "question", "prediction", "label", "p_mastered"]]))
    # the stage's stats name the processes that answered; not the router's metrics
    return {"rows_in": len(questions) + rejected, "rows_out": len(answered), "rows_rejected": rejected, **metrics,
            "generator_actors": actors}


def router_work(config: WbragConfig, sizes: Sizes, params: dict[str, Any]) -> list:
    """One closed-book answer a training question (its label), and the questions' embeddings from the query
    embedder."""
    q, counted = sizes.questions(config.zerorag.train, config.zerorag.train_limit)
    return [Generate(q, (Pass(1, 0),), f"training questions: {counted}; one closed-book answer each (labels), their "
                     "embeddings from the query embedder"), Embed(q, "query")]


ROUTER = RunStage(
    "router",
    settings=("zerorag.train_limit", "generator", "zerorag.router_threshold", "zerorag.seed", "zerorag.val_fraction",
              "embedder", "zerorag.router_metric"),
    uses=(TUNE,),  # labelled with the tuned adapter when there is one
    command="wbrag train-router RUN --train PATH", work=router_work,
    run=lambda folder, config, force, services, params: train_router(folder, config, force=force, services=services),
    instances=lambda config: [{}] if config.zerorag.enabled and config.zerorag.router else [],
    resources=("generator", "retrieval.query_embedder"), outputs=("zero_rag/router",))
