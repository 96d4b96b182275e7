"""RAG methods, shared by evaluation and write-back: one pass (`rag.one_pass`: no-retrieval, naive, replug,
replug-vote) and adaptive (`rag.self_rag`, `rag.flare`). `answer()` gives one row per (question, method)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING

import pandas as pd

from wbrag_ray import prompts
from wbrag_ray.config import ConfigError
from wbrag_ray.generation.backends import BACKENDS, check_backend_mode
from wbrag_ray.placement.gpus import retrieval_waits_for_engine
from wbrag_ray.rag import flare, self_rag
from wbrag_ray.rag.one_pass import (
    MIXTURE,
    ONE_PASS,
    combine,
    combine_mixture,
    expand,
    replug_weights,
    weighted_vote,
)
from wbrag_ray.work import Pass

if TYPE_CHECKING:
    import pyarrow as pa

    from wbrag_ray.config import GeneratorConfig, WbragConfig
    from wbrag_ray.generation.passes import GeneratorPasses
    from wbrag_ray.retrieval.stage import RetrievalSetting

ADAPTIVE = ("self-rag", "flare")
METHODS = (*ONE_PASS, *ADAPTIVE)

__all__ = ["ADAPTIVE", "METHODS", "MIXTURE", "ONE_PASS", "answer", "available_methods", "combine", "combine_mixture",
           "expand", "replug_weights", "weighted_vote"]


def check_methods(methods: Sequence[str]) -> list[str]:
    """The methods in order, once each; a clear error for an unknown one."""
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ConfigError(f"unknown RAG method(s) {unknown}; choose from {', '.join(METHODS)}")
    return list(dict.fromkeys(methods))


def passes(method: str, config: WbragConfig) -> list[Pass]:
    """The generator passes `method` makes a question, at most (an adaptive method decides at run time): Self-RAG
    judges retrieval and each document (one token each) and answers; FLARE a look-ahead and a rewrite per round;
    RePlug one mixture of K prompts on the hf backend, else K answers as replug-vote."""
    k, flare = config.retrieval.top_k, config.rag.flare
    rounds, look = flare.max_rounds, flare.look_ahead_tokens
    return {
        "no-retrieval": [Pass(1, 0)],
        "naive": [Pass(1, k)],
        "replug": [Pass(1, k, mixture=True)] if config.generator.backend == "hf" else [Pass(k, 1)],
        "replug-vote": [Pass(k, 1)],
        "self-rag": [Pass(1, 0, 1, prompt=lambda q, _: prompts.retrieval_judge_messages(q)),
                     Pass(k, 1, 1, prompt=lambda q, d: prompts.relevance_judge_messages(q, d[0]), prompt_docs=1),
                     Pass(1, k)],
        "flare": [Pass(rounds, 0, look), Pass(rounds, k, look)],
    }[method]


def available_methods(generator: GeneratorConfig) -> list[str]:
    """Every method this generator backend can run (`replug`'s mixture needs the hf backend)."""
    backend = BACKENDS.get(generator.backend)
    return [m for m in METHODS if m not in MIXTURE or backend is None or backend.supports_mixture]


def retrieval_gpus(config: WbragConfig) -> float:
    """The GPU shares a retrieval pass's actors may ask for: the query embedder's, and the search actors' where the
    index may search on GPUs (`index.gpu` true or auto)."""
    search = config.retrieval.search_share if config.index.gpu is not False else 0.0
    return config.retrieval.query_embedder(config.embedder).num_gpus + search


def answer(
    questions: pa.Table,
    methods: Sequence[str],
    config: WbragConfig,
    search: RetrievalSetting | None,
    passes: GeneratorPasses,
    answer_column: str = "prediction",
    keep_search: bool = True,
) -> pd.DataFrame:
    """Answer every question with every method: one row per (question, method) with the question's columns,
    `method`, `docs`, `prompt`, `slot_answers`, `answer_column`, `retrieval_skipped`, `generator_calls` and `trace`.
    `keep_search=False`: where no method searches after the first search, the retrieval service and its search pools
    end before the generator's passes (a caller whose later passes search keeps them)."""
    methods = check_methods(methods)
    mixture = [m for m in methods if m in MIXTURE]
    if mixture:  # before any search: a backend that cannot decode the mixture says so now
        check_backend_mode(config.generator, "mixture")
    if search is None and any(m != "no-retrieval" for m in methods):
        raise ValueError("methods that retrieve need a retrieval setting")
    parts = []
    one_pass = [m for m in methods if m in ONE_PASS and m not in MIXTURE]
    # Each pass sends the driver's questions to its service's actors directly (no Ray Data plan per pass).
    if one_pass or mixture:
        frame = questions.to_pandas()
        if any(m != "no-retrieval" for m in one_pass + mixture):
            passes.start()  # the generator loads while the questions are searched
            if retrieval_waits_for_engine(config.generator, retrieval_gpus(config)):
                passes.wait_ready()  # ... unless GPU retrieval beside the engine would upset its memory profiling
            frame = search.search(frame, services=passes.services)  # one search for both passes
            if not keep_search and not {"self-rag", "flare"} & set(methods):
                passes.services.end_search()
        temperature = config.retrieval.replug_temperature
    if one_pass:
        rows = expand(frame, one_pass, temperature)
        df = combine(passes.generate("answer", rows, "prompt", answer_column), answer_column)
        df["generator_calls"] = [len(json.loads(s)) for s in df["slot_answers"]]
        df["trace"] = "{}"
        parts.append(df)
    if mixture:
        rows = expand(frame, mixture, temperature)
        generated = passes.generate("replug:mixture", rows, "prompt", answer_column, mode="mixture",
                                    weight_column="weights")
        parts.append(combine_mixture(generated, answer_column))
    if "self-rag" in methods or "flare" in methods:
        frame = questions.to_pandas()
        if "self-rag" in methods:
            parts.append(self_rag.run(frame, config.rag.self_rag, search, passes, answer_column))
        if "flare" in methods:
            parts.append(flare.run(frame, config.rag.flare, search, passes, answer_column))
    out = pd.concat(parts, ignore_index=True)
    skipped = out["retrieval_skipped"] if "retrieval_skipped" in out else pd.Series(False, index=out.index)
    out["retrieval_skipped"] = skipped.fillna(False).astype(bool)
    return out
