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


def code_part_ivf(index):
    """The IVF whose array lists a codes-only part fills (bare, or behind a pre-transform); None otherwise."""
    import faiss

    outer = faiss.downcast_index(index)
    inner = faiss.downcast_index(outer.index) if isinstance(outer, faiss.IndexPreTransform) else outer
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


def add_codes(index, ivf, ids: np.ndarray, codes: np.ndarray) -> None:
    """Append standalone codes to the lists of `ivf` (the IVF inside `index`), keeping `index.ntotal` true."""
    if codes.ndim != 2 or codes.shape[1] != index.sa_code_size() or len(codes) != len(ids):
        raise IndexError_(f"a part's codes have shape {codes.shape} for {len(ids)} ids; the index codes "
                          f"{index.sa_code_size()} bytes per vector")
    ivf.add_sa_codes(np.ascontiguousarray(codes), np.ascontiguousarray(ids, dtype=np.int64))
    index.ntotal = ivf.ntotal  # a pre-transform wrapper counts its own vectors


def merge_parts(trained: Location, parts: list[Location]):
    """One index shard from its parts, one part in memory at a time besides the shard."""
    if parts and parts[0].name.endswith(CODES_SUFFIX):
        index = read_index_file(trained)
        ivf = code_part_ivf(index)
        if ivf is None:
            raise IndexError_(f"the trained index {trained.uri} has no plain IVF lists for the parts {parts[0].uri}")
        for f in parts:
            ids, codes = read_code_part(f)
            add_codes(index, ivf, ids, codes)
            del ids, codes
        return index
    index = read_index_file(parts[0])
    for f in parts[1:]:
        other = read_index_file(f)
        index.merge_from(other, 0)
        del other
    return index

