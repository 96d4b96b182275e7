"""Sharded FAISS indices on synthetic clustered vectors: build, search, pruned views, memory, and 138M.

For Flat, IVF-Flat and IVF-PQ with a refine step (IVF..,PQ48,RFlat):
- build throughput of the sharded Ray build (one add task per embedding shard, merged into index shards of
  100K vectors)
  vs one single-process build of the same factory, reusing the same trained index (training is one task in
  both, so it is timed once and reported apart);
- recall@10 against exact search and query latency (1000 queries, 500 per batch, default nprobe 32);
- query latency and index size of the full index vs a 30%-pruned view (Flat, IVF-Flat);
- peak resident memory of the build tasks vs the bytes of all vectors (the single-process build runs in
  a fresh child process so its peak is its own);
- 138M sentences extrapolated from the measured per-task add rate and bytes per vector.

    python -m benchmarks.index_build [--quick] [--n 1000000] [--dim 384]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import math
import multiprocessing as mp
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from benchmarks.common import Stopwatch, header, local_ray, report, report_ratio, run_module_main

SHARD_ROWS = 50_000  # rows per embedding shard (the embed stage writes one file per Ray block)
QUERIES = 1000
QUERY_BATCH = 500
TARGET = 138_000_000  # sentences of the wiki corpus (DESIGN.md)
SHARD_VECTORS = 100_000  # vectors per index shard: the merge task's memory, whatever the corpus size


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="20K vectors: a smoke run, not a measurement")
    parser.add_argument("--n", type=int, default=200_000, help="vectors (the issue's figure: 1000000)")
    parser.add_argument("--dim", type=int, default=384, help="dimension (384: all-MiniLM-L6-v2)")
    args = parser.parse_args(argv)
    if args.quick:
        args.n = 20_000
    return args


def clustered_chunks(n: int, dim: int, chunk: int, clusters: int = 1000, seed: int = 0, spread: float = 0.6):
    """Unit vectors around `clusters` centres, `chunk` rows at a time (so 1M x 384 never needs two copies)."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(clusters, dim)).astype(np.float32)
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        v = centres[rng.integers(clusters, size=m)] + spread * rng.normal(size=(m, dim)).astype(np.float32)
        v /= np.linalg.norm(v, axis=1, keepdims=True)
        yield start, v


def write_corpus(folder: Path, n: int, dim: int, **shape) -> tuple[np.ndarray, np.ndarray]:
    """Embedding shards of n clustered vectors (ids 0..n-1) plus held-out queries from the same clusters;
    returns (queries, exact top-10 ids), computed shard by shard. `shape`: `clustered_chunks`'s clusters, spread."""
    import pyarrow.parquet as pq

    from wbrag_ray.formats import embeddings_table

    folder.mkdir(parents=True)
    gen = clustered_chunks(n + QUERIES, dim, SHARD_ROWS, **shape)
    queries, best_s, best_i = None, None, None
    for shard, (start, v) in enumerate(gen):
        if queries is None:  # the first QUERIES vectors are queries, not corpus
            queries, v = v[:QUERIES], v[QUERIES:]
        start = max(0, start - QUERIES)
        ids = np.arange(start, start + len(v), dtype=np.int64)
        pq.write_table(embeddings_table(ids, v), folder / f"emb-{shard:06d}.parquet")
        scores = queries @ v.T
        part = np.argsort(-scores, axis=1)[:, :10]
        s, i = np.take_along_axis(scores, part, axis=1), ids[part]
        if best_s is None:
            best_s, best_i = s, i
        else:
            s, i = np.concatenate([best_s, s], axis=1), np.concatenate([best_i, i], axis=1)
            top = np.argsort(-s, axis=1)[:, :10]
            best_s, best_i = np.take_along_axis(s, top, axis=1), np.take_along_axis(i, top, axis=1)
    return queries, best_i


def num_shards(n: int) -> int:
    return max(1, round(n / SHARD_VECTORS))


def _single_process_build(emb: str, out: str, factory: str, trained: bytes, n: int) -> dict:
    from wbrag_ray.config import IndexConfig
    from wbrag_ray.index.build import build_index
    from wbrag_ray.storage import resolve

    return build_index(resolve(emb), resolve(out), "synthetic", "sentence",
                       IndexConfig(factory=factory, num_shards=num_shards(n), gpu=False, target_recall=None),
                       parallel=False, trained=trained)


def search(index_dir: str, queries: np.ndarray, truth: np.ndarray, k_factor: float | None = None,
           nprobe: int | str = "auto") -> tuple[float, float]:
    """(recall@10, ms per query) at `nprobe` (default: the index's own); median of 3 passes over all query batches."""
    from wbrag_ray.retrieval.local import Retriever

    r = Retriever(index_dir, nprobe=nprobe, k_factor=k_factor, batch_size=QUERY_BATCH)
    r.setup()
    times = []
    for _ in range(3):
        with Stopwatch() as sw:
            _, got = r.search_ids(queries, 10)
        times.append(sw.seconds)
    recall = float(np.mean([len(set(g) & set(t)) / 10 for g, t in zip(got, truth, strict=True)]))
    return recall, 1000 * float(np.median(times)) / len(queries)


