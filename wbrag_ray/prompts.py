"""Prompts, in one place: every stage that talks to the generator builds its messages here.

The RAG prompts follow FlashRAG's defaults (answer only, no other words) so metrics are comparable.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from wbrag_ray.index.retriever import Hit

RAG_SYSTEM = (
    "Answer the question based on the given documents. Only give me the answer and do not output any other words."
    "\n\nThe following are given documents.\n\n{reference}"
)
NO_RETRIEVAL_SYSTEM = (
    "Answer the question based on your own knowledge. Only give me the answer and do not output any other words."
)
QUESTION = "Question: {question}"


def format_reference(docs: Sequence[Hit]) -> str:
    return "\n".join(f"Doc {i + 1}(Title: {d.title}) {d.text}" for i, d in enumerate(docs))


def rag_messages(question: str, docs: Sequence[Hit]) -> list[dict[str, str]]:
    """Messages for answering with the given documents (none -> the no-retrieval prompt)."""
    if not docs:
        return no_retrieval_messages(question)
    return [
        {"role": "system", "content": RAG_SYSTEM.format(reference=format_reference(docs))},
        {"role": "user", "content": QUESTION.format(question=question)},
    ]


def no_retrieval_messages(question: str) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": NO_RETRIEVAL_SYSTEM},
        {"role": "user", "content": QUESTION.format(question=question)},
    ]


def dumps(messages: list[dict[str, str]]) -> str:
    """Prompts travel through Ray Data as JSON strings (one column, any number of messages)."""
    return json.dumps(messages, ensure_ascii=False)
