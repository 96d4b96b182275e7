"""Zero-RAG's evaluation grid: every pruning ratio (and 0) without and with router, tuned adapter and the active
write-back index, with retrieval latency and index size (RUN/zero_rag/grid.json)."""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any

from wbrag_ray import rag
from wbrag_ray.config import WbragConfig
from wbrag_ray.evaluation.evaluate import dataset_name, evaluate_stage
from wbrag_ray.evaluation.stage import EVAL
from wbrag_ray.formats import read_dataset
from wbrag_ray.generation.passes import GeneratorPasses
from wbrag_ray.generation.stage import GenerateStage
from wbrag_ray.index.files import load_manifest
from wbrag_ray.retrieval.stage import query_gpu_refusal, query_vectors
from wbrag_ray.run import RunFolder
from wbrag_ray.stages.service import Services, shared_or_own
from wbrag_ray.storage import resolve
from wbrag_ray.work import Generate, Sizes
from wbrag_ray.writeback.versions import read_active
from wbrag_ray.zerorag.prune import index_bytes, index_for_ratio
from wbrag_ray.zerorag.tune import with_adapter


def evaluate_grid(run: RunFolder, config: WbragConfig, dataset: str, force: bool = False,
                  services: Services | None = None) -> list[dict[str, Any]]:
    """Evaluate every ratio (and 0) without and with router, adapter and write-back; write grid.json."""
    z = config.zerorag
    query_gpu_refusal("the Zero-RAG grid", config.embedder, config.retrieval)  # before any cell
    name = dataset_name(config, dataset)
    ratios = sorted({0.0, *z.ratios})
    routers = [False, True] if z.router else [False]
    # the adapter's cells first: the services handed over already hold that model
    adapters = [True, False] if z.tune.enabled else [False]
    writebacks = [False, True] if read_active(run)["version"] else [False]
    questions, _ = read_dataset(resolve(dataset), limit=config.eval.limit)
    rows: list[dict[str, Any]] = []
    latency: dict[float, float] = {}
    with shared_or_own(services) as services:  # one set of services; the retrieval service follows the cell
        # the latency queries, as the retrieval actors embed them
        vectors = query_vectors(questions["question"].to_pylist(), config.embedder, config.retrieval, services)
        for turn, adapter in enumerate(adapters):
            cfg = config.model_copy(update={"generator": with_adapter(run, config.generator)}) if adapter else config
            passes = GeneratorPasses(cfg.generator, services)  # with or without the adapter, for every cell
            # back and forth over the ratios, so the last index loaded serves the next cell first
            for ratio in ratios if turn % 2 == 0 else ratios[::-1]:
                index = index_for_ratio(run, ratio)
                manifest = load_manifest(index)
                if ratio not in latency:  # measured by the search actors that then serve the cell's passes
                    service = passes.services.retrieval(((index.uri, None, "base"),), config.index, config.retrieval)
                    latency[ratio] = service.latency_ms(vectors, config.retrieval.top_k)
                for router, writeback in itertools.product(routers, writebacks):
                    first = ratio == ratios[0] and not router and not writeback
                    methods = [m for m in cfg.eval.methods if first or m != "no-retrieval"]  # no index: once is enough
                    if not methods:
                        continue
                    label = eval_label(name, ratio, writeback, router, adapter)
                    cfg_m = cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"methods": methods})})
                    stats = evaluate_stage(run, cfg_m, dataset, label, force=force, passes=passes,
                                           base_index=index.uri, router=run.layout.zero_rag.router.uri if router
                                           else None, setting=label, writeback=writeback)
                    for method, m in stats["methods"].items():
                        searched = method != "no-retrieval"
                        rows.append({
                            "ratio": ratio, "router": router, "adapter": adapter, "writeback": writeback,
                            "method": method, "n": m["n"], "em": m["em"], "f1": m["f1"], "acc": m["acc"],
                            "latency_ms_per_query": round(latency[ratio], 4) if searched else 0.0,
                            # the paper's retrieval speedup: search time saved against the full index
                            "retrieval_speedup_pct": round(100 * (1 - latency[ratio] / latency[0.0]), 2)
                            if searched and latency.get(0.0) else 0.0,
                            # and its total time per question (Table 7): this cell's evaluation, all its methods
                            "seconds_per_question": round(m["seconds"] / max(1, m["n"]), 4),
                            "index_bytes": index_bytes(index), "sentences": int(manifest["count"]),
                            "retrieval_skipped": m.get("retrieval_skipped", 0.0) if searched else 1.0,
                        })
        # what the grid's services started and loaded, per service kind
        used = {"started": dict(services.started), "loads": dict(services.loads),
                "generator_actors": services.actor_ids(GenerateStage.name)}
    rows.sort(key=lambda r: (r["adapter"], r["ratio"]))  # stable: each cell's rows as evaluated
    run.layout.zero_rag.grid.write_json({"dataset": dataset, "rows": rows, "services": used})
    print(format_grid(rows), flush=True)
    return rows


