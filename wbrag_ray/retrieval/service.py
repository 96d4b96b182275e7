"""The retrieval service: an index's shards held by search actors that a command starts once and every
retrieval pass of it uses.

An index folder's shards (the build sizes them by `index.shard_memory_gb`) are grouped, in manifest order, into
groups of at most `retrieval.actor_memory_gb`; each group is loaded by one search actor that declares that
memory to Ray (`memory=`), so Ray places groups on nodes that can hold them and never packs two big ones on a
node that cannot. `retrieval.concurrency` replicas of every group serve in parallel. A search sends the
query vectors to one replica of each group at once (for an IVF index, with the lists one actor assigned the
queries to: the coarse quantizer runs once per search, not once per shard), and merges the groups' top K by
score; the union with the write-back index is cut to the top K by `retrieval.union` (wbrag_ray.retrieval.union),
each hit keeping its source, a unit its provenance. Document text is looked
up only for the merged top K, by id, in the memory-mapped document store (`retrieval.docstore`), in the
process that asked. Nothing here loads an index into the driver: the latency figures come from the actors.

Search actors ask for a GPU only where `index.gpu` is set and the cluster has GPUs; they put shards on it
only when Ray reserved it for them. A lost actor (its node gone) is started again elsewhere and the call
retried: a search is a pure function of its shards.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from wbrag_ray.config import IndexConfig, RetrievalConfig
from wbrag_ray.index.faiss_index import IndexError_, load_manifest
from wbrag_ray.index.files import load_shard
from wbrag_ray.index.gpu_clone import faiss_has_gpu, to_gpu
from wbrag_ray.index.search_params import measured_settings, set_search_params
from wbrag_ray.ray_runtime import call_actor, start_restartable
from wbrag_ray.retrieval.docstore import DocStore, DocStoreError, open_doc_store
from wbrag_ray.retrieval.hits import Hit, merge_results
from wbrag_ray.retrieval.local import (
    ShardSearch,
    check_comparable,
    check_query_vectors,
    check_union,
    docs_location,
    to_hits,
    union_base_unit,
)
from wbrag_ray.retrieval.union import BASE, PROVENANCE, UnionRule, cut_union, read_provenance
from wbrag_ray.storage import resolve

log = logging.getLogger(__name__)

ACTOR_OVERHEAD_BYTES = 400 << 20  # interpreter, faiss and pyarrow of one search actor, besides its shards


def search_actor_memory(group_bytes: float) -> int:
    """The memory a search actor declares to Ray for a group of shards of `group_bytes`: the shards, a fifth more
    for faiss's search buffers and the id maps, and the process itself (`wbrag plan` asks for the same)."""
    return int(group_bytes * 1.2 + ACTOR_OVERHEAD_BYTES)


