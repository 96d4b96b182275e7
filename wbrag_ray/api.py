"""The library API: what the `wbrag` command and the job entry points call, and what a Python user calls.

Every function takes a run folder (a path, an s3:// URI or a RunFolder) and a resolved config (`load_config`),
and returns the stage's stats (or results) as plain dicts. The functions that write to the run folder record
the config as the run's first (refusing one that would change the built knowledge base, unless `force`) and
join or start Ray (`config.ray`).

    from wbrag_ray import api
    from wbrag_ray.config import load_config

    config = load_config("jobs/configs/demo.yaml")
    api.build_kb("runs/demo", config)
    api.evaluate("runs/demo", config, "questions.jsonl")

Errors a person can fix (a missing input, a changed config, a stage to run first) are `ConfigError`s whose
message says the fix; anything else is a bug.
"""

from __future__ import annotations

import os
from importlib import resources
from typing import Any

from wbrag_ray.config import ConfigError, WbragConfig, load_config
from wbrag_ray.run import RunFolder

RunLike = str | os.PathLike[str] | RunFolder


def open_run(run: RunLike) -> RunFolder:
    return run if isinstance(run, RunFolder) else RunFolder(str(run))


def start(run: RunLike, config: WbragConfig, force: bool = False) -> RunFolder:
    """Bind `config` to the run folder (refused when a built stage was made with another, unless `force`) and
    join or start Ray."""
    from wbrag_ray.build_kb import KB_STAGES
    from wbrag_ray.ray_runtime import init_ray

    run = open_run(run)
    run.bind_config(config, force=force, guard=KB_STAGES)
    init_ray(config.ray, run.uri)
    return run


# --- the knowledge base ------------------------------------------------------------------------------------

BUILD_STEPS = ("ingest", "embed", "index")


def build_kb(run: RunLike, config: WbragConfig, force: bool = False,
             steps: tuple[str, ...] = BUILD_STEPS) -> dict[str, dict[str, Any]]:
    """ingest -> embed -> index (or the named `steps` of them), skipping complete stages."""
    from wbrag_ray import build_kb as kb

    unknown = set(steps) - set(BUILD_STEPS)
    if unknown:
        raise ConfigError(f"unknown build steps {sorted(unknown)}; choose from {', '.join(BUILD_STEPS)}")
    if "ingest" in steps and not config.ingest.corpus:  # say so before a Ray cluster is started for nothing
        raise ConfigError("ingest.corpus is not set; pass --corpus PATH or set ingest.corpus in the config")
    run = start(run, config, force)
    return {step: getattr(kb, step)(run, config, force=force) for step in BUILD_STEPS if step in steps}


def search(run: RunLike, config: WbragConfig, queries: list[str], k: int = 5):
    """The top `k` hits of each query on the run's index: the queries embedded here, the shards searched by
    the retrieval service's actors, and only the hits' documents read (from the memory-mapped store)."""
    from wbrag_ray.ray_runtime import init_ray
    from wbrag_ray.retrieval.local import load_query_embedder
    from wbrag_ray.stages.service import Services

    run = open_run(run)
    init_ray(config.ray, run.uri)
    with Services() as services:
        service = services.retrieval(((run.layout.index.uri, run.layout.ingest.root.uri, "base"),), config.index,
                                     config.retrieval)
        embedder = load_query_embedder(config.embedder, service.dim, run.layout.index.uri)
        return service.search_vectors(embedder.encode_queries(queries), k)


# --- evaluation --------------------------------------------------------------------------------------------


