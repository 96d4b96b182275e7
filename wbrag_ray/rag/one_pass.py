"""The one-pass RAG methods: prompts from a question and its documents, and generations back to one answer.
Rows fan out to one per (example, method, slot) for one generator pass and `combine` folds them back; `replug`
rows (one per example, K prompts and weights) go through a mixture pass folded by `combine_mixture`."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

import pandas as pd

from wbrag_ray import prompts
from wbrag_ray.metrics import normalize_answer
from wbrag_ray.retrieval.hits import hits_from_json

ONE_PASS = ("no-retrieval", "naive", "replug", "replug-vote")
MIXTURE = ("replug",)  # decoded as one probability mixture per example (generation mode `mixture`)


def replug_weights(scores: Sequence[float], temperature: float) -> list[float]:
    """softmax(score / temperature), the weight RePlug gives each retrieved document."""
    if not scores:
        return []
    top = max(scores)
    exp = [math.exp((s - top) / temperature) for s in scores]
    total = sum(exp)
    return [e / total for e in exp]


def weighted_vote(answers: Sequence[str], weights: Sequence[float]) -> str:
    """The answer whose normalized form carries the most weight; ties go to the better-ranked document."""
    totals: dict[str, float] = {}
    first: dict[str, str] = {}
    for answer, weight in zip(answers, weights, strict=True):
        key = normalize_answer(answer)
        totals[key] = totals.get(key, 0.0) + weight
        first.setdefault(key, answer)
    if not totals:
        return ""
    best = max(totals, key=lambda k: (totals[k], -list(first).index(k)))
    return first[best]


def _replug_groups(batch: pd.DataFrame, temperature: float) -> tuple[list[list], list[list[float]]]:
    """Per example: one prompt per retrieved document in rank order (or one closed-book prompt) and its weight."""
    groups, weights = [], []
    for q, d in zip(batch["question"], batch["docs"], strict=True):
        hits = hits_from_json(d)
        if not hits:
            groups.append([prompts.no_retrieval_messages(q)])
            weights.append([1.0])
            continue
        groups.append([prompts.rag_messages(q, [hit]) for hit in hits])
        weights.append(replug_weights([h.score for h in hits], temperature))
    return groups, weights


def expand(batch: pd.DataFrame, methods: Sequence[str], temperature: float = 0.1) -> pd.DataFrame:
    """One row per (example, method, slot) with `prompt` and `weight` (`replug`: one per example, JSON lists)."""
    parts = []
    for method in methods:
        if method not in ONE_PASS:
            raise ValueError(f"{method!r} is not a one-pass RAG method ({', '.join(ONE_PASS)})")
        if method != "replug-vote":
            part = batch.copy()
            part["slot"], part["weight"] = 0, 1.0
        if method == "no-retrieval":
            part["docs"] = "[]"
            part["prompt"] = [prompts.dumps(prompts.no_retrieval_messages(q)) for q in batch["question"]]
        elif method == "naive":
            part["prompt"] = [prompts.dumps(prompts.rag_messages(q, hits_from_json(d)))
                              for q, d in zip(batch["question"], batch["docs"], strict=True)]
        elif method == "replug":  # one row per example: its K prompts, mixed as they decode
            groups, weights = _replug_groups(batch, temperature)
            part["prompt"] = [json.dumps(g, ensure_ascii=False) for g in groups]
            part["weights"] = [json.dumps(w) for w in weights]
        else:  # replug-vote: one row per document alone
            groups, weights = _replug_groups(batch, temperature)
            index = [i for i, g in enumerate(groups) for _ in g]
            part = batch.iloc[index].reset_index(drop=True)
            part["slot"] = [j for g in groups for j in range(len(g))]
            part["weight"] = [w for ws in weights for w in ws]
            part["prompt"] = [prompts.dumps(p) for g in groups for p in g]
        part["method"] = method
        parts.append(part)
    return pd.concat(parts, ignore_index=True)


def combine(df: pd.DataFrame, answer_column: str = "prediction") -> pd.DataFrame:
    """Fold slots back to one row per (id, method); `slot_answers` keeps each slot's answer in rank order."""
    df = df.sort_values(["id", "method", "slot"], kind="stable").reset_index(drop=True)
    groups = df.groupby(["id", "method"], sort=False)
    answers = groups[answer_column].apply(list)
    weights = groups["weight"].apply(list)
    out = df.loc[groups.head(1).index].reset_index(drop=True)
    keys = list(zip(out["id"], out["method"], strict=True))
    out["slot_answers"] = [json.dumps(answers[k], ensure_ascii=False) for k in keys]
    out[answer_column] = [weighted_vote(answers[k], weights[k]) for k in keys]
    return out.drop(columns=["slot", "weight"])


def combine_mixture(df: pd.DataFrame, answer_column: str = "prediction") -> pd.DataFrame:
    """A mixture pass's rows as `combine`'s: one answer, K generator calls, and a trace of weights and tokens."""
    out = df.sort_values(["id", "method"], kind="stable").reset_index(drop=True)
    weights = [json.loads(w) for w in out["weights"]]
    out["slot_answers"] = [json.dumps([a], ensure_ascii=False) for a in out[answer_column]]
    out["generator_calls"] = [len(w) for w in weights]
    out["trace"] = [
        json.dumps({"weights": [round(x, 6) for x in w], "tokens": list(t), "token_probs": [round(float(p), 6) for p in ps],
                    "finished": bool(f)}, ensure_ascii=False)
        for w, t, ps, f in zip(weights, out[f"{answer_column}_tokens"], out[f"{answer_column}_probs"],
                               out[f"{answer_column}_finished"], strict=True)
    ]
    scored = [f"{answer_column}_{c}" for c in ("tokens", "probs", "finished")]
    return out.drop(columns=["slot", "weight", "weights", *scored])
