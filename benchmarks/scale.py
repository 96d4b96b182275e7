"""The growth curve: index build, pruner prediction, percentile and keep mask, pruned index, export, report, and
searches with document lookup through the retrieval service (and their recall@10 against an exact search), at
growing corpus sizes; how time and memory grow.

Each size gets a run folder whose ingest and embed stages are synthetic (varied text from a pseudo-word
vocabulary, random unit vectors stored as float16 in the project's embedding-shard format: embedding speed
has its own benchmark) and whose embedding pruner is a random head; every later stage is the project's own
code on a local Ray cluster: `build_kb.index` (index + document store), `zerorag.prune.predict`,
`zerorag.prune.prune` (percentile, keep mask, pruned corpus, pruned index) and `Services.retrieval` (search
actors started and loaded once, measured as a stage of its own; then the searches: one coarse assignment per
batch, every shard group's scan, merge, document lookup; the latency also as it was with every shard assigning
its own queries). One index factory for every size (an HNSW coarse quantizer, SQ8 codes),
with a list size held constant by default (nlist = sentences / LIST_SIZE: a query scans the same number of
codes at every size, and k-means, 39 points per centroid, costs n^2), or with `--lists sqrt` the number of
lists `index.factory=auto` picks below 10M vectors (4 sqrt(n): k-means costs n, a query scans sqrt(n)).

Shards and search actors have a fixed size (SHARD_GB) at every corpus size, so their number grows with the
corpus and what one process holds does not; each size runs in a fresh process with its own local Ray.

Memory: the driver's peak (VmHWM, reset per stage) and, per kind of Ray worker (its process title: the task's
function or the actor's class), the largest resident set seen by a sampler polling every worker process
every 0.2 s. The ratios of 4M to 1M sentences are the result; the last table extrapolates each stage to
138M sentences on N nodes from the measured rows per CPU-second.

    python -m benchmarks.scale [--sizes 250000,1000000,4000000] [--dim 384] [--lists constant|sqrt]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import header, local_ray, report, report_pressure, report_ratio, run_module_main

WIKIPEDIA_SENTENCES = 138_000_000
SENTENCES_PER_SHARD = 100_000  # one ingest / embedding shard, about what a 64 MB ingest shard of Wikipedia holds
SENTENCES_PER_PASSAGE = 6  # Wikipedia: 21M passages, 138M sentences
LIST_SIZE = 1_000  # vectors per IVF list: nlist grows with the corpus, the codes scanned per query do not
QUERIES = 2_000
RATIO = 0.3
SHARD_GB = 0.15  # index shard and search-actor budget: about 400,000 SQ8 vectors of 384 dimensions
TOPICS = 1_000  # text embeddings cluster by topic: each passage's sentences lie around one of these centres
RECALL_QUERIES = 1_000  # stored vectors plus noise (cosine about 0.8 to them), searched against an exact search
OLD_NPROBE = 16  # what this benchmark searched with before index.nprobe=auto


# --- synthetic run folder -------------------------------------------------------------------------------


def _vocabulary(size: int = 8_000, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    syllables = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "ber", "dan", "gel", "hor", "jun", "mar", "pel",
                 "quo", "ris", "sto", "tur", "wen", "xal", "yor", "zen", "an", "el", "is", "on", "ur"]
    return ["".join(rng.choice(syllables, rng.integers(1, 4))) for _ in range(size)]


def _topic_centres(dim: int) -> np.ndarray:
    centres = np.random.default_rng(12345).standard_normal((TOPICS, dim)).astype(np.float32)
    return centres / np.linalg.norm(centres, axis=1, keepdims=True)


def _write_shard(item: tuple[int, int, int, str]) -> int:
    """One synthetic ingest shard (passages, sentences) and its embedding shard; ids as ingest makes them:
    unique, ascending within the shard, the shard's range disjoint from the others."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from wbrag_ray.formats import PASSAGES, SENTENCES, embeddings_table

    index, n, dim, root = item
    rng = np.random.default_rng(index + 1)
    words = np.array(_vocabulary())
    passages = math.ceil(n / SENTENCES_PER_PASSAGE)
    pids = (np.int64(index + 1) << 40) + np.arange(passages, dtype=np.int64) * 64
    positions = np.arange(n) % SENTENCES_PER_PASSAGE
    owner = np.arange(n) // SENTENCES_PER_PASSAGE
    sids = pids[owner] + positions
    lengths = rng.integers(6, 26, size=n)
    picks = rng.integers(len(words), size=int(lengths.sum()))
    cuts = np.cumsum(lengths)[:-1]
    sentences = [" ".join(w).capitalize() + "." for w in np.split(words[picks], cuts)]
    texts = [" ".join(sentences[i : i + SENTENCES_PER_PASSAGE]) for i in range(0, n, SENTENCES_PER_PASSAGE)]
    name = f"shard-{index:06d}.parquet"
    pq.write_table(pa.table({"pid": pids, "doc_id": [str(p) for p in pids],
                             "title": [f"Article {index}-{p}" for p in range(passages)], "text": texts},
                            schema=PASSAGES), os.path.join(root, "ingest", "passages", name))
    pq.write_table(pa.table({"sid": sids, "pid": pids[owner], "position": positions.astype(np.int32),
                             "text": sentences}, schema=SENTENCES), os.path.join(root, "ingest", "sentences", name))
    # around topic centres shared by every shard (a passage's sentences share its topic): IVF lists then follow the
    # topics, as they do on real embeddings; uniform random vectors have no neighbourhoods for recall to find
    centres = _topic_centres(dim)
    topic = rng.integers(len(centres), size=passages)[owner]
    vecs = centres[topic] + rng.standard_normal((n, dim), dtype=np.float32) / np.sqrt(dim)
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    pq.write_table(embeddings_table(sids, vecs.astype(np.float16), id_column="sid"),
                   os.path.join(root, "embed", f"emb-{index:06d}.parquet"))
    return n


