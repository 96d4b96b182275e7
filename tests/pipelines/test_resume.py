"""Resuming a stage whose driver was killed (issue 26): the `wbrag` process is SIGKILLed once about half of a
pass's rows are committed to the stage's checkpoint, the same command runs again, and the rerun computes only
what was left and writes what an uninterrupted run wrote.

The killed drivers join the session's Ray cluster (RAY_ADDRESS), as a job's driver joins a cluster: killing
one ends its actors, not the cluster. The runs are copies of the session's Zero-RAG chain run, so the chain's
own outputs are the uninterrupted reference. An evaluation's driver is killed and resumed on four nodes with
the run folder on object storage (tests/pipelines/test_multinode_zero_rag.py); the embed stage's (a Ray Data
pass under its row-level checkpoint, as pruner prediction is) in tests/cluster/test_fault_tolerance.py; the
index build's in tests/index/test_build_resume.py."""

from __future__ import annotations

import json
import shutil
import signal
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.conftest import joining_env
from tests.drivers import ONE_WRITE_AT_A_TIME_CPUS, die_once_half_committed, kill_once_committed
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
    local = chain_run.root.path.rstrip("/")
    shutil.copytree(local, dest)
    relocate(dest, local, str(dest))  # nothing of the copy may write into the session's chain run
    run = RunFolder(str(dest))
    for stage in invalidate:
        run.layout.stage(stage).success.delete()
    return run


def _kill_when_half_committed(args: list[str], run: RunFolder, stage: str, total: int, ray_cluster) -> int:
    """Run `wbrag ARGS` as a driver on the session's cluster and SIGKILL it once `total / 2` answers of `stage`
    are committed; returns how many were."""
    committed, log = kill_once_committed([sys.executable, "-m", "wbrag_ray.cli", *args], joining_env(ray_cluster),
                                         run.layout.checkpoint(stage), total / 2, ray_cluster, cwd=ROOT)
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


def _sent_to_the_generator(monkeypatch) -> dict[str, list[str]]:
    """The prompts each generator pass of this process sends to its service, recorded as they are sent (a resumed
    pass sends only what no attempt committed), by pass name."""
    from wbrag_ray.stages.service import Services

    sent: dict[str, list[str]] = {}
    real = Services.run_frame

    def run_frame(self, frame, stage, name=None, on_batch=None):
        sent.setdefault(name or stage.name, []).extend(frame[stage.prompt_column])
        return real(self, frame, stage, name, on_batch)

    monkeypatch.setattr(Services, "run_frame", run_frame)
    return sent


