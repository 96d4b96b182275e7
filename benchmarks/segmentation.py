"""Sentence segmentation (nupunkt, one core) against a whole ingest shard (read, parse, segment, write Parquet).

The ratio says how much of ingest's time is segmentation: near 1.0 means segmentation is the cost, well
below means the reading and writing around it matter too.

    python -m benchmarks.segmentation [--quick]
"""

from __future__ import annotations

import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path

from benchmarks.common import (
    demo_passages,
    header,
    parse_args,
    repeat_to,
    report,
    report_pressure,
    report_ratio,
    run_module_main,
    timed,
    write_repeated_corpus,
)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(__doc__.splitlines()[0], argv, rounds=(5, 2))
    header("segmentation", args)
    import pyarrow as pa

    from wbrag_ray.config import IngestConfig
    from wbrag_ray.stages.ingest import Segmenter, ingest_shard, plan_shards

    n = 5_000 if args.quick else 20_000
    # An ingest shard runs as a Ray task that asks for one CPU: hold Arrow's compute threads to one as well.
    pa.set_cpu_count(1)
    config = IngestConfig()
    texts = [p.text for p in repeat_to(demo_passages(), n)]
    report("passages", n)
    report("rounds (median reported)", args.rounds)

    segmenter = Segmenter(config.min_sentence_chars)
    segmenter.split(texts[0])  # loads the Punkt model outside the timing

    def segment_all() -> int:
        return sum(len(segmenter.split(t)) for t in texts)

    with tempfile.TemporaryDirectory(prefix="wbrag-bench-seg-") as tmp:
        corpus = Path(tmp) / "corpus.jsonl"
        size = write_repeated_corpus(corpus, n)
        shards = plan_shards(str(corpus), config)

        def ingest_all(out: str) -> list[dict]:
            return [ingest_shard(spec, out, config) for spec in shards]

        # Rounds alternate the two, so a noisy neighbour slows both alike; medians of the rounds.
        seg_times, ingest_times = [], []
        for r in range(args.rounds):
            sentences, seconds = timed(segment_all)
            seg_times.append(seconds)
            # A fresh output folder per round: every round writes from scratch.
            stats, seconds = timed(ingest_all, str(Path(tmp) / f"out-{r}"))
            ingest_times.append(seconds)
    seg_seconds, ingest_seconds = statistics.median(seg_times), statistics.median(ingest_times)

    report("sentences", sentences)
    report("segmentation time", seg_seconds, "s", 3)
    report("segmentation throughput", sentences / seg_seconds, "sentences/s", 0)
    seg_passages_per_s = report("segmentation throughput (passages)", n / seg_seconds, "passages/s", 0)
    report("corpus size", size / 1e6, "MB", 2)
    report("ingest shards", len(shards))
    rows_in = sum(s["rows_in"] for s in stats)
    rows_out = sum(s["rows_out"] for s in stats)
    ingest_sentences = sum(s["sentences"] for s in stats)
    report("ingest records in / out", f"{rows_in} / {rows_out}")
    report("ingest sentences match segmentation", ingest_sentences == sentences)
    report("ingest time", ingest_seconds, "s", 3)
    ingest_per_s = report("ingest throughput", rows_in / ingest_seconds, "records/s", 0)
    report("ingest throughput (sentences)", ingest_sentences / ingest_seconds, "sentences/s", 0)
    report_ratio("ratio ingest records/s / segmentation passages/s", ingest_per_s, seg_passages_per_s)
    report_pressure("at the end")
    return 0


if __name__ == "__main__":
    run_module_main(main)
