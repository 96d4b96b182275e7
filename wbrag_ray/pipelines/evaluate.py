"""Evaluate RAG on a QA dataset: [retrieve top K] -> prompt -> generate -> metrics, per method.

Methods (wbrag_ray.rag): `naive` (top-K retrieval, FlashRAG's prompt), `replug` (per-document answers,
weighted vote) and `no-retrieval` (the closed-book baseline). Settings: the base index alone, or base +
the active write-back index (`writeback=True`); `base_index` swaps the base for another index folder (a
pruned one). Each method writes RUN/eval/<name>-<method>/metrics.json and predictions.parquet.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pyarrow as pa

from wbrag_ray.config import ConfigError, WbragConfig
from wbrag_ray.formats import read_dataset
from wbrag_ray.metrics import METRICS, score_answer
from wbrag_ray.run import RunFolder
from wbrag_ray.storage import resolve


def evaluate(
    run: RunFolder,
    config: WbragConfig,
    dataset: str,
    name: str | None = None,
    writeback: bool = False,
    base_index: str | None = None,
    router: str | None = None,
    setting: str | None = None,
    label: str | None = None,
) -> dict[str, dict[str, Any]]:
    """Run every configured method over `dataset`; return {method: metrics}.

    `writeback`: search the active write-back index together with the base (results under
    `<name>-writeback-<method>`). `base_index`: an index folder to use instead of RUN/index (e.g. pruned).
    `router`: a query router folder (Zero-RAG); queries it calls mastered get no documents. `setting`: the
    label recorded in metrics.json (default: base or base+writeback). `label`: the results' folder prefix
    (default: the name, plus -writeback).
    """
    import ray.data

    from wbrag_ray import rag
    from wbrag_ray.index.retriever import RetrieveStage
    from wbrag_ray.models.generator import make_generator
    from wbrag_ray.ray_runtime import LIGHT_CPUS
    from wbrag_ray.stages.base import apply_stage

    methods = list(dict.fromkeys(config.eval.methods))
    needs_index = any(m != "no-retrieval" for m in methods)
    if needs_index and base_index is None and not run.is_complete("index"):
        raise ConfigError(f"evaluation with retrieval needs the index of {run.uri}; run `wbrag index RUN` first")
    base_index = base_index or run.path("index").uri
    extra: tuple[tuple[str, str, str], ...] = ()
    default_setting, wb_version = "base", None
    if writeback:
        from wbrag_ray.pipelines.writeback import active_index

        wb_version, wb_index, wb_docs = active_index(run)
        extra, default_setting = ((wb_index, wb_docs, "writeback"),), "base+writeback"
    setting = setting or default_setting
    name = name or config.eval.name or Path(dataset.rstrip("/")).name.split(".")[0]
    folder_prefix = label or (f"{name}-writeback" if writeback else name)
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
                base_index, run.path("ingest").uri, config.embedder, config.retrieval, config.index.nprobe, extra,
                router_dir=router,
            ),
        )
    expand_args = {"methods": methods, "temperature": config.retrieval.replug_temperature}
    ds = ds.map_batches(rag.expand, fn_kwargs=expand_args, batch_format="pandas", num_cpus=LIGHT_CPUS)
    ds = generator.apply(ds, "prompt", "prediction")
    df = rag.combine(ds.to_pandas(), "prediction")
    seconds = time.perf_counter() - t0

    results: dict[str, dict[str, Any]] = {}
    for method in methods:
        part = df[df["method"] == method].sort_values("id").reset_index(drop=True)
        scores = [score_answer(p, g) for p, g in zip(part["prediction"], part["golden_answers"], strict=True)]
        for m in METRICS:
            part[m] = [s[m] for s in scores]
        out = run.path("eval", f"{folder_prefix}-{method}")
        keep = ["id", "question", "golden_answers", "method", "docs", "prompt", "slot_answers", "prediction", *METRICS]
        keep += ["retrieval_skipped"] if "retrieval_skipped" in part else []
        # No pandas metadata: readers with another pandas version (or none) get plain Arrow types.
        table = pa.Table.from_pandas(part[keep], preserve_index=False).replace_schema_metadata(None)
        out.join("predictions.parquet").write_table(table)
        metrics = {
            "n": len(part),
            **{m: round(float(part[m].mean()), 4) for m in METRICS},
            "method": method,
            "setting": setting,
            "writeback_version": wb_version if method != "no-retrieval" else None,
            "dataset": dataset,
            "rejected_questions": rejects.num_rows,
            "top_k": config.retrieval.top_k if method != "no-retrieval" else 0,
            "index": base_index if method != "no-retrieval" else None,
            "router": router if method != "no-retrieval" else None,
            "retrieval_skipped": round(float(part["retrieval_skipped"].mean()), 4)
            if "retrieval_skipped" in part and method != "no-retrieval" else 0.0,
            "generator": config.generator.model_dump(mode="json"),
            "embedder": config.embedder.model,
            "seconds": round(seconds, 2),
        }
        out.join("metrics.json").write_json(metrics)
        if rejects.num_rows:
            out.join("rejects.parquet").write_table(rejects)
        results[method] = metrics
    print(format_table(f"{folder_prefix} ({setting})", results), flush=True)
    return results


def evaluate_stage(
    run: RunFolder, config: WbragConfig, dataset: str, name: str, label: str, force: bool = False, **kwargs: Any
) -> dict[str, Any]:
    """`evaluate` as a stage of the run folder (`eval-<label>`, results under RUN/eval/<label>-<method>): a
    rerun skips it and prints the stored table again."""
    stage = f"eval-{label}"
    if run.is_complete(stage) and not force:
        done = {v["method"]: v for k, v in load_results(run).items() if k == f"{label}-{v.get('method')}"}
        print(format_table(label, done), flush=True)

    def work() -> dict[str, Any]:
        results = evaluate(run, config, dataset, name, label=label, **kwargs)
        first = next(iter(results.values()))
        return {"rows_in": first["n"] + first["rejected_questions"], "rows_out": first["n"],
                "rows_rejected": first["rejected_questions"], "methods": results}

    return run.run_stage(stage, work, force=force)


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
