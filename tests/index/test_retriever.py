"""Search across shards and the union of a base and a write-back index: order by score, separate namespaces."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.index.conftest import clustered, index_config, write_shards
from wbrag_ray.index.build import build_index
from wbrag_ray.index.files import IndexError_
from wbrag_ray.retrieval.docstore import DocStoreError, open_doc_store
from wbrag_ray.retrieval.hits import Hit, merge_results
from wbrag_ray.retrieval.local import IndexUnion, Retriever
from wbrag_ray.retrieval.union import UnionRule
from wbrag_ray.storage import resolve


def _index(tmp_path, name, vecs, ids, embedder="m", docs=None):
    write_shards(tmp_path / f"{name}-emb", vecs, ids=ids, parts=2)
    build_index(resolve(str(tmp_path / f"{name}-emb")), resolve(str(tmp_path / name)), embedder, "passage",
                index_config("Flat", num_shards=2), parallel=False, docs=docs)
    return str(tmp_path / name)


def _docs(folder, ids, prefix):
    folder.mkdir(parents=True)
    pq.write_table(pa.table({"id": pa.array(ids, pa.int64()), "title": [f"{prefix} {i}" for i in ids],
                             "text": [f"{prefix} text {i}" for i in ids]}), folder / "units.parquet")
    return str(folder)


def test_union_orders_by_score_and_keeps_namespaces_apart(tmp_path):
    vecs = clustered(400, 16, seed=1)
    # both indices number their documents 0..n-1: the same id means different documents
    base = _index(tmp_path, "base", vecs[:300], np.arange(300, dtype=np.int64),
                  docs=_docs(tmp_path / "base-docs", range(300), "base"))
    wb = _index(tmp_path, "wb", vecs[300:], np.arange(100, dtype=np.int64),
                docs=_docs(tmp_path / "wb-docs", range(100), "unit"))
    union = IndexUnion([Retriever(base), Retriever(wb, source="writeback")], UnionRule("score"))  # the paper's
    q = vecs[[5, 310, 320]]  # exact matches: base 5, write-back units 10 and 20
    results = union.search_vectors(q, 8)
    for hits in results:
        assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
        assert [h.rank for h in hits] == list(range(8))
        assert len({h.key for h in hits}) == 8
        for h in hits:  # each hit's document comes from its own index's store
            assert h.title == f"{'base' if h.source == 'base' else 'unit'} {h.id}"
    assert results[0][0].key == ("base", 5)
    assert results[1][0].key == ("writeback", 10) and results[2][0].key == ("writeback", 20)
    # the union is exactly the top 8 of all 400 scores
    all_scores = np.sort(q @ vecs.T, axis=1)[:, ::-1][:, :8]
    np.testing.assert_allclose([[h.score for h in hits] for hits in results], all_scores, rtol=1e-5)


def test_union_refuses_incomparable_indices_and_shared_sources(tmp_path):
    vecs = clustered(100, 16)
    a = _index(tmp_path, "a", vecs, None)
    b = _index(tmp_path, "b", vecs, None, embedder="another-model")
    with pytest.raises(ValueError, match="distinct sources"):
        IndexUnion([Retriever(a), Retriever(b)])
    with pytest.raises(IndexError_, match="differ in embedder .*'m' vs 'another-model'"):
        IndexUnion([Retriever(a), Retriever(b, source="writeback")])


def test_wrong_dimension_queries_are_named(tmp_path):
    idx = _index(tmp_path, "a", clustered(100, 16), None)
    with pytest.raises(IndexError_, match=r"shape \(3, 8\); the index .* expects \(n, 16\)"):
        Retriever(idx).search_vectors(np.zeros((3, 8), np.float32), 2)


def test_docstore_reads_a_plain_parquet_folder_and_names_a_bad_one(tmp_path, monkeypatch):
    monkeypatch.setenv("WBRAG_CACHE", str(tmp_path / "cache"))  # the store built from the folder goes there
    store = open_doc_store(resolve(_docs(tmp_path / "docs", [3, 1, 2], "unit")))
    assert store.get(2) == ("unit 2", "unit text 2")
    with pytest.raises(KeyError, match="document id 9"):
        store.get(9)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DocStoreError, match="no documents at .*empty"):
        open_doc_store(resolve(str(tmp_path / "empty")))


def test_merge_results_and_short_shards(tmp_path):
    scores = np.array([[0.1, 0.9, 0.5, -np.inf]], np.float32)
    assert merge_results([(scores, np.array([[0, 1, 2, 3]]))], 3)[1].tolist() == [[1, 2, 0]]
    idx = _index(tmp_path, "a", clustered(3, 8), None)  # fewer vectors than k: no -1 ids in the hits
    hits = Retriever(idx).search_vectors(clustered(1, 8, seed=9), 5)[0]
    assert len(hits) == 3 and all(isinstance(h, Hit) and h.id >= 0 for h in hits)
