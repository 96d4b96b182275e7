"""The export's one FAISS index (row i = document i): codes made in the shards' tasks, appended in order."""

from __future__ import annotations

import numpy as np

from wbrag_ray.index.files import TRAINED_FILE, from_bytes
from wbrag_ray.storage import Location


def encoder(trained: bytes):
    """The trained empty index's standalone encoder: vectors -> the codes `add_codes` appends."""
    index = from_bytes(trained, TRAINED_FILE)
    return lambda vectors: index.sa_encode(np.ascontiguousarray(vectors, dtype=np.float32))


def adds_codes(index) -> bool:
    """Whether `index` takes standalone codes (flat and IVF, behind a transform or not; not HNSW)."""
    import faiss

    inner = faiss.downcast_index(index)
    if isinstance(inner, faiss.IndexPreTransform):
        inner = faiss.downcast_index(inner.index)
    return isinstance(inner, faiss.IndexIVF | faiss.IndexFlatCodes)


def add_codes(index, codes: np.ndarray) -> None:
    """Append `codes` (`sa_encode` of the same trained index) as the next rows of `index`."""
    import faiss

    index = faiss.downcast_index(index)
    if isinstance(index, faiss.IndexPreTransform):  # the codes were made after the transform: the inner index's
        inner = faiss.downcast_index(index.index)
        inner.add_sa_codes(codes)
        index.ntotal = inner.ntotal
    else:
        index.add_sa_codes(codes)



def write_index(index, loc: Location) -> None:
    """Write a faiss index to a file (local or s3://) in pieces, not through one serialized copy in memory."""
    import faiss

    with loc.open_write() as f:
        writer = faiss.PyCallbackIOWriter(f.write)
        faiss.write_index(index, writer)
        del writer  # flushes before the stream closes
