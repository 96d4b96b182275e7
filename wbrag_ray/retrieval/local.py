"""Searching an index in this process: for a few queries, tests, benchmarks and exports (the pipelines search
through the retrieval service, `retrieval.service`, which holds the shards in search actors instead).

`Retriever` loads an index folder (manifest + shards) and opens its document store; `UnionRetriever` searches
several indices built with the same embedder (the base and the write-back index) and cuts their union to the
top K by `retrieval.union` (wbrag_ray.retrieval.union). Both share the query embedding, the shard search and the merge with the service.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from wbrag_ray.config import EmbedderConfig
from wbrag_ray.index.faiss_index import IndexError_, load_shards
from wbrag_ray.index.gpu_clone import to_gpu
from wbrag_ray.index.search_params import measured_settings, set_search_params
from wbrag_ray.models.hardware import gpus_usable
from wbrag_ray.retrieval.docstore import DocStore, open_doc_store
from wbrag_ray.retrieval.hits import Hit, merge_results
from wbrag_ray.retrieval.union import BASE, UnionRule, cut_union, read_provenance
from wbrag_ray.storage import Location, resolve

if TYPE_CHECKING:
    from wbrag_ray.config import WbragConfig


def check_embedder(manifest: dict, index_dir: str, embedder: EmbedderConfig | None) -> None:
    if embedder is not None and manifest["embedder"] != embedder.model:
        raise IndexError_(
            f"index {index_dir} was built with embedder {manifest['embedder']!r}, "
            f"but embedder.model is {embedder.model!r}; rebuild the index or change the config"
        )


def docs_location(index: Location, manifest: dict, docs_dir: str | None) -> Location | None:
    """Where the documents of an index's ids are: `docs_dir`, else the manifest's `docs` (relative to the
    index folder when not absolute); None when neither names any."""
    docs = docs_dir or manifest.get("docs")
    if not docs:
        return None
    if "://" not in docs and not docs.startswith("/"):
        return index.join(docs)
    return resolve(docs)


def _ivf_of(shard):
    """(the IVF index inside a shard, the vector transforms applied before it), or None where the shard is not
    an IVF (HNSW, flat) or wraps it in a way a coarse assignment cannot pass (refine, id maps)."""
    import faiss

    chain = []
    inner = faiss.downcast_index(shard)
    if isinstance(inner, faiss.IndexPreTransform):
        chain = [faiss.downcast_VectorTransform(inner.chain.at(i)) for i in range(inner.chain.size())]
        inner = faiss.downcast_index(inner.index)
    return (inner, chain) if isinstance(inner, faiss.IndexIVF) else None


def quantizer_fingerprint(ivf) -> str | None:
    """A digest of an IVF's coarse quantizer (its list count and a few of its centroids): equal for the shards of
    one build, which trains once; None where the quantizer cannot give its centroids back."""
    import hashlib

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
    """Index shards searched as one index: each query's top K over all of them, best first.

    The shards of one IVF index share the trained coarse quantizer, so a batch of queries is assigned to its
    nprobe lists once (`assign`) and each shard scans only its own part of those lists (faiss's
    `search_preassigned`): the quantizer is not run again per shard, a cost that grows with the number of
    shards rather than with what they hold. A retrieval service makes the assignment once for all its search
    actors. Other index types (HNSW, flat, refine) search shard by shard."""

    def __init__(self, shards: list, batch_size: int = 1024):
        self.shards, self.batch_size = shards, batch_size
        ivfs = [_ivf_of(s) for s in shards]
        self.ivfs = None
        self.fingerprint = None
        prints = {quantizer_fingerprint(found[0]) if found else None for found in ivfs}
        if shards and len(prints) == 1 and None not in prints:
            self.ivfs = [ivf for ivf, _ in ivfs]
            self.chain = ivfs[0][1]
            self.fingerprint = prints.pop()
            for ivf in self.ivfs:  # faiss searches min(nprobe, nlist) lists; an assignment has that width
                ivf.nprobe = min(ivf.nprobe, ivf.nlist)

    @property
    def can_assign(self) -> bool:
        return self.ivfs is not None

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
        """(scores, ids), each (n, k), best first, over every shard, `batch_size` queries at a time; `assigned`:
        the lists the queries visit (`assign`), made here when missing."""
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


def to_hits(scores: np.ndarray, ids: np.ndarray, docs: DocStore | None, source: str) -> list[list[Hit]]:
    """Hits per query, with their documents looked up (empty title and text without a store)."""
    results = []
    for row_s, row_i in zip(scores, ids, strict=True):
        hits = []
        for s, i in zip(row_s, row_i, strict=True):
            if i < 0:
                continue
            title, text = docs.get(int(i)) if docs is not None else ("", "")
            hits.append(Hit(int(i), float(s), len(hits), title, text, source))
        results.append(hits)
    return results


def check_query_vectors(vectors: np.ndarray, dim: int, where: str) -> np.ndarray:
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    if vectors.ndim != 2 or vectors.shape[1] != dim:
        raise IndexError_(f"query vectors have shape {vectors.shape}; the index {where} expects (n, {dim})")
    return vectors


def load_query_embedder(config: EmbedderConfig, dim: int, where: str):
    """The query-side embedder, checked against the index's dimension; on a GPU only where one is usable."""
    from wbrag_ray.models.embedder import Embedder

    if config.num_gpus and not gpus_usable():
        config = config.model_copy(update={"num_gpus": 0.0})
    embedder = Embedder(config)
    embedder.setup()
    if embedder.dim != dim:
        raise IndexError_(f"embedder {config.model!r} makes {embedder.dim}-dimensional vectors, "
                          f"index {where} holds {dim}-dimensional ones")
    return embedder


