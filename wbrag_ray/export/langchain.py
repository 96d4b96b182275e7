"""LangChain: index.faiss and index.pkl as `FAISS.load_local` reads them (inner product on normalized vectors),
the pickle written as a stream one shard at a time; `load` and `embeddings` give the query side."""

from __future__ import annotations

import functools
import pickle
import tempfile
from collections.abc import Iterator
from typing import Any

from wbrag_ray.config import WbragConfig
from wbrag_ray.export.embedder import load_embedder
from wbrag_ray.export.view import Document, View
from wbrag_ray.storage import Location

INDEX_NAME = "index"  # FAISS.load_local's default: index.faiss and index.pkl
INDEX_FILE, DOCSTORE_FILE = f"{INDEX_NAME}.faiss", f"{INDEX_NAME}.pkl"
# what `wbrag export` checks is importable before it writes a file, and the packages that hold it
NEEDS, PACKAGES = ("langchain_community.vectorstores", "langchain_core.documents"), "langchain-community"


class _Reduce:
    """Pickled as `func(*args)`; `items` (pairs, consumed while pickling) become a dict's entries."""

    def __init__(self, func: Any, args: tuple = (), items: Iterator[tuple[Any, Any]] | None = None):
        self.func, self.args, self.items = func, args, items

    def __reduce__(self):
        return (self.func, self.args, None, None, self.items)


def write(view: View, batches: Iterator[list[Document]], out: Location, config: WbragConfig) -> list[str]:
    """index.pkl as a stream while the index fills; the files' names."""
    from langchain_community.docstore.in_memory import InMemoryDocstore
    from langchain_core.documents import Document as LangChainDocument

    with tempfile.TemporaryFile() as ids, out.join(DOCSTORE_FILE).open_write() as f:

        def documents() -> Iterator[tuple[str, Any]]:
            for docs in batches:
                for d in docs:
                    ids.write(d.id.encode("utf-8") + b"\n")
                    yield d.id, LangChainDocument(page_content=d.contents, metadata=d.metadata, id=d.id)

        def rows() -> Iterator[tuple[int, str]]:
            ids.seek(0)
            for i, line in enumerate(ids):
                yield i, line[:-1].decode("utf-8")

        pickler = pickle.Pickler(f, protocol=pickle.HIGHEST_PROTOCOL)
        pickler.fast = True  # no memo: nothing pickled is shared, and a memo would keep every document alive
        # (docstore, index_to_docstore_id): the docstore's documents are pickled (and the id file filled) first
        pickler.dump((_Reduce(InMemoryDocstore, (_Reduce(dict, items=documents()),)),
                      _Reduce(dict, items=rows())))
    return [DOCSTORE_FILE]


# --- the query side -------------------------------------------------------------------------------------------


@functools.cache
def _embeddings_class():
    from langchain_core.embeddings import Embeddings

    class WbragEmbeddings(Embeddings):
        """wbrag's embedder as LangChain Embeddings: the model's own prefixes, normalized vectors."""

        def __init__(self, embedder: Any):
            self.embedder = embedder

        def embed_documents(self, texts: list[str]) -> list[list[float]]:
            return self.embedder.encode_passages(list(texts)).tolist()

        def embed_query(self, text: str) -> list[float]:
            return self.embedder.encode_queries([text])[0].tolist()

    return WbragEmbeddings


def embeddings(model: Any):
    """LangChain `Embeddings` over wbrag's embedder (a name, an EmbedderConfig or a loaded Embedder)."""
    return _embeddings_class()(load_embedder(model))


def load(folder: str, model: Any = None):
    """The exported store as a LangChain FAISS store with inner product, with the export's embedder (or `model`);
    only for exports you made (a pickle)."""
    from langchain_community.vectorstores import FAISS
    from langchain_community.vectorstores.utils import DistanceStrategy

    return FAISS.load_local(folder, _embeddings_class()(load_embedder(model, folder)), index_name=INDEX_NAME,
                            allow_dangerous_deserialization=True, distance_strategy=DistanceStrategy.MAX_INNER_PRODUCT)
