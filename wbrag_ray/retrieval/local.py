"""An index searched as one (`Retriever`: on the retrieval service's search pool, or in this process), and
`IndexUnion`: indices built with one embedder (the base and the write-back index) searched as one."""

from __future__ import annotations

from typing import Any

import numpy as np

from wbrag_ray.config import EmbedderConfig
from wbrag_ray.identity import content_identity
from wbrag_ray.index.files import IndexError_, load_manifest, named_shards
from wbrag_ray.index.search import ShardSearch, measured_settings
from wbrag_ray.models.embedder import Embedder
from wbrag_ray.models.hardware import gpus_usable
from wbrag_ray.retrieval.docstore import DocStore, open_doc_store
from wbrag_ray.retrieval.hits import Hit
from wbrag_ray.retrieval.union import BASE, PROVENANCE, UnionRule, cut_union, read_provenance
from wbrag_ray.storage import committed, resolve


def check_embedder(manifest: dict, index_dir: str, embedder: EmbedderConfig | None) -> None:
    if embedder is not None and manifest["embedder"] != embedder.model:
        raise IndexError_(
            f"index {index_dir} was built with embedder {manifest['embedder']!r}, "
            f"but embedder.model is {embedder.model!r}; rebuild the index or change the config"
        )


# Per process, keyed by the files' identity as well as their place: a store is opened (and mapped) once, a
# write-back index's provenance read once, and a version trained again in place is read anew.
_STORES: dict[tuple[str, str, str | None], DocStore] = {}
_PROVENANCE: dict[tuple[str, str, str | None], dict[int, list[int]]] = {}


def documents(index_dir: str, manifest: dict, docs_dir: str | None) -> DocStore | None:
    """The document store of an index's ids, opened once per process: `docs_dir`, else the manifest's `docs`
    (relative to the index folder when not absolute); None where neither names one."""
    docs = docs_dir or manifest.get("docs")
    if not docs:
        return None
    # a store redone after the index was built is read where its last commit put it (`storage.committed`)
    loc = committed(resolve(index_dir).join(docs) if "://" not in docs and not docs.startswith("/") else resolve(docs))
    key = (loc.uri, manifest.get("unit", "passage"), content_identity(loc.uri))
    if key not in _STORES:
        _STORES[key] = open_doc_store(loc, key[1])
    return _STORES[key]


def provenance(index_dir: str, base_unit: str) -> dict[int, list[int]]:
    """A write-back index's units' source documents, read once per process."""
    loc = resolve(index_dir)
    key = (index_dir, base_unit, content_identity(loc.join(PROVENANCE).uri))
    if key not in _PROVENANCE:
        _PROVENANCE[key] = read_provenance(loc, base_unit)
    return _PROVENANCE[key]


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


def load_query_embedder(config: EmbedderConfig, dim: int, where: str) -> Embedder:
    """The query-side embedder, checked against the index's dimension; on a GPU only where one is usable."""
    if config.num_gpus and not gpus_usable():
        config = config.model_copy(update={"num_gpus": 0.0})
    embedder = Embedder(config)
    embedder.setup()
    if embedder.dim != dim:
        raise IndexError_(f"embedder {config.model!r} makes {embedder.dim}-dimensional vectors, "
                          f"index {where} holds {dim}-dimensional ones")
    return embedder


