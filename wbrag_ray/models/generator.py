"""The generator: one interface, three backends (hf, vllm, openai), chosen by `generator.backend`.

A prompt is a list of chat messages ({"role", "content"}). Instruct models get their chat template; base
models (`chat_template: false`) get the messages' contents joined as a completion prompt.

A prompt whose last message is the assistant's is continued (its content is the start of the answer):
FLARE regenerates the next sentence of an answer already begun.

Every backend offers, for in-process use:
- `generate(prompts) -> answers` (greedy, cut at the stop strings);
- `generate_scored(prompts) -> [Scored]`: the answers with each generated token's probability (FLARE);
- `choice_probs(prompts, choices)`: the probability of each choice word as the first token of the answer
  (Self-RAG-style judgements: p("yes") and p("no") from one forward pass, no decoding);
Over a Ray Dataset, `stages.generate.generate_pass` runs any of the three: the hf and openai backends through
`GenerateStage` (a pool, or a command's generator service), vllm through `ray.data.llm.build_processor`.

Not split yet (over 500 lines): shared types, logprob parsing, the GGUF cache and three backends; the split is
planned with the house (issue 14), so this change keeps the module whole.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import shutil
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from wbrag_ray.config import ConfigError, GeneratorConfig
from wbrag_ray.models.bundled import resolve_model

log = logging.getLogger(__name__)

Prompt = list[dict[str, str]]
MODES = ("text", "scored", "choice")


def check_mode(mode: str, choices: tuple[str, ...]) -> None:
    """A clear error for a pass no backend can run, before any actor starts."""
    if mode not in MODES:
        raise ValueError(f"unknown generation mode {mode!r}; choose one of {', '.join(MODES)}")
    if mode == "choice" and not choices:
        raise ValueError("a choice pass needs the choice words")


@dataclass
class Scored:
    """One greedy answer with the probability the model gave each of its tokens."""

    text: str  # the answer, cut at the stop strings
    tokens: list[str]  # the generated tokens before the end / stop token, as text
    probs: list[float]  # each token's probability when it was chosen
    finished: bool  # the model ended the answer itself (end or stop token), not the token budget


def continues_answer(prompt: Prompt) -> bool:
    """A prompt ending with the assistant's message asks for that message's continuation."""
    return bool(prompt) and prompt[-1].get("role") == "assistant"


def choice_matches(token_text: str, choice: str) -> bool:
    """A vocabulary token counts as a choice word in any case and with any surrounding space ("Yes", " yes")."""
    return token_text.strip().lower() == choice.strip().lower()


def choice_mass(top: list[tuple[str, float]], choices: tuple[str, ...]) -> list[float]:
    """Probability of each choice from a first-token distribution given as (token text, probability) pairs
    (a backend's top-k): the tokens spelling the same word add up."""
    return [sum(p for t, p in top if choice_matches(t, c)) for c in choices]


def _logprob_entry(entry: Any) -> tuple[float, str] | None:
    """(logprob, token text) from a vLLM `Logprob` object or its dict form (Ray Data's output rows)."""
    if entry is None:
        return None
    if isinstance(entry, dict):
        return entry["logprob"], entry.get("decoded_token") or ""
    return entry.logprob, entry.decoded_token or ""


def _chosen(step: dict, token_id: int) -> tuple[float, str]:
    # Ray Data rows may carry the ids as strings, and (Arrow struct columns) other rows' ids with None values.
    found = _logprob_entry(step.get(token_id)) or _logprob_entry(step.get(str(token_id)))
    if found is None:
        raise ValueError(f"no logprob for the generated token {token_id}; ask the engine for logprobs >= 0")
    return found


def scored_from_pieces(pieces: list[tuple[str, float]], text: str, finished: bool, stop: list[str]) -> Scored:
    """A `Scored` answer from (token text, logprob) per generated token, as engines and APIs report them.

    The end-of-answer token is not part of the answer: tokens stop at the first one that decodes to nothing
    (a special token) or holds a stop string."""
    import math

    tokens, probs = [], []
    for piece, logprob in pieces:
        if not piece or any(s and s in piece for s in stop):
            break
        tokens.append(piece)
        probs.append(math.exp(logprob))
    return Scored(cut_at_stop(text, stop), tokens, probs, finished)


def scored_from_logprobs(
    token_ids: list[int], logprobs: list[dict], text: str, max_tokens: int, stop: list[str]
) -> Scored:
    """A `Scored` answer from vLLM's per-token logprobs (`{token id: Logprob}` per generated token);
    `finished` = the engine stopped before the token budget."""
    chosen = [_chosen(step, int(token_id)) for token_id, step in zip(token_ids, logprobs, strict=False)]
    return scored_from_pieces([(piece, lp) for lp, piece in chosen], text, len(token_ids) < max_tokens, stop)


def choices_from_logprobs(first_step: dict | None, choices: tuple[str, ...]) -> list[float]:
    """Choice probabilities from the top-k logprobs of an engine's first generated token."""
    import math

    pairs = [_logprob_entry(e) for e in (first_step or {}).values()]
    return choice_mass([(t, math.exp(lp)) for lp, t in filter(None, pairs)], choices)


def scored_columns(output_column: str, scored: Scored) -> dict[str, Any]:
    """The columns a `scored` pass adds to a row."""
    return {output_column: scored.text, f"{output_column}_tokens": scored.tokens,
            f"{output_column}_probs": scored.probs, f"{output_column}_finished": scored.finished}


# top-k logprobs asked of an engine for a choice judgement: the choice words are among the likeliest tokens
# whenever the model follows the instruction, and what it leaves out is reported as missing mass.
CHOICE_TOP_K = 20


def messages_to_text(messages: Prompt) -> str:
    """Completion-style prompt for base models: the contents in order, the last one open for the answer."""
    return "\n\n".join(m["content"] for m in messages)


def cut_at_stop(text: str, stop: list[str]) -> str:
    """The text before the first stop string (a backend may return the stop string and what its token held)."""
    text = text.strip()
    for s in stop:
        if s and s in text:
            text = text[: text.index(s)]
    return text.strip()


class Generator(ABC):
    """Batched greedy generation. `setup()` loads the model (once per worker); `generate` answers prompts."""

    def __init__(self, config: GeneratorConfig):
        self.config = config

    def setup(self) -> None:  # noqa: B027 - optional hook
        """Load weights; called once per worker, never at construction (the object travels to actors)."""

    def with_config(self, config: GeneratorConfig) -> Generator:
        """This set-up generator under another pass's settings (token budget, batch size, stop strings), the
        loaded model shared: what a generator service lends each pass."""
        other = copy.copy(self)
        other.config = config
        return other

    @abstractmethod
    def generate(self, prompts: list[Prompt], max_new_tokens: int | None = None) -> list[str]:
        """Greedy answers, one per prompt, in order."""

    @abstractmethod
    def generate_scored(self, prompts: list[Prompt], max_new_tokens: int | None = None) -> list[Scored]:
        """Greedy answers with their tokens' probabilities, one per prompt, in order."""

    @abstractmethod
    def choice_probs(self, prompts: list[Prompt], choices: tuple[str, ...]) -> list[list[float]]:
        """For each prompt, the probability of each choice word as the answer's first token (not normalized:
        what the choices leave to other tokens tells whether the model followed the instruction)."""



# --- hf: transformers -----------------------------------------------------------------------------------


def _gguf_cache_dir(config: GeneratorConfig, gguf_path: Path) -> Path:
    root = Path(config.cache_dir or os.environ.get("WBRAG_CACHE", "~/.cache/wbrag")).expanduser() / "converted"
    stat = gguf_path.stat()
    key = hashlib.sha1(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return root / f"{gguf_path.stem}-{key}"


def hf_model_source(config: GeneratorConfig) -> str:
    """What `from_pretrained` takes for `config.model`: a local folder or a hub id.

    A GGUF file is de-quantized by transformers on every load (about 17 s for SmolLM2-135M); the first call
    saves the converted fp32 weights to a cache folder, and later loads read that folder (well under 1 s).
    Every role that loads the generator's weights (answering, the LM pruner, LoRA tuning) goes through here.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = resolve_model(config.model)
    path = Path(source)
    if path.suffix != ".gguf":
        return source
    cached = _gguf_cache_dir(config, path)
    if not (cached / "config.json").exists():
        import torch

        log.info("converting GGUF %s (first load; cached at %s)", path, cached)
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        # transformers refuses to save a model that still carries its GGUF quantizer; the weights are
        # already de-quantized, so dropping the quantizer and its config makes it a plain model.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        try:
            tmp.rename(cached)  # atomic: concurrent workers race harmlessly
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(cached)


def load_hf_causal_lm(config: GeneratorConfig, dtype, device: str):
    """(model, tokenizer) from a local folder, a hub id, or a GGUF file (see `hf_model_source`), with the
    configured LoRA adapter merged in."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = hf_model_source(config)
    tok = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    if config.lora_adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, config.lora_adapter)
        model = model.merge_and_unload()  # merged weights decode as fast as the base model
    model.to(device).eval()
    tok.padding_side = "left"  # decoder-only batches must end at the same position
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model, tok


class HFGenerator(Generator):
    """transformers backend: chat template, left padding, length-bucketed batches, greedy decoding."""

    def setup(self) -> None:
        from wbrag_ray.models.hardware import pick_device, pick_dtype

        self.device = pick_device(self.config.num_gpus)
        self.dtype = pick_dtype(self.config.dtype, self.device)
        self.model, self.tokenizer = load_hf_causal_lm(self.config, self.dtype, self.device)
        self._stop_id_cache: dict[tuple[str, ...], list[int]] = {}
        self.stop_token_ids = self._stop_token_ids()
        self.memory_budget = self._memory_budget()
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

    def _memory_budget(self) -> int:
        """Bytes one generate call may use beyond the weights: generator.memory_gb, else 90% of the GPU memory
        left after loading, else half of the node's available memory (the rest is for other actors)."""
        if self.config.memory_gb:
            return int(self.config.memory_gb * 2**30)
        if self.device.startswith("cuda"):
            import torch

            return int(torch.cuda.mem_get_info()[0] * 0.9)
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * 0.5)

    def row_bytes(self, tokens: int, new_tokens: int, with_probs: bool) -> int:
        """Estimated memory of one row of a generate call: its KV cache over prompt + new tokens, the prefill's
        activations (hidden state and MLP), and the next-token logits (kept for every step when scoring)."""
        c = self.model.config
        size = self.model.dtype.itemsize
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        kv = 2 * c.num_hidden_layers * kv_heads * head_dim * size
        activations = 2 * (c.hidden_size + getattr(c, "intermediate_size", 4 * c.hidden_size)) * size
        logits = c.vocab_size * 4 * (new_tokens if with_probs else 2)
        return (tokens + new_tokens) * kv + tokens * activations + logits

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
                   and (end + 1 - start) * self.row_bytes(lengths[order[end]], new_tokens, with_probs)
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


