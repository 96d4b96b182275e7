"""Retrieval: embed queries, search every shard of an index, merge to the global top K; and the union of a
base and a write-back index, each searched on its own and cut to the top K by score.

Ids are only unique inside one index: a hit is identified by (source, id), never by id alone, so the
write-back index can number its knowledge units from 0 without colliding with base passages.

Over 400 lines, not split yet: the document store, the sharded search, the union and the Ray stage around
them change together until issue 15 replaces the in-process document store with a sharded retrieval service.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from wbrag_ray.config import EmbedderConfig, RetrievalConfig
from wbrag_ray.index.faiss_index import IndexError_, load_shards
from wbrag_ray.layout import IngestFolder
from wbrag_ray.stages.base import Resources, Stage
from wbrag_ray.storage import Location, resolve

if TYPE_CHECKING:
    import ray.data

    from wbrag_ray.config import WbragConfig
    from wbrag_ray.stages.service import Services

log = logging.getLogger(__name__)


@dataclass
class Hit:
    id: int
    score: float
    rank: int
    title: str
    text: str
    source: str = "base"  # which index the hit came from; (source, id) is the hit's identity

    @property
    def key(self) -> tuple[str, int]:
        return (self.source, self.id)


def merge_top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """Column positions of the k best scores per row (descending; ties keep column order), for score
    matrices made by concatenating per-shard or per-index results side by side."""
    order = np.argsort(-scores, axis=1, kind="stable")
    return order[:, :k]


class DocStore:
    """id -> (title, text) for the unit an index holds (sorted ids, binary search). Reads either an ingest
    folder (passages/ and sentences/ shards) or a plain Parquet folder of (id, title, text), the layout of
    the write-back corpus."""

    def __init__(self, loc: Location, unit: str = "passage"):
        ingest = IngestFolder(loc)
        if ingest.passages.exists():
            table = self._from_ingest(ingest, unit)
        else:
            try:
                table = loc.read_table(["id", "title", "text"])
            except (FileNotFoundError, KeyError) as exc:
                raise IndexError_(
                    f"no documents at {loc.uri}: expected an ingest folder (passages/, sentences/) "
                    f"or Parquet files with columns id, title, text ({exc})"
                ) from None
        table = table.sort_by("id")
        self.uri = loc.uri
        self.ids = table["id"].to_numpy()
        self.titles = table["title"].to_pylist()
        self.texts = table["text"].to_pylist()

    @staticmethod
    def _from_ingest(ingest: IngestFolder, unit: str):
        passages = ingest.passages.read_table(["pid", "title", "text"])
        if unit == "sentence":
            sentences = ingest.sentences.read_table(["sid", "pid", "text"])
            table = sentences.join(passages.select(["pid", "title"]), "pid").select(["sid", "title", "text"])
            return table.rename_columns(["id", "title", "text"])
        return passages.rename_columns(["id", "title", "text"])

    def get(self, doc_id: int) -> tuple[str, str]:
        i = int(np.searchsorted(self.ids, doc_id))
        if i >= len(self.ids) or self.ids[i] != doc_id:
            raise KeyError(f"document id {doc_id} is in the index but not in the documents at {self.uri}")
        return self.titles[i], self.texts[i]


def set_search_params(index, nprobe: int | None, ef_search: int | None, k_factor: float | None) -> None:
    """Apply the settings that exist for this index type (IVF: nprobe, HNSW: efSearch, refine: k_factor);
    the others do not apply and are skipped."""
    import faiss

    ps = faiss.ParameterSpace()
    for name, value in (("nprobe", nprobe), ("efSearch", ef_search)):
        if value is not None:
            try:
                ps.set_index_parameter(index, name, value)
            except RuntimeError:
                pass  # this index type has no such parameter
    inner = index
    while k_factor is not None:
        inner = faiss.downcast_index(inner)
        if isinstance(inner, faiss.IndexRefine):
            inner.k_factor = float(k_factor)
            break
        if not isinstance(inner, faiss.IndexIDMap | faiss.IndexIDMap2 | faiss.IndexPreTransform):
            break
        inner = inner.index


def _to_gpu(index, where: str):
    """The index on all GPUs when faiss was built with GPU support and one is present; the CPU index
    otherwise (types without a GPU version, such as HNSW, stay on the CPU)."""
    import faiss

    if not hasattr(faiss, "index_cpu_to_all_gpus") or faiss.get_num_gpus() == 0:
        return index
    try:
        return faiss.index_cpu_to_all_gpus(index)
    except RuntimeError as exc:
        log.info("index shard %s stays on the CPU: %s", where, str(exc).splitlines()[0])
        return index


class Retriever:
    """Loads an index folder (manifest + shards) and its documents; `search` returns `Hit`s per query.

    docs_dir: an ingest folder or a Parquet folder of (id, title, text); default: the manifest's `docs`
    (then hits without a document store carry empty title and text). embedder: needed only to search by
    text; `search_vectors` works without it. source: the name hits carry (e.g. "writeback").
    """

    def __init__(
        self,
        index_dir: str,
        docs_dir: str | None = None,
        embedder: EmbedderConfig | None = None,
        nprobe: int | None = 32,
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
        if self.embedder_config is not None and self.manifest["embedder"] != self.embedder_config.model:
            raise IndexError_(
                f"index {self.index_dir} was built with embedder {self.manifest['embedder']!r}, "
                f"but embedder.model is {self.embedder_config.model!r}; rebuild the index or change the config"
            )
        for i, shard in enumerate(self.shards):
            set_search_params(shard, self.nprobe, self.ef_search, self.k_factor)
            if self.gpu:
                self.shards[i] = _to_gpu(shard, f"{self.index_dir}/{self.manifest['files'][i]}")
        docs = self.docs_dir or self.manifest.get("docs")
        if docs and "://" not in docs and not docs.startswith("/"):
            docs = loc.join(docs).uri  # a manifest may name its documents relative to the index folder
        self.docs = DocStore(resolve(docs), self.manifest.get("unit", "passage")) if docs else None
        self._loaded = True

    def _ensure_loaded(self) -> None:
        if not self._loaded:
            self.setup()

    def _ensure_embedder(self):
        self._ensure_loaded()
        if self.embedder is None:
            if self.embedder_config is None:
                raise IndexError_(f"retriever for {self.index_dir} has no embedder: search by vectors, or pass one")
            from wbrag_ray.models.embedder import Embedder

            embedder = Embedder(self.embedder_config)
            embedder.setup()
            if embedder.dim != self.manifest["dim"]:
                raise IndexError_(
                    f"embedder {self.embedder_config.model!r} makes {embedder.dim}-dimensional vectors, "
                    f"index {self.index_dir} holds {self.manifest['dim']}-dimensional ones"
                )
            self.embedder = embedder
        return self.embedder

    def search_ids(self, vectors: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(scores, ids), each (n, k), best first; missing hits are id -1 with score -inf. Every shard is
        searched and the results merged, `batch_size` queries at a time."""
        self._ensure_loaded()
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        d = self.manifest["dim"]
        if vectors.ndim != 2 or vectors.shape[1] != d:
            raise IndexError_(f"query vectors have shape {vectors.shape}; the index {self.index_dir} expects (n, {d})")
        all_scores = np.full((len(vectors), k), -np.inf, np.float32)
        all_ids = np.full((len(vectors), k), -1, np.int64)
        for start in range(0, len(vectors), self.batch_size):
            q = vectors[start : start + self.batch_size]
            parts = [shard.search(q, k) for shard in self.shards]
            scores = np.concatenate([s for s, _ in parts], axis=1)
            ids = np.concatenate([i for _, i in parts], axis=1)
            scores[ids < 0] = -np.inf  # faiss pads short results with id -1 and a huge negative score
            top = merge_top_k(scores, k)
            all_scores[start : start + len(q)] = np.take_along_axis(scores, top, axis=1)
            all_ids[start : start + len(q)] = np.take_along_axis(ids, top, axis=1)
        return all_scores, all_ids

    def search_vectors(self, vectors: np.ndarray, k: int) -> list[list[Hit]]:
        scores, ids = self.search_ids(vectors, k)
        results = []
        for row_s, row_i in zip(scores, ids, strict=True):
            hits = []
            for s, i in zip(row_s, row_i, strict=True):
                if i < 0:
                    continue
                title, text = self.docs.get(int(i)) if self.docs is not None else ("", "")
                hits.append(Hit(int(i), float(s), len(hits), title, text, self.source))
            results.append(hits)
        return results

    def encode(self, queries: list[str]) -> np.ndarray:
        return self._ensure_embedder().encode_queries(queries)

    def search(self, queries: list[str], k: int) -> list[list[Hit]]:
        return self.search_vectors(self.encode(queries), k)


