"""Zero-RAG's noise-tolerant tuning: LoRA on each training question in three formats (relevant documents,
distractors, none), with evaluation's prompts; the adapter goes where `GeneratorConfig.lora_adapter` points."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from wbrag_ray import prompts
from wbrag_ray.config import ConfigError, GeneratorConfig, TuneConfig
from wbrag_ray.generation.hf_loading import hf_model_source
from wbrag_ray.generation.types import messages_to_text
from wbrag_ray.layout import ADAPTER_STATS as STATS_FILE
from wbrag_ray.metrics import normalize_answer, substring_match
from wbrag_ray.retrieval.hits import Hit, hits_from_json, hits_to_json
from wbrag_ray.training.lora import with_lora
from wbrag_ray.training.placement import Placement
from wbrag_ray.training.workers import GROUP, WEIGHT, Training, first_last, fit, loss_stats

log = logging.getLogger(__name__)

FORMATS = ("relevant", "distracting", "none")
IGNORE = -100  # label of positions the loss skips (prompt and padding)


def _pick_random(rng: np.random.Generator, pool: list[str], excluded: set[int], golds: list[str], k: int) -> list[int]:
    """Up to k pool positions outside `excluded` whose text holds no gold answer (random draws, then a scan)."""
    if not pool or k <= 0:
        return []
    picked: list[int] = []
    for candidates in (rng.integers(len(pool), size=8 * k), rng.permutation(len(pool))):
        for i in candidates.tolist():
            if len(picked) == k:
                return picked
            if i not in picked and i not in excluded and not any(g in pool[i] for g in golds):
                picked.append(i)
    return picked


def _relevant_context(hits: list[Hit], holds: list[bool], k: int) -> list[Hit]:
    """The top `k` of `hits` when one holds the answer; else the top k-1 plus the best-ranked that does; else []."""
    if not any(holds):
        return []
    top = hits[:k]
    if any(holds[:k]):
        return top
    return top[: k - 1] + [hits[holds.index(True)]]


def build_examples(questions: pd.DataFrame, docs_per_format: int, seed: int) -> pd.DataFrame:
    """Training rows per question, one per term of the objective, both document formats holding `docs_per_format`:
    relevant (the top K, the K-th replaced by a deeper answer-bearing doc where none holds a gold answer; no row where
    none retrieved does), distracting (K retrieved docs without one, topped up from other questions), none (closed-book).
    Questions without a gold answer are dropped, with a warning."""
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
    pool = [normalize_answer(f"{h.title} {h.text}") for h in pool_hits]  # the prompt shows the title too

    rng = np.random.default_rng(seed)
    rows: list[dict[str, Any]] = []
    for qid, question, golds, hits in parsed:
        norm_golds = [g for g in map(normalize_answer, golds) if g]
        own = [position[h.key] for h in hits]
        holds = [any(g in pool[i] for g in norm_golds) for i in own]
        relevant = _relevant_context(hits, holds, docs_per_format)
        hard = [h for h, yes in zip(hits, holds, strict=True) if not yes][:docs_per_format]
        extra = _pick_random(rng, pool, set(own), norm_golds, docs_per_format - len(hard))
        distracting = hard + [pool_hits[i] for i in extra]
        if relevant:  # fewer retrieved than K (a tiny index): drawn distractors fill up, as for the distracting row
            relevant += [pool_hits[i] for i in _pick_random(rng, pool, set(own), norm_golds,
                                                            docs_per_format - len(relevant))]
        formats = [("relevant", relevant)] if relevant else []
        formats += [("distracting", distracting), ("none", [])]
        for fmt, docs in formats:
            messages = prompts.rag_messages(question, docs)  # no docs: the closed-book prompt
            rows.append({"id": qid, "question": question, "format": fmt, "docs": hits_to_json(docs),
                         "n_docs": len(docs), "random_distractors": len(extra) if fmt == "distracting" else 0,
                         "messages": prompts.dumps(messages), "target": golds[0]})
    columns = ["id", "question", "format", "docs", "n_docs", "random_distractors", "messages", "target"]
    return pd.DataFrame(rows, columns=columns)


def own_targets(examples: pd.DataFrame, answers: list[str], golds: dict[str, list[str]]) -> pd.DataFrame:
    """`examples` retargeted to the generator's own answers (tune.targets: own): relevant and none rows keep their
    answer where it holds a gold answer, distracting rows take the closed-book answer where it does; others are
    dropped. Small models answer in a sentence and pick a worse span when trained to the gold's short form."""
    if len(answers) != len(examples):
        raise ValueError(f"{len(answers)} answers for {len(examples)} tuning rows")
    df = examples.reset_index(drop=True).assign(own=[str(a).strip() for a in answers])
    df["holds"] = [bool(a) and substring_match(a, golds.get(i, [])) > 0 for a, i in zip(df["own"], df["id"], strict=True)]
    closed = df[df["format"] == "none"].set_index("id")
    distracting = df["format"] == "distracting"
    df.loc[distracting, "own"] = df.loc[distracting, "id"].map(closed["own"]).fillna("")
    df.loc[distracting, "holds"] = df.loc[distracting, "id"].map(closed["holds"]).fillna(False).astype(bool)
    kept = df[df["holds"]].assign(target=lambda d: d["own"])
    return kept.drop(columns=["own", "holds"]).reset_index(drop=True)


