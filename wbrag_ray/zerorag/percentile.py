"""The corpus-wide percentile of predicted mastery from two-level histograms (only counts travel), and the
keep mask it gives (ties in the last sub-bin dropped by a draw fixed by id)."""

from __future__ import annotations

from typing import Any

import numpy as np

from wbrag_ray.ray_runtime import LIGHT_CPUS
from wbrag_ray.storage import Location, resolve
from wbrag_ray.zerorag.sampling import splitmix64


def _bins(scores: np.ndarray, bins: int) -> tuple[np.ndarray, np.ndarray]:
    """Two-level integer bin indices of scores in [0, 1], so histogram and keep mask agree exactly."""
    x = np.clip(np.asarray(scores, np.float64), 0.0, 1.0) * bins
    b1 = np.minimum(x.astype(np.int64), bins - 1)
    b2 = np.minimum(((x - b1) * bins).astype(np.int64), bins - 1)
    return b1, b2


def _tie_draw(ids: np.ndarray) -> np.ndarray:
    """A uniform number in [0, 1) per id, fixed by the id: which of the sentences tied at the cut are dropped."""
    return (splitmix64(ids, 0x5EED) >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def percentile_cut(pred: Location, ratio: float, bins: int) -> dict[str, Any]:
    """Where to cut so that `ratio` of all sentences (those with the highest predicted mastery) are dropped."""
    import ray

    files = [f.uri for f in pred.list_files(".parquet")]

    @ray.remote(num_cpus=LIGHT_CPUS)
    def histogram(uri: str, level1_bin: int | None) -> np.ndarray:
        scores = resolve(uri).read_table(["mastery_pred"])["mastery_pred"].to_numpy()
        b1, b2 = _bins(scores, bins)
        if level1_bin is None:
            return np.bincount(b1, minlength=bins)
        return np.bincount(b2[b1 == level1_bin], minlength=bins)

    level1 = np.sum(ray.get([histogram.remote(f, None) for f in files]), axis=0)
    total = int(level1.sum())
    target = int(round(ratio * total))
    if target == 0:
        return {"total": total, "target_dropped": 0, "b1": bins, "b2": 0, "tie_fraction": 0.0, "threshold": 1.0}
    b1, need = _cut_bin(level1, target)
    level2 = np.sum(ray.get([histogram.remote(f, b1) for f in files]), axis=0)
    b2, need2 = _cut_bin(level2, need)
    return {"total": total, "target_dropped": target, "b1": b1, "b2": b2,
            "tie_fraction": need2 / int(level2[b2]), "threshold": (b1 + b2 / bins) / bins}


def _cut_bin(counts: np.ndarray, drop: int) -> tuple[int, int]:
    """(the bin where dropping the top `drop` items ends, how many of that bin's items are still to drop)."""
    above = np.cumsum(counts[::-1])[::-1]  # above[i] = items in bins >= i
    b = int(np.flatnonzero(above >= drop)[-1])
    return b, drop - (int(above[b + 1]) if b + 1 < len(counts) else 0)


def keep_mask(ids: np.ndarray, scores: np.ndarray, cut: dict[str, Any], bins: int) -> np.ndarray:
    """True for sentences kept at `cut`: everything below the cut's sub-bin, and the undrawn ties in it."""
    b1, b2 = _bins(scores, bins)
    drop = (b1 > cut["b1"]) | ((b1 == cut["b1"]) & (b2 > cut["b2"]))
    tied = (b1 == cut["b1"]) & (b2 == cut["b2"])
    drop |= tied & (_tie_draw(ids) < cut["tie_fraction"])
    return ~drop
