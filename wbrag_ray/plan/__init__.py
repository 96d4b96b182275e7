"""`wbrag plan`: what a config will ask of a cluster before it runs, and about how long it will take. `planner`
walks the registry, `stages` sizes each stage, `timing` prices it from `calibrate`d, benchmark (`rates`) or
estimated rates; nothing starts Ray or loads a model, except `--calibrate`."""

from __future__ import annotations

import logging

from wbrag_ray.config import WbragConfig
from wbrag_ray.models.accelerators import DEFAULT_GPU_MEMORY_GB
from wbrag_ray.models.size import MEMORY_RULE
from wbrag_ray.placement import Cluster, Node, cluster_from_ray, stated_cluster
from wbrag_ray.plan.accelerators import EFFICIENCY_NOTE
from wbrag_ray.plan.calibrate import load_records
from wbrag_ray.plan.planner import Plan, idle_gpus, make_plan
from wbrag_ray.plan.rates import RATES

log = logging.getLogger(__name__)

__all__ = ["Cluster", "Node", "Plan", "cluster_from_ray", "format_plan", "format_summary", "make_plan",
           "plan_data", "run_plan", "run_summary", "stated_cluster"]


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "no estimate"
    if seconds < 60:
        return "under a minute"
    if seconds < 3600:
        return f"about {seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"about {seconds / 3600:.1f} h"
    return f"about {seconds / 86400:.1f} days"


def format_plan(plan: Plan) -> str:
    lines = [f"plan of {plan.config_name}" if plan.config_name else "plan",
             f"cluster: {plan.cluster.describe()}"]
    c = plan.corpus
    size = f"{c.passages:,} passages, {c.sentences:,} sentences" if c.passages is not None else "size unknown"
    lines.append(f"corpus: {size} ({c.source})")
    for i, stage in enumerate(plan.stages, 1):
        left_out = f" + {stage.left_out} (no measured rate)" if stage.left_out else ""
        lines += ["", f"{i:>2}. {stage.name}: {duration(stage.seconds)}{left_out}"]
        lines += [f"      asks: {b.describe()}" for b in stage.bundles] or ["      asks: nothing of the cluster"]
        lines.append(f"      work: {stage.work}")
        if stage.how:
            lines.append(f"      time ({stage.rate_source or 'none'}): {stage.how}")
        if plan.cluster.gpus:
            lines.append(f"      {_gpus(stage, plan.cluster.gpus, plan.gpu_hour_price)}")
        lines += [f"      - {note}" for note in stage.notes]
    lines += ["", _totals(plan)]
    lines += [f"warning: {w}" for w in plan.warnings]
    if plan.problems:
        lines += ["", f"REFUSED: this config cannot be placed on this cluster ({len(plan.problems)} problem(s)):"]
        lines += [f"  - {p}" for p in plan.problems]
    else:
        lines.append("placement: every stage's bundles fit this cluster")
    used = dict.fromkeys([*plan.corpus.rates, *(k for s in plan.stages for k in s.rates)])
    lines += ["", "rates: calibrated (measured by `wbrag plan --calibrate` on this hardware), benchmark (measured by "
              "the project's benchmarks, on CPUs), estimate (FLOPs and bytes against the accelerator's peaks)"]
    lines += [f"  [{k}] {RATES[k].provenance()}" for k in used] or ["  no benchmark rate used"]
    lines += [f"  calibrated: {r}" for r in plan.calibrated]
    if any(s.rate_source == "estimate" for s in plan.stages) and plan.cluster.gpus:
        lines += [f"  GPU: {plan.gpu.describe()}; {EFFICIENCY_NOTE}"]
        if plan.network is not None and len(plan.cluster.nodes) > 1:
            lines += [f"  network between nodes (--interconnect): {plan.network.describe()}"]
    if any("(estimate)" in s.how for s in plan.stages):
        lines += [f"  model files: read at {plan.storage_gbs:g} GB/s a node (--storage-read-gbs; assumed); an actor's "
                  "start and a vLLM engine's are assumed where no calibration measured them"]
    lines += [f"  prompt tokens: {plan.tokens.source}"] if plan.tokens else []
    if not any(c.startswith("generator ") for c in plan.calibrated) and any("calls" in s.how for s in plan.stages):
        lines += ["  generated tokens: not measured for this config (a GPU estimate decodes each pass's max_new_tokens, "
                  "an upper bound; a CPU benchmark rate is a call's at the benchmark's lengths): `--calibrate` times "
                  "the calls as they generate on the config's own data"]
    lines += [f"memory: {MEMORY_RULE}"]
    return "\n".join(lines)


