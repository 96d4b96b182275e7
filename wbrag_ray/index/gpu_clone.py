"""The options a CPU faiss index needs to be cloned to a GPU, decided from the index itself.

Imports nothing but faiss (lazily), so that `benchmarks/gpu/check.py` loads this file by its path on a GPU
machine without the project's dependencies, and checks there the same rule the search actors apply.
"""

from __future__ import annotations

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
