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
from wbrag_ray.index.retriever import Hit, hits_from_json, hits_to_json
from wbrag_ray.layout import ADAPTER_STATS as STATS_FILE
from wbrag_ray.metrics import normalize_answer
from wbrag_ray.training.lora import loss_stats, save_adapter, seed_torch, train, training_threads, with_lora

log = logging.getLogger(__name__)

FORMATS = ("relevant", "distracting", "none")
IGNORE = -100  # label of positions the loss skips (prompt and padding)


def _doc_text(hit: Hit) -> str:
    # The title is part of what the prompt shows, so an answer in the title counts as contained.
    return normalize_answer(f"{hit.title} {hit.text}")


def _pick_distracting(rng: np.random.Generator, pool: list[str], own: set[int], golds: list[str], k: int) -> list[int]:
    """k pool positions outside `own` whose text holds no gold answer. Random draws first (cheap at any pool
    size); a full shuffled scan only when they fall short, which happens on small or answer-dense pools."""

    def ok(i: int) -> bool:
        return i not in own and not any(g in pool[i] for g in golds)

    if not pool:
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
    """Three training rows per question (`id`, `question`, `golden_answers`, `docs`: JSON hits in rank order):

    - relevant: up to `docs_per_format` retrieved docs that contain a gold answer (normalized substring);
      when none does, the top-ranked docs (`fallback` true);
    - distracting: `docs_per_format` docs retrieved for other questions that contain no gold answer
      (seeded draw; fewer only when the pool has too few);
    - none: no docs (the closed-book prompt).

    Columns: id, question, format, docs (JSON hits), n_docs, fallback, messages (JSON chat), target (the first
    gold answer). Questions without a gold answer have no target and are dropped, with a warning.
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
        relevant = [h for h, i in zip(hits, own, strict=True) if any(g in pool[i] for g in norm_golds)]
        fallback = not relevant
        relevant = (relevant or hits)[:docs_per_format]
        distracting = [pool_hits[i] for i in _pick_distracting(rng, pool, set(own), norm_golds, docs_per_format)]
        for fmt, docs in zip(FORMATS, (relevant, distracting, []), strict=True):
            messages = prompts.rag_messages(question, docs)  # no docs: the closed-book prompt
            rows.append({
                "id": qid,
                "question": question,
                "format": fmt,
                "docs": hits_to_json(docs),
                "n_docs": len(docs),
                "fallback": fallback and fmt == "relevant",
                "messages": prompts.dumps(messages),
                "target": golds[0],
            })
    columns = ["id", "question", "format", "docs", "n_docs", "fallback", "messages", "target"]
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
    """Causal-LM LoRA on `examples` (from `build_examples`): loss on the answer tokens only. Saves the adapter
    and `tune.json` to the local folder `out_dir`, loadable as `GeneratorConfig(lora_adapter=out_dir)`.
    Returns the training stats."""
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
        return model(input_ids=input_ids, attention_mask=mask, labels=labels).loss

    losses, seconds = train(model, len(encoded), batch_loss, config)
    formats = examples["format"] if "format" in examples else pd.Series(dtype=str)
    docs = examples["n_docs"] if "n_docs" in examples else pd.Series(config.docs_per_format, index=examples.index)
    stats = {
        "generator": generator.model,
        "source": source,
        "chat_template": generator.chat_template,
        "examples": len(encoded),
        "formats": {f: int((formats == f).sum()) for f in FORMATS},
        "relevant_fallback": int(examples["fallback"].sum()) if "fallback" in examples else 0,
        "distracting_short": int(((formats == "distracting") & (docs < config.docs_per_format)).sum()),
        "truncated_prompts": sum(cut > 0 for *_, cut in encoded),
        "threads": threads,
        **loss_stats(losses, seconds, min(config.batch_size, len(encoded))),
        "config": config.model_dump(mode="json"),
    }
    save_adapter(model, out_dir, STATS_FILE, stats)
    return stats
