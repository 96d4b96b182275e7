"""The `wbrag` command: parses, calls the library API (wbrag_ray.api), prints.

A run folder records the resolved config, so later subcommands on it need only overrides (--set). Errors a person
can fix exit 2 with one line (-v adds the traceback); a bug shows its traceback; Ctrl-C exits 130. A command that
writes its run folder holds the folder's lease (wbrag_ray.lease).

Over 500 lines, kept whole: one parser block and one function (or table entry) a subcommand, read as one table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from wbrag_ray import __version__, api, doctor, flashrag_data, jobs_api, plan, rag
from wbrag_ray.config import ConfigError, WbragConfig, load_config, set_dotted
from wbrag_ray.export import FORMATS
from wbrag_ray.formats import InputError
from wbrag_ray.index.files import IndexError_
from wbrag_ray.inspection import inspect_run, run_status
from wbrag_ray.lease import run_lease
from wbrag_ray.models.accelerators import accelerator
from wbrag_ray.papers import print_departures
from wbrag_ray.pipeline import sweep_run
from wbrag_ray.plan import run_summary
from wbrag_ray.plan.accelerators import interconnect
from wbrag_ray.plan.calibrate import calibrate, load_records
from wbrag_ray.ray_runtime import init_ray
from wbrag_ray.report import write_report
from wbrag_ray.run import RunFolder

DEMO_DIR = "runs/demo"


# The commands that read a config: --config (`run`: its CONFIG argument), --set, --address and --force.
CONFIGURED = {"ingest", "embed", "index", "search", "eval", "mastery", "train-pruner", "prune", "tune", "train-router",
              "writeback", "run", "export", "demo"}


def _common(p: argparse.ArgumentParser, config: bool = True) -> None:
    if config:
        p.add_argument("--config", metavar="FILE", help="YAML config (sections: ingest, embedder, generator, ...)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config key, e.g. --set generator.batch_size=16 (repeatable)")
    p.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS, else a local cluster)")
    p.add_argument("--force", action="store_true", help="rerun completed stages / accept a changed config")


def _on_run_parser(sub, name: str, help: str) -> argparse.ArgumentParser:
    """A subcommand on one run folder (RUN, its first argument)."""
    p = sub.add_parser(name, help=help)
    p.add_argument("run", metavar="RUN", help="run folder (local path or s3://bucket/prefix)")
    return p


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v.strip()]


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def build_parser() -> argparse.ArgumentParser:
    """The subcommands. A flag whose `dest` is a dotted config key (ingest.corpus) sets that key (`_resolve_config`)."""
    parser = argparse.ArgumentParser(prog="wbrag", description="Knowledge-base training for RAG on Ray: ingest, "
                                     "embed, index, evaluate (Zero-RAG pruning and WriteBack-RAG enrichment build "
                                     "on these).")
    parser.add_argument("--version", action="version", version=f"wbrag-ray {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = _on_run_parser(sub, "ingest", "corpus (FlashRAG jsonl / Parquet) -> passages + sentences shards")
    p.add_argument("--corpus", dest="ingest.corpus", metavar="CORPUS",
                   help="corpus file or folder (FlashRAG jsonl or Parquet, local or s3://)")

    _on_run_parser(sub, "embed", "embed the ingested passages (or sentences) in a Ray actor pool")

    p = _on_run_parser(sub, "index", "build the FAISS index from the embedding shards")
    p.add_argument("--factory", dest="index.factory", metavar="FACTORY",
                   help="faiss index factory string, or 'auto' (default: index.factory, auto)")

    p = _on_run_parser(sub, "search", "search the run's index and print the top K documents")
    p.add_argument("--query", action="append", required=True, help="query text (repeatable)")
    p.add_argument("-k", type=int, default=5, help="documents per query (default 5)")

    p = _on_run_parser(sub, "eval", "evaluate RAG on a QA dataset: metrics.json + predictions.parquet")
    p.add_argument("--dataset", dest="eval.dataset", metavar="DATASET",
                   help="FlashRAG dataset jsonl / Parquet (id, question, golden_answers)")
    p.add_argument("--name", help="name of the evaluation (default: the dataset's file stem)")
    p.add_argument("--methods", help="comma-separated RAG methods: no-retrieval,naive,replug,replug-vote,self-rag,"
                   "flare (default: eval.methods, no-retrieval,naive; with --methods-grid: all)")
    # 0 too: refused by eval.limit's range, not read as "no limit"
    p.add_argument("--limit", dest="eval.limit", metavar="LIMIT", type=int, help="evaluate only the first N questions")
    p.add_argument("--writeback", action="store_true", help="search the active write-back index beside the base")
    p.add_argument("--prune-ratio", type=float, help="Zero-RAG: evaluate on the index pruned at this ratio")
    p.add_argument("--router", action="store_true", help="Zero-RAG: skip retrieval for queries the router calls mastered")
    p.add_argument("--adapter", action="store_true", help="Zero-RAG: generate with the noise-tolerant LoRA adapter")
    p.add_argument("--grid", action="store_true",
                   help="Zero-RAG: evaluate every zerorag.ratios setting (with router / adapter when enabled)")
    p.add_argument("--methods-grid", action="store_true",
                   help="every RAG method on the base and beside each trained write-back version "
                   "(same- and cross-method): RUN/eval/methods_grid.json")
    p.add_argument("--same-writeback", action="store_true",
                   help="with --methods-grid: first train (or reuse) a write-back version per method from "
                   "writeback.train (WriteBack-RAG's Same-WB)")

    p = _on_run_parser(sub, "mastery", "Zero-RAG: mastery scores of a sample of sentences (QA pairs, closed-book EM)")
    p.add_argument("--sample", type=int, help="sentences to score (default: zerorag.sample)")
    p.add_argument("--mode", dest="zerorag.qa_mode", choices=["cloze", "llm"],
                   help="how QA pairs are written (default: zerorag.qa_mode)")

    p = _on_run_parser(sub, "train-pruner", "Zero-RAG: train and validate the pruner(s) on the scored sample")
    p.add_argument("--kind", choices=["embedding", "lm"], help="one pruner (default: zerorag.train_pruners)")

    p = _on_run_parser(sub, "prune", "Zero-RAG: predict mastery for every sentence, drop the top R, build the "
                       "pruned index")
    p.add_argument("--ratio", type=float, action="append", required=True,
                   help="fraction of sentences to drop, e.g. 0.3 (repeatable)")
    p.add_argument("--pruner", dest="zerorag.pruner", choices=["embedding", "lm"],
                   help="which trained pruner predicts (default: zerorag.pruner)")

    for name, text in (("tune", "Zero-RAG: noise-tolerant LoRA tuning of the generator"),
                       ("train-router", "Zero-RAG: train the query router (skip retrieval for mastered queries)")):
        p = _on_run_parser(sub, name, text)
        p.add_argument("--train", dest="zerorag.train", metavar="TRAIN",
                       help="training questions (default: zerorag.train)")

    p = _on_run_parser(sub, "writeback", "WriteBack-RAG: train, activate (replace) or roll back a write-back index")
    p.add_argument("--train", dest="writeback.train", metavar="TRAIN",
                   help="labeled QA set (FlashRAG jsonl / Parquet) to train a write-back index from")
    p.add_argument("--version", help="name of the version to train (default: the train file's stem)")
    p.add_argument("--activate", metavar="VERSION", help="make a trained version the active write-back index")
    p.add_argument("--rollback", metavar="VERSION", nargs="?", const="",
                   help="back to the previously active version, or to VERSION ('base': base index only)")
    p.add_argument("--list", action="store_true", help="list trained versions and the active one")
    p.add_argument("--sweep", metavar="VERSION",
                   help="the gates' ablation (the paper's Table 4) on a trained version's scores: no model calls")
    p.add_argument("--tau-s", type=_floats, help="with --sweep: utility-gate tau_s values (default 0,0.1,0.3,0.5)")
    p.add_argument("--tau-delta", type=_floats, help="with --sweep: tau_delta values (default: writeback.tau_delta)")
    p.add_argument("--tau-doc", type=_floats, help="with --sweep: document-gate tau_doc values (default 0,0.01,0.1)")
    p.add_argument("--n-min", type=_ints, help="with --sweep: n_min values (default 1,2,3)")

    p = sub.add_parser("run", help="run the whole pipeline a config describes (ingest, embed, index, eval, writeback)")
    p.add_argument("config_file", metavar="CONFIG", help="YAML config")
    p.add_argument("--run", dest="run", help="run folder (default: the config's `run` key)")

    p = sub.add_parser("plan", help="what each stage of `wbrag run CONFIG` asks of a cluster (bundles, memory per "
                       "actor, index shards, search actors) and about how long it takes; refuses what cannot be placed")
    p.add_argument("config_file", metavar="CONFIG", help="YAML config")
    p.add_argument("--nodes", type=int, help="nodes of the cluster (default 1); with no node flag and no --address: "
                   "this machine")
    p.add_argument("--gpus-per-node", type=float, help="GPUs of each node (default 0)")
    p.add_argument("--cpus-per-node", type=float, help="CPUs of each node (default: this machine's)")
    p.add_argument("--memory-per-node", type=float, metavar="GB", help="memory of each node (default: this machine's)")
    p.add_argument("--gpu-memory-gb", type=float, help="memory of one GPU (default: --gpu's, 80 for the H100)")
    p.add_argument("--passages", type=int, help="corpus passages (default: the run folder's ingest stats, else "
                   "estimated from the corpus files)")
    p.add_argument("--run", dest="run", help="run folder whose ingest stats give the corpus size (default: the "
                   "config's `run` key)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--address", help="plan for this Ray cluster's nodes (joins it, submits nothing)")
    p.add_argument("--json", action="store_true", help="print the plan as data (stages, seconds, GPUs, fit)")
    p.add_argument("--gpu", default="H100", help="the GPU uncalibrated stages are estimated for: A100-40GB, "
                   "A100-80GB, H100, H100-PCIe, H100-NVL, H200, H200-NVL, L4, L40S, A10G (default H100)")
    p.add_argument("--interconnect", default="ib-ndr-400", help="the network between nodes: ib-ndr-400, ib-hdr-200, "
                   "efa-3200, efa-400, ethernet-100 (default ib-ndr-400)")
    p.add_argument("--storage-read-gbs", type=float, default=2.0, metavar="GBS", help="GB/s a node reads model files "
                   "at, for each model's load (default 2)")
    p.add_argument("--gpu-hour-price", type=float, metavar="PRICE", help="price of one GPU-hour: the plan adds the cost")
    p.add_argument("--calibrate", action="store_true", help="first time each model on one worker of the cluster "
                   "and record the rates with its hardware (in --run and ~/.cache/wbrag/rates.json)")
    p.add_argument("--calibrate-seconds", type=float, default=30.0, metavar="S",
                   help="seconds each model runs when calibrating (default 30; a minute on a cluster)")

    p = sub.add_parser("submit", help="submit `wbrag run CONFIG` to a Ray cluster with the Ray Jobs API")
    p.add_argument("config_file", metavar="CONFIG", help="YAML config inside the working dir (e.g. jobs/configs/...)")
    p.add_argument("--address", required=True, help="head node: http://HEAD:8265, HEAD:6379 or ray://HEAD:10001")
    p.add_argument("--run", dest="run", help="run folder; on a multi-node cluster use s3:// or a shared mount")
    p.add_argument("--working-dir", default=".", help="folder uploaded as the job's working dir (default .)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--no-wait", action="store_true", help="return after submitting instead of following the logs")
    p.add_argument("--force", action="store_true", help="submit again even if the same job already succeeded")

    p = sub.add_parser("status", help="show a run folder's stages (done / total rows, what a rerun resumes), or a "
                       "submitted job's status")
    p.add_argument("submission_id", metavar="RUN|ID", help="a run folder, or the id `wbrag submit` printed")
    p.add_argument("--address", help="head node of a submitted job: http://HEAD:8265 or HEAD:6379")
    for name, text in (("logs", "print a submitted job's logs"), ("stop", "stop a submitted job")):
        p = sub.add_parser(name, help=text)
        p.add_argument("submission_id", metavar="ID", help="the id `wbrag submit` printed")
        p.add_argument("--address", required=True, help="head node: http://HEAD:8265 or HEAD:6379")

    _on_run_parser(sub, "report", "write RUN/report/index.html (+ PNG plots) and report.md")

    p = sub.add_parser("data", help="FlashRAG's QA datasets and wiki-18 corpus into a folder (local or s3://): "
                                    "fetch from the hub, or check a folder downloaded by hand")
    p.add_argument("action", choices=["fetch", "check"])
    p.add_argument("source", choices=["flashrag"], help="the data's source (FlashRAG's dataset repository)")
    p.add_argument("datasets", nargs="*", metavar="DATASET", help="nq, triviaqa, popqa, hotpotqa, ...")
    p.add_argument("--out", required=True, metavar="DIR", help="the folder (or s3:// prefix) for fetch; the "
                                                               "folder to read for check")
    p.add_argument("--corpus", choices=["wiki18"], help="the retrieval corpus too (wiki18: 21M passages, 5 GB zipped)")
    p.add_argument("--revision", help="fetch: the repository's revision (a commit, for a pinned reproduction)")

    p = _on_run_parser(sub, "inspect", "print samples: rejects, sentences, answers, write-back units")
    p.add_argument("-n", type=int, default=3, help="samples per section (default 3)")

    p = _on_run_parser(sub, "export", "write the knowledge base (pruned, with write-back units) for FlashRAG, "
                       "LangChain or LlamaIndex")
    p.add_argument("--format", required=True, choices=FORMATS, help="the target's own on-disk format")
    p.add_argument("--out", required=True, metavar="DIR", help="folder to write (local or s3://); empty or new")
    p.add_argument("--prune-ratio", type=float, help="Zero-RAG: the base pruned at this ratio (default: the full base)")
    p.add_argument("--writeback", metavar="V|active|none",
                   help="write-back units to add: a version, 'active' or 'none' (default: the active version, if any)")

    doctor.add_arguments(sub.add_parser("doctor", help="what this node can run: torch and CUDA, the driver, vLLM, "
                                        "faiss's GPUs, /dev/shm, S3 and hub credentials (exit 1 where a flag's "
                                        "requirement fails)"))

    p = sub.add_parser("demo", help="the embedded demo: 100 passages, 40 questions, bundled models, local Ray")
    p.add_argument("--run", dest="run", default=DEMO_DIR, help=f"run folder (default {DEMO_DIR})")
    for name, p in sub.choices.items():
        if name in CONFIGURED:  # after the command's own flags
            _common(p, config=name != "run")
        p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return parser


# --- config resolution ----------------------------------------------------------------------------------


def _resolve_config(args: argparse.Namespace, extra: dict[str, Any] | None = None,
                    run: RunFolder | None = None) -> WbragConfig:
    """--config file, else the run's recorded config, then flag values (`extra` and the flags whose dest is a
    config key), then --set overrides."""
    extra = extra or {}
    for key, value in vars(args).items():
        if "." in key and value not in (None, ""):
            set_dotted(extra, key, value)
    config_file = getattr(args, "config", None) or getattr(args, "config_file", None)
    base = None
    if config_file is None and run is not None and run.layout.run_json.exists():
        base = run.load_config().model_dump(mode="json")
    config = load_config(config_file, args.overrides, extra, base=base)
    if args.address:
        config.ray.address = args.address
    return config


def _on_run(args, extra: dict[str, Any] | None = None) -> tuple[RunFolder, WbragConfig]:
    run = RunFolder(args.run)
    return run, _resolve_config(args, extra, run)


def _run_dir(args, config: WbragConfig) -> str:
    """`wbrag run` / `submit`: --run, else the config's `run` key."""
    run_dir = args.run or config.run
    if not run_dir:
        raise ConfigError("no run folder: pass --run RUN or set `run:` in the config")
    return run_dir


