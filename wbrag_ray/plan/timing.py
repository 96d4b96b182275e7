"""A model stage's time from the best rate for its hardware: calibrated (`calibrate`, matched by hardware), else
benchmark (`rates`, scaled to the model and threads), else estimate (FLOPs and bytes against `accelerators`' peaks;
an OpenAI-compatible endpoint's stated latency and speed). A service's start is added once, to the first stage
that starts it: `wbrag run` keeps services up between stages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from wbrag_ray.config import EmbedderConfig, GeneratorConfig
from wbrag_ray.models.accelerators import Accelerator
from wbrag_ray.models.hardware import resolved_dtype_name, threads_of
from wbrag_ray.models.size import lora_params, model_size, training_gb, weights_gb
from wbrag_ray.placement.gpus import memory_share
from wbrag_ray.plan.accelerators import (
    DEFAULT_INTERCONNECT,
    STORAGE_READ_GBS,
    Interconnect,
    encode_seconds,
    generation_seconds,
    interconnect,
    load_seconds,
    training_communication,
    training_seconds,
)
from wbrag_ray.plan.calibrate import hardware, training_dtype
from wbrag_ray.plan.rates import RATES
from wbrag_ray.plan.stages import Time, fsdp_mesh, scaled_rate
from wbrag_ray.plan.tokens import TOKEN_UNITS, TokenShape, template_of
from wbrag_ray.work import Pass

SOURCES = ("calibrated", "benchmark", "estimate")


@dataclass
class Timing:
    """What a plan times its model stages with; remembers which services a stage already started."""

    gpu: Accelerator
    records: list[dict[str, Any]]
    shape: TokenShape
    net: Interconnect = field(default_factory=lambda: interconnect(DEFAULT_INTERCONNECT))
    storage_gbs: float = STORAGE_READ_GBS  # a node's read rate of model files
    gpus_per_node: int = 8
    started: set[str] = field(default_factory=set)
    used: list[dict[str, Any]] = field(default_factory=list)  # the records a stage's time came from
    stale: list[dict[str, Any]] = field(default_factory=list)  # generator records of an earlier version's units

    # --- matching a record to the hardware a stage runs on ----------------------------------------------------

    def _want(self, num_gpus: float, dtype: str, threads: int) -> dict[str, Any]:
        if num_gpus > 0:
            return {"device": self.gpu.name, "dtype": dtype if dtype != "auto" else "auto (gpu)"}
        return hardware("cpu", resolved_dtype_name(dtype, 0), threads)

    def record(self, role: str, model: str, num_gpus: float, dtype: str, threads: int,
               backend: str | None = None, **fields: Any) -> dict[str, Any] | None:
        """The first record of `role` for `model` on the hardware of these resources, with these `fields`; or None."""
        want = self._want(num_gpus, dtype, threads)
        for r in self.records:
            hw = r.get("hardware") or {}
            if r.get("role") != role or r.get("model") != model or (backend and r.get("backend") not in (None, backend)):
                continue
            if any(r.get(k) != v for k, v in fields.items()):
                continue
            if role == "generator" and r.get("token_units") != TOKEN_UNITS:
                if not any(x is r for x in self.stale):  # its prompt tokens counted otherwise: not comparable
                    self.stale.append(r)
                continue
            if num_gpus > 0:
                name = hw.get("device", "").replace("-", "").replace(" ", "").lower()
                if want["device"].split("-")[0].lower() in name and hw.get("dtype") == want["dtype"]:
                    return self._use(r)
            elif hw == want:
                return self._use(r)
        return None

    def record_of(self, role: str, s: Any, **fields: Any) -> dict[str, Any] | None:
        """`record` for the model of config section `s` (a generator's or an embedder's) on its resources."""
        return self.record(role, s.model, s.num_gpus, s.dtype, threads_of(s.num_cpus, s.threads),
                           getattr(s, "backend", None), **fields)

    def _use(self, record: dict[str, Any]) -> dict[str, Any]:
        if not any(r is record for r in self.used):
            self.used.append(record)
        return record

    def cluster_start(self, cpus: float) -> float:
        """The run's own start where calibrated on a cluster of this CPU kind and count; 0 otherwise."""
        want = {k: v for k, v in hardware("cpu", "", 0).items() if k in ("cpu", "cpu_flags")}
        for r in self.records:
            hw = r.get("hardware") or {}
            if r.get("role") == "cluster" and r.get("cpus") == cpus and all(hw.get(k) == v for k, v in want.items()):
                return self._use(r).get("start_seconds", 0.0)
        return 0.0

    # --- generation ------------------------------------------------------------------------------------------

    def generation(self, g: GeneratorConfig, calls: int, p: Pass, unit_tokens: float,
                   point: dict[str, Any] | None = None) -> Time:
        """`calls` calls of pass `p` (its documents of `unit_tokens` unless it says); `point`: a calibrated prompt
        kind, used as measured."""
        new = p.new_tokens or g.max_new_tokens
        if g.backend == "openai":  # the endpoint's own rate: a stated latency and output speed, per request
            per_call = ENDPOINT_LATENCY_S + new / ENDPOINT_TOKENS_PER_S
            return Time(calls * per_call / max(1, g.concurrency), (
                f"estimate: {calls:,} calls to the endpoint x ({ENDPOINT_LATENCY_S:g} s + {new} tokens at "
                f"{ENDPOINT_TOKENS_PER_S:g}/s) / {g.concurrency} in flight"), "estimate")
        if point is not None:
            seconds = calls * point["seconds_per_call"] / max(1, g.concurrency)
            return Time(seconds, (f"{point['shape']}: {calls:,} calls x {point['seconds_per_call']:.3g} s ("
                                  f"{point['prompt_tokens']:,.0f} prompt + {point['generated_tokens']:,.0f} generated "
                                  f"tokens a call, measured) / {g.concurrency} actor(s) [calibrated]"), "calibrated")
        docs, mixture = p.docs, p.mixture
        prompt = self.shape.prompt(1 if mixture else docs, p.doc_tokens if p.doc_tokens is not None or not docs
                                   else unit_tokens, template_of(p.prompt, p.prompt_docs) if p.prompt else None,
                                   self.shape.sentence if p.question == "sentence" else None)
        rec = self.record_of("generator", g)
        if rec is not None:
            per_call, how = _per_call(rec, prompt, new, docs if mixture else 0)
            if per_call is not None:
                return Time(calls * per_call / max(1, g.concurrency),
                            f"{calls:,} calls x {how} / {g.concurrency} actor(s) [calibrated]", "calibrated")
        size = model_size(g.model)
        n = calls * (docs if mixture else 1)
        if g.num_gpus > 0 and size.params:
            tp, pp = g.parallel_sizes()
            seconds, how = generation_seconds(self.gpu, size.params, n, prompt, new, max(g.num_gpus, tp * pp),
                                              g.concurrency, size.kv_bytes_per_token(), tp, size.hidden, size.layers,
                                              bool(g.batch_invariance()), memory_share(g))
            return Time(seconds, how, "estimate")
        if g.num_gpus > 0:
            return Time(None, f"no measured rate: {n:,} generator calls on GPUs")
        key = "closed_book" if docs == 0 and not mixture else f"rag_prompt_{g.backend}"
        per_actor, how = scaled_rate(key, size, threads_of(g.num_cpus, g.threads))
        if per_actor is None:
            return Time(None, how)
        return Time(n / (per_actor * g.concurrency), f"{n:,} calls / ({how} x {g.concurrency} actors)", "benchmark",
                    (key,))

    def service_start(self, role: str, s: EmbedderConfig | GeneratorConfig, service: str | None = None,
                      per_node: int = 1) -> Time:
        """The start of a service of config section `s` (its actors and their model's load), the first time a stage
        asks; nothing after that. Calibrated, else an assumed start plus the weights' read at the storage rate."""
        backend = getattr(s, "backend", None)
        key = f"{service or role}:{s.model}"
        if key in self.started:
            return Time(0.0, "")
        self.started.add(key)
        rec = self.record_of(role, s)
        if rec is not None and service == EMBED_PASS and rec.get("pass_start_seconds") is not None:
            # the embed stage's fixed cost, measured on the run's own stage (`calibrate.embed_pass`)
            seconds = rec["pass_start_seconds"]
            return Time(seconds, (f"embed pass start, load and first use {seconds:.1f} s (the run's embed stage on "
                                  f"{rec['pass_texts']} texts in {rec['pass_seconds']:.1f} s, less their tokens at the "
                                  "warm rate) [calibrated]"), "calibrated")
        if rec is not None:
            seconds = rec.get("service_start_seconds") or rec.get("start_seconds", 0.0) + rec.get("load_seconds", 0.0)
            # the prompt shapes' first use, paid once per run
            seconds += sum(max(0.0, p.get("first_use_seconds", 0.0)) for p in rec.get("points", []))
            return Time(seconds, f"{service or role} start, load and first use {seconds:.0f} s [calibrated]",
                        "calibrated")
        weights = weights_gb(model_size(s.model), s.dtype, s.num_gpus > 0)
        if backend == "openai" or weights is None:
            return Time(0.0, "")
        start = ENGINE_START_S if backend == "vllm" and s.num_gpus > 0 else ACTOR_START_S
        load = load_seconds(weights * 1e9, per_node, self.storage_gbs)
        what = "vLLM engine start (compile, CUDA graphs, memory profiling)" if start == ENGINE_START_S else "actor start"
        return Time(start + load, (f"{service or role}: {what} {start:.0f} s (assumed) + load {weights:,.1f} GB x "
                                   f"{per_node} actor(s) a node at {self.storage_gbs:g} GB/s a node {load:.0f} s "
                                   "(estimate)"), "estimate")

    # --- embedding and training ------------------------------------------------------------------------------

    def embedding(self, e: EmbedderConfig, texts: int, unit: str, tokens: float) -> Time:
        """`texts` index units (`unit`) of `tokens` each embedded by the embedder's `concurrency` actors."""
        rec = self.record_of("embedder", e)
        actors = e.concurrency
        if rec is not None:
            per_token = rec["seconds_per_token"]
            return Time(texts * tokens * per_token / max(1, actors), (
                f"{texts:,} texts x {tokens:,.0f} tokens x {per_token * 1e3:.3g} ms a token / {actors} actor(s) "
                "[calibrated]"), "calibrated")
        size = model_size(e.model)
        if e.num_gpus > 0:
            if not size.params:
                return Time(None, f"{e.model}: size unknown, no estimate")
            return Time(*encode_seconds(self.gpu, size.params, texts, tokens, e.num_gpus, actors), "estimate")
        per_actor, how = scaled_rate("embed", size, threads_of(e.num_cpus, e.threads))
        if per_actor is None:
            return Time(None, how)
        if unit == "passage":  # the rate is of sentences; a passage is about this many sentences of tokens
            per_actor /= RATES["sentences_per_passage"].value
            how += f" / {RATES['sentences_per_passage'].value} sentences a passage"
        return Time(texts / (per_actor * actors), f"{texts:,} / ({how} x {actors} actors)", None,
                    ("embed",) + (("sentences_per_passage",) if unit == "passage" else ()))

    def training(self, model: str, section: Any, steps: int, batch: int, row_tokens: float,
                 generator_model: str) -> tuple[Time, Time, dict[str, float]]:
        """A LoRA training's compute (calibrated; on GPUs compute, collectives and load estimated; on CPUs the
        benchmark's step scaled), Ray Train's start (calibrated, else the benchmark's), and the estimate's parts."""
        trainer = section.trainer
        tokens = steps * batch * row_tokens
        workers = trainer.num_workers if isinstance(trainer.num_workers, int) else 1
        size, measured = model_size(model), model_size(generator_model)
        rec = self.record("training", generator_model, trainer.num_gpus, training_dtype(trainer.num_gpus),
                          threads_of(trainer.num_cpus, section.threads))
        parts: dict[str, float] = {}
        if rec is not None and size.params and measured.params:
            scale = size.params / measured.params
            seconds = tokens / max(1, workers) * rec["seconds_per_token"] * scale
            compute = Time(seconds, (f"{tokens:,.0f} tokens / {workers} worker(s) x {rec['seconds_per_token'] * 1e3:.3g}"
                                     f" ms a token x {scale:.3g} (params) [calibrated]"), "calibrated")
            parts = {"compute": seconds}
        elif trainer.num_gpus > 0 and size.params:
            seconds, how = training_seconds(self.gpu, size.params, tokens, trainer.num_gpus * workers)
            per_node = max(1, min(workers, int(self.gpus_per_node // max(trainer.num_gpus, 1e-9)) or 1))
            need = math.ceil((training_gb(size, True) or 0.0) / max(self.gpu.memory_gb, 1e-9)) or 1
            replicas, _ = fsdp_mesh(workers, per_node, need)
            comm_step, comm_how = training_communication(
                self.gpu, self.net, size.params, lora_params(size, section.lora_r, section.target_modules), workers,
                per_node, trainer.strategy, size.layers, hybrid=replicas > 1)
            comm = steps * comm_step
            # communication overlaps compute (FSDP2 prefetch, DDP's all-reduce): only the excess is exposed
            exposed = max(0.0, comm - seconds)
            weights = (weights_gb(size, "auto", True) or 0.0) * 1e9
            readers = 1 if trainer.strategy == "fsdp" else per_node
            load = load_seconds(weights, readers, self.storage_gbs)
            parts = {"compute": seconds, "communication": comm, "of it exposed": exposed, "load": load}
            compute = Time(seconds + exposed + load, (
                f"compute {seconds:,.0f} s: {how}; communication {comm:,.0f} s, {exposed:,.0f} s of it beyond the "
                f"compute it overlaps: {steps:,} steps x {comm_step:.3g} s ({comm_how}); load {load:,.0f} s: "
                f"{weights / 1e9:,.1f} GB x {readers} reader(s) a node at {self.storage_gbs:g} GB/s (estimate)"),
                "estimate")
        else:
            compute = _cpu_training(size, trainer, steps, batch, row_tokens)
        # Ray Train's start, measured where calibrated; the model's load is in the estimate already
        calibrated = compute.source == "calibrated"
        measured_start = rec.get("train_start_seconds") if calibrated else None
        start = RATES["train_start"].value if measured_start is None else measured_start
        load = rec.get("load_seconds", 0.0) if calibrated else 0.0
        return compute, Time(start + load, f"Ray Train start {start:.0f} s "
                             + ("[train_start]" if measured_start is None else "[calibrated]")
                             + (f" + model load {load:.0f} s" if calibrated else ""),
                             "benchmark" if measured_start is None else "calibrated",
                             ("train_start",) if measured_start is None else ()), parts


def _cpu_training(size, trainer, steps: int, batch: int, row_tokens: float) -> Time:
    """The CPU benchmark's LoRA step ([lora_step]: 4 examples x 128 tokens), scaled to this training."""
    if trainer.num_gpus > 0:
        return Time(None, f"no measured rate: {steps:,} steps of {batch} examples on GPUs")
    if size.params is None:
        return Time(None, f"{size.name}: size unknown, no rate")
    rate = RATES["lora_step"]
    per_worker = batch / trainer.num_workers
    factor = (size.params / rate.reference_params * per_worker / 4 * row_tokens / 128
              * rate.threads / threads_of(trainer.num_cpus, None))
    return Time(steps * rate.value * factor, (f"{steps:,} steps x {rate.value:g} s [lora_step] x {factor:.3g} (params, "
                                              f"{per_worker:g} examples x {row_tokens:,.0f} tokens per worker, threads)"),
                "benchmark", ("lora_step",))


EMBED_PASS = "embed actor"  # the embed stage's service name: its calibrated start is the stage timed whole
ACTOR_START_S = 10.0  # an actor's start, assumed (RESULTS.md, "Ray overhead": 7-11 s)
ENGINE_START_S = 60.0  # a vLLM engine's start beside its weights' read, assumed
# an OpenAI-compatible endpoint: its rate is the provider's; assumed, and labeled an estimate
ENDPOINT_LATENCY_S = 0.5  # a request's time to its first token
ENDPOINT_TOKENS_PER_S = 60.0  # output tokens a second of one request


def _per_call(rec: dict[str, Any], prompt: float, new: int, group: int) -> tuple[float | None, str]:
    """Seconds a call of `prompt` tokens decoding `new`: a line through a record's two prompt lengths."""
    points = [p for p in rec.get("points", []) if p["shape"] != "mixture"]
    if group:
        mix = next((p for p in rec.get("points", []) if p["shape"] == "mixture"), None)
        if mix is None:
            return None, ""
        scale = group / mix.get("prompts_per_call", group) * new / mix["new_tokens"]
        return mix["seconds_per_call"] * scale, f"{mix['seconds_per_call']:.3g} s a mixture of {group} x {scale:.3g}"
    if not points:
        return None, ""
    if len(points) == 1:
        p = points[0]
        return p["seconds_per_call"] * new / p["new_tokens"], f"{p['seconds_per_call']:.3g} s a call"
    lo, hi = sorted(points, key=lambda p: p["prompt_tokens"])[:2]
    span = max(hi["prompt_tokens"] - lo["prompt_tokens"], 1e-9)
    per_token = max(0.0, (hi["seconds_per_call"] - lo["seconds_per_call"]) / span)
    per_call = max(0.0, lo["seconds_per_call"] - per_token * lo["prompt_tokens"]) * new / lo["new_tokens"]
    return per_call + per_token * prompt, (f"({per_call:.3g} s + {prompt:,.0f} prompt tokens x {per_token * 1e3:.3g} "
                                           "ms)")


def describe_record(r: dict[str, Any]) -> str:
    """One line of a calibration record: what ran, on what, when, and what was measured."""
    hw = r.get("hardware") or {}
    where = f"{hw.get('device')}, {hw.get('cpu')} ({hw.get('cpu_flags')}), {hw.get('dtype')}, {hw.get('threads')} threads"
    if r.get("role") == "cluster":
        return f"the run's start {r.get('start_seconds', 0):.1f} s ({r.get('cpus'):g} CPUs, {hw.get('cpu')}), {r.get('date')}"
    if r.get("role") == "writeback":
        return f"{_writeback(r)}; on {where}, {r.get('date')}"
    if r.get("role") == "generator":
        pts = "; ".join(f"{p['shape']}: {p['seconds_per_call']:.3g} s a call at {p['prompt_tokens']:.0f} prompt tokens"
                        for p in r.get("points", []))
        what = f"{pts}; start {r.get('start_seconds', 0):.1f} s + load {r.get('load_seconds', 0):.1f} s"
        first = sum(max(0.0, p.get("first_use_seconds", 0.0)) for p in r.get("points", []))
        what += f"; the prompt shapes' first use {first:.1f} s" if first else ""
        if r.get("service_start_seconds"):
            what += f"; its service to a first answer {r['service_start_seconds']:.1f} s"
    else:
        what = (f"{r.get('seconds_per_token', 0) * 1e3:.3g} ms a token; start {r.get('start_seconds', 0):.1f} s + "
                f"load {r.get('load_seconds', 0):.1f} s")
        if r.get("pass_start_seconds") is not None:
            what += (f"; the run's embed stage on {r['pass_texts']} texts {r['pass_seconds']:.1f} s, its start "
                     f"{r['pass_start_seconds']:.1f} s")
        if r.get("tokenizer_tokens_per_text"):
            what += (f"; {r['tokens_per_text']:.0f} tokens a text at 4 characters a token, "
                     f"{r['tokenizer_tokens_per_text']:.0f} by its tokenizer")
    return f"{r.get('role')} {r.get('model')}: {what}; on {where}, {r.get('date')}"


def _writeback(r: dict[str, Any]) -> str:
    """A write-back record: the keep rate with its interval and sample, and the passes' prompt kinds."""
    lo, hi = r["keep_interval"]
    whole = r.get("corpus_passages") is not None
    kinds = "; ".join(f"{p['shape']} {p['seconds_per_call']:.3g} s a call, {p['prompt_tokens']:.0f} prompt + "
                      f"{p['generated_tokens']:.0f} generated tokens" for p in r["points"])
    return (f"write-back of {r['train']}: the utility gate kept {r['kept']} of {r['questions']} sampled training "
            f"questions ({r['keep_rate']:.1%}, 95% Wilson interval {lo:.1%}-{hi:.1%}; {r['metric']}, "
            f"{r['rag_method']}, top {r['top_k']} of "
            + ("the whole corpus" if whole else f"the first {r['passages_searched']:,} passages (a sample of the "
               "corpus)")
            + f"); {r['retained_docs']:.2g} documents retained a kept example; "
            + (kinds or "none kept: the distiller's calls not measured"))
