"""The index's search setting measured at build time against the formula it replaced (issue 58).

At each size and shape: clustered vectors (`index_build.write_corpus`, dim 384, noise 0.6 per dimension around
unit-variance topic centres: 1,000 topics, where a vector's neighbours share its topic and about one list, or
10,000 small topics, where most of a vector's exact top 10 lie in other topics and many lists) and held-out
queries from the same topics that are not in the index, with their exact top 10 (numpy, shard by shard); the index that
`index.factory=auto` picks for a budget of 1 GB per million vectors (SQ8 codes, 4 sqrt(n) lists: IVF4096,SQ8 at
1M), built by the project's Ray build with `index.target_recall` 0.95, which measures nprobe on a sample of the
index's own vectors and prints it. Then the held-out queries (which the build never saw) are searched in this
process, one thread, 500 per batch, at the measured nprobe and at the formula's, max(min(nlist, 32),
sqrt(nlist)): recall@10 and milliseconds per query, median of 3 passes. The result is the time ratio of the two
settings and whether the measured one still reaches the target on queries it was not measured on.

    python -m benchmarks.search_setting [--quick] [--sizes 250000,1000000] [--topics 1000,10000]
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from benchmarks.common import Stopwatch, header, local_ray, report, report_ratio, run_module_main
from benchmarks.index_build import search, write_corpus

DIM = 384
TARGET = 0.95


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="sizes 50000: a smoke run, not a measurement")
    parser.add_argument("--sizes", default="250000,1000000", help="vectors per index, comma-separated")
    parser.add_argument("--topics", default="1000,10000", help="topic counts of the vectors, comma-separated")
    args = parser.parse_args(argv)
    args.sizes = [50_000] if args.quick else [int(s) for s in args.sizes.split(",")]
    args.topics = [int(t) for t in args.topics.split(",")]
    return args


def held_out_search(index_dir: str, nprobe: int, queries: np.ndarray, truth: np.ndarray) -> tuple[float, float]:
    """(recall@10, ms per query) of the held-out queries at `nprobe`, one thread; median of 3 passes."""
    import faiss

    faiss.omp_set_num_threads(1)
    return search(index_dir, queries, truth, nprobe=nprobe)


def measure_size(root: Path, n: int, topics: int) -> dict:
    from wbrag_ray.config import IndexConfig
    from wbrag_ray.index.build import build_index
    from wbrag_ray.index.files import load_manifest
    from wbrag_ray.index.sizing import choose_factory
    from wbrag_ray.storage import resolve

    emb = root / f"emb-{n}-{topics}"
    with Stopwatch() as sw:
        queries, truth = write_corpus(emb, n, DIM, clusters=topics)
    report(f"[{n:,} / {topics:,} topics] corpus and exact top 10 of the held-out queries", sw.seconds, "s")
    factory = choose_factory(n, DIM, memory_budget_gb=n / 1e6)
    out = root / f"index-{n}-{topics}"
    with Stopwatch() as sw:
        stats = build_index(resolve(str(emb)), resolve(str(out)), "synthetic", "sentence",
                            IndexConfig(factory=factory, num_shards="auto", memory_budget_gb=n / 1e6,
                                        target_recall=TARGET, gpu=False))
    report(f"[{n:,} / {topics:,} topics] build of {factory} (measuring included)", sw.seconds, "s")
    report(f"[{n:,} / {topics:,} topics] of which measuring the search setting", stats["search_measure_s"], "s")
    search = load_manifest(resolve(str(out)))["search"]
    measured, formula = search["value"], search["formula"]["value"]
    row = {"n": n, "topics": topics, "factory": factory, "shards": stats["num_shards"], "nprobe": measured, "formula": formula,
           "build_recall": search["recall"], "build_ms": search["ms_per_query"],
           "steps": len(search["measured"]), "measure_s": stats["search_measure_s"], "build_s": sw.seconds}
    for label, nprobe in (("measured", measured), ("formula", formula)):
        recall, ms = held_out_search(str(out), nprobe, queries, truth)
        row[f"{label}_recall"], row[f"{label}_ms"] = recall, ms
        report(f"[{n:,} / {topics:,} topics] held-out recall@10 at nprobe {nprobe} ({label})", recall, "", 3)
        report(f"[{n:,} / {topics:,} topics] held-out ms per query at nprobe {nprobe} ({label})", ms, "ms", 3)
    report_ratio(f"[{n:,} / {topics:,} topics] time per query, formula / measured", row["formula_ms"], row["measured_ms"])
    return row


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    header("search_setting", args)
    rows = []
    with tempfile.TemporaryDirectory(prefix="wbrag-search-setting-") as tmp, local_ray(2):
        for n in args.sizes:
            for topics in args.topics:
                rows.append(measure_size(Path(tmp), n, topics))
    print("\n| size | topics | factory (shards) | nprobe measured (steps, seconds) | recall@10 on the build's sample | held-out "
          "recall@10 / ms per query, measured | the formula's nprobe | held-out recall@10 / ms per query, formula | "
          "time, formula / measured |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['n']:,} | {r['topics']:,} | {r['factory']} ({r['shards']}) | {r['nprobe']} ({r['steps']}, {r['measure_s']:.1f} s) | "
              f"{r['build_recall']:.3f} | {r['measured_recall']:.3f} / {r['measured_ms']:.3f} | {r['formula']} | "
              f"{r['formula_recall']:.3f} / {r['formula_ms']:.3f} | {r['formula_ms'] / r['measured_ms']:.2f}x |")
    return 0


if __name__ == "__main__":
    run_module_main(main)
