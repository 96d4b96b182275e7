"""The transformers backend: chat template, left padding, length-bucketed batches sized to the memory budget,
greedy decoding."""

from __future__ import annotations

from wbrag_ray.config import ConfigError, GeneratorConfig
from wbrag_ray.generation.hf_loading import load_hf_causal_lm, memory_budget, row_bytes
from wbrag_ray.generation.types import (
    Generator,
    Prompt,
    Scored,
    choice_matches,
    continues_answer,
    cut_at_stop,
    messages_to_text,
)


class HFGenerator(Generator):
    """transformers backend: chat template, left padding, length-bucketed batches, greedy decoding."""

    def setup(self) -> None:
        from wbrag_ray.models.hardware import pick_device, pick_dtype

        self.device = pick_device(self.config.num_gpus)
        self.dtype = pick_dtype(self.config.dtype, self.device)
        self.model, self.tokenizer = load_hf_causal_lm(self.config, self.dtype, self.device)
        self._stop_id_cache: dict[tuple[str, ...], list[int]] = {}
        self.stop_token_ids = self._stop_token_ids()
        self.memory_budget = memory_budget(self.config, self.device)
        self._choice_id_cache: dict[tuple[str, ...], list[list[int]]] = {}
        if self.config.chat_template and self.tokenizer.chat_template is None:
            raise ConfigError(
                f"generator.model {self.config.model!r} has no chat template; set generator.chat_template=false "
                "to use completion prompts (base models)"
            )

    def _stop_token_ids(self) -> list[int]:
        """End-of-sequence ids plus every vocabulary token whose text holds a stop string: a row ends at its
        first such token. (transformers' `stop_strings` matches text as it decodes and measured 40% slower
        here; a token-id check is free. cut_at_stop trims what such a token carried past the stop string.)
        Cached per stop list: a generator service's passes switch between a few of them."""
        stop = tuple(self.config.stop)
        if stop not in self._stop_id_cache:
            eos = self.model.generation_config.eos_token_id
            ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [self.tokenizer.eos_token_id])
            for token, i in self.tokenizer.get_vocab().items() if stop else ():
                text = self.tokenizer.convert_tokens_to_string([token])
                if any(s in text for s in stop):
                    ids.add(i)
            self._stop_id_cache[stop] = sorted(ids)
        return self._stop_id_cache[stop]

    def with_config(self, config: GeneratorConfig) -> Generator:
        other = super().with_config(config)
        other.stop_token_ids = other._stop_token_ids()  # the cache is shared with this generator
        return other

    def render(self, prompts: list[Prompt]) -> list[str]:
        if not self.config.chat_template:
            return [messages_to_text(p) for p in prompts]
        # A final assistant message is continued, not closed and followed by a new turn.
        return [
            self.tokenizer.apply_chat_template(
                p, tokenize=False, add_generation_prompt=not continues_answer(p), continue_final_message=continues_answer(p)
            )
            for p in prompts
        ]

    def _batches(self, texts: list[str], new_tokens: int = 1, with_probs: bool = False):
        """Batches of `texts` indices sorted by token length, so each batch pads little; with their encodings.
        A batch takes up to generator.batch_size rows, and fewer once its longest row times its size would
        pass the memory budget (long prompts come in smaller batches, short ones fill the batch)."""
        lengths = [len(self.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
        order = sorted(range(len(texts)), key=lengths.__getitem__)
        start = 0
        while start < len(order):
            end = start + 1  # one row always goes, whatever its size
            while (end < len(order) and end - start < self.config.batch_size
                   and (end + 1 - start) * row_bytes(self.model, lengths[order[end]], new_tokens, with_probs)
                   <= self.memory_budget):
                end += 1
            idx = order[start:end]
            start = end
            enc = self.tokenizer(
                [texts[i] for i in idx], return_tensors="pt", padding=True, add_special_tokens=False
            ).to(self.device)
            yield idx, enc

    def generate(self, prompts: list[Prompt], max_new_tokens: int | None = None) -> list[str]:
        return [s.text for s in self._decode(prompts, max_new_tokens, with_probs=False)]

    def generate_scored(self, prompts: list[Prompt], max_new_tokens: int | None = None) -> list[Scored]:
        return self._decode(prompts, max_new_tokens, with_probs=True)

    def _decode(self, prompts: list[Prompt], max_new_tokens: int | None, with_probs: bool) -> list[Scored]:
        import torch

        if not prompts:
            return []
        texts = self.render(prompts)
        max_new = max_new_tokens or self.config.max_new_tokens
        stop_ids = set(self.stop_token_ids)
        out: list[Scored] = [None] * len(texts)  # type: ignore[list-item]
        for idx, enc in self._batches(texts, max_new, with_probs):
            with torch.inference_mode():
                gen = self.model.generate(
                    **enc,
                    max_new_tokens=max_new,
                    do_sample=False,
                    pad_token_id=self.tokenizer.pad_token_id,
                    eos_token_id=self.stop_token_ids,
                    output_scores=with_probs,
                    return_dict_in_generate=True,
                )
                # log-softmax of the (greedy) step logits at the chosen token: that token's probability
                probs = (
                    self.model.compute_transition_scores(gen.sequences, gen.scores, normalize_logits=True).float().exp()
                    if with_probs else None
                )
            new_tokens = gen.sequences[:, enc["input_ids"].shape[1] :]
            for row, i in enumerate(idx):
                ids = new_tokens[row].tolist()
                end = next((j for j, t in enumerate(ids) if t in stop_ids), None)
                body = ids[:end]
                out[i] = Scored(
                    text=cut_at_stop(self.tokenizer.decode(ids, skip_special_tokens=True), self.config.stop),
                    tokens=[self.tokenizer.decode([t]) for t in body] if with_probs else [],
                    probs=probs[row, : len(body)].tolist() if with_probs else [],
                    finished=end is not None,
                )
        return out

    def _choice_ids(self, choices: tuple[str, ...]) -> list[list[int]]:
        """Vocabulary ids spelling each choice word (any case, with or without a leading space)."""
        cache = self._choice_id_cache
        if choices not in cache:
            vocab = [(i, self.tokenizer.convert_tokens_to_string([t])) for t, i in self.tokenizer.get_vocab().items()]
            cache[choices] = [[i for i, text in vocab if choice_matches(text, c)] for c in choices]
            missing = [c for c, ids in zip(choices, cache[choices], strict=True) if not ids]
            if missing:
                raise ConfigError(f"generator {self.config.model!r} has no single token for {missing}")
        return cache[choices]

    def choice_probs(self, prompts: list[Prompt], choices: tuple[str, ...]) -> list[list[float]]:
        import torch

        if not prompts:
            return []
        ids = self._choice_ids(tuple(choices))
        out: list[list[float]] = [[]] * len(prompts)
        for idx, enc in self._batches(self.render(prompts)):
            # Left padding: positions count from each row's first real token, as generate() does.
            positions = (enc["attention_mask"].cumsum(-1) - 1).clamp(min=0)
            with torch.inference_mode():
                # One forward pass, logits at the last position only (not sequence x vocabulary).
                logits = self.model(**enc, position_ids=positions, logits_to_keep=1).logits[:, -1, :]
            probs = torch.softmax(logits.float(), dim=-1)
            for row, i in enumerate(idx):
                out[i] = [float(probs[row, c].sum()) for c in ids]
        return out
