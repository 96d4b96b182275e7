"""The generator: one interface, three backends (hf, vllm, openai), chosen by `generator.backend`.

A prompt is a list of chat messages ({"role", "content"}). Instruct models get their chat template; base
models (`chat_template: false`) get the messages' contents joined as a completion prompt.

Every backend offers `generate(prompts) -> answers` for in-process use, and `apply(ds, ...)` to run over a
Ray Dataset: the hf and openai backends through an actor pool of `GenerateStage`, vllm through
`ray.data.llm.build_processor`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any

from wbrag_ray.config import ConfigError, GeneratorConfig
from wbrag_ray.models.bundled import resolve_model

if TYPE_CHECKING:
    import ray.data

log = logging.getLogger(__name__)

Prompt = list[dict[str, str]]


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

    @abstractmethod
    def generate(self, prompts: list[Prompt], max_new_tokens: int | None = None) -> list[str]:
        """Greedy answers, one per prompt, in order."""

    def apply(
        self, ds: ray.data.Dataset, prompt_column: str = "prompt", output_column: str = "answer"
    ) -> ray.data.Dataset:
        """Add `output_column` to every row of `ds`, generated from the JSON chat messages in `prompt_column`."""
        from wbrag_ray.stages.base import apply_stage
        from wbrag_ray.stages.generate import GenerateStage

        return apply_stage(ds, GenerateStage(self.config, prompt_column, output_column))


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
        self.stop_token_ids = self._stop_token_ids()
        if self.config.chat_template and self.tokenizer.chat_template is None:
            raise ConfigError(
                f"generator.model {self.config.model!r} has no chat template; set generator.chat_template=false "
                "to use completion prompts (base models)"
            )

    def _stop_token_ids(self) -> list[int]:
        """End-of-sequence ids plus every vocabulary token whose text holds a stop string: a row ends at its
        first such token. (transformers' `stop_strings` matches text as it decodes and measured 40% slower
        here; a token-id check is free. cut_at_stop trims what such a token carried past the stop string.)"""
        eos = self.model.generation_config.eos_token_id
        ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [self.tokenizer.eos_token_id])
        if self.config.stop:
            for token, i in self.tokenizer.get_vocab().items():
                text = self.tokenizer.convert_tokens_to_string([token])
                if any(s in text for s in self.config.stop):
                    ids.add(i)
        return sorted(ids)

    def render(self, prompts: list[Prompt]) -> list[str]:
        if self.config.chat_template:
            return [
                self.tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False) for p in prompts
            ]
        return [messages_to_text(p) for p in prompts]

    def generate(self, prompts: list[Prompt], max_new_tokens: int | None = None) -> list[str]:
        import torch

        if not prompts:
            return []
        texts = self.render(prompts)
        max_new = max_new_tokens or self.config.max_new_tokens
        # Sort by length so each batch pads little; answers go back in the callers' order.
        lengths = [len(self.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
        order = sorted(range(len(texts)), key=lengths.__getitem__)
        answers: list[str] = [""] * len(texts)
        bs = self.config.batch_size
        for start in range(0, len(order), bs):
            idx = order[start : start + bs]
            enc = self.tokenizer(
                [texts[i] for i in idx], return_tensors="pt", padding=True, add_special_tokens=False
            ).to(self.device)
            with torch.inference_mode():
                out = self.model.generate(
                    **enc,
                    max_new_tokens=max_new,
                    do_sample=False,
                    pad_token_id=self.tokenizer.pad_token_id,
                    eos_token_id=self.stop_token_ids,
                )
            new_tokens = out[:, enc["input_ids"].shape[1] :]
            for i, text in zip(idx, self.tokenizer.batch_decode(new_tokens, skip_special_tokens=True), strict=True):
                answers[i] = cut_at_stop(text, self.config.stop)
        return answers


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

    def build_processor(self, prompt_column: str = "prompt", output_column: str = "answer"):
        from ray.data.llm import build_processor

        max_tokens = self.config.max_new_tokens
        stop = list(self.config.stop)
        chat = self.config.chat_template
        adapter = self.config.lora_adapter

        def preprocess(row: dict[str, Any]) -> dict[str, Any]:
            messages = json.loads(row[prompt_column])
            out = dict(row)
            out["sampling_params"] = {"temperature": 0.0, "max_tokens": max_tokens, **({"stop": stop} if stop else {})}
            if chat:
                out["messages"] = messages
            else:
                out["prompt"] = messages_to_text(messages)
            if adapter:
                out["model"] = Path(adapter).name  # a subfolder of dynamic_lora_loading_path
            return out

        def postprocess(row: dict[str, Any]) -> dict[str, Any]:
            keep = {k: v for k, v in row.items() if k not in ("messages", "sampling_params", "generated_text")}
            keep[output_column] = cut_at_stop(row.get("generated_text") or "", stop)
            return keep

        return build_processor(self.processor_config(), preprocess=preprocess, postprocess=postprocess)

    def apply(self, ds, prompt_column: str = "prompt", output_column: str = "answer"):
        return self.build_processor(prompt_column, output_column)(ds)

    def setup(self) -> None:
        try:
            from vllm import LLM
        except ImportError:
            raise ConfigError("generator.backend=vllm needs vllm: pip install 'wbrag-ray[gpu]'") from None
        self.llm = LLM(model=resolve_model(self.config.model), **self.engine_kwargs())

    def generate(self, prompts: list[Prompt], max_new_tokens: int | None = None) -> list[str]:
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens or self.config.max_new_tokens,
                                stop=list(self.config.stop) or None)
        if self.config.chat_template:
            outs = self.llm.chat(prompts, params, use_tqdm=False)
        else:
            outs = self.llm.generate([messages_to_text(p) for p in prompts], params, use_tqdm=False)
        return [cut_at_stop(o.outputs[0].text, self.config.stop) for o in outs]


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

    def generate(self, prompts: list[Prompt], max_new_tokens: int | None = None) -> list[str]:
        from concurrent.futures import ThreadPoolExecutor

        max_tokens = max_new_tokens or self.config.max_new_tokens
        stop = {"stop": list(self.config.stop)} if self.config.stop else {}

        def one(p: Prompt) -> str:
            if self.config.chat_template:
                body = {"model": self.config.model, "messages": p, "temperature": 0, "max_tokens": max_tokens, **stop}
                text = self._post("/chat/completions", body)["choices"][0]["message"]["content"]
            else:
                body = {"model": self.config.model, "prompt": messages_to_text(p), "temperature": 0,
                        "max_tokens": max_tokens, **stop}
                text = self._post("/completions", body)["choices"][0]["text"]
            return cut_at_stop(text, self.config.stop)

        with ThreadPoolExecutor(max_workers=min(16, len(prompts) or 1)) as pool:
            return list(pool.map(one, prompts))


_BACKENDS: dict[str, type[Generator]] = {"hf": HFGenerator, "vllm": VLLMGenerator, "openai": OpenAIGenerator}


def make_generator(config: GeneratorConfig) -> Generator:
    """The generator for `config.backend`; checks the model spec now so a bad path fails before any job starts."""
    if config.backend not in _BACKENDS:
        raise ConfigError(f"unknown generator.backend {config.backend!r}; choose one of {', '.join(_BACKENDS)}")
    if config.backend != "openai":
        resolve_model(config.model)
    return _BACKENDS[config.backend](config)
