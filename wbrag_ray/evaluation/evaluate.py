"""Evaluate RAG on a QA dataset: questions -> a method's retrieval and generator passes -> metrics, on the base
index, a pruned one (`base_index`), or base + a write-back index; each method writes RUN/eval/<label>-<method>/."""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, replace
from typing import Any

import pandas as pd

from wbrag_ray import rag
from wbrag_ray.build_kb import INDEX
from wbrag_ray.config import WbragConfig
from wbrag_ray.evaluation.made_by import made_by, made_config, own_adapter, searched_union
from wbrag_ray.evaluation.short_answer import short_answer
from wbrag_ray.evaluation.stage import EVAL, dataset_name, eval_params, union_settings
from wbrag_ray.formats import plain_table, read_questions
from wbrag_ray.generation.backends import make_generator
from wbrag_ray.generation.passes import GeneratorPasses
from wbrag_ray.layout import EvalResult
from wbrag_ray.metrics import METRICS, score_answer
from wbrag_ray.papers import run_departures
from wbrag_ray.retrieval.stage import RetrievalSetting
from wbrag_ray.retrieval.union import UnionRule
from wbrag_ray.run import RunFolder, RunStage
from wbrag_ray.storage import commit, sweep
from wbrag_ray.work import Generate, Sizes
from wbrag_ray.writeback.versions import active_index


def evaluate(run: RunFolder, config: WbragConfig, dataset: str, label: str, writeback: bool = False,
             base_index: str | None = None, router: str | None = None, setting: str | None = None,
             writeback_version: str | None = None, passes: GeneratorPasses | None = None) -> dict[str, dict[str, Any]]:
    """Run every configured method over `dataset` into RUN/eval/<label>-<method>/; return {method: metrics}.
    `writeback`: search the active (or `writeback_version`) write-back index with the base; `base_index`: another
    index folder; `router`: a query router folder; `passes`: shared generator passes, left open."""
    methods = rag.check_methods(config.eval.methods)
    needs_index = any(m != "no-retrieval" for m in methods)
    if needs_index and base_index is None:
        run.require(INDEX)
    base_index = base_index or run.layout.index.uri
    extra: tuple[tuple[str, str | None, str], ...] = ()
    default_setting, wb_version = "base", None
    if writeback or writeback_version:
        wb_version, wb_index, wb_docs = active_index(run, writeback_version)
        extra, default_setting = ((wb_index, wb_docs, "writeback"),), "base+writeback"
    setting = setting or default_setting
    generator = make_generator(config.generator)  # fails now, not in an actor, on a bad backend or model
    # the papers this evaluation follows
    zero_rag = base_index != run.layout.index.uri or bool(router) or bool(config.generator.lora_adapter)
    # from what made the results: the version's and the adapter's recorded settings, not this config's
    made, facts = made_config(run, config, wb_version, own_adapter(run, config), zero_rag)
    papers, departed = facts.papers, run_departures(made, dataset=dataset, made=facts)

    searched = searched_union(run, config, wb_version) if wb_version else None
    t0 = time.perf_counter()
    questions, rejects = read_questions(dataset, "dataset", limit=config.eval.limit)
    search = (RetrievalSetting(base_index, None, config.embedder, config.retrieval, config.index, extra, router)
              if needs_index else None)
    shared = passes is not None
    with contextlib.nullcontext(passes) if passes else GeneratorPasses(generator.config) as passes:  # given: left open
        # a caller's shared passes may search again; this evaluation's own end their search before generating
        df = rag.answer(questions, methods, config, search, passes, "prediction", keep_search=shared)
    seconds = time.perf_counter() - t0

    results: dict[str, dict[str, Any]] = {}
    staged: list[EvalResult] = []
    for method in methods:
        part = df[df["method"] == method].sort_values("id").reset_index(drop=True)
        part["answer"] = scored_answers(part, config.eval.answer_form)
        scores = [score_answer(a, g) for a, g in zip(part["answer"], part["golden_answers"], strict=True)]
        for m in METRICS:
            part[m] = [s[m] for s in scores]
        # results that exist are replaced by the next version, committed once every method's is written (a cut-short
        # run leaves the old); first ones are written in place, metrics.json last (a folder without it is not listed)
        final = run.layout.eval_result(label, method)
        sweep(final.root)  # what a kill after a commit left behind
        out = run.layout.eval_staging(label, method) if final.metrics.exists() else final
        out.root.delete()  # one left by an evaluation cut short
        if out is not final:
            staged.append(out)
        keep = ["id", "question", "golden_answers", "method", "docs", "prompt", "slot_answers", "prediction", "answer",
                *METRICS, "retrieval_skipped", "generator_calls", "trace"]
        out.predictions.write_table(plain_table(part[keep]))
        metrics = {
            "n": len(part),
            **{m: round(float(part[m].mean()), 4) for m in METRICS},
            # how long the scored answers are: acc rewards long ones, exact match short ones
            "answer_words": round(float(part["answer"].str.split().str.len().mean()), 2) if len(part) else 0.0,
            "answer_form": config.eval.answer_form or "as generated",
            "method": method,
            "setting": setting,
            "writeback_version": wb_version if method != "no-retrieval" else None,
            "union": union_settings(config) if wb_version and method != "no-retrieval" else None,
            # the rule the searches used: under `auto`, the one the version chose (retrieval.union), read beside its index
            "union_searched": searched if method != "no-retrieval" else None,
            "dataset": dataset,
            "rejected_questions": rejects.num_rows,
            "top_k": config.retrieval.top_k if method != "no-retrieval" else 0,
            "index": base_index if method != "no-retrieval" else None,
            "router": router if method != "no-retrieval" else None,
            "retrieval_skipped": round(float(part["retrieval_skipped"].mean()), 4) if method != "no-retrieval" else 0.0,
            # questions the method searched for
            "retrieval_rate": round(1 - float(part["retrieval_skipped"].mean()), 4) if method != "no-retrieval" else 0.0,
            "generator_calls": int(part["generator_calls"].sum()),
            "rag_settings": config.rag.model_dump(mode="json").get(method.replace("-", "_")),
            "generator": config.generator.model_dump(mode="json"),
            "embedder": config.embedder.model,
            "papers": list(papers),
            "departures": [asdict(d) for d in departed],
            "seconds": round(seconds, 2),
        }
        metrics["made_by"] = made_by(run, config, dataset, len(part), method, wb_version, base_index, router)
        if rejects.num_rows:
            out.rejects.write_table(rejects)
        out.metrics.write_json(metrics)
        results[method] = metrics
    for out in staged:
        commit(out.root)
    print(format_table(f"{label} ({setting})", results), flush=True)
    return results


