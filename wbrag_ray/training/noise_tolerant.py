"""Zero-RAG's noise-tolerant tuning: LoRA fine-tuning of the generator on each training question in three
formats, so that it answers well with relevant documents, is not misled by distracting ones, and still
answers from its own knowledge when retrieval is skipped (the router's mastered queries).

Prompts come from `wbrag_ray.prompts`, the ones evaluation uses, rendered exactly as `HFGenerator` renders
them; the adapter is saved where `GeneratorConfig.lora_adapter` can point.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import numpy as np
import pandas as pd

from wbrag_ray import prompts
from wbrag_ray.config import ConfigError, GeneratorConfig, TuneConfig
from wbrag_ray.generation.hf_loading import hf_model_source
from wbrag_ray.generation.types import messages_to_text
from wbrag_ray.layout import ADAPTER_STATS as STATS_FILE
from wbrag_ray.metrics import normalize_answer
from wbrag_ray.retrieval.hits import Hit, hits_from_json, hits_to_json
from wbrag_ray.training.lora import loss_stats, save_adapter, seed_torch, train, training_threads, with_lora

log = logging.getLogger(__name__)

FORMATS = ("relevant", "distracting", "none")
IGNORE = -100  # label of positions the loss skips (prompt and padding)


def _doc_text(hit: Hit) -> str:
    # The title is part of what the prompt shows, so an answer in the title counts as contained.
    return normalize_answer(f"{hit.title} {hit.text}")


def _pick_random(rng: np.random.Generator, pool: list[str], excluded: set[int], golds: list[str], k: int) -> list[int]:
    """Up to k pool positions outside `excluded` whose text holds no gold answer. Random draws first (cheap at
    any pool size); a full shuffled scan only when they fall short (small or answer-dense pools)."""

    def ok(i: int) -> bool:
        return i not in excluded and not any(g in pool[i] for g in golds)

    if not pool or k <= 0:
        return []
    picked: list[int] = []
    for candidates in (rng.integers(len(pool), size=8 * k), rng.permutation(len(pool))):
        for i in candidates.tolist():
            if len(picked) == k:
                return picked
            if i not in picked and ok(i):
                picked.append(i)
    return picked


def build_examples(questions: pd.DataFrame, docs_per_format: int, seed: int) -> pd.DataFrame:
    """Training rows per question (`id`, `question`, `golden_answers`, `docs`: JSON hits in rank order), one per
    term of the tuning objective:

    - relevant (the retrieval-augmented term): up to `docs_per_format` retrieved docs that hold a gold answer
      (normalized substring). A question whose retrieved docs hold none gets no relevant row: a "relevant"
      context without the answer would teach the model to answer from nothing.
    - distracting (the noise-suppression term): `docs_per_format` hard distractors: docs retrieved for the same
      question that hold no gold answer, best-ranked first, as a retriever would mislead; when too few, docs
      retrieved for other questions (seeded draw) fill up (`random_distractors` counts them).
    - none (the retrieval-free term): no docs, the closed-book prompt.

    Columns: id, question, format, docs (JSON hits), n_docs, random_distractors, messages (JSON chat), target
    (the first gold answer). Questions without a gold answer have no target and are dropped, with a warning.
    """
    parsed = []
    for row in questions.itertuples(index=False):
        answers = row.golden_answers
        answers = [answers] if isinstance(answers, str) else (answers if answers is not None else [])
        golds = [str(g) for g in answers if str(g).strip()]
        if not golds:
            continue
        parsed.append((row.id, str(row.question), golds, hits_from_json(row.docs)))
    if len(parsed) < len(questions):
        log.warning("noise-tolerant tuning: %d questions without a gold answer dropped", len(questions) - len(parsed))

    # One pool of every retrieved doc (first occurrence wins), normalized once.
    position: dict[tuple[str, int], int] = {}
    pool_hits: list[Hit] = []
    for *_, hits in parsed:
        for h in hits:
            if h.key not in position:
                position[h.key] = len(pool_hits)
                pool_hits.append(h)
    pool = [_doc_text(h) for h in pool_hits]

    rng = np.random.default_rng(seed)
    rows: list[dict[str, Any]] = []
    for qid, question, golds, hits in parsed:
        norm_golds = [g for g in map(normalize_answer, golds) if g]
        own = [position[h.key] for h in hits]
        holds = [any(g in pool[i] for g in norm_golds) for i in own]
        relevant = [h for h, yes in zip(hits, holds, strict=True) if yes][:docs_per_format]
        hard = [h for h, yes in zip(hits, holds, strict=True) if not yes][:docs_per_format]
        extra = _pick_random(rng, pool, set(own), norm_golds, docs_per_format - len(hard))
        distracting = hard + [pool_hits[i] for i in extra]
        formats = [("relevant", relevant)] if relevant else []
        formats += [("distracting", distracting), ("none", [])]
        for fmt, docs in formats:
            messages = prompts.rag_messages(question, docs)  # no docs: the closed-book prompt
            rows.append({
                "id": qid,
                "question": question,
                "format": fmt,
                "docs": hits_to_json(docs),
                "n_docs": len(docs),
                "random_distractors": len(extra) if fmt == "distracting" else 0,
                "messages": prompts.dumps(messages),
                "target": golds[0],
            })
    columns = ["id", "question", "format", "docs", "n_docs", "random_distractors", "messages", "target"]
    return pd.DataFrame(rows, columns=columns)


def encode_example(
    tokenizer, prompt: str, answer_ids: list[int], max_length: int
) -> tuple[list[int], list[int], int]:
    """(input ids, labels, prompt tokens cut) of prompt + answer within `max_length`: the prompt loses tokens
    from its left so the answer (which ends with eos) always fits; labels are IGNORE on the prompt."""
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    answer_ids = answer_ids[: max_length - 1]  # keep one prompt token so a position precedes the answer
    cut = max(0, len(prompt_ids) + len(answer_ids) - max_length)
    prompt_ids = prompt_ids[cut:]
    return prompt_ids + answer_ids, [IGNORE] * len(prompt_ids) + answer_ids, cut


def tune_generator(
    examples: pd.DataFrame, generator: GeneratorConfig, config: TuneConfig, out_dir: str
) -> dict[str, Any]:
    """Causal-LM LoRA on `examples` (from `build_examples`) with Zero-RAG's objective, a weighted sum of three
    answer losses: retrieval-free (`none` rows), retrieval-augmented (`relevant`) and noise-suppression
    (`distracting`), weighted by config.weight_* (each example's loss is its answer tokens' mean NLL; a batch's
    loss is the weighted mean over its examples). Saves the adapter and `tune.json` (with each term's loss per
    step) to the local folder `out_dir`, loadable as `GeneratorConfig(lora_adapter=out_dir)`. Returns the
    training stats."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    missing = {"messages", "target"} - set(examples.columns)
    if missing:
        raise ValueError(f"tuning examples lack columns {sorted(missing)}; build them with build_examples")
    threads = training_threads(config)
    seed_torch(config.seed)
    source = hf_model_source(generator)
    tokenizer = AutoTokenizer.from_pretrained(source)
    if generator.chat_template and tokenizer.chat_template is None:
        raise ConfigError(
            f"generator.model {generator.model!r} has no chat template; set generator.chat_template=false "
            "to tune on completion prompts (base models)"
        )
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    model.config.use_cache = False  # no generation while training; the cache only costs memory
    model = with_lora(model, config, "CAUSAL_LM")

    encoded = []
    for messages_json, target in zip(examples["messages"], examples["target"], strict=True):
        messages = json.loads(messages_json)
        if generator.chat_template:
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            answer = str(target)
        else:
            # HFGenerator strips what a base model writes; a space separates the answer from the prompt.
            prompt, answer = messages_to_text(messages), " " + str(target)
        answer_ids = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        encoded.append(encode_example(tokenizer, prompt, answer_ids, config.max_length))

    formats = examples["format"] if "format" in examples else pd.Series("relevant", index=examples.index)
    weight_of = {"none": config.weight_retrieval_free, "relevant": config.weight_relevant,
                 "distracting": config.weight_noise}
    example_format = formats.tolist()
    term_losses: dict[str, list[float]] = {f: [] for f in FORMATS}  # per step, the mean loss of each term's rows

    def batch_loss(idx: list[int]) -> torch.Tensor:
        width = max(len(encoded[i][0]) for i in idx)
        input_ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
        labels = torch.full((len(idx), width), IGNORE, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for row, i in enumerate(idx):
            ids, labs, _ = encoded[i]
            input_ids[row, : len(ids)] = torch.tensor(ids)
            labels[row, : len(labs)] = torch.tensor(labs)
            mask[row, : len(ids)] = 1
        logits = model(input_ids=input_ids, attention_mask=mask).logits[:, :-1].float()
        target = labels[:, 1:]
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), target, ignore_index=IGNORE, reduction="none")
        per_example = nll.sum(1) / (target != IGNORE).sum(1).clamp(min=1)
        fmts = [example_format[i] for i in idx]
        for f in FORMATS:
            rows = [r for r, g in enumerate(fmts) if g == f]
            term_losses[f].append(float(per_example[rows].mean().detach()) if rows else float("nan"))
        weights = torch.tensor([weight_of[f] for f in fmts], dtype=per_example.dtype)
        return (weights * per_example).sum() / weights.sum().clamp(min=1e-12)

    losses, seconds = train(model, len(encoded), batch_loss, config)
    docs = examples["n_docs"] if "n_docs" in examples else pd.Series(config.docs_per_format, index=examples.index)
    stats = {
        "generator": generator.model,
        "source": source,
        "chat_template": generator.chat_template,
        "examples": len(encoded),
        "formats": {f: int((formats == f).sum()) for f in FORMATS},
        "questions_without_relevant": int(examples.groupby("id")["format"].apply(lambda f: "relevant" not in set(f)).sum())
        if "id" in examples else 0,
        "random_distractors": int(examples["random_distractors"].sum()) if "random_distractors" in examples else 0,
        "distracting_short": int(((formats == "distracting") & (docs < config.docs_per_format)).sum()),
        "term_losses": {f: _term_summary(v) for f, v in term_losses.items()},
        "truncated_prompts": sum(cut > 0 for *_, cut in encoded),
        "threads": threads,
        **loss_stats(losses, seconds, min(config.batch_size, len(encoded))),
        "config": config.model_dump(mode="json"),
    }
    save_adapter(model, out_dir, STATS_FILE, stats)
    return stats


def _term_summary(per_step: list[float]) -> dict[str, Any]:
    """One term's loss: per step (NaN where a batch held none of its rows), and the mean of its first and last
    quarter of steps with rows (at most 5 each)."""
    seen = [v for v in per_step if not np.isnan(v)]
    window = max(1, min(5, len(seen) // 4))
    return {"per_step": [None if np.isnan(v) else round(v, 5) for v in per_step],
            "first": round(float(np.mean(seen[:window])), 5) if seen else None,
            "last": round(float(np.mean(seen[-window:])), 5) if seen else None}
