"""The document store: written per ingest shard from the real ingest of the demo corpus, read by id through
memory maps, fetched per node from object storage; every id the ingest wrote is found with its own text."""

import os

import numpy as np
import pyarrow as pa
import pytest

from tests.conftest import demo_records, write_jsonl
from wbrag_ray.config import IngestConfig
from wbrag_ray.retrieval.docstore import LISTING, DocStore, DocStoreError, open_doc_store, write_doc_store
from wbrag_ray.stages.ingest import run_ingest
from wbrag_ray.storage import resolve


@pytest.fixture(scope="module")
def ingested(tmp_path_factory, ray_cluster):
    """The demo corpus ingested in several shards (small shard_bytes), so the store has several files."""
    root = tmp_path_factory.mktemp("docstore")
    corpus = write_jsonl(root / "c.jsonl", demo_records())
    run_ingest(str(corpus), str(root / "ingest"), IngestConfig(shard_bytes=8_000), max_in_flight=1)
    return root / "ingest"


def _expected(ingest, unit):
    passages = resolve(str(ingest / "passages")).read_table(["pid", "title", "text"])
    if unit == "passage":
        return {p: (t, x) for p, t, x in zip(*(passages[c].to_pylist() for c in ("pid", "title", "text")), strict=True)}
    titles = dict(zip(passages["pid"].to_pylist(), passages["title"].to_pylist(), strict=True))
    sentences = resolve(str(ingest / "sentences")).read_table(["sid", "pid", "text"])
    return {s: (titles[p], x) for s, p, x in zip(*(sentences[c].to_pylist() for c in ("sid", "pid", "text")),
                                                 strict=True)}


@pytest.mark.parametrize("unit", ["passage", "sentence"])
def test_every_ingested_unit_is_found_with_its_title_and_text(ingested, tmp_path, unit):
    out = resolve(str(tmp_path / unit))
    stats = write_doc_store(resolve(str(ingested)), unit, out, parallel=False)
    expected = _expected(ingested, unit)
    assert stats["rows_out"] == len(expected) and stats["files"] > 1
    store = DocStore(out)
    assert store.listing["count"] == len(expected)
    ids = np.array(list(expected), np.int64)
    np.random.default_rng(0).shuffle(ids)
    assert [store.get(int(i)) for i in ids] == [expected[int(i)] for i in ids]
    with pytest.raises(KeyError, match=f"document id {int(ids.max()) + 1} is in the index but not"):
        store.get(int(ids.max()) + 1)
    # each file is id-sorted Arrow IPC, uncompressed: what a memory map reads in place
    listing = out.join(LISTING).read_json()
    for f in listing["files"]:
        reader = pa.ipc.open_file(pa.memory_map(os.path.join(out.path, f["file"])))
        table = reader.read_all()
        assert table["id"].to_pylist() == sorted(table["id"].to_pylist())
        assert (f["id_min"], f["id_max"]) == (table["id"][0].as_py(), table["id"][-1].as_py())


def test_a_lookup_maps_only_the_file_it_needs_and_a_store_pickles_without_its_maps(ingested, tmp_path):
    import pickle

    out = resolve(str(tmp_path / "store"))
    write_doc_store(resolve(str(ingested)), "passage", out, parallel=False)
    store = DocStore(out)
    first = store.listing["files"][0]
    store.get(first["id_min"])
    assert list(store._open) == [first["file"]]
    copy = pickle.loads(pickle.dumps(store))
    assert copy._open == {} and copy.get(first["id_max"]) == store.get(first["id_max"])


def test_damaged_or_missing_store_files_are_named(ingested, tmp_path):
    out = resolve(str(tmp_path / "store"))
    write_doc_store(resolve(str(ingested)), "passage", out, parallel=False)
    files = DocStore(out).listing["files"]
    (tmp_path / "store" / files[0]["file"]).write_bytes(b"not arrow")
    os.remove(tmp_path / "store" / files[1]["file"])
    store = DocStore(out)
    with pytest.raises(DocStoreError, match=f"{files[0]['file']} is damaged"):
        store.get(files[0]["id_min"])
    with pytest.raises(DocStoreError, match=f"{files[1]['file']} named by .*docs.json is missing"):
        store.get(files[1]["id_min"])
    with pytest.raises(DocStoreError, match="no document store at"):
        DocStore(resolve(str(tmp_path / "nowhere")))