# --- commands: each parses, calls the library API, prints ------------------------------------------------


def cmd_search(args) -> None:
    run, config = _on_run(args)
    for query, hits in zip(args.query, api.search(run, config, args.query, args.k), strict=True):
        print(f"query: {query}")
        for h in hits:
            text = h.text if len(h.text) <= 160 else h.text[:157] + "..."
            print(f"  {h.rank + 1:>2}. {h.score:.4f}  [{h.id}] {h.title}: {text}")


def cmd_eval(args) -> None:
    methods = None if args.methods is None else [m.strip() for m in args.methods.split(",") if m.strip()]
    if methods == []:
        raise ConfigError(f"--methods {args.methods!r} names no method: e.g. --methods no-retrieval,naive")
    run, config = _on_run(args, {"eval": {"methods": methods}} if methods else None)
    if args.grid and args.methods_grid:
        raise ConfigError("--grid (Zero-RAG settings) and --methods-grid (RAG methods x write-back) are two grids: "
                          "run them one at a time")
    if args.grid:
        # the grid's settings come from zerorag.*: a flag for one setting would be dropped silently
        ignored = [flag for flag, given in (("--name", args.name), ("--prune-ratio", args.prune_ratio is not None),
                                            ("--router", args.router), ("--adapter", args.adapter),
                                            ("--writeback", args.writeback), ("--same-writeback", args.same_writeback))
                   if given]
        if ignored:
            raise ConfigError(f"--grid evaluates every zerorag.ratios setting (router, adapter and write-back as "
                              f"configured): drop {', '.join(ignored)}, or evaluate one setting without --grid")
        api.evaluate_zero_rag_grid(run, config, force=args.force)
        return
    if args.methods_grid and not methods:  # the grid's point is every method
        config.eval.methods = rag.available_methods(config.generator)
    api.evaluate(run, config, name=args.name, writeback=args.writeback, prune_ratio=args.prune_ratio,
                 router=args.router, adapter=args.adapter, methods_grid=args.methods_grid,
                 same_writeback=args.same_writeback, force=args.force)


