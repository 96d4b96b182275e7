"""Generation as a stage: JSON chat messages in; greedy answers, scored answers or choice probabilities out (or,
for a mixture, JSON lists of prompts and their weights in; one scored answer per row out)."""

from __future__ import annotations

import json

import pandas as pd

from wbrag_ray.config import GeneratorConfig
from wbrag_ray.generation.backends import make_generator
from wbrag_ray.generation.types import check_mode, scored_columns
from wbrag_ray.identity import content_identity
from wbrag_ray.placement import PENDING_TIMEOUT_S, sharded
from wbrag_ray.ray_runtime import LIGHT_CPUS, vllm_env
from wbrag_ray.stages.base import Resources, Stage

# Generator settings each pass sets for itself on the loaded model: another value loads nothing again.
# (batch_invariant is not one: a vLLM engine starts with or without its batch-invariant kernels.)
PASS_KEYS = {"max_new_tokens", "batch_size", "stop", "checkpoint_rows", "checkpoint_seconds"}


class GenerateStage(Stage):
    """One generator pass. `mode`: `text`, `scored` (with tokens, their probabilities and whether the model ended
    it: FLARE), `choice` (each of `choices`' probability as the first token: Self-RAG), `mixture` (JSON lists of
    prompts and of their weights, one answer from their mixture with `scored`'s columns: RePlug)."""

    name = "generate"
    section = "generator"

    def __init__(
        self, config: GeneratorConfig, prompt_column: str = "prompt", output_column: str = "answer",
        mode: str = "text", choices: tuple[str, ...] = (), weight_column: str = "weights",
    ):
        check_mode(mode, choices)
        self.config = config
        self.prompt_column = prompt_column
        self.output_column = output_column
        self.mode = mode
        self.choices = tuple(choices)
        self.weight_column = weight_column
        self.input_columns = (prompt_column, weight_column) if mode == "mixture" else (prompt_column,)
        self.output_columns = (output_column,) if mode in ("text", "choice") else scored_columns(output_column)
        # vLLM's log level, decided in the driver (its -v), in the runtime env of the workers that import it
        self.env = tuple(sorted(vllm_env().items())) if config.backend == "vllm" else ()
        # the weights' content: a model or adapter rewritten in place is loaded anew, not answered by the old one
        self.weights = (content_identity(config.model), content_identity(config.lora_adapter))
        # ray.pending_timeout_s, as the driver has it, for the waits in the actor (a sharded replica's placement group)
        self.pending_timeout_s = PENDING_TIMEOUT_S["seconds"]

    @property
    def resources(self) -> Resources:
        c = self.config
        # A sharded replica holds its GPUs (or CPU ranks) in a placement group of its own (`RemoteEngine`): the
        # actor that forwards batches to it asks for no GPU and a light share of a CPU.
        gpus = 0.0 if sharded(c) else c.num_gpus
        cpus = LIGHT_CPUS if sharded(c) else c.num_cpus
        # A Ray batch holds several generate batches (length bucketing has room to sort); a vLLM engine takes
        # several calls at once (`vllm_feed`), the other backends one.
        calls = c.calls_per_engine if c.backend == "vllm" else 1
        return Resources(cpus, gpus, c.concurrency, batch_size=c.batch_size * 4, threads=c.threads, calls=calls,
                         env=self.env)

    def setup(self) -> None:
        PENDING_TIMEOUT_S["seconds"] = self.pending_timeout_s
        self.generator = make_generator(self.config)
        self.generator.setup()

    @property
    def starts_processes(self) -> bool:
        return self.config.backend == "vllm"  # its engine core and model workers (on GPUs; a remote engine's too)

    def close(self) -> None:
        if getattr(self, "generator", None) is not None:
            self.generator.close()

    def service_key(self) -> str:
        # What setup loads: the generator's settings but those a pass sets for itself (`adopt` lends the loaded
        # model the pass's config).
        return self.config.model_dump_json(exclude=PASS_KEYS) + json.dumps(self.weights)

    def adopt(self, loaded: GenerateStage) -> None:
        self.generator = loaded.generator.with_config(self.config)

    def process_batch(self, batch: pd.DataFrame) -> pd.DataFrame:
        prompts = [json.loads(p) for p in batch[self.prompt_column]]
        if self.mode == "text":
            batch[self.output_column] = self.generator.generate(prompts)
        elif self.mode == "choice":
            batch[self.output_column] = self.generator.choice_probs(prompts, self.choices)
        else:
            answers = (self.generator.generate_mixture(prompts, [json.loads(w) for w in batch[self.weight_column]])
                       if self.mode == "mixture" else self.generator.generate_scored(prompts))
            for column, field in zip(self.output_columns, ("text", "tokens", "probs", "finished"), strict=True):
                batch[column] = [getattr(s, field) for s in answers]
        return batch
