"""Search on a GPU that works or says why: the cloner options an index needs, decided from real CPU indices; the
clone itself with faiss's GPU functions mocked (this machine's faiss-cpu has none), named as such; and the CPUs a
process may use under a container's CPU quota."""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace

import faiss
import numpy as np
import pytest

from tests.index.conftest import clustered, index_config, write_shards
from wbrag_ray.config import ConfigError
from wbrag_ray.index.build import build_index
from wbrag_ray.index.files import load_manifest
from wbrag_ray.index.gpu_clone import (
    GPU_TEMP_MEMORY_BYTES,
    GpuCloneError,
    cluster_faiss_gpu,
    faiss_has_gpu,
    faiss_has_gpu_on,
    gpu_clone_settings,
    gpu_node,
    to_gpu,
)
from wbrag_ray.index.search import SearchActor, takes_assignment
from wbrag_ray.models.hardware import usable_cpus
from wbrag_ray.placement.gpus import index_on_gpu
from wbrag_ray.storage import resolve


@pytest.mark.parametrize("factory, float16_tables, cpu_quantizer", [
    # PQ96's float32 lookup tables need 96 x 256 x 4 = 96 KiB of a kernel's 48 KiB shared memory; PQ48's fit
    ("IVF16,PQ96", True, False),
    ("IVF16,PQ48", False, False),
    # the shape `index.factory: auto` picks at scale: a rotation, an HNSW coarse quantizer (no GPU version), PQ96
    ("OPQ96,IVF16_HNSW8,PQ96", True, True),
    ("IVF16_HNSW8,PQ16", False, True),
    ("IVF16,Flat", False, False),
    ("IDMap,Flat", False, False),
    ("HNSW32", False, False),
])
def test_the_cloner_options_follow_the_index_type(factory, float16_tables, cpu_quantizer):
    settings = gpu_clone_settings(faiss.index_factory(192, factory))
    assert settings == {"useFloat16LookupTables": float16_tables, "allowCpuCoarseQuantizer": cpu_quantizer}


class SimulatedGpuIndexIVF(faiss.IndexIVFInterface):
    """Shaped as faiss-gpu's GpuIndexIVF (`class GpuIndexIVF : public GpuIndex, public IndexIVFInterface`): the IVF
    interface and no IndexIVF. Simulated: faiss-cpu has no GPU class, and the interface is abstract (no C++ object)."""

    def __init__(self):
        pass


def test_a_simulated_gpu_ivf_shard_takes_the_shared_coarse_assignment_as_a_cpu_one_does():
    """Fault 4 of issue 74: the test was `isinstance(inner, faiss.IndexIVF)`, which a GPU IVF fails, so each GPU
    shard ran its own coarse search. HNSW and flat shards have no lists and search shard by shard."""
    gpu = SimulatedGpuIndexIVF()
    assert not isinstance(gpu, faiss.IndexIVF) and takes_assignment(gpu)
    assert takes_assignment(faiss.index_factory(16, "IVF8,Flat"))
    assert takes_assignment(faiss.downcast_index(faiss.index_factory(16, "OPQ4,IVF8_HNSW8,PQ4").index))
    assert not takes_assignment(faiss.index_factory(16, "HNSW8"))
    assert not takes_assignment(faiss.index_factory(16, "Flat"))


class _ClonerOptions:  # the attributes of faiss-gpu's GpuMultipleClonerOptions this code sets
    useFloat16LookupTables = False
    allowCpuCoarseQuantizer = False


class _GpuResources:  # faiss-gpu's StandardGpuResources, as far as this code uses it
    def setTempMemory(self, size):
        self.temp_memory = size


def _mock_gpu_faiss(monkeypatch, clone):
    monkeypatch.setattr(faiss, "StandardGpuResources", _GpuResources, raising=False)
    monkeypatch.setattr(faiss, "GpuMultipleClonerOptions", _ClonerOptions, raising=False)
    monkeypatch.setattr(faiss, "index_cpu_to_all_gpus", lambda *a, **k: None, raising=False)
    monkeypatch.setattr(faiss, "index_cpu_to_gpu", clone, raising=False)
    monkeypatch.setattr(faiss, "get_num_gpus", lambda: 1)


def test_to_gpu_with_a_mocked_gpu_faiss_passes_the_index_its_options_and_resources_with_capped_scratch(monkeypatch):
    """Fault 3 of issue 74: the shard goes to one GPU with faiss GPU resources the project makes, their scratch
    memory capped at what the search actor's share counts (faiss's defaults reserve about 1.5 GiB)."""
    seen = {}

    def clone(resources, device, index, co=None):
        seen.update(index=index, device=device, temp=resources.temp_memory, float16=co.useFloat16LookupTables,
                    cpu_quantizer=co.allowCpuCoarseQuantizer)
        return SimpleNamespace(on="the gpu")

    _mock_gpu_faiss(monkeypatch, clone)
    index = faiss.index_factory(192, "OPQ96,IVF16_HNSW8,PQ96")
    gpu = to_gpu(index, "shard-0")
    assert gpu.on == "the gpu" and isinstance(gpu.referenced_objects[0], _GpuResources)  # they live with it
    assert seen == {"index": index, "device": 0, "temp": GPU_TEMP_MEMORY_BYTES, "float16": True,
                    "cpu_quantizer": True}


def _failing_clone(resources, device, index, co=None):
    raise RuntimeError("Error in virtual void faiss::gpu::GpuIndexIVFPQ: not enough shared memory\nmore")


