"""The embedding pruner head and the validation metrics of both pruners."""

import numpy as np

from wbrag_ray.models.pruner import EmbeddingHead, pruner_metrics, top_quantile_overlap


def _data(n: int, seed: int):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 32)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    w = np.random.default_rng(99).standard_normal(32)
    y = 1 / (1 + np.exp(-4 * x @ w))
    return x, y


def test_head_learns_a_mastery_signal_and_round_trips(tmp_path):
    x, y = _data(600, 0)
    xv, yv = _data(200, 1)
    head, losses = EmbeddingHead.train(x, y, hidden=16, epochs=300, lr=1e-2)
    pred = head.predict(xv)
    assert pred.dtype == np.float32 and ((pred >= 0) & (pred <= 1)).all()
    m = pruner_metrics(yv, pred, 0.3)
    assert m["spearman"] > 0.8 and m["mse"] < m["mse_predict_mean"] / 2 and losses[-1] < losses[0]
    head.save(tmp_path, {"dim": 32})
    np.testing.assert_array_equal(EmbeddingHead.load(tmp_path).predict(xv), pred)


def test_top_quantile_overlap_counts_ties_in_the_measured_top():
    measured = np.array([0, 0, 0, 0, 1, 1, 1, 0.5, 0.5, 0])
    perfect = top_quantile_overlap(measured, measured + np.linspace(0, 0.01, 10), 0.3)
    assert perfect["precision"] == 1.0 and perfect["recall"] == 1.0
    backwards = top_quantile_overlap(measured, -measured, 0.3)
    assert backwards["precision"] == 0.0
