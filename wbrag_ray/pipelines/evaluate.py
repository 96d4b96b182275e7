"""Evaluate RAG on a QA dataset: [retrieve top K] -> prompt -> generate -> metrics, per method.

Methods: `naive` (top-K retrieval, FlashRAG's prompt) and `no-retrieval` (the closed-book baseline).
Each method writes RUN/eval/<name>-<method>/metrics.json and predictions.parquet.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa

from wbrag_ray.config import ConfigError, WbragConfig
from wbrag_ray.formats import read_dataset
from wbrag_ray.metrics import METRICS, score_answer
from wbrag_ray.run import RunFolder
from wbrag_ray.storage import resolve


def _prompts(batch: pd.DataFrame, methods: list[str]) -> pd.DataFrame:
    """One row per (question, method), with the prompt that method sends."""
    from wbrag_ray import prompts
    from wbrag_ray.index.retriever import hits_from_json

    parts = []
    for method in methods:
        part = batch.copy()
        part["method"] = method
        if method == "no-retrieval":
            part["docs"] = "[]"
            part["prompt"] = [prompts.dumps(prompts.no_retrieval_messages(q)) for q in batch["question"]]
        else:
            part["prompt"] = [
                prompts.dumps(prompts.rag_messages(q, hits_from_json(d)))
                for q, d in zip(batch["question"], batch["docs"], strict=True)
            ]
        parts.append(part)
    return pd.concat(parts, ignore_index=True)


def evaluate(run: RunFolder, config: WbragConfig, dataset: str, name: str | None = None) -> dict[str, dict[str, Any]]:
    """Run every configured method over `dataset`; return {method: metrics}."""
    import ray.data

    from wbrag_ray.index.retriever import RetrieveStage
    from wbrag_ray.models.generator import make_generator
    from wbrag_ray.ray_runtime import LIGHT_CPUS
    from wbrag_ray.stages.base import apply_stage

    methods = list(dict.fromkeys(config.eval.methods))
    needs_index = any(m != "no-retrieval" for m in methods)
    if needs_index and not run.is_complete("index"):
        raise ConfigError(f"evaluation with retrieval needs the index of {run.uri}; run `wbrag index RUN` first")
    name = name or config.eval.name or Path(dataset.rstrip("/")).name.split(".")[0]
    generator = make_generator(config.generator)  # fails now, not in an actor, on a bad backend or model

    t0 = time.perf_counter()
    questions, rejects = read_dataset(resolve(dataset), limit=config.eval.limit)
    if questions.num_rows == 0:
        raise ConfigError(f"dataset {dataset} has no usable questions ({rejects.num_rows} rejected)")
    ds = ray.data.from_arrow(questions)
    if needs_index:
        ds = apply_stage(
            ds,
            RetrieveStage(
                run.path("index").uri, run.path("ingest").uri, config.embedder, config.retrieval, config.index.nprobe
            ),
        )
    ds = ds.map_batches(_prompts, fn_kwargs={"methods": methods}, batch_format="pandas", num_cpus=LIGHT_CPUS)
    ds = generator.apply(ds, "prompt", "prediction")
    df = ds.to_pandas()
    seconds = time.perf_counter() - t0

    results: dict[str, dict[str, Any]] = {}
    for method in methods:
        part = df[df["method"] == method].sort_values("id").reset_index(drop=True)
        scores = [score_answer(p, g) for p, g in zip(part["prediction"], part["golden_answers"], strict=True)]
        for m in METRICS:
            part[m] = [s[m] for s in scores]
        out = run.path("eval", f"{name}-{method}")
        keep = ["id", "question", "golden_answers", "method", "docs", "prompt", "prediction", *METRICS]
        # No pandas metadata: readers with another pandas version (or none) get plain Arrow types.
        table = pa.Table.from_pandas(part[keep], preserve_index=False).replace_schema_metadata(None)
        out.join("predictions.parquet").write_table(table)
        metrics = {
            "n": len(part),
            **{m: round(float(part[m].mean()), 4) for m in METRICS},
            "method": method,
            "dataset": dataset,
            "rejected_questions": rejects.num_rows,
            "top_k": config.retrieval.top_k if method != "no-retrieval" else 0,
            "index": run.path("index").uri if method != "no-retrieval" else None,
            "generator": config.generator.model_dump(mode="json"),
            "embedder": config.embedder.model,
            "seconds": round(seconds, 2),
        }
        out.join("metrics.json").write_json(metrics)
        if rejects.num_rows:
            out.join("rejects.parquet").write_table(rejects)
        results[method] = metrics
    print(format_table(name, results), flush=True)
    return results


def format_table(name: str, results: dict[str, dict[str, Any]]) -> str:
    lines = [f"results on {name}", f"{'method':<16}{'n':>6}{'em':>8}{'f1':>8}{'acc':>8}"]
    for method, m in results.items():
        lines.append(f"{method:<16}{m['n']:>6}{m['em']:>8.3f}{m['f1']:>8.3f}{m['acc']:>8.3f}")
    return "\n".join(lines)


def load_results(run: RunFolder) -> dict[str, dict[str, Any]]:
    """Every metrics.json under RUN/eval, by folder name."""
    base = run.path("eval")
    if not base.exists():
        return {}
    import pyarrow.fs as pafs

    out = {}
    for info in sorted(base.fs.get_file_info(pafs.FileSelector(base.path)), key=lambda i: i.base_name):
        m = base.join(info.base_name, "metrics.json")
        if m.exists():
            out[info.base_name] = m.read_json()
    return out
