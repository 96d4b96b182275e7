"""The retrieval service on a real local Ray cluster: shard groups bounded by memory in search actors that
declare it, replicas, results equal to the in-process search, the base + write-back union, one pool per
index shared by every pass of a command, and clear errors."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.index.conftest import clustered, index_config, write_shards
from wbrag_ray.config import IndexConfig, RetrievalConfig
from wbrag_ray.index.build import build_index
from wbrag_ray.index.files import IndexError_, load_manifest
from wbrag_ray.retrieval.docstore import write_doc_store
from wbrag_ray.retrieval.local import IndexUnion, Retriever
from wbrag_ray.retrieval.service import shard_groups
from wbrag_ray.stages.service import Services
from wbrag_ray.storage import resolve

# each test's searches are one command's: its pools end when it closes them, none is taken over from another
pytestmark = pytest.mark.usefixtures("one_command")

DIM = 16


def _index(root, name, vecs, ids, shards, factory="Flat"):
    docs = root / f"{name}-parquet"
    docs.mkdir(parents=True)
    pq.write_table(pa.table({"id": pa.array(ids, pa.int64()), "title": [f"{name} {i}" for i in ids],
                             "text": [f"{name} text {i}" for i in ids]}), docs / "docs.parquet")
    write_doc_store(resolve(str(docs)), "passage", resolve(str(root / f"{name}-docs")), parallel=False)
    write_shards(root / f"{name}-emb", vecs, ids=ids, parts=shards)
    build_index(resolve(str(root / f"{name}-emb")), resolve(str(root / name)), "m", "passage",
                index_config(factory, num_shards=shards), parallel=False, docs=str(root / f"{name}-docs"))
    return str(root / name)


@pytest.fixture(scope="module")
def indices(tmp_path_factory):
    root = tmp_path_factory.mktemp("service")
    vecs = clustered(1_300, DIM, seed=3)
    base = _index(root, "base", vecs[:1_200], np.arange(1_200, dtype=np.int64) * 10, shards=4)
    wb = _index(root, "wb", vecs[1_200:], np.arange(100, dtype=np.int64), shards=1)
    return base, wb, vecs


def _small_actors(**kw):
    return RetrievalConfig(actor_memory_gb=kw.pop("gb", 60_000 / (1 << 30)), search_cpus=0.1, **kw)


def _wait_for(condition, seconds: float = 20.0):
    """Ray frees a killed actor's resources asynchronously."""
    import time

    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.2)


def test_shard_groups_stay_within_the_budget_in_manifest_order():
    shards = [{"bytes": b} for b in (40, 40, 30, 100, 10, 10)]
    assert shard_groups(shards, 80) == [[0, 1], [2], [3], [4, 5]]
    assert shard_groups(shards, 1_000) == [[0, 1, 2, 3, 4, 5]]


def test_the_service_answers_as_the_in_process_search_does(indices, ray_cluster):
    import ray

    base, wb, vecs = indices
    queries = vecs[[3, 500, 1_100, 1_250]] + 0.01
    retrieval = _small_actors(concurrency=2)
    memory_before = ray.available_resources().get("memory", 0)
    with Services() as services:
        service = services.retrieval(((base, None, "base"),), IndexConfig(nprobe=4), retrieval)
        pool = service.pools[0]
        # four ~20 KB shards, a 60 KB budget: more than one group, each in two replicas, memory declared to Ray
        assert len(pool.actors) > 1 and all(len(r) == 2 for r in pool.actors)
        assert ray.available_resources().get("memory", 0) < memory_before
        for _ in range(3):  # calls go to alternating replicas: the answers do not change
            got = service.search_vectors(queries, 7)
            want = Retriever(base).search_vectors(queries, 7)
            assert [[(h.id, h.title, h.text) for h in hits] for hits in got] == \
                   [[(h.id, h.title, h.text) for h in hits] for hits in want]
            np.testing.assert_allclose([[h.score for h in hits] for hits in got],
                                       [[h.score for h in hits] for hits in want], rtol=1e-6)
        assert got[0][0].title == "base 30"
        assert service.latency_ms(queries, 7, min_seconds=0.05) > 0
    _wait_for(lambda: ray.available_resources().get("memory", 0) == pytest.approx(memory_before, rel=1e-6))  # closed


