"""One generator pass over a Ray Dataset, recorded: every pipeline that calls the LLM in batches (write-back's
gates and distiller, Zero-RAG's QA writing and closed-book answers, the router's labels) goes through here, so
calls, seconds and prompt / output sizes per pass land in its stats the same way."""

from __future__ import annotations

import time
from typing import Any

import pandas as pd

from wbrag_ray.config import GeneratorConfig


class GeneratorPasses:
    """Runs generator passes and records calls, seconds and prompt / output sizes per pass for stats.json."""

    def __init__(self, generator: GeneratorConfig):
        self.generator = generator
        self.stats: dict[str, dict[str, Any]] = {}

    def generate(
        self, name: str, ds, prompt_column: str, output_column: str, max_new_tokens: int | None = None,
        generator: GeneratorConfig | None = None, multiline: bool = False, mode: str = "text",
        choices: tuple[str, ...] = (),
    ) -> pd.DataFrame:
        """Add `output_column` to every row of `ds`; `generator` replaces the default role's model (e.g. the
        QA generator beside the target model); `multiline` lets outputs run past a line end (generator.stop);
        `mode` / `choices`: scored answers or choice probabilities instead of text (Generator.apply)."""
        from wbrag_ray.models.generator import make_generator

        gen_config = generator or self.generator
        if max_new_tokens:
            gen_config = gen_config.model_copy(update={"max_new_tokens": max_new_tokens})
        if multiline:
            gen_config = gen_config.model_copy(update={"stop": [s for s in gen_config.stop if "\n" not in s]})
        t0 = time.perf_counter()
        df = make_generator(gen_config).apply(ds, prompt_column, output_column, mode, choices).to_pandas()
        seconds = time.perf_counter() - t0
        text_out = mode != "choice" and len(df)
        self.stats[name] = {
            "generator_calls": len(df),
            "seconds": round(seconds, 2),
            "calls_per_s": round(len(df) / seconds, 2) if seconds > 0 and len(df) else 0.0,
            "mean_prompt_chars": round(float(df[prompt_column].str.len().mean()), 1) if len(df) else 0.0,
            "mean_output_chars": round(float(df[output_column].str.len().mean()), 1) if text_out else 0.0,
            "max_new_tokens": gen_config.max_new_tokens,
            "model": gen_config.model,
        }
        return df

    @property
    def calls(self) -> int:
        return sum(p["generator_calls"] for p in self.stats.values())


def from_pandas(df: pd.DataFrame):
    import ray.data

    return ray.data.from_pandas(df.reset_index(drop=True))