def evaluate(run: RunLike, config: WbragConfig, dataset: str | None = None, name: str | None = None, *,
             writeback: bool = False, prune_ratio: float | None = None, router: bool = False, adapter: bool = False,
             methods_grid: bool = False, force: bool = False) -> dict[str, Any]:
    """Evaluate eval.methods on `dataset` (default eval.dataset): on the base index, or beside the active
    write-back index, or in a Zero-RAG setting (the index pruned at `prune_ratio`, the query `router`, the tuned
    `adapter`), each setting named in the results' label. `methods_grid`: every method on this base and beside
    every trained write-back version. Returns {method: metrics} (the grid for `methods_grid`)."""
    from wbrag_ray.evaluation.evaluate import dataset_name
    from wbrag_ray.evaluation.evaluate import evaluate as evaluate_methods
    from wbrag_ray.zerorag.grid import eval_label
    from wbrag_ray.zerorag.prune import index_for_ratio
    from wbrag_ray.zerorag.router import ROUTER
    from wbrag_ray.zerorag.tune import with_adapter

    run = open_run(run)
    dataset = dataset or config.eval.dataset
    if not dataset:
        raise ConfigError("no dataset to evaluate: pass --dataset PATH or set eval.dataset")
    if methods_grid and writeback:
        raise ConfigError("--methods-grid already evaluates beside every trained write-back version: drop --writeback")
    name = name or dataset_name(config, dataset)
    kwargs: dict[str, Any] = {}
    if prune_ratio is not None:
        kwargs["base_index"] = index_for_ratio(run, prune_ratio).uri
    if router:
        run.require(ROUTER)
        kwargs["router"] = run.layout.zero_rag.router.uri
    if adapter:
        config = config.model_copy(update={"generator": with_adapter(run, config)})
    label = None
    if prune_ratio is not None or router or adapter:  # a Zero-RAG setting: name it after them all
        label = eval_label(name, prune_ratio, writeback, router, adapter)
    from wbrag_ray.ray_runtime import init_ray

    init_ray(config.ray, run.uri)
    if methods_grid:
        from wbrag_ray.evaluation.methods_grid import evaluate_methods_grid

        return evaluate_methods_grid(run, config, dataset, label or name, force=force, **kwargs)
    if label:
        kwargs.update(label=label, setting=label)
    return evaluate_methods(run, config, dataset, name, writeback=writeback, **kwargs)


def evaluate_zero_rag_grid(run: RunLike, config: WbragConfig, dataset: str | None = None,
                           force: bool = False) -> list[dict[str, Any]]:
    """Every zerorag.ratios setting (with the router, adapter and write-back when there are any)."""
    from wbrag_ray.ray_runtime import init_ray
    from wbrag_ray.zerorag.grid import evaluate_grid

    dataset = dataset or config.eval.dataset
    if not dataset:
        raise ConfigError("no dataset to evaluate: pass --dataset PATH or set eval.dataset")
    run = open_run(run)
    init_ray(config.ray, run.uri)
    return evaluate_grid(run, config, dataset, force=force)


# --- WriteBack-RAG -----------------------------------------------------------------------------------------


def train_writeback(run: RunLike, config: WbragConfig, train: str | None = None, version: str | None = None,
                    force: bool = False) -> dict[str, Any]:
    """Train one write-back version from a labeled QA set (default writeback.train); activate it when
    writeback.activate."""
    from wbrag_ray.writeback.pipeline import train_writeback as train_version

    run = start(run, config, force)
    return train_version(run, config, train=train, version=version, force=force)


def writeback_versions(run: RunLike) -> tuple[list[str], str | None]:
    """(trained versions, the active one or None)."""
    from wbrag_ray.writeback.versions import read_active, versions

    run = open_run(run)
    return versions(run), read_active(run)["version"]


def activate_writeback(run: RunLike, version: str) -> dict[str, Any]:
    from wbrag_ray.writeback.versions import activate

    return activate(open_run(run), version)


def rollback_writeback(run: RunLike, version: str | None = None) -> dict[str, Any]:
    from wbrag_ray.writeback.versions import rollback

    return rollback(open_run(run), version)


def writeback_sweep(run: RunLike, version: str, tau_s: list[float], tau_delta: list[float], tau_doc: list[float],
                    n_min: list[int]) -> list[dict[str, Any]]:
    """The gates re-applied to a trained version's scores under every setting (the paper's Table 4): one row
    per setting, printed and written to RUN/writeback/<version>/sweep.json."""
    from wbrag_ray.writeback.sweep import format_sweep, gate_sweep

    rows = gate_sweep(open_run(run), version, tau_s, tau_delta, tau_doc, n_min)
    print(format_sweep(version, rows), flush=True)
    return rows


# --- Zero-RAG ----------------------------------------------------------------------------------------------


