"""The vLLM backend: over a Ray Dataset through Ray Data LLM (`build_processor` with
`vLLMEngineProcessorConfig`), in process through `vllm.LLM`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from wbrag_ray.config import ConfigError
from wbrag_ray.generation.types import (
    CHOICE_TOP_K,
    Generator,
    Prompt,
    Scored,
    check_mode,
    choices_from_logprobs,
    continues_answer,
    cut_at_stop,
    messages_to_text,
    mixture_unsupported,
    scored_columns,
    scored_from_logprobs,
)
from wbrag_ray.models.bundled import resolve_model

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
    """vLLM backend through Ray Data LLM (`build_processor` + `vLLMEngineProcessorConfig`).

    No probability mixture (RePlug; `Generator.generate_mixture`): vLLM decodes every request as its own
    sequence. Its sampler picks a request's next token from that request's logits alone, and its outputs give,
    per generated token, the chosen token's logprob and the top-k of that sequence (`SamplingParams.logprobs`,
    at most the engine's `max_logprobs`, 20 by default), after the step. Neither the offline API (`LLM.generate`
    / `chat`) nor Ray Data LLM's engine stage makes K requests share one token chosen from their mixture at
    each step: a request's logits processor sees its own sequence, and the scheduler does not promise that the
    K requests of a group are decoded in the same step (token budget, chunked prefill, preemption). The exact
    alternative, one-token requests with the chosen token appended to all K prefixes and resubmitted, costs an
    engine round trip per token (a Ray Data pass each, behind the processor) and needs each prompt's full
    next-token distribution: from top-k logprobs a token outside one document's top k has an unknown
    probability there, so the mixture's argmax is bounded, not known. Hence the method `replug` refuses this
    backend (`ConfigError`, naming `replug-vote`, the weighted vote over per-document answers, which runs here).
    """

    mixture_limit = (
        "vLLM decodes each request as its own sequence and reports only each sequence's top-k logprobs after "
        "the step, so K document-conditioned requests cannot share one token chosen from their mixed "
        "distributions at each step (see VLLMGenerator)"
    )

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
        if mode == "mixture":
            raise mixture_unsupported(self.config, self.mixture_limit)
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
