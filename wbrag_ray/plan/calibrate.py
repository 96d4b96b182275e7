"""Calibration: the rates of a config's models measured on the cluster's own hardware (`wbrag plan CONFIG
--calibrate`), where later plans on the same hardware find them.

Each model runs in one Ray worker with its stage's resources, for a bounded time, on the config's own questions and
passages: the generator's seconds a call at two prompt lengths (and its service's start), the embedder's seconds a
token (and the run's own embed stage's fixed cost), a LoRA step's seconds a token (and Ray Train's start).
Write-back's keep rate is measured by `selection`. A record holds the hardware it ran on, and a plan uses it only
for a stage on the same hardware. Records go to RUN/plan/calibration.json and to a cache (`WBRAG_RATES_CACHE`).

Over 400 lines, kept whole: every `--calibrate` measurement and the driver that keeps the records.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from wbrag_ray.config import WbragConfig
from wbrag_ray.plan.measuring import hardware
from wbrag_ray.plan.measuring import timed_batches as _timed_batches
from wbrag_ray.plan.tokens import TOKEN_UNITS, jsonl_rows, messages_tokens, text_tokens

log = logging.getLogger(__name__)

DEFAULT_SECONDS = 30.0  # per model
PROBE_PASSAGES = 512  # passages the run's own embed stage is timed on (`_embed_pass`)


def cache_path() -> Path:
    return Path(os.environ.get("WBRAG_RATES_CACHE", "~/.cache/wbrag/rates.json")).expanduser()


def training_dtype(num_gpus: float) -> str:
    """A training worker's weights' dtype: fp32 on CPUs (bf16 is emulated on many; LoRA loses precision in it)."""
    return "auto" if num_gpus > 0 else "float32"


def calibrate_generator(config: WbragConfig, questions: list[str], docs: list[tuple[str, str]],
                        budget: float) -> dict[str, Any]:
    """Time batches of closed-book, K-document (and RePlug mixture) prompts, the budget shared."""
    import torch

    from wbrag_ray.generation.backends import make_generator
    from wbrag_ray.models.hardware import resolved_dtype_name, set_threads
    from wbrag_ray.prompts import no_retrieval_messages, rag_messages
    from wbrag_ray.retrieval.hits import Hit

    g, k = config.generator, config.retrieval.top_k
    threads = g.threads or set_threads(g.num_cpus)
    if g.threads:
        torch.set_num_threads(g.threads)
    t0 = time.perf_counter()
    gen = make_generator(g)
    gen.setup()
    load = time.perf_counter() - t0
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
        n, cold, seconds = _timed_batches(lambda b: gen.generate(b, g.max_new_tokens), batches, share)
        calls = sum(len(batches[i]) for i in range(n))
        tokens = sum(messages_tokens(p) for i in range(n) for p in batches[i]) / calls
        points.append({"shape": shape, "prompt_tokens": tokens, "new_tokens": g.max_new_tokens, "calls": calls,
                       "seconds": seconds, "seconds_per_call": seconds / calls, "first_use_seconds": cold - seconds})
    if mixture:
        groups = [[rag_messages(q, [hits[(i + j) % len(hits)]]) for j in range(k)] for i, q in enumerate(questions)]
        weights = [[1.0] * k for _ in groups]
        per = max(1, batch // k)
        packs = [(groups[i:i + per], weights[i:i + per]) for i in range(0, len(groups), per)]
        n, cold, seconds = _timed_batches(lambda p: gen.generate_mixture(p[0], p[1], g.max_new_tokens), packs, share)
        calls = sum(len(packs[i][0]) for i in range(n))
        points.append({"shape": "mixture", "prompt_tokens": messages_tokens(groups[0][0]), "new_tokens": g.max_new_tokens,
                       "calls": calls, "seconds": seconds, "seconds_per_call": seconds / calls, "prompts_per_call": k,
                       "first_use_seconds": cold - seconds})
    device = torch.cuda.get_device_name() if getattr(gen, "device", "cpu").startswith("cuda") else "cpu"
    return {"role": "generator", "model": g.model, "backend": g.backend, "batch_size": batch, "load_seconds": load, "loaded_at": loaded_at,
            "points": points, "token_units": TOKEN_UNITS, "hardware": hardware(device, resolved_dtype_name(g.dtype, g.num_gpus), threads)}


def calibrate_embedder(config: WbragConfig, texts: list[str], budget: float) -> dict[str, Any]:
    """Load the embedder, then encode the corpus's texts for the budget."""
    import torch

    from wbrag_ray.models.embedder import Embedder
    from wbrag_ray.models.hardware import resolved_dtype_name
    from wbrag_ray.stages.embed import EmbedStage

    e = config.embedder
    threads = e.threads or max(1, int(-(-e.num_cpus // 1)))
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    emb = Embedder(e)
    emb.setup()
    load = time.perf_counter() - t0
    loaded_at = time.time()
    # a pass batch a call, as the run's embed actor is handed them (a larger call pads less)
    batch = EmbedStage(e).resources.batch_size
    batches = [texts[i:i + batch] for i in range(0, len(texts), batch)] or [texts]
    n, _, seconds = _timed_batches(emb.encode_passages, batches, budget)
    done = [t for i in range(n) for t in batches[i]]
    tokens = sum(text_tokens(t) for t in done)
    # the model's own tokens a text (cut at its max_seq_length), beside the plan's count (characters / 4)
    limit = emb.model.max_seq_length or 10**9
    own = sum(min(limit, len(ids)) for ids in emb.model.tokenizer(done)["input_ids"]) / max(1, len(done))
    device = torch.cuda.get_device_name() if str(emb.model.device).startswith("cuda") else "cpu"
    return {"role": "embedder", "model": e.model, "load_seconds": load, "loaded_at": loaded_at, "texts": len(done), "tokens": tokens,
            "tokens_per_text": tokens / max(1, len(done)), "tokenizer_tokens_per_text": own,
            "seconds": seconds, "seconds_per_token": seconds / max(tokens, 1e-9),
            "hardware": hardware(device, resolved_dtype_name(e.dtype, e.num_gpus), threads)}


def calibrate_training(config: WbragConfig, budget: float) -> dict[str, Any]:
    """Seconds a training token of LoRA steps at the tuning's per-worker batch and length, on random tokens."""
    import torch

    from wbrag_ray.generation.hf_loading import load_hf_causal_lm
    from wbrag_ray.models.hardware import pick_device, resolved_dtype_name
    from wbrag_ray.training.lora import with_lora

    tune, g = config.zerorag.tune, config.generator
    trainer = tune.trainer
    threads = tune.threads or max(1, int(-(-trainer.num_cpus // 1)))
    torch.set_num_threads(threads)
    device = pick_device(trainer.num_gpus)
    # as a training worker has it: fp32 on CPUs, bf16 (else fp16) autocast on GPUs; trainable weights in fp32
    on_gpu = device.startswith("cuda")
    dtype = (torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16) if on_gpu else torch.float32
    t0 = time.perf_counter()
    model, _ = load_hf_causal_lm(g, dtype, device)
    model = with_lora(model, tune, "CAUSAL_LM")
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    autocast = torch.autocast(device_type="cuda", dtype=dtype) if on_gpu else contextlib.nullcontext()
    load = time.perf_counter() - t0
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

    n, _, seconds = _timed_batches(step, [None] * 1000, budget)
    tokens = n * batch * length
    name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    return {"role": "training", "model": g.model, "load_seconds": load, "loaded_at": loaded_at, "steps": n, "batch": batch,
            "length": length, "seconds": seconds, "seconds_per_token": seconds / tokens,
            "hardware": hardware(name, resolved_dtype_name(training_dtype(trainer.num_gpus), trainer.num_gpus), threads)}


# --- the driver: one actor per model, then the records saved -------------------------------------------------

def _sample(config: WbragConfig, n: int = 128) -> tuple[list[str], list[tuple[str, str]], list[str]]:
    """(questions, (title, text) documents, texts to embed) from the config's files; stand-ins where unreadable."""
    from wbrag_ray.build_kb import unit_text
    from wbrag_ray.plan.selection import corpus_passages

    questions: list[str] = []  # every QA file's: prompts the run will not meet twice
    for path in dict.fromkeys((config.eval.dataset, config.writeback.train, config.zerorag.train)):
        questions += _jsonl_field(path, "question", n)
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


def _jsonl_field(path: str | None, field: str, n: int) -> list[str]:
    return [str(r[field]) for r in jsonl_rows(path, n) if field in r]


def roles(config: WbragConfig) -> list[str]:
    """The models of a config that calibration can time (not an HTTP endpoint)."""
    out = ["embedder"]
    if config.generator.backend != "openai":
        out.append("generator")
        if config.writeback.train:
            out.append("writeback")
        if config.zerorag.enabled and config.zerorag.tune.enabled:
            out.append("training")
    return out


def calibrate(config: WbragConfig, seconds: float = DEFAULT_SECONDS, run: str | None = None,
              cache: Path | None = None) -> list[dict[str, Any]]:
    """Time each model of `config` on one actor for about `seconds`; save and return the records."""
    import psutil
    import ray

    from wbrag_ray.ray_runtime import init_ray

    started = ray.is_initialized()
    init_ray(config.ray)
    date = time.strftime("%Y-%m-%d %H:%M")
    records = []
    if not started and not (config.ray.address or os.environ.get("RAY_ADDRESS")):
        # the run's own start: this process's and the local cluster's
        cpus = float(ray.cluster_resources().get("CPU", 0))
        records.append({"role": "cluster", "model": "", "cpus": cpus, "date": date, "hardware": hardware("cpu", "", 0),
                        "start_seconds": time.time() - psutil.Process().create_time()})
    questions, docs, texts = _sample(config)
    for role in roles(config):
        num_cpus, num_gpus = _resources(config, role)
        # max_calls=1: a fresh worker a model, as a stage's actor starts one
        task = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, max_retries=0, max_calls=1)(_calibrate_role)
        log.info("calibrating the %s on one actor (%g CPUs, %g GPUs) for about %g s", role, num_cpus, num_gpus, seconds)
        submitted = time.time()
        record = ray.get(task.remote(config.model_dump(), role, questions, docs, texts, seconds))
        record["start_seconds"] = max(0.0, record.pop("entered") - submitted)  # scheduling and the worker's start
        if role == "generator":
            record["service_start_seconds"] = _service_start(config, questions)
        if role == "training":
            record["train_start_seconds"] = _train_start(config)
        if role == "embedder":
            record.update(_embed_pass(config, record))
        record["date"] = date
        records.append(record)
    save(records, run, cache)
    return records


def _service_start(config: WbragConfig, questions: list[str]) -> float:
    """Seconds to a first answer through the run's own generator service, on two one-token prompts."""
    import pandas as pd

    from wbrag_ray.generation.passes import GeneratorPasses
    from wbrag_ray.prompts import dumps, no_retrieval_messages
    from wbrag_ray.stages.service import Services

    frame = pd.DataFrame({"prompt": [dumps(no_retrieval_messages(q)) for q in questions[:2]]})
    t0 = time.perf_counter()
    with Services() as services:
        GeneratorPasses(config.generator, services).generate("calibration", frame, "prompt", "answer", 1)
    return time.perf_counter() - t0


def _embed_pass(config: WbragConfig, record: dict[str, Any]) -> dict[str, Any]:
    """The run's own embed stage on the corpus's first `PROBE_PASSAGES` passages: its seconds beyond their tokens at
    `record`'s warm rate are the stage's fixed cost (pass start, actors' load, write). Timed once: a second pass
    starts warmer. {} where the corpus is not readable here."""
    probe = _timed_embed_stage(config, PROBE_PASSAGES)
    if probe is None:
        return {}
    return {"pass_seconds": probe["seconds"], "pass_texts": probe["texts"], "pass_tokens": probe["tokens"],
            "pass_start_seconds": max(0.0, probe["seconds"] - probe["tokens"] * record["seconds_per_token"])}


def _timed_embed_stage(config: WbragConfig, passages: int) -> dict[str, Any] | None:
    """The run's embed stage on the corpus's first `passages` passages: seconds, texts, tokens; None if unreadable."""
    import tempfile

    from wbrag_ray import build_kb
    from wbrag_ray.plan.selection import corpus_passages
    from wbrag_ray.session import start

    probe = corpus_passages(config.ingest.corpus, passages)
    if not probe:
        return None
    with tempfile.TemporaryDirectory(prefix="wbrag-calibrate-embed-") as folder:
        corpus = Path(folder) / "corpus.jsonl"
        corpus.write_text("".join(json.dumps({"id": str(i), "contents": f"{title}\n{text}"}) + "\n"
                                  for i, (title, text) in enumerate(probe)))
        probing = config.model_copy(update={"ingest": config.ingest.model_copy(update={"corpus": str(corpus)})})
        # the stages' progress lines to stderr: `wbrag plan --calibrate --json` prints its plan alone on stdout
        with contextlib.redirect_stdout(sys.stderr):
            run = start(str(Path(folder) / "run"), probing)
            build_kb.ingest(run, probing)
            stats = build_kb.embed(run, probing)
        texts = _run_units(run, probing)
    return {"passages": len(probe), "texts": len(texts), "tokens": sum(text_tokens(t) for t in texts),
            "seconds": float(stats["seconds"])}


def _run_units(run, config: WbragConfig) -> list[str]:
    """The texts the run's embed stage embedded (`build_kb.unit_text` of its ingested units)."""
    import pyarrow.parquet as pq

    from wbrag_ray.build_kb import unit_text

    src, id_col = run.layout.ingest.units(config.index.unit)
    columns = [id_col, "text"] + (["title"] if config.index.unit == "passage" else [])
    frame = pq.read_table(src.path, filesystem=src.fs, columns=columns).to_pandas()
    return unit_text(frame, id_col)["text"].tolist()


def _noop_loop(_config: dict) -> None:
    """A Ray Train loop that does nothing: what remains of a fit is Ray Train's own start and end."""


def _train_start(config: WbragConfig) -> float:
    """Seconds of a Ray Train fit whose loop does nothing, with the tuning's workers: Ray Train's own overhead."""
    import tempfile

    import ray.train
    from ray.train.torch import TorchTrainer

    t = config.zerorag.tune.trainer
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
    if role in ("generator", "writeback"):
        return config.generator.num_cpus, config.generator.num_gpus
    if role == "embedder":
        return config.embedder.num_cpus, config.embedder.num_gpus
    t = config.zerorag.tune.trainer
    return t.num_cpus, t.num_gpus


def _calibrate_role(config: dict, role: str, questions, docs, texts, seconds: float) -> dict[str, Any]:
    entered = time.time()
    config = WbragConfig.model_validate(config)
    if role == "generator":
        record = calibrate_generator(config, questions, docs, seconds)
    elif role == "writeback":
        from wbrag_ray.plan.selection import (
            SAMPLE_PASSAGES,
            calibrate_writeback,
            corpus_passages,
            sample_rows,
        )

        passages = corpus_passages(config.ingest.corpus, SAMPLE_PASSAGES)
        whole = len(passages) if len(passages) < SAMPLE_PASSAGES else None  # read to its end: the whole corpus
        rows = sample_rows(config.writeback.train)
        if not rows or not passages:
            raise ValueError(f"write-back calibration needs a local training set and corpus (writeback.train "
                             f"{config.writeback.train!r}, ingest.corpus {config.ingest.corpus!r})")
        record = calibrate_writeback(config, rows, passages, whole, seconds)
        record["loaded_at"] = entered  # its loads are inside its measurement; the generator record has them
    elif role == "embedder":
        record = calibrate_embedder(config, texts, seconds)
    else:
        record = calibrate_training(config, seconds)
    return {**record, "entered": entered, "load_seconds": record.pop("loaded_at") - entered}


def _key(record: dict[str, Any]) -> str:
    return json.dumps([record["role"], record["model"], record.get("backend"), record.get("batch_size"),
                       record["hardware"], record.get("train")], sort_keys=True)


def save(records: list[dict[str, Any]], run: str | None = None, cache: Path | None = None) -> None:
    """Merge `records` into the cache (newer replaces older) and, with `run`, write them to the run folder."""
    path = cache or cache_path()
    found = {_key(r): r for r in load_cache(path)}
    found.update({_key(r): r for r in records})
    from wbrag_ray.storage import resolve

    resolve(str(path)).write_json(list(found.values()))  # temp-then-move, a name of this writer's own
    if run:
        from wbrag_ray.run import RunFolder

        RunFolder(run).layout.calibration.write_json(records)


def load_cache(path: Path | None = None) -> list[dict[str, Any]]:
    path = path or cache_path()
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, list) else []
    except (OSError, ValueError):
        return []


def load_records(run: str | None = None, cache: Path | None = None) -> list[dict[str, Any]]:
    """The run folder's records (with `run`, where it has them), then the cache's."""
    out: list[dict[str, Any]] = []
    if run:
        from wbrag_ray.run import RunFolder

        try:
            out += RunFolder(run).layout.calibration.read_json()
        except (OSError, ValueError, TypeError):
            pass
    return out + load_cache(cache)


def this_hardware(device: str, dtype: str, threads: int) -> dict[str, Any]:
    """The hardware a stage of this machine would run on, to match records against (`hardware`'s fields)."""
    return hardware(device, dtype, threads)


def find(records: list[dict[str, Any]], role: str, model: str, want: dict[str, Any],
         backend: str | None = None) -> dict[str, Any] | None:
    """The first record of `role` for `model` (and `backend`) measured on hardware `want`: None where none was."""
    for r in records:
        if r.get("role") == role and r.get("model") == model and r.get("hardware") == want \
                and (backend is None or r.get("backend") in (None, backend)):
            return r
    return None
