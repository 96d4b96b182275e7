"""Zero-RAG's noise-tolerant tuning stage: the generator's LoRA adapter (RUN/zero_rag/adapter/)."""

from __future__ import annotations

import tempfile
from typing import Any

import pandas as pd

from wbrag_ray.build_kb import INDEX
from wbrag_ray.config import ConfigError, GeneratorConfig, WbragConfig, ZeroRagConfig
from wbrag_ray.formats import input_params, read_questions
from wbrag_ray.generation.passes import GeneratorPasses
from wbrag_ray.retrieval.stage import RetrievalSetting
from wbrag_ray.run import RunFolder, RunStage
from wbrag_ray.stages.service import Services
from wbrag_ray.training.noise_tolerant import build_examples, own_targets, tune_generator
from wbrag_ray.work import Generate, Pass, Search, Sizes, Train


def train_questions(z: ZeroRagConfig, train: str | None) -> tuple[str, pd.DataFrame, int]:
    """(path, the training questions, how many rows were rejected) of zerorag.train (or `train`)."""
    train = train or z.train
    if not train:
        raise ConfigError("no training questions: pass --train PATH or set zerorag.train (FlashRAG jsonl / Parquet)")
    questions, rejects = read_questions(train, "zerorag.train", limit=z.train_limit)
    df = questions.to_pandas()
    df["golden_answers"] = df["golden_answers"].map(list)  # numpy object arrays would travel through Ray pickled
    return train, df, rejects.num_rows


def with_adapter(run: RunFolder, generator: GeneratorConfig) -> GeneratorConfig:
    """`generator` with the run's adapter by its URI (each worker fetches it to its own node)."""
    run.require(TUNE)
    return generator.model_copy(update={"lora_adapter": run.layout.zero_rag.adapter.uri})


def tune(run: RunFolder, config: WbragConfig, train: str | None = None, force: bool = False) -> dict[str, Any]:
    """Noise-tolerant LoRA tuning of the generator; the adapter goes to RUN/zero_rag/adapter."""
    train, questions, rejected = train_questions(config.zerorag, train)

    stats = run.execute(TUNE, config, lambda: _tune(run, config, questions, rejected),
                        params=input_params(train, "zerorag.train"), force=force)
    print(f"noise-tolerant adapter: {run.layout.zero_rag.adapter.uri} (loss {stats.get('first_loss')} -> "
          f"{stats.get('last_loss')})", flush=True)
    return stats


def _tune(run: RunFolder, config: WbragConfig, questions: pd.DataFrame, rejected: int) -> dict[str, Any]:
    t = config.zerorag.tune
    # more documents than an answer needs: the relevant ones and the hard distractors are picked from them
    wide = config.retrieval.model_copy(update={"top_k": max(config.retrieval.top_k, t.retrieve_k)})
    search = RetrievalSetting(run.layout.index.uri, None, config.embedder, wide, config.index)
    targets: dict[str, Any] = {"targets": t.targets}
    with Services() as services:  # the search (and generator) actors end before training needs the CPUs
        retrieved = search.search(questions, services=services)
        # as many documents as the evaluation's prompts hold, unless zerorag.tune.docs_per_format says otherwise
        examples = build_examples(retrieved, t.docs_per_format or config.retrieval.top_k, t.seed)
        if t.targets == "own":  # the generator's own answers to the very prompts it is tuned on
            rows = examples.assign(_row=range(len(examples)))
            with GeneratorPasses(config.generator, services) as passes:
                answered = passes.generate("tune_targets", rows, "messages", "_own").sort_values("_row")
            golds = dict(zip(retrieved["id"], retrieved["golden_answers"], strict=True))
            kept = own_targets(examples, answered["_own"].tolist(), golds)
            targets.update(rows_built=len(examples), rows_without_own_answer=len(examples) - len(kept),
                           generator_calls=passes.calls)
            if kept.empty:
                raise ConfigError("zerorag.tune.targets=own: the generator answered none of the training rows "
                                  "correctly, so there is nothing to tune on; use targets: gold, or more questions")
            examples = kept
    with tempfile.TemporaryDirectory() as tmp:
        stats = tune_generator(examples, config.generator, t, tmp)
        run.output(run.layout.zero_rag.adapter).upload_dir(tmp)  # beside the adapter in use while --force redoes it
    fit = {k: round(v, 4) if isinstance(v, float) else v for k, v in stats.items() if k not in ("losses", "group_loss")}
    # the training loop's own seconds; the stage's seconds include retrieval and Ray Train's start
    fit["train_seconds"] = fit.pop("seconds", None)
    return {"rows_in": len(questions) + rejected, "rows_out": len(examples), "rows_rejected": rejected, **targets,
            **fit}


ANSWER_TOKENS = 4  # a short gold answer (NQ, TriviaQA): a tuning row's target


def tune_work(config: WbragConfig, sizes: Sizes, params: dict[str, Any]) -> list:
    """The training questions' search (top retrieve_k), then LoRA training on up to three rows a question
    (relevant, distracting and no documents); with `targets: own`, the generator first answers each row. A step
    costs its longest row, nearly always one with documents (all `batch` rows without: 1 in 3^batch)."""
    t, g = config.zerorag.tune, config.generator
    q, counted = sizes.questions(config.zerorag.train, config.zerorag.train_limit)
    search = Search(q, max(t.retrieve_k, config.retrieval.top_k), f"training questions: {counted}; top "
                    f"{max(t.retrieve_k, config.retrieval.top_k)} each", title="tuning: retrieval")
    d = t.docs_per_format or config.retrieval.top_k
    answer = (g.max_new_tokens if t.targets == "own" else ANSWER_TOKENS) + 1  # the answer and its end token
    with_docs = min(t.max_length, sizes.tokens("prompt", d) + answer)
    without = min(t.max_length, sizes.tokens("prompt") + answer)
    none_only = (1 / 3) ** max(1, min(t.batch_size, 64))
    own = (Generate(q, (Pass(2, d), Pass(1, 0)), "first the generator answers each row, its right answers kept as "
                    "targets") if t.targets == "own" else None)
    return [search, Train(g.model, "zerorag.tune", 3 * q if q else None, with_docs * (1 - none_only) + without * none_only,
                          f"rows of {with_docs:,.0f} tokens ({d} documents) and {without:,.0f} (none), a step at its "
                          "longest", first=own)]


TUNE = RunStage("tune", settings=("zerorag.train_limit", "zerorag.tune", "generator", "retrieval", "index.nprobe"),
                requires=(INDEX,), command="wbrag tune RUN --train PATH", title="tuning: LoRA training", work=tune_work,
                run=lambda folder, config, force, services, params: tune(folder, config, force=force),
                instances=lambda config: [{}] if config.zerorag.enabled and config.zerorag.tune.enabled else [],
                resources=("retrieval", "zerorag.tune.trainer"), outputs=("zero_rag/adapter",))
