"""A long pass killed at about half and resumed, against the same pass uninterrupted (issue 76): the embed stage.

Two run folders are built from the same corpus (the demo's passages repeated to N, `--quick`: fewer). One embeds
uninterrupted (`wbrag embed`, a process with its own local Ray cluster). The other's `wbrag embed` is SIGKILLed,
with every process it started, once its stage checkpoint holds half the rows (`checkpoints.progress`), then run
again to completion. Printed: the rows committed at the kill, what the rerun resumed and computed (from its
stats), rows written twice, whether every vector equals the uninterrupted run's, and the killed-plus-rerun time
against the uninterrupted one (what the kill cost: rows computed but not committed, and the rerun's start).

Blocks are committed by size (`embedder.checkpoint_rows`, set to a tenth of N here so the kill has blocks to
resume); Ray Data has no time trigger (benchmarks/RESULTS.md).

    python -m benchmarks.kill_resume [--quick] [--rows N]
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

ROWS, QUICK_ROWS = 20_000, 4_000


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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_ROWS:,} passages (a smoke run)")
    parser.add_argument("--rows", type=int, default=None, help=f"passages (default {ROWS:,})")
    args = parser.parse_args(argv)
    header("kill_resume", args)
    n = args.rows or (QUICK_ROWS if args.quick else ROWS)
    block = max(100, n // 10)
    from wbrag_ray.checkpoints import progress, rows_by_file
    from wbrag_ray.run import RunFolder

    with tempfile.TemporaryDirectory(prefix="kill-resume-") as tmp:
        corpus = Path(tmp) / "corpus.jsonl"
        write_repeated_corpus(corpus, n)
        runs = {name: Path(tmp) / name for name in ("uninterrupted", "killed")}
        sets = ["--set", f"embedder.checkpoint_rows={block}"]
        for run in runs.values():
            finish(wbrag("ingest", str(run), "--corpus", str(corpus), *sets))
        report("passages", n)
        report("embedder.checkpoint_rows", block)
        uninterrupted = finish(wbrag("embed", str(runs["uninterrupted"])))
        report("uninterrupted embed", uninterrupted, "s")

        folder = RunFolder(str(runs["killed"]))
        checkpoint = folder.layout.checkpoint("embed")
        start = time.perf_counter()
        proc = wbrag("embed", str(runs["killed"]))
        while proc.poll() is None and progress(checkpoint).get("committed", 0) < n // 2:
            time.sleep(0.05)
        killed_after = time.perf_counter() - start
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        time.sleep(3)  # a write task of the killed command may still finish its block
        committed = progress(checkpoint).get("committed", 0)
        report("killed after", killed_after, "s")
        report("rows committed at the kill", committed)
        rerun = finish(wbrag("embed", str(runs["killed"])))
        stats = folder.stats("embed")
        report("rerun", rerun, "s")
        report("rows resumed by the rerun", stats["rows_resumed"])
        report("rows computed by the rerun", stats["rows_computed"])
        a, b = vectors(runs["uninterrupted"]), vectors(runs["killed"])
        written = sum(n for n in rows_by_file(folder.layout.embed).values())
        report("rows written (uninterrupted, killed + rerun)", f"{len(a)}, {written}")
        report("rows written twice", written - len(b))
        report("every vector equal to the uninterrupted run's", a.keys() == b.keys() and all(a[k] == b[k] for k in a))
        # what the kill cost: the rows computed but not committed, and the rerun's start (Ray, the model's load)
        report("time lost to the kill", killed_after + rerun - uninterrupted, "s")
        report_ratio("killed + rerun / uninterrupted time", killed_after + rerun, uninterrupted)
    return 0


if __name__ == "__main__":
    sys.exit(main())
