"""How big an index build is: the factory, the training sample, the shard count and the train task's
resources, as pure functions of counts and memory figures."""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)

GiB = 1 << 30
# faiss's k-means warns below 39 training points per centroid.
MIN_POINTS_PER_CENTROID = 39


def choose_factory(n: int, dim: int, memory_budget_gb: float, train_memory_gb: float = 8.0) -> str:
    """The factory `index.factory=auto` picks from the vector count and the whole index's memory budget: Flat below
    20,000 vectors, else an IVF (nlist near 4*sqrt(n), 16*sqrt(n) with an HNSW32 quantizer from 10M on, lowered for 39
    training points per list) with the most precise codes (Flat, SQ8, PQm) that fit with 10% headroom."""
    if n < 20_000:
        return "Flat"
    budget = memory_budget_gb * GiB * 0.9
    big = n >= 10_000_000
    nlist = 2 ** round(math.log2((16 if big else 4) * math.sqrt(n)))
    trainable = min(n, train_sample_cap(dim, train_memory_gb)) // MIN_POINTS_PER_CENTROID
    nlist = max(1, min(nlist, _floor_pow2(trainable)))
    coarse = f"IVF{nlist}_HNSW32" if big else f"IVF{nlist}"
    per_vector = budget / n - 8
    if per_vector >= 4 * dim:
        return f"{coarse},Flat"
    if per_vector >= dim:
        return f"{coarse},SQ8"
    fitting = [m for m in range(min(dim, int(per_vector)), 0, -1) if dim % m == 0 and m <= 96]
    if not fitting:
        need = n * (8 + 1) / GiB / 0.9
        raise ValueError(
            f"index.memory_budget_gb={memory_budget_gb} cannot hold {n:,} vectors even at one byte each "
            f"(needs about {need:.1f} GB); raise index.memory_budget_gb or set index.factory explicitly"
        )
    return f"{coarse},PQ{fitting[0]}"


def _floor_pow2(x: int) -> int:
    return 2 ** int(math.log2(x)) if x >= 1 else 1


