"""Pruned views: rebuilt from the stored embedding shards, without the dropped ids, with no retraining."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.index.conftest import clustered, index_config, write_shards
from wbrag_ray.index.build import build_index
from wbrag_ray.index.files import IndexError_, load_manifest
from wbrag_ray.index.prune import drop_ids_ref, prune_index, scan_drop_ids
from wbrag_ray.ray_runtime import in_sorted
from wbrag_ray.retrieval.local import Retriever
from wbrag_ray.storage import resolve


@pytest.fixture
def full_index(tmp_path):
    vecs = clustered(2000, 16, clusters=10, seed=2)
    ids = write_shards(tmp_path / "emb", vecs, parts=4)
    build_index(resolve(str(tmp_path / "emb")), resolve(str(tmp_path / "full")), "m", "sentence",
                index_config("IVF8,Flat", num_shards=2, train_sample=2000), parallel=False)
    return tmp_path, vecs, ids


def test_pruned_view_holds_exactly_the_kept_ids(full_index, ray_cluster):
    tmp_path, vecs, ids = full_index
    drop = ids[np.random.default_rng(0).random(len(ids)) < 0.3]
    stats = prune_index(str(tmp_path / "full"), str(tmp_path / "pruned"), drop)
    assert stats["rows_out"] == len(ids) - len(drop) and stats["rows_dropped"] == len(drop)
    manifest = load_manifest(resolve(str(tmp_path / "pruned")))
    assert manifest["pruned_from"] == str(tmp_path / "full") and manifest["unit"] == "sentence"
    assert manifest["count"] == len(ids) - len(drop) and manifest["num_shards"] == 2
    # same trained index: no retraining
    assert (tmp_path / "pruned" / "trained.faiss").read_bytes() == (tmp_path / "full" / "trained.faiss").read_bytes()
    got = Retriever(str(tmp_path / "pruned"), nprobe=8).search_ids(vecs, 1)[1][:, 0]
    kept = ~np.isin(ids, drop)
    np.testing.assert_array_equal(got[kept], ids[kept])  # every kept vector finds itself
    assert not np.isin(got, drop).any()  # no dropped id is ever returned


def test_drop_ids_from_a_keep_mask_parquet(full_index, tmp_path):
    _, _, ids = full_index
    keep = np.arange(len(ids)) % 3 != 0
    (tmp_path / "mask").mkdir()
    pq.write_table(pa.table({"id": ids, "keep": keep}), tmp_path / "mask" / "part-0.parquet")
    np.testing.assert_array_equal(scan_drop_ids(resolve(str(tmp_path / "mask"))), np.sort(ids[~keep]))
    pq.write_table(pa.table({"id": ids[:5]}), tmp_path / "ids.parquet")
    np.testing.assert_array_equal(scan_drop_ids(resolve(str(tmp_path / "ids.parquet"))), ids[:5])
    pq.write_table(pa.table({"sid": ids[:5]}), tmp_path / "bad.parquet")
    with pytest.raises(IndexError_, match="bad.parquet has no 'id' column"):
        scan_drop_ids(resolve(str(tmp_path / "bad.parquet")))


def test_a_drop_set_in_the_object_store_prunes_as_the_array_does(full_index, tmp_path, ray_cluster):
    """The ids of a keep mask collected by a Ray task (the driver holds a reference and the count only), passed
    on to the add tasks: the same pruned index as the array in hand."""
    import ray

    root, vecs, ids = full_index
    keep = np.random.default_rng(1).random(len(ids)) >= 0.25
    (tmp_path / "mask").mkdir()
    for i, part in enumerate(np.array_split(np.arange(len(ids)), 3)):  # a keep mask in files of any order
        pq.write_table(pa.table({"id": ids[part][::-1], "keep": keep[part][::-1]}), tmp_path / "mask" / f"{i}.parquet")
    ref, count = drop_ids_ref(resolve(str(tmp_path / "mask")))
    assert isinstance(ref, ray.ObjectRef) and count == int((~keep).sum())
    np.testing.assert_array_equal(ray.get(ref), np.sort(ids[~keep]))
    by_ref = prune_index(str(root / "full"), str(tmp_path / "by-ref"), ref)
    by_array = prune_index(str(root / "full"), str(tmp_path / "by-array"), ids[~keep])
    assert by_ref["rows_out"] == by_array["rows_out"] == int(keep.sum()) and by_ref["rows_dropped"] == count
    for name in ("by-ref", "by-array"):
        found = Retriever(str(tmp_path / name), nprobe=8).search_ids(vecs, 1)[1][:, 0]
        np.testing.assert_array_equal(found[keep], ids[keep])


def test_in_sorted_is_membership_in_a_sorted_set():
    rng = np.random.default_rng(4)
    ids = np.unique(rng.integers(0, 5_000, 1_000))
    values = rng.integers(-10, 5_010, 3_000)
    np.testing.assert_array_equal(in_sorted(values, ids), np.isin(values, ids))
    assert not in_sorted(values, np.empty(0, np.int64)).any()
    assert in_sorted(ids[[0, -1]], ids).all()


def test_prune_names_a_missing_source(tmp_path):
    with pytest.raises(IndexError_, match="no index manifest at .*nowhere"):
        prune_index(str(tmp_path / "nowhere"), str(tmp_path / "out"), [1])
