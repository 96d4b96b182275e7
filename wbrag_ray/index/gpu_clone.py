"""A faiss index on the GPU: the cloner options it needs, decided from the index itself (`gpu_clone_settings`),
and the clone a search actor makes (`to_gpu`). Only the standard library at the top and faiss in the rule's
functions: `benchmarks/gpu/check.py` loads this file by its path on a GPU machine without the project.
"""

from __future__ import annotations

import functools
import logging

log = logging.getLogger(__name__)

# The scratch memory of the faiss GPU resources a search actor makes (`to_gpu`), counted in its GPU share
# (`placement.gpus.apply_gpu_layout`); faiss's default resources reserve about 1.5 GiB of a large GPU, outside it
GPU_TEMP_MEMORY_BYTES = 512 << 20
# The shared memory a GPU IVFPQ search kernel may use per block without opting in: its lookup tables (M x ksub
# entries) must fit, in float32 or, with `useFloat16LookupTables`, in float16 (PQ96 needs the latter).
GPU_SHARED_MEMORY_BYTES = 48 * 1024


def gpu_clone_settings(index) -> dict[str, bool]:
    """The faiss GPU cloner options a CPU index needs to go to a GPU at all: float16 lookup tables where a PQ's
    float32 tables overflow a kernel's shared memory (PQ96), and a coarse quantizer left on the CPU where it has no
    GPU version (HNSW). Without them the clone fails and the shard is searched on the CPU beside an idle GPU."""
    import faiss

    settings = {"useFloat16LookupTables": False, "allowCpuCoarseQuantizer": False}
    inner = faiss.downcast_index(index)
    while not isinstance(inner, faiss.IndexIVF):  # through the wrappers a shard may carry
        if isinstance(inner, faiss.IndexPreTransform | faiss.IndexIDMap | faiss.IndexIDMap2):
            inner = faiss.downcast_index(inner.index)
        elif isinstance(inner, faiss.IndexRefine):
            inner = faiss.downcast_index(inner.base_index)
        else:
            return settings
    if isinstance(inner, faiss.IndexIVFPQ):
        settings["useFloat16LookupTables"] = inner.pq.M * inner.pq.ksub * 4 > GPU_SHARED_MEMORY_BYTES
    quantizer = faiss.downcast_index(inner.quantizer)
    settings["allowCpuCoarseQuantizer"] = not isinstance(quantizer, faiss.IndexFlat)
    return settings


def faiss_has_gpu() -> bool:
    """Whether this faiss was built with GPU support (faiss-gpu); faiss-cpu has no GPU classes at all."""
    import faiss

    return hasattr(faiss, "StandardGpuResources") and hasattr(faiss, "index_cpu_to_all_gpus")


def gpu_node(nodes: list[dict]) -> str | None:
    """The id of an alive node with GPUs among `ray.nodes()`' entries; None where the cluster has none."""
    return next((n["NodeID"] for n in nodes if n.get("Alive") and n.get("Resources", {}).get("GPU", 0) > 0), None)


@functools.cache
def faiss_has_gpu_on(node_id: str) -> bool:
    """`faiss_has_gpu` as a Ray task on the node `node_id` (holding no CPU or GPU) answers it: the faiss the
    search actors and the build's tasks there import."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    probe = ray.remote(faiss_has_gpu).options(
        num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))
    return bool(ray.get(probe.remote()))


def cluster_faiss_gpu() -> bool:
    """Whether the Ray cluster's GPU nodes have faiss GPU support, asked of one of them (`faiss_has_gpu_on`): the
    driver's faiss says nothing of theirs. False, and no probe, where no node has GPUs."""
    import ray

    node = gpu_node(ray.nodes())
    return node is not None and faiss_has_gpu_on(node)


def cloner_options(index):
    """(faiss.GpuMultipleClonerOptions, a GpuClonerOptions `index_cpu_to_gpu` takes too, with what `index` needs
    set; the names this faiss lacks). Needs faiss-gpu."""
    import faiss

    options = faiss.GpuMultipleClonerOptions()
    missing = []
    for name, value in gpu_clone_settings(index).items():
        if value and not hasattr(options, name):
            missing.append(name)
        elif value:
            setattr(options, name, True)
    return options, missing


class GpuCloneError(RuntimeError):
    """A shard that `index.gpu: true` puts on the GPU cannot go there; the message says why and what to set."""


def to_gpu(index, where: str, required: bool = False):
    """The index on this process's first GPU, cloned with the options it needs, its faiss scratch memory capped at
    `GPU_TEMP_MEMORY_BYTES`. Where it cannot go there: GpuCloneError where `required` (`index.gpu: true`), else the
    CPU index with a warning."""
    import faiss

    from wbrag_ray.models.hardware import gpus_usable, granted_gpus

    if not faiss_has_gpu():
        why = (f"index.gpu is set but this faiss ({faiss.__version__}) has no GPU support (install faiss-gpu, as the "
               "project's image does)")
    elif not gpus_usable() or faiss.get_num_gpus() == 0:
        why = (f"index.gpu is set but faiss sees {faiss.get_num_gpus()} GPU(s) and Ray reserved "
               f"{granted_gpus() or 'none'} for this process")
    else:
        options, missing = cloner_options(index)
        if missing:
            log.warning("index shard %s needs the GPU cloner option(s) %s, which faiss %s lacks", where,
                        ", ".join(missing), faiss.__version__)
        resources = faiss.StandardGpuResources()
        resources.setTempMemory(GPU_TEMP_MEMORY_BYTES)
        try:
            gpu = faiss.index_cpu_to_gpu(resources, 0, index, options)
        except RuntimeError as exc:
            why = f"faiss could not clone it to the GPU ({str(exc).strip().splitlines()[0]})"
        else:
            gpu.referenced_objects = [resources]  # faiss keeps no reference: the resources live with the index
            return gpu
    if required:
        raise GpuCloneError(f"index shard {where} cannot be searched on the GPU: {why}; index.gpu: true allows no "
                            "CPU search (set index.gpu: auto to search on the CPU where the GPU cannot)")
    log.warning("index shard %s is searched on the CPU: %s", where, why)
    return index