def scored_answers(part: pd.DataFrame, form: str | None) -> list[str]:
    """What the metrics score: the generated text, or its answer span (`eval.answer_form: span`)."""
    if form == "span":
        return [short_answer(p, q) for p, q in zip(part["prediction"], part["question"], strict=True)]
    return part["prediction"].tolist()


def evaluate_stage(run: RunFolder, config: WbragConfig, dataset: str, label: str, force: bool = False,
                   passes: GeneratorPasses | None = None, **kwargs: Any) -> dict[str, Any]:
    """`evaluate` as a run-folder stage: a rerun with the same settings prints the stored table; methods the
    complete evaluation of the same settings lacks are answered alone and added to it."""
    params = eval_params(label, dataset, kwargs, config, run)
    name = EVAL.instance(params)
    stored = {} if force or not run.is_complete(name) else (run.stats(name) or {}).get("methods", {})
    missing = [m for m in config.eval.methods if m not in stored]
    if stored and missing:
        run.check(EVAL, config, params)  # other settings than the stored methods' are still refused
        print(f"[{name}] adding {', '.join(missing)} to the stored {', '.join(stored)}", flush=True)
        config = config.model_copy(update={"eval": config.eval.model_copy(update={"methods": missing})})

    def work() -> dict[str, Any]:
        results = evaluate(run, config, dataset, label, passes=passes, **kwargs)
        first = next(iter(results.values()))
        return {"rows_in": first["n"] + first["rejected_questions"], "rows_out": first["n"],
                "rows_rejected": first["rejected_questions"], "methods": {**stored, **results}}

    stats = run.execute(EVAL, config, work, params=params, force=force or bool(stored and missing),
                        on_skip=lambda stats: print(format_table(label, stats.get("methods", {})), flush=True))
    if stored and missing:
        print(format_table(f"{label}, every method", stats["methods"]), flush=True)
    return stats


def format_table(name: str, results: dict[str, dict[str, Any]]) -> str:
    lines = [f"results on {name}", f"{'method':<16}{'n':>6}{'em':>8}{'f1':>8}{'acc':>8}"]
    for method, m in results.items():
        lines.append(f"{method:<16}{m['n']:>6}{m['em']:>8.3f}{m['f1']:>8.3f}{m['acc']:>8.3f}")
    return "\n".join(lines)


def load_results(run: RunFolder) -> dict[str, dict[str, Any]]:
    """Every evaluated method's metrics under RUN/eval, by folder name."""
    return {r.root.name: r.metrics.read_json() for r in run.layout.eval_results()}  # each with its metrics


def _evaluation(writeback: bool) -> RunStage:
    """The base evaluation (or the one beside the write-back index) that `wbrag run` makes: when eval.dataset is set
    and Zero-RAG's grid does not evaluate instead."""
    def instances(config: WbragConfig) -> list[dict[str, Any]]:
        c = config
        if not c.eval.dataset or c.zerorag.enabled or (writeback and not (c.writeback.train and c.writeback.evaluate)):
            return []
        name = dataset_name(c, c.eval.dataset)
        return [{"label": f"{name}-writeback" if writeback else name}]

    def work(config: WbragConfig, sizes: Sizes, params: dict[str, Any]) -> list[Generate]:
        ev, k = config.eval, config.retrieval.top_k
        q, counted = sizes.questions(ev.dataset, ev.limit)
        passes = [p for m in ev.methods for p in rag.passes(m, config)]
        extra = UnionRule.of(config.retrieval).appended_units if writeback else 0
        if extra:  # the prompts that read the top K read its units too
            passes = [replace(p, docs=p.docs + extra) if p.docs == k and not p.mixture else p for p in passes]
        return [Generate(q, tuple(passes), f"questions: {counted}; methods {', '.join(ev.methods)}: up to "
                         f"{sum(p.calls for p in passes):g} calls a question"
                         + (f"; the additive union: up to {k} + {extra} documents a prompt" if extra else ""),
                         retrieval=any(m != "no-retrieval" for m in ev.methods))]

    def run_it(folder: RunFolder, config: WbragConfig, force: bool, services: Any,
               params: dict[str, Any]) -> dict[str, Any]:
        return evaluate_stage(folder, config, config.eval.dataset, params["label"], force=force, writeback=writeback,
                              passes=GeneratorPasses(config.generator, services))

    return replace(EVAL, title="evaluation with write-back" if writeback else "evaluation", work=work, run=run_it,
                   instances=instances, resources=("generator", "retrieval"), outputs=("eval/{label}-<method>",))


EVALUATION, EVALUATION_WRITEBACK = _evaluation(False), _evaluation(True)
