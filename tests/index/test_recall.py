"""The index's search setting measured at build time (`index.recall`): the nprobe (or efSearch) chosen reaches
index.target_recall of exact search, the one before it does not, both checked here against a numpy brute-force
search of other stored vectors than the build sampled; searches with `nprobe: auto` take it."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from tests.index.conftest import clustered, index_config, write_shards
from wbrag_ray.index.build import build_index
from wbrag_ray.index.files import load_manifest
from wbrag_ray.index.recall import RECALL_K, choose, levelled, nprobe_steps, without
from wbrag_ray.index.search import measured_settings
from wbrag_ray.retrieval.local import Retriever
from wbrag_ray.storage import resolve


def brute_force_recall(index_dir, vecs: np.ndarray, ids: np.ndarray, nprobe=None, ef_search=None,
                       n: int = 300, seed: int = 11) -> float:
    """recall@10 of stored vectors (other than the build's sample: another seed) as queries, neighbours other
    than themselves, against numpy's exact inner product: a reference the build did not produce."""
    rows = np.random.default_rng(seed).choice(len(vecs), n, replace=False)
    truth = ids[np.argsort(-(vecs[rows] @ vecs.T), axis=1, kind="stable")[:, 1:RECALL_K + 1]]
    shards = Retriever(str(index_dir), nprobe=nprobe, ef_search=ef_search, gpu=False).searcher.shards
    found = [shard.search(vecs[rows], RECALL_K + 1) for shard in shards]
    scores = np.concatenate([s for s, _ in found], axis=1)
    got = np.take_along_axis(np.concatenate([i for _, i in found], axis=1), np.argsort(-scores, axis=1), axis=1)
    got = without(got[:, :RECALL_K + 1], ids[rows], RECALL_K)
    return float(np.mean([len(set(g) & set(t)) / RECALL_K for g, t in zip(got, truth, strict=True)]))


@pytest.fixture(scope="module")
def clustered_shards(tmp_path_factory):
    """12,000 vectors around 2,000 topics, more than the index's lists: a vector's neighbours span several lists."""
    vecs = clustered(12_000, 32, clusters=2_000, seed=3, spread=0.5)
    folder = tmp_path_factory.mktemp("recall") / "emb"
    return folder, vecs, write_shards(folder, vecs)


def test_steps_choice_and_plateau_rules():
    assert nprobe_steps(64) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
    assert nprobe_steps(5) == [1, 2, 3, 4, 5]
    table = [{"value": v, "recall": r} for v, r in ((1, 0.7), (2, 0.9), (4, 0.96), (8, 0.99))]
    assert choose(table, 0.95) == (table[2], True)
    capped = [{"value": v, "recall": r} for v, r in ((1, 0.7), (2, 0.895), (4, 0.897), (8, 0.899))]
    assert choose(capped, 0.95) == (capped[1], False)  # within 0.005 of the best: the cheapest at the cap
    assert levelled(capped) and not levelled(table)
    assert without(np.array([[5, 3, 9], [3, 5, -1]]), np.array([5, 7]), 2).tolist() == [[3, 9], [3, 5]]


def test_ivf_nprobe_is_the_smallest_reaching_the_target_and_searches_use_it(tmp_path, clustered_shards, capsys):
    folder, vecs, ids = clustered_shards
    out = tmp_path / "ivf"
    stats = build_index(resolve(str(folder)), resolve(str(out)), "e", "passage",
                        index_config("IVF64,Flat", num_shards=2, target_recall=0.9, recall_queries=300),
                        parallel=False)
    search = load_manifest(resolve(str(out)))["search"]
    assert search["parameter"] == "nprobe" and search["chosen"] and search["reached"]
    assert stats["search"]["value"] == search["value"]
    chosen = search["value"]
    steps = [m["value"] for m in search["measured"]]
    assert steps == nprobe_steps(64)[:len(steps)] and steps[-1] == chosen
    assert 1 < chosen < 32  # fewer lists than the formula's 32 for 64 lists
    # the reference: other stored vectors, numpy's exact search
    assert brute_force_recall(out, vecs, ids, nprobe=chosen) >= 0.9 - 0.03
    assert brute_force_recall(out, vecs, ids, nprobe=steps[-2]) < 0.9 + 0.03
    assert search["formula"]["value"] == 32 and search["formula"]["recall"] > search["recall"]
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("[index] nprobe"))
    assert f"nprobe {chosen} of 64 lists" in line and "the formula's nprobe 32" in line
    # a search with nprobe: auto takes the measured nprobe; an explicit one stays
    assert measured_settings(load_manifest(resolve(str(out))), "auto", None) == (chosen, None)
    assert measured_settings(load_manifest(resolve(str(out))), 5, None) == (5, None)
    retriever = Retriever(str(out), gpu=False)
    retriever.setup()
    import faiss

    assert {faiss.extract_index_ivf(s).nprobe for s in retriever.searcher.shards} == {chosen}