class UnionRetriever:
    """Several indices built with the same embedder (the base index and the write-back index), searched
    independently; each query's hits are the union cut to the top K by score, tagged with their source.

    Same `search` / `search_vectors` interface as `Retriever`; queries are embedded once, by the first
    member that has an embedder.
    """

    def __init__(self, members: list[Retriever]):
        if not members:
            raise ValueError("UnionRetriever needs at least one retriever")
        sources = [m.source for m in members]
        if len(set(sources)) != len(sources):
            raise ValueError(f"retrievers in a union need distinct sources (they name the id namespaces): {sources}")
        self.members = members
        self._loaded = False

    def setup(self) -> None:
        for m in self.members:
            m._ensure_loaded()
        first = self.members[0]
        for m in self.members[1:]:
            for key in ("embedder", "dim", "metric"):
                if m.manifest.get(key) != first.manifest.get(key):
                    raise IndexError_(
                        f"indices {first.index_dir} and {m.index_dir} differ in {key} "
                        f"({first.manifest.get(key)!r} vs {m.manifest.get(key)!r}): their scores are not comparable"
                    )
        self._loaded = True

    def search_vectors(self, vectors: np.ndarray, k: int) -> list[list[Hit]]:
        if not self._loaded:
            self.setup()
        per_member = [m.search_vectors(vectors, k) for m in self.members]
        results = []
        for hit_lists in zip(*per_member, strict=True):
            pool = [h for hits in hit_lists for h in hits]
            if not pool:
                results.append([])
                continue
            top = merge_top_k(np.array([[h.score for h in pool]], np.float32), k)[0]
            results.append([Hit(pool[j].id, pool[j].score, r, pool[j].title, pool[j].text, pool[j].source)
                            for r, j in enumerate(top)])
        return results

    def encode(self, queries: list[str]) -> np.ndarray:
        if not self._loaded:
            self.setup()
        encoder = next((m for m in self.members if m.embedder_config is not None), None)
        if encoder is None:
            raise IndexError_("no retriever in the union has an embedder: search by vectors, or pass one")
        return encoder.encode(queries)

    def search(self, queries: list[str], k: int) -> list[list[Hit]]:
        return self.search_vectors(self.encode(queries), k)