@pytest.mark.slow
def test_mastery_resumes_its_closed_book_answers_after_the_driver_is_killed(chain, ray_cluster, tmp_path, caplog,
                                                                           capsys, monkeypatch):
    source, _ = chain
    run = _copy(source, tmp_path / "run", "mastery")
    total = source.stats("mastery")["valid"]  # the QA pairs the closed-book pass answers
    committed = _kill_when_half_committed(["mastery", run.uri, *SMALL_BLOCKS], run, "mastery", total, ray_cluster)

    assert main(["status", run.uri]) == 0  # what a person sees of the stopped stage
    status = capsys.readouterr().out
    assert f"{committed:,} of {total:,} rows committed in pass closed_book: the same command resumes it" in status
    sent = _sent_to_the_generator(monkeypatch)
    with caplog.at_level("INFO", logger="wbrag_ray.progress"):
        assert main(["mastery", run.uri]) == 0
    # what the rerun sent the model as it went: only the prompts no attempt committed, each once
    assert len(sent["closed_book"]) == len(set(sent["closed_book"])) == total - committed, (len(sent["closed_book"]),
                                                                                             total, committed)
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
def test_mastery_resumes_the_llm_qa_writer_after_the_driver_is_killed(chain, ray_cluster, tmp_path, monkeypatch):
    """zerorag.qa_mode llm: the QA writer is a generator pass of the stage too. Killed while it writes (half of the
    sentences' QA outputs committed), the rerun sends the model only the sentences no attempt committed, and writes
    the QA pairs (the writer's raw outputs included) and scores of an uninterrupted run of the same settings."""
    source, _ = chain
    llm = ["--mode", "llm", "--sample", "24", "--set", "zerorag.qa_max_new_tokens=24"]
    reference = _copy(source, tmp_path / "reference", "mastery")
    assert main(["mastery", reference.uri, *llm]) == 0
    want = reference.stats("mastery")
    assert want["mode"] == "llm" and want["sentences"] == 24
    total = want["sentences"] + want["valid"]  # the writer's prompts, then the closed-book answers to its pairs

    run = _copy(source, tmp_path / "run", "mastery")
    committed = _kill_when_half_committed(["mastery", run.uri, *llm, *SMALL_BLOCKS], run, "mastery", 24, ray_cluster)
    sent = _sent_to_the_generator(monkeypatch)
    assert main(["mastery", run.uri, *llm]) == 0
    # what the rerun sent the QA writer as it went: the sentences whose output no attempt committed, each once
    assert len(sent["qa_write"]) == len(set(sent["qa_write"])) == 24 - committed, (len(sent["qa_write"]), committed)
    assert len(sent.get("closed_book", [])) == want["valid"]  # its pairs: none committed before the kill
    stats = run.stats("mastery")
    assert stats["passes"]["qa_write"]["rows_resumed"] == committed and "rows_resumed" not in stats["passes"].get(
        "closed_book", {})
    _check_resumed(run, "mastery", total, committed)
    for table in ("qa", "scores"):
        want_t = pq.read_table(getattr(reference.layout.zero_rag, table).path).to_pandas()
        got = pq.read_table(getattr(run.layout.zero_rag, table).path).to_pandas()
        key = ["sid", "qa_index"] if table == "qa" else ["sid"]
        assert got.sort_values(key).reset_index(drop=True).equals(want_t.sort_values(key).reset_index(drop=True))


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


@pytest.mark.slow
def test_router_labels_resume_after_the_driver_is_killed(chain, ray_cluster, tmp_path):
    """The router's labels are closed-book answers to the training questions (with the tuned adapter): a driver
    SIGKILLed right after the commit that brings its answers to half (from inside: a batch of the tiny model's
    answers comes back faster than a look from outside, see tests.drivers) leaves 8 of 10 (batches of 4); the
    rerun decodes the other 2 and labels and trains as the chain's uninterrupted router did."""
    source, _ = chain
    run = _copy(source, tmp_path / "run", "router")
    total = source.stats("router")["rows_out"]
    args = ["train-router", run.uri, "--set", "generator.batch_size=1", "--set", "generator.checkpoint_rows=2"]
    committed, status, log = die_once_half_committed(args, joining_env(ray_cluster), run.layout.checkpoint("router"),
                                                     total, cwd=ROOT)
    assert status == -signal.SIGKILL, log[-3000:]
    assert total / 2 <= committed < total and not run.is_complete("router"), (committed, total)

    assert main(["train-router", run.uri]) == 0
    _check_resumed(run, "router", total, committed)
    whole = source.layout.zero_rag.router_labels.read_table().to_pandas()
    resumed = run.layout.zero_rag.router_labels.read_table().to_pandas()
    assert resumed[["id", "question", "prediction", "label"]].equals(whole[["id", "question", "prediction", "label"]])
    assert np.allclose(resumed["p_mastered"], whole["p_mastered"], atol=1e-6)
    assert run.layout.zero_rag.router_metrics.read_json() == source.layout.zero_rag.router_metrics.read_json()


