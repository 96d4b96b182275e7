"""What a write-back version did where it could act: won and lost over the questions whose top K it changed."""

from __future__ import annotations

from typing import Any

import pandas as pd

from wbrag_ray.retrieval.hits import hits_from_json
from wbrag_ray.retrieval.union import BASE

# A rule is chosen, or a version said to hurt, only beyond chance: a one-sided sign test at this level.
CHANCE = 0.05


def unit_in_top_k(docs: str) -> bool:
    """Whether a write-back unit took one of the question's slots."""
    return any(h.source != BASE for h in hits_from_json(docs))


def writeback_effect(base: pd.DataFrame, union: pd.DataFrame, metric: str = "acc") -> dict[str, Any]:
    """{questions, unit_in_top_k, changed, won, lost, won_ids, lost_ids} of `union` against `base`, by id."""
    both = base[["id", "docs", metric]].merge(union[["id", "docs", metric]], on="id", suffixes=("_base", "_wb"))
    changed = [[h.key for h in hits_from_json(a)] != [h.key for h in hits_from_json(b)]
               for a, b in zip(both["docs_base"], both["docs_wb"], strict=True)]
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
