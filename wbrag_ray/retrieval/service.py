"""The retrieval service: an index's shards held by search actors (`index.search.SearchActor`) that a command
starts once for all its retrieval passes: groups of shards of at most `retrieval.actor_memory_gb`, in manifest
order, each in `retrieval.concurrency` actors, searched as one (`index.search.SearchGroups`); documents are looked
up for the merged top K only, in the process that asked. A lost actor is started again and the call retried.
"""

from __future__ import annotations

import itertools
import logging
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from wbrag_ray.config import IndexConfig, RetrievalConfig
from wbrag_ray.index.files import IndexError_, load_manifest
from wbrag_ray.index.gpu_clone import GpuCloneError, cluster_faiss_gpu
from wbrag_ray.index.search import SearchActor, SearchGroups, measured_settings
from wbrag_ray.placement import pool_refusal, refuse_unplaceable
from wbrag_ray.placement.gpus import beside_generator, index_on_gpu
from wbrag_ray.placement.waits import wait_placed
from wbrag_ray.ray_runtime import call_actor, start_restartable
from wbrag_ray.retrieval.docstore import DocStoreError
from wbrag_ray.retrieval.local import IndexUnion, Retriever, check_query_vectors
from wbrag_ray.storage import resolve

log = logging.getLogger(__name__)

ACTOR_OVERHEAD_BYTES = 400 << 20  # interpreter, faiss and pyarrow of one search actor, besides its shards


def search_actor_memory(group_bytes: float) -> int:
    """The memory a search actor declares to Ray for a group of shards of `group_bytes`: the shards, a fifth more
    for faiss's search buffers and the id maps, and the process itself (`wbrag plan` asks for the same)."""
    return int(group_bytes * 1.2 + ACTOR_OVERHEAD_BYTES)


def shard_groups(shards: list[dict[str, Any]], budget_bytes: float) -> list[list[int]]:
    """Consecutive shard positions grouped so each group's bytes stay within the budget (a shard larger than
    the budget is a group of its own: the build's `index.shard_memory_gb` is what bounds it)."""
    groups: list[list[int]] = []
    held = 0.0
    for i, shard in enumerate(shards):
        size = float(shard["bytes"])
        if not groups or held + size > budget_bytes:
            groups.append([])
            held = 0.0
        groups[-1].append(i)
        held += size
    return groups


def _pool_layout(index_dir: str, index: IndexConfig,
                 retrieval: RetrievalConfig) -> tuple[dict[str, Any], list[list[dict[str, Any]]], list[float], bool]:
    """(manifest, its shards in the actors' groups, the bytes each group holds, whether the actors search on
    GPUs)."""
    import ray

    manifest = load_manifest(resolve(index_dir))
    shards = manifest["shards"]
    groups = [[shards[i] for i in g] for g in shard_groups(shards, retrieval.actor_memory_gb * (1 << 30))]
    return manifest, groups, [sum(s["bytes"] for s in g) for g in groups], index_on_gpu(
        index.gpu, ray.cluster_resources().get("GPU", 0), cluster_faiss_gpu())


def search_actors(index_dir: str, index: IndexConfig, retrieval: RetrievalConfig) -> tuple[int, float]:
    """The search actors the pool of the index at `index_dir` will start on GPUs (`SearchPool.start`), and the
    bytes of the largest group: (0, 0) where they search on CPUs or the index is not built yet."""
    try:
        _, _, held, use_gpu = _pool_layout(index_dir, index, retrieval)
    except IndexError_:
        return 0, 0.0
    return (len(held) * retrieval.concurrency, float(max(held))) if use_gpu else (0, 0.0)


def _unwrap(exc: Exception) -> Exception:
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, IndexError_ | DocStoreError | GpuCloneError) else exc


