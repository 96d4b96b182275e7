import pytest

from wbrag_ray.config import ConfigError, load_config
from wbrag_ray.run import RunFolder


def test_stage_runs_once_then_is_skipped(tmp_path, capsys):
    run = RunFolder(str(tmp_path / "run"))
    calls = []

    def work():
        calls.append(1)
        return {"rows_in": 3, "rows_out": 2, "rows_rejected": 1}

    assert run.run_stage("s", work)["rows_out"] == 2
    assert run.is_complete("s") and run.stats("s")["rows_rejected"] == 1
    assert run.run_stage("s", work)["rows_out"] == 2
    assert len(calls) == 1
    assert "skipped" in capsys.readouterr().out
    run.run_stage("s", work, force=True)
    assert len(calls) == 2


def test_a_failed_stage_leaves_no_marker(tmp_path):
    run = RunFolder(str(tmp_path / "run"))

    def boom():
        raise RuntimeError("died part way")

    with pytest.raises(RuntimeError):
        run.run_stage("s", boom)
    assert not run.is_complete("s")
    assert run.completed_stages() == []


def test_marker_is_written_after_stats(tmp_path):
    run = RunFolder(str(tmp_path / "run"))
    run.run_stage("s", lambda: {"rows_out": 1})
    d = tmp_path / "run" / "_stages" / "s"
    assert (d / "_SUCCESS").stat().st_mtime_ns >= (d / "stats.json").stat().st_mtime_ns


def test_changed_config_is_refused_unless_forced(tmp_path):
    run = RunFolder(str(tmp_path / "run"))
    run.bind_config(load_config())
    run.bind_config(load_config(overrides=["eval.limit=3"]))  # eval settings don't change built outputs
    run.bind_config(load_config(overrides=["embedder.num_cpus=4", "generator.concurrency=8"]))  # placement only
    with pytest.raises(ConfigError, match="different config.*index.factory"):
        run.bind_config(load_config(overrides=["index.factory=HNSW32"]))
    run.bind_config(load_config(overrides=["index.factory=HNSW32"]), force=True)
    assert run.load_config().index.factory == "HNSW32"


def test_rag_method_settings_never_invalidate_a_run_even_one_made_before_they_existed(tmp_path):
    import json

    run = RunFolder(str(tmp_path / "run"))
    run.bind_config(load_config())
    run.bind_config(load_config(overrides=["rag.flare.threshold=0.5", "rag.self_rag.relevance_threshold=0.2"]))
    run_json = tmp_path / "run" / "run.json"
    old = json.loads(run_json.read_text())
    del old["config"]["rag"]  # a run folder written by a version without the adaptive methods
    run_json.write_text(json.dumps(old))
    run.bind_config(load_config())


def test_run_json_holds_no_credentials(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t-value")
    run = RunFolder(str(tmp_path / "run"))
    run.bind_config(load_config())
    assert "s3cr3t-value" not in (tmp_path / "run" / "run.json").read_text()
