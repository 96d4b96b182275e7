"""Long passes killed at about half and resumed, against the same passes uninterrupted (issue 76): embedding and
the LM pruner's prediction.

embed: two run folders are built from the same corpus (the demo's passages repeated to N, `--quick`: fewer). One
embeds uninterrupted (`wbrag embed`, a process with its own local Ray cluster). The other's `wbrag embed` is
SIGKILLed, with every process it started, once its stage checkpoint holds half the rows (`checkpoints.progress`),
then run again to completion. predict: a sentence-level run (ingest in small shards, embed, index, mastery on a
sample, the LM pruner trained a few steps) copied twice; `wbrag prune --pruner lm` runs in each, one killed at half
of its prediction the same way. Printed: the rows committed at the kill, what the rerun resumed and computed (from its
stats), rows written twice, whether every vector equals the uninterrupted run's, and the killed-plus-rerun time
against the uninterrupted one (what the kill cost: rows computed but not committed, and the rerun's start).

Blocks are committed by size (`embedder.checkpoint_rows`, `zerorag.checkpoint_rows`: a tenth of the rows here, so
the kill has blocks to resume); Ray Data has no time trigger (benchmarks/RESULTS.md). The LM pruner's scores are
compared to float rounding (the rerun batches the rest otherwise).

    python -m benchmarks.kill_resume [--quick] [--rows N] [--stage embed|predict|all]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.common import header, report, report_ratio, write_repeated_corpus

ROWS, QUICK_ROWS = 20_000, 4_000  # passages embedded
PREDICT_PASSAGES, QUICK_PREDICT_PASSAGES = 400, 100  # demo passages repeated, about 5 sentences each
ZERO_RAG = str(Path(__file__).resolve().parents[1] / "jobs" / "configs" / "zero_rag_demo.yaml")


def wbrag(*args: str) -> subprocess.Popen:
    """A `wbrag` command in a process group of its own, on a local cluster of its own."""
    return subprocess.Popen([sys.executable, "-m", "wbrag_ray.cli", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "RAY_ADDRESS": ""},
                            start_new_session=True)


def finish(proc: subprocess.Popen) -> float:
    start = time.perf_counter()
    err = proc.communicate()[1]
    if proc.returncode:
        raise RuntimeError(f"{' '.join(proc.args)} failed ({proc.returncode}):\n{err[-3000:]}")
    return time.perf_counter() - start


def vectors(run: Path) -> dict:
    """{id: vector bytes} of a run folder's embedding shards."""
    from wbrag_ray.index.files import embedding_files, read_embedding_shard
    from wbrag_ray.run import RunFolder

    out = {}
    for f in embedding_files(RunFolder(str(run)).layout.embed):
        ids, vecs = read_embedding_shard(f)
        out.update(zip(ids.tolist(), (v.tobytes() for v in vecs), strict=True))
    return out


def killed_at_half(command: list[str], folder, stage: str, total: int) -> tuple[float, int]:
    """Run `command`, SIGKILL it with all it started once `stage`'s checkpoint holds half of `total` rows: (seconds
    it ran, rows committed)."""
    from wbrag_ray.checkpoints import progress

    checkpoint = folder.layout.checkpoint(stage)
    start = time.perf_counter()
    proc = wbrag(*command)
    while proc.poll() is None and progress(checkpoint).get("committed", 0) < total // 2:
        time.sleep(0.05)
    seconds = time.perf_counter() - start
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    time.sleep(3)  # a write task of the killed command may still finish its block
    return seconds, progress(checkpoint).get("committed", 0)


def report_resume(name: str, folder, stage: str, killed_s: float, committed: int, rerun_s: float,
                  uninterrupted_s: float) -> None:
    stats = folder.stats(stage)
    report(f"{name}: killed after", killed_s, "s")
    report(f"{name}: rows committed at the kill", committed)
    report(f"{name}: rerun", rerun_s, "s")
    report(f"{name}: rows resumed by the rerun", stats["rows_resumed"])
    report(f"{name}: rows computed by the rerun", stats["rows_computed"])
    # what the kill cost: the rows computed but not committed, and the rerun's start (Ray, the model's load)
    report(f"{name}: time lost to the kill", killed_s + rerun_s - uninterrupted_s, "s")
    report_ratio(f"{name}: killed + rerun / uninterrupted time", killed_s + rerun_s, uninterrupted_s)