class SearchActor:
    """A group of one index's shards, loaded once; `search` returns the group's top K and its own seconds."""

    def __init__(self, index_dir: str, files: list[str], counts: list[int | None], dim: int,
                 search: dict[str, Any], threads: int):
        import faiss

        faiss.omp_set_num_threads(threads)
        self.error: Exception | None = None
        self.shards = []
        try:
            loc = resolve(index_dir)
            for name, count in zip(files, counts, strict=True):
                shard = load_shard(loc, name, dim, count)
                set_search_params(shard, search["nprobe"], search["ef_search"], search["k_factor"])
                self.shards.append(to_gpu(shard, loc.join(name).uri) if search["gpu"] else shard)
        except IndexError_ as exc:
            self.error = exc  # raised by `ready`, as itself: a constructor's error would come back wrapped
        self.searcher = ShardSearch(self.shards)

    def ready(self) -> tuple[int, str | None]:
        """(vectors held, the fingerprint of the coarse quantizer the group's shards share: None where they take
        no assignment made elsewhere)."""
        if self.error is not None:
            raise self.error
        return sum(int(s.ntotal) for s in self.shards), self.searcher.fingerprint

    def assign(self, vectors: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
        """The lists each query visits, made once for every group of the index (see `ShardSearch`)."""
        t0 = time.perf_counter()
        dists, lists = self.searcher.assign(vectors)
        return dists, lists, time.perf_counter() - t0

    def search(self, vectors: np.ndarray, k: int,
               assigned: tuple[np.ndarray, np.ndarray, float] | None = None) -> tuple[np.ndarray, np.ndarray, float]:
        t0 = time.perf_counter()
        scores, ids = self.searcher.search(vectors, k, assigned[:2] if assigned is not None else None)
        return scores, ids, time.perf_counter() - t0

    def peak_rss_mb(self) -> float:
        from wbrag_ray.ray_runtime import peak_rss_mb

        return peak_rss_mb()


def shard_groups(shards: list[dict[str, Any]], budget_bytes: float) -> list[list[int]]:
    """Consecutive shard positions grouped so each group's bytes stay within the budget (a shard larger than
    the budget is a group of its own: the build's `index.shard_memory_gb` is what bounds it)."""
    groups: list[list[int]] = []
    held = 0.0
    for i, shard in enumerate(shards):
        size = float(shard.get("bytes") or 0)
        if not groups or held + size > budget_bytes:
            groups.append([])
            held = 0.0
        groups[-1].append(i)
        held += size
    return groups


def _manifest_shards(index_dir: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The index's manifest and its shards, each with its bytes (read from storage for indices built before the
    manifest recorded sizes)."""
    loc = resolve(index_dir)
    manifest = load_manifest(loc)
    shards = manifest.get("shards") or [{"file": f, "count": None, "bytes": 0} for f in manifest["files"]]
    for s in shards:
        if not s.get("bytes"):
            s["bytes"] = loc.join(s["file"]).size()
    return manifest, shards


def search_actors(index_dir: str, index: IndexConfig, retrieval: RetrievalConfig) -> tuple[int, float]:
    """The search actors the pool of the index at `index_dir` will start on GPUs, by `SearchPool.start`'s rule
    (shard groups x replicas where `gpu_layout.index_on_gpu`), and the bytes of the largest group: (0, 0) where
    they search on CPUs or the index is not built yet."""
    import ray

    from wbrag_ray.gpu_layout import index_on_gpu

    if not index_on_gpu(index.gpu, ray.cluster_resources().get("GPU", 0), faiss_has_gpu()):
        return 0, 0.0
    try:
        shards = _manifest_shards(index_dir)[1]
    except IndexError_:
        return 0, 0.0
    groups = shard_groups(shards, retrieval.actor_memory_gb * (1 << 30))
    return len(groups) * retrieval.concurrency, float(max(sum(shards[i]["bytes"] for i in g) for g in groups))


def search_gpus(index_dir: str, index: IndexConfig, retrieval: RetrievalConfig) -> float:
    """The GPUs the search pool of the index at `index_dir` will hold: `retrieval.search_gpus` per search actor
    (`search_actors`)."""
    return search_actors(index_dir, index, retrieval)[0] * retrieval.search_share


def _unwrap(exc: Exception) -> Exception:
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, IndexError_ | DocStoreError) else exc


# Per process, keyed by the files' identity (`identity.content_identity`) as well as their place: a store is opened
# (and mapped) once, a write-back index's provenance read once, and a version trained again in place is read anew.
_STORES: dict[tuple[str, str, str | None], DocStore] = {}
_PROVENANCE: dict[tuple[str, str, str | None], dict[int, list[int]]] = {}


@dataclass
class SearchPool:
    """The search actors of one index folder: `groups` of its shards, each in `replicas` actors."""

    index_dir: str
    manifest: dict[str, Any]
    actors: list[list[Any]]  # [group][replica]
    placement: tuple
    shared_assignment: bool = False  # one coarse assignment per search, made by one actor for every group
    _turn: Any = field(default_factory=itertools.count, repr=False)

    @classmethod
    def start(cls, index_dir: str, index: IndexConfig, retrieval: RetrievalConfig) -> SearchPool:
        import ray

        manifest, shards = _manifest_shards(index_dir)
        groups = shard_groups(shards, retrieval.actor_memory_gb * (1 << 30))
        from wbrag_ray.gpu_layout import index_on_gpu

        # index.gpu true where no GPU search can run is refused; auto searches on CPUs there (a GPU reserved per
        # search actor that faiss cannot use would idle beside a CPU search)
        use_gpu = index_on_gpu(index.gpu, ray.cluster_resources().get("GPU", 0), faiss_has_gpu())
        if index.gpu == "auto" and not use_gpu and ray.cluster_resources().get("GPU", 0) > 0:
            log.info("index.gpu auto: this faiss has no GPU support, the search actors search on CPUs")
        nprobe, ef_search = measured_settings(manifest, index.nprobe, index.ef_search)  # 'auto': what the build measured
        search = {"nprobe": nprobe, "ef_search": ef_search, "k_factor": index.k_factor, "gpu": use_gpu}
        threads = max(1, math.ceil(retrieval.search_cpus))
        from wbrag_ray.cluster_nodes import beside_generator, pool_refusal, refuse_unplaceable
        from wbrag_ray.waits import wait_placed

        # search actors that can never be placed would leave every search waiting: refused first (the pool's
        # largest shard group sizes the memory each asks for)
        most = max(search_actor_memory(sum(shards[i]["bytes"] for i in g)) for g in groups)
        need = {"CPU": retrieval.search_cpus, "GPU": retrieval.search_share if use_gpu else 0.0, "memory": most}
        refuse_unplaceable(lambda nodes: pool_refusal(
            "the search pool", len(groups) * retrieval.concurrency, need, nodes, len(groups)))
        actors = []
        for group in groups:
            held = sum(shards[i]["bytes"] for i in group)
            remote = ray.remote(
                num_cpus=retrieval.search_cpus, num_gpus=retrieval.search_share if use_gpu else None,
                memory=search_actor_memory(held), max_restarts=-1, max_task_retries=3,
            )(SearchActor).options(**beside_generator(retrieval.search_share if use_gpu else 0.0))
            files = [shards[i]["file"] for i in group]
            counts = [shards[i].get("count") for i in group]
            actors.append([start_restartable(remote, index_dir, files, counts, int(manifest["dim"]), search, threads)
                           for _ in range(retrieval.concurrency)])
        pool = cls(index_dir, manifest, actors, pool_placement(index, retrieval))
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
        """(scores, ids) of the whole index, and the search's seconds as the actors measured them (the groups
        run at once: the slowest one's, after the coarse assignment they share).

        With several groups of IVF shards, one actor (a different group each time) assigns the queries to their
        lists and every group scans its part of them: the groups' calls are sent at once with the assignment as
        a pending argument, so Ray starts them as it arrives and the driver waits once."""
        import ray

        vectors = check_query_vectors(vectors, self.dim, self.index_dir)
        turn = next(self._turn)
        ref = ray.put(vectors)
        assigned = None
        if self.shared_assignment:
            replicas = self.actors[turn % len(self.actors)]
            assigned = replicas[turn // len(self.actors) % len(replicas)].assign.remote(ref)
        calls = [replicas[turn % len(replicas)].search.remote(ref, k, assigned) for replicas in self.actors]
        try:
            parts = ray.get(calls)
            assign_s = ray.get(assigned)[2] if assigned is not None else 0.0
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.ActorDiedError):
            # a search actor's node was lost (the assigning one included: its error reaches every call that
            # waited on it): ask each group again, one call at a time, on any live replica, each assigning itself
            parts = [call_actor(replicas, "search", ref, k) for replicas in self.actors]
            assign_s = 0.0
        scores, ids = merge_results([(s, i) for s, i, _ in parts], k)
        return scores, ids, assign_s + max(sec for _, _, sec in parts)

    def peak_rss_mb(self) -> list[float]:
        import ray

        return ray.get([a.peak_rss_mb.remote() for replicas in self.actors for a in replicas])

    def close(self) -> None:
        import ray

        for replicas in self.actors:
            for actor in replicas:
                ray.kill(actor)
        self.actors = []

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_turn"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        import random

        self.__dict__.update(state)
        self._turn = itertools.count(random.randrange(1 << 16))  # each process spreads its calls over replicas


def pool_placement(index: IndexConfig, retrieval: RetrievalConfig) -> tuple:
    """What a pool's actors are: the search settings they applied and what they hold."""
    return (index.nprobe, index.ef_search, index.k_factor, index.gpu, retrieval.search_cpus,
            retrieval.actor_memory_gb, retrieval.concurrency)


@dataclass(frozen=True)
class Member:
    """An index of a retrieval service: its search pool, the source its hits carry, where its documents are
    (None: the manifest's `docs`)."""

    pool: SearchPool
    source: str = "base"
    docs_dir: str | None = None

    def docs(self) -> DocStore | None:
        """The document store, opened once per process (its files are mapped on first use)."""
        loc = docs_location(resolve(self.pool.index_dir), self.pool.manifest, self.docs_dir)
        if loc is None:
            return None
        key = (loc.uri, self.pool.manifest.get("unit", "passage"), self._identity(loc.uri))
        if key not in _STORES:
            _STORES[key] = open_doc_store(loc, key[1])
        return _STORES[key]

    def _identity(self, uri: str) -> str | None:
        """The content identity of the files at `uri`, listed once per member (a member lives for one command)."""
        from wbrag_ray.identity import content_identity

        known = self.__dict__.setdefault("_identities", {})  # frozen: the cache lives beside the fields
        if uri not in known:
            known[uri] = content_identity(uri)
        return known[uri]

    def provenance(self, base_unit: str) -> dict[int, list[int]]:
        """A write-back index's units' source documents ({} for the base), read once per process."""
        if self.source == BASE:
            return {}
        key = (self.pool.index_dir, base_unit, self._identity(resolve(self.pool.index_dir).join(PROVENANCE).uri))
        if key not in _PROVENANCE:
            _PROVENANCE[key] = read_provenance(resolve(self.pool.index_dir), base_unit)
        return _PROVENANCE[key]

    def search_vectors(self, vectors: np.ndarray, k: int) -> list[list[Hit]]:
        """This index's top k of each query, as hits tagged with its source (provenance is the union's to add)."""
        scores, ids, _ = self.pool.search_ids(vectors, k)
        return to_hits(scores, ids, self.docs(), self.source)


class RetrievalService:
    """One or more indices (the base, and the write-back index beside it) searched as one: each index on its
    own search pool, the union cut to the top K by `union` (retrieval.union), each hit tagged with its index's
    source."""

    def __init__(self, members: list[Member], union: UnionRule | None = None):
        check_union([m.source for m in members])
        check_comparable([(m.pool.index_dir, m.pool.manifest) for m in members])
        self.members = members
        self.pools = [m.pool for m in members]
        # `auto`: the rule the write-back version chose, read once here (the driver) and sent with the service
        self.union = (union or UnionRule()).resolved([resolve(m.pool.index_dir) for m in members if m.source != BASE])
        self.base_unit = union_base_unit([(m.source, m.pool.manifest) for m in members])

    @property
    def dim(self) -> int:
        return self.pools[0].dim

    @property
    def embedder(self) -> str:
        return self.pools[0].manifest["embedder"]

    def search_vectors(self, vectors: np.ndarray, k: int) -> list[list[Hit]]:
        return cut_union([m.search_vectors(vectors, k) for m in self.members],
                         [m.provenance(self.base_unit) for m in self.members], self.union, k)

    def latency_ms(self, vectors: np.ndarray, k: int, min_seconds: float = 0.5) -> float:
        """Milliseconds per query of the search itself, as the search actors measure it (the slowest group of
        each index; indices of a union add up): the best of repeated runs after a warm-up (the machine may be
        shared; the minimum is the least disturbed)."""
        def once() -> float:
            return sum(p.search_ids(vectors, k)[2] for p in self.pools)

        once()
        best, spent = float("inf"), 0.0
        while spent < min_seconds or best == float("inf"):
            t0 = time.perf_counter()
            best = min(best, once())
            spent += time.perf_counter() - t0
        return 1000 * best / max(1, len(vectors))
