"""A model stage's time from the best rate there is for the hardware it runs on, in this order:

    calibrated  a rate `wbrag plan --calibrate` measured on this cluster's hardware (`calibrate`), matched by
                device, CPU model and flags, dtype and threads (a GPU: by the accelerator's name and dtype)
    benchmark   a CPU rate the project's benchmarks measured (`rates`), scaled to the model and threads
    estimate    FLOPs and bytes against the accelerator's peaks (`accelerators`), GPU stages without a rate

A calibrated generator's time is a cost per call plus a cost per prompt token, from its two measured prompt
lengths; the per-call part (decoding) scales with the pass's new tokens. Its service's start (the worker and the
model's load, measured) is added once per run, to the first stage that starts it: `wbrag run` keeps the services
up from one stage to the next.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from wbrag_ray.config import EmbedderConfig, GeneratorConfig, TrainerConfig
from wbrag_ray.plan.accelerators import Accelerator, encode_seconds, generation_seconds, training_seconds
from wbrag_ray.plan.models import model_size
from wbrag_ray.plan.tokens import TOKEN_UNITS, TokenShape

SOURCES = ("calibrated", "benchmark", "estimate")


@dataclass
class Timing:
    """What a plan times its model stages with: the accelerator of its GPU stages, the calibration records, the
    run's prompt shapes; remembers which services a stage already started."""

    gpu: Accelerator
    records: list[dict[str, Any]]
    shape: TokenShape
    started: set[str] = field(default_factory=set)
    used: list[dict[str, Any]] = field(default_factory=list)  # the records a stage's time came from
    stale: list[dict[str, Any]] = field(default_factory=list)  # generator records of an earlier version's units

    # --- matching a record to the hardware a stage runs on ----------------------------------------------------

    def _want(self, num_gpus: float, dtype: str, threads: int) -> dict[str, Any]:
        from wbrag_ray.models.hardware import resolved_dtype_name
        from wbrag_ray.plan.calibrate import hardware

        if num_gpus > 0:
            return {"device": self.gpu.name, "dtype": dtype if dtype != "auto" else "auto (gpu)"}
        return hardware("cpu", resolved_dtype_name(dtype, 0), threads)

    def record(self, role: str, model: str, num_gpus: float, dtype: str, threads: int,
               backend: str | None = None) -> dict[str, Any] | None:
        want = self._want(num_gpus, dtype, threads)
        for r in self.records:
            hw = r.get("hardware") or {}
            if r.get("role") != role or r.get("model") != model or (backend and r.get("backend") not in (None, backend)):
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

    def _use(self, record: dict[str, Any]) -> dict[str, Any]:
        if not any(r is record for r in self.used):
            self.used.append(record)
        return record

    def cluster_start(self, cpus: float) -> float:
        """The run's own start (the driver's imports, a local Ray cluster's start), where calibration measured it
        on a cluster of this CPU kind and count; 0 otherwise."""
        from wbrag_ray.plan.calibrate import hardware

        want = {k: v for k, v in hardware("cpu", "", 0).items() if k in ("cpu", "cpu_flags")}
        for r in self.records:
            hw = r.get("hardware") or {}
            if r.get("role") == "cluster" and r.get("cpus") == cpus and all(hw.get(k) == v for k, v in want.items()):
                return self._use(r).get("start_seconds", 0.0)
        return 0.0

    # --- generation ------------------------------------------------------------------------------------------

    def generation(self, g: GeneratorConfig, calls: int, docs: int, new_tokens: int | None = None,
                   doc_tokens: float | None = None, mixture: bool = False, template: float | None = None,
                   question: float | None = None) -> tuple[float | None, str, str | None]:
        """(seconds, how, source) of `calls` calls of prompts holding `docs` documents (of `doc_tokens`), each
        decoding up to `new_tokens` (default max_new_tokens); `mixture`: RePlug's groups of `docs` one-document
        prompts decoded as one answer (a call each); `template`, `question`: see `TokenShape.prompt`."""
        from wbrag_ray.plan.stages import generation_time, threads_of

        new = new_tokens or g.max_new_tokens
        prompt = self.shape.prompt(1 if mixture else docs, doc_tokens, template, question)
        threads = threads_of(g.num_cpus, g.threads)
        rec = self.record("generator", g.model, g.num_gpus, g.dtype, threads, g.backend)
        if rec is not None:
            per_call, how = _per_call(rec, prompt, new, docs if mixture else 0)
            if per_call is not None:
                seconds = calls * per_call / max(1, g.concurrency)
                return seconds, f"{calls:,} calls x {how} / {g.concurrency} actor(s) [calibrated]", "calibrated"
        size = model_size(g.model)
        if g.num_gpus > 0 and g.backend != "openai" and size.params:
            tp, pp = g.parallel_sizes()
            gpus = max(g.num_gpus, tp * pp)
            n = calls * (docs if mixture else 1)
            seconds, how = generation_seconds(self.gpu, size.params, n, prompt, new, gpus, g.concurrency)
            return seconds, how, "estimate"
        key = "closed_book" if docs == 0 and not mixture else "rag"
        seconds, how, keys = generation_time(g, calls * (docs if mixture else 1), key)
        return seconds, how, "benchmark" if keys else None

    def service_start(self, role: str, model: str, num_gpus: float, dtype: str, threads: int,
                      backend: str | None = None, service: str | None = None) -> tuple[float, str]:
        """Seconds to start a service's actor and load its model (`service`: which actors, default the role's),
        the first time a plan's stage asks for it (calibrated only: the benchmarks timed steady rates); (0, "")
        after that or without a record."""
        key = f"{service or role}:{model}"
        rec = self.record(role, model, num_gpus, dtype, threads, backend)
        if key in self.started or rec is None or role == "cluster":
            return 0.0, ""
        self.started.add(key)
        seconds = rec.get("service_start_seconds") or rec.get("start_seconds", 0.0) + rec.get("load_seconds", 0.0)
        # the prompt shapes' first use: paid once per run, by its first pass (kernels built per shape on CPUs)
        seconds += sum(max(0.0, p.get("first_use_seconds", 0.0)) for p in rec.get("points", []))
        return seconds, f"{service or role} start, load and first use {seconds:.0f} s [calibrated]"

    # --- embedding and training ------------------------------------------------------------------------------

    def embedding(self, e: EmbedderConfig, texts: int, tokens: float, actors: int) -> tuple[float | None, str, str | None]:
        from wbrag_ray.plan.stages import threads_of

        rec = self.record("embedder", e.model, e.num_gpus, e.dtype, threads_of(e.num_cpus, e.threads))
        if rec is not None:
            per_token = rec["seconds_per_token"]
            seconds = texts * tokens * per_token / max(1, actors)
            return seconds, (f"{texts:,} texts x {tokens:,.0f} tokens x {per_token * 1e3:.3g} ms a token / {actors} "
                             "actor(s) [calibrated]"), "calibrated"
        size = model_size(e.model)
        if e.num_gpus > 0 and size.params:
            seconds, how = encode_seconds(self.gpu, size.params, texts, tokens, e.num_gpus, actors)
            return seconds, how, "estimate"
        return None, "", None

    def training(self, model: str, trainer: TrainerConfig, threads: int | None, steps: int, batch: int,
                 max_length: int, generator_model: str) -> tuple[float | None, str, str | None]:
        """A LoRA training's compute: calibrated seconds a token (scaled by parameters from the generator's
        model it was measured with), or on GPUs tokens x 6 x params; None: the caller's benchmark rule."""
        from wbrag_ray.plan.stages import threads_of

        tokens = steps * batch * max_length
        workers = trainer.num_workers if isinstance(trainer.num_workers, int) else 1
        size, measured = model_size(model), model_size(generator_model)
        from wbrag_ray.plan.calibrate import training_dtype

        rec = self.record("training", generator_model, trainer.num_gpus, training_dtype(trainer.num_gpus),
                          threads_of(trainer.num_cpus, threads))
        if rec is not None and size.params and measured.params:
            scale = size.params / measured.params
            seconds = tokens / max(1, workers) * rec["seconds_per_token"] * scale
            return seconds, (f"{tokens:,} tokens / {workers} worker(s) x {rec['seconds_per_token'] * 1e3:.3g} ms a "
                             f"token x {scale:.3g} (params) [calibrated]"), "calibrated"
        if trainer.num_gpus > 0 and size.params:
            seconds, how = training_seconds(self.gpu, size.params, tokens, trainer.num_gpus * workers)
            return seconds, how, "estimate"
        return None, "", None


def _per_call(rec: dict[str, Any], prompt: float, new: int, group: int) -> tuple[float | None, str]:
    """Seconds a call of `prompt` tokens decoding `new` tokens, from a generator record's points: a line through
    the closed-book and K-document points (cost a prompt token, cost a call at `new` tokens); a mixture group of
    `group` prompts from the measured mixture point, scaled by its prompt tokens."""
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
    return f"{r.get('role')} {r.get('model')}: {what}; on {where}, {r.get('date')}"