def cmd_writeback(args) -> None:
    train = getattr(args, "writeback.train")
    actions = [flag for flag, given in (("--train", train), ("--activate", args.activate),
                                        ("--rollback", args.rollback is not None), ("--list", args.list),
                                        ("--sweep", args.sweep)) if given]
    if len(actions) > 1:
        raise ConfigError(f"{' and '.join(actions)} are different actions: run one at a time")
    if args.list:
        trained, active = api.writeback_versions(args.run)
        for v in trained:
            print(f"{'*' if v == active else ' '} {v}")
        print(f"active: {active or 'none (base index only)'}")
    elif args.activate:
        api.activate_writeback(args.run, args.activate)
    elif args.rollback is not None:
        api.rollback_writeback(args.run, args.rollback or None)
    elif args.sweep:
        run, config = _on_run(args)
        api.writeback_sweep(run, args.sweep, tau_s=args.tau_s or [0.0, 0.1, 0.3, 0.5],
                            tau_delta=args.tau_delta or [config.writeback.tau_delta],
                            tau_doc=args.tau_doc or [0.0, 0.01, 0.1], n_min=args.n_min or [1, 2, 3])
    else:
        api.train_writeback(*_on_run(args), version=args.version, force=args.force)


def cmd_plan(args) -> None:
    config = _resolve_config(args)
    if args.passages is not None and args.passages < 1:
        raise ConfigError(f"--passages {args.passages}: a corpus has at least one passage")
    try:
        gpu_memory_gb = args.gpu_memory_gb or accelerator(args.gpu).memory_gb
    except ValueError as exc:
        raise ConfigError(f"--gpu: {exc}") from None
    try:
        interconnect(args.interconnect)
    except ValueError as exc:
        raise ConfigError(f"--interconnect: {exc}") from None
    if args.storage_read_gbs <= 0:
        raise ConfigError(f"--storage-read-gbs {args.storage_read_gbs:g}: a read rate is positive")
    shape = (args.nodes, args.gpus_per_node, args.cpus_per_node, args.memory_per_node)
    if not args.json:
        print_departures(config)  # as `wbrag run` will start
    if args.calibrate:  # on the cluster the run will use: --address, or a local one started here
        calibrate(config, args.calibrate_seconds, run=args.run)
    if args.address and all(v is None for v in shape):
        init_ray(config.ray)
        cluster = plan.cluster_from_ray(gpu_memory_gb)
    else:
        cluster = plan.stated_cluster(*shape, gpu_memory_gb=gpu_memory_gb)
    result = plan.make_plan(config, cluster, passages=args.passages, run=args.run, name=args.config_file,
                            gpu=args.gpu, records=load_records(args.run), gpu_hour_price=args.gpu_hour_price,
                            network=args.interconnect, storage_gbs=args.storage_read_gbs)
    if args.json:
        print(json.dumps(plan.plan_data(result), indent=1), flush=True)
    else:
        print(plan.format_plan(result), flush=True)
    if not result.places:
        raise ConfigError(f"{args.config_file} cannot be placed on this cluster: {len(result.problems)} problem(s), "
                          "each with what to change, above")


