"""How long a run's prompts are, in tokens, counted from its own data where readable here (else wiki-18's shapes).

Tokens are characters / `CHARS_PER_TOKEN`, without a tokenizer (a plan loads no model), plus each chat message's
markers; an instruction is counted from the prompt's own text (`prompts`), so a cost per token calibrated on two
prompt kinds carries to the others (RESULTS.md, "Measurements moved from docstrings").
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from wbrag_ray.config import WbragConfig

CHARS_PER_TOKEN = 4.0
MESSAGE_TOKENS = 5  # "<|im_start|>user\n ... <|im_end|>\n" (SmolLM2, Qwen); Llama 3's header ids about the same
GENERATION_TOKENS = 3  # the assistant's opening, after the last message
DOC_FORMAT_TOKENS = 3  # a document's "Doc i(Title: ...)" beside its title and text (`prompts.format_reference`)
TOKEN_UNITS = 2  # the version of these units in a record: a record of other units is not used
SAMPLE_LINES = 2000  # a file's first lines are its sample: the counts stay cheap on a 13 GB corpus
# wiki-18's shapes: 100-word passages of 6.57 sentences, NQ-style questions of about 9 words
WIKI_PASSAGE_TOKENS = 130.0
WIKI_SENTENCE_TOKENS = WIKI_PASSAGE_TOKENS / 6.57
QUESTION_TOKENS = 12.0
WIKI_TITLE_TOKENS = 4.0


@dataclass(frozen=True)
class TokenShape:
    """Mean tokens of a question, a passage (title and text) and a sentence, and where each came from."""

    question: float
    passage: float
    sentence: float
    source: str
    title: float = WIKI_TITLE_TOKENS  # a passage's title (the LM pruner reads `title: sentence`)

    def prompt(self, docs: int, doc_tokens: float | None = None, template: float | None = None,
               question: float | None = None) -> float:
        """Tokens of a prompt of a question and `docs` documents of `doc_tokens` in a template of `template`
        tokens (defaults: the run's mean question, a passage, the RAG or closed-book prompt's template)."""
        doc = self.passage if doc_tokens is None else doc_tokens
        return ((template_tokens(docs > 0) if template is None else template)
                + (self.question if question is None else question) + docs * (doc + DOC_FORMAT_TOKENS))


def text_tokens(text: str) -> float:
    """Tokens of `text` as the plan counts them (characters / CHARS_PER_TOKEN), so measured and planned agree."""
    return len(text) / CHARS_PER_TOKEN


def messages_tokens(messages: list[dict[str, str]]) -> float:
    """Tokens of a chat prompt: its messages' text, each message's template markers, the answer's opening."""
    return (sum(text_tokens(m["content"]) for m in messages) + MESSAGE_TOKENS * len(messages)
            + GENERATION_TOKENS)


def template_of(build, docs: int = 0) -> float:
    """The tokens a prompt kind (`build(question, docs)`) adds beside its question and `docs` documents."""
    from wbrag_ray.retrieval.hits import Hit

    return messages_tokens(build("", [Hit(0, 0.0, 0, "", "")] * docs)) - docs * DOC_FORMAT_TOKENS


def template_tokens(with_docs: bool) -> float:
    """Tokens of the RAG (`with_docs`) or closed-book prompt's template."""
    from wbrag_ray.prompts import no_retrieval_messages, rag_messages

    return template_of(rag_messages, 1) if with_docs else template_of(lambda q, _: no_retrieval_messages(q))


def jsonl_rows(path: str | None, n: int = SAMPLE_LINES) -> list[dict]:
    """The first `n` rows of a local jsonl file or folder ([] for Parquet, remote or unreadable files)."""
    if not path or "://" in path:
        return []
    from wbrag_ray.formats import InputError, file_kind, input_files
    from wbrag_ray.storage import resolve

    rows: list[dict] = []
    try:
        for f in input_files(resolve(path), path):
            if file_kind(f) == "parquet":
                continue
            with open(f.path, encoding="utf-8") as handle:
                for line in handle:
                    if len(rows) >= n:
                        return rows
                    if line.strip():
                        rows.append(json.loads(line))
    except (OSError, InputError, ValueError):
        pass
    return rows


def _mean_chars(path: str, field: str, part=str) -> float | None:
    """Mean characters of `part` of `field` over a local jsonl file's first lines; None where unreadable."""
    rows = jsonl_rows(path)
    return sum(len(part(str(r.get(field, "")))) for r in rows) / len(rows) if rows else None


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
    title_chars = _mean_chars(config.ingest.corpus or "", "contents", lambda v: v.split("\n", 1)[0])
    if passage_chars is not None:
        passage = passage_chars / CHARS_PER_TOKEN
        sentence = passage / 4.0  # the demo passages' 3.96 sentences; a wiki passage's 6.57 (rates.RATES)
        sources.append(f"passages of {config.ingest.corpus}")
    else:
        passage, sentence = WIKI_PASSAGE_TOKENS, WIKI_SENTENCE_TOKENS
    if question is None:
        question = QUESTION_TOKENS
    how = ("counted from the " + " and the ".join(sources) if sources else "wiki-18's shapes (nothing readable here)")
    title = title_chars / CHARS_PER_TOKEN if title_chars is not None else WIKI_TITLE_TOKENS
    return TokenShape(question, passage, sentence, f"{how}, at {CHARS_PER_TOKEN:g} characters a token", title)
