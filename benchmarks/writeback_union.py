"""Write-back that never hurts: base vs base + write-back under each `retrieval.union`, on held-out questions.

The base index holds the 100 demo passages; a write-back version is trained on the 30 demo training questions
(`demo_train.jsonl`, naive RAG, K = 5, the bundled SmolLM2). The test set, `demo_heldout.jsonl`, is 120
questions the write-back never saw: 60 about passages a training question also asked about (other facts of
them, where units distilled from those passages compete for slots) and 60 about passages no training question
asked about. Every setting is evaluated by naive RAG in one command, so a question whose top K a setting leaves
as the base's gets the base's answer (the command's answer memo); won / lost are counted over the questions whose
top K changed (`wbrag_ray.evaluation.effect`). Figures per setting: acc, questions with a unit in their top K,
won, lost, and acc on each half.

    python -m benchmarks.writeback_union [--quick] [--run DIR]

--quick evaluates the first 24 questions of each half. The run folder (default: a folder under the system's
temporary directory) is kept: a rerun skips the base index and the write-back training.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Sequence
from pathlib import Path

from benchmarks.common import DATA, Stopwatch, header, report, report_pressure, run_module_main

CONFIG = Path(__file__).resolve().parent.parent / "jobs" / "configs" / "writeback_demo.yaml"
HELDOUT = DATA / "demo_heldout.jsonl"
TRAIN = DATA / "demo_train.jsonl"
# (label, retrieval settings): the paper's merge, the provenance rule, rank fusion, a quota of one unit, and the
# gate at the query's best passage
SETTINGS = (
    ("score", {"union": "score"}),
    ("provenance", {"union": "provenance"}),
    ("rrf", {"union": "rrf"}),
    ("provenance, max_units 1", {"union": "provenance", "max_units": 1}),
    ("gate", {"union": "gate"}),
)


def heldout(quick: bool, folder: Path) -> tuple[str, dict[str, bool]]:
    """(the test file, {question id: about a passage a training question asked about})."""
    rows = [json.loads(line) for line in HELDOUT.read_text().splitlines() if line.strip()]
    if quick:
        halves = [[r for r in rows if r["metadata"]["train_passage"] is half] for half in (True, False)]
        rows = halves[0][:24] + halves[1][:24]
    path = folder / ("heldout-quick.jsonl" if quick else "heldout.jsonl")
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path), {r["id"]: r["metadata"]["train_passage"] for r in rows}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="48 of the 120 questions (a smoke run)")
    parser.add_argument("--run", default=str(Path(tempfile.gettempdir()) / "wbrag-bench-writeback-union"))
    args = parser.parse_args(argv)
    header("writeback_union", args)

    import pandas as pd

    from wbrag_ray import api
    from wbrag_ray.config import load_config
    from wbrag_ray.evaluation.effect import writeback_effect
    from wbrag_ray.evaluation.evaluate import evaluate_stage
    from wbrag_ray.generation.passes import GeneratorPasses
    from wbrag_ray.run import RunFolder

    Path(args.run).mkdir(parents=True, exist_ok=True)
    dataset, train_passage = heldout(args.quick, Path(args.run))
    config = load_config(CONFIG, [f"ingest.corpus={DATA / 'demo_corpus.jsonl'}", f"writeback.train={TRAIN}",
                                  "eval.methods=[naive]"])
    with Stopwatch() as sw:
        api.build_kb(args.run, config)
        stats = api.train_writeback(args.run, config, version="demo_train")
    report("base index + write-back training (a rerun skips both)", sw.seconds, "s")
    report("units written", stats.get("units_written"))
    run = RunFolder(args.run)
    name = "heldout-quick" if args.quick else "heldout"

    def predictions(label: str) -> pd.DataFrame:
        return run.layout.eval_result(label, "naive").predictions.read_table().to_pandas()

    rows = []
    with GeneratorPasses(config.generator) as passes, Stopwatch() as sw:
        evaluate_stage(run, config, dataset, name, f"{name}-base", passes=passes)
        base = predictions(f"{name}-base")
        rows.append(("base", base, None))
        for label, retrieval in SETTINGS:
            cfg = config.model_copy(update={"retrieval": config.retrieval.model_copy(update=retrieval)})
            folder = f"{name}-wb-" + label.replace(", ", "-").replace(" ", "")
            evaluate_stage(run, cfg, dataset, name, folder, passes=passes, writeback_version="demo_train",
                           setting=f"base+writeback ({label})")
            union = predictions(folder)
            rows.append((label, union, writeback_effect(base, union)))
    report("evaluation of every setting", sw.seconds, "s")
    report_pressure("after")

    half = base["id"].map(train_passage)
    print(f"# {len(base)} held-out questions ({int(half.sum())} about passages a training question asked about)")
    print(f"{'setting':<26}{'acc':>7}{'unit in top K':>15}{'won':>6}{'lost':>6}{'acc, trained passages':>23}"
          f"{'acc, others':>13}")
    for label, frame, effect in rows:
        acc = frame.set_index("id")["acc"]
        on_trained = acc[base.set_index("id").index[half.to_numpy()]].mean()
        others = acc[base.set_index("id").index[~half.to_numpy()]].mean()
        unit, won, lost = ("-", "-", "-") if effect is None else (effect["unit_in_top_k"], effect["won"], effect["lost"])
        print(f"{label:<26}{acc.mean():>7.3f}{unit!s:>15}{won!s:>6}{lost!s:>6}{on_trained:>23.3f}{others:>13.3f}")
    for label, _, effect in rows[1:]:
        print(f"{label}: won {effect['won_ids']}, lost {effect['lost_ids']}")
    score_frame, score_effect = next((frame, effect) for label, frame, effect in rows if label == "score")
    print_unit_gaps(score_frame, score_effect)
    return 0


def print_unit_gaps(frame, effect) -> None:
    """Under the paper's merge, each question with a unit in its top K: its best unit's score less its best
    passage's (what the gate compares with gate_margin), and whether the question was won or lost."""
    from wbrag_ray.retrieval.hits import hits_from_json
    from wbrag_ray.retrieval.union import BASE

    gaps = []
    for qid, docs in zip(frame["id"], frame["docs"], strict=True):
        hits = hits_from_json(docs)
        units = [h.score for h in hits if h.source != BASE]
        if units:
            best = max((h.score for h in hits if h.source == BASE), default=float("nan"))
            outcome = "won" if qid in effect["won_ids"] else "lost" if qid in effect["lost_ids"] else "same"
            gaps.append((max(units) - best, qid, outcome))
    print("# score: best unit's score - best passage's, per question with a unit in its top K")
    print("  " + ", ".join(f"{gap:+.3f} {qid} ({outcome})" for gap, qid, outcome in sorted(gaps, reverse=True)))


if __name__ == "__main__":
    run_module_main(main)
