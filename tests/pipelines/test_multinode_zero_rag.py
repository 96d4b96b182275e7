"""Multi-node chaos acceptance (issue 76): on a local Ray cluster of a head and three worker nodes, with the run
folder on the S3-compatible server on loopback, the chain's passages embedded again while a worker node is lost
(a replacement node joins after), the index rebuilt by a driver SIGKILLed inside its commit's swap and rebuilt
again, then the Zero-RAG chain after the index (pruner prediction, percentile and keep mask, the pruned index, an
evaluation with the router and the tuned adapter) and a write-back evaluation, losing a worker node during
prediction and again during an evaluation pass: the same keep mask and the same answers as the one-node run of
the chain fixture, nothing lost, nothing duplicated; then the write-back evaluation again, its driver killed part
way: it resumes from its checkpoint on object storage and answers as the uninterrupted one.

The chain's run folder is copied to object storage with every absolute path in its JSON files moved with it,
and the local copy deleted, so a stage that still read the local folder would fail instead of passing."""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.conftest import last_json_line
from tests.pipelines.conftest import relocate
from wbrag_ray.storage import resolve
from wbrag_ray.zerorag.grid import eval_label

ROOT = Path(__file__).resolve().parents[2]
S3_RUN = "s3://wbrag/multinode-zero-rag"


def _one_node_answers(run, label):
    table = pq.read_table(run.layout.eval_result(label, "naive").predictions.path,
                          columns=["id", "prediction", "docs"]).to_pylist()
    return ({r["id"]: r["prediction"] for r in table},
            {r["id"]: [[d["source"], d["id"]] for d in json.loads(r["docs"])] for r in table})


# The first test of the chain's group, so its set-up builds the chain (minutes), which pytest-timeout counts with
# the test: the script gets SCRIPT_TIMEOUT_S of its own, and a hang in it is reported with its log.
SCRIPT_TIMEOUT_S = 900


@pytest.mark.slow
@pytest.mark.timeout(SCRIPT_TIMEOUT_S + 900)
def test_zero_rag_and_writeback_on_four_nodes_lose_a_node_twice_and_match_one_node(chain, s3_env, tmp_path):
    run, test_file = chain
    copy = tmp_path / "run"
    local = run.root.path.rstrip("/")
    shutil.copytree(local, copy)
    relocate(copy, local, S3_RUN)
    import pyarrow.fs as pafs

    remote = resolve(S3_RUN)
    remote.delete()
    pafs.copy_files(str(copy), remote.path, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=remote.fs)
    shutil.rmtree(copy)

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    # its own process group: a script stopped for its time takes its cluster's raylets and workers with it
    script = subprocess.Popen([sys.executable, "-m", "tests.cluster.multinode_zero_rag", S3_RUN, str(test_file)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                              start_new_session=True)
    try:
        stdout, stderr = script.communicate(timeout=SCRIPT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(script.pid, signal.SIGKILL)
        stderr = script.communicate()[1]  # the script's steps say which stage did not end
        pytest.fail(f"the four-node script ran past {SCRIPT_TIMEOUT_S} s; its log:\n{stderr[-6000:]}")
    assert script.returncode == 0, stderr[-4000:]
    summary = last_json_line(stdout)

    # rows committed, recomputed and duplicated by each stage that lost a node or its driver
    sentences = run.stats("ingest")["sentences"]
    embed, index = summary["embed"], summary["index"]
    print(f"embed, a node lost: {embed['rows_out']} of {embed['rows_in']} vectors committed, "
          f"{embed['rows_computed']} computed in the pass, {embed['rows'] - embed['unique']} duplicated")
    print(f"index --force, driver killed in the swap: exit {index['exit']}, a reader then found "
          f"{index['after_kill']['vectors']} vectors whole; the rerun left {index['left']}")
    print(f"evaluation, driver killed: {summary['resume']['committed']} committed, "
          f"{summary['resume']['rows_computed']} recomputed, 0 duplicated (its rows are unique: asserted below)")

    # a worker node lost while the passages were embedded again: every vector once
    assert embed["killed"].get("during"), embed
    assert embed["rows_in"] == embed["rows_out"] == embed["rows"] == embed["unique"] == sentences, embed
    assert embed["rows_resumed"] + embed["rows_computed"] == embed["rows_out"], embed
    # the forced rebuild's driver killed between moving the pointer and removing the old version: readers found one
    # index whole; the next command completed the rebuild and left one version
    assert index["exit"] == -signal.SIGKILL and index["rerun_exit"] == 0, index["log"]
    assert index["before"] == index["after_kill"] == index["after_rerun"], index
    assert index["before"]["vectors"] == embed["rows_out"], index
    assert len(index["left"]) == 2 and index["left"][0] == "_COMMIT", index

    # a worker node died in each stage, part way (of three and a replacement: the head and one remain)
    killed = {k: summary[k] for k in ("predict_killed", "eval_killed")}
    assert all(k.get("during") for k in killed.values()), killed
    assert "MapBatches" in killed["predict_killed"]["task"] and "_ServiceWorker" in killed["eval_killed"]["task"]
    assert summary["alive_nodes"] == 2
    assert summary["predictions"] == {"rows": sentences, "unique": sentences}
    one_node_keep = pq.read_table(run.layout.zero_rag.pruned(0.3).keep.path, columns=["id", "keep"]).to_pylist()
    assert summary["keep_rows"] == sentences
    assert summary["dropped"] == sorted(r["id"] for r in one_node_keep if not r["keep"])

    for key, label in (("zero_rag", eval_label("t", 0.3, False, True, True)), ("writeback", eval_label("t", 0.3, True))):
        got = summary[key]["naive"]
        answers, docs = _one_node_answers(run, label)
        assert got["rows"] == got["unique"] == len(answers)
        assert got["docs"] == docs, key  # the same documents from the same indices (the write-back union too)
        assert got["answers"] == answers, key

    # a driver killed with half of an evaluation's answers committed (to object storage): the rerun reads them
    # back, computes the rest, and answers as the uninterrupted evaluation did
    resume, total = summary["resume"], len(answers)
    assert resume["total"] == total and total / 2 <= resume["committed"] < total, resume
    assert resume["exit"] == -signal.SIGKILL and not resume["complete_at_kill"], resume
    assert resume["rows_resumed"] == resume["committed"] and resume["rows_computed"] == total - resume["committed"]
    assert not resume["checkpoint_left"] and resume["same_answers"], resume