@dataclass
class SearchPool(SearchGroups):
    """The search actors of one index folder: `groups` of its shards, each in `replicas` actors."""

    index_dir: str
    manifest: dict[str, Any]
    actors: list[list[Any]]  # [group][replica]
    shared_assignment: bool = False  # one coarse assignment per search, made by one actor for every group
    _turn: Any = field(default_factory=itertools.count, repr=False)

    @classmethod
    def start(cls, index_dir: str, index: IndexConfig, retrieval: RetrievalConfig) -> SearchPool:
        import ray

        manifest, groups, held, use_gpu = _pool_layout(index_dir, index, retrieval)
        # index.gpu true where no GPU search can run is refused; auto searches on CPUs there (a GPU reserved per
        # search actor that faiss cannot use would idle beside a CPU search)
        if index.gpu == "auto" and not use_gpu and ray.cluster_resources().get("GPU", 0) > 0:
            log.info("index.gpu auto: the GPU nodes' faiss has no GPU support, the search actors search on CPUs")
        nprobe, ef_search = measured_settings(manifest, index.nprobe, index.ef_search)  # 'auto': what the build measured
        search = (nprobe, ef_search, index.k_factor, index.gpu if use_gpu else False)
        threads = max(1, math.ceil(retrieval.search_cpus))

        # search actors that can never be placed would leave every search waiting: refused first (the pool's
        # largest shard group sizes the memory each asks for)
        need = {"CPU": retrieval.search_cpus, "GPU": retrieval.search_share if use_gpu else 0.0,
                "memory": search_actor_memory(max(held))}
        refuse_unplaceable(lambda nodes: pool_refusal(
            "the search pool", len(groups) * retrieval.concurrency, need, nodes, len(groups)))
        actors = []
        for group, group_bytes in zip(groups, held, strict=True):
            remote = ray.remote(
                num_cpus=retrieval.search_cpus, num_gpus=retrieval.search_share if use_gpu else None,
                memory=search_actor_memory(group_bytes), max_restarts=-1, max_task_retries=3,
            )(SearchActor).options(**beside_generator(need["GPU"]))
            named = [(s["file"], s.get("count")) for s in group]
            actors.append([start_restartable(remote, index_dir, named, int(manifest["dim"]), search, threads)
                           for _ in range(retrieval.concurrency)])
        pool = cls(index_dir, manifest, actors)
        try:
            wait_placed([a for replicas in actors for a in replicas], "the search pool", need,
                        "lower retrieval.concurrency")
            ready = ray.get([a.ready.remote() for replicas in actors for a in replicas])
        except ray.exceptions.RayTaskError as exc:
            pool.close()
            raise _unwrap(exc) from None
        except BaseException:
            pool.close()
            raise
        quantizers = {fingerprint for _, fingerprint in ready}  # one trained quantizer in every group
        pool.shared_assignment = len(actors) > 1 and len(quantizers) == 1 and None not in quantizers
        return pool

    @property
    def dim(self) -> int:
        return int(self.manifest["dim"])

    def search_ids(self, vectors: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, float]:
        """(scores, ids) of the whole index, and the search's seconds as the actors measured them (the slowest
        group's, after the coarse assignment). With several groups of IVF shards, one actor (a different group each
        time) assigns the queries to their lists: the groups' calls take the assignment as a pending argument."""
        import ray

        vectors = check_query_vectors(vectors, self.dim, self.index_dir)
        turn = next(self._turn)
        ref = ray.put(vectors)
        assigned = None
        if self.shared_assignment:
            replicas = self.actors[turn % len(self.actors)]
            assigned = replicas[turn // len(self.actors) % len(replicas)].assign.remote(ref)
        try:
            parts = self.call("search", ref, k, assigned, turn=turn)
            assign_s = ray.get(assigned)[2] if assigned is not None else 0.0
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.ActorDiedError):
            # a search actor's node was lost (the assigning one included: its error reaches every call that
            # waited on it): ask each group again, one call at a time, on any live replica, each assigning itself
            parts = [call_actor(replicas, "search", ref, k) for replicas in self.actors]
            assign_s = 0.0
        scores, ids, seconds = self.merged(parts, k)
        return scores, ids, assign_s + max(seconds)

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_turn"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._turn = itertools.count(random.randrange(1 << 16))  # each process spreads its calls over replicas


def pool_placement(index: IndexConfig, retrieval: RetrievalConfig) -> tuple:
    """What a pool's actors are: the search settings they applied and what they hold."""
    return (index.nprobe, index.ef_search, index.k_factor, index.gpu, retrieval.search_cpus,
            retrieval.actor_memory_gb, retrieval.concurrency)


class RetrievalService(IndexUnion):
    """The base and the write-back index beside it searched as one (`IndexUnion`), each on its own search pool.
    Built in the driver, where `auto` is resolved, and sent with the passes."""

    members: list[Retriever]

    @property
    def pools(self) -> list[SearchPool]:
        return [m.pool for m in self.members]

    def latency_ms(self, vectors: np.ndarray, k: int, min_seconds: float = 0.5) -> float:
        """Milliseconds per query of the search itself, as the search actors measure it (indices of a union add
        up): the best of repeated runs after a warm-up (the least disturbed on a shared machine)."""
        def once() -> float:
            return sum(p.search_ids(vectors, k)[2] for p in self.pools)

        once()
        best, spent = float("inf"), 0.0
        while spent < min_seconds or best == float("inf"):
            t0 = time.perf_counter()
            best = min(best, once())
            spent += time.perf_counter() - t0
        return 1000 * best / max(1, len(vectors))
