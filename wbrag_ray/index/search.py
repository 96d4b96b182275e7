"""The one search of an index's shards (`ShardSearch`), run in this process (`retrieval.local`), by the retrieval
service's search actors and by the recall measurement (`SearchActor`s in `SearchGroups`). The shards of one trained
IVF share one coarse assignment (faiss's `search_preassigned`); the per-shard top Ks are merged by score.
`index.nprobe: auto` takes the setting the build measured (the manifest's `search`), else `auto_nprobe`.
"""

from __future__ import annotations

import hashlib
import math
import time
from typing import Any

import numpy as np

from wbrag_ray.index.files import IndexError_, load_shard
from wbrag_ray.index.gpu_clone import GpuCloneError, to_gpu
from wbrag_ray.index.tasks import set_threads
from wbrag_ray.retrieval.hits import merge_results
from wbrag_ray.storage import resolve


def auto_nprobe(nlist: int) -> int:
    """The formula for an index without a measured setting: every list of a small index (up to 32), sqrt(nlist)
    lists of a large one."""
    return max(min(nlist, 32), round(math.sqrt(nlist)))


def search_nprobe(index, nprobe: int | str | None) -> int | None:
    """`nprobe`, or for 'auto' `auto_nprobe` of the index's lists (None for an index that is not an IVF)."""
    import faiss

    if nprobe != "auto":
        return nprobe
    ivf = faiss.try_extract_index_ivf(index)
    return auto_nprobe(ivf.nlist) if ivf is not None else None


def measured_settings(manifest: dict[str, Any], nprobe: int | str | None,
                      ef_search: int | None) -> tuple[int | str | None, int | None]:
    """(nprobe, ef_search) for the index of `manifest`: 'auto' and an unset ef_search take what its build measured,
    where it did; explicit settings stay."""
    measured = manifest.get("search") or {}
    if not measured.get("chosen"):
        return nprobe, ef_search
    if nprobe == "auto" and measured.get("parameter") == "nprobe":
        nprobe = int(measured["value"])
    if ef_search is None and measured.get("parameter") == "efSearch":
        ef_search = int(measured["value"])
    return nprobe, ef_search


def unwrapped(index):
    """The index inside its id maps and pre-transforms."""
    import faiss

    inner = faiss.downcast_index(index)
    while isinstance(inner, faiss.IndexIDMap | faiss.IndexIDMap2 | faiss.IndexPreTransform):
        inner = faiss.downcast_index(inner.index)
    return inner


def set_search_params(index, nprobe: int | str | None, ef_search: int | None, k_factor: float | None) -> None:
    """Apply the settings this index type has (IVF: nprobe, HNSW: efSearch, refine: k_factor), skip the others. An
    IVF's HNSW quantizer searches with efSearch = max(2 x nprobe, ef_search): faiss's 16 finds too few lists."""
    import faiss

    nprobe = search_nprobe(index, nprobe)
    ivf = faiss.try_extract_index_ivf(index)
    if ivf is not None and nprobe is not None:
        quantizer = faiss.downcast_index(ivf.quantizer)
        if isinstance(quantizer, faiss.IndexHNSW):
            quantizer.hnsw.efSearch = max(2 * min(nprobe, ivf.nlist), ef_search or 0)
    ps = faiss.ParameterSpace()
    for name, value in (("nprobe", nprobe), ("efSearch", ef_search)):
        if value is not None:
            try:
                ps.set_index_parameter(index, name, value)
            except RuntimeError:
                pass  # this index type has no such parameter
    inner = unwrapped(index)
    if k_factor is not None and isinstance(inner, faiss.IndexRefine):
        inner.k_factor = float(k_factor)


def takes_assignment(index) -> bool:
    """Whether `index` scans the lists a coarse assignment made elsewhere names: faiss's IVF interface, which a CPU
    IndexIVF and a GPU one (no IndexIVF) both implement."""
    import faiss

    return isinstance(index, faiss.IndexIVFInterface)