def index_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("index*.faiss"))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    header("index_build", args)
    from wbrag_ray.config import IndexConfig
    from wbrag_ray.index.build import build_index
    from wbrag_ray.index.prune import prune_index
    from wbrag_ray.storage import resolve

    n, dim = args.n, args.dim
    nlist = 2 ** round(math.log2(4 * math.sqrt(n)))
    factories = {"flat": "Flat", "ivf_flat": f"IVF{nlist},Flat", "ivf_pq_rflat": f"IVF{nlist},PQ48,RFlat"}
    report("vectors", n)
    report("index_shards", num_shards(n))
    report("dim", dim)
    vector_bytes = report("vector_bytes_mb", n * dim * 4 / 2**20, "MiB")
    work = Path(tempfile.mkdtemp(prefix="wbrag-bench-index-"))
    with Stopwatch() as sw:
        queries, truth = write_corpus(work / "emb", n, dim)
    report("corpus_write_s", sw.seconds, "s")
    emb = str(work / "emb")
    spawn = mp.get_context("spawn")
    per_task_rates, bytes_per_vector = [], {}
    with local_ray(num_cpus=2):
        for name, factory in factories.items():
            print(f"# {name}: {factory}", flush=True)
            out = work / name
            ray_stats = build_index(resolve(emb), resolve(str(out)), "synthetic", "sentence",
                                    IndexConfig(factory=factory, num_shards=num_shards(n), gpu=False, target_recall=None),
                                    parallel=True)
            trained = (out / "trained.faiss").read_bytes()
            with cf.ProcessPoolExecutor(1, mp_context=spawn) as pool:  # a fresh process: its own peak RSS
                single = pool.submit(_single_process_build, emb, str(work / f"{name}-single"), factory, trained, n).result()
            report(f"{name}_train_s", ray_stats["train_s"], "s")
            ray_rate = report(f"{name}_ray_add_merge_vectors_per_s", n / (ray_stats["add_s"] + ray_stats["merge_s"]))
            one_rate = report(f"{name}_single_add_merge_vectors_per_s", n / (single["add_s"] + single["merge_s"]))
            report_ratio(f"{name}_ray_vs_single_throughput", ray_rate, one_rate)
            report(f"{name}_ray_task_start_rss_mb", ray_stats["task_base_rss_mb"], "MiB")  # imports, no vectors
            report(f"{name}_ray_task_peak_rss_mb", ray_stats["peak_rss_mb"], "MiB")
            for kind in ("train", "add", "merge"):  # each kind of task's own peak (None: that step did not run)
                if ray_stats.get(f"{kind}_peak_rss_mb") is not None:
                    report(f"{name}_ray_{kind}_task_peak_rss_mb", ray_stats[f"{kind}_peak_rss_mb"], "MiB")
            if ray_stats["parts_bytes"]:  # an add part vs the trained index it no longer copies (IVF: codes only)
                report(f"{name}_add_part_mb", ray_stats["parts_bytes"] / ray_stats["add_tasks"] / 2**20, "MiB", digits=3)
                report(f"{name}_trained_index_mb", ray_stats["trained_bytes"] / 2**20, "MiB", digits=3)
            report(f"{name}_single_process_peak_rss_mb", single["peak_rss_mb"], "MiB")
            report_ratio(f"{name}_ray_task_peak_rss_vs_vector_bytes", ray_stats["peak_rss_mb"], vector_bytes)
            per_task_rates.append((name, ray_stats["add_vectors_per_task_s"]))
            report(f"{name}_add_vectors_per_task_s", ray_stats["add_vectors_per_task_s"])
            size = index_bytes(out)
            bytes_per_vector[name] = size / n
            report(f"{name}_index_mb", size / 2**20, "MiB")
            k_factors = (1, 8) if "RFlat" in factory else (None,)
            for kf in k_factors:
                suffix = f"_kfactor{kf}" if kf else ""
                recall, ms = search(str(out), queries, truth, k_factor=kf)
                report(f"{name}{suffix}_recall_at_10", recall, digits=3)
                report(f"{name}{suffix}_ms_per_query", ms, "ms", digits=3)
            if name in ("flat", "ivf_flat"):
                drop = np.flatnonzero(np.random.default_rng(1).random(n) < 0.3)
                pruned = work / f"{name}-pruned"
                prune_index(str(out), str(pruned), drop)
                _, full_ms = search(str(out), queries, truth)
                _, pruned_ms = search(str(pruned), queries, truth)
                report(f"{name}_full_ms_per_query", full_ms, "ms", digits=3)
                report(f"{name}_pruned30_ms_per_query", pruned_ms, "ms", digits=3)
                report_ratio(f"{name}_pruned30_vs_full_latency", pruned_ms, full_ms)
                report_ratio(f"{name}_pruned30_vs_full_size", index_bytes(pruned), size)

    # 138M, from the measured rates: add tasks are independent, so a node with C cores runs C of them
    print(f"# extrapolated to {TARGET:,} vectors of dim {dim}", flush=True)
    for name, rate in per_task_rates:
        core_hours = TARGET / rate / 3600
        report(f"{name}_138M_add_core_hours", core_hours, "core-h")
        report(f"{name}_138M_add_hours_on_2_cores", core_hours / 2, "h")
        report(f"{name}_138M_index_gb", bytes_per_vector[name] * TARGET / 2**30, "GiB", digits=1)
    report("138M_vector_gb_float32", TARGET * dim * 4 / 2**30, "GiB")
    import shutil

    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    run_module_main(main)