def train_sample_cap(dim: int, train_memory_gb: float) -> int:
    """The most float32 vectors of `dim` dimensions that fit `train_memory_gb` (sample x dim x 4 bytes)."""
    return max(1, int(train_memory_gb * GiB // (4 * dim)))


def ivf_nlist(factory: str) -> int | None:
    """The number of IVF lists a factory string asks for, or None without an IVF coarse quantizer."""
    m = re.search(r"(?:^|,)IVF(\d+)", factory.replace(" ", ""))
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class TrainingPlan:
    """The factory an index is built with and the number of vectors its train task reads."""

    factory: str
    train_sample: int
    nlist: int | None  # IVF lists (k-means centroids), None without an IVF


def plan_training(n: int, dim: int, factory: str, train_sample: int, memory_budget_gb: float = 16.0,
                  train_memory_gb: float = 8.0) -> TrainingPlan:
    """The factory and training sample, chosen together: max(train_sample, 39 x nlist), capped by the corpus and by
    `train_memory_gb`. An explicit IVF that cannot get 39 points per list within the memory is refused here; a
    corpus smaller than 39 x nlist trains on every vector (logged), one smaller than nlist is refused."""
    auto = factory.strip().lower() == "auto"
    if auto:
        factory = choose_factory(n, dim, memory_budget_gb, train_memory_gb)
    cap = train_sample_cap(dim, train_memory_gb)
    nlist = ivf_nlist(factory)
    if nlist is None:
        return TrainingPlan(factory, min(train_sample, cap, n), None)
    want = MIN_POINTS_PER_CENTROID * nlist
    if nlist < 1:  # faiss builds IVF0 and fails only when the first vector is added (list_no < nlist)
        raise ValueError(f"index.factory {factory!r} has no IVF lists; use IVF with at least one list, e.g. "
                         f"IVF{max(1, _floor_pow2(n // MIN_POINTS_PER_CENTROID))}, or Flat")
    if n < nlist:
        raise ValueError(f"index.factory {factory!r} has {nlist:,} IVF lists but the corpus only {n:,} vectors; "
                         f"use an IVF with at most {_floor_pow2(n // MIN_POINTS_PER_CENTROID)} lists, or Flat")
    if want > cap and n >= want:
        fits = _floor_pow2(cap // MIN_POINTS_PER_CENTROID)
        raise ValueError(
            f"index.factory {factory!r} needs {want:,} training vectors (39 per IVF list), {want * dim * 4 / GiB:.1f} "
            f"GB at dim {dim}, more than index.train_memory_gb={train_memory_gb} holds ({cap:,} vectors); raise "
            f"index.train_memory_gb to {math.ceil(want * dim * 4 / GiB)}, or use at most IVF{fits} "
            f"(or index.factory=auto)"
        )
    sample = min(max(train_sample, want), cap, n)
    if n < want:
        log.warning("index.factory %s: the corpus has %d vectors, fewer than 39 per IVF list (%d); training on all "
                    "of them", factory, n, want)
    elif sample > train_sample:
        log.info("index.train_sample raised from %d to %d: 39 training vectors per IVF list of %s",
                 train_sample, sample, factory)
    elif sample < train_sample:
        log.info("index.train_sample lowered from %d to %d: what index.train_memory_gb=%s holds at dim %d",
                 train_sample, sample, train_memory_gb, dim)
    return TrainingPlan(factory, sample, nlist)


def bytes_per_vector(index) -> float:
    """Bytes one more vector adds to an index file, from the trained empty index: code, id, HNSW links."""
    import faiss

    # A new name, not `index =`: rebinding would free a temporary the caller passed (a segfault later).
    owner, index = index, faiss.downcast_index(index)  # noqa: F841 - `owner` keeps the object alive
    if isinstance(index, faiss.IndexIDMap | faiss.IndexIDMap2):
        return 8 + bytes_per_vector(index.index)
    if isinstance(index, faiss.IndexPreTransform):
        return bytes_per_vector(index.index)
    if isinstance(index, faiss.IndexRefine):
        return bytes_per_vector(index.base_index) + bytes_per_vector(index.refine_index)
    if isinstance(index, faiss.IndexIVF):
        return 8 + index.code_size
    if isinstance(index, faiss.IndexHNSW):
        m = index.hnsw.nb_neighbors(1)
        return bytes_per_vector(index.storage) + 4 * (2 * m + m / max(1, m - 1)) + 8 + 4
    code_size = getattr(index, "code_size", None)
    if code_size:
        return float(code_size)
    try:
        return float(index.sa_code_size())
    except RuntimeError:
        return 4.0 * index.d  # unknown type: as big as raw float32


def shards_for(n: int, per_vector: float, fixed_bytes: int, shard_memory_gb: float) -> int:
    """`num_shards=auto`: ceil(estimated bytes / shard budget), each shard carrying the trained index."""
    budget = shard_memory_gb * GiB
    room = budget - fixed_bytes
    if room <= budget * 0.05:
        raise ValueError(
            f"index.shard_memory_gb={shard_memory_gb} cannot hold an index shard: the trained index alone (coarse "
            f"quantizer and codebooks, which every shard carries) takes {fixed_bytes / GiB:.2f} GB; raise "
            f"index.shard_memory_gb or take fewer IVF lists"
        )
    return max(1, math.ceil(n * per_vector / room))


def is_auto(num_shards: int | str) -> bool:
    """Whether `index.num_shards` is "auto"; anything but "auto" or a positive integer is refused."""
    if isinstance(num_shards, str) and num_shards.strip().lower() == "auto":
        return True
    if isinstance(num_shards, int) and not isinstance(num_shards, bool) and num_shards >= 1:
        return False
    raise ValueError(f"index.num_shards must be a positive integer or 'auto', not {num_shards!r}")


def shard_count(num_shards: int | str, n: int, per_vector: float, fixed_bytes: int, shard_memory_gb: float,
                files: int) -> int:
    """Index shards: `num_shards`, or for 'auto' `shards_for`'s count; never more than the embedding shards."""
    if not is_auto(num_shards):
        return max(1, min(int(num_shards), files))
    wanted = shards_for(n, per_vector, fixed_bytes, shard_memory_gb)
    if wanted > files:
        log.warning("index.num_shards=auto wants %d shards of at most index.shard_memory_gb=%s, but there are only "
                    "%d embedding shards: each index shard will hold about %.2f GB", wanted, shard_memory_gb, files,
                    (n * per_vector / files + fixed_bytes) / GiB)
    return min(wanted, files)


def balanced_groups(counts: Sequence[int], n: int) -> list[list[int]]:
    """Split 0..len-1 into min(n, len) contiguous groups of about equal count (narrow id ranges per shard)."""
    n = max(1, min(n, len(counts)))
    total = sum(counts)
    groups: list[list[int]] = [[]]
    done = 0
    for i, c in enumerate(counts):
        if len(groups) < n and groups[-1]:
            # open the next group once this one holds its share, or when every remaining group needs one
            if done >= total * len(groups) / n or len(counts) - i <= n - len(groups):
                groups.append([])
        groups[-1].append(i)
        done += c
    return groups


# A task's resident memory before it reads anything (a Ray worker with numpy, pyarrow and faiss loaded).
TASK_BASE_BYTES = 512 * 2**20


def train_resources(num_cpus: float, gpu: bool, cluster_gpus: float, faiss_gpu: bool, kmeans: bool,
                    node: dict[str, float], sample_bytes: int, quantizer_bytes: int) -> dict[str, float]:
    """The train task's Ray resources: a GPU where k-means can use one, else the largest node's CPUs (no more than
    are free now); memory for the sample twice, the centroids twice and a worker's base."""
    use_gpu = gpu and faiss_gpu and cluster_gpus >= 1 and kmeans
    cpus = num_cpus
    if kmeans and not use_gpu:
        cpus = max(num_cpus, min(node["CPU"], float(int(node.get("free_CPU", node["CPU"])))))
    memory = 2 * sample_bytes + 2 * quantizer_bytes + TASK_BASE_BYTES
    return {"num_cpus": cpus, "num_gpus": 1 if use_gpu else 0, "memory": node_bounded(memory, node)}


def merge_memory(vectors: int, per_vector: float, trained_bytes: int, node: dict[str, float]) -> int:
    """A merge task's memory: its shard twice (a merge peaks at 1.4-2x its shard), the trained index, a worker."""
    return node_bounded(int(2 * vectors * per_vector) + trained_bytes + TASK_BASE_BYTES, node)


def node_bounded(memory: int, node: dict[str, float]) -> int:
    """`memory` capped at the largest node's (a larger request would never be placed; logged)."""
    offered = int(node.get("memory", 0) * 0.95)
    if offered and memory > offered:
        log.warning("an index task needs about %.1f GB, more than the largest node offers Ray (%.1f GB): it asks for "
                    "%.1f GB and may run out of memory; use smaller shards (index.shard_memory_gb) or train_memory_gb",
                    memory / GiB, node["memory"] / GiB, offered / GiB)
        return offered
    return int(memory)