def eval_label(name: str, ratio: float | None = None, writeback: bool = False, router: bool = False,
               adapter: bool = False) -> str:
    """The folder prefix of one evaluation: the dataset, then each setting differing from the base, in one order."""
    return (name + (f"-prune{ratio:g}" if ratio is not None else "") + ("-writeback" if writeback else "")
            + ("-router" if router else "") + ("-adapter" if adapter else ""))


def format_grid(rows: list[dict[str, Any]]) -> str:
    head = f"{'ratio':>6} {'wb':>4} {'router':>7} {'adapter':>8} {'method':<13}{'acc':>7}{'em':>7}{'ms/query':>10}" \
           f"{'speedup':>9}{'s/q':>8}{'index MB':>10}{'sentences':>11}{'skipped':>9}"
    lines = ["Zero-RAG evaluation grid", head]
    yes = {True: "yes", False: "no"}
    for r in rows:
        lines.append(f"{r['ratio']:>6g} {yes[bool(r.get('writeback'))]:>4} {yes[bool(r['router'])]:>7} "
                     f"{yes[bool(r['adapter'])]:>8} {r['method']:<13}{r['acc']:>7.3f}{r['em']:>7.3f}"
                     f"{r['latency_ms_per_query']:>10.4f}{r.get('retrieval_speedup_pct', 0.0):>8.1f}%"
                     f"{r.get('seconds_per_question', 0.0):>8.3f}{r['index_bytes'] / 1e6:>10.3f}{r['sentences']:>11}"
                     f"{r['retrieval_skipped']:>9.2f}")
    return "\n".join(lines)


def grid_work(config: WbragConfig, sizes: Sizes, params: dict[str, Any]) -> list[Generate]:
    """What the grid generates: no-retrieval once per adapter (no index), the other methods in every cell of ratio
    x write-back x adapter; a router cell's prompts are its no-router twin's or the closed-book ones, which the
    passes' answer memo reuses."""
    c, z = config, config.zerorag
    n, counted = sizes.questions(c.eval.dataset, c.eval.limit)
    ratios = len({0.0, *z.ratios})
    adapters, writebacks = (2 if z.tune.enabled else 1), (2 if c.writeback.train else 1)
    cells = ratios * (2 if z.router else 1) * adapters * writebacks
    passes = tuple(replace(p, calls=p.calls * adapters * (1 if m == "no-retrieval" else ratios * writebacks))
                   for m in c.eval.methods for p in rag.passes(m, c))
    return [Generate(n, passes, f"questions: {counted}; {cells} settings (ratios x router x adapter x write-back), up "
                     f"to {sum(p.calls for p in passes):g} calls a question (the router's cells reuse their twins' "
                     "answers)", retrieval=True)]


# the grid's evaluations are `EVAL` stages, one a cell
GRID = replace(EVAL, title="evaluation grid", work=grid_work,
               run=lambda folder, config, force, services, params: evaluate_grid(
                   folder, config, config.eval.dataset, force=force, services=services),
               instances=lambda config: [{}] if config.zerorag.enabled and config.eval.dataset else [],
               resources=("generator", "retrieval"), outputs=("eval/<label>-<method>", "zero_rag/grid.json"),
               measured_by=r"eval-.+")