def _ivf_of(shard):
    """(the IVF index inside a shard, the vector transforms before it), or None where the shard is no IVF or wraps
    it so that an assignment cannot pass (refine, id maps, a multi-GPU clone)."""
    import faiss

    chain = []
    inner = faiss.downcast_index(shard)
    if isinstance(inner, faiss.IndexPreTransform):
        chain = [faiss.downcast_VectorTransform(inner.chain.at(i)) for i in range(inner.chain.size())]
        inner = faiss.downcast_index(inner.index)
    return (inner, chain) if takes_assignment(inner) else None


def quantizer_fingerprint(ivf) -> str | None:
    """A digest of an IVF's coarse quantizer (its list count and a few centroids): equal for the shards of one
    build; None where the quantizer cannot give its centroids back."""
    quantizer = ivf.quantizer
    if quantizer.ntotal == 0:
        return None
    digest = hashlib.blake2b(f"{ivf.nlist}:{quantizer.ntotal}".encode(), digest_size=16)
    try:
        for row in sorted({0, quantizer.ntotal // 2, quantizer.ntotal - 1}):
            digest.update(np.ascontiguousarray(quantizer.reconstruct(row)).tobytes())
    except RuntimeError:  # a quantizer type without reconstruction
        return None
    return digest.hexdigest()


class ShardSearch:
    """Index shards searched as one index: each query's top K over all of them, best first. IVF shards of one
    training share one coarse assignment (`assign`; a retrieval service makes it once for all its actors)."""

    def __init__(self, shards: list, batch_size: int = 1024):
        self.shards, self.batch_size = shards, batch_size
        ivfs = [_ivf_of(s) for s in shards]
        self.ivfs = self.fingerprint = None
        prints = {quantizer_fingerprint(found[0]) if found else None for found in ivfs}
        if shards and len(prints) == 1 and None not in prints:
            self.ivfs = [ivf for ivf, _ in ivfs]
            self.chain = ivfs[0][1]
            self.fingerprint = prints.pop()
        self._clamp()

    @classmethod
    def load(cls, index_uri: str, named: list[tuple[str, int | None]], dim: int, nprobe: int | str | None = None,
             ef_search: int | None = None, k_factor: float | None = None, *, gpu: bool | str = False,
             batch_size: int = 1024) -> ShardSearch:
        """The shards `named` ((file, count), ...) of the index folder at `index_uri`, checked against its
        manifest, the search settings applied, on the GPU where `gpu` (`index.gpu`, `gpu_clone.to_gpu`)."""
        loc = resolve(index_uri)
        shards = []
        for name, count in named:
            shard = load_shard(loc, name, dim, count)
            set_search_params(shard, nprobe, ef_search, k_factor)
            shards.append(to_gpu(shard, loc.join(name).uri, required=gpu is True) if gpu else shard)
        return cls(shards, batch_size)

    def _clamp(self) -> None:
        for ivf in self.ivfs or ():  # faiss searches min(nprobe, nlist) lists; an assignment has that width
            ivf.nprobe = min(ivf.nprobe, ivf.nlist)

    def configure(self, nprobe: int | None, ef_search: int | None) -> None:
        """Search at other settings from now on (the recall measurement's steps; CPU shards)."""
        for shard in self.shards:
            set_search_params(shard, nprobe, ef_search, None)
        self._clamp()

    def _transformed(self, vectors: np.ndarray) -> np.ndarray:
        for transform in self.chain:
            vectors = transform.apply(vectors)
        return vectors

    def assign(self, vectors: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(centroid scores, list ids), each (n, nprobe): the lists each query visits, in every shard."""
        if self.ivfs is None:
            raise ValueError("these shards are not IVF shards of one trained index: they cannot share an assignment")
        ivf = self.ivfs[0]
        return ivf.quantizer.search(self._transformed(vectors), ivf.nprobe)

    def search(self, vectors: np.ndarray, k: int,
               assigned: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(scores, ids), each (n, k), best first, over every shard, `batch_size` queries at a time; a missing hit
        is id -1, score -inf. `assigned`: the lists the queries visit (`assign`), made here when missing."""
        out_s = np.full((len(vectors), k), -np.inf, np.float32)
        out_i = np.full((len(vectors), k), -1, np.int64)
        for start in range(0, len(vectors), self.batch_size):
            q = vectors[start : start + self.batch_size]
            if self.ivfs is None:
                found = [shard.search(q, k) for shard in self.shards]
            else:
                q = self._transformed(q)
                if assigned is None:
                    dists, lists = self.ivfs[0].quantizer.search(q, self.ivfs[0].nprobe)
                else:
                    dists, lists = (a[start : start + len(q)] for a in assigned)
                found = [ivf.search_preassigned(q, k, lists, dists) for ivf in self.ivfs]
            out_s[start : start + len(q)], out_i[start : start + len(q)] = merge_results(found, k)
        return out_s, out_i


class SearchActor:
    """A group of one index's shards loaded once and searched by `ShardSearch`, timing itself. `search`: (nprobe,
    ef_search, k_factor, gpu). A load error is raised by `ready` as itself (a constructor's would come back
    wrapped, and a restartable actor would be started again and again)."""

    def __init__(self, index_uri: str, named: list[tuple[str, int | None]], dim: int, search: tuple,
                 threads: int | None):
        set_threads(threads)
        self.error: Exception | None = None
        try:
            self.searcher = ShardSearch.load(index_uri, named, dim, *search[:3], gpu=search[3])
        except (IndexError_, GpuCloneError) as exc:
            self.error, self.searcher = exc, ShardSearch([])

    def ready(self) -> tuple[int, str | None]:
        """(vectors held, the fingerprint of the coarse quantizer the group's shards share, or None)."""
        if self.error is not None:
            raise self.error
        return sum(int(s.ntotal) for s in self.searcher.shards), self.searcher.fingerprint

    def configure(self, nprobe: int | None, ef_search: int | None) -> None:
        self.searcher.configure(nprobe, ef_search)

    def assign(self, vectors: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
        """The lists each query visits (for every group of the index), and its seconds."""
        t0 = time.perf_counter()
        dists, lists = self.searcher.assign(vectors)
        return dists, lists, time.perf_counter() - t0

    def search(self, vectors: np.ndarray, k: int,
               assigned: tuple[np.ndarray, np.ndarray, float] | None = None) -> tuple[np.ndarray, np.ndarray, float]:
        """(scores, ids) of the group's top K and its seconds."""
        t0 = time.perf_counter()
        scores, ids = self.searcher.search(vectors, k, assigned[:2] if assigned is not None else None)
        return scores, ids, time.perf_counter() - t0


class SearchGroups:
    """An index's shards in groups, each loaded by `SearchActor`s: Ray actors (a group's replicas), or one object in
    this process. A call goes to one replica of every group at once; `search` merges the groups' top Ks."""

    def __init__(self, actors: list[list[Any]]):
        self.actors = actors  # [group][replica]

    def call(self, method: str, *args, turn: int = 0) -> list:
        """`method` of the `turn`-th replica of each group, all at once: the results in group order."""
        picked = [replicas[turn % len(replicas)] for replicas in self.actors]
        if isinstance(picked[0], SearchActor):
            return [getattr(a, method)(*args) for a in picked]
        import ray

        args = [ray.put(a) if isinstance(a, np.ndarray) else a for a in args]  # one copy for every group
        return ray.get([getattr(a, method).remote(*args) for a in picked])

    @staticmethod
    def merged(parts: list[tuple], k: int) -> tuple[np.ndarray, np.ndarray, list[float]]:
        """The groups' (scores, ids, seconds) as the whole index's (scores, ids) and each group's seconds."""
        return (*merge_results([(s, i) for s, i, _ in parts], k), [sec for _, _, sec in parts])

    def search(self, vectors, k: int) -> tuple[np.ndarray, np.ndarray, list[float]]:
        return self.merged(self.call("search", vectors, k), k)

    def close(self) -> None:
        actors, self.actors = [a for replicas in self.actors for a in replicas], []
        if actors and not isinstance(actors[0], SearchActor):
            import ray

            for actor in actors:
                ray.kill(actor)
