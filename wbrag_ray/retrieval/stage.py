"""A retrieval pass: top-K documents for every question, searched on the retrieval service. `RetrievalSetting`
is what a RAG method searches (the base index, the write-back index beside it, a Zero-RAG router); each pass turns
it into a `RetrieveStage`, whose actors hold the query embedder and the router (the shards stay in the search
actors)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from wbrag_ray.config import EmbedderConfig, IndexConfig, RetrievalConfig
from wbrag_ray.models.embedder import Embedder
from wbrag_ray.models.router import QueryRouter
from wbrag_ray.placement import refuse_unplaceable
from wbrag_ray.retrieval.hits import hits_to_json
from wbrag_ray.retrieval.local import check_embedder, load_query_embedder
from wbrag_ray.stages.base import Resources, Stage
from wbrag_ray.stages.embed import stored
from wbrag_ray.stages.service import shared_or_own
from wbrag_ray.storage import resolve

if TYPE_CHECKING:
    from wbrag_ray.retrieval.service import RetrievalService
    from wbrag_ray.stages.service import Services


class QueryVectorsStage(Stage):
    """question -> vector, embedded by a retrieval pass's actors with their query embedder, for the driver (the
    Zero-RAG router's training, the grid's latency measurement). The other retrieval stages are this one's kind."""

    name = "retrieve"
    section = "retrieval"
    gpu_setting = "retrieval.embed_gpus"  # the query embedder's GPUs (embedder.num_gpus where unset)
    beside_generator = True
    input_columns = ("question",)
    output_columns = ("vector",)

    def __init__(self, embedder: EmbedderConfig, retrieval: RetrievalConfig):
        self.embedder_config, self.retrieval = retrieval.query_embedder(embedder), retrieval
        self.embedder = self.router = None

    @property
    def resources(self) -> Resources:
        # as many pass actors (query embedder, router) as search replicas: neither side waits on the other
        return Resources(num_cpus=self.retrieval.num_cpus, num_gpus=self.embedder_config.num_gpus,
                         concurrency=self.retrieval.concurrency, batch_size=self.retrieval.batch_size)

    def setup(self) -> None:
        self.embedder = Embedder(self.embedder_config)
        self.embedder.setup()

    def service_key(self) -> tuple:
        return ("queries", self.embedder_config.model_dump_json())

    def adopt(self, loaded: QueryVectorsStage) -> None:
        self.embedder, self.router = loaded.embedder, loaded.router

    def process_batch(self, batch: pd.DataFrame) -> pd.DataFrame:
        vectors = self.embedder.encode_queries(batch["question"].tolist())
        return pd.DataFrame({"vector": list(vectors.astype(np.float32))})


class RetrieveStage(QueryVectorsStage):
    """Adds a `docs` column (JSON list of hits) from `service`'s indices. With `router_dir` (Zero-RAG's query
    router), questions the router calls mastered get no documents (`retrieval_skipped`); the router judges the
    question even where the query is another column (FLARE's sentence queries)."""

    output_columns = ("docs",)

    def __init__(self, service: RetrievalService, embedder: EmbedderConfig, retrieval: RetrievalConfig, *,
                 router_dir: str | None = None, query_column: str = "question"):
        check_embedder(service.pools[0].manifest, service.pools[0].index_dir, embedder)
        super().__init__(embedder, retrieval)
        self.service, self.router_dir, self.query_column = service, router_dir, query_column
        self.input_columns = tuple(dict.fromkeys((query_column, "question") if router_dir else (query_column,)))

    def setup(self) -> None:
        self.embedder = load_query_embedder(self.embedder_config, self.service.dim, self.service.pools[0].index_dir)
        if self.router_dir:
            self.router = QueryRouter.load(resolve(self.router_dir).local_dir())

    def service_key(self) -> tuple:
        # What setup loads (the embedder, the router); the search actors are the service's, shared by all.
        return (self.embedder_config.model_dump_json(), self.service.dim, self.router_dir)

    def process_batch(self, batch: pd.DataFrame) -> pd.DataFrame:
        k = self.retrieval.top_k
        queries = batch[self.query_column].tolist()
        if self.router is None:
            found = self.service.search_vectors(self.embedder.encode_queries(queries), k)
            batch["docs"] = [hits_to_json(h) for h in found]
            return batch
        vectors = self.embedder.encode_queries(batch["question"].tolist())
        skip = self.router.mastered(vectors)
        docs = ["[]"] * len(batch)
        searched = np.flatnonzero(~skip)
        if len(searched):
            # The router judged the questions; the search embeds the query column only where it differs.
            wanted = (vectors[searched] if self.query_column == "question"
                      else self.embedder.encode_queries([queries[i] for i in searched]))
            for i, hits in zip(searched, self.service.search_vectors(wanted, k), strict=True):
                docs[i] = hits_to_json(hits)
        batch["docs"] = docs
        batch["retrieval_skipped"] = skip
        return batch


