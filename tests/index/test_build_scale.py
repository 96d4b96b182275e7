"""The index build at any size: factory and training sample chosen together, shard count from a memory budget,
add parts without the quantizer, merges as parallel tasks, and where k-means trains (issue 15, item 2)."""

import json
import time

import faiss
import numpy as np
import pytest

from tests.index.conftest import clustered, index_config, write_shards
from wbrag_ray.index.build import _add_task, build_index
from wbrag_ray.index.files import new_index
from wbrag_ray.index.sizing import (
    MIN_POINTS_PER_CENTROID,
    TASK_BASE_BYTES,
    bytes_per_vector,
    plan_training,
    shards_for,
    train_resources,
    train_sample_cap,
)
from wbrag_ray.index.tasks import cluster_gpus
from wbrag_ray.retrieval.local import Retriever
from wbrag_ray.storage import resolve

GiB = 1 << 30


@pytest.fixture(autouse=True)
def _one_faiss_thread():
    """faiss's OpenMP threads spin when the cores are shared (CI, other jobs): one thread keeps k-means fast."""
    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    yield
    faiss.omp_set_num_threads(before)


def _build(tmp_path, factory, emb="emb", out="idx", parallel=None, trained=None, **settings):
    return build_index(resolve(str(tmp_path / emb)), resolve(str(tmp_path / out)), "m", "passage",
                       index_config(factory, **settings), parallel=parallel, trained=trained)


# --- factory and training sample, together (pure: no data) ----------------------------------------------


@pytest.mark.parametrize(
    "n, dim, factory, sample",
    [
        (138_000_000, 768, "IVF65536_HNSW32,PQ96", 39 * 65536),  # 2^18 lists wanted; 8 GB holds 2.8M x 768
        (138_000_000, 384, "IVF131072_HNSW32,PQ96", 39 * 131072),
        (21_000_000, 768, "IVF65536_HNSW32,PQ96", 39 * 65536),  # was 1.5 points per centroid
        (21_000_000, 384, "IVF65536_HNSW32,SQ8", 39 * 65536),
        (1_000_000, 384, "IVF4096,Flat", 39 * 4096),
        (10_000, 384, "Flat", 10_000),  # no training needed; the sample is never more than the corpus
    ],
)
def test_auto_factory_and_training_sample_give_39_points_per_centroid(n, dim, factory, sample):
    plan = plan_training(n, dim, "auto", 100_000, memory_budget_gb=16, train_memory_gb=8)
    assert (plan.factory, plan.train_sample) == (factory, sample)
    assert plan.train_sample * dim * 4 <= 8 * GiB
    if plan.nlist:
        assert plan.train_sample >= MIN_POINTS_PER_CENTROID * plan.nlist  # faiss would refuse nx < k, warn below 39k


def test_auto_takes_fewer_centroids_when_the_train_memory_is_small_and_keeps_a_larger_sample():
    plan = plan_training(1_000_000, 384, "auto", 100_000, train_memory_gb=0.1)  # 69,905 vectors fit
    assert (plan.factory, plan.train_sample) == ("IVF1024,Flat", 69_905)  # the configured 100K, capped
    assert train_sample_cap(384, 0.1) == 69_905
    assert plan_training(1_000_000, 384, "auto", 500_000).train_sample == 500_000  # more than 39 per list: kept


def test_explicit_ivf_factory_gets_its_sample_raised_or_a_clear_error_before_any_work(tmp_path):
    plan = plan_training(21_000_000, 768, "IVF65536,PQ64", 2_000_000)
    assert (plan.factory, plan.train_sample) == ("IVF65536,PQ64", 39 * 65536)  # the factory is never changed
    with pytest.raises(ValueError, match=r"10,223,616 training vectors.*raise index.train_memory_gb to 30.*IVF65536"):
        plan_training(138_000_000, 768, "IVF262144_HNSW32,PQ96", 100_000)
    assert plan_training(600, 32, "IVF16,Flat", 100_000).train_sample == 600  # a small corpus: all of it
    with pytest.raises(ValueError, match="IVF lists but the corpus only 3 vectors"):
        plan_training(3, 32, "IVF4,Flat", 100_000)
    write_shards(tmp_path / "emb", clustered(6000, 32), parts=2)
    with pytest.raises(ValueError, match="index.train_memory_gb"):
        _build(tmp_path, "IVF64,Flat", train_memory_gb=0.0001, parallel=False)  # 838 vectors fit, 2,496 needed
    assert not (tmp_path / "idx").exists()  # refused before training wrote anything


