"""Run every benchmark in sequence, each in a fresh process: `python -m benchmarks [--quick]`.

Every module of this package is a benchmark except `common` (and `gpu/`, a standalone script for GPU machines): the known ones run in the order below, any
others after them in name order. A fresh process per benchmark keeps one benchmark's threads, loaded models
and Ray cluster out of the next one's numbers. The exit status is non-zero if any benchmark failed.
"""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

FIRST = ("segmentation", "embed", "generate")  # the pipeline's order: ingest, embed, generate
NOT_BENCHMARKS = {"common", "__main__", "gpu"}  # gpu: a package of its own, run by hand on a GPU machine


def benchmark_names() -> list[str]:
    found = {m.name for m in pkgutil.iter_modules([str(Path(__file__).parent)])} - NOT_BENCHMARKS
    return [n for n in FIRST if n in found] + sorted(found - set(FIRST))


def main(argv: list[str]) -> int:
    failed = []
    for name in benchmark_names():
        rc = subprocess.run([sys.executable, "-m", f"benchmarks.{name}", *argv]).returncode
        if rc:
            failed.append(f"{name} (exit {rc})")
        print(flush=True)
    if failed:
        print("failed: " + ", ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
