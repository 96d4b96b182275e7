import os

import pytest

from wbrag_ray.build_kb import KB_STAGES
from wbrag_ray.config import ConfigError, WbragConfig, load_config
from wbrag_ray.run import RunFolder, RunStage
from wbrag_ray.storage import committed


def test_stage_runs_once_then_is_skipped(tmp_path, capsys):
    run = RunFolder(str(tmp_path / "run"))
    calls = []

    def work():
        calls.append(1)
        return {"rows_in": 3, "rows_out": 2, "rows_rejected": 1}

    assert run.execute(RunStage("s"), WbragConfig(), work)["rows_out"] == 2
    assert run.is_complete("s") and run.stats("s")["rows_rejected"] == 1
    assert run.execute(RunStage("s"), WbragConfig(), work)["rows_out"] == 2
    assert len(calls) == 1
    assert "skipped" in capsys.readouterr().out
    run.execute(RunStage("s"), WbragConfig(), work, force=True)
    assert len(calls) == 2


def test_a_failed_stage_leaves_no_marker(tmp_path):
    run = RunFolder(str(tmp_path / "run"))

    def boom():
        raise RuntimeError("died part way")

    with pytest.raises(RuntimeError):
        run.execute(RunStage("s"), WbragConfig(), boom)
    assert not run.is_complete("s")
    assert run.completed_stages() == []


@pytest.mark.parametrize("stop", [ConfigError("embedder.num_cpus: no room"), RuntimeError("died part way"),
                                  KeyboardInterrupt()], ids=["refused", "failed", "ctrl-c"])
def test_run_json_only_ever_holds_the_settings_of_completed_stages(tmp_path, stop):
    """A stage that does not complete (refused by its check, failed, interrupted by Ctrl-C) leaves run.json as it
    was before the command, so its --set never becomes the next command's base; on a new run folder, where there
    was none, it leaves none. A stage that completes records its settings."""
    def stopped():
        raise stop

    run = RunFolder(str(tmp_path / "run"))
    run.bind_config(load_config(overrides=["embedder.num_cpus=0.75"]), record="when_a_stage_runs")
    with pytest.raises(type(stop)):
        run.execute(RunStage("first"), WbragConfig(), stopped)
    assert not run.is_run()  # nothing completed: no config recorded
    run.bind_config(load_config(overrides=["embedder.num_cpus=0.5"]))
    run.bind_config(load_config(overrides=["embedder.num_cpus=1"]), record="when_a_stage_runs")
    with pytest.raises(type(stop)):
        run.execute(RunStage("s"), WbragConfig(), stopped)
    assert run.load_config().embedder.num_cpus == 0.5
    run.bind_config(load_config(overrides=["embedder.num_cpus=1"]), record="when_a_stage_runs")
    run.execute(RunStage("s"), WbragConfig(), lambda: {"rows_out": 1})
    assert run.load_config().embedder.num_cpus == 1  # it completed with them: what it wrote, they made


def test_marker_is_written_after_stats(tmp_path, monkeypatch):
    """Files are recorded in the order they appear under their names (a write is whole once its stream closes and
    its temporary file is moved): mtimes could not tell, as both land in one clock tick."""
    import contextlib

    from wbrag_ray.storage import Location

    appeared = []
    open_write = Location.open_write

    @contextlib.contextmanager
    def recording(self):
        with open_write(self) as f:
            yield f
        appeared.append((os.path.basename(self.path), os.path.exists(self.path)))

    monkeypatch.setattr(Location, "open_write", recording)
    run = RunFolder(str(tmp_path / "run"))
    run.execute(RunStage("s"), WbragConfig(), lambda: {"rows_out": 1})
    assert [a for a in appeared if a[0] in ("stats.json", "_SUCCESS")] == [("stats.json", True), ("_SUCCESS", True)]
    assert run.stats("s")["rows_out"] == 1 and run.is_complete("s")


