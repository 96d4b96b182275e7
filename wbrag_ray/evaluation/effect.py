"""What a write-back version did, measured only where it could act: the questions whose top K it changed.

A question whose top K is the base's gets the base's prompt, and within one command the same prompt gets the same
answer (`generation.passes.AnswerMemo`), so it cannot be won or lost. Over the questions whose top K changed (a
write-back unit took a slot), a question is won when the metric rose over the base and lost when it fell.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from wbrag_ray.retrieval.hits import hits_from_json
from wbrag_ray.retrieval.union import BASE

# A union rule other than the paper's merge is chosen for a version, and a version is said to hurt, only where its
# held-out questions tell it from chance: a one-sided sign test (`metrics.sign_test`) at this level over the
# questions the two answered differently. A union rule acts on a handful of questions (the demo's held-out halves:
# 3-10 answers changed in 60), so one question lost or won is what a coin gives; choosing on it made `auto` a rule
# that acts on nothing whenever the paper's merge happened to lose one validation question (benchmarks/RESULTS.md,
# issue 69).
CHANCE = 0.05


def top_k_keys(docs: str) -> list[tuple[str, int]]:
    return [h.key for h in hits_from_json(docs)]


def unit_in_top_k(docs: str) -> bool:
    """Whether a write-back unit took one of the question's slots."""
    return any(h.source != BASE for h in hits_from_json(docs))


def writeback_effect(base: pd.DataFrame, union: pd.DataFrame, metric: str = "acc") -> dict[str, Any]:
    """{questions, unit_in_top_k, changed, won, lost, won_ids, lost_ids} of one evaluation beside the write-back
    index (`union`) against the base's (`base`), both with columns id, docs and `metric`, matched by id."""
    both = base[["id", "docs", metric]].merge(union[["id", "docs", metric]], on="id", suffixes=("_base", "_wb"))
    changed = [top_k_keys(a) != top_k_keys(b) for a, b in zip(both["docs_base"], both["docs_wb"], strict=True)]
    moved = both[changed]
    won = moved[moved[f"{metric}_wb"] > moved[f"{metric}_base"]]["id"].tolist()
    lost = moved[moved[f"{metric}_wb"] < moved[f"{metric}_base"]]["id"].tolist()
    return {
        "questions": len(both),
        "unit_in_top_k": int(sum(unit_in_top_k(d) for d in both["docs_wb"])),
        "changed": len(moved),
        "won": len(won),
        "lost": len(lost),
        "won_ids": sorted(map(str, won)),
        "lost_ids": sorted(map(str, lost)),
    }
