"""docs/plan-example.md is what `wbrag plan` prints: regenerate it with `python -m tests.test_plan_example`, which
runs each command in a fresh process with an empty calibration cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "plan-example.md"
CLUSTER = ["--nodes", "4", "--gpus-per-node", "8", "--cpus-per-node", "96", "--memory-per-node", "1024",
           "--passages", "21000000"]
PLACES = ["jobs/configs/paper_zero_rag.yaml", *CLUSTER]
# the same config on one node of two L4s (24 GB each, `--gpu L4`): the 70B model cannot be held
REFUSED = ["jobs/configs/paper_zero_rag.yaml", "--nodes", "1", "--gpus-per-node", "2", "--gpu", "L4",
           "--cpus-per-node", "96", "--memory-per-node", "1024", "--passages", "21000000"]


def wbrag_plan(args: list[str]) -> tuple[int, str]:
    """(exit code, stdout and stderr) of `wbrag plan ARGS` run from the repository root with no calibration."""
    with tempfile.TemporaryDirectory(prefix="wbrag-plan-example-") as cache:
        env = {**os.environ, "WBRAG_RATES_CACHE": str(Path(cache) / "rates.json")}
        done = subprocess.run([sys.executable, "-m", "wbrag_ray.cli", "plan", *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=300)
    return done.returncode, done.stdout + done.stderr


def page() -> str:
    """The page's text from the commands' output now."""
    code, placed = wbrag_plan(PLACES)
    if code != 0:
        raise RuntimeError(f"`wbrag plan {' '.join(PLACES)}` exited {code}:\n{placed}")
    _, data = wbrag_plan([*PLACES, "--json"])
    facts = json.loads(data[data.index("{"):])
    code, refused = wbrag_plan(REFUSED)
    hours = facts["total_seconds"] / 3600
    return "\n".join([
        "# `wbrag plan`: a full output and a refusal",
        "",
        "What `wbrag plan` prints, for the paper's Zero-RAG config on a stated cluster of 4 nodes of 8 GPUs. How the plan",
        "is made (bundles, memory rule, rate sources, `--calibrate`): [cluster.md](cluster.md#planning-a-run-wbrag-plan).",
        "This page is generated: `python -m tests.test_plan_example` writes it from the commands below, with no",
        "calibration records, and `tests/test_plan_example.py` fails when it differs from what they print.",
        "",
        "```bash",
        f"wbrag plan {' '.join(PLACES)}",
        "```",
        "",
        f"It places, in about {hours:.1f} h and {facts['gpu_hours_total']:,.0f} GPU-hours on {facts['gpu']}s, each "
        "stage's time an estimate or a benchmark rate (the QA files on s3:// are not downloaded: FlashRAG's published "
        "split sizes stand in for their counts, and the plan says so). Its output:",
        "",
        "```",
        placed.rstrip("\n"),
        "```",
        "",
        "## A refusal",
        "",
        f"A cluster that cannot hold a config is refused (exit code {code}), each problem with what to change; the",
        "same config on one node of two L4 GPUs (24 GB each):",
        "",
        "```bash",
        f"wbrag plan {' '.join(REFUSED)}",
        "```",
        "",
        "```",
        _refusal(refused),
        "```",
        "",
    ])


def _refusal(output: str) -> str:
    """The REFUSED block of a plan's output and its last line (the command's error), as the page quotes them."""
    lines = output.rstrip("\n").splitlines()
    if not any(line.startswith("REFUSED") for line in lines):
        raise RuntimeError(f"`wbrag plan {' '.join(REFUSED)}` was not refused:\n{output}")
    start = next(i for i, line in enumerate(lines) if line.startswith("REFUSED"))
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].strip()), len(lines))
    return "\n".join(lines[start:end] + lines[-1:])


def test_the_plan_example_page_is_what_wbrag_plan_prints():
    now = page()
    assert PAGE.read_text() == now, ("docs/plan-example.md differs from what `wbrag plan` prints now: run "
                                     "`python -m tests.test_plan_example` and commit the page")


if __name__ == "__main__":
    PAGE.write_text(page())
    print(f"wrote {PAGE.relative_to(ROOT)}")
