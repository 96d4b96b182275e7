"""Evaluate RAG on a QA dataset: questions -> a RAG method's retrieval and generator passes -> metrics.

Methods (wbrag_ray.rag): `no-retrieval` (the closed-book baseline), `naive` (top-K retrieval, FlashRAG's
prompt), `replug` (per-document answers, weighted vote), `self-rag` (judged retrieval and relevance) and
`flare` (retrieval per unsure sentence). Settings: the base index alone, or base + a write-back index (the
active one, or a named version); `base_index` swaps the base for another index folder (a pruned one). Each
method writes RUN/eval/<name>-<method>/metrics.json and predictions.parquet.

`evaluate_methods_grid` evaluates every method on the base and beside every trained write-back version, so
a knowledge base written back under one method is measured under all the others (RUN/eval/methods_grid.json).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pyarrow as pa

from wbrag_ray.config import ConfigError, WbragConfig
from wbrag_ray.formats import read_dataset
from wbrag_ray.metrics import METRICS, score_answer
from wbrag_ray.pipelines.passes import GeneratorPasses
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
    writeback_version: str | None = None,
    passes: GeneratorPasses | None = None,
) -> dict[str, dict[str, Any]]:
    """Run every configured method over `dataset`; return {method: metrics}.

    `writeback`: search the active write-back index (or `writeback_version`) together with the base (results
    under `<name>-writeback-<method>`). `base_index`: an index folder to use instead of RUN/index (e.g. pruned).
    `router`: a query router folder (Zero-RAG); queries it calls mastered get no documents. `setting`: the
    label recorded in metrics.json (default: base or base+writeback). `label`: the results' folder prefix
    (default: the name, plus -writeback). `passes`: generator passes (and their loaded generator) shared with
    the caller's other evaluations, left open; by default the evaluation has its own.
    """
    from wbrag_ray import rag
    from wbrag_ray.index.retriever import RetrievalSetting
    from wbrag_ray.models.generator import make_generator

    methods = rag.check_methods(config.eval.methods)
    needs_index = any(m != "no-retrieval" for m in methods)
    if needs_index and base_index is None and not run.is_complete("index"):
        raise ConfigError(f"evaluation with retrieval needs the index of {run.uri}; run `wbrag index RUN` first")
    base_index = base_index or run.path("index").uri
    extra: tuple[tuple[str, str, str], ...] = ()
    default_setting, wb_version = "base", None
    if writeback or writeback_version:
        from wbrag_ray.pipelines.writeback import active_index

        wb_version, wb_index, wb_docs = active_index(run, writeback_version)
        extra, default_setting = ((wb_index, wb_docs, "writeback"),), "base+writeback"
    setting = setting or default_setting
    name = name or config.eval.name or Path(dataset.rstrip("/")).name.split(".")[0]
    folder_prefix = label or (f"{name}-writeback" if writeback else name)
    generator = make_generator(config.generator)  # fails now, not in an actor, on a bad backend or model

    t0 = time.perf_counter()
    questions, rejects = read_dataset(resolve(dataset), limit=config.eval.limit)
    if questions.num_rows == 0:
        raise ConfigError(f"dataset {dataset} has no usable questions ({rejects.num_rows} rejected)")
    search = RetrievalSetting(
        base_index, run.path("ingest").uri, config.embedder, config.retrieval, config.index.nprobe, extra, router
    ) if needs_index else None
    own = passes is None
    passes = passes or GeneratorPasses(generator.config)
    try:
        df = rag.answer(questions, methods, config, search, passes, "prediction")
    finally:
        if own:
            passes.close()
    seconds = time.perf_counter() - t0

    results: dict[str, dict[str, Any]] = {}
    for method in methods:
        part = df[df["method"] == method].sort_values("id").reset_index(drop=True)
        scores = [score_answer(p, g) for p, g in zip(part["prediction"], part["golden_answers"], strict=True)]
        for m in METRICS:
            part[m] = [s[m] for s in scores]
        out = run.path("eval", f"{folder_prefix}-{method}")
        keep = ["id", "question", "golden_answers", "method", "docs", "prompt", "slot_answers", "prediction", *METRICS,
                "retrieval_skipped", "generator_calls", "trace"]
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
            "retrieval_skipped": round(float(part["retrieval_skipped"].mean()), 4) if method != "no-retrieval" else 0.0,
            # questions the method searched for: every one for naive / replug (without a router), those judged
            # to need it for self-rag, those with an unsure sentence for flare
            "retrieval_rate": round(1 - float(part["retrieval_skipped"].mean()), 4) if method != "no-retrieval" else 0.0,
            "generator_calls": int(part["generator_calls"].sum()),
            "rag_settings": config.rag.model_dump(mode="json").get(method.replace("-", "_")),
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
    run: RunFolder, config: WbragConfig, dataset: str, name: str, label: str, force: bool = False,
    passes: GeneratorPasses | None = None, **kwargs: Any
) -> dict[str, Any]:
    """`evaluate` as a stage of the run folder (`eval-<label>`, results under RUN/eval/<label>-<method>): a
    rerun with the same settings skips it and prints the stored table again; changed settings (another
    method, threshold, write-back version, generator) evaluate again, since nothing costly is lost."""
    from wbrag_ray.run import PLACEMENT_KEYS

    stage = f"eval-{label}"
    settings = {
        "dataset": dataset, "methods": list(config.eval.methods), "limit": config.eval.limit,
        "top_k": config.retrieval.top_k, "rag": config.rag.model_dump(mode="json"),
        # where and how wide the generator runs never changes an answer: moving to a bigger cluster reuses results
        "generator": config.generator.model_dump(mode="json", exclude=PLACEMENT_KEYS), "embedder": config.embedder.model,
        **{k: v for k, v in kwargs.items() if k != "setting"},
    }
    previous = run.stats(stage) if run.is_complete(stage) else None
    if previous is not None and previous.get("settings") == settings and not force:
        print(format_table(label, previous.get("methods", {})), flush=True)
    else:
        force = True

    def work() -> dict[str, Any]:
        results = evaluate(run, config, dataset, name, label=label, passes=passes, **kwargs)
        first = next(iter(results.values()))
        return {"rows_in": first["n"] + first["rejected_questions"], "rows_out": first["n"],
                "rows_rejected": first["rejected_questions"], "methods": results, "settings": settings}

    return run.run_stage(stage, work, force=force)


def evaluate_methods_grid(
    run: RunFolder, config: WbragConfig, dataset: str, name: str | None = None, force: bool = False, **kwargs: Any
) -> dict[str, Any]:
    """Every method of `eval.methods` on the base index, and beside every trained write-back version: a
    version written back under one method is measured under the same method and under every other one.
    `kwargs` (`base_index`: a pruned index; `router`) apply to every cell (as does a generator adapter), and
    `name` then says so.

    Writes RUN/eval/methods_grid.json (rows: method, setting, version, the method the version was trained
    with, same_method, metrics and their change over the base; methods_grid-<name>.json for a Zero-RAG
    setting) and prints the table."""
    from wbrag_ray.pipelines.writeback import trained_method, versions

    name = name or config.eval.name or Path(dataset.rstrip("/")).name.split(".")[0]
    methods = list(dict.fromkeys(config.eval.methods))
    trained = {v: trained_method(run, v) for v in versions(run)}
    rows: list[dict[str, Any]] = []
    base: dict[str, dict[str, Any]] = {}
    # One generator for every cell (the retrieval service changes with the cell's write-back index).
    with GeneratorPasses(config.generator) as passes:
        for version in [None, *trained]:
            # The closed-book baseline searches nothing: once, on the base, is enough.
            evaluated = [m for m in methods if version is None or m != "no-retrieval"]
            if not evaluated:
                continue
            cfg = config.model_copy(update={"eval": config.eval.model_copy(update={"methods": evaluated})})
            label = f"{name}-grid" + (f"-wb-{version}" if version else "")
            stats = evaluate_stage(run, cfg, dataset, name, label, force=force, passes=passes, writeback_version=version,
                                   setting="base" if version is None else f"base+writeback:{version}", **kwargs)
            for method, m in stats["methods"].items():
                if version is None:
                    base[method] = m
                row = {
                    "method": method, "setting": "base" if version is None else "base+writeback", "version": version,
                    "trained_with": trained.get(version), "same_method": None if version is None else trained[version] == method,
                    "n": m["n"], **{k: m[k] for k in METRICS},
                    "retrieval_rate": m.get("retrieval_rate", 0.0), "generator_calls": m.get("generator_calls"),
                }
                if version is not None and method in base:
                    row["delta"] = {k: round(m[k] - base[method][k], 4) for k in METRICS}
                rows.append(row)
    grid = {"dataset": dataset, "name": name, "methods": methods, "versions": trained, "rows": rows, **kwargs}
    zero_rag_setting = bool(kwargs) or bool(config.generator.lora_adapter)  # pruned / routed base, tuned adapter
    run.path("eval", f"methods_grid-{name}.json" if zero_rag_setting else "methods_grid.json").write_json(grid)
    print(format_methods_grid(grid), flush=True)
    return grid


def format_methods_grid(grid: dict[str, Any], metric: str = "acc") -> str:
    """Methods down, settings across (base, then each write-back version with the method it was trained
    with); each write-back cell shows the change over the base, * where the version's method is the row's."""
    versions = grid["versions"]
    cells = {(r["method"], r["version"]): r for r in grid["rows"]}
    heads = ["base"] + [f"+wb {v} [{m}]" for v, m in versions.items()]
    width = max(16, *(len(h) + 2 for h in heads))
    lines = [f"RAG methods x knowledge base on {grid['name']} ({metric}; * = written back under the same method)",
             f"{'method':<14}" + "".join(f"{h:>{width}}" for h in heads)]
    for method in grid["methods"]:
        line = f"{method:<14}"
        for version in [None, *versions]:
            r = cells.get((method, version))
            if r is None:
                line += f"{'':>{width}}"
                continue
            text = f"{r[metric]:.3f}"
            if "delta" in r:
                text += f" ({r['delta'][metric]:+.3f}){'*' if r['same_method'] else ' '}"
            line += f"{text:>{width}}"
        lines.append(line)
    return "\n".join(lines)


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
