"""Integration: Zero-RAG's whole chain on a slice of the demo data on a local Ray cluster, through
`wbrag run jobs/configs/zero_rag_demo.yaml` (smaller sample, fewer steps, and a small write-back index on the
same run): mastery scores, both pruners, prediction, the percentile, the pruned corpus and index, tuning, the
router and the evaluation grid; then the pieces are checked one by one. Every model role runs on the tiny
random-weight models (tests/tiny_models.py): what is checked is bookkeeping, not what the models learn."""

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.conftest import demo_questions
from wbrag_ray.cli import main
from wbrag_ray.index.files import load_manifest
from wbrag_ray.models.router import QueryRouter
from wbrag_ray.retrieval.local import Retriever

N_SAMPLE = 48  # zerorag.sample of the chain (tests/pipelines/conftest.py)


def test_mastery_score_is_the_mean_em_of_the_stored_answers(chain):
    run, _ = chain
    zero_rag = run.layout.zero_rag
    qa = pq.read_table(zero_rag.qa.path).to_pandas()
    scores = pq.read_table(zero_rag.scores.path).to_pandas().set_index("sid")
    assert len(scores) == N_SAMPLE and set(qa["sid"]) <= set(scores.index)
    ok = qa[qa["status"] == "ok"]
    assert ok["prediction"].notna().all() and qa.loc[qa["status"] != "ok", "em"].isna().all()
    expected = ok.groupby("sid")["em"].mean()
    np.testing.assert_allclose(scores.loc[expected.index, "mastery"], expected)
    assert scores.drop(expected.index)["mastery"].isna().all()  # no valid pair: no score, but still listed
    stats = run.stats("mastery")
    assert stats["qa_pairs"] == len(qa) == stats["valid"] + stats["unparseable"] + stats["answer_not_in_sentence"]
    assert stats["mode"] == "cloze" and stats["generator_calls"] == len(ok)


def test_both_pruners_are_validated_on_held_out_sentences(chain):
    run, _ = chain
    for kind in ("embedding", "lm"):
        metrics = run.layout.zero_rag.pruner_metrics(kind).read_json()
        val = pq.read_table(run.layout.zero_rag.pruner_validation(kind).path).to_pandas()
        assert metrics["n_val"] == len(val) > 0 and metrics["n_train"] + metrics["n_val"] == run.stats("mastery")["scored_sentences"]
        assert val["predicted"].between(0, 1).all() and "spearman" in metrics and metrics["top_quantile"]["q"] == 0.3


def test_the_lm_pruner_predicts_on_the_text_it_was_trained_and_validated_on(chain):
    """Prediction reads every sentence with its title, as training did: the prediction path's scores of the
    held-out sentences are the validation scores (before, it read the bare sentence and scored other text)."""
    from wbrag_ray.stages.base import run_local
    from wbrag_ray.stages.pruner import LMPredictStage
    from wbrag_ray.zerorag.mastery import titled
    from wbrag_ray.zerorag.pruners import pruner_inputs

    run, _ = chain
    scores = pq.read_table(run.layout.zero_rag.scores.path).to_pandas().set_index("sid")
    inputs = pruner_inputs(run).to_pandas().set_index("sid")
    assert len(inputs) == run.stats("ingest")["sentences"] and (scores["title"] != "").all()
    expected = titled(scores["title"], scores["text"])
    assert inputs.loc[scores.index, "text"].tolist() == expected
    val = pq.read_table(run.layout.zero_rag.pruner_validation("lm").path).to_pandas()
    batch = inputs.loc[val["sid"]].reset_index()
    # the same rows in the same batches as validation: the same numbers, whatever dtype this CPU computes in
    stage = LMPredictStage(run.layout.zero_rag.pruner("lm").uri, run.load_config().zerorag.lm_pruner)
    predicted = run_local(stage, batch).set_index("sid").loc[val["sid"], "mastery_pred"]
    np.testing.assert_allclose(predicted.to_numpy(), val["predicted"].to_numpy(), rtol=1e-5, atol=1e-6)


def test_pruning_drops_the_requested_fraction_and_the_index_holds_exactly_the_kept_ids(chain):
    run, _ = chain
    n = run.stats("ingest")["sentences"]
    pred = pq.read_table(run.layout.zero_rag.predictions.path).to_pandas()
    assert len(pred) == n and pred["sid"].is_unique
    level = run.layout.zero_rag.pruned(0.3)
    keep = pq.read_table(level.keep.path).to_pandas()
    stats = run.stats("prune-0.3")
    assert len(keep) == n and abs(stats["achieved_ratio"] - 0.3) <= 0.005 + 1 / n
    assert keep.loc[~keep["keep"], "mastery_pred"].min() >= keep.loc[keep["keep"], "mastery_pred"].max()
    kept_ids = set(keep.loc[keep["keep"], "id"])
    corpus = pq.read_table(level.sentences.path).to_pandas()
    assert set(corpus["sid"]) == kept_ids and len(corpus) == len(kept_ids)
    index = level.index
    manifest = load_manifest(index)
    assert manifest["count"] == len(kept_ids) and manifest["pruned_from"] == run.layout.index.uri
    # a Flat index returns everything it holds for k = its size
    ids = Retriever(index.uri, nprobe=None).search_ids(np.ones((1, manifest["dim"]), np.float32), manifest["count"])[1][0]
    assert set(ids.tolist()) == kept_ids
    assert stats["index_bytes"] < stats["source_index_bytes"]