class PassageVectorsStage(QueryVectorsStage):
    """(id, text) -> (id, vector): passages embedded by a retrieval pass's actors with the index's embedder, as a
    bulk embed pass would (write-back's few units: the actors hold the model already)."""

    input_columns = ("id", "text")
    output_columns = ("id", "vector")

    def __init__(self, search: RetrieveStage):
        self.search, self.embedder_config, self.retrieval = search, search.embedder_config, search.retrieval
        self.embedder = self.router = None

    def setup(self) -> None:  # an actor that has loaded nothing yet (or that Ray restarted) loads the pass's stage
        self.search.setup()
        self.adopt(self.search)

    def service_key(self) -> tuple:
        return self.search.service_key()

    def process_batch(self, batch: pd.DataFrame) -> pd.DataFrame:
        vectors = stored(self.embedder.encode_passages(batch["text"].tolist()), self.embedder_config)
        return pd.DataFrame({"id": batch["id"].to_numpy(np.int64), "vector": list(vectors.astype(np.float32))})


def query_gpu_refusal(what: str, embedder: EmbedderConfig, retrieval: RetrievalConfig):
    """Refuse, before any work, `what` (the Zero-RAG router, its grid) whose query embedder asks for more GPUs
    than any node holds, naming the setting."""
    gpus = retrieval.query_embedder(embedder).num_gpus
    if gpus <= 0:
        return
    setting = "retrieval.embed_gpus" if retrieval.embed_gpus not in (None, "auto") else "embedder.num_gpus"
    refuse_unplaceable(lambda nodes: None if any(n.get("GPU", 0.0) + 1e-9 >= gpus for n in nodes) else (
        f"{what} embeds its queries on the retrieval actors, which ask for {gpus:g} GPU{'s' * (gpus != 1)} each "
        f"({setting}), but no node of the cluster has {'one' if gpus <= 1 else 'that many'}; set "
        "retrieval.embed_gpus: 0 to embed queries on CPU (the bulk embedding keeps embedder.num_gpus)"))


def query_vectors(texts: list[str], embedder: EmbedderConfig, retrieval: RetrievalConfig,
                  services: Services | None = None) -> np.ndarray:
    """`texts` embedded as queries, as a retrieval pass embeds them: on the retrieval actors of `services` (or of
    this call's own) where the query embedder asks for GPUs (a driver may have none); else in this process."""
    config = retrieval.query_embedder(embedder)
    if config.num_gpus <= 0:
        return Embedder(config).encode_queries(list(texts))
    with shared_or_own(services) as own:
        out = own.run_frame(pd.DataFrame({"question": list(texts)}), QueryVectorsStage(embedder, retrieval),
                            "embed queries")
    return np.stack(out["vector"].to_list()).astype(np.float32) if len(out) else np.zeros((0, 0), np.float32)


@dataclass(frozen=True)
class RetrievalSetting:
    """What a RAG method searches and how: the base index (documents from `docs_dir`, default the manifest's), the
    indices `extra` beside it ((index_dir, docs_dir, source), ...), a Zero-RAG router; `index`'s search settings."""

    index_dir: str
    docs_dir: str | None
    embedder: EmbedderConfig
    retrieval: RetrievalConfig
    index: IndexConfig = field(default_factory=IndexConfig)
    extra: tuple[tuple[str, str | None, str], ...] = ()
    router_dir: str | None = None

    def service(self, services: Services) -> RetrievalService:
        return services.retrieval(((self.index_dir, self.docs_dir, "base"), *self.extra), self.index, self.retrieval)

    def stage(self, services: Services, query_column: str = "question") -> RetrieveStage:
        return RetrieveStage(self.service(services), self.embedder, self.retrieval, router_dir=self.router_dir,
                             query_column=query_column)

    def search(self, frame: pd.DataFrame, query_column: str = "question",
               services: Services | None = None) -> pd.DataFrame:
        """`frame` with `docs` (and, with a router, `retrieval_skipped`) added, on the retrieval service of
        `services` (its actors answer the driver's rows directly)."""
        if services is None:
            raise ValueError("a retrieval pass runs on a command's services: pass `services` (Services())")
        return services.run_frame(frame, self.stage(services, query_column), "search")