def test_a_store_on_object_storage_is_fetched_once_per_node_and_read_there(ingested, tmp_path, s3_env, monkeypatch):
    monkeypatch.setenv("WBRAG_CACHE", str(tmp_path / "cache"))
    remote = resolve("s3://wbrag/docstore-test")
    write_doc_store(resolve(str(ingested)), "sentence", remote, parallel=False)
    expected = _expected(ingested, "sentence")
    store = DocStore(resolve("s3://wbrag/docstore-test"))
    files = store.listing["files"]
    assert len(files) >= 3
    some = [files[0]["id_min"], files[0]["id_max"], files[-1]["id_min"]]  # in two of the files
    assert [store.get(i) for i in some] == [expected[i] for i in some]
    cache = tmp_path / "cache" / "docs"
    cached = {n: os.stat(cache / n).st_ino for n in os.listdir(cache) if not n.startswith(".")}  # .locks: node_cached
    # only the files the lookups touched, by the listing's id ranges: <key>-<file name>
    assert sorted(n.split("-", 1)[1] for n in cached) == sorted({files[0]["file"], files[-1]["file"]})
    assert DocStore(resolve("s3://wbrag/docstore-test")).get(some[0]) == expected[some[0]]
    again = {n: os.stat(cache / n).st_ino for n in os.listdir(cache) if not n.startswith(".")}
    assert again == cached  # the second reader fetched nothing: the same files, not rewritten


def test_open_doc_store_builds_a_store_from_a_source_once(ingested, tmp_path, monkeypatch):
    monkeypatch.setenv("WBRAG_CACHE", str(tmp_path / "cache"))
    a = open_doc_store(resolve(str(ingested)), "passage")
    b = open_doc_store(resolve(str(ingested)), "passage")
    assert a.uri == b.uri and len(os.listdir(tmp_path / "cache" / "docstores")) == 1
    assert open_doc_store(resolve(str(ingested)), "sentence").unit == "sentence"


def test_lookups_across_batches_and_id_pages_find_every_row_and_nothing_else(tmp_path):
    """Several record batches of several id pages each (sparse, unsorted input ids): every id is found, and an
    id between two stored ones is not."""
    import pyarrow.parquet as pq

    from wbrag_ray.retrieval import docstore

    rng = np.random.default_rng(1)
    ids = np.unique(rng.integers(0, 10**12, size=150_000)) * 2  # even ids only: every odd id is absent
    (tmp_path / "src").mkdir()
    order = rng.permutation(len(ids))
    pq.write_table(pa.table({"id": ids[order], "title": [f"t{i}" for i in ids[order]], "text": [f"x{i}" for i in ids[order]]}),
                   tmp_path / "src" / "docs.parquet")
    out = resolve(str(tmp_path / "store"))
    write_doc_store(resolve(str(tmp_path / "src")), "passage", out, parallel=False)
    store = DocStore(out)
    mapped = store._file(store.listing["files"][0]["file"])
    assert len(mapped.batches) == 3 and len(mapped.ids[0]) > 100 * docstore.SPARSE
    # the in-memory id sample comes from the file's footer (opening touches no page of the mapped ids)
    assert docstore.SAMPLE_KEY in mapped.reader.schema.metadata
    assert all(np.array_equal(s, i[:: docstore.SPARSE]) for s, i in zip(mapped.samples, mapped.ids, strict=True))
    probe = ids[rng.choice(len(ids), 3_000, replace=False)]
    assert [store.get(i) for i in probe] == [(f"t{i}", f"x{i}") for i in probe]
    assert store.get(int(ids[0])) == (f"t{ids[0]}", f"x{ids[0]}") and store.get(int(ids[-1]))[0] == f"t{ids[-1]}"
    for absent in (int(ids[500]) + 1, int(ids[0]) - 2, int(ids[-1]) + 2):
        with pytest.raises(KeyError):
            store.get(absent)