def encode_example(
    tokenizer, prompt: str, answer_ids: list[int], max_length: int
) -> tuple[list[int], list[int], int]:
    """(input ids, labels, prompt tokens cut): the prompt loses tokens on its left so the answer always fits."""
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    answer_ids = answer_ids[: max_length - 1]  # keep one prompt token so a position precedes the answer
    cut = max(0, len(prompt_ids) + len(answer_ids) - max_length)
    prompt_ids = prompt_ids[cut:]
    return prompt_ids + answer_ids, [IGNORE] * len(prompt_ids) + answer_ids, cut


@dataclass
class TuneTraining(Training):
    """Noise-tolerant tuning on examples of `messages` and `target`, each row's term its GROUP and WEIGHT:
    per-example answer NLL weighted by its term; logs each term's loss. `counts`: the examples' figures."""

    generator: GeneratorConfig
    config: TuneConfig
    counts: dict[str, Any]
    group_names = FORMATS
    stats_file = STATS_FILE

    @property
    def model(self) -> str:
        return self.generator.model

    def build(self, place: Placement):
        import torch
        from torch.nn.utils.rnn import pad_sequence
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.source = hf_model_source(self.generator)
        tokenizer = AutoTokenizer.from_pretrained(self.source)
        if self.generator.chat_template and tokenizer.chat_template is None:
            raise ConfigError(
                f"generator.model {self.generator.model!r} has no chat template; set generator.chat_template=false "
                "to tune on completion prompts (base models)"
            )
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        model = place.load(AutoModelForCausalLM, self.source)
        model.config.use_cache = False  # no generation while training; the cache only costs memory
        model = place.place(with_lora(model, self.config, "CAUSAL_LM"))
        device = place.inputs_device(model)
        encoded = [encode_example(tokenizer, *self._prompt_answer(tokenizer, json.loads(m), t), self.config.max_length)
                   for m, t in zip(self.examples["messages"], self.examples["target"], strict=True)]
        self.truncated_prompts = sum(cut > 0 for *_, cut in encoded)

        def per_example_loss(module, idx: list[int]):
            def padded(rows: list[list[int]], value: int):
                return pad_sequence([torch.tensor(r) for r in rows], batch_first=True, padding_value=value)

            input_ids = padded([encoded[i][0] for i in idx], pad_id)
            labels = padded([encoded[i][1] for i in idx], IGNORE)
            mask = padded([[1] * len(encoded[i][0]) for i in idx], 0)
            logits = module(input_ids=input_ids.to(device), attention_mask=mask.to(device)).logits[:, :-1].float()
            target = labels[:, 1:].to(logits.device)
            nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), target, ignore_index=IGNORE,
                                                    reduction="none")
            return nll.sum(1) / (target != IGNORE).sum(1).clamp(min=1)

        return model, per_example_loss

    def _prompt_answer(self, tokenizer, messages: list[dict], target: str) -> tuple[str, list[int]]:
        """The prompt exactly as `HFGenerator` renders it, and the answer's ids ending with eos."""
        if self.generator.chat_template:
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            answer = str(target)
        else:
            # HFGenerator strips what a base model writes; a space separates the answer from the prompt.
            prompt, answer = messages_to_text(messages), " " + str(target)
        return prompt, tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]

    def finish(self, model, place: Placement) -> dict[str, Any]:
        return {"source": self.source, "truncated_prompts": self.truncated_prompts}

    def summary(self, result: dict[str, Any]) -> dict[str, Any]:
        per_term = list(zip(*result["group_loss"], strict=True)) if result["group_loss"] else [[]] * len(FORMATS)
        return {"generator": self.generator.model, "source": result["source"],
                "chat_template": self.generator.chat_template, **self.counts,
                "term_losses": {f: _term_summary(list(v)) for f, v in zip(FORMATS, per_term, strict=True)},
                "truncated_prompts": result["truncated_prompts"], **loss_stats(result),
                "config": self.config.model_dump(mode="json")}


def tune_generator(
    examples: pd.DataFrame, generator: GeneratorConfig, config: TuneConfig, out_dir: str
) -> dict[str, Any]:
    """Causal-LM LoRA on `examples` with Zero-RAG's objective (weighted retrieval-free, retrieval-augmented and
    noise-suppression losses) on Ray Train workers; saves the adapter and `tune.json` to `out_dir`; returns stats."""
    formats, docs = examples["format"], examples["n_docs"]
    k = config.docs_per_format or (int(docs.max()) if len(docs) else 0)  # None: the K build_examples was given
    counts = {"examples": len(examples), "formats": {f: int((formats == f).sum()) for f in FORMATS},
              "questions_without_relevant": int(examples.groupby("id")["format"]
                                                .apply(lambda f: "relevant" not in set(f)).sum()),
              "random_distractors": int(examples["random_distractors"].sum()),
              "distracting_short": int(((formats == "distracting") & (docs < k)).sum())}
    weight_of = {"none": config.weight_retrieval_free, "relevant": config.weight_relevant,
                 "distracting": config.weight_noise}
    rows = pd.DataFrame({"messages": examples["messages"], "target": examples["target"].astype(str),
                         WEIGHT: formats.map(weight_of), GROUP: formats.map(FORMATS.index)})
    return fit(TuneTraining(rows, generator, config, counts), config, out_dir, "tune", "zerorag.tune")


def _term_summary(per_step: list[float]) -> dict[str, Any]:
    """One term's loss per step (NaN where a batch held none), and the means of its first and last quarters."""
    first, last = first_last(per_step)
    return {"per_step": [None if np.isnan(v) else round(v, 5) for v in per_step],
            "first": None if first is None else round(first, 5), "last": None if last is None else round(last, 5)}
