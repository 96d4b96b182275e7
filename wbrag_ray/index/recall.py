"""The index's search setting measured at build time (`index.nprobe: auto`, `index.target_recall`): a sample of
the index's own vectors, searched exactly (a task per embedding shard) and by the built shards (the retrieval
service's search, `search.SearchGroups`) at growing nprobe (IVF) or efSearch (HNSW). The smallest setting reaching
the target is chosen; where the codes cap recall, the cheapest within PLATEAU of the best, with a warning. The
result is the manifest's `search` entry (`search.measured_settings`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from wbrag_ray.index.files import read_embedding_shard, sample_vectors
from wbrag_ray.index.search import SearchActor, SearchGroups, auto_nprobe, unwrapped
from wbrag_ray.index.sizing import balanced_groups
from wbrag_ray.index.tasks import run_tasks, set_threads
from wbrag_ray.retrieval.hits import merge_results
from wbrag_ray.storage import Location, resolve

log = logging.getLogger(__name__)

RECALL_K = 10  # recall@10 of exact search: the figure faiss's own benchmarks report
PLATEAU = 0.005  # recall within this of the best measured counts as the best (codes cap it)
EF_STEPS = (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)


def nprobe_steps(nlist: int) -> list[int]:
    """The nprobe values tried, ascending: 1, 2, 3, 4, 6, 8, 12, ... (steps of 1.5x and 2x) and every list."""
    steps, p = [], 1
    while p < nlist:
        steps += [p] + ([p * 3 // 2] if p >= 2 and p * 3 // 2 < nlist else [])
        p *= 2
    return [*steps, nlist]


def parameter_of(index) -> tuple[str | None, list | None]:
    """(the setting a search of `index` trades recall for time with, the values to try): nprobe for an IVF,
    efSearch for an HNSW graph; (None, None) for an exact index; (None, [None]) for other codes, measured as is."""
    import faiss

    ivf = faiss.try_extract_index_ivf(index)
    if ivf is not None:
        return "nprobe", nprobe_steps(ivf.nlist)
    inner = unwrapped(index)
    if isinstance(inner, faiss.IndexHNSW):
        return "efSearch", [v for v in EF_STEPS if v > RECALL_K]
    if isinstance(inner, faiss.IndexFlat):
        return None, None
    return None, [None]


def without(ids: np.ndarray, own: np.ndarray, k: int) -> np.ndarray:
    """Each row's first k ids other than the query's own (-1 pads a short row)."""
    out = np.full((len(ids), k), -1, np.int64)
    for r, (row, me) in enumerate(zip(ids, own, strict=True)):
        kept = row[(row != me) & (row >= 0)][:k]
        out[r, :len(kept)] = kept
    return out


def recall(found: np.ndarray, truth: np.ndarray) -> float:
    """The share of the exact neighbours (ids >= 0 in `truth`) that `found` holds, over all queries."""
    hits = sum(len(set(f[f >= 0]) & set(t[t >= 0])) for f, t in zip(found, truth, strict=True))
    return hits / max(int((truth >= 0).sum()), 1)


# --- exact search: a task per embedding shard --------------------------------------------------------


def _exact_task(shared: dict[str, Any], uri: str) -> tuple[np.ndarray, np.ndarray]:
    """(scores, ids) of the sample's k nearest vectors of one embedding shard, by inner product."""
    import faiss

    set_threads(shared["threads"])
    ids, vecs = read_embedding_shard(resolve(uri))
    k = min(shared["k"], len(ids))
    scores, rows = faiss.knn(shared["queries"], np.ascontiguousarray(vecs, np.float32), k,
                             metric=faiss.METRIC_INNER_PRODUCT)
    return scores, np.where(rows >= 0, ids[np.maximum(rows, 0)], -1)


def exact_neighbours(files: list[Location], queries: np.ndarray, own: np.ndarray, *, threads: int,
                     num_cpus: float, parallel: bool) -> np.ndarray:
    """The exact RECALL_K nearest ids of each query, other than itself, over every embedding shard."""
    shared = {"queries": queries, "k": RECALL_K + 1, "threads": threads}
    parts = run_tasks(_exact_task, shared, [f.uri for f in files], num_cpus=num_cpus, parallel=parallel)
    return without(merge_results(parts, RECALL_K + 1)[1], own, RECALL_K)


# --- the built shards searched at each setting -----------------------------------------------------------