def _print_plan_summary(config: WbragConfig, run_dir: str) -> None:
    """The plan's summary on the run's Ray cluster (none for a local cluster not started yet)."""
    if config.ray.address or os.environ.get("RAY_ADDRESS"):
        init_ray(config.ray)
    summary = run_summary(config, run_dir)
    if summary:
        print(summary, flush=True)


def cmd_run(args) -> None:
    config = _resolve_config(args)
    run_dir = _run_dir(args, config)
    with writing(run_dir, args.holder):
        api.check_run_inputs(config)  # every stage's inputs and names, before a cluster is joined
        _print_plan_summary(config, run_dir)
        api.run(run_dir, config, force=args.force, plan_name=args.config_file)
    print(api.stage_time_split(run_dir), flush=True)


def cmd_demo(args) -> None:
    t0 = time.perf_counter()
    run, report = api.demo(args.run, args.config, args.overrides, force=args.force, address=args.address)
    print(f"demo finished in {time.perf_counter() - t0:.1f} s; run folder: {run.uri}", flush=True)
    print(api.stage_time_split(run), flush=True)
    print(f"report: {report}", flush=True)


def cmd_submit(args) -> None:
    run_dir = _run_dir(args, load_config(args.config_file, args.overrides))  # validated before anything is uploaded
    result = jobs_api.submit(args.config_file, run_dir, args.address, args.working_dir, args.overrides,
                             wait=not args.no_wait, force=args.force)
    if not args.no_wait and result["status"] != "SUCCEEDED":
        raise ConfigError(f"job {result['submission_id']} ended {result['status']}; "
                          f"see `wbrag logs {result['submission_id']} --address {args.address}`")


