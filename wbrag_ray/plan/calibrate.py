"""Calibration (`wbrag plan CONFIG --calibrate`): each model of a config timed for a bounded time in one Ray worker
with its stage's resources, on the config's own data; then a scratch run of a sample (`pipeline.execute`), whose
stats give the embed stage's fixed cost and write-back's figures. Records hold their hardware and go to
RUN/plan/calibration.json and a cache (`WBRAG_RATES_CACHE`), where later plans on that hardware find them.
Over 400 lines: every measurement, the scratch run and the records' driver."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from wbrag_ray.build_kb import EMBED, INDEX, INGEST, unit_text
from wbrag_ray.config import EmbedderConfig, GeneratorConfig, TrainerConfig, TuneConfig, WbragConfig
from wbrag_ray.pipeline import execute
from wbrag_ray.plan.tokens import CHARS_PER_TOKEN, TOKEN_UNITS, jsonl_rows, messages_tokens, text_tokens
from wbrag_ray.run import RunFolder
from wbrag_ray.session import start
from wbrag_ray.storage import resolve
from wbrag_ray.writeback.pipeline import WRITEBACK_TRAINING

log = logging.getLogger(__name__)

DEFAULT_SECONDS = 30.0  # per model
SAMPLE_PASSAGES = 2000  # the scratch run's corpus: the corpus's first passages
SAMPLE_QUESTIONS = 64  # the scratch run's training questions: a 95% interval of about +-0.1 at a 20% keep rate
# write-back's passes (`GeneratorPasses.stats` names) that the plan prices as their own prompt kinds
WRITEBACK_PASSES = {"document_gate": "document gate", "distill_extract": "extract", "distill_rewrite": "rewrite"}


def cache_path() -> Path:
    return Path(os.environ.get("WBRAG_RATES_CACHE", "~/.cache/wbrag/rates.json")).expanduser()


def training_dtype(num_gpus: float) -> str:
    """A training worker's weights' dtype: fp32 on CPUs (bf16 is emulated on many; LoRA loses precision in it)."""
    return "auto" if num_gpus > 0 else "float32"


def hardware(device: str, dtype: str, threads: int) -> dict[str, Any]:
    """The hardware a rate was measured on: what must match for a plan to use it."""
    from wbrag_ray.models.hardware import _cpuinfo, cpu_matmul_flags

    return {"device": device, "cpu": _cpuinfo()[0] or "unknown", "cpu_flags": cpu_matmul_flags(), "dtype": dtype,
            "threads": threads}


def timed_batches(run_batch, batches: list, budget: float) -> tuple[int, float, float]:
    """Run `batches` until half of `budget` passes (the cold pass, paying each shape's first use), then the same
    again (warm, a run's steady rate): (batches, cold seconds, warm seconds)."""
    t0, n = time.perf_counter(), 0
    while n == 0 or (time.perf_counter() - t0 < budget / 2 and n < len(batches)):
        run_batch(batches[n])
        n += 1
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    for b in batches[:n]:
        run_batch(b)
    return n, cold, time.perf_counter() - t0


def wilson(kept: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of `kept` / `n`: it stays in [0, 1] and is not empty at 0 or n kept."""
    if n <= 0:
        return 0.0, 1.0
    p = kept / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def calibrate_generator(config: WbragConfig, questions: list[str], docs: list[tuple[str, str]],
                        budget: float) -> dict[str, Any]:
    """Time batches of closed-book, K-document (and RePlug mixture) prompts, the budget shared."""
    import torch

    from wbrag_ray.generation.backends import make_generator
    from wbrag_ray.models.hardware import resolved_dtype_name, set_threads
    from wbrag_ray.prompts import no_retrieval_messages, rag_messages
    from wbrag_ray.retrieval.hits import Hit

    g, k = config.generator, config.retrieval.top_k
    threads = set_threads(g.num_cpus, g.threads)
    gen = make_generator(g)
    gen.setup()
    loaded_at = time.time()
    hits = [Hit(i, 1.0, i, title, text) for i, (title, text) in enumerate(docs)]
    batch = max(1, g.batch_size or 16)
    points = []
    mixture = gen.supports_mixture and "replug" in config.eval.methods  # RePlug's ensemble: K prompts as one
    share = budget / (3 if mixture else 2)
    for shape, make in (("closed-book", lambda q, i: no_retrieval_messages(q)),
                        (f"{k} documents", lambda q, i: rag_messages(q, [hits[(i + j) % len(hits)] for j in range(k)]))):
        prompts = [make(q, i) for i, q in enumerate(questions)]
        batches = [prompts[i:i + batch] for i in range(0, len(prompts), batch)] or [prompts]
        n, cold, seconds = timed_batches(lambda b: gen.generate(b, g.max_new_tokens), batches, share)
        calls = sum(len(batches[i]) for i in range(n))
        tokens = sum(messages_tokens(p) for i in range(n) for p in batches[i]) / calls
        points.append({"shape": shape, "prompt_tokens": tokens, "new_tokens": g.max_new_tokens, "calls": calls,
                       "seconds": seconds, "seconds_per_call": seconds / calls, "first_use_seconds": cold - seconds})
    if mixture:
        groups = [[rag_messages(q, [hits[(i + j) % len(hits)]]) for j in range(k)] for i, q in enumerate(questions)]
        weights = [[1.0] * k for _ in groups]
        per = max(1, batch // k)
        packs = [(groups[i:i + per], weights[i:i + per]) for i in range(0, len(groups), per)]
        n, cold, seconds = timed_batches(lambda p: gen.generate_mixture(p[0], p[1], g.max_new_tokens), packs, share)
        calls = sum(len(packs[i][0]) for i in range(n))
        points.append({"shape": "mixture", "prompt_tokens": messages_tokens(groups[0][0]), "new_tokens": g.max_new_tokens,
                       "calls": calls, "seconds": seconds, "seconds_per_call": seconds / calls, "prompts_per_call": k,
                       "first_use_seconds": cold - seconds})
    device = torch.cuda.get_device_name() if getattr(gen, "device", "cpu").startswith("cuda") else "cpu"
    return {"role": "generator", "model": g.model, "backend": g.backend, "batch_size": batch, "loaded_at": loaded_at,
            "points": points,
            "token_units": TOKEN_UNITS, "hardware": hardware(device, resolved_dtype_name(g.dtype, g.num_gpus), threads)}


def calibrate_embedder(e: EmbedderConfig, texts: list[str], budget: float) -> dict[str, Any]:
    """Load the embedder, then encode the corpus's texts for the budget."""
    import torch

    from wbrag_ray.models.embedder import Embedder
    from wbrag_ray.models.hardware import resolved_dtype_name, set_threads
    from wbrag_ray.stages.embed import EmbedStage

    threads = set_threads(e.num_cpus, e.threads)
    emb = Embedder(e)
    emb.setup()
    loaded_at = time.time()
    # a pass batch a call, as the run's embed actor is handed them (a larger call pads less)
    batch = EmbedStage(e).resources.batch_size
    batches = [texts[i:i + batch] for i in range(0, len(texts), batch)] or [texts]
    n, _, seconds = timed_batches(emb.encode_passages, batches, budget)
    done = [t for i in range(n) for t in batches[i]]
    tokens = sum(text_tokens(t) for t in done)
    # the model's own tokens a text (cut at its max_seq_length), beside the plan's count (characters / 4)
    limit = emb.model.max_seq_length or 10**9
    own = sum(min(limit, len(ids)) for ids in emb.model.tokenizer(done)["input_ids"]) / max(1, len(done))
    device = torch.cuda.get_device_name() if str(emb.model.device).startswith("cuda") else "cpu"
    return {"role": "embedder", "model": e.model, "loaded_at": loaded_at, "texts": len(done), "tokens": tokens,
            "tokens_per_text": tokens / max(1, len(done)), "tokenizer_tokens_per_text": own,
            "seconds": seconds, "seconds_per_token": seconds / max(tokens, 1e-9),
            "hardware": hardware(device, resolved_dtype_name(e.dtype, e.num_gpus), threads)}


def calibrate_training(tune: TuneConfig, g: GeneratorConfig, budget: float) -> dict[str, Any]:
    """Seconds a training token of LoRA steps at the tuning's per-worker batch and length, on random tokens."""
    import torch

    from wbrag_ray.generation.hf_loading import load_hf_causal_lm
    from wbrag_ray.models.hardware import pick_device, resolved_dtype_name, set_threads
    from wbrag_ray.training.lora import with_lora

    trainer = tune.trainer
    threads = set_threads(trainer.num_cpus, tune.threads)
    device = pick_device(trainer.num_gpus)
    # as a training worker has it: fp32 on CPUs, bf16 (else fp16) autocast on GPUs; trainable weights in fp32
    on_gpu = device.startswith("cuda")
    dtype = (torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16) if on_gpu else torch.float32
    model, _ = load_hf_causal_lm(g, dtype, device)
    model = with_lora(model, tune, "CAUSAL_LM")
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    autocast = torch.autocast(device_type="cuda", dtype=dtype) if on_gpu else contextlib.nullcontext()
    loaded_at = time.time()
    workers = trainer.num_workers if isinstance(trainer.num_workers, int) else 1
    batch, length = max(1, tune.batch_size // max(1, workers)), tune.max_length
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(0, model.config.vocab_size, (batch, length), device=device)

    def step(_):
        with autocast:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    n, _, seconds = timed_batches(step, [None] * 1000, budget)
    tokens = n * batch * length
    name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    return {"role": "training", "model": g.model, "loaded_at": loaded_at, "steps": n, "batch": batch, "length": length,
            "seconds": seconds, "seconds_per_token": seconds / tokens,
            "hardware": hardware(name, resolved_dtype_name(training_dtype(trainer.num_gpus), trainer.num_gpus), threads)}


# --- the driver: one worker per model, then the scratch run, then the records saved ---------------------------

def corpus_passages(path: str | None, n: int) -> list[tuple[str, str]]:
    """(title, text) of a local corpus file's first `n` passages, as the ingest parses them."""
    from wbrag_ray.formats import corpus_record

    parsed = [corpus_record(r) for r in jsonl_rows(path, n) if isinstance(r, dict)]
    return [(p.title, p.text) for p in parsed if not isinstance(p, str)]


def _sample(config: WbragConfig, n: int = 128) -> tuple[list[str], list[tuple[str, str]], list[str]]:
    """(questions, (title, text) documents, texts to embed) from the config's files; stand-ins where unreadable."""
    questions: list[str] = []  # every QA file's: prompts the run will not meet twice
    for path in dict.fromkeys((config.eval.dataset, config.writeback.train, config.zerorag.train)):
        questions += [str(r["question"]) for r in jsonl_rows(path, n) if "question" in r]
    docs = corpus_passages(config.ingest.corpus, n)
    if config.index.unit == "sentence":
        from wbrag_ray.stages.ingest import Segmenter

        split = Segmenter().split
        texts = [s for _, text in docs for s in split(text)][: 4 * n]
    else:  # as the embed stage embeds a passage: 'Title\ntext'
        import pandas as pd

        frame = pd.DataFrame({"pid": range(len(docs)), "title": [t for t, _ in docs], "text": [x for _, x in docs]})
        texts = unit_text(frame, "pid")["text"].tolist()
    filler = "The river flows north through several countries and reaches the sea after many miles."
    return (questions or ["What is the capital of France?"] * 8, docs or [("Filler", filler)] * 8,
            texts or [filler] * 32)


def roles(config: WbragConfig) -> list[str]:
    """The models of a config that calibration times in a worker of their own (not an HTTP endpoint)."""
    out = ["embedder"]
    if config.generator.backend != "openai":
        out.append("generator")
        if config.zerorag.enabled and config.zerorag.tune.enabled:
            out.append("training")
    return out


def calibrate(config: WbragConfig, seconds: float = DEFAULT_SECONDS, run: str | None = None) -> list[dict[str, Any]]:
    """Time each model of `config` on one worker for about `seconds`, then the run's own stages on a sample; save
    and return the records."""
    import psutil
    import ray

    from wbrag_ray.ray_runtime import init_ray

    started = ray.is_initialized()
    init_ray(config.ray, trains=True)  # it times a training step under Ray Train
    date = time.strftime("%Y-%m-%d %H:%M")
    records = []
    if not started and not (config.ray.address or os.environ.get("RAY_ADDRESS")):
        # the run's own start: this process's and the local cluster's
        cpus = float(ray.cluster_resources().get("CPU", 0))
        records.append({"role": "cluster", "model": "", "cpus": cpus, "date": date, "hardware": hardware("cpu", "", 0),
                        "start_seconds": time.time() - psutil.Process().create_time()})
    questions, docs, texts = _sample(config)
    by_role = {}
    for role in roles(config):
        num_cpus, num_gpus = _resources(config, role)
        # max_calls=1: a fresh worker a model, as a stage's actor starts one
        task = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, max_retries=0, max_calls=1)(_calibrate_role)
        log.info("calibrating the %s on one actor (%g CPUs, %g GPUs) for about %g s", role, num_cpus, num_gpus, seconds)
        submitted = time.time()
        record = ray.get(task.remote(config.model_dump(), role, questions, docs, texts, seconds))
        record["start_seconds"] = max(0.0, record.pop("entered") - submitted)  # scheduling and the worker's start
        if role == "generator":
            record["service_start_seconds"] = _service_start(config.generator, questions)
        if role == "training":
            record["train_start_seconds"] = _train_start(config.zerorag.tune.trainer)
        record["date"] = date
        records.append(record)
        by_role[role] = record
    writeback = "generator" in by_role and bool(config.writeback.train)
    with tempfile.TemporaryDirectory(prefix="wbrag-calibrate-") as folder:
        scratch = scratch_run(config, Path(folder), writeback)
        if scratch is not None:
            by_role["embedder"].update(embed_pass(*scratch, by_role["embedder"]))
            if writeback:
                records.append({**writeback_record(config, *scratch, by_role["generator"]["hardware"]), "date": date})
    save(records, run)
    return records


def _service_start(g: GeneratorConfig, questions: list[str]) -> float:
    """Seconds to a first answer through the run's own generator service, on two one-token prompts."""
    import pandas as pd

    from wbrag_ray.generation.passes import GeneratorPasses
    from wbrag_ray.prompts import dumps, no_retrieval_messages
    from wbrag_ray.stages.service import Services

    frame = pd.DataFrame({"prompt": [dumps(no_retrieval_messages(q)) for q in questions[:2]]})
    t0 = time.perf_counter()
    with Services() as services:
        GeneratorPasses(g, services).generate("calibration", frame, "prompt", "answer", 1)
    return time.perf_counter() - t0


def scratch_run(config: WbragConfig, folder: Path, writeback: bool = False):
    """(run, its config): the run's own stages (`pipeline.execute`) on the corpus's first `SAMPLE_PASSAGES` passages in
    `folder`: ingest and embed, and with `writeback`, index and write-back training on `SAMPLE_QUESTIONS` of its
    training questions (none held out). None where the corpus is not readable here."""
    passages = corpus_passages(config.ingest.corpus, SAMPLE_PASSAGES)
    rows = jsonl_rows(config.writeback.train) if writeback else []
    if writeback and not (rows and passages):
        raise ValueError(f"write-back calibration needs a local training set and corpus (writeback.train "
                         f"{config.writeback.train!r}, ingest.corpus {config.ingest.corpus!r})")
    if not passages:
        return None
    folder.mkdir(parents=True, exist_ok=True)
    corpus, train = folder / "corpus.jsonl", folder / "train.jsonl"
    corpus.write_text("".join(json.dumps({"id": str(i), "contents": f"{title}\n{text}"}) + "\n"
                              for i, (title, text) in enumerate(passages)))
    train.write_text("".join(json.dumps(r) + "\n" for r in rows[::max(1, len(rows) // SAMPLE_QUESTIONS)][:SAMPLE_QUESTIONS]))
    wb = config.writeback.model_copy(update={"train": str(train) if writeback else None, "validation": None,
                                             "limit": None})
    # a copy of its own: the run's start decides its "auto" counts in it
    sample = config.model_copy(deep=True, update={"ingest": config.ingest.model_copy(update={"corpus": str(corpus)}),
                                                  "writeback": wb})
    stages = (INGEST, EMBED) + ((INDEX, WRITEBACK_TRAINING) if writeback else ())
    # the stages' progress lines to stderr: `wbrag plan --calibrate --json` prints its plan alone on stdout
    with contextlib.redirect_stdout(sys.stderr):
        run = start(str(folder / "run"), sample)
        execute(run, sample, only=stages)
    return run, sample


def embed_pass(run, config: WbragConfig, record: dict[str, Any]) -> dict[str, Any]:
    """The scratch run's embed stage: its seconds beyond its texts' tokens at `record`'s warm rate are the stage's
    fixed cost (pass start, actors' load, write)."""
    import pyarrow.parquet as pq

    src, id_col = run.layout.ingest.units(config.index.unit)
    columns = [id_col, "text"] + (["title"] if config.index.unit == "passage" else [])
    texts = unit_text(pq.read_table(src.path, filesystem=src.fs, columns=columns).to_pandas(), id_col)["text"]
    tokens, seconds = sum(map(text_tokens, texts)), float(run.stats(EMBED.name)["seconds"])
    return {"pass_seconds": seconds, "pass_texts": len(texts), "pass_tokens": tokens,
            "pass_start_seconds": max(0.0, seconds - tokens * record["seconds_per_token"])}


def writeback_record(config: WbragConfig, run, sample: WbragConfig, hw: dict[str, Any]) -> dict[str, Any]:
    """Write-back's figures as the scratch run's write-back stage recorded them: the utility gate's keep rate (with
    its 95% Wilson interval), the documents the document gate retained, and its passes' seconds a call."""
    stats = run.stats(WRITEBACK_TRAINING.instance(WRITEBACK_TRAINING.instances(sample)[0]))
    n, kept, g = stats["examples"], stats["selected"], sample.generator
    points = [{"shape": shape, "calls": p["generator_calls"], "seconds": p["seconds"], "new_tokens": p["max_new_tokens"],
               # a call's seconds on one actor: the pass ran on the service's `concurrency` actors
               "seconds_per_call": p["seconds"] * max(1, g.concurrency) / p["generator_calls"],
               "prompt_tokens": p["mean_prompt_chars"] / CHARS_PER_TOKEN,
               "generated_tokens": p["mean_output_chars"] / CHARS_PER_TOKEN}
              for name, shape in WRITEBACK_PASSES.items() if (p := stats["passes"].get(name, {})).get("generator_calls")]
    passages = run.stats(INGEST.name)["rows_out"]
    return {"role": "writeback", "model": config.generator.model, "backend": config.generator.backend,
            "train": config.writeback.train, "top_k": config.retrieval.top_k, "metric": stats["gate_metric"],
            "rag_method": stats["rag_method"], "questions": n, "kept": kept, "keep_rate": kept / max(1, n),
            "keep_interval": list(wilson(kept, n)),
            "retained_docs": stats["mean_retained_docs"] if kept else float(config.retrieval.top_k),
            "passages_searched": passages, "corpus_passages": passages if passages < SAMPLE_PASSAGES else None,
            "points": points, "seconds": stats["seconds"], "hardware": hw}


def _noop_loop(_config: dict) -> None:
    """A Ray Train loop that does nothing: what remains of a fit is Ray Train's own start and end."""


def _train_start(t: TrainerConfig) -> float:
    """Seconds of a Ray Train fit whose loop does nothing, with the tuning's workers: Ray Train's own overhead."""
    import ray.train
    from ray.train.torch import TorchTrainer

    workers = t.num_workers if isinstance(t.num_workers, int) else 1
    os.environ.setdefault("RAY_CHDIR_TO_TRIAL_DIR", "0")
    with tempfile.TemporaryDirectory(prefix="wbrag-calibrate-train-") as storage:
        trainer = TorchTrainer(
            _noop_loop,
            scaling_config=ray.train.ScalingConfig(
                num_workers=workers, use_gpu=t.num_gpus > 0,
                resources_per_worker={"CPU": t.num_cpus, **({"GPU": t.num_gpus} if t.num_gpus else {})}),
            run_config=ray.train.RunConfig(name="calibrate-train-start", storage_path=storage,
                                           logging_config=ray.train.LoggingConfig(log_level="WARNING")))
        t0 = time.perf_counter()
        trainer.fit()
        return time.perf_counter() - t0


def _resources(config: WbragConfig, role: str) -> tuple[float, float]:
    section = {"generator": config.generator, "embedder": config.embedder}.get(role, config.zerorag.tune.trainer)
    return section.num_cpus, section.num_gpus


def _calibrate_role(config: dict, role: str, questions, docs, texts, seconds: float) -> dict[str, Any]:
    entered = time.time()
    config = WbragConfig.model_validate(config)
    if role == "generator":
        record = calibrate_generator(config, questions, docs, seconds)
    elif role == "embedder":
        record = calibrate_embedder(config.embedder, texts, seconds)
    else:
        record = calibrate_training(config.zerorag.tune, config.generator, seconds)
    return {**record, "entered": entered, "load_seconds": record.pop("loaded_at") - entered}


def _key(record: dict[str, Any]) -> str:
    return json.dumps([record["role"], record["model"], record.get("backend"), record.get("batch_size"),
                       record["hardware"], record.get("train")], sort_keys=True)


def save(records: list[dict[str, Any]], run: str | None = None) -> None:
    """Merge `records` into the cache (newer replaces older) and, with `run`, write them to the run folder."""
    found = {_key(r): r for r in load_cache()}
    found.update({_key(r): r for r in records})
    resolve(str(cache_path())).write_json(list(found.values()))  # temp-then-move, a name of this writer's own
    if run:
        RunFolder(run).layout.calibration.write_json(records)


def load_cache() -> list[dict[str, Any]]:
    try:
        data = json.loads(cache_path().read_text())
        return data if isinstance(data, list) else []
    except (OSError, ValueError):
        return []


def load_records(run: str | None = None) -> list[dict[str, Any]]:
    """The run folder's records (with `run`, where it has them), then the cache's."""
    out: list[dict[str, Any]] = []
    if run:
        try:
            out += RunFolder(run).layout.calibration.read_json()
        except (OSError, ValueError, TypeError):
            pass
    return out + load_cache()
