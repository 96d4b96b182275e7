"""The calibrated plan against the measured run at several sizes (issue 58): `python -m benchmarks.plan_accuracy
[--config jobs/configs/zero_rag_demo.yaml] [--scales 1,4,10]`.

One calibration (`wbrag plan CONFIG --calibrate`, its records in a cache of this benchmark's own), then `wbrag
run` of the config (default: the write-back demo) at 1x, 4x and 10x its test questions, each in a fresh run folder,
each planned from the cache's records when it starts (`wbrag run` stores its plan): what a user does who
calibrates once and plans runs of other sizes. Printed per size: every stage's planned and measured seconds and their ratio, the stages
together and the run's wall time, with the CPU pressure before and after (a busy neighbour shows there first).

Questions: the package's 160 distinct test questions (demo_qa's 40, demo_heldout's 120) first, then cloze
questions of the demo corpus's sentences (Zero-RAG's cloze pairs: a sentence with a name, date or number
blanked, the span the answer) to make up larger sizes. Every question is distinct, so no answer comes from an
earlier pass's store.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import yaml

from benchmarks.common import DATA, cpu_shares, demo_passages, header, report, report_pressure, report_ratio

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "jobs" / "configs" / "writeback_demo.yaml"
BASE_QUESTIONS = 40  # the demo configs' test set: demo_qa, the first 40 of `questions`


def questions(n: int) -> list[dict]:
    """`n` distinct test questions: the shipped ones, then cloze questions of the corpus's sentences."""
    from wbrag_ray.stages.ingest import Segmenter
    from wbrag_ray.zerorag.qa import OK, cloze_pairs

    out, seen = [], set()
    for name in ("demo_qa.jsonl", "demo_heldout.jsonl"):
        for line in (DATA / name).read_text().splitlines():
            if line.strip() and (row := json.loads(line))["question"] not in seen:
                seen.add(row["question"])
                out.append({"id": row["id"], "question": row["question"], "golden_answers": row["golden_answers"]})
    split = Segmenter().split
    for p in demo_passages():
        for s, sentence in enumerate(split(p.text)):
            for pair in cloze_pairs(p.title, sentence, 2):
                if pair["status"] == OK and pair["question"] not in seen:
                    seen.add(pair["question"])
                    out.append({"id": f"cloze-{p.doc_id}-{s}-{pair['qa_index']}", "question": pair["question"],
                                "golden_answers": [pair["answer"]]})
    if len(out) < n:
        raise SystemExit(f"only {len(out)} distinct questions can be made from the demo data, {n} asked")
    return out[:n]


def sized_config(source: Path, folder: Path, scale: int, data: Path | None = None, limit: int | None = None) -> Path:
    """The config `source` at `scale` times its 40 test questions, with a run folder of its own; with `data`, a
    folder's corpus.jsonl, train.jsonl and test.jsonl (those there are) replace the config's corpus, write-back
    training set and test set (its test set at 1x: larger sizes add the demo's questions)."""
    config = yaml.safe_load(source.read_text())
    config["run"] = str(folder / f"run-{scale}x")
    if data is not None:
        for name, section, key in (("corpus", "ingest", "corpus"), ("train", "writeback", "train"),
                                   ("test", "eval", "dataset")):
            if (data / f"{name}.jsonl").is_file() and (section != "writeback" or config.get("writeback")):
                config[section] = {**config.get(section, {}), key: str((data / f"{name}.jsonl").resolve())}
        if config.get("zerorag", {}).get("enabled") and (data / "train.jsonl").is_file():
            config["zerorag"] = {**config["zerorag"], "train": str((data / "train.jsonl").resolve())}
    if data is None or scale > 1 or not (data / "test.jsonl").is_file():
        questions_file = folder / f"questions-{scale}x.jsonl"
        questions_file.write_text("".join(json.dumps(q) + "\n" for q in questions(BASE_QUESTIONS * scale)))
        config["eval"] = {**config.get("eval", {}), "dataset": str(questions_file), "name": f"questions_{scale}x"}
    if limit:  # the first N test questions only: a shorter run on a busy machine
        config["eval"] = {**config.get("eval", {}), "limit": limit}
    path = folder / f"config-{scale}x.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def wbrag(*args: str, env: dict[str, str]) -> None:
    cmd = [str(Path(sys.executable).parent / "wbrag"), *args]
    print(f"# {' '.join(cmd)}", flush=True)
    subprocess.run(cmd, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)  # the configs name files from the root