def mastery(run: RunLike, config: WbragConfig, sample: int | None = None, force: bool = False) -> dict[str, Any]:
    from wbrag_ray.zerorag.mastery import mastery as score

    return score(start(run, config, force), config, sample=sample, force=force)


def train_pruner(run: RunLike, config: WbragConfig, kind: str | None = None, force: bool = False) -> dict[str, Any]:
    from wbrag_ray.zerorag.pruners import train_pruner as train

    return train(start(run, config, force), config, kind=kind, force=force)


def prune(run: RunLike, config: WbragConfig, ratios: list[float], force: bool = False) -> dict[str, Any]:
    """Predict every sentence's mastery (zerorag.pruner), then prune at each ratio: {ratio: stats}."""
    from wbrag_ray.zerorag.prune import predict
    from wbrag_ray.zerorag.prune import prune as prune_at

    run = start(run, config, force)
    predict(run, config, force=force)
    return {ratio: prune_at(run, config, ratio, force=force) for ratio in ratios}


def tune(run: RunLike, config: WbragConfig, train: str | None = None, force: bool = False) -> dict[str, Any]:
    from wbrag_ray.zerorag.tune import tune as tune_adapter

    return tune_adapter(start(run, config, force), config, train=train, force=force)


def train_router(run: RunLike, config: WbragConfig, train: str | None = None, force: bool = False) -> dict[str, Any]:
    from wbrag_ray.zerorag.router import train_router as train_it

    return train_it(start(run, config, force), config, train=train, force=force)


def run_zero_rag(run: RunLike, config: WbragConfig, force: bool = False) -> None:
    """mastery -> pruners -> prediction -> every ratio -> [tune] -> [router] -> [the grid]."""
    from wbrag_ray.zerorag import run_zero_rag as chain

    chain(start(run, config, force), config, force=force)


# --- whole runs --------------------------------------------------------------------------------------------


def run(run: RunLike, config: WbragConfig, force: bool = False) -> dict[str, dict[str, Any]]:
    """ingest -> embed -> index -> [write-back training] -> [Zero-RAG: mastery, pruners, pruned indices, tuning,
    router, the evaluation grid] -> eval (base, then base + write-back), skipping completed stages. Returns every
    completed stage's stats."""
    from wbrag_ray.evaluation.evaluate import dataset_name, evaluate_stage

    folder = open_run(run)
    build_kb(folder, config, force=force)
    evaluated = [False]
    if config.writeback.train:
        train_writeback(folder, config, force=force)
        evaluated += [True] if config.writeback.evaluate else []
    if config.zerorag.enabled:
        run_zero_rag(folder, config, force=force)
        evaluated = []  # its grid evaluates the base and the pruned bases, with write-back when there is one
    if config.eval.dataset:
        name = dataset_name(config, config.eval.dataset)
        for wb in evaluated:
            evaluate_stage(folder, config, config.eval.dataset, name, f"{name}-writeback" if wb else name, force=force,
                           writeback=wb)
    return {s: folder.stats(s) for s in folder.completed_stages()}


def demo_data(name: str) -> str:
    """A file of the embedded demo (the corpus, the questions, the configs)."""
    return os.path.normpath(str(resources.files("wbrag_ray") / "data" / name))


def demo(run_dir: RunLike, config_file: str | None = None, overrides: list[str] | None = None,
         force: bool = False, address: str | None = None) -> tuple[RunFolder, str]:
    """The embedded demo: 100 passages, 40 questions, the bundled models; returns (run folder, report path)."""
    from wbrag_ray.report import write_report

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
    """Write the knowledge base in a RAG stack's own format (`format`: flashrag, langchain or llamaindex) into the
    folder `out`: the base index, or the base pruned at `prune_ratio`, plus the units of write-back version
    `writeback` (a name, 'active' or 'none'; default: the active version, if any). Reads the run (local or s3://)
    one shard at a time and writes nothing to it; returns the export's manifest (OUT/wbrag_export.json)."""
    from wbrag_ray.export import export_kb

    return export_kb(open_run(run), config, format, out, prune_ratio=prune_ratio, writeback=writeback, force=force)
