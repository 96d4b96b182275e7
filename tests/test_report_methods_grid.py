"""The RAG methods x knowledge base grid in `wbrag report`, from a methods_grid.json as `wbrag eval
--methods-grid` writes it (no Ray, no models): the table has every cell, the figure exists and is linked."""

from __future__ import annotations

from wbrag_ray.report import write_report
from wbrag_ray.run import RunFolder

METHODS = ["no-retrieval", "naive", "replug", "self-rag", "flare"]
VERSIONS = {"v-naive": "naive", "v-flare": "flare"}


def _grid() -> dict:
    rows = []
    for version in [None, *VERSIONS]:
        for k, method in enumerate(METHODS):
            if version and method == "no-retrieval":
                continue
            acc = 0.3 + 0.1 * k + (0.05 if version else 0.0)
            row = {"method": method, "setting": "base+writeback" if version else "base", "version": version,
                   "trained_with": VERSIONS.get(version), "same_method": None if version is None else VERSIONS[version] == method,
                   "n": 40, "em": 0.0, "f1": 0.2, "acc": acc, "retrieval_rate": 0.5, "generator_calls": 80}
            if version:
                row["delta"] = {"em": 0.0, "f1": 0.0, "acc": 0.05}
                row.update(union="provenance", unit_in_top_k=3 + k, won=2, lost=k % 2)
            rows.append(row)
    return {"dataset": "qa.jsonl", "name": "qa", "methods": METHODS, "versions": VERSIONS, "rows": rows}


def test_methods_grid_section_table_and_figure(tmp_path):
    run = RunFolder(str(tmp_path / "run"))
    run.layout.methods_grid().write_json(_grid())
    write_report(run)
    assert run.layout.report.join("methods_grid.png").size() > 10_000
    html = run.layout.report_html.read_bytes().decode()
    assert "RAG methods x knowledge base" in html and "src='methods_grid.png'" in html
    md = run.layout.report_markdown.read_bytes().decode()
    table = md[md.index("answer metrics on qa"):]
    lines = [line for line in table.splitlines() if line.startswith("| ") and "method" not in line][:13]
    assert len(lines) == 5 + 4 * 2  # the base for every method, each version for the retrieving ones
    assert sum("| same |" in line for line in lines) == 2 and sum("| cross |" in line for line in lines) == 6
    assert all("+0.050" in line for line in lines if "| v-" in line)
    # per version row: the union setting, then the questions a unit entered the top K of, won and lost
    naive_rows = [line for line in lines if line.startswith("| naive | v-")]
    assert len(naive_rows) == 2 and all("| provenance |" in line and "| +0.050 | 4 | 2 | 1 |" in line
                                        for line in naive_rows)
