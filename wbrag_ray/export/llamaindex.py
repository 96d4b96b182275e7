"""LlamaIndex: a persisted storage folder `load_index_from_storage` reads as a VectorStoreIndex over a
`FaissVectorStore` (row i = node i), its JSON written as streams in the library's layout; `load` and
`embed_model` give the query side."""

from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

from wbrag_ray.config import WbragConfig
from wbrag_ray.export.embedder import load_embedder
from wbrag_ray.export.view import METADATA_KEYS, Document, View
from wbrag_ray.storage import Location

INDEX_FILE = "default__vector_store.json"  # the FAISS vector store
DOCSTORE_FILE = "docstore.json"
INDEX_STORE_FILE = "index_store.json"
EMPTY_FILES = {"graph_store.json": {"graph_dict": {}},
               "image__vector_store.json": {"embedding_dict": {}, "text_id_to_ref_doc_id": {}, "metadata_dict": {}}}
INDEX_ID = "wbrag"
# The key-value collections of SimpleDocumentStore and SimpleIndexStore (namespace + suffix)
NODES, NODE_METADATA, INDEX_STRUCTS = "docstore/data", "docstore/metadata", "index_store/data"
CHUNK = 1 << 20
# what `wbrag export` checks is importable before it writes a file, and the packages that hold it
NEEDS = ("llama_index.core", "llama_index.vector_stores.faiss")
PACKAGES = "llama-index-core and llama-index-vector-stores-faiss"


def write(view: View, batches: Iterator[list[Document]], out: Location, config: WbragConfig) -> list[str]:
    """Write docstore.json while the index fills, then the index and empty stores; returns the names."""
    from llama_index.core.schema import TextNode
    from llama_index.core.storage.docstore.utils import doc_to_json

    hidden = list(METADATA_KEYS)
    with tempfile.TemporaryDirectory() as tmp:
        hashes_path, rows_path = os.path.join(tmp, "hashes"), os.path.join(tmp, "rows")
        with out.join(DOCSTORE_FILE).open_write() as f, open(hashes_path, "w") as hashes, open(rows_path, "w") as rows:
            f.write(f"{{{json.dumps(NODES)}: {{".encode())
            row = 0
            for docs in batches:
                entries = []
                for d in docs:
                    node = TextNode(id_=d.id, text=d.contents, metadata=d.metadata,
                                    excluded_embed_metadata_keys=hidden, excluded_llm_metadata_keys=hidden)
                    sep = ", " if row else ""
                    key = json.dumps(d.id)
                    entries.append(f"{sep}{key}: {json.dumps(doc_to_json(node), ensure_ascii=False)}")
                    hashes.write(f"{sep}{key}: {json.dumps({'doc_hash': node.hash})}")
                    rows.write(f"{sep}{json.dumps(str(row))}: {key}")
                    row += 1
                f.write("".join(entries).encode("utf-8"))
            hashes.close()
            f.write(f"}}, {json.dumps(NODE_METADATA)}: {{".encode())
            with open(hashes_path, "rb") as src:
                shutil.copyfileobj(src, f, CHUNK)
            f.write(b"}}")
        _write_index_store(out.join(INDEX_STORE_FILE), rows_path)
    for name, content in EMPTY_FILES.items():
        out.join(name).write_bytes(json.dumps(content).encode())
    return [DOCSTORE_FILE, INDEX_STORE_FILE, *EMPTY_FILES]


def _write_index_store(loc: Location, rows_path: str) -> None:
    """The index store, whose IndexDict is JSON text inside JSON: the row -> node map is escaped piece by piece."""
    from llama_index.core.constants import DATA_KEY, TYPE_KEY
    from llama_index.core.data_structs.data_structs import IndexDict

    struct = IndexDict(index_id=INDEX_ID)
    placeholder = "@@nodes@@"
    head, tail = json.dumps({**struct.to_dict(), "nodes_dict": placeholder}).split(json.dumps(placeholder))
    with loc.open_write() as f, open(rows_path, encoding="utf-8") as rows:
        f.write(f'{{{json.dumps(INDEX_STRUCTS)}: {{{json.dumps(INDEX_ID)}: '
                f'{{{json.dumps(TYPE_KEY)}: {json.dumps(struct.get_type())}, {json.dumps(DATA_KEY)}: "'.encode())
        for piece in (head + "{", *iter(lambda: rows.read(CHUNK), ""), "}" + tail):
            f.write(json.dumps(piece)[1:-1].encode())  # escaping is per character: pieces escape as the whole would
        f.write(b'"}}}')


# --- the query side -------------------------------------------------------------------------------------------


@functools.cache
def _embedding_class():
    from llama_index.core.bridge.pydantic import PrivateAttr
    from llama_index.core.embeddings import BaseEmbedding

    class WbragEmbedding(BaseEmbedding):
        """wbrag's embedder as a LlamaIndex embed model: the model's own prefixes, normalized vectors."""

        _embedder: Any = PrivateAttr()

        def __init__(self, embedder: Any, **kwargs: Any):
            super().__init__(model_name=embedder.name, **kwargs)
            self._embedder = embedder

        @classmethod
        def class_name(cls) -> str:
            return "WbragEmbedding"

        def _get_query_embedding(self, query: str) -> list[float]:
            return self._embedder.encode_queries([query])[0].tolist()

        async def _aget_query_embedding(self, query: str) -> list[float]:
            return self._get_query_embedding(query)

        def _get_text_embedding(self, text: str) -> list[float]:
            return self._embedder.encode_passages([text])[0].tolist()

        def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
            return self._embedder.encode_passages(list(texts)).tolist()

    return WbragEmbedding


def embed_model(model: Any):
    """A LlamaIndex embed model over wbrag's embedder (a name, an EmbedderConfig or a loaded Embedder)."""
    return _embedding_class()(load_embedder(model))


def load(folder: str, model: Any = None):
    """The exported folder as a LlamaIndex VectorStoreIndex, with the export's embedder (or `model`)."""
    from llama_index.core import StorageContext, load_index_from_storage
    from llama_index.vector_stores.faiss import FaissVectorStore

    context = StorageContext.from_defaults(vector_store=FaissVectorStore.from_persist_dir(folder), persist_dir=folder)
    return load_index_from_storage(context, embed_model=_embedding_class()(load_embedder(model, folder)))