def _built(tmp_path) -> RunFolder:
    """A run folder whose knowledge-base stages are complete (their work faked: only the records matter here)."""
    run = RunFolder(str(tmp_path / "run"))
    config = load_config()
    run.bind_config(config, guard=KB_STAGES)
    for stage in KB_STAGES:
        run.execute(stage, config, lambda: {"rows_out": 1})
    return run


def test_changed_config_is_refused_unless_forced(tmp_path):
    run = _built(tmp_path)
    run.bind_config(load_config(overrides=["eval.limit=3"]), guard=KB_STAGES)  # eval settings don't change built outputs
    run.bind_config(load_config(overrides=["embedder.num_cpus=4", "generator.concurrency=8"]), guard=KB_STAGES)
    with pytest.raises(ConfigError, match="different config.*index.factory"):
        run.bind_config(load_config(overrides=["index.factory=HNSW32"]), guard=KB_STAGES)
    run.bind_config(load_config(overrides=["index.factory=HNSW32"]), force=True, guard=KB_STAGES)
    assert run.load_config().index.factory == "HNSW32"


def test_rag_method_settings_never_invalidate_a_run_even_one_made_before_they_existed(tmp_path):
    import json

    run = _built(tmp_path)
    run.bind_config(load_config(overrides=["rag.flare.threshold=0.5", "rag.self_rag.relevance_threshold=0.2"]),
                    guard=KB_STAGES)
    run_json = run.layout.run_json.path
    old = json.loads(open(run_json).read())
    del old["config"]["rag"]  # a run folder written by a version without the adaptive methods
    open(run_json, "w").write(json.dumps(old))
    run.bind_config(load_config(), guard=KB_STAGES)


def test_run_json_holds_no_credentials(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t-value")
    run = RunFolder(str(tmp_path / "run"))
    run.bind_config(load_config())
    assert "s3cr3t-value" not in run.layout.run_json.read_bytes().decode()


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_forced_redo_writes_beside_the_old_output_and_replaces_it_only_at_completion(where, tmp_path, request):
    """`RunFolder.output`: a complete stage redone writes its output folder beside the old one (a hidden folder); a
    redo that fails leaves the old output, stats and marker; the next one resumes into the same folder, and its
    output replaces the old at completion. A stage made for the first time writes in place."""
    if where == "s3":
        request.getfixturevalue("s3_env")
    uri = f"s3://wbrag/run-output-{tmp_path.name}" if where == "s3" else str(tmp_path / "run")
    run = RunFolder(uri)
    final = run.root.join("out")
    seen = []

    def work(text: str, fail: bool = False):
        def stage():
            out = run.output(final)
            seen.append(out.uri)
            out.join("part.txt").write_bytes(text.encode())
            if fail:
                raise RuntimeError("died part way")
            return {"rows_out": 1}
        return stage

    run.execute(RunStage("s"), WbragConfig(), work("old"))
    assert seen[-1] == final.uri  # first time: in place
    with pytest.raises(RuntimeError):
        run.execute(RunStage("s"), WbragConfig(), work("new", fail=True), force=True)
    assert seen[-1] == final.join("_v1", "out").uri  # the next version, inside the folder
    assert run.is_complete("s") and committed(final).join("part.txt").read_bytes() == b"old"
    assert [f.name for f in final.list_files()] == ["part.txt"]  # the version is hidden from a plain listing
    run.execute(RunStage("s"), WbragConfig(), work("new"), force=True)
    assert seen[-1] == seen[-2]  # the same staging folder: a redo resumes into it
    assert run.is_complete("s") and committed(final).join("part.txt").read_bytes() == b"new"
    assert not final.join("part.txt").exists()  # the old output went once the pointer moved
    run.execute(RunStage("s"), WbragConfig(), work("newer"), force=True)
    assert seen[-1] == final.join("_v2", "out").uri and committed(final).join("part.txt").read_bytes() == b"newer"
    assert not final.join("_v1").exists()
