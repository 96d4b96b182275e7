"""Zero-RAG's cost: what scoring a sample and predicting every sentence take, measured here and extrapolated
to the 138M sentences of Wikipedia.

- mastery: the target model's closed-book answers to cloze pairs of demo sentences (calls/s, direct);
- embedding pruner: predicting from stored fp16 vectors vs only reading them (the bound), direct and as the
  Ray Data pipeline `wbrag prune` runs (read -> EmbeddingPredictStage), on synthetic shards;
- LM pruner: sentences/s of the LoRA regressor (direct);
- the corpus-wide percentile and keep mask over the predictions.

    python -m benchmarks.zero_rag [--quick]
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from benchmarks.common import (
    Stopwatch,
    demo_passages,
    demo_sentences,
    header,
    local_ray,
    parse_args,
    repeat_to,
    report,
    report_pressure,
    report_ratio,
    run_module_main,
    set_torch_threads,
    set_up,
)

WIKI_SENTENCES = 138e6
DIM = 384


def write_vectors(folder: Path, n: int, files: int) -> None:
    rng = np.random.default_rng(0)
    folder.mkdir()
    per = n // files
    for i in range(files):
        v = rng.standard_normal((per, DIM)).astype(np.float16)
        flat = pa.array(v.reshape(-1))
        pq.write_table(pa.table({"sid": pa.array(np.arange(i * per, (i + 1) * per, dtype=np.int64)),
                                 "vector": pa.FixedSizeListArray.from_arrays(flat, DIM)}), folder / f"emb-{i:03d}.parquet")


def hours(n: float, rate: float) -> float:
    return n / rate / 3600 if rate else float("nan")


def bench_mastery(n_pairs: int) -> float:
    from wbrag_ray import prompts
    from wbrag_ray.config import GeneratorConfig
    from wbrag_ray.generation.backends import make_generator
    from wbrag_ray.zerorag.qa import OK, cloze_pairs

    passages = demo_passages()
    pairs = [r for p in passages for r in cloze_pairs(p.title, p.text.split(". ")[0], 2) if r["status"] == OK]
    pairs = repeat_to(pairs, n_pairs)
    gen, load = set_up(make_generator(GeneratorConfig(batch_size=32, max_new_tokens=8)))
    report("generator load", load, "s")
    with Stopwatch() as sw:
        gen.generate([prompts.closed_book_messages(r["question"], True) for r in pairs])
    rate = report("mastery closed-book answers (SmolLM2, 8 new tokens, direct)", len(pairs) / sw.seconds, "calls/s")
    return rate


def bench_embedding_pruner(folder: Path, n: int) -> float:
    import ray
    import ray.data

    from wbrag_ray.index.files import vectors_of
    from wbrag_ray.models.pruner import EmbeddingHead
    from wbrag_ray.stages.base import apply_stage
    from wbrag_ray.stages.pruner import EmbeddingPredictStage

    rng = np.random.default_rng(1)
    head, _ = EmbeddingHead.train(rng.standard_normal((512, DIM)).astype(np.float32), rng.random(512), epochs=5)
    files = sorted(folder.glob("*.parquet"))
    with Stopwatch() as sw:
        rows = sum(vectors_of(pq.read_table(f)).shape[0] for f in files)
    read_rate = report("read stored vectors only (one process)", rows / sw.seconds, "rows/s")
    with Stopwatch() as sw:
        for f in files:
            head.predict(vectors_of(pq.read_table(f)))
    direct = report("embedding pruner, read + predict (one process)", n / sw.seconds, "rows/s")
    report_ratio("embedding pruner direct / read-only (1.0 = bounded by Parquet reads)", direct, read_rate)
    with local_ray(2):
        stage = EmbeddingPredictStage(head.weights)  # as `wbrag prune` runs it: tasks fused with the read
        runs = []
        for _ in range(2):  # the first run also starts the worker processes; the second finds them warm
            ds = ray.data.read_parquet(str(folder), columns=["sid", "vector"],
                                       ray_remote_args={"num_cpus": stage.resources.num_cpus})
            ds = apply_stage(ds, stage)
            with Stopwatch() as sw:
                got = sum(t.num_rows for t in ray.get(ds.to_arrow_refs()))
            assert got == n
            runs.append(sw.seconds)
    report("embedding pruner in its Ray Data pipeline, first run (worker start included)", n / runs[0], "rows/s")
    in_ray = report("embedding pruner in its Ray Data pipeline, second run (2 CPUs)", n / runs[1], "rows/s")
    report_ratio("embedding pruner Ray (second run) / direct (target >= 0.9)", in_ray, direct)
    return in_ray


def bench_lm_pruner(n: int) -> float:
    from wbrag_ray.config import LMPrunerConfig
    from wbrag_ray.training.lm_pruner import LMPrunerPredictor, train_lm_pruner

    sentences = repeat_to(demo_sentences(), n)
    with tempfile.TemporaryDirectory() as tmp:
        train_lm_pruner(sentences[:8], [0.0, 1.0] * 4, LMPrunerConfig(max_steps=1, batch_size=8), tmp)
        predictor, load = set_up(LMPrunerPredictor(tmp, batch_size=64))
        report("LM pruner load", load, "s")
        with Stopwatch() as sw:
            predictor.predict(sentences)
    return report("LM pruner predict (SmolLM2-135M + LoRA, direct)", n / sw.seconds, "sentences/s")


def bench_percentile(folder: Path, n: int) -> float:
    from wbrag_ray.storage import resolve
    from wbrag_ray.zerorag.prune import keep_mask, percentile_cut

    rng = np.random.default_rng(2)
    pred = folder.parent / "pred"
    pred.mkdir()
    for i, f in enumerate(sorted(folder.glob("*.parquet"))):
        sid = pq.read_table(f, columns=["sid"])["sid"]
        pq.write_table(pa.table({"sid": sid, "mastery_pred": pa.array(rng.beta(2, 5, len(sid)).astype(np.float32))}),
                       pred / f"pred-{i:03d}.parquet")
    with local_ray(2), Stopwatch() as sw:
        cut = percentile_cut(resolve(str(pred)), 0.3, 4096)
        dropped = 0
        for f in sorted(pred.glob("*.parquet")):
            t = pq.read_table(f)
            dropped += int((~keep_mask(t["sid"].to_numpy(), t["mastery_pred"].to_numpy(), cut, 4096)).sum())
    report("percentile (two histogram passes) + keep mask", n / sw.seconds, "rows/s")
    report("achieved pruning ratio (asked 0.3)", dropped / n, "", digits=5)
    return n / sw.seconds


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args("Zero-RAG cost: mastery scoring, pruner prediction, percentile", argv)
    header("zero_rag", args)
    set_torch_threads(2)
    n_vectors = 50_000 if args.quick else 500_000
    calls_per_s = bench_mastery(64 if args.quick else 256)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "emb"
        write_vectors(folder, n_vectors, 10)
        in_ray = bench_embedding_pruner(folder, n_vectors)
        pct_rate = bench_percentile(folder, n_vectors)
    lm_rate = bench_lm_pruner(64 if args.quick else 256)
    report_pressure("after")
    print("# cost model for 138M sentences on this machine (2 cores), from the rates above", flush=True)
    for qa in (2, 3):
        report(f"scoring a 10K-sentence sample, {qa} QA pairs each (hours)", hours(10_000 * qa, calls_per_s), "h", 2)
    report("embedding pruner over 138M sentences, Ray pipeline (hours)", hours(WIKI_SENTENCES, in_ray), "h", 2)
    report("embedding pruner over 138M sentences, per core (hours)", hours(WIKI_SENTENCES, in_ray / 2), "core-h", 2)
    report("LM pruner over 138M sentences (hours)", hours(WIKI_SENTENCES, lm_rate), "h", 1)
    report("percentile + keep mask over 138M sentences (hours)", hours(WIKI_SENTENCES, pct_rate), "h", 2)
    return 0


if __name__ == "__main__":
    run_module_main(main)