def embed(n: int, tmp: Path) -> None:
    from wbrag_ray.checkpoints import rows_by_file
    from wbrag_ray.run import RunFolder

    corpus = tmp / "corpus.jsonl"
    write_repeated_corpus(corpus, n)
    runs = {name: tmp / f"embed-{name}" for name in ("uninterrupted", "killed")}
    block = max(100, n // 10)
    for run in runs.values():
        finish(wbrag("ingest", str(run), "--corpus", str(corpus), "--set", f"embedder.checkpoint_rows={block}"))
    report("embed: passages", n)
    report("embed: embedder.checkpoint_rows", block)
    uninterrupted = finish(wbrag("embed", str(runs["uninterrupted"])))
    report("embed: uninterrupted", uninterrupted, "s")
    folder = RunFolder(str(runs["killed"]))
    killed_s, committed = killed_at_half(["embed", str(runs["killed"])], folder, "embed", n)
    rerun = finish(wbrag("embed", str(runs["killed"])))
    report_resume("embed", folder, "embed", killed_s, committed, rerun, uninterrupted)
    a, b = vectors(runs["uninterrupted"]), vectors(runs["killed"])
    written = sum(rows_by_file(folder.layout.embed).values())
    report("embed: rows written (uninterrupted, killed + rerun)", f"{len(a)}, {written}")
    report("embed: rows written twice", written - len(b))
    report("embed: every vector equal to the uninterrupted run's", a.keys() == b.keys() and all(a[k] == b[k] for k in a))


def predict(passages: int, tmp: Path) -> None:
    import shutil

    import numpy as np
    import pyarrow.parquet as pq

    from wbrag_ray.checkpoints import rows_by_file
    from wbrag_ray.run import RunFolder

    corpus = tmp / "sentences.jsonl"
    write_repeated_corpus(corpus, passages)
    base = tmp / "predict-base"
    sets = ["--config", ZERO_RAG, "--set", f"ingest.corpus={corpus}", "--set", "ingest.shard_bytes=8192",
            "--set", "zerorag.sample=200", "--set", "zerorag.lm_pruner.max_steps=8"]
    finish(wbrag("ingest", str(base), *sets))
    for command in ("embed", "index", "mastery"):
        finish(wbrag(command, str(base)))
    finish(wbrag("train-pruner", str(base), "--kind", "lm"))
    total = RunFolder(str(base)).stats("ingest")["sentences"]
    block = max(50, total // 10)
    runs = {name: tmp / f"predict-{name}" for name in ("uninterrupted", "killed")}
    for run in runs.values():
        shutil.copytree(base, run, ignore=shutil.ignore_patterns("_lease.json"))
    prune = ["--ratio", "0.3", "--pruner", "lm", "--set", f"zerorag.checkpoint_rows={block}"]
    report("predict: sentences", total)
    report("predict: zerorag.checkpoint_rows", block)
    uninterrupted = finish(wbrag("prune", str(runs["uninterrupted"]), *prune))
    report("predict: uninterrupted (prediction and prune)", uninterrupted, "s")
    folder = RunFolder(str(runs["killed"]))
    killed_s, committed = killed_at_half(["prune", str(runs["killed"]), *prune], folder, "predict", total)
    rerun = finish(wbrag("prune", str(runs["killed"]), *prune))
    report_resume("predict", folder, "predict", killed_s, committed, rerun, uninterrupted)

    def scores(run: Path) -> dict:
        out = RunFolder(str(run)).layout.zero_rag.predictions
        table = pq.read_table(out.path, filesystem=out.fs)
        return dict(zip(table["sid"].to_pylist(), table["mastery_pred"].to_pylist(), strict=True))

    a, b = scores(runs["uninterrupted"]), scores(runs["killed"])
    written = sum(rows_by_file(folder.layout.zero_rag.predictions).values())
    report("predict: rows written (uninterrupted, killed + rerun)", f"{len(a)}, {written}")
    report("predict: rows written twice", written - len(b))
    same = a.keys() == b.keys()
    report("predict: every sentence scored in both", same)
    if same:
        report("predict: largest score difference", float(np.max(np.abs(np.array([a[k] - b[k] for k in a])))), "", 6)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rows (a smoke run)")
    parser.add_argument("--rows", type=int, default=None, help=f"passages embedded (default {ROWS:,})")
    parser.add_argument("--stage", choices=("embed", "predict", "all"), default="all")
    args = parser.parse_args(argv)
    header("kill_resume", args)
    with tempfile.TemporaryDirectory(prefix="kill-resume-") as tmp:
        if args.stage in ("embed", "all"):
            embed(args.rows or (QUICK_ROWS if args.quick else ROWS), Path(tmp))
        if args.stage in ("predict", "all"):
            predict(QUICK_PREDICT_PASSAGES if args.quick else PREDICT_PASSAGES, Path(tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