def test_explicit_nprobe_is_measured_beside_the_choice_and_warned_when_short(tmp_path, clustered_shards, caplog):
    folder, vecs, ids = clustered_shards
    out = tmp_path / "ivf1"
    with caplog.at_level(logging.WARNING, logger="wbrag_ray.index.recall"):
        build_index(resolve(str(folder)), resolve(str(out)), "e", "passage",
                    index_config("IVF64,Flat", num_shards=1, target_recall=0.9, recall_queries=300, nprobe=1),
                    parallel=False)
    search = load_manifest(resolve(str(out)))["search"]
    assert search["as_set"]["value"] == 1 and search["as_set"]["recall"] < 0.9
    assert search["as_set"]["recall"] == pytest.approx(brute_force_recall(out, vecs, ids, nprobe=1), abs=0.05)
    assert "index.nprobe: auto would measure and use nprobe" in caplog.text
    assert measured_settings(load_manifest(resolve(str(out))), 1, None) == (1, None)  # what searches use


def test_hnsw_ef_search_is_measured_and_flat_is_not(tmp_path, clustered_shards):
    folder, vecs, ids = clustered_shards
    out = tmp_path / "hnsw"
    build_index(resolve(str(folder)), resolve(str(out)), "e", "passage",
                index_config("HNSW8", num_shards=1, target_recall=0.97, recall_queries=200), parallel=False)
    search = load_manifest(resolve(str(out)))["search"]
    assert search["parameter"] == "efSearch" and search["value"] > RECALL_K
    assert brute_force_recall(out, vecs, ids, ef_search=search["value"]) >= 0.97 - 0.03
    assert measured_settings(load_manifest(resolve(str(out))), "auto", None) == ("auto", search["value"])
    flat = tmp_path / "flat"
    stats = build_index(resolve(str(folder)), resolve(str(flat)), "e", "passage",
                        index_config("Flat", target_recall=0.95), parallel=False)
    assert stats["search"] is None and "search" not in load_manifest(resolve(str(flat)))


def test_without_a_target_the_formula_applies(tmp_path, clustered_shards):
    folder, _, _ = clustered_shards
    out = tmp_path / "formula"
    build_index(resolve(str(folder)), resolve(str(out)), "e", "passage", index_config("IVF64,Flat"), parallel=False)
    manifest = load_manifest(resolve(str(out)))
    assert "search" not in manifest and measured_settings(manifest, "auto", None) == ("auto", None)


def test_probes_run_as_ray_actors_over_several_shards(tmp_path, clustered_shards, ray_cluster):
    folder, vecs, ids = clustered_shards
    out = tmp_path / "ray"
    stats = build_index(resolve(str(folder)), resolve(str(out)), "e", "passage",
                        index_config("IVF64,Flat", num_shards=3, target_recall=0.9, recall_queries=300),
                        parallel=True)
    assert stats["parallel"] and stats["num_shards"] == 3
    chosen = stats["search"]["value"]
    assert brute_force_recall(out, vecs, ids, nprobe=chosen) >= 0.9 - 0.03


def test_the_report_plots_the_steps_tried(tmp_path, clustered_shards):
    from wbrag_ray.report.plots import plot_search_setting

    folder, _, _ = clustered_shards
    out = tmp_path / "plotted"
    build_index(resolve(str(folder)), resolve(str(out)), "e", "passage",
                index_config("IVF64,Flat", target_recall=0.9, recall_queries=200), parallel=False)
    name = plot_search_setting(load_manifest(resolve(str(out)))["search"], tmp_path)
    assert name and (tmp_path / name).stat().st_size > 1000


def test_the_probes_search_as_the_retriever_does(tmp_path, clustered_shards):
    """The recall measurement runs the retrieval's own search (`index.search`): its probes' merged top K at one
    nprobe is the in-process retriever's at that nprobe."""
    from wbrag_ray.index.recall import probes

    folder, vecs, _ = clustered_shards
    out = tmp_path / "same"
    build_index(resolve(str(folder)), resolve(str(out)), "e", "passage",
                index_config("IVF64,Flat", num_shards=2), parallel=False)
    queries = vecs[:50]
    groups = probes(resolve(str(out)), load_manifest(resolve(str(out)))["shards"], 32, queries[:8], threads=1,
                    num_cpus=1, parallel=False)
    groups.call("configure", 4, None)
    got = groups.search(queries, RECALL_K + 1)[1]
    want = Retriever(str(out), nprobe=4, gpu=False).search_ids(queries, RECALL_K + 1)[1]
    np.testing.assert_array_equal(got, want)
