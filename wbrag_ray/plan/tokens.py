"""How long the prompts of a run are, in tokens, counted from its own data where it is readable here: the mean
question of its QA files, the mean passage (and sentence) of its corpus; otherwise wiki-18's shapes.

Tokens are counted as characters / `CHARS_PER_TOKEN` (English text under the BPE vocabularies of the Llama, Gemma
and SmolLM2 families), without loading a tokenizer: a plan loads no model. A prompt adds `TEMPLATE_TOKENS` for its
instruction and chat template (FlashRAG's RAG instruction and a chat template come to about that).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from wbrag_ray.config import WbragConfig

CHARS_PER_TOKEN = 4.0
TEMPLATE_TOKENS = 60
SAMPLE_LINES = 2000  # a file's first lines are its sample: the counts stay cheap on a 13 GB corpus
# wiki-18's shapes, where the corpus or the questions cannot be read here: 100-word passages (about 1.3 tokens a
# word), their 6.57 sentences, and NQ-style questions of about 9 words
WIKI_PASSAGE_TOKENS = 130.0
WIKI_SENTENCE_TOKENS = WIKI_PASSAGE_TOKENS / 6.57
QUESTION_TOKENS = 12.0


@dataclass(frozen=True)
class TokenShape:
    """Mean tokens of a question, a passage (title and text) and a sentence, and where each came from."""

    question: float
    passage: float
    sentence: float
    source: str

    def prompt(self, docs: int, doc_tokens: float | None = None) -> float:
        """Tokens of a prompt holding a question and `docs` documents of `doc_tokens` (a passage by default)."""
        return TEMPLATE_TOKENS + self.question + docs * (self.passage if doc_tokens is None else doc_tokens)


def _mean_chars(path: str, field: str) -> float | None:
    """Mean characters of `field` over a local jsonl file's first lines; None where it is not a readable local
    jsonl (Parquet and remote files are not read for this)."""
    if not path or "://" in path:
        return None
    from wbrag_ray.formats import InputError, file_kind, input_files
    from wbrag_ray.storage import resolve

    try:
        total = n = 0
        for f in input_files(resolve(path), path):
            if file_kind(f) == "parquet":
                continue
            with open(f.path, encoding="utf-8") as handle:
                for line in handle:
                    if n >= SAMPLE_LINES:
                        break
                    if line.strip():
                        total += len(str(json.loads(line).get(field, "")))
                        n += 1
        return total / n if n else None
    except (OSError, InputError, ValueError):
        return None


def token_shape(config: WbragConfig) -> TokenShape:
    """The run's prompt shapes: its questions (the evaluation set, else the training sets) and its corpus."""
    sources = []
    question = None
    for path in (config.eval.dataset, config.writeback.train, config.zerorag.train):
        chars = _mean_chars(path or "", "question")
        if chars is not None:
            question = chars / CHARS_PER_TOKEN
            sources.append(f"questions of {path}")
            break
    passage_chars = _mean_chars(config.ingest.corpus or "", "contents")
    if passage_chars is not None:
        passage = passage_chars / CHARS_PER_TOKEN
        sentence = passage / 4.0  # the demo passages' 3.96 sentences; a wiki passage's 6.57 (rates.RATES)
        sources.append(f"passages of {config.ingest.corpus}")
    else:
        passage, sentence = WIKI_PASSAGE_TOKENS, WIKI_SENTENCE_TOKENS
    if question is None:
        question = QUESTION_TOKENS
    how = ("counted from the " + " and the ".join(sources) if sources else "wiki-18's shapes (nothing readable here)")
    return TokenShape(question, passage, sentence, f"{how}, at {CHARS_PER_TOKEN:g} characters a token")
