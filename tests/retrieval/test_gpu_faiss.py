"""Search on a GPU that works or says why: the cloner options an index needs, decided from real CPU indices; the
clone itself with faiss's GPU functions mocked (this machine's faiss-cpu has none), named as such; and the CPUs a
process may use under a container's CPU quota."""

from __future__ import annotations

import logging
import os

import faiss
import numpy as np
import pytest

from wbrag_ray.index.gpu_clone import gpu_clone_settings, to_gpu
from wbrag_ray.index.search import takes_assignment
from wbrag_ray.models.hardware import usable_cpus


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


def _mock_gpu_faiss(monkeypatch, clone):
    monkeypatch.setattr(faiss, "StandardGpuResources", object, raising=False)
    monkeypatch.setattr(faiss, "GpuMultipleClonerOptions", _ClonerOptions, raising=False)
    monkeypatch.setattr(faiss, "index_cpu_to_all_gpus", clone, raising=False)
    monkeypatch.setattr(faiss, "get_num_gpus", lambda: 1)


def test_to_gpu_with_a_mocked_gpu_faiss_passes_the_index_its_options(monkeypatch):
    seen = {}

    def clone(index, co=None, ngpu=-1):
        seen.update(index=index, float16=co.useFloat16LookupTables, cpu_quantizer=co.allowCpuCoarseQuantizer)
        return "on the gpu"

    _mock_gpu_faiss(monkeypatch, clone)
    index = faiss.index_factory(192, "OPQ96,IVF16_HNSW8,PQ96")
    assert to_gpu(index, "shard-0") == "on the gpu"
    assert seen == {"index": index, "float16": True, "cpu_quantizer": True}


def test_to_gpu_with_a_mocked_gpu_faiss_warns_when_the_clone_fails_and_keeps_the_cpu_index(monkeypatch, caplog):
    def clone(index, co=None, ngpu=-1):
        raise RuntimeError("Error in virtual void faiss::gpu::GpuIndexIVFPQ: not enough shared memory\nmore")

    _mock_gpu_faiss(monkeypatch, clone)
    index = faiss.index_factory(192, "IVF16,PQ48")
    with caplog.at_level(logging.WARNING, logger="wbrag_ray.index.gpu_clone"):
        assert to_gpu(index, "shard-3") is index
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert "shard-3 is searched on the CPU" in record.getMessage()
    assert "not enough shared memory" in record.getMessage() and "more" not in record.getMessage()


def test_a_gpu_asked_of_faiss_cpu_is_a_warning_not_an_info_line(caplog):
    index = faiss.index_factory(8, "Flat")
    index.add(np.eye(8, dtype=np.float32))
    with caplog.at_level(logging.WARNING, logger="wbrag_ray.index.gpu_clone"):
        assert to_gpu(index, "shard-0") is index
    [record] = caplog.records
    assert record.levelno == logging.WARNING and "has no GPU support" in record.getMessage()


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
