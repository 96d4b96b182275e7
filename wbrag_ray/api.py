"""The library API: what the `wbrag` command and the job entry points call, and what a Python user calls.

Every function takes a run folder (a path, an s3:// URI or a RunFolder) and a resolved config (`load_config`),
and returns plain dicts. Each checks what it can before Ray starts (inputs, ranges, names, the stages it reads, a
changed setting); an error a person can fix is a `ConfigError` whose message says the fix.

    from wbrag_ray import api
    from wbrag_ray.config import load_config

    config = load_config("jobs/configs/demo.yaml")
    api.build_kb("runs/demo", config)
    api.evaluate("runs/demo", config, "questions.jsonl")
"""

from __future__ import annotations

import os
from importlib import resources
from typing import Any

from wbrag_ray import build_kb as kb
from wbrag_ray.build_kb import INDEX
from wbrag_ray.config import ConfigError, WbragConfig, load_config
from wbrag_ray.evaluation.evaluate import evaluate_stage
from wbrag_ray.evaluation.made_by import made_config
from wbrag_ray.evaluation.methods_grid import evaluate_methods_grid
from wbrag_ray.evaluation.stage import EVAL, dataset_name, eval_params
from wbrag_ray.export import export_kb
from wbrag_ray.formats import input_files
from wbrag_ray.index.files import load_manifest
from wbrag_ray.layout import plain_name
from wbrag_ray.papers import format_paper_vs_run, print_departures
from wbrag_ray.pipeline import execute
from wbrag_ray.plan.against_run import record_plan
from wbrag_ray.report import write_report
from wbrag_ray.report.paper_rows import run_paper_rows
from wbrag_ray.retrieval.local import load_query_embedder
from wbrag_ray.run import RunFolder, RunStage

# a command's session, part of the API: `api.start(run, config)` opens a run folder and joins Ray
from wbrag_ray.session import RunLike, check_model_shapes, join_ray, open_run, start  # noqa: F401
from wbrag_ray.stages.service import Services
from wbrag_ray.storage import resolve
from wbrag_ray.writeback.pipeline import train_writeback as train_version
from wbrag_ray.writeback.sweep import format_sweep, gate_sweep
from wbrag_ray.writeback.versions import (
    activate,
    active_index,
    default_version,
    read_active,
    rollback,
    versions,
)
from wbrag_ray.zerorag.grid import eval_label, evaluate_grid
from wbrag_ray.zerorag.mastery import MASTERY
from wbrag_ray.zerorag.mastery import mastery as score
from wbrag_ray.zerorag.prune import index_for_ratio, predict, predict_stage
from wbrag_ray.zerorag.prune import prune as prune_at
from wbrag_ray.zerorag.pruners import train_pruner as train
from wbrag_ray.zerorag.router import ROUTER
from wbrag_ray.zerorag.router import train_router as train_it
from wbrag_ray.zerorag.tune import TUNE, with_adapter
from wbrag_ray.zerorag.tune import tune as tune_adapter


def existing_run(run: RunLike) -> RunFolder:
    """A run folder a command only reads or edits (a report, a version switch): refused unless it is a run."""
    run = open_run(run)
    run.require_run()
    return run


def check_input(path: str, what: str) -> None:
    """An input file or folder exists and holds .jsonl / .parquet files: checked before Ray starts."""
    input_files(resolve(path), what)


def check_ratio(ratio: float, flag: str) -> None:
    if not 0 <= ratio < 1:
        raise ConfigError(f"{flag} {ratio:g} is out of range: a pruning ratio is the fraction of sentences dropped, "
                          "at least 0 and below 1 (e.g. 0.3)")


# --- the knowledge base ------------------------------------------------------------------------------------

BUILD_STEPS = ("ingest", "embed", "index")


def build_kb(run: RunLike, config: WbragConfig, force: bool = False,
             steps: tuple[str, ...] = BUILD_STEPS) -> dict[str, dict[str, Any]]:
    """ingest -> embed -> index (or the named `steps` of them), skipping complete stages."""
    unknown = set(steps) - set(BUILD_STEPS)
    if unknown:
        raise ConfigError(f"unknown build steps {sorted(unknown)}; choose from {', '.join(BUILD_STEPS)}")
    run = open_run(run)
    # refused before a Ray cluster is started for nothing
    first = next(step for step in BUILD_STEPS if step in steps)
    if "index" in steps:  # a string faiss cannot parse is named as such, before "another factory: --force"
        kb.check_factory(run, config)
    if first == "ingest":
        run.check(kb.INGEST, config, kb.corpus_params(config, run, force), force=force)
    else:
        run.check(getattr(kb, first.upper()), config, force=force)
    run = start(run, config, force)
    return {step: getattr(kb, step)(run, config, force=force) for step in BUILD_STEPS if step in steps}


