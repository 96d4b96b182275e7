"""WriteBack-RAG's units of work: the utility gate, the document gate, the distiller's two steps, and dedupe.

Each gate is a pure decision function (the rule of the paper, tested on hand-made scores) wrapped in a Stage
that scores a batch of examples with the task metric and applies the rule. The distiller stages only build
prompts: generation runs in the generator's own pool between them, and neither step's prompt is built from
anything but the question and documents, so the gold answer cannot reach the distiller.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

import numpy as np
import pandas as pd

from wbrag_ray.config import WritebackConfig
from wbrag_ray.stages.base import Resources, Stage

# --- the rules ------------------------------------------------------------------------------------------

# Scores are differences of floats (f1 especially): 0.51 - 0.5 is 0.0100000000000000009, which must not beat
# tau = 0.01. Comparisons allow this much rounding, so a score exactly at a threshold behaves as written.
_EPS = 1e-9


def utility_gate(s_rag: float, s_nr: float, tau_s: float, tau_delta: float) -> bool:
    """Keep an example iff retrieval answers it well enough (s_rag >= tau_s) and helps (delta > tau_delta)."""
    return s_rag >= tau_s - _EPS and (s_rag - s_nr) > tau_delta + _EPS


def document_gate(doc_scores: Sequence[float], s_nr: float, tau_doc: float, n_min: int) -> tuple[list[int], bool]:
    """(kept ranks, fallback): documents whose score alone beats s_nr by more than tau_doc; when none does,
    the top n_min by retrieval rank (doc_scores are in rank order) and fallback=True."""
    kept = [j for j, s in enumerate(doc_scores) if s - s_nr > tau_doc + _EPS]
    if kept:
        return kept, False
    return list(range(min(n_min, len(doc_scores)))), True


def word_count(text: str) -> int:
    """Token counts of Table 3, as whitespace words: independent of any one tokenizer."""
    return len(text.split())


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def _tokens(text: str) -> set[str]:
    from wbrag_ray.metrics import normalize_answer

    return set(normalize_answer(text).split())


def ground_extraction(extracted: str, docs, question: str, min_overlap: float = 0.6) -> str:
    """Step 1 must be verbatim: each extracted sentence is replaced by the source sentence it copies (the one
    sharing most of its words, at least `min_overlap`), so a small model's paraphrase or invention never
    reaches the rewrite step. When nothing matches, the two source sentences closest to the question."""
    source = [s for d in docs for s in _SENTENCE_END.split(d.text) if s.strip()]
    if not source:
        return ""
    source_tokens = [_tokens(s) for s in source]
    picked: set[int] = set()
    for line in _SENTENCE_END.split(extracted.replace("\n", " ")):
        words = _tokens(line)
        if not words:
            continue
        overlap = [len(words & t) / len(words) for t in source_tokens]
        best = int(np.argmax(overlap))
        if overlap[best] >= min_overlap:
            picked.add(best)
    if not picked:
        q = _tokens(question)
        picked = set(sorted(range(len(source)), key=lambda i: -len(q & source_tokens[i]))[:2])
    return "\n".join(source[i] for i in sorted(picked))


def parse_unit(rewritten: str, extracted: str, default_title: str) -> tuple[str, str] | None:
    """(title, text) of a knowledge unit from the rewrite step's output: a title line, then text.

    Small models often skip the title or the rewrite; the unit then falls back to the extracted sentences
    under the top document's title. None when both steps produced nothing.
    """
    lines = [ln.strip() for ln in rewritten.splitlines() if ln.strip()]
    if len(lines) >= 2:
        title = lines[0].removeprefix("Title:").strip().strip("#*\"' ")
        text = " ".join(ln.removeprefix("Text:").strip() for ln in lines[1:])
        return (title or default_title), text
    body = " ".join(lines) or " ".join(extracted.split())
    return (default_title, body) if body else None


def dedupe(vectors: np.ndarray, threshold: float) -> dict[int, int]:
    """Greedy, in row order: unit i is a duplicate of the first earlier kept unit with cosine >= threshold.

    Returns {duplicate row: kept row}; vectors are normalized, so inner product is cosine. A range search
    finds every close pair at once instead of one search per unit.
    """
    import faiss

    n = len(vectors)
    if n < 2:
        return {}
    index = faiss.IndexFlatIP(vectors.shape[1])
    x = np.ascontiguousarray(vectors, dtype=np.float32)
    index.add(x)
    # range_search keeps scores > radius; nudge down so a pair exactly at the threshold counts.
    lims, dist, labels = index.range_search(x, float(threshold) - 1e-6)
    merged: dict[int, int] = {}
    for i in range(n):
        if i in merged:
            continue
        for j, _ in sorted(zip(labels[lims[i] : lims[i + 1]], dist[lims[i] : lims[i + 1]], strict=True)):
            j = int(j)
            if j > i and j not in merged:
                merged[j] = i
    return merged


def _golds(value) -> list[str]:
    return [str(g) for g in value] if value is not None else []


# --- stages ---------------------------------------------------------------------------------------------


class _GateStage(Stage):
    """CPU-only: a gate reads generated answers and scores them; no model to load."""

    def __init__(self, config: WritebackConfig):
        self.config = config

    @property
    def resources(self) -> Resources:
        from wbrag_ray.ray_runtime import LIGHT_CPUS

        return Resources(num_cpus=LIGHT_CPUS, batch_size=1024)


class UtilityGateStage(_GateStage):
    """s_nr = M(q, a | no docs), s_rag = M(q, a | top-K docs), delta, and the utility gate's decision."""

    name = "utility-gate"
    input_columns = ("golden_answers", "nr_answer", "rag_answer")
    output_columns = ("s_nr", "s_rag", "delta", "useful")

    def process_batch(self, batch: pd.DataFrame) -> pd.DataFrame:
        from wbrag_ray.metrics import metric

        c = self.config
        golds = [_golds(g) for g in batch["golden_answers"]]
        batch["s_nr"] = [metric(c.metric, a, g) for a, g in zip(batch["nr_answer"], golds, strict=True)]
        batch["s_rag"] = [metric(c.metric, a, g) for a, g in zip(batch["rag_answer"], golds, strict=True)]
        batch["delta"] = batch["s_rag"] - batch["s_nr"]
        batch["useful"] = [
            utility_gate(r, n, c.tau_s, c.tau_delta) for r, n in zip(batch["s_rag"], batch["s_nr"], strict=True)
        ]
        return batch


