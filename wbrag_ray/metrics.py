"""Answer metrics compatible with FlashRAG: normalization, em, f1, acc; each the max over the gold answers."""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from collections.abc import Iterable

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)
_SPECIAL = {"yes", "no", "noanswer"}


def normalize_answer(s: str) -> str:
    """Lowercase, drop punctuation, drop articles a/an/the, collapse whitespace (SQuAD / FlashRAG)."""
    s = s.lower().translate(_PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def exact_match(prediction: str, golds: Iterable[str]) -> float:
    p = normalize_answer(prediction)
    return float(any(normalize_answer(g) == p for g in golds))


def substring_match(prediction: str, golds: Iterable[str]) -> float:
    """FlashRAG's `acc`: a normalized gold answer occurs inside the normalized prediction."""
    p = normalize_answer(prediction)
    return float(any(normalize_answer(g) in p for g in golds))


def _f1(prediction: str, gold: str) -> float:
    p, g = normalize_answer(prediction), normalize_answer(gold)
    # yes / no / noanswer must match exactly: token overlap would give partial credit to the wrong polarity.
    if (p in _SPECIAL or g in _SPECIAL) and p != g:
        return 0.0
    pt, gt = p.split(), g.split()
    common = sum((Counter(pt) & Counter(gt)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pt), common / len(gt)
    return 2 * precision * recall / (precision + recall)


def f1_score(prediction: str, golds: Iterable[str]) -> float:
    return max((_f1(prediction, g) for g in golds), default=0.0)


SCORERS = {"em": exact_match, "f1": f1_score, "acc": substring_match}
METRICS = tuple(SCORERS)


def score_answer(prediction: str, golds: Iterable[str]) -> dict[str, float]:
    golds = list(golds)
    return {name: fn(prediction, golds) for name, fn in SCORERS.items()}


def metric(name: str, prediction: str, golds: Iterable[str]) -> float:
    """One metric by name (acc, em or f1): the task metric M(q, a | context) of both papers."""
    fn = SCORERS.get(name)
    if fn is None:
        raise ValueError(f"unknown metric {name!r}; choose one of {', '.join(METRICS)}")
    return fn(prediction, golds)


def sign_test(better: int, worse: int, two_sided: bool = False) -> float:
    """Exact sign test over the questions two settings answered differently: one-sided, P(`better` or more of
    them go the first way) under a fair coin (5-0, 7-1, 9-2 first under 0.05); two-sided, a split at least this uneven.
    1.0 where none differ."""
    n = better + worse
    if n == 0:
        return 1.0
    if two_sided:
        return min(1.0, 2 * sum(math.comb(n, i) for i in range(min(better, worse) + 1)) / 2**n)
    return sum(math.comb(n, k) for k in range(better, n + 1)) / 2**n
