"""`GeneratorPasses`: generator passes over rows the driver holds, recorded for stats.json; every pipeline that calls
the LLM goes through it. Each pass is a `GenerateStage` on the command's generator service (docs/architecture.md,
"One engine path"), and the retrieval passes between them share its services. Use it as a context manager, or call
`close()`, so the services end before the command runs stages that need their CPUs."""

from __future__ import annotations

import hashlib
import json
import time
from typing import TYPE_CHECKING, Any

import pandas as pd

from wbrag_ray import checkpoints
from wbrag_ray.config import GeneratorConfig
from wbrag_ray.generation.backends import check_backend_mode, make_generator
from wbrag_ray.generation.stage import GenerateStage
from wbrag_ray.generation.vllm import check_shape
from wbrag_ray.identity import generator_identity
from wbrag_ray.placement import check_placement
from wbrag_ray.progress import log as progress_log
from wbrag_ray.run import settings_value
from wbrag_ray.stages.service import Services

if TYPE_CHECKING:
    from wbrag_ray.checkpoints import AnswerStore


def _checked(config: GeneratorConfig, mode: str, key: str = "generator") -> None:
    """Refuse, before anything waits for an actor, a bad backend, model or mode, a model shape the engine does not
    fit, a cluster whose nodes cannot hold a replica. `key`: the config section, for messages."""
    make_generator(config)
    check_backend_mode(config, mode)
    check_shape(config, key)
    check_placement(config, key)


class GeneratorPasses:
    """Runs generator passes and records calls, seconds and prompt / output sizes per pass for stats.json."""

    def __init__(self, generator: GeneratorConfig, services: Services | None = None):
        """`services`: stage services shared with other passes objects, owned (and closed) by the caller;
        by default these passes own theirs."""
        self.generator = generator
        self.stats: dict[str, dict[str, Any]] = {}
        self._owns_services = services is None
        self.services = Services() if services is None else services
        self._memo = AnswerMemo()

    def close(self) -> None:
        """End the services these passes own (the loaded generator and index actors); the stats stay."""
        if self._owns_services:
            self.services.close()

    def start(self) -> None:
        """Start the generator service before the first pass needs it (it loads while the command retrieves)."""
        _checked(self.generator, "text")
        self.services.start(GenerateStage(self.generator, "prompt", "answer"))

    def wait_ready(self) -> None:
        """Block until the generator service has loaded its model (a vLLM engine: profiled its memory)."""
        self.services.wait_ready(GenerateStage(self.generator, "prompt", "answer"))

    def __enter__(self) -> GeneratorPasses:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def generate(
        self, name: str, frame: pd.DataFrame, prompt_column: str, output_column: str, max_new_tokens: int | None = None,
        generator: GeneratorConfig | None = None, multiline: bool = False, mode: str = "text",
        choices: tuple[str, ...] = (), weight_column: str = "weights", key: str = "generator",
    ) -> pd.DataFrame:
        """Add `output_column` to every row of `frame` (on the generator service, or from the command's
        `AnswerMemo`). `generator`: another model than the default (the QA generator); `multiline`: outputs may run
        past a line end; `key`: the config section of `generator`, for messages; `mode`: `GenerateStage`'s.
        `generator_calls` counts prompts (a mixture row's K; `mixture_groups` counts its rows)."""
        gen_config = generator or self.generator
        if max_new_tokens:
            gen_config = gen_config.model_copy(update={"max_new_tokens": max_new_tokens})
        if multiline:
            gen_config = gen_config.model_copy(update={"stop": [s for s in gen_config.stop if "\n" not in s]})
        t0 = time.perf_counter()
        _checked(gen_config, mode, key)
        stage = GenerateStage(gen_config, prompt_column, output_column, mode, choices, weight_column)
        checkpoint = checkpoints.active()
        store = None
        if checkpoint is not None:
            store = checkpoint.answers(gen_config.checkpoint_rows, gen_config.checkpoint_seconds)
            checkpoint.begin_pass(name, len(frame))
        df, reused, resumed = self._memo.run(
            frame, stage, lambda todo, on_batch: self.services.run_frame(todo, stage, name, on_batch), store)
        if checkpoint is not None:
            checkpoint.count(resumed, len(df) - reused - resumed)
        if resumed:
            progress_log.info("%s: resumed %s of %s rows from the stage's checkpoint", name, f"{resumed:,}",
                              f"{len(df):,}")
        if reused:
            progress_log.info("%s: %s of %s rows answered by earlier passes of this command", name,
                              f"{reused:,}", f"{len(df):,}")
        seconds = time.perf_counter() - t0
        text_out = mode != "choice" and len(df)
        calls = sum(len(json.loads(w)) for w in df[weight_column]) if mode == "mixture" else len(df)
        self.stats[name] = {
            "generator_calls": calls,
            "seconds": round(seconds, 2),
            "calls_per_s": round(calls / seconds, 2) if seconds > 0 and calls else 0.0,
            # per prompt (a mixture row's JSON list holds its K prompts)
            "mean_prompt_chars": round(float(df[prompt_column].str.len().sum()) / calls, 1) if calls else 0.0,
            "mean_output_chars": round(float(df[output_column].str.len().mean()), 1) if text_out else 0.0,
            "max_new_tokens": gen_config.max_new_tokens,
            "model": gen_config.model,
        }
        if mode == "mixture":
            self.stats[name]["mixture_groups"] = len(df)
        if reused:
            self.stats[name]["answers_reused"] = reused
        if resumed:
            self.stats[name]["rows_resumed"] = resumed
        return df

    @property
    def calls(self) -> int:
        return sum(p["generator_calls"] for p in self.stats.values())


