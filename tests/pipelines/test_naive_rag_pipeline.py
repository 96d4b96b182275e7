"""Integration: ingest -> embed -> index -> eval on a slice of the demo data, with the real bundled models,
on a local Ray cluster, through the `wbrag` command; FlashRAG files written here, not the demo's own."""

import json

import pyarrow.parquet as pq

from wbrag_ray.cli import main
from wbrag_ray.run import RunFolder


def test_every_stage_completed_with_reconciled_counts(built_run, flashrag_files):
    run, _ = built_run
    layout = RunFolder(str(run)).layout
    _, _, n_docs, _ = flashrag_files
    for stage in ("ingest", "embed", "index", "eval-slice"):
        assert layout.stage(stage).success.exists(), stage
    ingest = layout.stage("ingest").stats.read_json()
    assert ingest["rows_in"] == n_docs == ingest["rows_out"] + ingest["rows_rejected"]
    embed = layout.stage("embed").stats.read_json()
    assert embed["rows_out"] == ingest["rows_out"]
    manifest = layout.index.join("manifest.json").read_json()  # the index's own file
    assert manifest["count"] == n_docs and manifest["dim"] == 384


def test_eval_writes_metrics_and_predictions(built_run, flashrag_files):
    run, _ = built_run
    layout = RunFolder(str(run)).layout
    _, _, _, n_q = flashrag_files
    for method in ("naive", "no-retrieval"):
        result = layout.eval_result("slice", method)
        metrics = result.metrics.read_json()
        assert metrics["n"] == n_q and metrics["method"] == method
        assert {"em", "f1", "acc"} <= set(metrics) and metrics["rejected_questions"] == 1
        preds = pq.read_table(result.predictions.path).to_pylist()
        assert len(preds) == n_q and all(p["prediction"] for p in preds)
        assert pq.read_table(result.rejects.path).to_pylist()[0]["reason"] == "missing or empty 'golden_answers'"
    naive = layout.eval_result("slice", "naive").metrics.read_json()
    closed = layout.eval_result("slice", "no-retrieval").metrics.read_json()
    # retrieval over passages that hold the answers must help even a 135M model
    assert naive["acc"] > closed["acc"]
    preds = pq.read_table(layout.eval_result("slice", "naive").predictions.path).to_pylist()
    assert all(len(json.loads(p["docs"])) == 5 for p in preds)


def test_rerun_skips_completed_stages(built_run, capsys):
    run, config = built_run
    capsys.readouterr()
    assert main(["run", str(config)]) == 0
    out = capsys.readouterr().out
    for stage in ("ingest", "embed", "index", "eval-slice"):
        assert f"[{stage}] complete, skipped" in out
    assert "results on slice" in out


def test_search_command_finds_the_source_passage(built_run, capsys):
    run, _ = built_run
    capsys.readouterr()
    assert main(["search", str(run), "--query", "highest mountain above sea level", "-k", "2"]) == 0
    out = capsys.readouterr().out
    assert "Mount Everest" in out.splitlines()[1]


def test_changed_config_on_existing_run_is_refused(built_run, capsys):
    run, config = built_run
    assert main(["run", str(config), "--set", "index.factory=HNSW32"]) == 2
    assert "different config" in capsys.readouterr().err


def test_report_has_every_plot_it_references_and_a_markdown_twin(built_run, capsys):
    import html
    import re

    run, _ = built_run
    assert main(["report", str(run)]) == 0
    layout = RunFolder(str(run)).layout
    html_text = layout.report_html.read_bytes().decode()
    images = re.findall(r"<img src='([^']+)'", html_text)
    assert {"stage_times.png", "eval_metrics.png", "sentences_per_passage.png"} <= set(images)
    for img in images:
        data = layout.report.join(img).read_bytes()  # named by the page, beside it
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000, img
    md = layout.report_markdown.read_bytes().decode()
    html_tables = [html.unescape(c) for c in re.findall(r"<caption>([^<]+)</caption>", html_text)]  # HTML text
    md_tables = re.findall(r"^\*\*(.+)\*\*$", md, re.M)
    assert html_tables == md_tables and "answer metrics" in md_tables
    assert md.count("| slice-naive |") == 1 and html_text.count("<td>slice-naive</td>") == 1


def test_inspect_prints_answers_with_their_documents(built_run, capsys):
    run, _ = built_run
    capsys.readouterr()
    assert main(["inspect", str(run), "-n", "2"]) == 0
    out = capsys.readouterr().out
    assert "slice-naive: wrong answers first" in out and "doc 1 [base:" in out and "as sentences" in out
