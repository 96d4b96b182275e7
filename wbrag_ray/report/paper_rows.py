"""The report's "paper vs this run" section: each headline number of the two papers (`papers.HEADLINES`) that
the run evaluated something comparable to, beside the run's own, with its source and the run's settings that differ
from the paper's; the models are named, as they may differ."""

from __future__ import annotations

from wbrag_ray.evaluation.evaluate import load_results
from wbrag_ray.papers import paper_vs_run
from wbrag_ray.report.render import Section, Table
from wbrag_ray.run import RunFolder


def paper_section(run: RunFolder) -> Section | None:
    grid = run.layout.zero_rag.grid
    config = run.load_config() if run.layout.run_json.exists() else None
    rows = paper_vs_run(load_results(run), grid.read_json().get("rows", []) if grid.exists() else [], config)
    if not rows:
        return None
    sec = Section("Paper vs this run")
    sec.text = ("The papers' headline numbers where this run evaluated the same dataset and method; acc in %. The "
                "paper's model and the run's are both named: with another model, the numbers compare the method, "
                "not the reproduction. Each number's source (table, row, column where the repository records them) "
                "and the run's settings that differ from the ones that made it are beside it.")
    sec.tables.append(Table("headline rows", ["paper", "dataset", "method", "knowledge base", "metric", "paper",
                                              "this run", "paper's model", "run's model", "run's result",
                                              "source", "run's settings that differ"],
                            [[r["paper"], r["dataset"], r["method"], r["knowledge_base"], r["metric"],
                              r["paper_value"], r["run_value"], r["paper_model"], r["run_model"] or "",
                              r["run_result"], f"table {r['table']}; row {r['row']}; column {r['column']}; {r['source']}",
                              "; ".join(r["differs"])] for r in rows]))
    return sec
