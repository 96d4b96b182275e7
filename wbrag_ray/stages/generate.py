"""Generation as a stage: JSON chat messages in, greedy answers out."""

from __future__ import annotations

import json

import pandas as pd

from wbrag_ray.config import GeneratorConfig
from wbrag_ray.stages.base import Resources, Stage


class GenerateStage(Stage):
    name = "generate"

    def __init__(self, config: GeneratorConfig, prompt_column: str = "prompt", output_column: str = "answer"):
        self.config = config
        self.prompt_column = prompt_column
        self.output_column = output_column
        self.input_columns = (prompt_column,)
        self.output_columns = (output_column,)

    @property
    def resources(self) -> Resources:
        c = self.config
        # One Ray batch holds several generate batches, so length bucketing has room to sort.
        return Resources(c.num_cpus, c.num_gpus, c.concurrency, batch_size=c.batch_size * 4, threads=c.threads)

    def setup(self) -> None:
        from wbrag_ray.models.generator import make_generator

        self.generator = make_generator(self.config)
        self.generator.setup()

    def process_batch(self, batch: pd.DataFrame) -> pd.DataFrame:
        prompts = [json.loads(p) for p in batch[self.prompt_column]]
        batch[self.output_column] = self.generator.generate(prompts)
        return batch
