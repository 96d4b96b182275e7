"""The one-pass RAG methods: how a method turns a question and its retrieved documents into generator prompts,
and the generations back into one answer.

- `no-retrieval`: one closed-book prompt.
- `naive`: one prompt holding the top-K documents (FlashRAG's prompt).
- `replug`: one prompt per document alone, combined by RePlug's ensemble weights, softmax(score / T) over
  the retrieval scores. RePlug mixes next-token distributions; with greedy, short answers we mix at the
  answer level instead: a vote over normalized answers, each weighted by its document's weight.

Rows fan out to one row per (example, method, slot) so every prompt of every method goes through the
generator as one Ray Data pass, then `combine` folds them back to one row per (example, method).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

import pandas as pd

ONE_PASS = ("no-retrieval", "naive", "replug")


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
    from wbrag_ray.metrics import normalize_answer

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


def expand(batch: pd.DataFrame, methods: Sequence[str], temperature: float = 0.1) -> pd.DataFrame:
    """One row per (example, method, slot), with `prompt` (JSON chat messages) and the slot's `weight`.

    `batch` has `question` and, for methods that retrieve, `docs` (JSON hits in rank order).
    """
    from wbrag_ray import prompts
    from wbrag_ray.index.retriever import hits_from_json

    parts = []
    for method in methods:
        if method not in ONE_PASS:
            raise ValueError(f"{method!r} is not a one-pass RAG method ({', '.join(ONE_PASS)})")
        if method == "no-retrieval":
            part = batch.copy()
            part["docs"] = "[]"
            part["slot"], part["weight"] = 0, 1.0
            part["prompt"] = [prompts.dumps(prompts.no_retrieval_messages(q)) for q in batch["question"]]
        elif method == "naive":
            part = batch.copy()
            part["slot"], part["weight"] = 0, 1.0
            part["prompt"] = [
                prompts.dumps(prompts.rag_messages(q, hits_from_json(d)))
                for q, d in zip(batch["question"], batch["docs"], strict=True)
            ]
        else:  # replug: each document alone
            index, slots, weights, prompt_list = [], [], [], []
            for i, (q, d) in enumerate(zip(batch["question"], batch["docs"], strict=True)):
                hits = hits_from_json(d)
                if not hits:  # nothing retrieved (the router skipped retrieval): one closed-book slot
                    index.append(i)
                    slots.append(0)
                    weights.append(1.0)
                    prompt_list.append(prompts.dumps(prompts.no_retrieval_messages(q)))
                    continue
                for j, (hit, w) in enumerate(zip(hits, replug_weights([h.score for h in hits], temperature), strict=True)):
                    index.append(i)
                    slots.append(j)
                    weights.append(w)
                    prompt_list.append(prompts.dumps(prompts.rag_messages(q, [hit])))
            part = batch.iloc[index].reset_index(drop=True)
            part["slot"], part["weight"], part["prompt"] = slots, weights, prompt_list
        part["method"] = method
        parts.append(part)
    return pd.concat(parts, ignore_index=True)


def combine(df: pd.DataFrame, answer_column: str = "prediction") -> pd.DataFrame:
    """Fold generated slots back to one row per (id, method): `answer_column` becomes the method's answer and
    `slot_answers` (JSON) keeps each slot's own answer in rank order (RePlug: the answer from each document)."""
    df = df.sort_values(["id", "method", "slot"], kind="stable").reset_index(drop=True)
    groups = df.groupby(["id", "method"], sort=False)
    answers = groups[answer_column].apply(list)
    weights = groups["weight"].apply(list)
    out = df.loc[groups.head(1).index].reset_index(drop=True)
    keys = list(zip(out["id"], out["method"], strict=True))
    out["slot_answers"] = [json.dumps(answers[k], ensure_ascii=False) for k in keys]
    out[answer_column] = [weighted_vote(answers[k], weights[k]) for k in keys]
    return out.drop(columns=["slot", "weight"])