class AnswerMemo:
    """Greedy answers a command already generated (a grid asks the same prompts again and again), keyed by what
    decides them: the settings that shape answers, the model's and adapter's content, the pass's mode and choices,
    and the prompt (with a mixture's weights), as 16-byte digests up to `max_entries`. With a stage's `AnswerStore`
    what an earlier attempt committed is an answer too, and every new answer is committed."""

    def __init__(self, max_entries: int = 500_000):
        self.max_entries = max_entries
        self._answers: dict[bytes, tuple] = {}

    @staticmethod
    def _keys(df: pd.DataFrame, stage: GenerateStage) -> list[bytes]:
        # the model's and adapter's content, not only their paths: an adapter retrained in place answers anew
        setting = json.dumps([settings_value(stage.config), generator_identity(stage.config), stage.mode,
                              list(stage.choices)], sort_keys=True)
        weights = df[stage.weight_column] if stage.mode == "mixture" else [""] * len(df)
        return [hashlib.blake2b(f"{setting}\x00{p}\x00{w}".encode(), digest_size=16).digest()
                for p, w in zip(df[stage.prompt_column], weights, strict=True)]

    def run(self, df: pd.DataFrame, stage: GenerateStage, generate, store: AnswerStore | None = None
            ) -> tuple[pd.DataFrame, int, int]:
        """(`df` with the stage's output columns, rows earlier passes answered, rows `store` answered): the known
        rows filled in, the others (one per key) through `generate(frame, on_batch)`, which calls
        `on_batch(first_row, answered_rows)` as each batch is answered (committed to `store` then)."""
        keys = self._keys(df, stage)
        committed = store.answers if store is not None else {}
        first_row: dict[bytes, int] = {}  # each unknown key's first row: the one sent to the generator
        resumed: set[bytes] = set()
        for i, k in enumerate(keys):
            if k in self._answers or k in first_row:
                continue
            if k in committed:
                resumed.add(k)
            else:
                first_row[k] = i
        columns = list(stage.output_columns)
        made: dict[bytes, tuple] = {k: committed[k] for k in resumed}
        if first_row:
            todo_keys = list(first_row)

            def on_batch(start: int, out: pd.DataFrame) -> None:
                if store is not None:
                    store.add(zip(todo_keys[start:start + len(out)], out[columns].itertuples(index=False, name=None),
                                  strict=True))

            # run_frame keeps the order of the rows it is given
            new = generate(df.iloc[list(first_row.values())].reset_index(drop=True), on_batch)
            made.update(zip(todo_keys, new[columns].itertuples(index=False, name=None), strict=True))
            if store is not None:
                store.flush()
        for k, v in made.items():
            if len(self._answers) >= self.max_entries:
                break
            self._answers[k] = v
        out = df.reset_index(drop=True).copy()
        values = [made[k] if k in made else self._answers[k] for k in keys]
        for j, column in enumerate(columns):
            out[column] = [v[j] for v in values]
        n_resumed = sum(k in resumed for k in keys)
        return out, len(keys) - len(first_row) - n_resumed, n_resumed
