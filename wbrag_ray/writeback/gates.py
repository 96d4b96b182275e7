"""WriteBack-RAG's two gates as pure decisions, and the scoring of examples that applies them:
utility gate: keep iff s_rag >= tau_s and delta > tau_delta; document gate: keep documents with s_j - s_nr > tau_doc,
at least n_min (the best ones as a fallback)."""

from __future__ import annotations

import json
from collections.abc import Sequence

import pandas as pd

from wbrag_ray.config import WritebackConfig
from wbrag_ray.metrics import metric

# Scores are float differences (0.51 - 0.5 > 0.01): comparisons allow this much rounding.
_EPS = 1e-9


def utility_gate(s_rag: float, s_nr: float, tau_s: float, tau_delta: float) -> bool:
    """Keep an example iff retrieval answers it well enough (s_rag >= tau_s) and helps (delta > tau_delta)."""
    return s_rag >= tau_s - _EPS and (s_rag - s_nr) > tau_delta + _EPS


def document_gate(doc_scores: Sequence[float], s_nr: float, tau_doc: float, n_min: int) -> tuple[list[int], bool]:
    """(kept ranks, fallback): documents beating s_nr by more than tau_doc, else the top n_min and fallback=True."""
    kept = [j for j, s in enumerate(doc_scores) if s - s_nr > tau_doc + _EPS]
    if kept:
        return kept, False
    return list(range(min(n_min, len(doc_scores)))), True


def _golds(value) -> list[str]:
    return [str(g) for g in value] if value is not None else []


def utility_scores(batch: pd.DataFrame, config: WritebackConfig) -> pd.DataFrame:
    """s_nr = M(q, a | no docs), s_rag = M(q, a | top-K docs), delta, and the utility gate's decision (`useful`)."""
    golds = [_golds(g) for g in batch["golden_answers"]]
    batch["s_nr"] = [metric(config.metric, a, g) for a, g in zip(batch["nr_answer"], golds, strict=True)]
    batch["s_rag"] = [metric(config.metric, a, g) for a, g in zip(batch["rag_answer"], golds, strict=True)]
    batch["delta"] = batch["s_rag"] - batch["s_nr"]
    batch["useful"] = [utility_gate(r, n, config.tau_s, config.tau_delta)
                       for r, n in zip(batch["s_rag"], batch["s_nr"], strict=True)]
    return batch


def gate_examples(answered: pd.DataFrame, method: str, config: WritebackConfig) -> pd.DataFrame:
    """The utility gate over `rag.combine`'s answers: one scored row per example that retrieved something."""
    nr = answered[answered["method"] == "no-retrieval"].set_index("id")["answer"]
    examples = answered[answered["method"] == method].set_index("id")
    own = {"rag_answer": "answer", "rag_slot_answers": "slot_answers", "rag_trace": "trace"}
    examples = examples[["question", "golden_answers", "docs"]].assign(
        nr_answer=nr, **{col: examples[src] for col, src in own.items() if src in examples}).reset_index()
    # Every answer is already on the driver and scoring is microseconds a row: gate in-process.
    examples = utility_scores(examples, config)
    examples["useful"] = examples["useful"] & (examples["docs"] != "[]")
    return examples


def document_scores(batch: pd.DataFrame, config: WritebackConfig) -> pd.DataFrame:
    """s_j from each document's own answer (`doc_answers`), and the document gate's kept ranks with the n_min
    fallback."""
    scores, kept, fallback = [], [], []
    for golds, s_nr, answers in zip(batch["golden_answers"], batch["s_nr"], batch["doc_answers"], strict=True):
        s = [metric(config.metric, a, _golds(golds)) for a in json.loads(answers)]
        ranks, fell_back = document_gate(s, s_nr, config.tau_doc, config.n_min)
        scores.append(json.dumps(s))
        kept.append(json.dumps(ranks))
        fallback.append(fell_back)
    batch["doc_scores"], batch["kept_ranks"], batch["fallback"] = scores, kept, fallback
    return batch