# --- vllm -----------------------------------------------------------------------------------------------

# Throughput defaults: prefix caching (every RAG prompt starts with the same instruction), chunked prefill
# (long retrieved contexts don't stall decoding), and a batch token budget large enough to keep the GPU busy.
VLLM_THROUGHPUT_DEFAULTS: dict[str, Any] = {
    "enable_prefix_caching": True,
    "enable_chunked_prefill": True,
    "max_num_batched_tokens": 8192,
    "max_model_len": 4096,
    "gpu_memory_utilization": 0.85,
}


class VLLMGenerator(Generator):
    """vLLM backend through Ray Data LLM (`build_processor` + `vLLMEngineProcessorConfig`)."""

    def engine_kwargs(self) -> dict[str, Any]:
        kwargs = dict(VLLM_THROUGHPUT_DEFAULTS)
        if self.config.lora_adapter:
            kwargs.update(enable_lora=True, max_lora_rank=64, max_loras=1)
        kwargs.update(self.config.vllm_engine_kwargs)
        return kwargs

    def processor_config(self):
        from ray.data.llm import vLLMEngineProcessorConfig

        model = resolve_model(self.config.model)
        return vLLMEngineProcessorConfig(
            model_source=model,
            engine_kwargs=self.engine_kwargs(),
            concurrency=self.config.concurrency,
            batch_size=self.config.batch_size,
            chat_template_stage=self.config.chat_template,
            tokenize_stage=True,
            detokenize_stage=True,
            dynamic_lora_loading_path=str(Path(self.config.lora_adapter).parent) if self.config.lora_adapter else None,
        )

    def sampling_params(self, mode: str, max_tokens: int | None = None) -> dict[str, Any]:
        """Greedy sampling parameters of one pass: `scored` asks for the chosen tokens' logprobs, `choice` for
        the first token's top-k."""
        params: dict[str, Any] = {"temperature": 0.0, "max_tokens": max_tokens or self.config.max_new_tokens}
        if self.config.stop:
            params["stop"] = list(self.config.stop)
        if mode == "scored":
            params["logprobs"] = 1
        elif mode == "choice":
            params.update(max_tokens=1, logprobs=CHOICE_TOP_K)
        return params

    def build_processor(
        self, prompt_column: str = "prompt", output_column: str = "answer", mode: str = "text",
        choices: tuple[str, ...] = (),
    ):
        from ray.data.llm import build_processor

        check_mode(mode, choices)
        sampling = self.sampling_params(mode)
        stop = list(self.config.stop)
        chat = self.config.chat_template
        adapter = self.config.lora_adapter

        def preprocess(row: dict[str, Any]) -> dict[str, Any]:
            messages = json.loads(row[prompt_column])
            out = dict(row)
            out["sampling_params"] = sampling
            if chat:  # Ray's chat template stage continues a final assistant message itself
                out["messages"] = messages
            else:
                out["prompt"] = messages_to_text(messages)
            if adapter:
                out["model"] = Path(adapter).name  # a subfolder of dynamic_lora_loading_path
            return out

        def postprocess(row: dict[str, Any]) -> dict[str, Any]:
            drop = ("messages", "sampling_params", "generated_text", "generated_tokens", "logprobs")
            keep = {k: v for k, v in row.items() if k not in drop}
            text = row.get("generated_text") or ""
            if mode == "choice":
                keep[output_column] = choices_from_logprobs((row.get("logprobs") or [None])[0], choices)
            elif mode == "scored":
                scored = scored_from_logprobs(
                    list(row.get("generated_tokens") or []), list(row.get("logprobs") or []), text,
                    sampling["max_tokens"], stop,
                )
                keep.update(scored_columns(output_column, scored))
            else:
                keep[output_column] = cut_at_stop(text, stop)
            return keep

        return build_processor(self.processor_config(), preprocess=preprocess, postprocess=postprocess)

    def setup(self) -> None:
        try:
            from vllm import LLM
        except ImportError:
            raise ConfigError("generator.backend=vllm needs vllm: pip install 'wbrag-ray[gpu]'") from None
        self.llm = LLM(model=resolve_model(self.config.model), **self.engine_kwargs())

    def _run(self, prompts: list[Prompt], params: dict[str, Any]):
        from vllm import SamplingParams

        sampling = SamplingParams(**params)
        if not self.config.chat_template:
            return self.llm.generate([messages_to_text(p) for p in prompts], sampling, use_tqdm=False)
        outs: list[Any] = [None] * len(prompts)
        for cont in (False, True):  # new answers and continued answers take different template flags
            idx = [i for i, p in enumerate(prompts) if continues_answer(p) == cont]
            if idx:
                done = self.llm.chat([prompts[i] for i in idx], sampling, use_tqdm=False,
                                     add_generation_prompt=not cont, continue_final_message=cont)
                for i, o in zip(idx, done, strict=True):
                    outs[i] = o
        return outs

    def generate(self, prompts: list[Prompt], max_new_tokens: int | None = None) -> list[str]:
        outs = self._run(prompts, self.sampling_params("text", max_new_tokens))
        return [cut_at_stop(o.outputs[0].text, self.config.stop) for o in outs]

    def generate_scored(self, prompts: list[Prompt], max_new_tokens: int | None = None) -> list[Scored]:
        params = self.sampling_params("scored", max_new_tokens)
        return [
            scored_from_logprobs(list(o.outputs[0].token_ids), o.outputs[0].logprobs or [], o.outputs[0].text,
                                 params["max_tokens"], list(self.config.stop))
            for o in self._run(prompts, params)
        ]

    def choice_probs(self, prompts: list[Prompt], choices: tuple[str, ...]) -> list[list[float]]:
        outs = self._run(prompts, self.sampling_params("choice"))
        return [choices_from_logprobs((o.outputs[0].logprobs or [None])[0], tuple(choices)) for o in outs]


