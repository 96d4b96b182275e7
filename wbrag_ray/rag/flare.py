"""FLARE-direct (Jiang et al. 2023): the answer is written a sentence at a time. Each round generates the next
sentence closed-book; a sentence holding a token below the threshold is written again from documents retrieved with
it (unsure tokens masked) as the query. Finished when the model ends it, or after `max_rounds`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pandas as pd

from wbrag_ray import prompts
from wbrag_ray.config import FlareConfig
from wbrag_ray.rag.adaptive import result_row, search_some

if TYPE_CHECKING:
    from wbrag_ray.generation.passes import GeneratorPasses
    from wbrag_ray.retrieval.hits import Hit
    from wbrag_ray.retrieval.stage import RetrievalSetting

METHOD = "flare"
_ENDS = (".", "!", "?")


def first_sentence(tokens: list[str]) -> int:
    """How many of `tokens` make the first sentence (to a . ! ? the next token does not continue)."""
    for j, token in enumerate(tokens):
        if token.rstrip().endswith(_ENDS) and (j + 1 == len(tokens) or tokens[j + 1][:1].isspace()):
            return j + 1
    return len(tokens)


def masked_query(question: str, tokens: list[str], probs: list[float], settings: FlareConfig) -> str:
    """FLARE's query: the sentence without its unsure tokens (`mask_query`), after the question if asked."""
    kept = [t for t, p in zip(tokens, probs, strict=True) if p >= settings.threshold or not settings.mask_query]
    sentence = "".join(kept).strip()
    return f"{question} {sentence}".strip() if settings.query_with_question else (sentence or question)


def run(
    questions: pd.DataFrame, settings: FlareConfig, search: RetrievalSetting, passes: GeneratorPasses,
    answer_column: str,
) -> pd.DataFrame:
    """One row per question (see `rag.answer`); `trace` lists each round's sentence, min probability and query."""
    questions = questions.reset_index(drop=True)
    ids = questions["id"].tolist()
    question_of = dict(zip(ids, questions["question"], strict=True))
    written = dict.fromkeys(ids, "")
    done = dict.fromkeys(ids, False)
    used: dict = {i: [] for i in ids}  # documents the answer was written from, first retrieval first
    rounds: dict = {i: [] for i in ids}
    last_prompt: dict = {}
    calls = dict.fromkeys(ids, 0)
    router_skipped = dict.fromkeys(ids, False)

    def scored_pass(name: str, prompt_of: dict) -> pd.DataFrame:
        frame = pd.DataFrame({"id": list(prompt_of), "prompt": list(prompt_of.values())})
        out = passes.generate(name, frame, "prompt", "out", settings.look_ahead_tokens, mode="scored")
        for i in prompt_of:
            calls[i] += 1
            last_prompt[i] = prompt_of[i]
        return out.set_index("id")

    for r in range(1, settings.max_rounds + 1):
        active = [i for i in ids if not done[i]]
        if not active:
            break
        look = scored_pass(f"{METHOD}:look-ahead-{r}", {
            i: prompts.dumps(prompts.continue_answer(prompts.no_retrieval_messages(question_of[i]), written[i]))
            for i in active
        })
        step: dict = {}
        for i in active:
            tokens, probs = list(look.at[i, "out_tokens"]), list(look.at[i, "out_probs"])
            k = first_sentence(tokens)
            low = bool(k) and min(probs[:k]) < settings.threshold  # an empty look-ahead ends the answer
            step[i] = {"tokens": tokens, "k": k, "finished": bool(look.at[i, "out_finished"]),
                       "min_prob": min(probs[:k]) if k else None, "retrieve": low,
                       "look_ahead": "".join(tokens[:k]).strip()}
            if low:
                step[i]["query"] = masked_query(question_of[i], tokens[:k], probs[:k], settings)

        unsure = [i for i in active if step[i]["retrieve"]]
        found: dict[object, list[Hit]] = {}
        if unsure:
            frame = pd.DataFrame({"id": unsure, "question": [question_of[i] for i in unsure],
                                  "flare_query": [step[i]["query"] for i in unsure]})
            for i, (hits, skipped) in search_some(search, frame, passes, "flare_query").items():
                found[i] = hits
                router_skipped[i] = router_skipped[i] or skipped
        rewrite = {
            i: prompts.dumps(prompts.continue_answer(prompts.rag_messages(question_of[i], found[i]), written[i]))
            for i in unsure if found[i]  # a router-skipped question has no documents: its look-ahead stands
        }
        again = scored_pass(f"{METHOD}:regenerate-{r}", rewrite) if rewrite else None

        for i in active:
            s = step[i]
            tokens, k, finished = s["tokens"], s["k"], s["finished"]
            if i in rewrite:
                tokens, finished = list(again.at[i, "out_tokens"]), bool(again.at[i, "out_finished"])
                k = first_sentence(tokens)
                known = {h.key for h in used[i]}
                used[i] += [h for h in found[i] if h.key not in known]
            sentence = "".join(tokens[:k])
            written[i] += sentence
            # Finished: the model ended the answer with this sentence, wrote nothing, or rounds ran out.
            done[i] = (finished and k == len(tokens)) or not k or r == settings.max_rounds
            rounds[i].append({
                "round": r, "look_ahead": s["look_ahead"],
                "min_prob": None if s["min_prob"] is None else round(s["min_prob"], 6),
                "retrieved": i in rewrite, "query": s.get("query"),
                "doc_ids": [h.id for h in found.get(i, [])], "sentence": sentence,  # as written, spaces kept
            })

    return pd.DataFrame([
        result_row(q, METHOD, answer_column, written[i].strip(), used[i], last_prompt.get(i, ""),
                   not any(x["retrieved"] for x in rounds[i]), calls[i],
                   {"threshold": settings.threshold, "router_skipped": router_skipped[i], "rounds": rounds[i]})
        for (_, q), i in zip(questions.iterrows(), ids, strict=True)
    ])
