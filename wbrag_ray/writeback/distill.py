"""WriteBack-RAG's distiller, in two steps over the kept examples: extract (the sentences of the kept documents
that answer the question, grounded in them) -> rewrite (one self-contained knowledge unit).

The stages only build prompts: generation runs in the generator's service between them, and neither step's
prompt is built from anything but the question and documents, so the gold answer cannot reach the distiller.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pandas as pd

from wbrag_ray import prompts
from wbrag_ray.config import WbragConfig
from wbrag_ray.generation.passes import GeneratorPasses
from wbrag_ray.metrics import normalize_answer
from wbrag_ray.ray_runtime import LIGHT_CPUS
from wbrag_ray.retrieval.hits import hits_from_json
from wbrag_ray.stages.base import Resources, Stage, run_local


def word_count(text: str) -> int:
    """Token counts of Table 3, as whitespace words: independent of any one tokenizer."""
    return len(text.split())

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
# Words about the training question rather than evidence ("The answer to the question is: ..."), which a small
# rewriter writes despite the prompt: a unit is a document, not an answer.
_ANSWER_LEAD = re.compile(r"^(?:the\s+)?answer(?:\s+to\s+(?:the|this|your)\s+question)?\s*(?:is\b\s*:?|:)\s*", re.I)


def _tokens(text: str) -> set[str]:
    return set(normalize_answer(text).split())


MIN_OVERLAP = 0.6  # the share of a sentence's words one source sentence must hold for it to copy that sentence
# Fewer words than a subject, a verb and what is said of it: a bare answer ("2018", "Alan Turing", "February 1990"),
# which nothing retrieves (a query is a question, not its answer) and which says nothing a reader can check.
MIN_STATEMENT_WORDS = 4
BARE_ANSWER, UNSUPPORTED = "bare answer", "unsupported by its source passages"


def source_sentences(docs) -> list[str]:
    return [s for d in docs for s in _SENTENCE_END.split(d.text) if s.strip()]


def best_source(words: set[str], source_tokens: list[set[str]]) -> tuple[int, float]:
    """(the source sentence sharing most of `words`, the share of them it holds)."""
    overlap = [len(words & t) / len(words) for t in source_tokens]
    best = int(np.argmax(overlap))
    return best, overlap[best]


def ground_extraction(extracted: str, docs, question: str, min_overlap: float = MIN_OVERLAP) -> str:
    """Step 1 must be verbatim: each extracted sentence is replaced by the source sentence it copies (the one
    sharing most of its words, at least `min_overlap`), so a small model's paraphrase or invention never
    reaches the rewrite step. When nothing matches, the two source sentences closest to the question."""
    source = source_sentences(docs)
    if not source:
        return ""
    source_tokens = [_tokens(s) for s in source]
    picked: set[int] = set()
    for line in _SENTENCE_END.split(extracted.replace("\n", " ")):
        words = _tokens(line)
        if not words:
            continue
        best, overlap = best_source(words, source_tokens)
        if overlap >= min_overlap:
            picked.add(best)
    if not picked:
        q = _tokens(question)
        picked = set(sorted(range(len(source)), key=lambda i: -len(q & source_tokens[i]))[:2])
    return "\n".join(source[i] for i in sorted(picked))


def statement_check(text: str, docs, min_overlap: float = MIN_OVERLAP) -> str | None:
    """Why a distilled unit is not a retrievable statement its source passages support (None: it is one): it is a
    bare answer (under MIN_STATEMENT_WORDS words), or one of its sentences fails the check step 1's extraction is
    grounded by (`ground_extraction`): no one source sentence, read with its document's title (a rewrite names
    what the passage's "It" is), holds `min_overlap` of its words and every number in it. Numbers are where a small rewriter joins two facts into a wrong one ("The peak position of Let Them Eat
    Bingo on the UK Albums Chart was February 1990": the chart sentence holds no 1990), and one source sentence
    must carry the fact with its figure."""
    if len(_tokens(text)) < MIN_STATEMENT_WORDS:
        return BARE_ANSWER
    source_tokens = [_tokens(s) | _tokens(d.title) for d in docs for s in source_sentences([d])]
    for sentence in _SENTENCE_END.split(text):
        words = _tokens(sentence)
        if not words:
            continue
        numbers = {w for w in words if any(c.isdigit() for c in w)}
        if not any(len(words & t) >= min_overlap * len(words) and numbers <= t for t in source_tokens):
            return UNSUPPORTED
    return None


def parse_unit(rewritten: str, extracted: str, default_title: str) -> tuple[str, str] | None:
    """(title, text) of a knowledge unit from the rewrite step's output: a title line, then text.

    Small models often skip the title or the rewrite; the unit then falls back to the extracted sentences
    under the top document's title. None when both steps produced nothing.
    """
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


class DistillExtractStage(Stage):
    """Distiller step 1 prompt: question + kept documents -> 'copy the answer-relevant sentences verbatim'.
    Reads only `question`, `docs` and `kept_ranks`: the gold answer is not an input of this stage."""

    name = "distill-extract"
    input_columns = ("question", "docs", "kept_ranks")
    output_columns = ("extract_prompt",)

    @property
    def resources(self) -> Resources:
        return Resources(num_cpus=LIGHT_CPUS, batch_size=1024)

    def process_batch(self, batch: pd.DataFrame) -> pd.DataFrame:
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
        batch["extracted_verbatim"] = [
            ground_extraction(e, kept_hits(d, k), q)
            for e, d, k, q in zip(batch["extracted"], batch["docs"], batch["kept_ranks"], batch["question"], strict=True)
        ]
        batch["rewrite_prompt"] = [
            prompts.dumps(prompts.rewrite_messages(q, e))
            for q, e in zip(batch["question"], batch["extracted_verbatim"], strict=True)
        ]
        return batch


def distill(config: WbragConfig, kept: pd.DataFrame, passes: GeneratorPasses) -> pd.DataFrame:
    """The distiller's two steps over the kept examples; the frame passed on holds no gold answers."""
    wb = config.writeback
    # Only these columns reach the distiller's prompts: the gold answers are not among them. The prompts are
    # built here, in the driver that holds the examples; the generator's service writes the steps.
    step0 = run_local(DistillExtractStage(), kept[["id", "question", "docs", "kept_ranks"]].copy())
    step1 = passes.generate("distill_extract", step0, "extract_prompt", "extracted", wb.extract_max_new_tokens,
                            multiline=True)
    step2 = run_local(DistillRewriteStage(), step1)
    return passes.generate("distill_rewrite", step2, "rewrite_prompt", "rewritten", wb.rewrite_max_new_tokens,
                           multiline=True)
