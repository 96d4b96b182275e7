"""WriteBack-RAG's distiller in two steps over the kept examples: extract (answer-relevant sentences, grounded
verbatim) -> rewrite (one self-contained unit). Prompts hold only the question and documents, never the gold answer."""

from __future__ import annotations

import json
import re

import numpy as np
import pandas as pd

from wbrag_ray import prompts
from wbrag_ray.config import WritebackConfig
from wbrag_ray.generation.passes import GeneratorPasses
from wbrag_ray.metrics import normalize_answer
from wbrag_ray.retrieval.hits import hits_from_json


def word_count(text: str) -> int:
    """Token counts of Table 3, as whitespace words: independent of any one tokenizer."""
    return len(text.split())


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
# Words about the question rather than evidence, which a small rewriter writes: a unit is a document.
_ANSWER_LEAD = re.compile(r"^(?:the\s+)?answer(?:\s+to\s+(?:the|this|your)\s+question)?\s*(?:is\b\s*:?|:)\s*", re.I)


def _tokens(text: str) -> set[str]:
    return set(normalize_answer(text).split())


MIN_OVERLAP = 0.6  # the share of a sentence's words one source sentence must hold for it to copy that sentence
# Fewer words than a statement: a bare answer, which nothing retrieves and no reader can check.
MIN_STATEMENT_WORDS = 4
BARE_ANSWER, UNSUPPORTED = "bare answer", "unsupported by its source passages"


def source_sentences(docs) -> list[str]:
    return [s for d in docs for s in _SENTENCE_END.split(d.text) if s.strip()]


def ground_extraction(extracted: str, docs, question: str) -> str:
    """Replace each extracted sentence by the source sentence sharing most of its words (at least MIN_OVERLAP),
    so no paraphrase reaches step 2; when nothing matches, the two source sentences closest to the question."""
    source = source_sentences(docs)
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
        if overlap[best] >= MIN_OVERLAP:
            picked.add(best)
    if not picked:
        q = _tokens(question)
        picked = set(sorted(range(len(source)), key=lambda i: -len(q & source_tokens[i]))[:2])
    return "\n".join(source[i] for i in sorted(picked))


def statement_check(text: str, docs) -> str | None:
    """Why a unit is not a statement its sources support (None: it is): a bare answer, or a sentence no single
    source sentence (with its title) holds MIN_OVERLAP of the words and every number of."""
    if len(_tokens(text)) < MIN_STATEMENT_WORDS:
        return BARE_ANSWER
    source_tokens = [_tokens(s) | _tokens(d.title) for d in docs for s in source_sentences([d])]
    for sentence in _SENTENCE_END.split(text):
        words = _tokens(sentence)
        if not words:
            continue
        numbers = {w for w in words if any(c.isdigit() for c in w)}
        if not any(len(words & t) >= MIN_OVERLAP * len(words) and numbers <= t for t in source_tokens):
            return UNSUPPORTED
    return None


def parse_unit(rewritten: str, extracted: str, default_title: str) -> tuple[str, str] | None:
    """(title, text) of a unit from the rewrite, else the extraction under the top title; None if empty."""
    lines = [ln.strip() for ln in rewritten.splitlines() if ln.strip()]
    title, body = default_title, " ".join(lines)
    if len(lines) >= 2:
        title = lines[0].removeprefix("Title:").strip().strip("#*\"' ") or default_title
        body = " ".join(ln.removeprefix("Text:").strip() for ln in lines[1:])
    body = _ANSWER_LEAD.sub("", body).strip()
    if not body:
        title, body = default_title, " ".join(extracted.split())
    return (title, body) if body else None


def kept_hits(docs: str, kept_ranks: str):
    """The retrieved hits the document gate kept, in rank order."""
    hits = hits_from_json(docs)
    return [hits[j] for j in json.loads(kept_ranks)]


def distill(wb: WritebackConfig, kept: pd.DataFrame, passes: GeneratorPasses) -> pd.DataFrame:
    """The distiller's two steps over the kept examples: extract (question + kept documents -> the answer-relevant
    sentences, grounded verbatim), then rewrite (question + grounded extraction -> one self-contained document)."""
    # Only these columns reach the distiller's prompts: the gold answers are not among them.
    frame = kept[["id", "question", "docs", "kept_ranks"]].copy()
    hits = [kept_hits(d, k) for d, k in zip(frame["docs"], frame["kept_ranks"], strict=True)]
    frame["extract_prompt"] = [prompts.dumps(prompts.extract_messages(q, h))
                               for q, h in zip(frame["question"], hits, strict=True)]
    frame = passes.generate("distill_extract", frame, "extract_prompt", "extracted", wb.extract_max_new_tokens,
                            multiline=True)
    hits = [kept_hits(d, k) for d, k in zip(frame["docs"], frame["kept_ranks"], strict=True)]
    frame["extracted_verbatim"] = [ground_extraction(e, h, q)
                                   for e, h, q in zip(frame["extracted"], hits, frame["question"], strict=True)]
    frame["rewrite_prompt"] = [prompts.dumps(prompts.rewrite_messages(q, e))
                               for q, e in zip(frame["question"], frame["extracted_verbatim"], strict=True)]
    return passes.generate("distill_rewrite", frame, "rewrite_prompt", "rewritten", wb.rewrite_max_new_tokens,
                           multiline=True)
