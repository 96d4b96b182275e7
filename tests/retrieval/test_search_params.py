"""index.nprobe=auto: the rule, what it sets in faiss (nprobe, and the HNSW coarse quantizer's efSearch), and the
recall it gives against an exact search."""

from __future__ import annotations

import faiss
import numpy as np
import pytest

from wbrag_ray.index.search import auto_nprobe, set_search_params


@pytest.mark.parametrize("nlist, nprobe", [(8, 8), (32, 32), (1024, 32), (4096, 64), (65536, 256), (131072, 362)])
def test_auto_nprobe_visits_every_list_of_a_small_index_and_sqrt_nlist_of_a_large_one(nlist, nprobe):
    assert auto_nprobe(nlist) == nprobe


def test_auto_sets_nprobe_and_the_hnsw_quantizers_efsearch_from_the_list_count():
    index = faiss.index_factory(16, "IVF4096_HNSW32,Flat", faiss.METRIC_INNER_PRODUCT)
    set_search_params(index, "auto", None, None)
    ivf = faiss.extract_index_ivf(index)
    assert ivf.nprobe == 64 and faiss.downcast_index(ivf.quantizer).hnsw.efSearch == 128
    set_search_params(index, 8, 300, None)  # explicit values: nprobe as given, efSearch at least 2 x nprobe
    assert ivf.nprobe == 8 and faiss.downcast_index(ivf.quantizer).hnsw.efSearch == 300
    flat = faiss.index_factory(16, "Flat", faiss.METRIC_INNER_PRODUCT)
    set_search_params(flat, "auto", None, None)  # no lists: nothing to set, no error


def test_auto_recall_at_10_against_exact_search_on_queries_near_stored_vectors():
    """80,000 vectors around 400 topics (text embeddings cluster by topic) in 2,048 lists, about 39 each as the
    build trains them; 500 queries, each a stored vector plus noise (cosine about 0.8 to it): recall@10 of the
    stored vector, and of the exact top 10 (a Flat index over the same vectors)."""
    rng = np.random.default_rng(0)
    dim, n, topics = 64, 80_000, 400
    centers = rng.standard_normal((topics, dim)).astype(np.float32)
    centers /= np.linalg.norm(centers, axis=1, keepdims=True)
    x = centers[rng.integers(topics, size=n)] + rng.standard_normal((n, dim)).astype(np.float32) / np.sqrt(dim)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    source = rng.choice(n, 500, replace=False)
    q = x[source] + 0.75 / np.sqrt(dim) * rng.standard_normal((500, dim)).astype(np.float32)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    exact = faiss.IndexFlatIP(dim)
    exact.add(x)
    _, truth = exact.search(q, 10)
    index = faiss.index_factory(dim, "IVF2048_HNSW32,Flat", faiss.METRIC_INNER_PRODUCT)
    index.train(x)
    index.add(x)
    found = {}
    for nprobe in (4, "auto"):
        set_search_params(index, nprobe, None, None)
        found[nprobe] = index.search(q, 10)[1]
    assert faiss.extract_index_ivf(index).nprobe == 45
    nn_recall = {p: float(np.mean([s in row for s, row in zip(source, f, strict=True)])) for p, f in found.items()}
    top10 = {p: float(np.mean([len(set(t) & set(row)) / 10 for t, row in zip(truth, f, strict=True)]))
             for p, f in found.items()}
    assert nn_recall["auto"] >= 0.99 and top10["auto"] >= 0.95
    assert top10[4] < 0.9  # too few lists visited lose neighbours: the rule is what finds them