def test_to_gpu_with_a_mocked_gpu_faiss_warns_when_the_clone_fails_and_keeps_the_cpu_index(monkeypatch, caplog):
    _mock_gpu_faiss(monkeypatch, _failing_clone)
    index = faiss.index_factory(192, "IVF16,PQ48")
    with caplog.at_level(logging.WARNING, logger="wbrag_ray.index.gpu_clone"):
        assert to_gpu(index, "shard-3") is index
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert "shard-3 is searched on the CPU" in record.getMessage()
    assert "not enough shared memory" in record.getMessage() and "more" not in record.getMessage()


def test_under_index_gpu_true_a_failed_clone_is_an_error_never_a_cpu_search(monkeypatch):
    """Fault 3 of issue 74: `index.gpu: true` (required) raises where the clone fails, with faiss's reason."""
    _mock_gpu_faiss(monkeypatch, _failing_clone)
    with pytest.raises(GpuCloneError, match=r"^index shard shard-3 cannot be searched on the GPU: faiss could not "
                                            r"clone it to the GPU \(.*not enough shared memory\); index.gpu: true"):
        to_gpu(faiss.index_factory(192, "IVF16,PQ48"), "shard-3", required=True)


def test_a_gpu_asked_of_faiss_cpu_is_a_warning_not_an_info_line(caplog):
    index = faiss.index_factory(8, "Flat")
    index.add(np.eye(8, dtype=np.float32))
    with caplog.at_level(logging.WARNING, logger="wbrag_ray.index.gpu_clone"):
        assert to_gpu(index, "shard-0") is index
    [record] = caplog.records
    assert record.levelno == logging.WARNING and "has no GPU support" in record.getMessage()


def test_a_search_actor_under_index_gpu_true_on_faiss_cpu_raises_from_ready_and_auto_searches_on_cpus(tmp_path):
    """This machine's faiss-cpu cannot clone: under `index.gpu: true` the search actor's `ready` raises that (as the
    retrieval service's start then does), under auto it holds the CPU shards."""
    vecs = clustered(400, 16, seed=1)
    write_shards(tmp_path / "emb", vecs, parts=2)
    build_index(resolve(str(tmp_path / "emb")), resolve(str(tmp_path / "idx")), "m", "passage",
                index_config("IVF4,Flat", num_shards=2), parallel=False)
    manifest = load_manifest(resolve(str(tmp_path / "idx")))
    named = [(s["file"], s["count"]) for s in manifest["shards"]]
    actor = SearchActor(str(tmp_path / "idx"), named, 16, (4, None, None, True), 1)
    with pytest.raises(GpuCloneError, match="has no GPU support.*index.gpu: true allows no CPU search"):
        actor.ready()
    assert SearchActor(str(tmp_path / "idx"), named, 16, (4, None, None, "auto"), 1).ready()[0] == 400


def test_the_gpu_node_probed_is_an_alive_node_with_gpus_and_a_cluster_without_one_is_not_probed():
    """Fault 5 of issue 74, on simulated inventories (`ray.nodes()` entries): a CPU head and GPU workers."""
    head = {"NodeID": "head", "Alive": True, "Resources": {"CPU": 8.0}}
    lost = {"NodeID": "lost", "Alive": False, "Resources": {"CPU": 96.0, "GPU": 8.0}}
    worker = {"NodeID": "worker", "Alive": True, "Resources": {"CPU": 96.0, "GPU": 8.0}}
    assert gpu_node([head, lost, worker]) == "worker"
    assert gpu_node([head]) is None and gpu_node([]) is None


def test_faiss_gpu_support_is_the_answer_of_a_task_on_the_gpu_node_not_the_drivers(monkeypatch, ray_cluster):
    """Fault 5 of issue 74: a driver whose faiss has GPU support (here its faiss made to look like faiss-gpu) asks
    the node's faiss in a task, which runs in a worker with this machine's faiss-cpu and answers no. The decision
    (`index_on_gpu`) then follows the task: `auto` searches on CPUs, `true` is refused naming faiss."""
    import ray

    monkeypatch.setattr(faiss, "StandardGpuResources", _GpuResources, raising=False)
    monkeypatch.setattr(faiss, "index_cpu_to_all_gpus", lambda *a, **k: None, raising=False)
    assert faiss_has_gpu()  # the driver's own answer
    node = ray.get_runtime_context().get_node_id()
    faiss_has_gpu_on.cache_clear()
    assert faiss_has_gpu_on(node) is False
    assert cluster_faiss_gpu() is False  # this cluster has no GPU node: no probe, no GPU search
    assert index_on_gpu("auto", 8, faiss_has_gpu_on(node)) is False
    with pytest.raises(ConfigError, match="faiss has no GPU support"):
        index_on_gpu(True, 8, faiss_has_gpu_on(node))


@pytest.mark.parametrize("files, expected", [
    ({"cpu.max": "150000 100000\n"}, 1),  # a pod limited to 1.5 CPUs: one thread, not the host's cores
    ({"cpu.max": "max 100000\n"}, None),  # no quota: the affinity mask
    ({"cpu/cpu.cfs_quota_us": "100000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 1),  # cgroup v1
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ({}, None),  # no cgroup files at all
])
def test_usable_cpus_reads_a_containers_cpu_quota(tmp_path, files, expected):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    affinity = len(os.sched_getaffinity(0))
    assert usable_cpus(str(tmp_path)) == (expected if expected is not None else affinity)
