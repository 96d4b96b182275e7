"""Retriever: embed queries, search an index, return the top K documents with their text and scores."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd

from wbrag_ray.config import EmbedderConfig, RetrievalConfig
from wbrag_ray.index.faiss_index import IndexError_, load_index
from wbrag_ray.stages.base import Resources, Stage
from wbrag_ray.storage import Location, resolve


@dataclass
class Hit:
    id: int
    score: float
    rank: int
    title: str
    text: str
    source: str = "base"  # which index the hit came from


class DocStore:
    """id -> (title, text) for the unit an index holds, from the ingest shards (sorted ids, binary search)."""

    def __init__(self, ingest: Location, unit: str):
        passages = ingest.join("passages").read_table(["pid", "title", "text"])
        if unit == "sentence":
            sentences = ingest.join("sentences").read_table(["sid", "pid", "text"])
            table = sentences.join(passages.select(["pid", "title"]), "pid").select(["sid", "title", "text"])
            table = table.rename_columns(["id", "title", "text"])
        else:
            table = passages.rename_columns(["id", "title", "text"])
        table = table.sort_by("id")
        self.ids = table["id"].to_numpy()
        self.titles = table["title"].to_pylist()
        self.texts = table["text"].to_pylist()

    def get(self, doc_id: int) -> tuple[str, str]:
        i = int(np.searchsorted(self.ids, doc_id))
        if i >= len(self.ids) or self.ids[i] != doc_id:
            raise KeyError(f"document id {doc_id} is in the index but not in the ingested corpus")
        return self.titles[i], self.texts[i]


class Retriever:
    """Loads an index folder (manifest + index) and its documents; `search` returns `Hit`s per query."""

    def __init__(self, index_dir: str, ingest_dir: str, embedder: EmbedderConfig, nprobe: int = 32, source: str = "base"):
        self.index_dir, self.ingest_dir, self.embedder_config = index_dir, ingest_dir, embedder
        self.nprobe, self.source = nprobe, source
        self._loaded = False

    def setup(self) -> None:
        import faiss

        from wbrag_ray.models.embedder import Embedder

        self.index, self.manifest = load_index(resolve(self.index_dir))
        if self.manifest["embedder"] != self.embedder_config.model:
            raise IndexError_(
                f"index {self.index_dir} was built with embedder {self.manifest['embedder']!r}, "
                f"but embedder.model is {self.embedder_config.model!r}; rebuild the index or change the config"
            )
        ivf = faiss.try_extract_index_ivf(self.index)
        if ivf is not None:
            ivf.nprobe = self.nprobe
        self.embedder = Embedder(self.embedder_config)
        self.embedder.setup()
        self.docs = DocStore(resolve(self.ingest_dir), self.manifest["unit"])
        self._loaded = True

    def search_vectors(self, vectors: np.ndarray, k: int) -> list[list[Hit]]:
        if not self._loaded:
            self.setup()
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        if vectors.ndim != 2 or vectors.shape[1] != self.index.d:
            raise IndexError_(f"query vectors have shape {vectors.shape}; the index expects (n, {self.index.d})")
        scores, ids = self.index.search(vectors, k)
        results = []
        for row_s, row_i in zip(scores, ids, strict=True):
            hits = []
            for rank, (s, i) in enumerate((s, i) for s, i in zip(row_s, row_i, strict=True) if i >= 0):
                title, text = self.docs.get(int(i))
                hits.append(Hit(int(i), float(s), rank, title, text, self.source))
            results.append(hits)
        return results

    def search(self, queries: list[str], k: int) -> list[list[Hit]]:
        if not self._loaded:
            self.setup()
        return self.search_vectors(self.embedder.encode_queries(queries), k)


def hits_to_json(hits: list[Hit]) -> str:
    return json.dumps([asdict(h) for h in hits], ensure_ascii=False)


def hits_from_json(s: str) -> list[Hit]:
    return [Hit(**h) for h in json.loads(s)] if s else []


class RetrieveStage(Stage):
    """Top-K retrieval for every question of a dataset: adds a `docs` column (JSON list of hits)."""

    name = "retrieve"
    input_columns = ("question",)
    output_columns = ("docs",)

    def __init__(self, index_dir: str, ingest_dir: str, embedder: EmbedderConfig, retrieval: RetrievalConfig, nprobe: int):
        self.retriever = Retriever(index_dir, ingest_dir, embedder, nprobe)
        self.retrieval = retrieval

    @property
    def resources(self) -> Resources:
        return Resources(num_cpus=self.retrieval.num_cpus, batch_size=self.retrieval.batch_size)

    def setup(self) -> None:
        self.retriever.setup()

    def process_batch(self, batch: pd.DataFrame) -> pd.DataFrame:
        hits = self.retriever.search(batch["question"].tolist(), self.retrieval.top_k)
        batch["docs"] = [hits_to_json(h) for h in hits]
        return batch

