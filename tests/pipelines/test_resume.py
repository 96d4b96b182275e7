"""Resuming a stage whose driver was killed (issue 26): the `wbrag` process is SIGKILLed once about half of a
pass's rows are committed to the stage's checkpoint, the same command runs again, and the rerun computes only
what was left and writes what an uninterrupted run wrote.

The killed drivers join the session's Ray cluster (RAY_ADDRESS), as a job's driver joins a cluster: killing
one ends its actors, not the cluster. The runs are copies of the session's Zero-RAG chain run, so the chain's
own outputs are the uninterrupted reference."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.conftest import demo_questions, write_jsonl
from tests.pipelines.conftest import relocate
from wbrag_ray.cli import main
from wbrag_ray.run import RunFolder

ROOT = Path(__file__).resolve().parents[2]
# small batches committed one by one, so "half the rows" falls between two commits
SMALL_BLOCKS = ["--set", "generator.batch_size=1", "--set", "generator.checkpoint_rows=4"]


def _copy(chain_run: RunFolder, dest: Path, *invalidate: str) -> RunFolder:
    local = chain_run.path().path.rstrip("/")
    shutil.copytree(local, dest)
    relocate(dest, local, str(dest))  # nothing of the copy may write into the session's chain run
    run = RunFolder(str(dest))
    for stage in invalidate:
        run.invalidate(stage)
    return run


def _committed_rows(folder) -> int:
    return sum(f.num_rows() for f in folder.list_files(".parquet"))


def _kill_when_half_committed(args: list[str], run: RunFolder, stage: str, total: int, ray_cluster) -> int:
    """Run `wbrag ARGS` as a driver on the session's cluster and SIGKILL it once `total / 2` answers of `stage`
    are committed; returns how many were."""
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address}
    p = subprocess.Popen([sys.executable, "-m", "wbrag_ray.cli", *args], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    answers = run.layout.checkpoint(stage).join("answers")
    deadline = time.time() + 300
    try:
        while time.time() < deadline and p.poll() is None and _committed_rows(answers) < total / 2:
            time.sleep(0.01)
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        out = p.communicate(timeout=60)[0]
    committed = _committed_rows(answers)
    assert total / 2 <= committed < total, (committed, total, out[-3000:])
    assert not run.is_complete(stage)
    return committed


def _check_resumed(run: RunFolder, stage: str, total: int, committed: int) -> None:
    stats = run.stats(stage)
    # every answer committed before the kill is read back, not decoded again: at most 60% are computed
    assert stats["rows_resumed"] == committed and stats["rows_computed"] == total - committed, stats
    assert stats["rows_computed"] <= 0.6 * total
    assert not run.layout.checkpoint(stage).exists()  # removed once the stage is complete


@pytest.mark.slow
def test_mastery_resumes_its_closed_book_answers_after_the_driver_is_killed(chain, ray_cluster, tmp_path, caplog,
                                                                           capsys):
    source, _ = chain
    run = _copy(source, tmp_path / "run", "mastery")
    total = source.stats("mastery")["valid"]  # the QA pairs the closed-book pass answers
    committed = _kill_when_half_committed(["mastery", run.uri, *SMALL_BLOCKS], run, "mastery", total, ray_cluster)

    assert main(["status", run.uri]) == 0  # what a person sees of the stopped stage
    status = capsys.readouterr().out
    assert f"{committed:,} of {total:,} rows committed in pass closed_book: the same command resumes it" in status
    with caplog.at_level("INFO", logger="wbrag_ray.progress"):
        assert main(["mastery", run.uri, *SMALL_BLOCKS]) == 0
    assert f"resumed {committed:,} of {total:,} rows" in caplog.text
    _check_resumed(run, "mastery", total, committed)
    assert main(["status", run.uri]) == 0
    assert f"{committed:,} of them resumed after a stop" in capsys.readouterr().out
    # the same QA pairs, answers and scores as the uninterrupted run
    for table in ("qa", "scores"):
        want = pq.read_table(getattr(source.layout.zero_rag, table).path).to_pandas()
        got = pq.read_table(getattr(run.layout.zero_rag, table).path).to_pandas()
        key = ["sid", "qa_index"] if table == "qa" else ["sid"]
        assert got.sort_values(key).reset_index(drop=True).equals(want.sort_values(key).reset_index(drop=True))


@pytest.mark.slow
def test_an_evaluation_resumes_after_the_driver_is_killed_and_answers_as_an_uninterrupted_one(
        chain, ray_cluster, tmp_path):
    source, _ = chain
    run = _copy(source, tmp_path / "run")
    questions = write_jsonl(tmp_path / "qa.jsonl", demo_questions(40))
    common = ["--dataset", str(questions), "--methods", "naive", *SMALL_BLOCKS]
    assert main(["eval", run.uri, "--name", "whole", *common]) == 0  # the uninterrupted reference

    stage = "eval-killed"
    committed = _kill_when_half_committed(["eval", run.uri, "--name", "killed", *common], run, stage, 40, ray_cluster)
    assert main(["eval", run.uri, "--name", "killed", *common]) == 0
    _check_resumed(run, stage, 40, committed)
    answers = [pq.read_table(run.layout.eval_result(label, "naive").predictions.path, columns=["id", "prediction"])
               .to_pylist() for label in ("whole", "killed")]
    assert sorted(answers[0], key=str) == sorted(answers[1], key=str) and len(answers[0]) == 40


@pytest.mark.slow
def test_write_back_training_resumes_after_the_driver_is_killed(chain, ray_cluster, tmp_path):
    """Utility scoring (RePlug's mixture and the closed-book baseline), the document gate and both distillation
    steps are generator passes of one stage: killed part way, the rerun decodes only what no attempt committed
    and writes the same examples, gates and knowledge units as an uninterrupted training."""
    import json

    from tests.conftest import DATA

    source, _ = chain
    run = _copy(source, tmp_path / "run")
    train = [json.loads(line) for line in (DATA / "demo_train.jsonl").read_text().splitlines()][:12]
    common = ["--train", str(write_jsonl(tmp_path / "train.jsonl", train)), "--set", "writeback.limit=12",
              "--set", "writeback.activate=false", *SMALL_BLOCKS]
    assert main(["writeback", run.uri, "--version", "whole", *common]) == 0  # the uninterrupted reference
    total = run.stats("writeback-whole")["rows_computed"]  # every distinct prompt the stage decodes

    committed = _kill_when_half_committed(["writeback", run.uri, "--version", "killed", *common], run,
                                          "writeback-killed", total, ray_cluster)
    assert main(["writeback", run.uri, "--version", "killed", *common]) == 0
    stats = run.stats("writeback-killed")
    assert stats["rows_computed"] == total - committed <= 0.6 * total, stats
    assert not run.layout.checkpoint("writeback-killed").exists()
    for table in ("scored", "distill", "units"):
        whole, killed = (pq.read_table(getattr(run.layout.writeback_version(v), table).path).to_pandas()
                         for v in ("whole", "killed"))
        assert killed.equals(whole), table
