"""A write-back evaluation's departures from the papers come from what made its results: the version's recorded
settings, not the evaluating config's, and the report lists the same ones its metrics.json records. Real Ray, the
tiny models, a real write-back version trained on the demo corpus."""

import json

from tests.conftest import DATA, DEMO_CORPUS, demo_questions, write_jsonl
from wbrag_ray.cli import main
from wbrag_ray.run import RunFolder


def test_a_writeback_evaluation_records_the_versions_departures_and_the_report_lists_the_same(
        tmp_path, ray_cluster, tiny, capsys):
    from wbrag_ray.report import write_report
    from wbrag_ray.report.paper_rows import departures_tables

    run = tmp_path / "run"
    train = write_jsonl(tmp_path / "nq_train.jsonl",
                        [json.loads(line) for line in (DATA / "demo_train.jsonl").read_text().splitlines()][:2])
    test = write_jsonl(tmp_path / "nq_test.jsonl", demo_questions(2))
    settings = [*tiny.set_args(), "--set", "generator.max_new_tokens=8", "--set", "generator.num_cpus=1"]
    assert main(["ingest", str(run), "--corpus", str(DEMO_CORPUS), *settings]) == 0
    assert main(["embed", str(run)]) == 0 and main(["index", str(run)]) == 0
    # the version: gates that keep every example, deduplicated at 0.9, nothing held out (the demo's auto holds out
    # none of 2 questions)
    assert main(["writeback", str(run), "--train", str(train), "--set", "writeback.tau_s=-1",
                 "--set", "writeback.tau_delta=-2", "--set", "writeback.tau_doc=2", "--set",
                 "writeback.dedupe_threshold=0.9", "--set", "writeback.extract_max_new_tokens=16",
                 "--set", "writeback.rewrite_max_new_tokens=16", "--set", "writeback.activate=true"]) == 0
    capsys.readouterr()
    # evaluated under the paper's gates and no deduplication: the version's own settings are what made the results
    assert main(["eval", str(run), "--dataset", str(test), "--methods", "naive", "--name", "t", "--writeback",
                 "--set", "writeback.dedupe_threshold=null", "--set", "writeback.tau_s=0.1",
                 "--set", "writeback.tau_delta=0.01", "--set", "writeback.tau_doc=0.01"]) == 0
    printed = capsys.readouterr().out
    folder = RunFolder(str(run))
    metrics = folder.layout.eval_result("t-writeback", "naive").metrics.read_json()
    whats = [d["what"] for d in metrics["departures"]]
    for setting in ("writeback.tau_s: -1.0", "writeback.tau_delta: -2.0", "writeback.tau_doc: 2.0",
                    "writeback.dedupe_threshold: 0.9"):
        assert any(w.startswith(setting) for w in whats), setting
    assert {d["paper"] for d in metrics["departures"]} == {"WriteBack-RAG"}
    made = metrics["made_by"]
    assert made["writeback"]["dedupe_threshold"] == 0.9 and made["writeback"]["tau_s"] == -1.0
    assert made["writeback"]["train"] == str(train) and made["dataset"] == "nq" and made["questions"]["n"] == 2
    # the tiny generator is none the papers ran: one line at the start, with the count metrics.json holds
    assert f"this run departs from WriteBack-RAG in {len(whats)} choices" in printed
    # the paper-vs-run table at the end: NQ naive with write-back beside Table 4's default row, the version's gates
    # (none of Table 4's rows) and deduplication named
    assert "paper vs this run" in printed and "deduplicated at 0.9 (the paper: no deduplication)" in printed

    # the report lists exactly the departures the results recorded
    write_report(folder)
    (table,) = departures_tables(folder)
    assert [row[2] for row in table.rows] == whats
    report = folder.layout.report_markdown.read_bytes().decode()
    assert all(w in report for w in whats)
    assert "Paper vs this run" in report and "34.82" in report  # Table 4's default row, as printed above