# --- num_shards from the shard memory budget -------------------------------------------------------------


def test_bytes_per_vector_comes_from_the_trained_index():
    x = clustered(3000, 32)
    sizes = {}
    for factory in ("Flat", "IVF16,Flat", "IVF16,SQ8", "IVF16,PQ8np", "PCA16,IVF16,SQ8", "HNSW16"):
        index = new_index(factory, 32)
        index.train(x)
        sizes[factory] = bytes_per_vector(index)
    assert sizes["Flat"] == sizes["IVF16,Flat"] == 8 + 4 * 32  # id + float32 code
    assert (sizes["IVF16,SQ8"], sizes["IVF16,PQ8np"], sizes["PCA16,IVF16,SQ8"]) == (8 + 32, 8 + 8, 8 + 16)
    assert sizes["HNSW16"] > 8 + 4 * 32 + 4 * 32  # raw vectors, id and 2 x 16 links at level 0


def test_num_shards_auto_is_the_index_bytes_over_the_shard_budget():
    # 138M x PQ96 codes + ids (13.4 GB), every shard carrying a 200 MB trained quantizer
    assert shards_for(138_000_000, 104, 200 << 20, 4.0) == 4
    assert shards_for(138_000_000, 104, 200 << 20, 1.0) == 17
    assert shards_for(21_000_000, 8 + 768 * 4, 0, 4.0) == 16  # Flat at 21M x 768: 60 GB
    assert shards_for(1000, 136, 1000, 4.0) == 1
    with pytest.raises(ValueError, match="shard_memory_gb=0.1 cannot hold an index shard.*trained index alone"):
        shards_for(138_000_000, 104, 200 << 20, 0.1)


def test_auto_shard_count_matches_the_files_it_writes(tmp_path):
    write_shards(tmp_path / "emb", clustered(6000, 32), parts=6)
    stats = _build(tmp_path, "IVF64,Flat", num_shards="auto", shard_memory_gb=0.0003, parallel=False)  # 322 KB
    manifest = json.loads((tmp_path / "idx" / "manifest.json").read_text())
    assert stats["num_shards"] == manifest["num_shards"] == 3  # 6000 x 136 bytes + 3 x 8 KB of quantizer
    estimate = 6000 * stats["bytes_per_vector_estimate"] + 3 * stats["trained_bytes"]
    assert abs(sum(s["bytes"] for s in manifest["shards"]) - estimate) < 0.05 * estimate
    assert all(s["bytes"] <= 0.0003 * GiB for s in manifest["shards"])


def test_a_bad_num_shards_or_a_shard_budget_below_the_quantizer_is_refused_before_training(tmp_path):
    write_shards(tmp_path / "emb", clustered(3000, 32), parts=2)
    for bad in ("many", 0):
        with pytest.raises(ValueError, match="num_shards must be a positive integer or 'auto'"):
            _build(tmp_path, "IVF64,Flat", num_shards=bad, parallel=False)
    with pytest.raises(ValueError, match="shard_memory_gb=1e-06 cannot hold an index shard"):
        _build(tmp_path, "IVF64,Flat", shard_memory_gb=1e-6, parallel=False)  # 1 KB; the quantizer takes 8 KB
    assert not (tmp_path / "idx").exists()


# --- add parts: codes only, merged to the same index -----------------------------------------------------


