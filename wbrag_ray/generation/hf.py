"""The transformers backend: chat template, left padding, length-bucketed batches sized to the memory budget,
greedy decoding, and RePlug's probability mixture (a decoding loop of its own over each group's prompts)."""

from __future__ import annotations

from wbrag_ray.config import ConfigError
from wbrag_ray.generation.hf_loading import load_hf_causal_lm, memory_budget, row_bytes
from wbrag_ray.generation.types import (
    Generator,
    Prompt,
    Scored,
    choice_matches,
    context_refusal,
    continues_answer,
    cut_at_stop,
    messages_to_text,
    mixture_weights,
)
from wbrag_ray.models.hardware import pick_device, pick_dtype

# generator.batch_invariant: prompts are left-padded to a multiple of this many tokens, a batch holds one bucket
PAD_BUCKET = 64


class HFGenerator(Generator):
    """transformers backend: chat template, left padding, length-bucketed batches, greedy decoding."""

    supports_mixture = True  # its own decoding loop sees every row's full distribution at every step

    def setup(self) -> None:
        self.device = pick_device(self.config.num_gpus)
        self.dtype = pick_dtype(self.config.dtype, self.device)
        self.model, self.tokenizer = load_hf_causal_lm(self.config, self.dtype, self.device)
        self._stop_id_cache: dict[tuple[str, ...], list[int]] = {}  # shared by `with_config`'s copies
        self.memory_budget = memory_budget(self.config, self.device)
        self._choice_id_cache: dict[tuple[str, ...], list[list[int]]] = {}
        if self.config.chat_template and self.tokenizer.chat_template is None:
            raise ConfigError(
                f"generator.model {self.config.model!r} has no chat template; set generator.chat_template=false "
                "to use completion prompts (base models)"
            )

    @property
    def stop_token_ids(self) -> list[int]:
        """End-of-sequence ids plus every token whose text holds a stop string (faster than transformers'
        `stop_strings`; cut_at_stop trims the rest), cached per stop list."""
        stop = tuple(self.config.stop)
        if stop not in self._stop_id_cache:
            eos = self.model.generation_config.eos_token_id
            ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [self.tokenizer.eos_token_id])
            for token, i in self.tokenizer.get_vocab().items() if stop else ():
                if any(s in self.tokenizer.convert_tokens_to_string([token]) for s in stop):
                    ids.add(i)
            self._stop_id_cache[stop] = sorted(ids)
        return self._stop_id_cache[stop]

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

    def _packs(self, units: list[list[str]], new_tokens: int, with_probs: bool = False, extra_row_bytes: int = 0):
        """Indices of `units` (texts that share a batch: a prompt, or a mixture group's) to run together, sorted by
        length: up to generator.batch_size rows within the memory budget (one unit always goes); with
        generator.batch_invariant one length bucket only, so a prompt decodes the same whatever is beside it."""
        lengths = [max(len(self.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in u) for u in units]
        context = getattr(self.model.config, "max_position_embeddings", None)
        if context and max(lengths, default=0) + new_tokens > context:
            raise context_refusal(self.config, max(lengths), new_tokens, context)
        order = sorted(range(len(units)), key=lengths.__getitem__)
        bucket = self._bucket
        start = 0
        while start < len(order):
            end, rows = start + 1, len(units[order[start]])
            while end < len(order):
                if bucket and -(-lengths[order[end]] // bucket) != -(-lengths[order[start]] // bucket):
                    break
                grown = rows + len(units[order[end]])
                per_row = row_bytes(self.model, lengths[order[end]], new_tokens, with_probs) + extra_row_bytes
                if grown > self.config.batch_size or grown * per_row > self.memory_budget:
                    break
                end, rows = end + 1, grown
            yield order[start:end]
            start = end

    @property
    def _bucket(self) -> int | None:
        return PAD_BUCKET if self.config.batch_invariance() else None

    def _encode(self, texts: list[str]):
        # every row of a pack shares a bucket: padded to its edge, a row is the same whatever else is in the pack
        return self.tokenizer(texts, return_tensors="pt", padding=True, pad_to_multiple_of=self._bucket,
                              add_special_tokens=False).to(self.device)

    def _batches(self, texts: list[str], new_tokens: int = 1, with_probs: bool = False):
        """Batches of `texts` indices (see `_packs`), with their encodings."""
        for idx in self._packs([[t] for t in texts], new_tokens, with_probs):
            yield idx, self._encode([texts[i] for i in idx])

    def _scored(self, ids: list[int], probs: list[float] | None, stop_ids: set[int]) -> Scored:
        """A row's new token ids (and their probabilities) as an answer, its tokens ending before the first stop id."""
        end = next((j for j, t in enumerate(ids) if t in stop_ids), None)
        body = ids[:end]
        text = cut_at_stop(self.tokenizer.decode(ids[: len(body) + 1], skip_special_tokens=True), self.config.stop)
        if probs is None:
            return Scored(text, [], [], end is not None)
        return Scored(text, [self.tokenizer.decode([t]) for t in body], probs[: len(body)], end is not None)

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
                out[i] = self._scored(new_tokens[row].tolist(), probs[row].tolist() if with_probs else None, stop_ids)
        return out

    def generate_mixture(
        self, groups: list[list[Prompt]], weights: list[list[float]], max_new_tokens: int | None = None
    ) -> list[Scored]:
        """RePlug's ensemble decoding (`Generator.generate_mixture`): a group's K prompts decode in lockstep, each its
        own KV cache row, their fp32 distributions weighted and summed; groups share a batch as memory allows."""
        import torch

        weights = mixture_weights(groups, weights)
        if not groups:
            return []
        texts = [self.render(g) for g in groups]
        max_new = max_new_tokens or self.config.max_new_tokens
        stop_ids = set(self.stop_token_ids)
        # beyond a generate call's row: the weighted copy of each row's fp32 distribution
        extra = self.model.config.vocab_size * 4
        out: list[Scored] = [None] * len(groups)  # type: ignore[list-item]
        for idx in self._packs(texts, max_new, extra_row_bytes=extra):
            enc = self._encode([t for g in idx for t in texts[g]])
            group_of = torch.tensor([b for b, g in enumerate(idx) for _ in texts[g]], device=self.device)
            row_weight = torch.tensor([w for g in idx for w in weights[g]], dtype=torch.float32, device=self.device)
            tokens, probs = self._mixture_steps(enc, group_of, row_weight, len(idx), max_new, stop_ids)
            for b, g in enumerate(idx):
                out[g] = self._scored(tokens[:, b].tolist(), probs[:, b].tolist(), stop_ids)
        return out

    def _mixture_steps(self, enc, group_of, row_weight, n_groups: int, max_new: int, stop_ids: set[int]):
        """(tokens, probabilities), each steps x groups: greedy decoding of each group's mixture, as generate() does
        it (positions from each row's first real token; an ended group decodes on until all have ended)."""
        import torch

        mask = enc["attention_mask"]
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        inputs, cache = enc["input_ids"], None
        stop = torch.tensor(sorted(stop_ids), device=self.device)
        ended = torch.zeros(n_groups, dtype=torch.bool, device=self.device)
        tokens, probs = [], []
        with torch.inference_mode():
            for _ in range(max_new):
                step = self.model(input_ids=inputs, attention_mask=mask, position_ids=positions,
                                  cache=cache, use_cache=True, logits_to_keep=1)
                cache = step.cache
                p = torch.softmax(step.logits[:, -1, :].float(), dim=-1)
                mixed = torch.zeros(n_groups, p.shape[-1], dtype=torch.float32, device=p.device)
                mixed.index_add_(0, group_of, p * row_weight[:, None])
                token = mixed.argmax(-1)
                tokens.append(token)
                probs.append(mixed.gather(1, token[:, None])[:, 0])
                ended |= torch.isin(token, stop)
                if bool(ended.all()):
                    break
                inputs = token[group_of][:, None]
                mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=-1)
                positions = positions[:, -1:] + 1
        return torch.stack(tokens).cpu(), torch.stack(probs).cpu()

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
