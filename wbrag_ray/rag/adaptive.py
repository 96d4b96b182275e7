"""What the adaptive methods share: judgement shares, retrieval passes, output rows (apart to avoid a cycle)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import pandas as pd

from wbrag_ray.retrieval.hits import Hit, hits_from_json, hits_to_json

if TYPE_CHECKING:
    from wbrag_ray.generation.passes import GeneratorPasses
    from wbrag_ray.retrieval.stage import RetrievalSetting


def judgement_share(probs: Sequence[float]) -> tuple[float, float]:
    """(p(yes) / (p(yes) + p(no)), p(yes) + p(no)) from a yes/no choice pass; the share is what is thresholded,
    the mass how far the model followed the instruction. No mass: 0.5."""
    yes, no = float(probs[0]), float(probs[1])
    mass = yes + no
    return (yes / mass if mass > 0 else 0.5), mass


def search_some(search: RetrievalSetting, frame: pd.DataFrame, passes: GeneratorPasses,
                query_column: str = "question") -> dict:
    """One retrieval pass over the questions an adaptive method chose to search: {id: (hits, router_skipped)}."""
    searched = search.search(frame, query_column, passes.services).set_index("id")
    router = "retrieval_skipped" in searched
    return {i: (hits_from_json(searched.at[i, "docs"]), router and bool(searched.at[i, "retrieval_skipped"]))
            for i in frame["id"]}


def result_row(question: pd.Series, method: str, answer_column: str, answer: str, docs: list[Hit], prompt: str,
               retrieval_skipped: bool, generator_calls: int, trace: dict[str, Any]) -> dict:
    """One output row of an adaptive method (see `rag.answer`): the question's own columns, then the method's."""
    return {**question.to_dict(), "method": method, "docs": hits_to_json(docs), "prompt": prompt,
            "slot_answers": json.dumps([answer], ensure_ascii=False), answer_column: answer,
            "retrieval_skipped": retrieval_skipped, "generator_calls": generator_calls, "trace": json.dumps(trace)}