def test_ivf_parts_carry_codes_not_the_quantizer_and_merge_to_the_same_index(tmp_path):
    vecs = clustered(12_000, 64, clusters=50, seed=11)
    ids = write_shards(tmp_path / "emb", vecs, parts=6)
    stats = _build(tmp_path, "IVF256,PQ8np", num_shards=1, parallel=False)  # np: no polysemous training (slow)
    assert stats["part_format"] == "codes"
    trained = (tmp_path / "idx" / "trained.faiss").read_bytes()
    files = sorted((tmp_path / "emb").glob("*.parquet"))

    # part sizes: the new codes-only part vs the old whole-index part, for the same 2,000 vectors
    shared = {"trained": trained, "drop_ids": None, "threads": None, "code_parts": True}
    new = _add_task(shared, (str(tmp_path / "p" / "new.codes.npz"), [str(files[0])]))
    old = _add_task({**shared, "code_parts": False}, (str(tmp_path / "p" / "old.faiss"), [str(files[0])]))
    assert new["count"] == old["count"] == 2000
    assert new["bytes"] < 2000 * (8 + 1 + 8) + 1024  # id + list number + PQ8 code, and the .npz's headers
    assert old["bytes"] > len(trained) > 3 * new["bytes"]  # the old part carried the quantizer and codebooks

    # the old path (whole-index parts merged with merge_from) answers with the same ids and scores
    reference = faiss.deserialize_index(np.frombuffer(trained, np.uint8))
    for part_ids, part_vecs in zip(np.array_split(ids, 6), np.array_split(vecs, 6), strict=True):
        part = faiss.deserialize_index(np.frombuffer(trained, np.uint8))
        part.add_with_ids(part_vecs, part_ids)
        reference.merge_from(part, 0)
    built = Retriever(str(tmp_path / "idx"), nprobe=16, gpu=False)
    faiss.extract_index_ivf(reference).nprobe = 16
    q = clustered(100, 64, clusters=50, seed=12)
    d_new, i_new = built.search_ids(q, 10)
    d_old, i_old = reference.search(q, 10)
    np.testing.assert_array_equal(i_new, i_old)
    np.testing.assert_array_equal(d_new, d_old)


def test_auto_build_in_several_shards_searches_like_one_shard(tmp_path):
    vecs = clustered(60_000, 32, clusters=200, seed=13)
    write_shards(tmp_path / "emb", vecs, parts=8)
    # 2.7 MB a shard, 8.2 MB in all; a configured sample below 39 per list is raised
    stats = _build(tmp_path, "auto", train_sample=1000, shard_memory_gb=0.0025, parallel=False)
    assert stats["factory"] == "IVF1024,Flat" and stats["train_sample"] == 39 * 1024
    assert stats["num_shards"] == 4 and stats["part_format"] == "codes"
    manifest = json.loads((tmp_path / "idx" / "manifest.json").read_text())
    assert [s["file"] for s in manifest["shards"]] == manifest["files"] == [f"index-{i:05d}.faiss" for i in range(4)]
    trained = (tmp_path / "idx" / "trained.faiss").read_bytes()
    _build(tmp_path, manifest["factory"], out="one", num_shards=1, trained=trained, parallel=False)
    sharded = Retriever(str(tmp_path / "idx"), nprobe=32, gpu=False)
    one = Retriever(str(tmp_path / "one"), nprobe=32, gpu=False)
    q = clustered(200, 32, clusters=200, seed=14)
    d_sharded, i_sharded = sharded.search_ids(q, 10)
    d_one, i_one = one.search_ids(q, 10)
    np.testing.assert_array_equal(i_sharded, i_one)
    np.testing.assert_allclose(d_sharded, d_one, rtol=0, atol=1e-6)


# --- Ray: merges as parallel tasks, their memory, and where training runs --------------------------------