def probes(index: Location, shards: list[dict[str, Any]], dim: int, warm: np.ndarray, threads: int, num_cpus: float,
           parallel: bool) -> SearchGroups:
    """The shards loaded for measuring, as built (each step sets its own setting): search actors over contiguous
    groups of shards (as many as the free CPUs hold), or one group in this process; paged in by a search of `warm`,
    so that no timed search loads them."""
    named = [(s["file"], s["count"]) for s in shards]
    unset = (None, None, None, False)
    if not parallel:
        groups = SearchGroups([[SearchActor(index.uri, named, dim, unset, threads)]])
    else:
        import ray

        # actors that cannot all be placed would leave the first ones waiting on the rest
        free = ray.available_resources().get("CPU", 0.0)
        parts = balanced_groups([s["count"] for s in shards], max(1, int(free // num_cpus)))
        groups = SearchGroups([[ray.remote(SearchActor).options(
            num_cpus=num_cpus, memory=int(sum(shards[i]["bytes"] for i in g) * 1.5) + (256 << 20),
        ).remote(index.uri, [named[i] for i in g], dim, unset, threads)] for g in parts])
    try:
        groups.call("ready")
        groups.call("search", warm, RECALL_K + 1)
    except BaseException:
        groups.close()
        raise
    return groups


# --- the choice ------------------------------------------------------------------------------------------


def choose(measured: list[dict[str, Any]], target: float) -> tuple[dict[str, Any], bool]:
    """(the smallest measured setting that reaches `target`, True), or where none does, (the smallest within
    PLATEAU of the best recall, False)."""
    reached = [m for m in measured if m["recall"] >= target]
    if reached:
        return reached[0], True
    best = max(m["recall"] for m in measured)
    return next(m for m in measured if m["recall"] >= best - PLATEAU), False


def levelled(measured: list[dict[str, Any]]) -> bool:
    """Recall stopped rising: the last two steps (a doubling of the setting) added less than PLATEAU."""
    return len(measured) >= 3 and measured[-1]["recall"] - measured[-3]["recall"] < PLATEAU


def measure_search(files: list[Location], counts: list[int], index: Location, shards: list[dict[str, Any]],
                   space: tuple[str | None, list | None], dim: int, *, target: float, queries: int,
                   nprobe: int | str = "auto", ef_search: int | None = None, threads: int, num_cpus: float,
                   parallel: bool) -> dict[str, Any] | None:
    """The manifest's `search` entry (module docstring), an explicit setting measured beside the choice; None for
    an exact index (nothing to trade)."""
    parameter, steps = space  # `parameter_of` the trained index
    if steps is None:
        return None
    explicit = {"nprobe": None if nprobe == "auto" else int(nprobe), "efSearch": ef_search}.get(parameter)
    own, sample = sample_vectors(files, counts, queries, dim, seed=1)
    t0 = time.perf_counter()
    truth = exact_neighbours(files, sample, own, threads=threads, num_cpus=num_cpus, parallel=parallel)
    exact_s = time.perf_counter() - t0
    groups = probes(index, shards, dim, sample[:8], threads, num_cpus, parallel)
    measured: list[dict[str, Any]] = []

    def measure(value: int | None) -> dict[str, Any]:
        if parameter is not None:
            groups.call("configure", value if parameter == "nprobe" else None, value if parameter == "efSearch" else None)
        _, ids, seconds = groups.search(sample, RECALL_K + 1)
        found = without(ids, own, RECALL_K)
        return {"value": value, "recall": round(recall(found, truth), 4),
                # groups are searched side by side (as search actors are): a query waits for the slowest
                "ms_per_query": round(1000 * max(seconds) / len(sample), 4),
                "cpu_ms_per_query": round(1000 * sum(seconds) / len(sample), 4)}

    def beside(value: int | None) -> dict[str, Any] | None:
        """A setting that is not chosen, measured for comparison (taken from the steps where it was one)."""
        if value is None:
            return None
        return next((m for m in measured if m["value"] == value), None) or measure(value)

    try:
        for value in steps:
            measured.append(measure(value))
            if measured[-1]["recall"] >= target or levelled(measured):
                break
        formula = beside(auto_nprobe(steps[-1]) if parameter == "nprobe" else None)
        as_set = beside(explicit)  # what the config's explicit setting gives: searches use it, not the choice
    finally:
        groups.close()
    pick, reached = choose(measured, target)
    entry = {
        "parameter": parameter, "value": pick["value"], "chosen": parameter is not None,
        "recall": pick["recall"], "ms_per_query": pick["ms_per_query"], "cpu_ms_per_query": pick["cpu_ms_per_query"],
        "lists": steps[-1] if parameter == "nprobe" else None, "k": RECALL_K, "target_recall": target, "reached": reached, "queries": len(sample),
        "exact_search_s": round(exact_s, 2), "measured": measured, "formula": formula, "as_set": as_set,
    }
    print(describe(entry), flush=True)
    if not reached:
        log.warning("index.target_recall %.3f is out of reach for this index's codes: the best measured recall@%d "
                    "is %.3f; finer codes (SQ8 -> Flat, more PQ bytes) or a refine stage (',RFlat') would reach "
                    "it", target, RECALL_K, max(m["recall"] for m in measured))
    if as_set is not None and as_set["recall"] < min(target, pick["recall"]):
        log.warning("the index's search as set (%s %d) finds %.3f of exact search's top %d, below index.target_recall "
                    "%.3f: %s would measure and use %s %s", parameter, explicit, as_set["recall"], RECALL_K, target,
                    "index.nprobe: auto" if parameter == "nprobe" else "leaving index.ef_search unset", parameter,
                    pick["value"])
    return entry


def describe(entry: dict[str, Any]) -> str:
    """One line: the setting chosen, its recall against exact search and its time per query; the formula's
    and the one set explicitly beside it."""
    what = f"{entry['parameter']} {entry['value']}" if entry["parameter"] else "as built"
    if entry.get("lists"):
        what += f" of {entry['lists']} lists"
    line = (f"[index] {what}: recall@{entry['k']} {entry['recall']:.3f} of exact search (target "
            f"{entry['target_recall']:g}) at {entry['ms_per_query']:.3f} ms/query, measured on {entry['queries']} of "
            f"the index's vectors")
    for label, other in (("the formula's", entry.get("formula")), ("as set", entry.get("as_set"))):
        if other is not None and other["value"] != entry["value"]:
            line += (f"; {label} {entry['parameter']} {other['value']}: recall {other['recall']:.3f} at "
                     f"{other['ms_per_query']:.3f} ms/query")
    return line