def test_tuning_and_router_and_the_grid(chain):
    run, _ = chain
    tune = run.stats("tune")
    # distracting and no documents for every training question; relevant ones only where a retrieved doc holds
    # the answer; each term's loss recorded
    formats = tune["formats"]
    assert formats["distracting"] == formats["none"] == 10 and tune["rows_out"] == sum(formats.values())
    assert formats["relevant"] == 10 - tune["questions_without_relevant"]
    # the stage's seconds are all of it (retrieval, Ray Train's start), the training loop's its own part
    assert 0 < tune["train_seconds"] < tune["seconds"]
    assert {t for t, v in tune["term_losses"].items() if v["first"] is not None} >= {"distracting", "none"}
    assert run.layout.zero_rag.adapter.join("adapter_config.json").exists()  # the adapter's own (peft) file
    router = run.layout.zero_rag.router_metrics.read_json()
    assert router["n_train"] + router["n_val"] == 10 and router["adapter"] is True
    grid = run.layout.zero_rag.grid.read_json()
    rows = grid["rows"]
    # one generator process for the router's labels and every cell: the adapter's cells on the model the router
    # loaded with it, then the model without it set up in the same process
    used = grid["services"]
    assert used["started"].get("generate", 0) == 1
    assert used["loads"]["generate"] == 2
    labelled_by = run.stats("router")["generator_actors"]
    assert labelled_by and grid["services"]["generator_actors"] == labelled_by
    settings = {(r["ratio"], r["router"], r["adapter"], r["method"]) for r in rows}
    for ratio in (0.0, 0.3):
        for router in (False, True):
            for adapter in (False, True):
                assert (ratio, router, adapter, "naive") in settings
    full = next(r for r in rows if r["ratio"] == 0 and r["method"] == "naive" and not r["router"] and not r["adapter"])
    pruned = next(r for r in rows if r["ratio"] == 0.3 and r["method"] == "naive" and not r["router"] and not r["adapter"])
    assert pruned["sentences"] < full["sentences"] and pruned["index_bytes"] < full["index_bytes"]
    assert all(r["n"] == 6 for r in rows)
    # the paper's Table 4 figures: the retrieval speedup is the formula over the two latencies the grid recorded (one
    # per index), by hand from them, each rounded to 4 decimals: the tolerance is what that rounding moves. Not
    # checked here: that the pruned cells' latency was measured on the pruned index; a few hundred tiny vectors
    # less search in less time than the timer's noise, so the measured speedup says nothing at this size.
    assert full["retrieval_speedup_pct"] == 0 and full["latency_ms_per_query"] > 0
    lat_full, lat_pruned = full["latency_ms_per_query"], pruned["latency_ms_per_query"]
    assert all(r["latency_ms_per_query"] == (lat_full if r["ratio"] == 0 else lat_pruned) for r in rows
               if r["method"] != "no-retrieval")  # one measurement per index, shared by its cells
    slack = 100 * 5e-5 * (1 + (lat_pruned + 5e-5) / lat_full) / (lat_full - 5e-5) + 0.005
    assert pruned["retrieval_speedup_pct"] == pytest.approx(100 * (1 - lat_pruned / lat_full), abs=slack)
    assert all(r["seconds_per_question"] > 0 for r in rows)


def test_each_grid_cell_records_what_made_it_and_its_departures_from_zero_rag(chain, capsys):
    from wbrag_ray import api
    from wbrag_ray.evaluation.evaluate import load_results

    run, _ = chain
    results = load_results(run)
    (cell,) = [m for name, m in results.items() if name.endswith("-prune0.3-router-adapter-naive")]
    made = cell["made_by"]
    assert made["pruning_ratio"] == 0.3 and made["router"] is True and made["writeback"] is None
    assert made["adapter"]["targets"] == run.load_config().zerorag.tune.targets  # the adapter's recorded settings
    assert cell["papers"] == ["Zero-RAG"] and {d["paper"] for d in cell["departures"]} == {"Zero-RAG"}
    assert any(d["what"].startswith("the pruner drops the sentences of highest predicted mastery")
               for d in cell["departures"])
    (full,) = [m for name, m in results.items() if name.endswith("-prune0-naive")]
    assert full["made_by"]["pruning_ratio"] == 0.0
    # `wbrag eval --grid` (its cells done: each skipped) starts with the departures and ends with the papers' numbers
    capsys.readouterr()
    api.evaluate_zero_rag_grid(run, run.load_config())
    printed = capsys.readouterr().out
    assert printed.startswith("this run departs from Zero-RAG in ") and "paper vs this run" in printed