def _spread_sentences(run: RunFolder, copies: int, files: int) -> int:
    """The copy's sentences `copies` times over (new ids, the same texts) in `files` files, each beside a copy of
    the passages under its name (a sentence finds its title in the passages file of its own name), as a larger
    corpus's ingest lays them out: a pass over them reads them in several tasks and commits a block per task.
    Returns the sentences."""
    import pyarrow as pa

    sentences, passages = run.layout.ingest.sentences, run.layout.ingest.passages
    one, titles = sentences.read_table(), passages.read_table()
    step = int(pa.compute.max(one["sid"]).as_py()) + 1
    many = pa.concat_tables([one.set_column(one.schema.get_field_index("sid"), "sid",
                                            pa.compute.add(one["sid"], k * step)) for k in range(copies)])
    sentences.delete()
    passages.delete()
    bounds = np.linspace(0, many.num_rows, files + 1).astype(int)
    for i in range(files):
        sentences.join(f"part-{i:03d}.parquet").write_table(many.slice(bounds[i], bounds[i + 1] - bounds[i]))
        passages.join(f"part-{i:03d}.parquet").write_table(titles)
    stats = run.layout.stage("ingest").stats
    stats.write_json({**stats.read_json(), "sentences": many.num_rows})
    return many.num_rows


@pytest.mark.slow
def test_pruner_prediction_resumes_after_the_driver_is_killed(chain, ray_cluster, tmp_path):
    """The LM pruner's prediction over every sentence, a Ray Data pass under its row-level checkpoint (the
    embedding pruner's runs the same way): killed once its first block of scores is committed, the rerun of the
    same `wbrag prune` predicts only the sentences of no committed block, and writes the scores and the keep mask of
    an uninterrupted prediction of the same sentences (scores to float rounding: the rerun batches the rest
    otherwise).

    Ray Data reads the 12 files in 4 tasks (twice the CPUs), so the pass commits 4 blocks, and its model actor
    can finish all 4 before the first write commits. What leaves blocks for the rerun is how many writes run at
    once (tests/drivers.py): the killed driver's actor asks for 1.75 of the node's 2 CPUs, so one read or write
    task (0.25 CPU) runs beside it, and the kill at the first commit finds at most one more write running."""
    source, _ = chain
    prune = ["--ratio", "0.3", "--pruner", "lm"]
    # half a CPU: on resume Ray Data adds a CheckpointFilter actor that holds 1 CPU of this 2-CPU node
    half_cpu = ["--set", "zerorag.lm_pruner.num_cpus=0.5"]
    whole = _copy(source, tmp_path / "whole", "predict", "prune-0.3")
    total = _spread_sentences(whole, copies=6, files=12)
    assert main(["prune", whole.uri, *prune, *half_cpu]) == 0
    run = _copy(source, tmp_path / "run", "predict", "prune-0.3")
    _spread_sentences(run, copies=6, files=12)

    one_write_at_a_time = ["--set", f"zerorag.lm_pruner.num_cpus={ONE_WRITE_AT_A_TIME_CPUS:g}"]
    committed, log = kill_once_committed([sys.executable, "-m", "wbrag_ray.cli", "prune", run.uri, *prune,
                                          *one_write_at_a_time], joining_env(ray_cluster),
                                         run.layout.checkpoint("predict"), 1, ray_cluster, cwd=ROOT)
    assert 0 < committed < total and not run.is_complete("predict"), (committed, total, log[-3000:])
    assert main(["prune", run.uri, *prune, *half_cpu]) == 0
    stats = run.stats("predict")
    assert stats["rows_resumed"] == committed and stats["rows_computed"] == total - committed, stats
    assert not run.layout.checkpoint("predict").exists()

    def scores(r: RunFolder):
        return r.layout.zero_rag.predictions.read_table().to_pandas().sort_values("sid").reset_index(drop=True)

    got, want = scores(run), scores(whole)
    assert got["sid"].tolist() == want["sid"].tolist() and len(set(got["sid"])) == total  # no gap, no duplicate
    assert np.allclose(got["mastery_pred"], want["mastery_pred"], atol=1e-5)
    keep = [r.layout.zero_rag.pruned(0.3).keep.read_table(["id", "keep"]).to_pandas().sort_values("id")
            .reset_index(drop=True) for r in (run, whole)]
    assert keep[0].equals(keep[1])