def cmd_status(args) -> None:
    if args.address is None:
        run = RunFolder(args.submission_id)
        if not run.is_run():
            raise ConfigError(f"{args.submission_id} is not a run folder (no run.json); for a submitted job's "
                              "status pass --address HEAD")
        print("\n".join(run_status(run)))
        return
    info = jobs_api.status(args.submission_id, args.address)
    print(f"{info['submission_id']}: {info['status']}" + (f" ({info['message']})" if info["message"] else ""))
    print(f"  entrypoint: {info['entrypoint']}")


def cmd_stop(args) -> None:
    stopped = jobs_api.stop(args.submission_id, args.address)
    print(f"{args.submission_id}: {'stop requested' if stopped else 'already finished'}")


def cmd_data(args) -> None:
    if not args.datasets and not args.corpus:
        raise ConfigError("name at least one dataset (nq, triviaqa, ...) or --corpus wiki18")
    if args.action == "fetch":
        layout = flashrag_data.fetch(args.datasets, args.out, args.corpus, args.revision)
    else:
        layout = flashrag_data.check_layout(args.out, args.datasets, args.corpus)
        if layout.problems:
            raise ConfigError("not FlashRAG's layout:\n  " + "\n  ".join(layout.problems))
    for dataset, splits in layout.splits.items():
        print(f"{dataset}: {', '.join(splits)} in {args.out.rstrip('/')}/{flashrag_data.folder_of(dataset)}/")
    if layout.corpus is not None:
        print(f"corpus: {layout.corpus} (ingest.corpus)")