def test_merges_run_one_ray_task_per_shard_and_report_each_tasks_peak_memory(tmp_path, ray_cluster, monkeypatch):
    """The adds and merges run in Ray worker processes, not this one (each result names the process that made it
    and measured its peak), one merge per shard file; the in-process build of the same data, for contrast, runs
    every task here and makes the same index. What each merge task saw of itself is written down by a wrapper
    around it (Ray's task id, the process, the kernel's resident and peak-resident figures just before and after
    it): one task per shard, and each reported peak lies between the two figures the kernel gave."""
    import os

    from wbrag_ray.index import build

    merge, seen = build._merge_task, tmp_path / "merges"
    seen.mkdir()

    def observed(shared, item):  # a closure: travels to the workers by value, calls the real task there
        import json as json_
        import uuid

        import ray

        def status_mb(key):
            return next(int(line.split()[1]) / 1024 for line in open("/proc/self/status") if line.startswith(key + ":"))

        before = status_mb("VmRSS")
        out = merge(shared, item)
        (seen / uuid.uuid4().hex).write_text(json_.dumps({
            "task": ray.get_runtime_context().get_task_id(), "pid": os.getpid(), "file": item[0],
            "rss_before": before, "hwm_after": status_mb("VmHWM")}))
        return out

    monkeypatch.setattr(build, "_merge_task", observed)
    write_shards(tmp_path / "emb", clustered(3000, 16), parts=6)
    stats = _build(tmp_path, "IVF16,Flat", num_shards=3, parallel=True)
    monkeypatch.undo()
    assert stats["parallel"] and stats["add_tasks"] == 6 and stats["merge_tasks"] == 3
    workers = set(stats["add_task_pids"]) | set(stats["merge_task_pids"])
    assert len(stats["merge_task_pids"]) == 3 and os.getpid() not in workers
    for pid in workers:  # live Ray worker processes (Ray titles them ray::<task>, ray::IDLE between tasks)
        assert open(f"/proc/{pid}/cmdline").read().startswith("ray::"), pid
    tasks = [json.loads(f.read_text()) for f in seen.iterdir()]
    assert len({t["task"] for t in tasks}) == len(tasks) == 3  # three Ray tasks, each merging one shard
    by_file = {t["file"].rsplit("/", 1)[-1]: t for t in tasks}
    assert sorted(by_file) == [f"index-{j:05d}.faiss" for j in range(3)]
    for j, (pid, peak) in enumerate(zip(stats["merge_task_pids"], stats["merge_task_peak_rss_mb"], strict=True)):
        task = by_file[f"index-{j:05d}.faiss"]
        # the peak since the task began: at least what the process held then (less a MiB the allocator may have
        # given back), at most the kernel's peak read after it (rounded to 0.1 in the stats)
        assert task["pid"] == pid and task["rss_before"] - 1 <= peak <= task["hwm_after"] + 0.05, (task, peak)
    assert stats["train_peak_rss_mb"] > 0 and stats["add_peak_rss_mb"] > 0
    assert stats["peak_rss_mb"] == max(stats["train_peak_rss_mb"], stats["add_peak_rss_mb"], stats["merge_peak_rss_mb"])
    manifest = json.loads((tmp_path / "idx" / "manifest.json").read_text())
    assert [s["file"] for s in manifest["shards"]] == [f"index-{j:05d}.faiss" for j in range(3)]

    here = _build(tmp_path, "IVF16,Flat", out="idx-here", num_shards=3, parallel=False)
    assert not here["parallel"] and set(here["add_task_pids"]) | set(here["merge_task_pids"]) == {os.getpid()}
    q = clustered(3000, 16)[:20]
    for a, b in zip(load_shards_of(tmp_path / "idx"), load_shards_of(tmp_path / "idx-here"), strict=True):
        np.testing.assert_array_equal(a.search(q, 5)[1], b.search(q, 5)[1])


def load_shards_of(folder):
    return Retriever(str(folder), nprobe=None, gpu=False).searcher.shards


NODE = {"CPU": 8.0, "memory": 64 * 2**30, "free_CPU": 8.0}


def _train(num_cpus, **kw):
    return train_resources(num_cpus, **kw, node=NODE, sample_bytes=0, quantizer_bytes=0)


def test_train_task_asks_for_no_gpu_when_the_cluster_has_none(tmp_path, ray_cluster):
    assert cluster_gpus(parallel=True) == 0
    assert _train(1.0, gpu=True, cluster_gpus=0, faiss_gpu=True, kmeans=True)["num_gpus"] == 0
    write_shards(tmp_path / "emb", clustered(2000, 16), parts=2)
    stats = _build(tmp_path, "IVF8,Flat", gpu=True, parallel=True)
    assert stats["train_on_gpu"] is False and stats["rows_out"] == 2000