def test_a_union_with_the_writeback_index_matches_the_in_process_union(indices, ray_cluster):
    base, wb, vecs = indices
    queries = vecs[[5, 1_210, 1_290]]
    with Services() as services:
        service = services.retrieval(((base, None, "base"), (wb, None, "writeback")), IndexConfig(), _small_actors())
        got = service.search_vectors(queries, 6)
    want = IndexUnion([Retriever(base), Retriever(wb, source="writeback")]).search_vectors(queries, 6)
    assert [[(h.key, h.title) for h in hits] for hits in got] == [[(h.key, h.title) for h in hits] for hits in want]
    assert got[1][0].key == ("writeback", 10) and got[1][0].title == "wb 10"


def test_every_pass_of_a_command_shares_one_pool_per_index(indices, ray_cluster):
    base, wb, _ = indices
    with Services() as services:
        first = services.retrieval(((base, None, "base"),), IndexConfig(), _small_actors())
        again = services.retrieval(((base, "other-docs", "base"), (wb, None, "writeback")), IndexConfig(),
                                   _small_actors())
        assert again.pools[0] is first.pools[0] and services.started["search"] == 2
        services.retrieval(((wb, None, "base"),), IndexConfig(), _small_actors())  # held already: nothing starts
        assert services.started["search"] == 2 and first.pools[0].actors
        # another index (here: other search settings) ends the pools this request does not name
        services.retrieval(((base, None, "base"),), IndexConfig(nprobe=8), _small_actors())
        assert services.started["search"] == 3 and not first.pools[0].actors and not again.pools[1].actors


def test_a_search_pool_the_cluster_cannot_place_is_refused_before_any_actor_starts(indices, ray_cluster):
    """A shard per group (a 1-byte budget), 4 groups x 6 replicas of 0.1 CPU: 24 actors, 2.4 CPUs on this
    2-CPU cluster: room for 20, 5 replicas a group."""
    from wbrag_ray.config import ConfigError

    base, _, _ = indices
    with Services() as services, pytest.raises(ConfigError, match=r"the search pool: 24 actors of 0\.1 CPU and "
                                               r".* GiB memory each .* \(room for 20\); lower its concurrency to 5"):
        services.retrieval(((base, None, "base"),), IndexConfig(), _small_actors(gb=1 / (1 << 30), concurrency=6))
    assert services.started == {}


def test_a_missing_shard_is_named_when_the_service_starts(indices, tmp_path, ray_cluster):
    import shutil

    base, _, _ = indices
    broken = tmp_path / "broken"
    shutil.copytree(base, broken)
    (broken / load_manifest(resolve(str(broken)))["files"][1]).unlink()
    with Services() as services, pytest.raises(IndexError_, match=r"index-00001.faiss named by .* is missing"):
        services.retrieval(((str(broken), None, "base"),), IndexConfig(), _small_actors())


@pytest.fixture(scope="module")
def ivf_index(indices, tmp_path_factory):
    """The base vectors in an IVF index of four shards (one trained quantizer), searched 3 lists of 8."""
    vecs = indices[2]
    root = tmp_path_factory.mktemp("service-ivf")
    return _index(root, "ivf", vecs[:1_200], np.arange(1_200, dtype=np.int64) * 10, shards=4, factory="IVF8,Flat")


def _each_shard_alone(index_dir, queries, k, nprobe):
    """faiss's own search of every shard (each runs its quantizer), merged: what a shared assignment must give."""
    from wbrag_ray.retrieval.hits import merge_results

    shards = Retriever(index_dir, nprobe=nprobe, gpu=False).searcher.shards
    return merge_results([s.search(queries, k) for s in shards], k)


