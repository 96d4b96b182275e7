"""Self-RAG-style adaptive retrieval with prompted judgements (Asai et al. 2024), reduced: judge "retrieve?";
no -> closed-book; yes -> top K, judge each document's relevance, answer from the relevant ones (none: the most
relevant, or closed-book). Judgements are probabilities, as Self-RAG thresholds p(Retrieve=yes)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pandas as pd

from wbrag_ray import prompts
from wbrag_ray.config import SelfRagConfig
from wbrag_ray.rag.adaptive import judgement_share, result_row, search_some

if TYPE_CHECKING:
    from wbrag_ray.generation.passes import GeneratorPasses
    from wbrag_ray.retrieval.stage import RetrievalSetting

METHOD = "self-rag"


def run(
    questions: pd.DataFrame, settings: SelfRagConfig, search: RetrievalSetting, passes: GeneratorPasses,
    answer_column: str,
) -> pd.DataFrame:
    """One row per question; `trace` holds p_retrieve, the yes+no mass, and each document's relevance share."""
    questions = questions.reset_index(drop=True)
    ids = questions["id"].tolist()
    # Only ids and prompts travel to the generator; the gold answers stay in the driver.
    judge = pd.DataFrame(
        {"id": ids, "prompt": [prompts.dumps(prompts.retrieval_judge_messages(q)) for q in questions["question"]]}
    )
    judged = passes.generate(
        f"{METHOD}:judge-retrieval", judge, "prompt", "p", mode="choice", choices=prompts.JUDGE_CHOICES
    ).set_index("id")["p"]
    share = {i: judgement_share(judged[i]) for i in ids}
    retrieve = {i: share[i][0] >= settings.retrieval_threshold for i in ids}

    hits: dict = {i: [] for i in ids}
    router_skipped: dict = {i: False for i in ids}
    need = questions[[retrieve[i] for i in ids]]
    if len(need):
        for i, (found, skipped) in search_some(search, need[["id", "question"]], passes).items():
            hits[i], router_skipped[i] = found, skipped

    question_of = dict(zip(ids, questions["question"], strict=True))
    pairs = pd.DataFrame(
        [
            {"id": i, "slot": j, "prompt": prompts.dumps(prompts.relevance_judge_messages(question_of[i], h))}
            for i in ids for j, h in enumerate(hits[i])
        ],
        columns=["id", "slot", "prompt"],
    )
    relevance: dict = {i: [] for i in ids}
    if len(pairs):
        rel = passes.generate(
            f"{METHOD}:judge-relevance", pairs, "prompt", "p", mode="choice",
            choices=prompts.JUDGE_CHOICES,
        ).sort_values(["id", "slot"], kind="stable")
        for i, p in zip(rel["id"], rel["p"], strict=True):
            relevance[i].append(judgement_share(p)[0])
    kept = {i: [h for h, r in zip(hits[i], relevance[i], strict=True) if r >= settings.relevance_threshold]
            for i in ids}
    fallback = {i: settings.keep_best and bool(hits[i]) and not kept[i] for i in ids}
    for i in ids:
        if fallback[i]:
            kept[i] = [hits[i][max(range(len(hits[i])), key=relevance[i].__getitem__)]]

    answer_prompts = {i: prompts.dumps(prompts.rag_messages(question_of[i], kept[i])) for i in ids}
    answered = passes.generate(
        f"{METHOD}:answer", pd.DataFrame({"id": ids, "prompt": [answer_prompts[i] for i in ids]}),
        "prompt", answer_column,
    ).set_index("id")[answer_column]

    rows = []
    for (_, q), i in zip(questions.iterrows(), ids, strict=True):
        trace = {
            "p_retrieve": round(share[i][0], 6),
            "judge_mass": round(share[i][1], 6),
            "retrieve": retrieve[i],
            "router_skipped": router_skipped[i],
            "fallback": fallback[i],  # no document passed: the most relevant one was kept
            "retrieved": [{"id": h.id, "source": h.source, "rank": h.rank, "relevance": round(r, 6)}
                          for h, r in zip(hits[i], relevance[i], strict=True)],
        }
        rows.append(result_row(q, METHOD, answer_column, answered[i], kept[i], answer_prompts[i],
                               not retrieve[i] or router_skipped[i], 2 + len(hits[i]), trace))
    return pd.DataFrame(rows)