def search(run: RunLike, config: WbragConfig, queries: list[str], k: int = 5):
    """The top `k` hits of each query on the run's index (embedded here, searched by the retrieval service)."""
    if k < 1:
        raise ConfigError(f"-k {k}: the number of documents per query must be at least 1")
    if not queries or any(not q.strip() for q in queries):
        raise ConfigError("an empty query: pass the text to search for, --query 'highest mountain in Europe'")
    run = existing_run(run)
    run.require(INDEX)
    join_ray(run, config)
    with Services() as services:
        service = services.retrieval(((run.layout.index.uri, None, "base"),), config.index, config.retrieval)
        embedder = load_query_embedder(config.embedder, service.dim, run.layout.index.uri)
        return service.search_vectors(embedder.encode_queries(queries), k)


# --- evaluation --------------------------------------------------------------------------------------------


def evaluate(run: RunLike, config: WbragConfig, dataset: str | None = None, name: str | None = None, *,
             writeback: bool = False, prune_ratio: float | None = None, router: bool = False, adapter: bool = False,
             methods_grid: bool = False, same_writeback: bool = False, force: bool = False) -> dict[str, Any]:
    """Evaluate eval.methods on `dataset` (default eval.dataset): on the base index, beside the active write-back
    index, or in a Zero-RAG setting (`prune_ratio`, `router`, `adapter`). `methods_grid`: every method on the base
    and beside every write-back version (`same_writeback`: first train one per method). Returns {method: metrics}
    (the grid for `methods_grid`). Other settings under the same name are refused unless `force`."""
    if methods_grid and writeback:
        raise ConfigError("--methods-grid already evaluates beside every trained write-back version: drop --writeback")
    if same_writeback and not methods_grid:
        raise ConfigError("--same-writeback trains a write-back version per method for a methods grid: "
                          "add --methods-grid")
    if same_writeback and not config.writeback.train:
        raise ConfigError("--same-writeback trains a version per method from writeback.train: set it "
                          "(--set writeback.train=PATH)")
    run, dataset = _evaluated(run, config, dataset)
    name = plain_name(dataset_name(config, dataset) if name is None else name, "--name (eval.name)")
    kwargs: dict[str, Any] = {}
    if prune_ratio is not None:
        check_ratio(prune_ratio, "--prune-ratio")
        kwargs["base_index"] = index_for_ratio(run, prune_ratio).uri
    elif any(m != "no-retrieval" for m in config.eval.methods) or methods_grid:
        run.require(INDEX)
    if router:
        run.require(ROUTER)
        kwargs["router"] = run.layout.zero_rag.router.uri
    if adapter:
        config = config.model_copy(update={"generator": with_adapter(run, config.generator)})
    label = None
    if prune_ratio is not None or router or adapter:  # a Zero-RAG setting: name it after them all
        label = eval_label(name, prune_ratio, writeback, router, adapter)
    version = active_index(run)[0] if writeback else None  # the version searched is part of the results
    made, facts = made_config(run, config, version, bool(adapter), prune_ratio is not None or bool(router),
                              writeback=methods_grid)
    print_departures(made, dataset=dataset, made=facts)
    if methods_grid:
        if same_writeback:  # before Ray starts, as every input
            check_input(config.writeback.train, "writeback.train")
        if label is None:  # the plain grid (a Zero-RAG setting's grid has its own file)
            check_grid_dataset(run.layout.methods_grid(), dataset, force)
        join_ray(run, config)
        grid = evaluate_methods_grid(run, config, dataset, label or name, force=force, same_writeback=same_writeback,
                                     **kwargs)
        print_paper_vs_run(run, config)
        return grid
    if writeback:
        kwargs.update(writeback=True, writeback_version=version)
    if any(m != "no-retrieval" for m in config.eval.methods):
        config = _top_k_within(config, kwargs.get("base_index") or run.layout.index.uri,
                               version and run.layout.writeback_version(version).index.uri)
    if label:
        kwargs["setting"] = label  # the Zero-RAG setting's name, recorded in metrics.json
    label = label or (f"{name}-writeback" if writeback else name)
    run.check(EVAL, config, eval_params(label, dataset, kwargs, config, run), force=force)  # a change refused before Ray starts
    join_ray(run, config)
    results = evaluate_stage(run, config, dataset, label, force=force, **kwargs)["methods"]
    print_paper_vs_run(run, config)
    return results


def print_paper_vs_run(run: RunFolder, config: WbragConfig) -> None:
    """The papers' numbers beside the run's comparable results (`papers.paper_vs_run`), as `wbrag eval` ends."""
    print(format_paper_vs_run(run_paper_rows(run, config)), flush=True)


