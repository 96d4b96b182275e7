"""An index's search settings at query time: nprobe for an IVF, efSearch for an HNSW graph, k_factor for a
refine stage, and with `index.nprobe: auto` the setting the build measured (`index.recall`, the manifest's
`search` entry), or for an index built without a measurement the formula `auto_nprobe`."""

from __future__ import annotations

import math
from typing import Any


def auto_nprobe(nlist: int) -> int:
    """The formula for an index without a measured setting: every list of a small index (up to 32), sqrt(nlist)
    lists of a large one."""
    return max(min(nlist, 32), round(math.sqrt(nlist)))


def search_nprobe(index, nprobe: int | str | None) -> int | None:
    """The nprobe a search of `index` uses: `nprobe`, or for 'auto' the rule of `auto_nprobe` on the index's lists
    (None for an index that is not an IVF). Resolve a measured 'auto' first (`measured_settings`)."""
    import faiss

    if nprobe != "auto":
        return nprobe
    ivf = faiss.try_extract_index_ivf(index)
    return auto_nprobe(ivf.nlist) if ivf is not None else None


def measured_settings(manifest: dict[str, Any], nprobe: int | str | None,
                      ef_search: int | None) -> tuple[int | str | None, int | None]:
    """(nprobe, ef_search) for searching the index of `manifest`: `nprobe: auto` takes the nprobe its build chose
    by measured recall, an unset ef_search the efSearch it chose; settings given explicitly stay as they are, and
    so does 'auto' on an index built without a measured choice (the formula then applies)."""
    measured = manifest.get("search") or {}
    if not measured.get("chosen"):
        return nprobe, ef_search
    if nprobe == "auto" and measured.get("parameter") == "nprobe":
        nprobe = int(measured["value"])
    if ef_search is None and measured.get("parameter") == "efSearch":
        ef_search = int(measured["value"])
    return nprobe, ef_search


def set_search_params(index, nprobe: int | str | None, ef_search: int | None, k_factor: float | None) -> None:
    """Apply the settings that exist for this index type (IVF: nprobe, HNSW: efSearch, refine: k_factor);
    the others do not apply and are skipped. `nprobe` may be 'auto' (`search_nprobe`); an IVF's HNSW coarse
    quantizer searches with efSearch = max(2 x nprobe, ef_search): faiss's default (16) finds too few of the
    nearest lists once nprobe passes it."""
    import faiss

    nprobe = search_nprobe(index, nprobe)
    ivf = faiss.try_extract_index_ivf(index)
    if ivf is not None and nprobe is not None:
        quantizer = faiss.downcast_index(ivf.quantizer)
        if isinstance(quantizer, faiss.IndexHNSW):
            quantizer.hnsw.efSearch = max(2 * min(nprobe, ivf.nlist), ef_search or 0)
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
