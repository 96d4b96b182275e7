"""Resuming a stage whose driver was killed (issue 26): the `wbrag` process is SIGKILLed once about half of a
pass's rows are committed to the stage's checkpoint, the same command runs again, and the rerun computes only
what was left and writes what an uninterrupted run wrote.

The killed drivers join the session's Ray cluster (RAY_ADDRESS), as a job's driver joins a cluster: killing
one ends its actors, not the cluster. The runs are copies of the session's Zero-RAG chain run, so the chain's
own outputs are the uninterrupted reference. An evaluation's driver is killed and resumed on four nodes with
the run folder on object storage (tests/pipelines/test_multinode_zero_rag.py); the embed stage's (a Ray Data
pass under its row-level checkpoint, as pruner prediction is) in tests/cluster/test_fault_tolerance.py."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.conftest import joining_env
from tests.drivers import kill_once_half_committed, start
from tests.pipelines.conftest import relocate
from wbrag_ray.cli import main
from wbrag_ray.run import RunFolder
from wbrag_ray.writeback.versions import versions

ROOT = Path(__file__).resolve().parents[2]
# The killed driver decodes in small batches committed one by one, so "half the rows" falls between two commits;
# the uninterrupted reference and the rerun decode in the usual batches (a batch size never changes an answer:
# generator.batch_invariant, and it is no setting of the stage).
SMALL_BLOCKS = ["--set", "generator.batch_size=1", "--set", "generator.checkpoint_rows=4"]


def _copy(chain_run: RunFolder, dest: Path, *invalidate: str) -> RunFolder:
    local = chain_run.path().path.rstrip("/")
    shutil.copytree(local, dest)
    relocate(dest, local, str(dest))  # nothing of the copy may write into the session's chain run
    run = RunFolder(str(dest))
    for stage in invalidate:
        run.invalidate(stage)
    return run


def _kill_when_half_committed(args: list[str], run: RunFolder, stage: str, total: int, ray_cluster) -> int:
    """Run `wbrag ARGS` as a driver on the session's cluster and SIGKILL it once `total / 2` answers of `stage`
    are committed; returns how many were."""
    driver = start([sys.executable, "-m", "wbrag_ray.cli", *args], joining_env(ray_cluster), cwd=ROOT)
    committed, log = kill_once_half_committed(driver, run.layout.checkpoint(stage), total)
    assert total / 2 <= committed < total, (committed, total, log[-3000:])
    assert not run.is_complete(stage)
    return committed


def _same(a, b) -> bool:
    """Equal values, floats to float rounding: scores from token probabilities change in their last bits with
    the batch size (the killed driver decoded in batches of one, the others in batches of 32), and a trace's
    rounded copies of them may round the other way; answers do not."""
    if hasattr(a, "tolist"):
        a = a.tolist()
    if hasattr(b, "tolist"):
        b = b.tolist()
    if isinstance(a, str) and isinstance(b, str) and a[:1] in "[{" and b[:1] in "[{":  # a JSON trace
        a, b = json.loads(a), json.loads(b)
    if isinstance(a, float) and isinstance(b, float):  # a JSON trace's floats are rounded to 6 digits
        return bool(np.isclose(a, b, rtol=1e-5, atol=2e-6, equal_nan=True))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


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
        assert main(["mastery", run.uri]) == 0
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
def test_write_back_training_resumes_after_the_driver_is_killed(chain, ray_cluster, tmp_path):
    """Utility scoring (RePlug's mixture and the closed-book baseline), the document gate and both distillation
    steps are generator passes of one stage: killed part way, the rerun decodes only what no attempt committed
    and writes the same examples, gates and knowledge units as the chain's uninterrupted training of the same
    examples under the same settings (scores to float rounding)."""
    source, _ = chain
    run = _copy(source, tmp_path / "run")
    (version,) = versions(source)  # the chain's one version, named after its training file
    reference = source.stats(f"writeback-{version}")
    total = reference["rows_computed"]  # every distinct prompt the stage decodes
    again = ["writeback", run.uri, "--version", "killed", "--set", "writeback.activate=false"]

    committed = _kill_when_half_committed([*again, *SMALL_BLOCKS], run, "writeback-killed", total, ray_cluster)
    assert main(again) == 0
    stats = run.stats("writeback-killed")
    assert stats["rows_computed"] == total - committed <= 0.6 * total, stats
    assert not run.layout.checkpoint("writeback-killed").exists()
    for table in ("scored", "distill", "units"):
        whole = pq.read_table(getattr(source.layout.writeback_version(version), table).path).to_pandas()
        killed = pq.read_table(getattr(run.layout.writeback_version("killed"), table).path).to_pandas()
        if table == "units":  # a unit names its version, in its id too
            assert set(killed["version"]) == {"killed"}
            killed["version"] = version
            killed["unit_id"] = killed["unit_id"].str.replace("wb:killed:", f"wb:{version}:")
        assert list(killed.columns) == list(whole.columns) and len(killed) == len(whole), table
        for column in whole.columns:
            assert _same(killed[column].tolist(), whole[column].tolist()), (table, column)