def _top_k_within(config: WbragConfig, *index_uris: str | None) -> WbragConfig:
    """retrieval.top_k capped at the documents the searched indices hold, saying so."""
    held = sum(load_manifest(resolve(uri)).get("count", 0) for uri in index_uris if uri)
    if held and config.retrieval.top_k > held:
        print(f"retrieval.top_k={config.retrieval.top_k} is more than the {held} documents the index holds: K = {held}",
              flush=True)
        config = config.model_copy(update={"retrieval": config.retrieval.model_copy(update={"top_k": held})})
    return config


def evaluate_zero_rag_grid(run: RunLike, config: WbragConfig, dataset: str | None = None,
                           force: bool = False) -> list[dict[str, Any]]:
    """Every zerorag.ratios setting (with the router, adapter and write-back when there are any)."""
    run, dataset = _evaluated(run, config, dataset)
    check_grid_dataset(run.layout.zero_rag.grid, dataset, force)
    made, facts = made_config(run, config, adapter=config.zerorag.tune.enabled, zero_rag=True)
    print_departures(made, dataset=dataset, made=facts)
    join_ray(run, config)
    rows = evaluate_grid(run, config, dataset, force=force)
    print_paper_vs_run(run, config)
    return rows


def _evaluated(run: RunLike, config: WbragConfig, dataset: str | None) -> tuple[RunFolder, str]:
    """The run folder and the dataset to evaluate (default eval.dataset), both checked before Ray starts."""
    dataset = dataset or config.eval.dataset
    if not dataset:
        raise ConfigError("no dataset to evaluate: pass --dataset PATH or set eval.dataset")
    run = existing_run(run)
    check_input(dataset, "dataset")
    return run, dataset


def check_grid_dataset(grid, dataset: str, force: bool) -> None:
    """A run's grid holds one dataset's rows: another dataset's does not silently replace it."""
    earlier = grid.read_json().get("dataset") if grid.exists() else None
    if earlier not in (None, dataset) and not force:
        raise ConfigError(f"{grid.uri} holds the grid of {earlier}: the grid of {dataset} would replace it; pass "
                          "--force to replace it, or evaluate the other dataset in another run folder")


# --- WriteBack-RAG -----------------------------------------------------------------------------------------


def train_writeback(run: RunLike, config: WbragConfig, train: str | None = None, version: str | None = None,
                    force: bool = False) -> dict[str, Any]:
    """Train one write-back version from a labeled QA set; activate it when writeback.activate."""
    train = train or config.writeback.train
    if not train:
        raise ConfigError("no training set: pass --train PATH or set writeback.train")
    check_input(train, "writeback.train")
    version = plain_name(version or default_version(config, train), "writeback.version (--version)",
                         reserved=("base", "ACTIVE"))
    run = start(run, config, force)
    return train_version(run, config, train=train, version=version, force=force)


def writeback_versions(run: RunLike) -> tuple[list[str], str | None]:
    """(trained versions, the active one or None)."""
    run = existing_run(run)
    return versions(run), read_active(run)["version"]


def activate_writeback(run: RunLike, version: str) -> dict[str, Any]:
    return activate(existing_run(run), version)


def rollback_writeback(run: RunLike, version: str | None = None) -> dict[str, Any]:
    return rollback(existing_run(run), version)


def writeback_sweep(run: RunLike, version: str, tau_s: list[float], tau_delta: list[float], tau_doc: list[float],
                    n_min: list[int]) -> list[dict[str, Any]]:
    """The gates re-applied to a trained version's scores under every setting (the paper's Table 4)."""
    rows = gate_sweep(existing_run(run), version, tau_s, tau_delta, tau_doc, n_min)
    print(format_sweep(version, rows), flush=True)
    return rows


# --- Zero-RAG ----------------------------------------------------------------------------------------------


def mastery(run: RunLike, config: WbragConfig, sample: int | None = None, force: bool = False) -> dict[str, Any]:
    if sample is not None and sample < 1:
        raise ConfigError(f"--sample {sample}: the number of sentences to score must be at least 1")
    folder = existing_run(run)
    folder.require_inputs(MASTERY)
    return score(start(folder, config, force), config, sample=sample, force=force)


def train_pruner(run: RunLike, config: WbragConfig, kind: str | None = None, force: bool = False) -> dict[str, Any]:
    open_run(run).require(MASTERY)
    return train(start(run, config, force), config, kind=kind, force=force)


def prune(run: RunLike, config: WbragConfig, ratios: list[float], force: bool = False) -> dict[str, Any]:
    """Predict every sentence's mastery (zerorag.pruner), then prune at each ratio: {ratio: stats}."""
    if not ratios:
        raise ConfigError("no pruning ratio: pass --ratio R (e.g. 0.3)")
    for ratio in ratios:  # before Ray: a typo costs no cluster start
        check_ratio(ratio, "--ratio")
    open_run(run).check(predict_stage(config), config, force=force)  # the trained pruner too, before Ray
    run = start(run, config, force)
    predict(run, config, force=force)
    return {ratio: prune_at(run, config, ratio, force=force) for ratio in ratios}