def test_ivf_groups_share_one_coarse_assignment_and_answer_as_each_shard_searched_alone(indices, ivf_index,
                                                                                        ray_cluster):
    vecs = indices[2]
    queries = vecs[[3, 500, 1_100, 1_250]] + 0.01
    scores, ids = _each_shard_alone(ivf_index, queries, 7, nprobe=3)
    in_process = Retriever(ivf_index, nprobe=3)
    assert in_process.dim == DIM and in_process.searcher.ivfs is not None  # the in-process search shares it too
    np.testing.assert_array_equal(in_process.search_ids(queries, 7)[1], ids)
    with Services() as services:
        pool = services.retrieval(((ivf_index, None, "base"),), IndexConfig(nprobe=3), _small_actors()).pools[0]
        assert len(pool.actors) > 1 and pool.shared_assignment
        for _ in range(len(pool.actors)):  # each group makes the assignment in turn
            got_scores, got_ids, seconds = pool.search_ids(queries, 7)
            np.testing.assert_array_equal(got_ids, ids)
            np.testing.assert_allclose(got_scores, scores, rtol=1e-6)
            assert seconds > 0


def test_a_lost_search_actor_mid_search_is_answered_by_its_replica(indices, ivf_index, ray_cluster, tmp_path,
                                                                    monkeypatch):
    """A search actor dies while it answers: its first search call says it started (and never that it finished)
    and stalls; the test kills that actor for good meanwhile. The search in flight still returns the in-process
    answer, from the replica, and so do later ones, in turns where the lost actor would be asked."""
    import os
    import threading
    import time

    import ray

    from wbrag_ray.retrieval import service

    claim, started, finished = tmp_path / "claim", tmp_path / "started", tmp_path / "finished"

    class StallingSearchActor(service.SearchActor):
        def search(self, vectors, k, assigned=None):
            try:  # the pool's first search call, whichever actor gets it
                os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                return service.SearchActor.search(self, vectors, k, assigned)
            (tmp_path / "started.tmp").write_text(ray.get_runtime_context().get_actor_id())
            os.rename(tmp_path / "started.tmp", started)
            time.sleep(120)  # killed meanwhile
            finished.write_text("")
            return service.SearchActor.search(self, vectors, k, assigned)

    monkeypatch.setattr(service, "SearchActor", StallingSearchActor)
    vecs = indices[2]
    queries = vecs[[7, 640, 1_150]]
    _, ids = _each_shard_alone(ivf_index, queries, 5, nprobe=3)
    with Services() as services:
        pool = services.retrieval(((ivf_index, None, "base"),), IndexConfig(nprobe=3),
                                  _small_actors(concurrency=2)).pools[0]
        by_id = {a._actor_id.hex(): a for replicas in pool.actors for a in replicas}
        lost = []

        def kill_the_stalled_actor():
            deadline = time.monotonic() + 60
            while not started.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            if started.exists():
                lost.append(by_id[started.read_text()])
                ray.kill(lost[0], no_restart=True)

        killer = threading.Thread(target=kill_the_stalled_actor)
        killer.start()
        got = pool.search_ids(queries, 5)[1]
        killer.join()
        assert lost and not finished.exists()  # the call was in flight when its actor died
        np.testing.assert_array_equal(got, ids)
        with pytest.raises(ray.exceptions.ActorDiedError):
            ray.get(lost[0].ready.remote())
        for _ in range(2 * len(pool.actors)):  # turns in which the lost actor assigns, and in which it searches
            np.testing.assert_array_equal(pool.search_ids(queries, 5)[1], ids)


def test_shards_of_different_trainings_search_each_with_its_own_quantizer(indices, ivf_index, tmp_path):
    from wbrag_ray.index.search import ShardSearch
    from wbrag_ray.retrieval.hits import merge_results

    vecs = indices[2]
    other = _index(tmp_path, "ivf4", vecs[:1_200], np.arange(1_200, dtype=np.int64) * 10, shards=2,
                   factory="IVF4,Flat")
    other_shards = Retriever(other, nprobe=2, gpu=False).searcher.shards
    shards = [Retriever(ivf_index, nprobe=2, gpu=False).searcher.shards[0], other_shards[0]]
    searcher = ShardSearch(shards)
    assert searcher.ivfs is None and searcher.fingerprint is None
    assert ShardSearch(other_shards).fingerprint is not None  # one training: one quantizer
    queries = vecs[[2, 900]]
    want = merge_results([s.search(queries, 4) for s in shards], 4)
    np.testing.assert_array_equal(searcher.search(queries, 4)[1], want[1])