def _gpus(stage, total: float, price: float | None = None) -> str:
    """"GPUs: 28 of 32", with GPU-hours, their cost at `price`, and what would use idle GPUs."""
    hours, idle = stage.gpu_hours, idle_gpus(stage, total)
    return (f"GPUs: {stage.gpus:g} of {total:g}" + (f", {hours:,.1f} GPU-hours" if hours else "")
            + (f" ({_money(hours * price)})" if hours and price else "")
            + (f" ({total - stage.gpus:g} idle: {stage.more_gpus})" if idle else ""))


def _money(amount: float) -> str:
    return f"{amount:,.2f} at the stated GPU-hour price"


def plan_data(plan: Plan) -> dict:
    """The plan as data (`wbrag plan --json`): each stage's seconds, rate source, GPUs and fit; the totals."""
    timed = [s.seconds for s in plan.stages if s.seconds is not None]
    hours = sum(s.gpu_hours or 0.0 for s in plan.stages)
    return {"stages": [{"name": s.name, "seconds": s.seconds, "rate_source": s.rate_source, "gpus": s.gpus,
                        "gpu_hours": s.gpu_hours, "fits": s.fits, "measured_by": s.measured_by}
                       for s in plan.stages],
            "total_seconds": sum(timed) + plan.start_seconds if timed else None, "start_seconds": plan.start_seconds,
            "gpus_total": plan.cluster.gpus, "gpu": plan.gpu.name, "gpu_hours_total": hours,
            "cost": hours * plan.gpu_hour_price if plan.gpu_hour_price else None, "places": plan.places,
            "warnings": plan.warnings, "problems": plan.problems}


def _totals(plan: Plan) -> str:
    timed = [s for s in plan.stages if s.seconds is not None]
    untimed = [s.name for s in plan.stages if s.seconds is None]
    left_out = [f"{s.left_out} ({s.name})" for s in timed if s.left_out]
    total = sum(s.seconds for s in timed) + (plan.start_seconds if timed else 0.0)
    sources = ", ".join(f"{n} {k}" for k in ("calibrated", "benchmark", "estimate")
                        if (n := sum(s.rate_source == k for s in timed)))
    text = f"estimated time of {len(timed)} stage(s) ({sources or 'none timed'}): {duration(total)}"
    text += f" ({total:,.0f} s, the run's start {plan.start_seconds:.0f} s included)" if plan.start_seconds else ""
    text += f" + {', '.join(left_out)}" if left_out else ""
    hours = sum(s.gpu_hours or 0.0 for s in timed)
    text += f" ({hours:,.1f} GPU-hours" + (f", {_money(hours * plan.gpu_hour_price)}" if plan.gpu_hour_price else "") \
        + ")" if hours else ""
    return text + (f"; no estimate for {len(untimed)}: {', '.join(untimed)}" if untimed else "")


def format_summary(plan: Plan) -> str:
    """A few lines: the cluster, the largest GPU ask, the estimated time and the first problems."""
    gpu_ask = [(sum(b.gpus * b.count for b in s.bundles if b.kind != "task"), s.name) for s in plan.stages]
    gpus, where = max(gpu_ask, default=(0.0, ""))
    lines = [f"plan ({len(plan.stages)} stages on {plan.cluster.describe()}; `wbrag plan CONFIG` prints all of it):",
             "  " + _totals(plan)]
    if gpus:
        lines.append(f"  most GPUs at once: {gpus:g} of {plan.cluster.gpus:g} ({where})")
    lines += [f"  would not place: {p}" for p in plan.problems[:3]]
    return "\n".join(lines)


def run_summary(config: WbragConfig, run: str | None = None) -> str | None:
    """The plan's summary on the connected Ray cluster; None when not connected or no plan can be made."""
    plan = run_plan(config, run)
    return None if plan is None else format_summary(plan)


def run_plan(config: WbragConfig, run: str | None = None) -> Plan | None:
    """The plan of `config` on the connected Ray cluster (GPUs of `ray.gpu_memory_gb`, else the default's memory)
    with the stored calibration records; None when there is no cluster or no plan can be made."""
    cluster = cluster_from_ray(config.ray.gpu_memory_gb or DEFAULT_GPU_MEMORY_GB)
    if cluster is None:
        return None
    try:
        return make_plan(config, cluster, run=run, records=load_records(run))
    except Exception as exc:  # noqa: BLE001 - a plan is advice here: whatever fails, the run's own checks decide
        log.debug("no plan: %s", exc, exc_info=exc)
        return None