def cmd_export(args) -> None:
    run, config = _on_run(args)
    manifest = api.export(run, config, args.format, args.out, prune_ratio=args.prune_ratio, writeback=args.writeback,
                          force=args.force)
    counts = ", ".join(f"{n} {source}" for source, n in manifest["counts"].items())
    embedder = manifest["embedder"]
    print(f"exported {manifest['count']} documents ({counts}) for {args.format} to {args.out}; embed queries with "
          f"{embedder['name']} (query prefix {embedder['query_prefix']!r}); see {args.out}/wbrag_export.json")


# Each command's function; one that returns an int exits with it. `report` and `inspect` only read RUN: a mistyped
# path is refused, nothing is created there.
COMMANDS: dict[str, Callable[[argparse.Namespace], Any]] = {
    "report": lambda args: print(f"report: {write_report(api.existing_run(args.run))}"),
    "inspect": lambda args: print(inspect_run(api.existing_run(args.run), args.n)),
    "submit": cmd_submit,
    "status": cmd_status,
    "logs": lambda args: print(jobs_api.logs(args.submission_id, args.address), end=""),
    "stop": cmd_stop,
    # that step of the knowledge base (another factory on a built index: --force)
    **{step: lambda args: api.build_kb(*_on_run(args), force=args.force, steps=(args.command,))
       for step in api.BUILD_STEPS},
    "search": cmd_search,
    "eval": cmd_eval,
    "writeback": cmd_writeback,
    "mastery": lambda args: api.mastery(*_on_run(args), sample=args.sample, force=args.force),
    "train-pruner": lambda args: api.train_pruner(*_on_run(args), kind=args.kind, force=args.force),
    "prune": lambda args: api.prune(*_on_run(args), args.ratio, force=args.force),
    "tune": lambda args: api.tune(*_on_run(args), force=args.force),
    "train-router": lambda args: api.train_router(*_on_run(args), force=args.force),
    "run": cmd_run,
    "plan": cmd_plan,
    "demo": cmd_demo,
    "export": cmd_export,
    "data": cmd_data,
    "doctor": doctor.run,
}


