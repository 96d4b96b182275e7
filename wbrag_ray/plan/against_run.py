"""The plan beside the run: `wbrag run` stores it (RUN/plan/plan.json) and refuses a config it cannot place; the
report puts each stage's planned time beside the measured one.
"""

from __future__ import annotations

import re
import time
from typing import Any

from wbrag_ray.config import ConfigError, WbragConfig


def record_plan(config: WbragConfig, run_dir: str, name: str = "", force: bool = False) -> dict[str, Any] | None:
    """Store the plan of `config` on the run's Ray cluster in the run folder and refuse, unless `force`, a config
    it cannot place. Returns the record; None where no plan could be made."""
    from wbrag_ray.plan import format_plan, plan_data, run_plan
    from wbrag_ray.ray_runtime import init_ray
    from wbrag_ray.run import RunFolder

    init_ray(config.ray, run_dir)
    plan = run_plan(config, run_dir)
    if plan is None:
        return None
    plan.config_name = name
    import psutil

    record = {**plan_data(plan), "config": name, "made": time.strftime("%Y-%m-%d %H:%M:%S"), "forced": force,
              "started_at": psutil.Process().create_time(), "text": format_plan(plan)}
    RunFolder(run_dir).layout.plan.write_json(record)
    unplaced = [s.name for s in plan.stages if not s.fits]
    if not plan.places and not force:
        raise ConfigError(f"the plan says {len(unplaced) or 'some'} stage(s) cannot be placed on this cluster "
                          f"({', '.join(unplaced) or 'see below'}), so nothing ran: "
                          + "; ".join(plan.problems[:3]) + ". Change what each problem names (`wbrag plan CONFIG` "
                          "prints all of it), or pass --force to run anyway")
    return record


def load_plan(run) -> dict[str, Any] | None:
    """The plan `wbrag run` stored in the run folder (a RunFolder), or None."""
    loc = run.layout.plan
    try:
        return loc.read_json() if loc.exists() else None
    except (OSError, ValueError):
        return None


def planned_vs_measured(plan: dict[str, Any], stats: dict[str, dict[str, Any]],
                        wall: float | None = None) -> list[dict[str, Any]]:
    """Each planned stage's planned and measured seconds, then the totals and the run's `wall` time."""
    names = list(stats)
    rows, planned_sum, measured_sum, claimed = [], 0.0, 0.0, set()
    for s in plan.get("stages", []):
        pattern = s["measured_by"]
        matched = [n for n in names if pattern and re.fullmatch(pattern, n)]
        run_names = [n for n in matched if n not in claimed]  # a run stage measures one plan stage, the first
        claimed.update(run_names)
        measured = sum((stats[n] or {}).get("seconds", 0.0) for n in run_names) if run_names else None
        planned = s.get("seconds")
        rows.append({"stage": s["name"], "planned_s": planned, "rate_source": s.get("rate_source"),
                     "run_stages": run_names or [f"with {n}" for n in matched], "measured_s": measured,
                     "ratio": measured / planned if measured is not None and planned else None})
        if planned is not None and matched:
            planned_sum += planned
            measured_sum += measured or 0.0
    rows.append({"stage": "the stages together", "planned_s": planned_sum, "rate_source": None, "run_stages": [],
                 "measured_s": measured_sum, "ratio": measured_sum / planned_sum if planned_sum else None})
    if wall is not None:
        total = plan.get("total_seconds")
        rows.append({"stage": "the run, start to last stage (wall)", "planned_s": total, "rate_source": None,
                     "run_stages": [], "measured_s": wall, "ratio": wall / total if total else None})
    return rows


def run_wall_seconds(run, plan: dict[str, Any]) -> float | None:
    """Seconds from the start of the `wbrag run` that stored `plan` to the last stage's completion marker."""
    started = plan.get("started_at")
    ends = []
    for name in run.completed_stages():
        loc = run.layout.stage(name).success
        info = loc.fs.get_file_info(loc.path)
        if info.mtime is not None:
            ends.append(info.mtime.timestamp())
    return max(ends) - started if started and ends and max(ends) > started else None