def test_train_and_merge_tasks_get_the_cpus_and_memory_they_use_from_rays_scheduler(tmp_path, ray_cluster):
    """What Ray granted, read inside each task (`get_assigned_resources`), not what the build meant to ask: k-means
    takes the node's two CPUs (and its threads), every task declares memory, and a merge's measured peak fits it."""
    import ray

    write_shards(tmp_path / "emb", clustered(6000, 16, seed=3), parts=4)
    # an earlier test's actors may still be giving their CPUs back: the build sizes its k-means task by what is
    # free when it asks, so wait for the cluster to be idle first (on a shared node it would take what is left)
    total, deadline = ray.cluster_resources().get("CPU", 0), time.monotonic() + 60
    while ray.available_resources().get("CPU", 0) < total and time.monotonic() < deadline:
        time.sleep(0.2)
    free = ray.available_resources().get("CPU", 0)
    stats = _build(tmp_path, "IVF16,Flat", parallel=True, num_shards=2)
    train, merge = stats["train_task_resources"], stats["merge_task_resources"]
    assert train["CPU"] == min(2.0, float(int(free))) and train["memory"] >= 512 * 2**20
    assert merge["CPU"] == 1.0 and merge["memory"] >= 512 * 2**20
    assert stats["merge_tasks"] == 2
    # A merge's own growth (its peak over what its worker held when it began), on top of the leanest worker of the
    # build, fits its declaration: Ray reuses workers, and one that ran an earlier test's task may start hundreds
    # of MiB above a fresh one (measured in CI: 546 MiB at its peak against 306 for the fresh one beside it)
    starts = stats["merge_task_start_rss_mb"]
    lean = min(starts)
    assert lean * 2**20 <= TASK_BASE_BYTES
    for peak, start in zip(stats["merge_task_peak_rss_mb"], starts, strict=True):
        assert start <= peak and (peak - start + lean) * 2**20 <= merge["memory"], (peak, start, merge["memory"])
    # a Flat index trains nothing: its train task takes one CPU, not the node
    flat = _build(tmp_path / "flat", "Flat", parallel=True, emb=tmp_path / "emb")
    assert flat["train_task_resources"]["CPU"] == 1.0


def test_a_task_never_asks_for_more_than_the_largest_node_offers():
    from wbrag_ray.index.sizing import merge_memory

    small = {"CPU": 2.0, "memory": 4 * 2**30, "free_CPU": 1.0}
    res = train_resources(1.0, gpu=False, cluster_gpus=0, faiss_gpu=False, kmeans=True, node=small,
                          sample_bytes=10 * 2**30, quantizer_bytes=2**20)
    assert res["num_cpus"] == 1.0  # the node has 2, but only 1 is free now: asking for 2 would never be placed
    assert res["memory"] == int(4 * 2**30 * 0.95)
    assert merge_memory(10**9, 64.0, 2**20, small) == int(4 * 2**30 * 0.95)
    assert merge_memory(1000, 64.0, 2**20, small) == 2 * 1000 * 64 + 2**20 + 512 * 2**20


@pytest.mark.parametrize("factory", ["IVF32,Flat", "IVF32_HNSW8,SQ8", "PCA16,IVF32,Flat"])
def test_gpu_kmeans_path_trains_the_same_centroids_with_a_cpu_stand_in_for_the_gpu(monkeypatch, factory):
    """No GPU here: faiss's `index_cpu_to_all_gpus` is replaced by the identity, so the GPU path (k-means
    assigning with a separate flat index) runs on the CPU and must train what plain CPU training does."""
    from wbrag_ray.index.build import _train_on_gpu

    monkeypatch.setattr(faiss, "index_cpu_to_all_gpus", lambda index: index, raising=False)
    x = clustered(4000, 32, seed=15)
    cpu, gpu = new_index(factory, 32), new_index(factory, 32)
    cpu.train(x)
    _train_on_gpu(gpu, x)
    assert faiss.extract_index_ivf(gpu).clustering_index is None  # nothing of the GPU is kept in the index
    centroids = [faiss.extract_index_ivf(i).quantizer.reconstruct_n(0, 32) for i in (cpu, gpu)]
    np.testing.assert_allclose(centroids[0], centroids[1], atol=1e-5)


def test_train_task_asks_for_a_gpu_only_for_kmeans_with_faiss_gpu_and_index_gpu():
    on_gpu = _train(2.0, gpu=True, cluster_gpus=4, faiss_gpu=True, kmeans=True)
    assert on_gpu["num_gpus"] == 1 and on_gpu["num_cpus"] == 2.0  # CPUs to feed the GPU, not the node's
    on_cpu = _train(2.0, gpu=False, cluster_gpus=4, faiss_gpu=True, kmeans=True)
    assert on_cpu["num_gpus"] == 0 and on_cpu["num_cpus"] == 8.0  # k-means on every core of the node
    assert _train(2.0, gpu=True, cluster_gpus=4, faiss_gpu=False, kmeans=True)["num_gpus"] == 0
    assert _train(2.0, gpu=True, cluster_gpus=4, faiss_gpu=True, kmeans=False) == {
        "num_cpus": 2.0, "num_gpus": 0, "memory": 512 * 2**20}  # Flat, PQ: nothing to cluster