# Commands that write their RUN folder take its lease first: one writer per run folder (`run` takes it itself).
WRITERS = {"ingest", "embed", "index", "eval", "mastery", "train-pruner", "prune", "tune", "train-router",
           "writeback", "demo"}


def _writer_lease(args):
    if args.command not in WRITERS or (args.command == "writeback" and args.list):
        return contextlib.nullcontext()
    return writing(args.run, args.holder)


@contextlib.contextmanager
def writing(run_dir: str, holder: str):
    """The run folder's lease, held while the block runs; what earlier commands' kills left swept first."""
    with run_lease(run_dir, holder) as lease:
        sweep_run(RunFolder(run_dir))
        yield lease


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if not args.verbose:  # which CPU build faiss tried first ("Could not load library with AVX2 support") is noise
        logging.getLogger("faiss.loader").setLevel(logging.WARNING)
    args.holder = " ".join(["wbrag", *(sys.argv[1:] if argv is None else argv)])[:300]
    try:
        with _writer_lease(args):
            code = COMMANDS[args.command](args)
    except KeyboardInterrupt:  # Ctrl-C: one line, the shell's code for it
        logging.disable(logging.CRITICAL)  # a thread still starting a service logs nothing after the line
        print(f"wbrag {args.command}: interrupted; completed stages and committed blocks are kept: rerun the same "
              "command to resume", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - sorted below: a person's mistake is one line, a bug its traceback
        message = user_error(exc)
        if message is None:
            raise
        if args.verbose:
            logging.getLogger("wbrag").debug("the error's traceback", exc_info=exc)
        print(f"wbrag {args.command}: {message}", file=sys.stderr)
        return 2
    return code if isinstance(code, int) else 0


def user_error(exc: BaseException) -> str | None:
    """The one-line message of an error a person can fix, also raised in a Ray worker; None for a bug."""
    cause = getattr(exc, "cause", None)  # ray.exceptions.RayTaskError / RayActorError keep the worker's error
    if isinstance(cause, BaseException) and cause is not exc:
        return user_error(cause)
    if isinstance(exc, SystemError) and exc.__cause__ is not None:  # raised by a signal handler inside a C call
        return user_error(exc.__cause__)  # (the lease's LeaseLost during a ray.get): CPython wraps it
    if isinstance(exc, (ConfigError, InputError, FileNotFoundError, IndexError_)):  # the message names the fix / file
        return str(exc).strip() or type(exc).__name__
    if isinstance(exc, OSError):  # storage: permissions, unreachable endpoints, object-store errors
        return f"storage error: {exc}"
    if isinstance(exc, ModuleNotFoundError) and exc.name == "faiss":
        return ("faiss is not installed: pip install 'wbrag-ray[cpu]' (faiss-cpu) on a CPU machine, or "
                "'wbrag-ray[gpu]' (faiss-gpu and vLLM) on a GPU one")
    return None


if __name__ == "__main__":
    sys.exit(main())