class Retriever:
    """An index folder (manifest + shards) searched as one: on a retrieval service's search pool (`pool`,
    `retrieval.service`), else loaded in this process (tests, benchmarks); `search_vectors` returns `Hit`s per query.

    docs_dir: a document store, an ingest folder or a Parquet folder of (id, title, text); default: the
    manifest's `docs` (hits without documents carry empty title and text). embedder: checked against the index's.
    source: the name hits carry (e.g. "writeback"). The search settings apply in this process (a pool has its own).
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
        gpu: bool | str = "auto",
        batch_size: int = 1024,
        pool: Any = None,
    ):
        self.index_dir, self.docs_dir, self.embedder_config = index_dir, docs_dir, embedder
        self.nprobe, self.ef_search, self.k_factor, self.gpu = nprobe, ef_search, k_factor, gpu
        self.source, self.batch_size, self.pool = source, batch_size, pool
        self._searcher = None
        self._manifest = pool.manifest if pool is not None else None

    @property
    def manifest(self) -> dict[str, Any]:
        if self._manifest is None:
            self._manifest = load_manifest(resolve(self.index_dir))
        return self._manifest

    @property
    def dim(self) -> int:
        return int(self.manifest["dim"])

    def setup(self) -> None:
        check_embedder(self.manifest, self.index_dir, self.embedder_config)
        nprobe, ef_search = measured_settings(self.manifest, self.nprobe, self.ef_search)
        self._searcher = ShardSearch.load(self.index_dir, named_shards(self.manifest), self.dim, nprobe, ef_search,
                                         self.k_factor, gpu=self.gpu, batch_size=self.batch_size)

    @property
    def searcher(self) -> ShardSearch:
        if self._searcher is None:
            self.setup()
        return self._searcher

    def docs(self) -> DocStore | None:
        return documents(self.index_dir, self.manifest, self.docs_dir)

    def search_ids(self, vectors: np.ndarray, k: int) -> tuple:
        """(scores, ids), each (n, k), best first, and on a pool the search's seconds; a missing hit is id -1
        with score -inf."""
        if self.pool is not None:
            return self.pool.search_ids(vectors, k)
        return self.searcher.search(check_query_vectors(vectors, self.dim, self.index_dir), k)

    def search_vectors(self, vectors: np.ndarray, k: int) -> list[list[Hit]]:
        return to_hits(*self.search_ids(vectors, k)[:2], self.docs(), self.source)


def check_members(members: list) -> None:
    """Indices searched as one need at least one member, distinct sources (they name the id spaces) and one
    embedder, dimension and metric (else their scores do not compare)."""
    sources = [m.source for m in members]
    if not sources:
        raise ValueError("a union of indices needs at least one index")
    if len(set(sources)) != len(sources):
        raise ValueError(f"indices in a union need distinct sources (they name the id namespaces): {sources}")
    first, *others = members
    for other in others:
        for key in ("embedder", "dim", "metric"):
            if other.manifest.get(key) != first.manifest.get(key):
                raise IndexError_(f"indices {first.index_dir} and {other.index_dir} differ in {key} "
                                  f"({first.manifest.get(key)!r} vs {other.manifest.get(key)!r}): their scores are "
                                  "not comparable")


class IndexUnion:
    """Indices built with the same embedder searched as one: each index's top K, tagged with its source, a
    write-back unit with its provenance, cut to the top K by `union` (retrieval.union; `auto` is resolved here,
    once, against the write-back indices' own choice). Its members are `Retriever`s."""

    def __init__(self, members: list, union: UnionRule | None = None):
        check_members(members)
        self.members = members
        self.union = (union or UnionRule()).resolved([resolve(m.index_dir) for m in members if m.source != BASE])
        # a unit's provenance applies only to the kind of document (passage / sentence) the base index holds
        base = next((m for m in members if m.source == BASE), members[0])
        self.base_unit = base.manifest.get("unit", "passage")
        self._opened: list | None = None  # per process: each member's (documents, provenance)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_opened": None}

    @property
    def dim(self) -> int:
        return int(self.members[0].manifest["dim"])

    def search_vectors(self, vectors: np.ndarray, k: int) -> list[list[Hit]]:
        if self._opened is None:
            self._opened = [(m.docs(), {} if m.source == BASE else provenance(m.index_dir, self.base_unit))
                            for m in self.members]
        hits = [to_hits(*m.search_ids(vectors, k)[:2], docs, m.source)
                for m, (docs, _) in zip(self.members, self._opened, strict=True)]
        return cut_union(hits, [p for _, p in self._opened], self.union, k)

