"""An index build that stops part way resumes in the same stage (issue 26): its tasks record their results in
the stage's checkpoint as their files are written, and the rerun takes the trained index, the parts and the
shards an earlier attempt finished and runs only the rest, writing the files an uninterrupted build writes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.conftest import joining_env, last_json_line
from tests.drivers import kill_once_committed, start
from tests.index.conftest import clustered, index_config, write_shards
from wbrag_ray.checkpoints import progress
from wbrag_ray.config import WbragConfig
from wbrag_ray.index.build import build_index
from wbrag_ray.index.files import IndexError_
from wbrag_ray.run import RunFolder, RunStage
from wbrag_ray.storage import resolve

ROOT = Path(__file__).resolve().parents[2]


def _files(folder: Path) -> dict[str, bytes]:
    """The index's files (shards, trained index) by name; the manifest apart, as it names its folder."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.suffix == ".faiss"}


def _manifest(folder: Path) -> dict:
    manifest = json.loads((folder / "manifest.json").read_text())
    return {k: v for k, v in manifest.items() if k not in ("embeddings", "docs")}


@pytest.mark.slow
def test_an_index_build_whose_driver_is_killed_resumes_its_finished_tasks(tmp_path, ray_cluster):
    """HNSW (no merge step: each add task writes a final index shard, about a quarter of a second of graph building
    each) in twelve shards on the session's cluster: the driver is SIGKILLed once half the vectors are in
    recorded shards, and the same command adds only the rest."""
    emb = tmp_path / "emb"
    vecs = clustered(12 * 2500, 64, seed=3)
    write_shards(emb, vecs, parts=12)
    factory, shards = "HNSW32", 12
    reference = tmp_path / "reference"
    build_index(resolve(str(emb)), resolve(str(reference)), "m", "passage",
                index_config(factory, num_shards=shards, num_cpus=1))

    run = RunFolder(str(tmp_path / "run"))
    args = [sys.executable, "-m", "tests.index.stage_build", run.uri, str(emb), factory, str(shards)]
    env = joining_env(ray_cluster)
    total = len(vecs)
    # a look every 0.1 s (a dozen small files read): a task takes longer, so the kill lands within a task or two
    committed, log = kill_once_committed(args, env, run.layout.checkpoint("index"), total / 2, ray_cluster,
                                         cwd=ROOT, poll_s=0.1)
    assert total / 2 <= committed < total, (committed, log[-3000:])
    assert not run.is_complete("index") and progress(run.layout.checkpoint("index"))["pass"] == "index"

    again = start(args, env, cwd=ROOT)
    out = again.communicate(timeout=300)[0]
    assert again.returncode == 0, out[-3000:]
    stats = last_json_line(out)
    assert f"resumed {committed // 2500} of {shards} add tasks" in out
    assert stats["train_resumed"] and stats["add_tasks_resumed"] == committed // 2500
    assert stats["rows_resumed"] == committed and stats["rows_computed"] == total - committed <= 0.6 * total
    assert not run.layout.checkpoint("index").exists()
    index = Path(run.layout.index.path)
    assert _files(index) == _files(reference) and len(_files(index)) == shards + 1  # the trained index too
    assert _manifest(index) == _manifest(reference)


def test_an_ivf_build_that_failed_on_a_bad_shard_resumes_its_parts_once_the_shard_is_fixed(tmp_path):
    """A pruned view of an IVF (the trained index given, as Zero-RAG's pruning builds it) in this process: the
    eighth of twelve embedding shards holds vectors of another dimension (another embedder's), so the stage
    fails with seven parts recorded; with the shard written again, the rerun encodes five parts, merges, and
    writes the uninterrupted build's files."""
    emb = tmp_path / "emb"
    vecs = clustered(12 * 300, 32, seed=5)
    ids = write_shards(emb, vecs, parts=12)
    source = tmp_path / "source"
    build_index(resolve(str(emb)), resolve(str(source)), "m", "passage",
                index_config("IVF16,SQ8", train_sample=39 * 16, num_shards=2), parallel=False)
    trained, drop = (source / "trained.faiss").read_bytes(), ids[::7]
    reference = tmp_path / "reference"

    def build(out):
        return build_index(resolve(str(emb)), out, "m", "passage",
                           index_config("IVF16,SQ8", num_shards=3), trained=trained, drop_ids=drop, parallel=False)

    build(resolve(str(reference)))
    run = RunFolder(str(tmp_path / "run"))

    def stage(ratio: float, force: bool = False) -> dict:
        return run.execute(RunStage("prune-index"), WbragConfig(), lambda: build(run.layout.index),
                           params={"ratio": ratio}, force=force)

    bad = emb / "emb-000007.parquet"
    good = bad.read_bytes()
    other = tmp_path / "other"
    write_shards(other, clustered(300, 16), ids=ids[7 * 300:8 * 300], parts=1)
    wrong = (other / "emb-000000.parquet").read_bytes()
    bad.write_bytes(wrong)
    with pytest.raises(IndexError_, match="emb-000007.parquet has dimension 16"):
        stage(0.3)
    assert progress(run.layout.checkpoint("prune-index"))["committed"] == 7 * 300
    bad.write_bytes(good)

    stats = stage(0.3)
    assert stats["add_tasks_resumed"] == 7 and stats["merge_tasks_resumed"] == 0
    assert stats["rows_resumed"] == 7 * 300 and stats["rows_computed"] == 5 * 300
    assert stats["rows_dropped"] == len(drop) and stats["rows_out"] == len(vecs) - len(drop)
    index = Path(run.layout.index.path)
    assert _files(index) == _files(reference) and not (index / "_parts").exists()
    assert _manifest(index) == _manifest(reference)

    # another stage's settings never take these records: the checkpoint is started over
    assert not run.layout.checkpoint("prune-index").exists()
    bad.write_bytes(wrong)
    with pytest.raises(IndexError_):
        stage(0.3, force=True)
    bad.write_bytes(good)
    stats = stage(0.5, force=True)
    assert stats["add_tasks_resumed"] == 0 and stats["rows_computed"] == len(vecs)
    assert _files(index) == _files(reference)
