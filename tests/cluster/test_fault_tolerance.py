"""Fault tests on real local Ray clusters (marked slow: one to three minutes each on 2 CPUs; CI runs them)."""

import os
import subprocess
import sys

import pytest

from tests.conftest import joining_env, last_json_line
from tests.drivers import ONE_WRITE_AT_A_TIME_CPUS, kill_once_committed

pytestmark = pytest.mark.slow


def test_losing_a_worker_node_mid_embed_loses_and_duplicates_nothing(tmp_path, tiny):
    """`build_kb.embed` (what `wbrag embed` runs, checkpointed) on three nodes; a worker node that Ray's actor
    table shows holding an embed actor is removed once a few embedding files are written. The tiny embedder:
    what is tested is the stage's checkpoint and Ray's recovery, not the vectors."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.setdefault("RAY_raylet_start_wait_time_s", "120")  # three raylets starting on a busy 2-CPU machine
    out = subprocess.run([sys.executable, "-m", "tests.cluster.multinode_embed", str(tmp_path), "2400",
                          tiny.embedder],
                         capture_output=True, text=True, timeout=600, env=env,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert out.returncode == 0, out.stderr[-3000:]
    summary = last_json_line(out.stdout)
    killed = summary["killed"]
    assert "node" in killed, (killed, summary["attempts"], out.stderr[-3000:])  # the kill happened
    assert killed["embed_actors_on_node"] and summary["dead_nodes"] == [killed["node"]]  # an embed actor's node
    assert summary["alive_nodes"] == 2
    # the node died part way: some files written before, fewer than the stage ends with
    assert 3 <= killed["files_before_kill"] < summary["files_after"], (killed, summary["attempts"])
    assert summary["complete"] and summary["attempts"][-1] == "ok", summary["attempts"]
    # every ingested passage embedded exactly once (the ids read from the files, against the ingest output)
    embedded, ingested = summary["embedded_ids"], summary["ingested_ids"]
    assert len(ingested) == 2400 and len(set(ingested)) == 2400
    assert sorted(embedded) == sorted(ingested)


def _cli(args, ray_cluster):
    """`wbrag ARGS` as a driver joined to the session's cluster."""
    env = joining_env(ray_cluster)
    return subprocess.Popen([sys.executable, "-m", "wbrag_ray.cli", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def test_killed_driver_resumes_the_embed_stage_without_loss_or_duplicates(tmp_path, ray_cluster, tiny):
    from tests.conftest import demo_records, write_jsonl
    from wbrag_ray.cli import main
    from wbrag_ray.run import RunFolder

    records = [{"id": f"{r['id']}-{k}", "contents": r["contents"]} for k in range(12) for r in demo_records()]
    corpus = write_jsonl(tmp_path / "corpus.jsonl", records)
    run = tmp_path / "run"
    layout = RunFolder(str(run)).layout
    # The tiny embedder (what is tested is the stage's checkpoint, not the vectors); the run's config keeps it for
    # the `wbrag embed` below. 0.5 CPU: on resume Ray adds a CheckpointFilter actor that holds 1 CPU of this
    # 2-CPU node.
    common = [*tiny.set_args(), "--set", "embedder.num_cpus=0.5", "--set", "embedder.threads=2",
              "--set", "embedder.batch_size=16", "--set", "embedder.checkpoint_rows=100"]
    # 14 shards; the stage writes blocks of `resumable_write`'s 64 KiB floor: about 177 rows, 7 files
    assert main(["ingest", str(run), "--corpus", str(corpus), "--set", "ingest.shard_bytes=32768", *common]) == 0

    # The killed driver's embed actor asks for 1.75 of the node's 2 CPUs, so one read or write task (0.25 CPU) runs
    # beside it and the files are written one at a time: killed at its first commit, at most the write then
    # running ends after the kill (measured: 1 file of 7 when Ray had ended the job, twice; 3-4 with the kill at
    # three files, looking every 0.2 s). With the writes six at a time beside a 0.5-CPU actor, the stage could end
    # before the kill (seen with 7 shards and the kill at three files): the tasks running at a kill still finish
    # (tests/drivers.py).
    committed, log = kill_once_committed(
        [sys.executable, "-m", "wbrag_ray.cli", "embed", str(run), "--set",
         f"embedder.num_cpus={ONE_WRITE_AT_A_TIME_CPUS:g}"], joining_env(ray_cluster), layout.checkpoint("embed"), 1,
        ray_cluster)
    from wbrag_ray.checkpoints import rows_by_file

    written_before = sum(rows_by_file(layout.embed).values())  # a file the kill cut short holds none
    assert 0 < committed <= written_before < len(records), (committed, written_before, log[-3000:])
    assert not layout.stage("embed").success.exists()

    # A resume run as it ran (a 1-CPU embed actor beside Ray Data's 1-CPU CheckpointFilter actor would leave no CPU
    # for the read and write tasks of this 2-CPU node: it would wait forever) narrows its actor to fit and says so
    p = _cli(["embed", str(run), "--set", "embedder.num_cpus=1"], ray_cluster)
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
    assert "embedder.num_cpus 1 -> 0.75" in out, out[-3000:]
    assert f"of {len(records):,} rows from the checkpoint" in out
    stats = layout.stage("embed").stats.read_json()
    assert stats["rows_out"] == len(records)
    # the rerun did only what was left (a file whose checkpoint was not committed at the kill is written again)
    assert 0 < stats["rows_resumed"] <= written_before and stats["rows_computed"] == len(records) - stats["rows_resumed"]
    assert not layout.checkpoint("embed").exists()
    ids = layout.embed.read_table(["pid"])["pid"].to_pylist()
    passages = layout.ingest.passages.read_table(["pid"])["pid"].to_pylist()
    assert len(ids) == len(set(ids)) == len(passages) and set(ids) == set(passages)