class Retriever:
    """Loads an index folder (manifest + shards) and its documents; `search` returns `Hit`s per query.

    docs_dir: a document store, an ingest folder or a Parquet folder of (id, title, text); default: the
    manifest's `docs` (hits without documents carry empty title and text). embedder: needed only to search
    by text; `search_vectors` works without it. source: the name hits carry (e.g. "writeback").
    """

    def __init__(
        self,
        index_dir: str,
        docs_dir: str | None = None,
        embedder: EmbedderConfig | None = None,
        nprobe: int | str | None = "auto",
        source: str = "base",
        *,
        ef_search: int | None = None,
        k_factor: float | None = None,
        gpu: bool = True,
        batch_size: int = 1024,
    ):
        self.index_dir, self.docs_dir, self.embedder_config = index_dir, docs_dir, embedder
        self.nprobe, self.ef_search, self.k_factor, self.gpu = nprobe, ef_search, k_factor, gpu
        self.source, self.batch_size = source, batch_size
        self.embedder = None
        self._loaded = False

    @classmethod
    def from_config(cls, index_dir: str, docs_dir: str | None, config: WbragConfig, source: str = "base") -> Retriever:
        """A retriever with the run config's search settings (index.nprobe, index.ef_search, ...)."""
        ic = config.index
        return cls(index_dir, docs_dir, config.embedder, ic.nprobe, source,
                   ef_search=ic.ef_search, k_factor=ic.k_factor, gpu=ic.gpu)

    @property
    def dim(self) -> int:
        self._ensure_loaded()
        return int(self.manifest["dim"])

    def setup(self) -> None:
        loc = resolve(self.index_dir)
        self.shards, self.manifest = load_shards(loc)
        check_embedder(self.manifest, self.index_dir, self.embedder_config)
        nprobe, ef_search = measured_settings(self.manifest, self.nprobe, self.ef_search)
        for i, shard in enumerate(self.shards):
            set_search_params(shard, nprobe, ef_search, self.k_factor)
            if self.gpu:
                self.shards[i] = to_gpu(shard, f"{self.index_dir}/{self.manifest['files'][i]}")
        self.searcher = ShardSearch(self.shards, self.batch_size)
        docs = docs_location(loc, self.manifest, self.docs_dir)
        self.docs = open_doc_store(docs, self.manifest.get("unit", "passage")) if docs else None
        self._loaded = True

    def _ensure_loaded(self) -> None:
        if not self._loaded:
            self.setup()

    def _ensure_embedder(self):
        self._ensure_loaded()
        if self.embedder is None:
            if self.embedder_config is None:
                raise IndexError_(f"retriever for {self.index_dir} has no embedder: search by vectors, or pass one")
            self.embedder = load_query_embedder(self.embedder_config, self.manifest["dim"], self.index_dir)
        return self.embedder

    def search_ids(self, vectors: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(scores, ids), each (n, k), best first; missing hits are id -1 with score -inf. Every shard is
        searched and the results merged, `batch_size` queries at a time."""
        self._ensure_loaded()
        vectors = check_query_vectors(vectors, self.manifest["dim"], self.index_dir)
        return self.searcher.search(vectors, k)

    def search_vectors(self, vectors: np.ndarray, k: int) -> list[list[Hit]]:
        return to_hits(*self.search_ids(vectors, k), self.docs, self.source)

    def encode(self, queries: list[str]) -> np.ndarray:
        return self._ensure_embedder().encode_queries(queries)

    def search(self, queries: list[str], k: int) -> list[list[Hit]]:
        return self.search_vectors(self.encode(queries), k)


def check_union(sources: list[str]) -> None:
    """Indices searched as one need at least one member and distinct sources: the source names the id space."""
    if not sources:
        raise ValueError("a union of indices needs at least one index")
    if len(set(sources)) != len(sources):
        raise ValueError(f"indices in a union need distinct sources (they name the id namespaces): {sources}")


def check_comparable(manifests: list[tuple[str, dict]]) -> None:
    """Indices searched as one union must share embedder, dimension and metric: else scores do not compare."""
    (first_dir, first), *others = manifests
    for other_dir, other in others:
        for key in ("embedder", "dim", "metric"):
            if other.get(key) != first.get(key):
                raise IndexError_(
                    f"indices {first_dir} and {other_dir} differ in {key} "
                    f"({first.get(key)!r} vs {other.get(key)!r}): their scores are not comparable"
                )


def union_base_unit(members: list[tuple[str, dict]]) -> str:
    """What the base index of a union holds (passage / sentence): a unit's provenance applies only to that kind."""
    manifest = next((m for source, m in members if source == BASE), members[0][1])
    return manifest.get("unit", "passage")


class UnionRetriever:
    """Several indices built with the same embedder (the base index and the write-back index), searched
    independently; each query's hits are the union cut to the top K by `union` (default: retrieval.union's
    default, the gate; the paper's merge by score is `UnionRule("score")`), tagged with their source, a write-back
    unit with its provenance: the same union as the retrieval service's (`union.cut_union`).

    Same `search` / `search_vectors` interface as `Retriever`; queries are embedded once, by the first
    member that has an embedder.
    """

    def __init__(self, members: list[Retriever], union: UnionRule | None = None):
        check_union([m.source for m in members])
        self.members = members
        self.union = union or UnionRule()
        self._loaded = False

    def setup(self) -> None:
        for m in self.members:
            m._ensure_loaded()
        check_comparable([(m.index_dir, m.manifest) for m in self.members])
        base_unit = union_base_unit([(m.source, m.manifest) for m in self.members])
        self.provenance = [{} if m.source == BASE else read_provenance(resolve(m.index_dir), base_unit)
                           for m in self.members]
        self.union = self.union.resolved([resolve(m.index_dir) for m in self.members if m.source != BASE])
        self._loaded = True

    def search_vectors(self, vectors: np.ndarray, k: int) -> list[list[Hit]]:
        if not self._loaded:
            self.setup()
        return cut_union([m.search_vectors(vectors, k) for m in self.members], self.provenance, self.union, k)

    def encode(self, queries: list[str]) -> np.ndarray:
        if not self._loaded:
            self.setup()
        encoder = next((m for m in self.members if m.embedder_config is not None), None)
        if encoder is None:
            raise IndexError_("no retriever in the union has an embedder: search by vectors, or pass one")
        return encoder.encode(queries)

    def search(self, queries: list[str], k: int) -> list[list[Hit]]:
        return self.search_vectors(self.encode(queries), k)