class DocumentGateStage(_GateStage):
    """s_j = M(q, a | d_j alone) from each document's own answer (`doc_answers`, JSON, rank order), and the
    document gate's kept ranks, with the n_min fallback."""

    name = "document-gate"
    input_columns = ("golden_answers", "s_nr", "doc_answers")
    output_columns = ("doc_scores", "kept_ranks", "fallback")

    def process_batch(self, batch: pd.DataFrame) -> pd.DataFrame:
        from wbrag_ray.metrics import metric

        c = self.config
        scores, kept, fallback = [], [], []
        for golds, s_nr, answers in zip(batch["golden_answers"], batch["s_nr"], batch["doc_answers"], strict=True):
            s = [metric(c.metric, a, _golds(golds)) for a in json.loads(answers)]
            ranks, fell_back = document_gate(s, s_nr, c.tau_doc, c.n_min)
            scores.append(json.dumps(s))
            kept.append(json.dumps(ranks))
            fallback.append(fell_back)
        batch["doc_scores"], batch["kept_ranks"], batch["fallback"] = scores, kept, fallback
        return batch


def kept_hits(docs: str, kept_ranks: str):
    """The retrieved hits the document gate kept, in rank order."""
    from wbrag_ray.index.retriever import hits_from_json

    hits = hits_from_json(docs)
    return [hits[j] for j in json.loads(kept_ranks)]


class DistillExtractStage(Stage):
    """Distiller step 1 prompt: question + kept documents -> 'copy the answer-relevant sentences verbatim'.
    Reads only `question`, `docs` and `kept_ranks`: the gold answer is not an input of this stage."""

    name = "distill-extract"
    input_columns = ("question", "docs", "kept_ranks")
    output_columns = ("extract_prompt",)

    @property
    def resources(self) -> Resources:
        from wbrag_ray.ray_runtime import LIGHT_CPUS

        return Resources(num_cpus=LIGHT_CPUS, batch_size=1024)

    def process_batch(self, batch: pd.DataFrame) -> pd.DataFrame:
        from wbrag_ray import prompts

        batch["extract_prompt"] = [
            prompts.dumps(prompts.extract_messages(q, kept_hits(d, k)))
            for q, d, k in zip(batch["question"], batch["docs"], batch["kept_ranks"], strict=True)
        ]
        return batch


class DistillRewriteStage(DistillExtractStage):
    """Distiller step 2 prompt: question + the extracted sentences, grounded verbatim in the kept documents
    (`extracted_verbatim`) -> one compact, self-contained document."""

    name = "distill-rewrite"
    input_columns = ("question", "docs", "kept_ranks", "extracted")
    output_columns = ("extracted_verbatim", "rewrite_prompt")

    def process_batch(self, batch: pd.DataFrame) -> pd.DataFrame:
        from wbrag_ray import prompts

        batch["extracted_verbatim"] = [
            ground_extraction(e, kept_hits(d, k), q)
            for e, d, k, q in zip(batch["extracted"], batch["docs"], batch["kept_ranks"], batch["question"], strict=True)
        ]
        batch["rewrite_prompt"] = [
            prompts.dumps(prompts.rewrite_messages(q, e))
            for q, e in zip(batch["question"], batch["extracted_verbatim"], strict=True)
        ]
        return batch


# --- Table 3 --------------------------------------------------------------------------------------------


def table3(scored: pd.DataFrame, units: pd.DataFrame, top_k: int) -> dict:
    """The paper's Table 3 from the scored examples and the written units, as plain JSON numbers."""
    n = len(scored)
    kept = scored[scored["useful"]]
    retained = [json.loads(r) for r in kept["kept_ranks"]] if len(kept) else []
    ranks = [r for rs in retained for r in rs]
    source = int(units["source_tokens"].sum()) if len(units) else 0
    distilled = int(units["distilled_tokens"].sum()) if len(units) else 0
    return {
        "examples": n,
        "selected": len(kept),
        "selection_rate": round(len(kept) / n, 4) if n else 0.0,
        "mean_retained_docs": round(float(np.mean([len(r) for r in retained])), 4) if retained else 0.0,
        "fallback_rate": round(float(kept["fallback"].mean()), 4) if len(kept) else 0.0,
        "source_tokens": source,
        "distilled_tokens": distilled,
        "mean_source_tokens": round(source / len(units), 2) if len(units) else 0.0,
        "mean_distilled_tokens": round(distilled / len(units), 2) if len(units) else 0.0,
        "compression_ratio": round(source / distilled, 4) if distilled else None,
        "token_unit": "whitespace words",
        # 1-based ranks, every rank listed so a report can plot the distribution as is
        "rank_distribution": {str(r + 1): ranks.count(r) for r in range(top_k)},
        "mean_s_nr": round(float(scored["s_nr"].mean()), 4) if n else 0.0,
        "mean_s_rag": round(float(scored["s_rag"].mean()), 4) if n else 0.0,
    }