# --- openai-compatible HTTP -----------------------------------------------------------------------------


class OpenAIGenerator(Generator):
    """Any OpenAI-compatible server (vLLM serve, TGI, llama.cpp server, hosted APIs): /v1/chat/completions."""

    def setup(self) -> None:
        if not self.config.base_url:
            raise ConfigError("generator.backend=openai needs generator.base_url, e.g. http://host:8000/v1")
        self.api_key = os.environ.get(self.config.api_key_env, "")

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        import urllib.request

        req = urllib.request.Request(
            self.config.base_url.rstrip("/") + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {self.api_key}"},
        )
        with urllib.request.urlopen(req, timeout=300) as resp:
            return json.loads(resp.read())

    def _complete(self, p: Prompt, max_tokens: int, top_logprobs: int | None) -> tuple[str, list, bool]:
        """(text, [(token, logprob, top [(token, logprob)])], stopped by the model) for one prompt."""
        stop = {"stop": list(self.config.stop)} if self.config.stop else {}
        base = {"model": self.config.model, "temperature": 0, "max_tokens": max_tokens, **stop}
        if self.config.chat_template:
            extra = {"logprobs": True, "top_logprobs": top_logprobs} if top_logprobs is not None else {}
            choice = self._post("/chat/completions", {**base, "messages": p, **extra})["choices"][0]
            text = choice["message"]["content"] or ""
            steps = [(c["token"], c["logprob"], [(t["token"], t["logprob"]) for t in c.get("top_logprobs") or []])
                     for c in (choice.get("logprobs") or {}).get("content") or []]
        else:
            extra = {"logprobs": max(top_logprobs, 1)} if top_logprobs is not None else {}
            choice = self._post("/completions", {**base, "prompt": messages_to_text(p), **extra})["choices"][0]
            text = choice["text"]
            lp = choice.get("logprobs") or {}
            steps = [(t, v, list((top or {}).items())) for t, v, top in
                     zip(lp.get("tokens") or [], lp.get("token_logprobs") or [], lp.get("top_logprobs") or [], strict=False)]
        return text, steps, choice.get("finish_reason") == "stop"

    def _map(self, fn, prompts: list[Prompt]) -> list:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=min(16, len(prompts) or 1)) as pool:
            return list(pool.map(fn, prompts))

    def generate(self, prompts: list[Prompt], max_new_tokens: int | None = None) -> list[str]:
        max_tokens = max_new_tokens or self.config.max_new_tokens
        return self._map(lambda p: cut_at_stop(self._complete(p, max_tokens, None)[0], self.config.stop), prompts)

    def generate_scored(self, prompts: list[Prompt], max_new_tokens: int | None = None) -> list[Scored]:

        max_tokens = max_new_tokens or self.config.max_new_tokens
        stop = list(self.config.stop)

        def one(p: Prompt) -> Scored:
            text, steps, stopped = self._complete(p, max_tokens, 0)
            return scored_from_pieces([(token, logprob) for token, logprob, _ in steps], text, stopped, stop)

        return self._map(one, prompts)

    def choice_probs(self, prompts: list[Prompt], choices: tuple[str, ...]) -> list[list[float]]:
        import math

        def one(p: Prompt) -> list[float]:
            _, steps, _ = self._complete(p, 1, CHOICE_TOP_K)
            top = steps[0][2] if steps else []
            return choice_mass([(t, math.exp(lp)) for t, lp in top], tuple(choices))

        return self._map(one, prompts)


_BACKENDS: dict[str, type[Generator]] = {"hf": HFGenerator, "vllm": VLLMGenerator, "openai": OpenAIGenerator}


def make_generator(config: GeneratorConfig) -> Generator:
    """The generator for `config.backend`; checks the model spec now so a bad path fails before any job starts."""
    if config.backend not in _BACKENDS:
        raise ConfigError(f"unknown generator.backend {config.backend!r}; choose one of {', '.join(_BACKENDS)}")
    if config.backend != "openai":
        resolve_model(config.model)
    return _BACKENDS[config.backend](config)
