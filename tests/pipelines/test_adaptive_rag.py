"""FLARE and Self-RAG-style retrieval with the real bundled model, as Ray Data passes on a local Ray cluster,
over the session's built run. Each decision is checked against the probability the same run recorded, at
thresholds chosen to force both paths."""

import json
import statistics

import pytest

from wbrag_ray import prompts, rag
from wbrag_ray.config import load_config
from wbrag_ray.formats import read_dataset
from wbrag_ray.index.retriever import RetrievalSetting, hits_from_json
from wbrag_ray.pipelines.passes import GeneratorPasses
from wbrag_ray.rag.flare import first_sentence, masked_query
from wbrag_ray.storage import resolve

N = 6


def _answer(built_run, flashrag_files, method: str, **settings):
    run, config_path = built_run
    overrides = [f"rag.{k}={v}" for k, v in settings.items()]
    config = load_config(config_path, overrides=overrides)
    questions, _ = read_dataset(resolve(str(flashrag_files[1])), limit=N)
    search = RetrievalSetting(str(run / "index"), str(run / "ingest"), config.embedder, config.retrieval,
                              config.index.nprobe)
    passes = GeneratorPasses(config.generator)
    df = rag.answer(questions, [method], config, search, passes, "prediction")
    assert sorted(df["id"]) == sorted(questions["id"].to_pylist()) and set(df["method"]) == {method}
    return df.set_index("id"), passes


def test_flare_sentence_split_and_masked_query():
    assert first_sentence([" It", " is", " 3", ".", "5", " m", ".", " Then", " more"]) == 7  # 3.5 is no end
    assert first_sentence([" No", " end"]) == 2
    settings = load_config(overrides=["rag.flare.threshold=0.5"]).rag.flare
    assert masked_query("Q?", [" Paris", " is", " big"], [0.9, 0.2, 0.8], settings) == "Q? Paris big"
    unmasked = settings.model_copy(update={"mask_query": False, "query_with_question": False})
    assert masked_query("Q?", [" Paris", " is"], [0.9, 0.2], unmasked) == "Paris is"


def test_flare_retrieves_exactly_when_a_token_falls_below_the_threshold(built_run, flashrag_files):
    # threshold 1: every sentence holds a token under probability 1, so every question retrieves
    always, _ = _answer(built_run, flashrag_files, "flare", **{"flare.threshold": 1.0, "flare.max_rounds": 1})
    first = {i: json.loads(t)["rounds"][0] for i, t in always["trace"].items()}
    assert all(r["retrieved"] and r["min_prob"] < 1 for r in first.values())
    assert not always["retrieval_skipped"].any()

    # between the lowest token probabilities of the first sentences: some retrieve, some don't
    threshold = statistics.median(r["min_prob"] for r in first.values())
    df, passes = _answer(built_run, flashrag_files, "flare",
                         **{"flare.threshold": threshold, "flare.max_rounds": 2})
    decided = set()
    for i, row in df.iterrows():
        trace = json.loads(row["trace"])
        for r in trace["rounds"]:
            assert r["retrieved"] == (r["min_prob"] < threshold), (i, r)
            decided.add(r["retrieved"])
            if r["retrieved"]:  # the sentence, its unsure tokens masked, after the question
                assert r["query"].startswith(row["question"]) and r["doc_ids"]
        assert trace["rounds"][0]["min_prob"] == pytest.approx(first[i]["min_prob"], abs=1e-3)
        docs = hits_from_json(row["docs"])
        retrieved_ids = [d for r in trace["rounds"] if r["retrieved"] for d in r["doc_ids"]]
        assert [h.id for h in docs] == list(dict.fromkeys(retrieved_ids))
        assert row["retrieval_skipped"] == (not retrieved_ids)
        # the answer is its sentences in order
        assert row["prediction"] == "".join(r["sentence"] for r in trace["rounds"]).strip()
        # the prompt that wrote the last sentence: with that round's documents if it retrieved, else closed-book
        system = json.loads(row["prompt"])[0]["content"]
        assert ("given documents" in system) == trace["rounds"][-1]["retrieved"]
    assert decided == {True, False}
    # one scored look-ahead pass per round, one regenerate pass per round that retrieved, all on Ray Data
    assert passes.stats["flare:look-ahead-1"]["generator_calls"] == N
    assert passes.stats["flare:regenerate-1"]["generator_calls"] == sum(
        json.loads(t)["rounds"][0]["retrieved"] for t in df["trace"])


def test_flare_threshold_zero_never_retrieves(built_run, flashrag_files):
    df, passes = _answer(built_run, flashrag_files, "flare", **{"flare.threshold": 0.0, "flare.max_rounds": 1})
    assert df["retrieval_skipped"].all() and (df["docs"] == "[]").all()
    assert not any(n.startswith("flare:regenerate") for n in passes.stats)


