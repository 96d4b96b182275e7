"""A faiss index on the GPU: the cloner options it needs, decided from the index itself (`gpu_clone_settings`,
`cloner_options`), and the clone a search actor or an in-process retriever makes (`to_gpu`).

The module imports only the standard library at its top, and the rule's functions only faiss, so that
`benchmarks/gpu/check.py` loads this file by its path on a GPU machine without the project's dependencies and
checks there the rule the search actors apply; `to_gpu` imports the project where it runs.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

# The shared memory a GPU IVFPQ search kernel may use per block without opting in: its lookup tables (M x ksub
# entries) must fit, in float32 or, with `useFloat16LookupTables`, in float16 (PQ96 needs the latter).
GPU_SHARED_MEMORY_BYTES = 48 * 1024


def gpu_clone_settings(index) -> dict[str, bool]:
    """The faiss GPU cloner options a CPU index needs to go to a GPU at all, decided from the index itself: float16
    lookup tables where a PQ's float32 tables overflow a kernel's shared memory (PQ96 with 256 centroids each), and
    a coarse quantizer left on the CPU where it has no GPU version (an IVF over an HNSW quantizer). Without them the
    clone fails and the shard would be searched on the CPU while its actor holds a GPU."""
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


def cloner_options(index):
    """(faiss.GpuMultipleClonerOptions with what `index` needs set, the names this faiss lacks). Needs faiss-gpu."""
    import faiss

    options = faiss.GpuMultipleClonerOptions()
    missing = []
    for name, value in gpu_clone_settings(index).items():
        if value and not hasattr(options, name):
            missing.append(name)
        elif value:
            setattr(options, name, True)
    return options, missing


def to_gpu(index, where: str):
    """The index on the GPUs this process may use, cloned with the options it needs (`gpu_clone_settings`). Where
    it cannot go there (a faiss without GPU support, no GPU visible, a type with no GPU version such as HNSW), the
    CPU index, with a warning: a GPU was asked for (`index.gpu`) and searching on the CPU is far slower."""
    import faiss

    from wbrag_ray.models.hardware import gpus_usable, granted_gpus

    if not faiss_has_gpu():
        log.warning("index shard %s is searched on the CPU: index.gpu is set but this faiss (%s) has no GPU "
                    "support (install faiss-gpu, as the project's image does)", where, faiss.__version__)
        return index
    visible = faiss.get_num_gpus()
    if not gpus_usable() or visible == 0:
        log.warning("index shard %s is searched on the CPU: index.gpu is set but faiss sees %d GPU(s) and Ray "
                    "reserved %s for this process", where, visible, granted_gpus() or "none")
        return index
    options, missing = cloner_options(index)
    if missing:
        log.warning("index shard %s needs the GPU cloner option(s) %s, which faiss %s lacks", where,
                    ", ".join(missing), faiss.__version__)
    try:
        return faiss.index_cpu_to_all_gpus(index, co=options)
    except RuntimeError as exc:
        log.warning("index shard %s is searched on the CPU: faiss could not clone it to the GPU (%s)", where,
                    str(exc).strip().splitlines()[0])
        return index
