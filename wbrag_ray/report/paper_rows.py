"""The report's view of the papers (`wbrag_ray.papers`): the "Paper vs this run" section and the departures the
Configuration section lists, as the evaluations' metrics.json recorded them."""

from __future__ import annotations

from typing import Any

from wbrag_ray.config import WbragConfig
from wbrag_ray.evaluation.evaluate import load_results
from wbrag_ray.papers import paper_vs_run, recorded_departures, run_departures
from wbrag_ray.report.render import Section, Table
from wbrag_ray.run import RunFolder


def paper_section(run: RunFolder) -> Section | None:
    rows = run_paper_rows(run, run.load_config() if run.layout.run_json.exists() else None)
    if not rows:
        return None
    sec = Section("Paper vs this run")
    sec.text = ("Each number of the papers (wbrag_ray/paper_numbers.py, cited from their texts) that a result of this "
                "run measures: the same paper's dataset, RAG method and setting (write-back or not, the gates of a "
                "Table 4 row; the pruning ratio, router and adapter of a Zero-RAG row). Acc, EM and F1 in %. Both "
                "models are named: with another model the numbers compare the method, not the reproduction. Every "
                "setting of the run's result that changes a number and differs from what made the paper's is listed.")
    sec.tables.append(Table("the paper's row and the run's", [
        "paper", "where", "row", "column", "paper", "paper's model", "this run", "run's model", "run's result",
        "run's settings that differ", "the paper's words"],
        [[r["paper"], r["where"], r["row"], r["column"], r["paper_shown"], r["paper_model"], r["run_value"],
          r["run_model"] or "", r["run_result"], "; ".join(r["differs"]) or "none", r["quote"]] for r in rows]))
    return sec


def run_paper_rows(run: RunFolder, config: WbragConfig | None) -> list[dict[str, Any]]:
    """`papers.paper_vs_run` over a run's evaluations and its Zero-RAG grid: what `wbrag eval` prints as it ends."""
    grid_file = run.layout.zero_rag.grid
    grid = grid_file.read_json() if grid_file.exists() else {}
    return paper_vs_run(load_results(run), grid.get("rows", []), config, grid.get("dataset"))


def departures_tables(run: RunFolder) -> list[Table]:
    """The departures the run's evaluations recorded, each with the results it applies to; for a run that
    evaluated nothing yet, its config's, as `wbrag run` printed them."""
    results = load_results(run)
    found = recorded_departures(results)
    if found:
        every = len(results)
        rows = [[d["paper"], d["kind"], d["what"], d.get("cites", ""),
                 "all" if len(names) == every else ", ".join(names)] for d, names in found]
        return [Table("where this run's results depart from the papers (as each metrics.json records them)",
                      ["paper", "kind", "departure", "the paper's words (or whose choice)", "results"], rows)]
    departed = run_departures(run.load_config())
    if not departed:
        return []
    return [Table("where this run's config departs from the papers (nothing evaluated yet)",
                  ["paper", "kind", "departure", "the paper's words (or whose choice)"],
                  [[d.paper, d.kind, d.what, d.cites] for d in departed])]
