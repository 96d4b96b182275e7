"""Index build from embedding shards, search correctness, and clear errors on bad index files."""

import numpy as np
import pyarrow.parquet as pq
import pytest

from wbrag_ray.config import EmbedderConfig
from wbrag_ray.formats import embeddings_table
from wbrag_ray.index.faiss_index import IndexError_, build_index, load_index
from wbrag_ray.index.retriever import DocStore, Retriever
from wbrag_ray.storage import resolve


def _shards(folder, n=600, dim=32, parts=3, seed=0):
    rng = np.random.default_rng(seed)
    vecs = rng.normal(size=(n, dim)).astype(np.float32)
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    ids = (np.arange(n, dtype=np.int64) * 1000) + 7  # sparse ids, as ingest makes them
    folder.mkdir(parents=True)
    for k, (i, v) in enumerate(zip(np.array_split(ids, parts), np.array_split(vecs, parts), strict=True)):
        pq.write_table(embeddings_table(i, v), folder / f"emb-{k:06d}.parquet")
    return ids, vecs


@pytest.mark.parametrize("factory", ["Flat", "IVF8,Flat", "HNSW16"])
def test_build_streams_shards_and_search_matches_exact(tmp_path, factory):
    ids, vecs = _shards(tmp_path / "emb")
    stats = build_index(resolve(str(tmp_path / "emb")), resolve(str(tmp_path / "idx")), factory, "m", "passage", 500)
    assert stats["rows_out"] == len(ids)
    index, manifest = load_index(resolve(str(tmp_path / "idx")))
    assert manifest["count"] == 600 and manifest["dim"] == 32 and manifest["factory"] == factory
    assert (manifest["id_min"], manifest["id_max"]) == (int(ids.min()), int(ids.max()))
    if factory.startswith("IVF"):
        import faiss

        faiss.extract_index_ivf(index).nprobe = 8  # all cells: exact
    q = vecs[:20]
    _, got = index.search(q, 5)
    want = ids[np.argsort(-(q @ vecs.T), axis=1)[:, :5]]
    recall = np.mean([len(set(g) & set(w)) / 5 for g, w in zip(got, want, strict=True)])
    assert recall >= (1.0 if factory != "HNSW16" else 0.9)


def test_bad_index_files_name_the_file(tmp_path):
    _shards(tmp_path / "emb")
    build_index(resolve(str(tmp_path / "emb")), resolve(str(tmp_path / "idx")), "Flat", "m", "passage")
    (tmp_path / "idx" / "index.faiss").write_bytes(b"not an index")
    with pytest.raises(IndexError_, match="index.faiss is corrupt"):
        load_index(resolve(str(tmp_path / "idx")))
    (tmp_path / "idx" / "index.faiss").unlink()
    with pytest.raises(IndexError_, match="index.faiss.*missing"):
        load_index(resolve(str(tmp_path / "idx")))
    with pytest.raises(IndexError_, match="no index manifest"):
        load_index(resolve(str(tmp_path / "nowhere")))
    (tmp_path / "emb" / "emb-000001.parquet").write_bytes(b"garbage")
    with pytest.raises(IndexError_, match="emb-000001.parquet is unreadable"):
        build_index(resolve(str(tmp_path / "emb")), resolve(str(tmp_path / "idx2")), "Flat", "m", "passage")


def test_bad_factory_string_is_a_clear_error(tmp_path):
    _shards(tmp_path / "emb")
    with pytest.raises(ValueError, match="not a valid faiss factory"):
        build_index(resolve(str(tmp_path / "emb")), resolve(str(tmp_path / "idx")), "IVF,Bogus", "m", "passage")


def test_retriever_checks_embedder_and_query_dimension(tmp_path, ray_cluster):
    from tests.conftest import demo_records, write_jsonl
    from wbrag_ray.config import IngestConfig
    from wbrag_ray.stages.ingest import run_ingest

    corpus = write_jsonl(tmp_path / "c.jsonl", demo_records(10))
    run_ingest(str(corpus), str(tmp_path / "ingest"), IngestConfig())
    docs = DocStore(resolve(str(tmp_path / "ingest")), "passage")
    ids = np.asarray(docs.ids)
    rng = np.random.default_rng(0)
    vecs = rng.normal(size=(len(ids), 384)).astype(np.float32)
    (tmp_path / "emb").mkdir()
    pq.write_table(embeddings_table(ids, vecs), tmp_path / "emb" / "emb-000000.parquet")
    build_index(resolve(str(tmp_path / "emb")), resolve(str(tmp_path / "idx")), "Flat", "other-embedder", "passage")
    r = Retriever(str(tmp_path / "idx"), str(tmp_path / "ingest"), EmbedderConfig())
    with pytest.raises(IndexError_, match="built with embedder 'other-embedder'"):
        r.setup()
    build_index(resolve(str(tmp_path / "emb")), resolve(str(tmp_path / "idx")), "Flat", EmbedderConfig().model, "passage")
    r = Retriever(str(tmp_path / "idx"), str(tmp_path / "ingest"), EmbedderConfig())
    with pytest.raises(IndexError_, match=r"shape \(2, 16\).*\(n, 384\)"):
        r.search_vectors(np.zeros((2, 16), np.float32), 3)
    hits = r.search_vectors(vecs[:1], 3)[0]
    assert hits[0].id == ids[0] and hits[0].title and hits[0].source == "base"