def tune(run: RunLike, config: WbragConfig, train: str | None = None, force: bool = False) -> dict[str, Any]:
    folder = _check_train(run, train or config.zerorag.train, TUNE)
    return tune_adapter(start(folder, config, force), config, train=train, force=force)


def train_router(run: RunLike, config: WbragConfig, train: str | None = None, force: bool = False) -> dict[str, Any]:
    folder = _check_train(run, train or config.zerorag.train, ROUTER)
    return train_it(start(folder, config, force), config, train=train, force=force)


def _check_train(run: RunLike, train: str | None, stage: RunStage) -> RunFolder:
    """Before Ray: the run folder, the inputs of `stage`, and the training questions exist."""
    if not train:
        raise ConfigError("no training questions: pass --train PATH or set zerorag.train (FlashRAG jsonl / Parquet)")
    folder = existing_run(run)
    check_input(train, "zerorag.train")
    folder.require_inputs(stage)
    return folder


# --- whole runs --------------------------------------------------------------------------------------------


def run(run: RunLike, config: WbragConfig, force: bool = False, plan_name: str = "") -> dict[str, dict[str, Any]]:
    """Every stage of `pipeline.PIPELINE` the config enables, skipping completed ones; the plan is stored first and
    a config it cannot place is refused unless `force`. Returns every completed stage's stats."""
    folder = open_run(run)
    check_run_inputs(config)
    if config.zerorag.enabled and config.eval.dataset:
        check_grid_dataset(folder.layout.zero_rag.grid, config.eval.dataset, force)
    kb.check_factory(folder, config)
    print_departures(config)
    record_plan(config, folder.uri, plan_name, force=force)  # RUN/plan/plan.json; refused here if it cannot fit
    execute(start(folder, config, force), config, force=force)
    return {s: folder.stats(s) for s in folder.completed_stages()}


def check_run_inputs(config: WbragConfig) -> None:
    """Every input and name of every stage `run` will reach, checked before the first."""
    if config.writeback.train:
        check_input(config.writeback.train, "writeback.train")
        plain_name(default_version(config, config.writeback.train), "writeback.version", reserved=("base", "ACTIVE"))
    check_model_shapes(config.generator, config.zerorag.qa_generator)
    if config.zerorag.enabled and config.zerorag.train:
        check_input(config.zerorag.train, "zerorag.train")
    if config.eval.dataset:
        check_input(config.eval.dataset, "eval.dataset")
        plain_name(dataset_name(config, config.eval.dataset), "eval.name")


def demo_data(name: str) -> str:
    """A file of the embedded demo (the corpus, the questions, the configs)."""
    return os.path.normpath(str(resources.files("wbrag_ray") / "data" / name))


def demo(run_dir: RunLike, config_file: str | None = None, overrides: list[str] | None = None,
         force: bool = False, address: str | None = None) -> tuple[RunFolder, str]:
    """The embedded demo: 100 passages, 40 questions, the bundled models; returns (run folder, report path)."""
    extra = {
        "ingest": {"corpus": demo_data("demo_corpus.jsonl")},
        "eval": {"dataset": demo_data("demo_qa.jsonl"), "name": "demo_qa"},
    }
    config = load_config(config_file or demo_data("../configs/demo.yaml"), overrides, extra)
    if address:
        config.ray.address = address
    folder = open_run(run_dir)
    run(folder, config, force=force)
    return folder, write_report(folder)


def stage_time_split(run: RunLike) -> str:
    """One line: each stage's share of the run's stage time, slowest first (where the time goes)."""
    folder = open_run(run)
    times = {s: (folder.stats(s) or {}).get("seconds", 0.0) for s in folder.completed_stages()}
    total = sum(times.values()) or 1.0
    parts = [f"{s} {t:.1f} s ({100 * t / total:.0f}%)" for s, t in sorted(times.items(), key=lambda kv: -kv[1])]
    return "time per stage, slowest first: " + ", ".join(parts)


# --- export ------------------------------------------------------------------------------------------------


def export(run: RunLike, config: WbragConfig, format: str, out: str, *, prune_ratio: float | None = None,
           writeback: str | None = None, force: bool = False) -> dict[str, Any]:
    """Write the knowledge base (pruned at `prune_ratio`, plus write-back version `writeback`) in a RAG stack's
    format (flashrag, langchain, llamaindex) into `out`; returns the export's manifest."""
    if prune_ratio is not None:
        check_ratio(prune_ratio, "--prune-ratio")
    run = existing_run(run)
    join_ray(run, config)
    return export_kb(run, config, format, out, prune_ratio=prune_ratio, writeback=writeback, force=force)