def test_the_grid_times_each_ratio_on_that_ratios_own_index(chain, monkeypatch):
    """The retrieval speedup against a clock the test sets: a search service's latency is the vectors its index
    holds (what a Flat index's search costs), and the grid runs again on the chain's run (every cell complete, so
    reused). Each ratio's latency is its own index's and the speedup, by hand from the two manifests' counts, is
    1 - pruned / full; the chain's grid.json is put back after."""
    from wbrag_ray.retrieval.service import RetrievalService
    from wbrag_ray.zerorag.grid import evaluate_grid
    from wbrag_ray.zerorag.prune import index_for_ratio

    run, test_file = chain
    count = {ratio: load_manifest(index_for_ratio(run, ratio))["count"] for ratio in (0.0, 0.3)}
    assert count[0.3] < count[0.0]
    monkeypatch.setattr(RetrievalService, "latency_ms",
                        lambda self, vectors, k, min_seconds=0.5: sum(p.manifest["count"] for p in self.pools) / 1000)
    saved = run.layout.zero_rag.grid.read_bytes()
    try:
        rows = evaluate_grid(run, run.load_config(), str(test_file))
    finally:
        run.layout.zero_rag.grid.write_bytes(saved)
    timed = [r for r in rows if r["method"] != "no-retrieval"]
    assert {r["ratio"] for r in timed} == {0.0, 0.3}
    for r in timed:
        assert r["latency_ms_per_query"] == round(count[r["ratio"]] / 1000, 4), r
        want = 0.0 if r["ratio"] == 0 else round(100 * (1 - count[0.3] / count[0.0]), 2)
        assert r["retrieval_speedup_pct"] == pytest.approx(want, abs=0.01), r


def test_grid_evaluates_a_pruned_base_with_write_back(chain):
    """The two methods combined: the pruned sentence index searched together with the write-back index."""
    run, _ = chain
    assert run.stats("writeback-train")["units_written"] >= 1
    rows = run.layout.zero_rag.grid.read_json()["rows"]
    for ratio in (0.0, 0.3):
        combined = [r for r in rows if r["ratio"] == ratio and r["writeback"] and r["method"] == "naive"]
        assert combined and all(r["n"] == 6 for r in combined)
    result = run.layout.eval_result("t-prune0.3-writeback", "naive")
    metrics = result.metrics.read_json()
    assert metrics["writeback_version"] == "train" and metrics["index"] == run.layout.zero_rag.pruned(0.3).index.uri
    preds = pq.read_table(result.predictions.path).to_pandas()
    sources = {d["source"] for docs in preds["docs"] for d in json.loads(docs)}
    assert sources <= {"base", "writeback"} and "base" in sources


def test_router_decision_changes_what_evaluation_retrieves(chain, tiny, tmp_path):
    """A router built to call exactly one question mastered: that question gets no documents (and is answered
    closed-book by every method), the others are retrieved for as before."""
    run, test_file = chain
    from wbrag_ray.config import EmbedderConfig
    from wbrag_ray.models.embedder import Embedder

    questions = [q["question"] for q in demo_questions(6)]
    vectors = Embedder(EmbedderConfig(model=tiny.embedder, dtype="float32")).encode_queries(questions)
    sims = vectors @ vectors[0]
    threshold = float((sims[0] + np.sort(sims)[-2]) / 2)  # between question 0 and the next most similar one
    # P(mastered) = sigmoid(s * (v . v0 - threshold)): above 0.5 only for question 0
    QueryRouter(vectors[0] * 200, -200 * threshold, 0.5).save(run.layout.zero_rag.router.path, {})
    assert main(["eval", run.root.path, "--dataset", str(test_file), "--name", "routed", "--router",
                 "--methods", "naive,replug"]) == 0
    for method in ("naive", "replug"):
        preds = pq.read_table(run.layout.eval_result("routed-router", method).predictions.path).to_pandas()
        preds = preds.set_index("question").loc[questions]
        assert preds["retrieval_skipped"].tolist() == [True] + [False] * 5
        assert preds["docs"].iloc[0] == "[]" and all(len(json.loads(d)) == 5 for d in preds["docs"].iloc[1:])
        prompt = json.loads(preds["prompt"].iloc[0])
        if method == "replug":  # the mixture's K prompts; without documents, one closed-book prompt
            (prompt,) = prompt
        assert "documents" not in prompt[0]["content"]
    metrics = run.layout.eval_result("routed-router", "naive").metrics.read_json()
    assert metrics["retrieval_skipped"] == pytest.approx(1 / 6, abs=1e-3)


def test_report_and_inspect_show_zero_rag(chain):
    run, _ = chain
    from wbrag_ray.inspection import inspect_run
    from wbrag_ray.report import write_report

    report = write_report(run)
    html = open(report).read()
    # what only the Zero-RAG sections show: "mastery" alone is also in the config dump (zerorag.mastery_metric)
    for shown in ("<h2>Zero-RAG: mastery scores</h2>", "<caption>QA pairs by status</caption>",
                  "<h2>Zero-RAG: pruned indices</h2>", "<caption>pruning levels</caption>"):
        assert shown in html, shown
    text = inspect_run(run, 2)
    assert "Zero-RAG prune-0.3" in text and "highest predicted mastery" in text and "mastery QA pairs" in text