def _config(root: Path, n: int, dim: int, lists: str = "constant"):
    from wbrag_ray.config import load_config

    if lists == "sqrt":  # index.factory=auto's rule below 10M vectors: a query scans more as the corpus grows,
        nlist = 2 ** round(math.log2(4 * math.sqrt(n)))  # k-means (sample 39 x nlist, cost sample x nlist) does not
    else:  # constant list size: a query scans the same codes at every size, k-means grows as n^2
        nlist = 2 ** max(4, round(math.log2(n / LIST_SIZE)))
    # Shards and search actors of a fixed size at every corpus size: their number grows with the corpus, what
    # one process holds does not (as on a cluster sized for 138M sentences).
    return load_config(None, [
        "index.unit=sentence", f"index.factory=IVF{nlist}_HNSW32,SQ8", f"index.train_sample={39 * nlist}",
        "index.nprobe=auto", "index.num_shards=auto", f"index.shard_memory_gb={SHARD_GB}", "zerorag.pruner=embedding",
        f"retrieval.actor_memory_gb={SHARD_GB}", "retrieval.search_cpus=0.1", f"ingest.corpus={root / 'synthetic'}",
    ])


def build_synthetic_run(root: Path, n: int, dim: int, lists: str = "constant"):
    """A run folder whose ingest, embed and embedding-pruner stages are complete (synthetic, see the doc)."""
    import ray

    from wbrag_ray.build_kb import EMBED, INGEST
    from wbrag_ray.models.pruner import EmbeddingHead
    from wbrag_ray.run import RunFolder
    from wbrag_ray.zerorag.mastery import MASTERY
    from wbrag_ray.zerorag.pruners import PRUNERS

    config = _config(root, n, dim, lists)
    for sub in ("ingest/passages", "ingest/sentences", "embed"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    run = RunFolder(str(root))
    run.bind_config(config)
    sizes = [min(SENTENCES_PER_SHARD, n - s) for s in range(0, n, SENTENCES_PER_SHARD)]
    items = [(i, size, dim, str(root)) for i, size in enumerate(sizes)]
    write = ray.remote(num_cpus=1)(_write_shard)
    run.execute(INGEST, config, lambda: {"rows_in": len(items), "rows_out": len(items), "rows_rejected": 0,
                                         "sentences": sum(ray.get([write.remote(it) for it in items]))})
    run.execute(EMBED, config, lambda: {"rows_in": n, "rows_out": n, "rows_rejected": 0, "unit": "sentence"})

    def head() -> dict[str, Any]:
        rng = np.random.default_rng(0)
        weights = {"w0": rng.normal(size=(dim, 32)).astype(np.float32) / math.sqrt(dim),
                   "b0": np.zeros(32, np.float32), "w1": rng.normal(size=(32, 1)).astype(np.float32),
                   "b1": np.zeros(1, np.float32)}
        folder = run.layout.zero_rag.pruner("embedding")
        EmbeddingHead(weights).save(folder.path, {"synthetic": True})
        return {"rows_in": 0, "rows_out": 0, "rows_rejected": 0}

    # The pruner's inputs are stages too: a synthetic run has no scored sample (the head is random).
    run.execute(MASTERY, config, lambda: {"rows_in": 0, "rows_out": 0, "rows_rejected": 0, "synthetic": True})
    run.execute(PRUNERS["embedding"], config, head)
    return run, config


# --- memory ---------------------------------------------------------------------------------------------


def _worker_kind(title: str) -> str | None:
    """`ray::_add_task` -> `_add_task`; `ray::SearchActor.search` -> `SearchActor`; Ray's own processes and
    idle workers -> None."""
    if not title.startswith("ray::"):
        return None
    kind = title[5:].split(".")[0].split("(")[0].split()[0] if title[5:].strip() else ""
    return None if kind in RAY_INTERNAL or kind.startswith("_Telemetry") else kind


# Ray's own processes and actors (agents, Ray Data's bookkeeping actors): not the project's workers.
RAY_INTERNAL = {"", "IDLE", "_StatsActor", "_AutoscalingCoordinatorActor", "AutoscalingRequester", "DashboardAgent",
                "RuntimeEnvAgent", "ActorLocationTracker", "FooterReader", "ListFiles"}


class WorkerPeaks:
    """Largest resident set per kind of Ray worker while the `with` block runs (polling every 0.2 s), and the
    largest *owned* part of it, of the workers and of this driver: resident minus what is shared with the
    page cache and the object store (file pages mapped around a memory-mapped lookup, objects mapped from
    Ray's shared-memory store: counted in every process that maps them, held by none of them)."""

    def __enter__(self) -> WorkerPeaks:
        self.peaks: dict[str, float] = {}
        self.owned: dict[str, float] = {}
        self.driver_owned = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def _poll(self) -> None:
        import psutil

        me = psutil.Process()
        while not self._stop.is_set():
            info = me.memory_info()
            self.driver_owned = max(self.driver_owned, (info.rss - info.shared) / (1 << 20))
            # this benchmark's own Ray cluster only: its raylet and workers descend from this process
            for p in me.children(recursive=True):
                try:
                    kind = _worker_kind(" ".join(p.cmdline()))
                    if kind:
                        info = p.memory_info()
                        self.peaks[kind] = max(self.peaks.get(kind, 0.0), info.rss / (1 << 20))
                        self.owned[kind] = max(self.owned.get(kind, 0.0), (info.rss - info.shared) / (1 << 20))
                except psutil.Error:
                    continue
            self._stop.wait(0.2)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


# --- recall -------------------------------------------------------------------------------------------


def recall_queries(embed_dir: str, count: int, dim: int, seed: int = 11) -> tuple[np.ndarray, np.ndarray]:
    """(source ids, queries): `count` stored vectors drawn from every embedding shard, each moved by noise to a
    cosine of about 0.8, as a question is near its passage."""
    from wbrag_ray.index.files import embedding_files, read_embedding_shard
    from wbrag_ray.storage import resolve

    rng = np.random.default_rng(seed)
    files = embedding_files(resolve(embed_dir))
    per_file = np.bincount(rng.integers(len(files), size=count), minlength=len(files))
    ids, vecs = [], []
    for f, k in zip(files, per_file, strict=True):
        if k:
            shard_ids, shard_vecs = read_embedding_shard(f)
            rows = rng.choice(len(shard_ids), k, replace=False)
            ids.append(shard_ids[rows])
            vecs.append(shard_vecs[rows].astype(np.float32))
    q = np.concatenate(vecs) + 0.75 / np.sqrt(dim) * rng.standard_normal((count, dim)).astype(np.float32)
    return np.concatenate(ids), q / np.linalg.norm(q, axis=1, keepdims=True)


def exact_top_k(embed_dir: str, queries: np.ndarray, k: int = 10) -> np.ndarray:
    """The exact top-k ids of each query by inner product over every stored vector (faiss's Flat search, one
    embedding shard at a time, merged): the reference recall is measured against."""
    import faiss

    from wbrag_ray.index.files import embedding_files, read_embedding_shard
    from wbrag_ray.retrieval.hits import merge_results
    from wbrag_ray.storage import resolve

    found = []
    for f in embedding_files(resolve(embed_dir)):
        ids, vecs = read_embedding_shard(f)
        flat = faiss.IndexIDMap2(faiss.IndexFlatIP(queries.shape[1]))
        flat.add_with_ids(np.ascontiguousarray(vecs, dtype=np.float32), ids)
        found = [merge_results([*found, flat.search(queries, k)], k)]
    return found[0][1]


def recall_at_k(found: np.ndarray, truth: np.ndarray, sources: np.ndarray) -> dict[str, float]:
    """recall@k of each query's source vector (1-R@k) and of the exact top k (k-R@k)."""
    k = truth.shape[1]
    return {"source_in_top_k": float(np.mean([s in row for s, row in zip(sources, found, strict=True)])),
            "exact_top_k": float(np.mean([len(set(t) & set(row)) / k for t, row in zip(truth, found, strict=True)]))}


def _search_ids(index_dir: str, nprobe: int | str, vectors: np.ndarray, k: int) -> tuple[np.ndarray, float, int]:
    """(ids, CPU seconds, the nprobe used) of one process and thread searching every shard at `nprobe`, as a
    search actor does (one coarse assignment per batch)."""
    import faiss

    from wbrag_ray.index.files import load_manifest, named_shards
    from wbrag_ray.index.search import ShardSearch, search_nprobe
    from wbrag_ray.storage import resolve

    faiss.omp_set_num_threads(1)
    manifest = load_manifest(resolve(index_dir))
    searcher = ShardSearch.load(index_dir, named_shards(manifest), manifest["dim"], nprobe)
    t0 = time.process_time()
    ids = searcher.search(vectors, k)[1]
    return ids, time.process_time() - t0, search_nprobe(searcher.shards[0], nprobe)


# --- one size -------------------------------------------------------------------------------------------


def _search_cpu(index_dir: str, nprobe: int, vectors: np.ndarray, k: int) -> dict[str, float]:
    """CPU seconds of the queries' search over every shard of the index in one process and one thread, with one
    coarse assignment for all shards (`ShardSearch`) and with every shard assigning itself: the work of a
    search, apart from how many processes share the machine's CPUs."""
    import faiss

    from wbrag_ray.index.files import load_manifest, named_shards
    from wbrag_ray.index.search import ShardSearch
    from wbrag_ray.retrieval.hits import merge_results
    from wbrag_ray.storage import resolve

    faiss.omp_set_num_threads(1)
    manifest = load_manifest(resolve(index_dir))
    searcher = ShardSearch.load(index_dir, named_shards(manifest), manifest["dim"], nprobe)
    shards = searcher.shards
    t0 = time.process_time()
    searcher.search(vectors, k)
    t1 = time.process_time()
    merge_results([shard.search(vectors, k) for shard in shards], k)
    return {"shared_s": t1 - t0, "each_shard_s": time.process_time() - t1, "shards": len(shards)}


def measure_size(root: Path, n: int, dim: int, queries: int, lists: str = "constant") -> dict[str, dict[str, Any]]:
    import shutil

    import ray

    from wbrag_ray import build_kb
    from wbrag_ray.export import export_kb
    from wbrag_ray.ray_runtime import peak_rss_mb, reset_peak_rss
    from wbrag_ray.report import write_report
    from wbrag_ray.stages.service import Services
    from wbrag_ray.zerorag.prune import predict, prune

    t0 = time.perf_counter()
    run, config = build_synthetic_run(root, n, dim, lists)
    report(f"{n} synthetic corpus written", time.perf_counter() - t0, "s")
    rng = np.random.default_rng(7)
    vectors = rng.standard_normal((queries, dim), dtype=np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    results: dict[str, dict[str, Any]] = {}

    def stage(name: str, rows: int, fn) -> Any:
        reset_peak_rss()
        with WorkerPeaks() as peaks:
            t = time.perf_counter()
            out = fn()
            seconds = time.perf_counter() - t
        results[name] = {"seconds": seconds, "rows": rows, "rows_per_s": rows / seconds,
                         "driver_peak_mb": peak_rss_mb(), "workers": dict(peaks.peaks),
                         "driver_owned_mb": peaks.driver_owned, "workers_owned": dict(peaks.owned)}
        kinds = ", ".join(f"{k} {v:,.0f} ({peaks.owned[k]:,.0f} owned)" for k, v in sorted(peaks.peaks.items()))
        print(f"[{n:,}] {name}: {seconds:.1f} s, {rows / seconds:,.0f} rows/s, driver peak "
              f"{results[name]['driver_peak_mb']:,.0f} MiB ({peaks.driver_owned:,.0f} owned); worker peaks MiB: "
              f"{kinds}", flush=True)
        return out

    stage("index build", n, lambda: build_kb.index(run, config))
    built = run.stats("index")
    results["_index"] = {k: built.get(k) for k in ("factory", "train_s", "add_s", "merge_s", "num_shards", "train_sample",
                                                   "train_peak_rss_mb", "add_peak_rss_mb", "merge_peak_rss_mb")}
    print(f"[{n:,}] index build split: {results['_index']}", flush=True)
    stage("pruner prediction", n, lambda: predict(run, config))
    stage("percentile, keep mask, pruned index", n, lambda: prune(run, config, RATIO))
    # what a user does with the built base: export it (FlashRAG's format: corpus.jsonl + one index.faiss) and report
    stage("export (FlashRAG)", n, lambda: export_kb(run, config, "flashrag", str(root / "export")))
    shutil.rmtree(root / "export", ignore_errors=True)
    stage("report", n, lambda: write_report(run))

    # the exact reference of the recall queries first: with 11 search actors holding a 2-CPU cluster's CPUs, a task
    # that asks for one would wait for them forever
    sources, near = recall_queries(run.layout.embed.uri, RECALL_QUERIES, dim)
    truth = ray.get(ray.remote(num_cpus=1)(exact_top_k).remote(run.layout.embed.uri, near, 10))

    with Services() as services:
        # the search actors start and load their shard groups once; every search after uses them
        service = stage("retrieval service start", n, lambda: services.retrieval(
            ((run.layout.index.uri, None, "base"),), config.index, config.retrieval))

        def searches() -> None:
            batch, hits = 100, 0
            for start in range(0, queries, batch):
                found = service.search_vectors(vectors[start : start + batch], config.retrieval.top_k)
                hits += sum(len(h) for h in found)
                assert all(h.text for hits_ in found for h in hits_), "a hit without its document"
            pool = service.pools[0]
            shared = pool.shared_assignment
            latency = service.latency_ms(vectors[:batch], config.retrieval.top_k, 0.3)
            pool.shared_assignment = False  # as before: every shard runs the coarse quantizer itself
            each_group = service.latency_ms(vectors[:batch], config.retrieval.top_k, 0.3)
            pool.shared_assignment = shared
            results["_search"] = {"latency_ms": latency, "latency_ms_each_shard_assigns": each_group,
                                  "shared_assignment": shared, "hits": hits, "groups": len(pool.actors)}

        stage("2,000 searches + document lookup", queries, searches)

        # recall: the service's own search (index.nprobe=auto) against the exact search of the same vectors
        served = np.array([[h.id for h in hits] + [-1] * (10 - len(hits))
                           for hits in service.search_vectors(near, 10)])
    search_one = ray.remote(num_cpus=1)(_search_ids)
    recall: dict[str, Any] = {"service_auto": recall_at_k(served, truth, sources)}
    for nprobe in (OLD_NPROBE, "auto"):  # the same search in one process: its recall and its CPU per query
        ids, cpu_s, used = ray.get(search_one.remote(run.layout.index.uri, nprobe, near, 10))
        recall[f"nprobe_{nprobe}"] = {**recall_at_k(ids, truth, sources), "nprobe": used,
                                      "cpu_ms_per_query": 1000 * cpu_s / len(near)}
    results["_recall"] = recall
    print(f"[{n:,}] recall@10 against exact search: {json.dumps(recall)}", flush=True)

    # the same queries' search work in one task holding the whole index (a benchmark's view, not the service's)
    results["_search"]["cpu"] = ray.get(ray.remote(num_cpus=1)(_search_cpu).remote(
        run.layout.index.uri, config.index.nprobe, vectors, config.retrieval.top_k))
    return results


# --- report ---------------------------------------------------------------------------------------------

STAGES = ("index build", "pruner prediction", "percentile, keep mask, pruned index", "export (FlashRAG)", "report",
          "retrieval service start", "2,000 searches + document lookup")
BULK = STAGES[:4]  # one task per shard: they spread over a cluster's every CPU
SEARCHES = STAGES[-1]


def growth_table(all_results: dict[int, dict[str, dict[str, Any]]], small: int, large: int) -> None:
    print("\n| stage | size | seconds | rows/s | driver peak MiB (owned) | largest worker peak MiB (owned, kind) |")
    print("|---|---|---|---|---|---|")
    for name in STAGES:
        for n, res in all_results.items():
            r = res[name]
            kind, peak = max(r["workers"].items(), key=lambda kv: kv[1], default=("-", 0.0))
            owned = r.get("workers_owned", {}).get(kind, 0.0)
            print(f"| {name} | {n:,} | {r['seconds']:.1f} | {r['rows_per_s']:,.0f} | {r['driver_peak_mb']:,.0f} "
                  f"({r.get('driver_owned_mb', 0.0):,.0f}) | {peak:,.0f} ({owned:,.0f}, {kind}) |")
    print(f"\nratios {large:,} / {small:,} sentences (goal: each within 1.3x; search time is per query)")
    for name in STAGES:
        a, b = all_results[small][name], all_results[large][name]
        per_row_a = a["seconds"] / a["rows"]
        per_row_b = b["seconds"] / b["rows"]
        report_ratio(f"{name}: time per row", per_row_b, per_row_a)
        report_ratio(f"{name}: driver peak memory", b["driver_peak_mb"], a["driver_peak_mb"])
        report_ratio(f"{name}: driver owned memory", b["driver_owned_mb"], a["driver_owned_mb"])
        for kind in sorted(set(a["workers"]) & set(b["workers"])):
            report_ratio(f"{name}: {kind} peak memory", b["workers"][kind], a["workers"][kind])
            report_ratio(f"{name}: {kind} owned memory", b["workers_owned"][kind], a["workers_owned"][kind])


def extrapolation(res: dict[str, dict[str, Any]], n: int, cpus: int, nodes: Sequence[int], cores: int) -> None:
    """138M sentences on N nodes of `cores` CPUs, from this run's rows per CPU-second (the stages are one task
    per shard or per shard group: they spread over every CPU of a cluster until there are fewer shards)."""
    shards = math.ceil(WIKIPEDIA_SENTENCES / SENTENCES_PER_SHARD)
    print(f"\nextrapolated to {WIKIPEDIA_SENTENCES:,} sentences ({shards:,} shards) from the {n:,}-sentence run "
          f"(rows per CPU-second = rows/s / {cpus} CPUs here); hours")
    print("| stage | rows per CPU-second | " + " | ".join(f"{k} x {cores} cores" for k in nodes) + " |")
    print("|---|---|" + "---|" * len(nodes))
    for name in BULK:
        per_cpu = res[name]["rows_per_s"] / cpus
        cells = [WIKIPEDIA_SENTENCES / (per_cpu * min(k * cores, shards)) / 3600 for k in nodes]
        print(f"| {name} | {per_cpu:,.0f} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")
    per_cpu = res[SEARCHES]["rows_per_s"] / cpus
    print(f"| queries/s per search CPU (index grows with shards: same list size) | {per_cpu:,.0f} | "
          + " | ".join(f"{per_cpu * k * cores:,.0f} q/s" for k in nodes) + " |")


def plot(all_results: dict[int, dict[str, dict[str, Any]]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted(all_results)
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4))
    for name in STAGES:
        ax_t.plot(sizes, [all_results[n][name]["seconds"] / all_results[n][name]["rows"] * 1e6 for n in sizes],
                  marker="o", label=name)
        ax_m.plot(sizes, [max(all_results[n][name]["workers"].values(), default=0) for n in sizes], marker="o",
                  label=name)
    ax_m.plot(sizes, [max(all_results[n][s]["driver_peak_mb"] for s in STAGES) for n in sizes], "k--", marker="s",
              label="driver (any stage)")
    # resident counts the document store's page-cache pages the lookups mapped; owned is what the driver holds
    ax_m.plot(sizes, [max(all_results[n][s].get("driver_owned_mb", 0.0) for s in STAGES) for n in sizes], "k:",
              marker="s", label="driver, owned (any stage)")
    for ax, title in ((ax_t, "microseconds per row (per query for searches)"), (ax_m, "peak resident MiB")):
        ax.set_xscale("log")
        ax.set_xlabel("sentences")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    ax_t.set_yscale("log")  # searches are per query, the other stages per row: decades apart
    ax_m.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"plot: {out}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="250000,1000000,4000000", help="sentences per run, comma-separated")
    parser.add_argument("--dim", type=int, default=384, help="vector dimension (the bundled embedder's: 384)")
    parser.add_argument("--queries", type=int, default=QUERIES)
    parser.add_argument("--root", default="/tmp/wbrag-scale", help="where the run folders go (deleted after each)")
    parser.add_argument("--cpus", type=int, default=2, help="CPUs of the local Ray cluster")
    parser.add_argument("--nodes", default="1,8,32", help="cluster sizes of the 138M extrapolation")
    parser.add_argument("--cores-per-node", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="sizes 20000,80000 (a smoke run, not a measurement)")
    parser.add_argument("--lists", choices=("constant", "sqrt"), default="constant",
                        help="IVF lists: n/1000 (a query costs the same at every size) or 4*sqrt(n) (index.factory=auto's "
                             "rule below 10M: k-means grows linearly)")
    parser.add_argument("--keep-results", action="store_true",
                        help="take a size's figures from an earlier run's result-N.json under --root (a curve whose "
                        "last size stopped: rerun only that one)")
    parser.add_argument("--one", type=int, default=0, help=argparse.SUPPRESS)  # one size, run by the parent
    args = parser.parse_args(argv)
    sizes = [20_000, 80_000] if args.quick else [int(s) for s in args.sizes.split(",")]
    import shutil
    import subprocess
    import sys

    if not args.one:
        header("scale", args)

    if args.one:  # one size, in this fresh process (the parent collects the results)
        root = Path(args.root) / f"run-{args.one}"
        shutil.rmtree(root, ignore_errors=True)
        with local_ray(args.cpus):
            result = measure_size(root, args.one, args.dim, args.queries, args.lists)
        shutil.rmtree(root, ignore_errors=True)
        (Path(args.root) / f"result-{args.one}.json").write_text(json.dumps(result))
        return 0
    # Each size in a fresh process with a fresh local Ray: the driver's memory is then its own for that size,
    # not what the earlier sizes left in the allocator.
    all_results: dict[int, dict[str, dict[str, Any]]] = {}
    Path(args.root).mkdir(parents=True, exist_ok=True)
    for n in sizes:
        if args.keep_results and (Path(args.root) / f"result-{n}.json").exists():
            print(f"[{n:,}] measured earlier: {Path(args.root) / f'result-{n}.json'} (--keep-results)", flush=True)
            all_results[n] = json.loads((Path(args.root) / f"result-{n}.json").read_text())
            continue
        cmd = [sys.executable, "-m", "benchmarks.scale", "--one", str(n), "--dim", str(args.dim), "--queries",
               str(args.queries), "--root", args.root, "--cpus", str(args.cpus), "--lists", args.lists]
        subprocess.run(cmd, check=True)
        all_results[n] = json.loads((Path(args.root) / f"result-{n}.json").read_text())
    report_pressure("after the runs")
    small, large = (sizes[-2], sizes[-1]) if len(sizes) > 1 else (sizes[0], sizes[0])
    growth_table(all_results, small, large)
    extrapolation(all_results[large], large, args.cpus, [int(k) for k in args.nodes.split(",")], args.cores_per_node)
    for n, res in all_results.items():
        report(f"{n} index build split", json.dumps(res["_index"]))
        report(f"{n} search latency (search actors' own, per query)", res["_search"]["latency_ms"], "ms", 3)
        report(f"{n} search latency, every shard assigning its own queries", res["_search"]["latency_ms_each_shard_assigns"],
               "ms", 3)
        report_ratio(f"{n} one coarse assignment per search: latency", res["_search"]["latency_ms"],
                     res["_search"]["latency_ms_each_shard_assigns"])
        report(f"{n} search shard groups", res["_search"]["groups"])
        cpu = res["_search"]["cpu"]
        report(f"{n} search CPU, {args.queries} queries, one process and thread, one assignment ({cpu['shards']} shards)",
               cpu["shared_s"], "s", 3)
        report(f"{n} search CPU, every shard assigning itself", cpu["each_shard_s"], "s", 3)
    print("\n| size | IVF lists | nprobe (auto) | recall@10 of the source, service | of the exact top 10, service "
          f"| the same at nprobe {OLD_NPROBE} (source / exact top 10) | CPU ms per query, auto / {OLD_NPROBE} |")
    print("|---|---|---|---|---|---|---|")
    for n, res in all_results.items():
        rec = res["_recall"]
        auto, old = rec["nprobe_auto"], rec[f"nprobe_{OLD_NPROBE}"]
        lists = res["_index"].get("factory", "")
        print(f"| {n:,} | {lists} | {auto['nprobe']} | {rec['service_auto']['source_in_top_k']:.3f} | "
              f"{rec['service_auto']['exact_top_k']:.3f} | {old['source_in_top_k']:.3f} / {old['exact_top_k']:.3f} | "
              f"{auto['cpu_ms_per_query']:.2f} / {old['cpu_ms_per_query']:.2f} |")
        report_ratio(f"{n} search CPU per query, nprobe auto ({auto['nprobe']}) / {OLD_NPROBE}",
                     auto["cpu_ms_per_query"], old["cpu_ms_per_query"])
    a, b = all_results[small]["_search"]["cpu"], all_results[large]["_search"]["cpu"]
    report_ratio(f"search CPU per query {large:,} / {small:,}, one assignment", b["shared_s"], a["shared_s"])
    report_ratio(f"search CPU per query {large:,} / {small:,}, every shard assigning", b["each_shard_s"],
                 a["each_shard_s"])
    Path(args.root).mkdir(parents=True, exist_ok=True)
    (Path(args.root) / "scale.json").write_text(json.dumps({str(k): v for k, v in all_results.items()}, indent=1))
    plot(all_results, Path(args.root) / "scale.png")
    return 0


if __name__ == "__main__":
    run_module_main(main)
