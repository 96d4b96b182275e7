"""The export's one FAISS index (row i = document i): codes made in the shards' tasks, appended in order."""

from __future__ import annotations

import numpy as np

from wbrag_ray.index.files import TRAINED_FILE, from_bytes
from wbrag_ray.storage import Location


def encoder(trained: bytes):
    """The trained empty index's standalone encoder: vectors -> the codes `index.parts.add_codes` appends."""
    index = from_bytes(trained, TRAINED_FILE)
    return lambda vectors: index.sa_encode(np.ascontiguousarray(vectors, dtype=np.float32))


def write_index(index, loc: Location) -> None:
    """Write a faiss index to a file (local or s3://) in pieces, not through one serialized copy in memory."""
    import faiss

    with loc.open_write() as f:
        writer = faiss.PyCallbackIOWriter(f.write)
        faiss.write_index(index, writer)
        del writer  # flushes before the stream closes