def test_self_rag_skips_retrieval_and_drops_documents_as_judged(built_run, flashrag_files):
    # thresholds 0: every question retrieves and keeps every document, so every judgement is recorded
    everything, _ = _answer(built_run, flashrag_files, "self-rag",
                            **{"self_rag.retrieval_threshold": 0.0, "self_rag.relevance_threshold": 0.0})
    traces = {i: json.loads(t) for i, t in everything["trace"].items()}
    assert all(t["retrieve"] and len(t["retrieved"]) == 5 for t in traces.values())
    p_retrieve = statistics.median(t["p_retrieve"] for t in traces.values())
    p_relevant = statistics.median(d["relevance"] for t in traces.values() for d in t["retrieved"])

    df, passes = _answer(built_run, flashrag_files, "self-rag", **{
        "self_rag.retrieval_threshold": p_retrieve, "self_rag.relevance_threshold": p_relevant})
    skipped = kept_some = dropped_some = 0
    for i, row in df.iterrows():
        trace = json.loads(row["trace"])
        assert trace["p_retrieve"] == pytest.approx(traces[i]["p_retrieve"], abs=1e-3)
        assert trace["retrieve"] == (trace["p_retrieve"] >= p_retrieve)
        docs = hits_from_json(row["docs"])
        if not trace["retrieve"]:  # judged not to need documents: no search, the closed-book prompt
            skipped += 1
            assert row["retrieval_skipped"] and not trace["retrieved"] and not docs
            assert json.loads(row["prompt"]) == prompts.no_retrieval_messages(row["question"])
            continue
        kept = [d["id"] for d in trace["retrieved"] if d["relevance"] >= p_relevant]
        assert trace["fallback"] == (not kept)
        if not kept:  # none judged relevant: the most relevant one (settings.keep_best)
            kept = [max(trace["retrieved"], key=lambda d: d["relevance"])["id"]]
        assert [h.id for h in docs] == kept  # the documents judged relevant, in rank order, and only those
        kept_some += bool(kept)
        dropped_some += len(kept) < len(trace["retrieved"])
        assert json.loads(row["prompt"]) == prompts.rag_messages(row["question"], docs)
    assert 0 < skipped < N and kept_some and dropped_some
    retrieved = N - skipped
    assert passes.stats["self-rag:judge-retrieval"]["generator_calls"] == N
    assert passes.stats["self-rag:judge-relevance"]["generator_calls"] == 5 * retrieved
    assert passes.stats["self-rag:answer"]["generator_calls"] == N
    assert df["generator_calls"].sum() == N * 2 + 5 * retrieved


def test_a_zero_rag_router_skips_retrieval_under_every_method(built_run, flashrag_files, tmp_path):
    """A router that calls every question mastered: no method searches, whatever its own decision was."""
    import numpy as np

    from wbrag_ray.models.router import QueryRouter

    run, config_path = built_run
    QueryRouter(np.zeros(384, np.float32), 10.0, 0.5).save(tmp_path / "router", {"test": "all mastered"})
    config = load_config(config_path, overrides=["rag.flare.threshold=1.0", "rag.flare.max_rounds=1",
                                                 "rag.self_rag.retrieval_threshold=0.0"])
    questions, _ = read_dataset(resolve(str(flashrag_files[1])), limit=3)
    search = RetrievalSetting(str(run / "index"), str(run / "ingest"), config.embedder, config.retrieval,
                              config.index.nprobe, router_dir=str(tmp_path / "router"))
    df = rag.answer(questions, ["naive", "self-rag", "flare"], config, search, GeneratorPasses(config.generator))
    assert len(df) == 9 and df["retrieval_skipped"].all() and (df["docs"] == "[]").all()
    for method, trace in zip(df["method"], df["trace"], strict=True):
        if method == "self-rag":  # it wanted documents; the router said no
            assert json.loads(trace)["retrieve"] and json.loads(trace)["router_skipped"]
        if method == "flare":  # every sentence was unsure; the router said no, so the look-ahead stands
            t = json.loads(trace)
            assert t["router_skipped"] and t["rounds"][0]["min_prob"] < 1 and not t["rounds"][0]["retrieved"]


def test_a_router_that_searches_everything_leaves_flare_its_sentence_queries(built_run, flashrag_files, tmp_path):
    """The router judges the question; FLARE's search still embeds its own sentence query."""
    import numpy as np

    from wbrag_ray.models.router import QueryRouter

    run, config_path = built_run
    QueryRouter(np.zeros(384, np.float32), -10.0, 0.5).save(tmp_path / "router", {"test": "none mastered"})
    config = load_config(config_path, overrides=["rag.flare.threshold=1.0", "rag.flare.max_rounds=1"])
    questions, _ = read_dataset(resolve(str(flashrag_files[1])), limit=3)
    routed = RetrievalSetting(str(run / "index"), str(run / "ingest"), config.embedder, config.retrieval,
                              config.index.nprobe, router_dir=str(tmp_path / "router"))
    plain = RetrievalSetting(str(run / "index"), str(run / "ingest"), config.embedder, config.retrieval,
                             config.index.nprobe)
    with_router = rag.answer(questions, ["flare"], config, routed, GeneratorPasses(config.generator))
    without = rag.answer(questions, ["flare"], config, plain, GeneratorPasses(config.generator))
    assert not with_router["retrieval_skipped"].any()
    assert with_router.sort_values("id")["docs"].tolist() == without.sort_values("id")["docs"].tolist()
