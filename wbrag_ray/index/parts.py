"""Add parts: what one add task writes and a merge task reads into an index shard. An IVF's part is ids and
standalone codes (`sa_encode`), without the quantizer, appended to the lists in part order (the same index as
adding the vectors); other mergeable types write a whole index merged with `merge_from`."""

from __future__ import annotations

import zipfile

import numpy as np

from wbrag_ray.index.files import IndexError_, read_index_file
from wbrag_ray.storage import Location

CODES_SUFFIX = ".codes.npz"
INDEX_SUFFIX = ".faiss"


def codes_index(index):
    """The index that holds `index`'s standalone codes (itself, or the one behind its pre-transform) where it takes
    them (flat and IVF; not HNSW); None otherwise."""
    import faiss

    outer = faiss.downcast_index(index)
    inner = faiss.downcast_index(outer.index) if isinstance(outer, faiss.IndexPreTransform) else outer
    return inner if isinstance(inner, faiss.IndexIVF | faiss.IndexFlatCodes) else None


def code_part_ivf(index):
    """The IVF whose array lists a codes-only part fills (bare, or behind a pre-transform); None otherwise."""
    import faiss

    inner = codes_index(index)
    if not isinstance(inner, faiss.IndexIVF) or isinstance(inner, faiss.IndexIVFFastScan):
        return None
    if not isinstance(faiss.downcast_InvertedLists(inner.invlists), faiss.ArrayInvertedLists):
        return None
    return inner


def write_code_part(f: Location, ids: np.ndarray, codes: np.ndarray) -> int:
    """Write a codes-only part; returns the bytes written."""
    with f.open_write() as stream:
        np.savez(stream, ids=ids.astype(np.int64, copy=False), codes=codes)
        return stream.tell()


def read_code_part(f: Location) -> tuple[np.ndarray, np.ndarray]:
    """(ids, codes) of a codes-only part; a missing or unreadable file is named in the error."""
    if not f.exists():
        raise IndexError_(f"index part {f.uri} is missing")
    try:
        with f.fs.open_input_file(f.path) as stream, np.load(stream) as data:
            return data["ids"], data["codes"]
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:
        raise IndexError_(f"index part {f.uri} is corrupt: {exc}") from None


def add_codes(index, inner, codes: np.ndarray, ids: np.ndarray | None = None) -> None:
    """Append standalone codes (`sa_encode` of the same trained index) to `inner` (`codes_index` of `index`), keeping
    `index.ntotal` true (a pre-transform wrapper counts its own vectors); no ids: the next rows."""
    rows = len(codes) if ids is None else len(ids)
    if codes.ndim != 2 or codes.shape[1] != index.sa_code_size() or len(codes) != rows:
        raise IndexError_(f"a part's codes have shape {codes.shape} for {rows} ids; the index codes "
                          f"{index.sa_code_size()} bytes per vector")
    inner.add_sa_codes(np.ascontiguousarray(codes), ids)
    index.ntotal = inner.ntotal


def merge_parts(trained: Location, parts: list[Location]):
    """One index shard from its parts, one part in memory at a time besides the shard."""
    if parts and parts[0].name.endswith(CODES_SUFFIX):
        index = read_index_file(trained)
        ivf = code_part_ivf(index)
        if ivf is None:
            raise IndexError_(f"the trained index {trained.uri} has no plain IVF lists for the parts {parts[0].uri}")
        for f in parts:
            ids, codes = read_code_part(f)
            add_codes(index, ivf, codes, ids)
            del ids, codes
        return index
    index = read_index_file(parts[0])
    for f in parts[1:]:
        other = read_index_file(f)
        index.merge_from(other, 0)
        del other
    return index