def hits_to_json(hits: list[Hit]) -> str:
    return json.dumps([asdict(h) for h in hits], ensure_ascii=False)


def hits_from_json(s: str) -> list[Hit]:
    return [Hit(**h) for h in json.loads(s)] if s else []


class RetrieveStage(Stage):
    """Top-K retrieval for every question of a dataset: adds a `docs` column (JSON list of hits).

    Searches the index folder; with `extra` ((index_dir, docs_dir, source), ...) the union of it and those
    indices (the write-back index beside the base). Or any retriever object (`retriever=`).

    With `router_dir` (Zero-RAG's query router), queries the router calls mastered are not searched: they get
    no documents (so every RAG method answers them closed-book), and `retrieval_skipped` says which they were.
    The router always judges the question, even where the query is another column (FLARE's sentence queries).
    """

    name = "retrieve"
    output_columns = ("docs",)

    def __init__(
        self,
        index_dir: str | None = None,
        ingest_dir: str | None = None,
        embedder: EmbedderConfig | None = None,
        retrieval: RetrievalConfig | None = None,
        nprobe: int = 32,
        extra: tuple[tuple[str, str | None, str], ...] = (),
        *,
        retriever: Retriever | UnionRetriever | Any = None,
        router_dir: str | None = None,
        query_column: str = "question",
    ):
        # What setup loads, for sharing it between passes (a stage around a given retriever is never shared).
        self._service_key = None
        if retriever is None:
            if index_dir is None:
                raise ValueError("RetrieveStage needs an index folder or a retriever")
            self._service_key = (index_dir, ingest_dir, embedder.model_dump_json() if embedder else None, nprobe,
                                 tuple(extra), router_dir)
            retriever = Retriever(index_dir, ingest_dir, embedder, nprobe)
            if extra:
                # only the base member embeds the queries; the others search the same vectors
                others = [Retriever(i, d, None, nprobe, source) for i, d, source in extra]
                retriever = UnionRetriever([retriever, *others])
        self.retriever = retriever
        self.retrieval = retrieval or RetrievalConfig()
        self.router_dir = router_dir
        self.router = None
        self.query_column = query_column
        self.input_columns = tuple(dict.fromkeys((query_column, "question") if router_dir else (query_column,)))

    @property
    def resources(self) -> Resources:
        return Resources(num_cpus=self.retrieval.num_cpus, batch_size=self.retrieval.batch_size)

    def setup(self) -> None:
        self.retriever.setup()
        if self.router_dir:
            from wbrag_ray.models.router import QueryRouter
            from wbrag_ray.storage import resolve as resolve_location

            self.router = QueryRouter.load(resolve_location(self.router_dir).local_dir())

    def service_key(self) -> tuple | None:
        return self._service_key

    def adopt(self, loaded: RetrieveStage) -> None:
        self.retriever, self.router = loaded.retriever, loaded.router

    def process_batch(self, batch: pd.DataFrame) -> pd.DataFrame:
        k = self.retrieval.top_k
        queries = batch[self.query_column].tolist()
        if self.router is None:
            batch["docs"] = [hits_to_json(h) for h in self.retriever.search(queries, k)]
            return batch
        vectors = self.retriever.encode(batch["question"].tolist())
        skip = self.router.mastered(vectors)
        docs = ["[]"] * len(batch)
        searched = np.flatnonzero(~skip)
        if len(searched):
            # The router judged the questions; the search embeds the query column only where it differs.
            found = (vectors[searched] if self.query_column == "question"
                     else self.retriever.encode([queries[i] for i in searched]))
            for i, hits in zip(searched, self.retriever.search_vectors(found, k), strict=True):
                docs[i] = hits_to_json(hits)
        batch["docs"] = docs
        batch["retrieval_skipped"] = skip
        return batch


@dataclass(frozen=True)
class RetrievalSetting:
    """What a RAG method searches and how (base index, the write-back index beside it, a Zero-RAG router):
    fixed once per evaluation or write-back run, and turned into a `RetrieveStage` by each retrieval pass,
    whatever column holds its queries."""

    index_dir: str
    ingest_dir: str | None
    embedder: EmbedderConfig
    retrieval: RetrievalConfig
    nprobe: int = 32
    extra: tuple[tuple[str, str | None, str], ...] = ()
    router_dir: str | None = None

    def stage(self, query_column: str = "question") -> RetrieveStage:
        return RetrieveStage(
            self.index_dir, self.ingest_dir, self.embedder, self.retrieval, self.nprobe, self.extra,
            router_dir=self.router_dir, query_column=query_column,
        )

    def search(self, ds: ray.data.Dataset, query_column: str = "question", services: Services | None = None
               ) -> ray.data.Dataset:
        """`ds` with `docs` (and, with a router, `retrieval_skipped`) added, as a Ray Data pass: on the
        retrieval service of `services` (the index opened once for every pass of a command), else on a pool
        of its own."""
        from wbrag_ray.stages.service import run_pass

        return run_pass(ds, self.stage(query_column), services)
