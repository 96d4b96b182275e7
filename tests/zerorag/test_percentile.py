"""Zero-RAG's corpus-wide percentile: computed from per-file histograms in Ray tasks (only counts travel), it
drops the requested fraction of sentences, the most mastered ones, even when many scores are tied."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from wbrag_ray.storage import resolve
from wbrag_ray.zerorag.prune import keep_mask, percentile_cut


def _write_predictions(folder, scores: np.ndarray, parts: int) -> np.ndarray:
    folder.mkdir()
    ids = np.arange(len(scores), dtype=np.int64) * 7 + 3
    for i, (a, b) in enumerate(zip(*(lambda e: (e[:-1], e[1:]))(np.linspace(0, len(scores), parts + 1).astype(int)),
                                   strict=True)):
        pq.write_table(pa.table({"sid": ids[a:b], "mastery_pred": scores[a:b].astype(np.float32)}),
                       folder / f"pred-{i}.parquet")
    return ids


@pytest.mark.parametrize("kind", ["continuous", "tied", "coarse"])
@pytest.mark.parametrize("ratio", [0.3, 0.5, 0.7])
def test_percentile_drops_the_requested_fraction_of_the_most_mastered(tmp_path, ray_cluster, kind, ratio):
    rng = np.random.default_rng(1)
    n = 20_000
    scores = {
        "continuous": rng.beta(2, 5, n),
        # a third of the corpus at exactly one value, straddling the cut: decided by the per-id draw
        "tied": np.where(rng.random(n) < 0.35, 0.25, rng.random(n)),
        "coarse": rng.integers(0, 4, n) / 3,  # what a mean of three 0/1 EMs looks like
    }[kind]
    ids = _write_predictions(tmp_path / "pred", scores, parts=5)
    cut = percentile_cut(resolve(str(tmp_path / "pred")), ratio, bins=256)
    assert cut["total"] == n and cut["target_dropped"] == round(ratio * n)
    keep = keep_mask(ids, scores.astype(np.float32), cut, 256)
    achieved = 1 - keep.mean()
    assert abs(achieved - ratio) <= 0.005, achieved
    # the dropped sentences are the most mastered: none scores below a kept one (ties aside)
    assert scores[~keep].min() >= scores[keep].max() - 1 / 256**2
    # the mask is a pure function of (id, score): the same on any node, in any order
    perm = np.random.default_rng(2).permutation(n)
    np.testing.assert_array_equal(keep_mask(ids[perm], scores[perm].astype(np.float32), cut, 256), keep[perm])
