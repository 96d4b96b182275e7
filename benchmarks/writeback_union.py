"""Write-back that never hurts: base vs base + write-back under each `retrieval.union`, the default chosen on a
validation half of the held-out questions and reported on the other half.

The base index holds the 100 demo passages; a write-back version is trained on the 30 demo training questions
(`demo_train.jsonl`, naive RAG, K = 5, the bundled SmolLM2). The held-out set, `demo_heldout.jsonl`, is 120
questions the write-back never saw: 60 about passages a training question also asked about (other facts of
them, where units distilled from those passages compete for slots) and 60 about passages no training question
asked about. They are split in two halves of 60 (`split_halves`: within each group of 60, the 30 ids whose hash
comes first are the validation half, so both halves hold 30 of each group, whatever the file's order). Every
setting is evaluated on all 120 by naive RAG in one command, so a question whose top K a setting leaves as the
base's gets the base's answer (the command's answer memo); won / lost are counted over the questions whose top K
changed (`wbrag_ray.evaluation.effect`). Figures per setting and half: acc, questions with a unit in their top K,
won, lost, and acc on each group.

The setting is chosen on the validation half alone (`choose`: highest acc; ties broken by fewest lost, then by
fewest questions with a unit in their top K, then by the order of SETTINGS), and its figures on the test half,
which played no part in the choice, are what the default's claim rests on. `retrieval.union`'s default is the
setting this chooses.

    python -m benchmarks.writeback_union [--quick] [--run DIR]

--quick evaluates the first 24 questions of each group. The run folder (default: a folder under the system's
temporary directory) is kept: a rerun skips the base index, the write-back training and every evaluation already
made (its figures, every setting on both halves, are also written to RUN/writeback_union.json).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import DATA, Stopwatch, header, report, report_pressure, run_module_main

CONFIG = Path(__file__).resolve().parent.parent / "jobs" / "configs" / "writeback_demo.yaml"
HELDOUT = DATA / "demo_heldout.jsonl"
TRAIN = DATA / "demo_train.jsonl"
# (label, retrieval settings): the paper's merge, the provenance rule, rank fusion, a quota of one unit, and the
# gate at the query's best passage with and without the provenance rule
SETTINGS = (
    ("score", {"union": "score"}),
    ("provenance", {"union": "provenance"}),
    ("rrf", {"union": "rrf"}),
    ("provenance, max_units 1", {"union": "provenance", "max_units": 1}),
    ("gate", {"union": "gate"}),
    ("gate-no-provenance", {"union": "gate-no-provenance"}),
)
HALVES = ("validation", "test")


def heldout(quick: bool, folder: Path) -> tuple[str, dict[str, bool]]:
    """(the test file, {question id: about a passage a training question asked about})."""
    rows = [json.loads(line) for line in HELDOUT.read_text().splitlines() if line.strip()]
    if quick:
        groups = [[r for r in rows if r["metadata"]["train_passage"] is group] for group in (True, False)]
        rows = groups[0][:24] + groups[1][:24]
    path = folder / ("heldout-quick.jsonl" if quick else "heldout.jsonl")
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path), {r["id"]: r["metadata"]["train_passage"] for r in rows}


def split_halves(train_passage: dict[str, bool]) -> dict[str, str]:
    """{question id: 'validation' or 'test'}: within each group (about a trained passage or not), the first half of
    its ids by hash is the validation half (an odd group gives the test half the extra question)."""
    def by_hash(i: str) -> bytes:
        return hashlib.blake2b(i.encode(), digest_size=8).digest()

    half: dict[str, str] = {}
    for group in (True, False):
        ids = sorted((i for i, g in train_passage.items() if g is group), key=by_hash)
        half.update({i: HALVES[0] if n < len(ids) // 2 else HALVES[1] for n, i in enumerate(ids)})
    return half


def figures(base, frame, train_passage: dict[str, bool], ids: set[str]) -> dict[str, Any]:
    """One setting's figures over the questions `ids` (`frame` is the base's own: no won / lost)."""
    from wbrag_ray.evaluation.effect import writeback_effect

    sub = frame[frame["id"].isin(ids)]
    acc = sub.set_index("id")["acc"]
    group = acc.index.map(train_passage).to_numpy(bool)
    out = {"questions": len(sub), "acc": round(float(acc.mean()), 4),
           "acc_trained_passages": round(float(acc[group].mean()), 4),
           "acc_others": round(float(acc[~group].mean()), 4)}
    if frame is not base:
        effect = writeback_effect(base[base["id"].isin(ids)], sub)
        out.update({k: effect[k] for k in ("unit_in_top_k", "won", "lost", "won_ids", "lost_ids")})
    return out


def choose(validation: dict[str, dict[str, Any]]) -> str:
    """The setting with the highest acc on the validation half; ties: fewest lost, then fewest questions with a unit
    in their top K (the one that changes less of what the reader sees), then the order of SETTINGS."""
    order = [label for label, _ in SETTINGS]
    return min(validation, key=lambda s: (-validation[s]["acc"], validation[s]["lost"], validation[s]["unit_in_top_k"],
                                          order.index(s)))


def print_table(half: str, figs: dict[str, dict[str, Any]], chosen: str) -> None:
    n = figs["base"]["questions"]
    print(f"# {half + ' half' if half in HALVES else 'both halves'}: {n} questions")
    print(f"{'setting':<26}{'acc':>7}{'unit in top K':>15}{'won':>6}{'lost':>6}{'acc, trained passages':>23}"
          f"{'acc, others':>13}")
    for label, f in figs.items():
        unit, won, lost = (f.get(k, "-") for k in ("unit_in_top_k", "won", "lost"))
        mark = " <- chosen" if label == chosen else ""
        print(f"{label:<26}{f['acc']:>7.3f}{unit!s:>15}{won!s:>6}{lost!s:>6}{f['acc_trained_passages']:>23.3f}"
              f"{f['acc_others']:>13.3f}{mark}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="48 of the 120 questions (a smoke run)")
    parser.add_argument("--run", default=str(Path(tempfile.gettempdir()) / "wbrag-bench-writeback-union"))
    args = parser.parse_args(argv)
    header("writeback_union", args)

    import pandas as pd

    from wbrag_ray import api
    from wbrag_ray.config import load_config
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

    frames = {}
    with GeneratorPasses(config.generator) as passes, Stopwatch() as sw:
        evaluate_stage(run, config, dataset, name, f"{name}-base", passes=passes)
        frames["base"] = predictions(f"{name}-base")
        for label, retrieval in SETTINGS:
            cfg = config.model_copy(update={"retrieval": config.retrieval.model_copy(update=retrieval)})
            folder = f"{name}-wb-" + label.replace(", ", "-").replace(" ", "")
            evaluate_stage(run, cfg, dataset, name, folder, passes=passes, writeback_version="demo_train",
                           setting=f"base+writeback ({label})")
            frames[label] = predictions(folder)
    report("evaluation of every setting", sw.seconds, "s")
    report_pressure("after")

    base = frames["base"]
    half = split_halves(train_passage)
    figs = {h: {label: figures(base, frame, train_passage, {i for i, x in half.items() if x == h})
                for label, frame in frames.items()} for h in HALVES}
    figs["all"] = {label: figures(base, frame, train_passage, set(half)) for label, frame in frames.items()}
    chosen = choose({label: f for label, f in figs["validation"].items() if label != "base"})
    for h in (*HALVES, "all"):
        print_table(h, figs[h], chosen)
    for h in HALVES:
        for label, f in figs[h].items():
            if label != "base":
                print(f"{h} {label}: won {f['won_ids']}, lost {f['lost_ids']}")
    test, test_base = figs["test"][chosen], figs["test"]["base"]
    print(f"# chosen on the validation half: {chosen}; on the test half: acc {test['acc']:.3f} against the base's "
          f"{test_base['acc']:.3f}, a unit in the top K of {test['unit_in_top_k']}, won {test['won']}, lost "
          f"{test['lost']}")
    (Path(args.run) / "writeback_union.json").write_text(json.dumps(
        {"chosen": chosen, "halves": {i: half[i] for i in sorted(half)}, "figures": figs}, indent=1))
    print_unit_gaps(frames["score"], figs["all"]["score"])
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