def compare(run_dir: str) -> list[dict]:
    """The report's planned-against-measured rows of a finished run."""
    from wbrag_ray.plan.against_run import load_plan, planned_vs_measured, run_wall_seconds
    from wbrag_ray.run import RunFolder

    run = RunFolder(run_dir)
    plan = load_plan(run)
    stats = {name: run.stats(name) or {} for name in run.completed_stages()}
    return planned_vs_measured(plan, stats, run_wall_seconds(run, plan))


def keep_rates(folder: Path, run_dir: Path) -> None:
    """The utility gate's keep rate the calibration measured (its sample and interval) beside the run's."""
    records = json.loads((folder / "rates.json").read_text()) if (folder / "rates.json").exists() else []
    for r in records:
        if r.get("role") == "writeback":
            lo, hi = r["keep_interval"]
            report("keep rate, calibrated", f"{r['keep_rate']:.3f} ({r['kept']} of {r['questions']} sampled, 95% "
                   f"Wilson {lo:.3f}-{hi:.3f})")
    for stats in sorted(run_dir.glob("writeback/*/stats.json")):
        data = json.loads(stats.read_text())
        if "selection_rate" in data:
            report("keep rate, the run's", f"{data['selection_rate']:.3f} (of {data.get('examples')} training "
                   "questions)")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1x and 2x only (a smoke run, not a measurement)")
    parser.add_argument("--config", default=str(CONFIG), help="a demo config (default: the write-back demo's)")
    parser.add_argument("--data", default=None, help="a data folder (corpus.jsonl, train.jsonl, test.jsonl; e.g. "
                        "`python -m benchmarks.long_passages OUT`'s) replacing the config's files")
    parser.add_argument("--scales", default=None, help="sizes, as multiples of the config's 40 test questions "
                        "(default 1,4,10; 1 with --data)")
    parser.add_argument("--limit", type=int, help="evaluate the first N test questions only (eval.limit)")
    parser.add_argument("--folder", default="/tmp/wbrag-bench-plan-accuracy")
    parser.add_argument("--calibrate-seconds", default="30")
    args = parser.parse_args(argv)
    scales = [1, 2] if args.quick else [int(s) for s in (args.scales or ("1" if args.data else "1,4,10")).split(",")]
    data = Path(args.data) if args.data else None
    header("plan_accuracy", args)
    folder = Path(args.folder)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    # the calibration's records in a cache of the benchmark's own: no record of another machine or version
    env = {**os.environ, "WBRAG_RATES_CACHE": str(folder / "rates.json")}
    report("config", args.config)
    report("data", args.data or "the config's own files")
    configs = {scale: sized_config(Path(args.config), folder, scale, data, args.limit) for scale in scales}
    wbrag("plan", str(configs[scales[0]]), "--calibrate", "--calibrate-seconds", args.calibrate_seconds, env=env)
    summary = []
    for scale in scales:
        report_pressure(f"before the {scale}x run")
        with cpu_shares(f"the {scale}x run"):
            wbrag("run", str(configs[scale]), env=env)
        rows = compare(str(folder / f"run-{scale}x"))
        print(f"## {BASE_QUESTIONS * scale} test questions ({scale}x)")
        print("| stage | planned s | measured s | measured / planned | rate source |\n|---|---|---|---|---|")
        for r in rows:
            if r["planned_s"] is None or r["measured_s"] is None:
                continue
            ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else ""
            print(f"| {r['stage']} | {r['planned_s']:.1f} | {r['measured_s']:.1f} | {ratio} | {r['rate_source'] or ''} |")
        wall = rows[-1]
        summary.append((scale, wall["planned_s"], wall["measured_s"]))
        keep_rates(folder, folder / f"run-{scale}x")
    for scale, planned, measured in summary:
        report(f"{scale}x planned", planned, "s")
        report(f"{scale}x measured (wall, start to last stage)", measured, "s")
        report_ratio(f"{scale}x measured / planned", measured, planned)
    worst = max(abs(m / p - 1) for _, p, m in summary)
    report("worst |measured / planned - 1|", worst, "", digits=3)
    return 0 if worst <= 0.3 else 1


if __name__ == "__main__":
    sys.exit(main())
