"""Run every benchmark in sequence, each in a fresh process: `python -m benchmarks [--quick]`.

A fresh process per benchmark keeps one benchmark's threads, loaded models and Ray cluster out of the next
one's numbers. The exit status is non-zero if any benchmark failed.
"""

from __future__ import annotations

import subprocess
import sys

BENCHMARKS = ("segmentation", "embed", "generate")


def main(argv: list[str]) -> int:
    failed = []
    for name in BENCHMARKS:
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
