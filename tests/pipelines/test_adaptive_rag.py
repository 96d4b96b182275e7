"""FLARE and Self-RAG-style retrieval as Ray Data passes on a local Ray cluster, over the session's built run
(its index, built with the bundled embedder). The generator is the tiny random-weight model (tests/tiny_models.py):
these tests check decisions, not answers. Each decision is checked against the probability the same run
recorded, at thresholds chosen to force both paths, and FLARE's first-round probabilities against the tiny model
decoded by hand in the test process (tests/reference_decoding.py)."""

import json
import statistics

import pytest

from tests import reference_decoding as reference
from wbrag_ray import prompts, rag
from wbrag_ray.config import load_config
from wbrag_ray.formats import read_dataset
from wbrag_ray.generation.passes import GeneratorPasses
from wbrag_ray.rag.flare import first_sentence, masked_query
from wbrag_ray.retrieval.hits import hits_from_json
from wbrag_ray.retrieval.stage import RetrievalSetting
from wbrag_ray.run import RunFolder
from wbrag_ray.storage import resolve

N = 6


@pytest.fixture(scope="module")
def services(ray_cluster):
    """The generator and retrieval services every test of this module shares (each with passes of its own, so
    its pass stats are its own): the tiny generator loads once and the index opens once for the module."""
    from wbrag_ray.stages.service import Services

    with Services() as shared:
        yield shared


def _config(built_run, tiny, overrides=()):
    """The built run's config with the tiny generator (the index and its query embedder stay as built)."""
    return load_config(built_run[1], overrides=[*tiny.overrides(embedder=False), *overrides])


def _answer(built_run, flashrag_files, tiny, services, method: str, extra=(), **settings):
    run, _ = built_run
    config = _config(built_run, tiny, [*(f"rag.{k}={v}" for k, v in settings.items()), *extra])
    questions, _ = read_dataset(resolve(str(flashrag_files[1])), limit=N)
    layout = RunFolder(str(run)).layout
    search = RetrievalSetting(layout.index.uri, layout.ingest.root.uri, config.embedder, config.retrieval,
                              config.index)
    passes = GeneratorPasses(config.generator, services)
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


def test_flare_retrieves_exactly_when_a_token_falls_below_the_threshold(built_run, flashrag_files, tiny, services):
    # threshold 1: every sentence holds a token under probability 1, so every question retrieves
    always, _ = _answer(built_run, flashrag_files, tiny, services, "flare", **{"flare.threshold": 1.0, "flare.max_rounds": 1})
    first = {i: json.loads(t)["rounds"][0] for i, t in always["trace"].items()}
    wrote = {i: r for i, r in first.items() if r["min_prob"] is not None}  # see the empty look-ahead test
    assert len(wrote) >= N - 1 and all(r["retrieved"] and r["min_prob"] < 1 for r in wrote.values())
    assert always["retrieval_skipped"].tolist() == [i not in wrote for i in always.index]
    # each first look-ahead and its lowest token probability, against the tiny model decoded by hand in this
    # process (tests/reference_decoding.py): the min over the first sentence's tokens, the stop token not counted
    config = _config(built_run, tiny)
    model, tokenizer = reference.load(tiny.generator)
    stops = reference.stop_ids(model, tokenizer, config.generator.stop)
    lowest = {}
    for i, question in always["question"].items():
        tokens, probs, _ = reference.greedy(model, tokenizer, prompts.no_retrieval_messages(question),
                                            config.rag.flare.look_ahead_tokens, stops)
        k = first_sentence(tokens)
        lowest[i] = min(probs[:k]) if k else None
        assert first[i]["look_ahead"] == "".join(tokens[:k]).strip(), i
        assert first[i]["min_prob"] == pytest.approx(lowest[i], abs=1e-3), i  # None == None

    # between the lowest token probabilities of the first sentences: some retrieve, some don't
    # (halfway between two of them, so no probability sits on the threshold)
    values = sorted(lowest[i] for i in wrote)
    threshold = (values[len(values) // 2 - 1] + values[len(values) // 2]) / 2
    df, passes = _answer(built_run, flashrag_files, tiny, services, "flare",
                         **{"flare.threshold": threshold, "flare.max_rounds": 2})
    decided = set()
    for i, row in df.iterrows():
        trace = json.loads(row["trace"])
        for r in trace["rounds"]:
            if r["min_prob"] is None:  # an empty look-ahead ends the answer: nothing to retrieve for
                assert not r["retrieved"] and not r["sentence"] and r is trace["rounds"][-1], (i, r)
                continue
            assert r["retrieved"] == (r["min_prob"] < threshold), (i, r)
            if r["round"] == 1:  # the decision follows the reference's probability, not only the recorded one
                assert r["retrieved"] == (lowest[i] < threshold), (i, r, lowest[i])
            decided.add(r["retrieved"])
            if r["retrieved"]:  # the sentence, its unsure tokens masked, after the question
                assert r["query"].startswith(row["question"]) and r["doc_ids"]
        assert trace["rounds"][0]["min_prob"] == pytest.approx(first[i]["min_prob"], abs=1e-3)  # None == None
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


def test_flare_ends_the_answer_when_the_look_ahead_is_empty(built_run, flashrag_files, tiny, services):
    """A model whose first token is a stop token writes an empty look-ahead (as SmolLM2 in fp32 did for a demo
    question): the answer is finished, with no retrieval and no further round, even at threshold 1."""
    from wbrag_ray.generation.hf import HFGenerator

    # the greedy first token of each question's first look-ahead (FLARE's own prompt), made a stop string
    questions, _ = read_dataset(resolve(str(flashrag_files[1])), limit=N)
    gen = HFGenerator(_config(built_run, tiny).generator)
    gen.setup()
    look_ahead = [prompts.continue_answer(prompts.no_retrieval_messages(q), "") for q in questions["question"].to_pylist()]
    openers = {s.tokens[0].strip() or s.tokens[0] for s in gen.generate_scored(look_ahead) if s.tokens}
    stop = ["\n", *openers]
    df, passes = _answer(built_run, flashrag_files, tiny, services, "flare", extra=[f"generator.stop={json.dumps(stop)}"],
                         **{"flare.threshold": 1.0, "flare.max_rounds": 3})
    for _, row in df.iterrows():
        trace = json.loads(row["trace"])
        assert trace["rounds"] == [{"round": 1, "look_ahead": "", "min_prob": None, "retrieved": False,
                                    "query": None, "doc_ids": [], "sentence": ""}]
        assert row["prediction"] == "" and row["retrieval_skipped"] and row["docs"] == "[]"
        assert row["generator_calls"] == 1
    assert set(passes.stats) == {"flare:look-ahead-1"}


def test_flare_threshold_zero_never_retrieves(built_run, flashrag_files, tiny, services):
    df, passes = _answer(built_run, flashrag_files, tiny, services, "flare", **{"flare.threshold": 0.0, "flare.max_rounds": 1})
    assert df["retrieval_skipped"].all() and (df["docs"] == "[]").all()
    assert not any(n.startswith("flare:regenerate") for n in passes.stats)


def test_self_rag_skips_retrieval_and_drops_documents_as_judged(built_run, flashrag_files, tiny, services):
    # thresholds 0: every question retrieves and keeps every document, so every judgement is recorded
    everything, _ = _answer(built_run, flashrag_files, tiny, services, "self-rag",
                            **{"self_rag.retrieval_threshold": 0.0, "self_rag.relevance_threshold": 0.0})
    traces = {i: json.loads(t) for i, t in everything["trace"].items()}
    assert all(t["retrieve"] and len(t["retrieved"]) == 5 for t in traces.values())
    p_retrieve = statistics.median(t["p_retrieve"] for t in traces.values())
    p_relevant = statistics.median(d["relevance"] for t in traces.values() for d in t["retrieved"])

    # the generator, retrieval-pass and search services the first run started
    held = dict(services.started)
    df, passes = _answer(built_run, flashrag_files, tiny, services, "self-rag", **{
        "self_rag.retrieval_threshold": p_retrieve, "self_rag.relevance_threshold": p_relevant})
    # four passes (3 generator, 1 retrieval) on the services already up: nothing started again
    assert services.started == held and set(held) == {"generate", "retrieve", "search"}
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


def test_a_zero_rag_router_skips_retrieval_under_every_method(built_run, flashrag_files, tiny, services, tmp_path):
    """A router that calls every question mastered: no method searches, whatever its own decision was."""
    import numpy as np

    from wbrag_ray.models.router import QueryRouter

    run, _ = built_run
    QueryRouter(np.zeros(384, np.float32), 10.0, 0.5).save(tmp_path / "router", {"test": "all mastered"})
    config = _config(built_run, tiny, ["rag.flare.threshold=1.0", "rag.flare.max_rounds=1",
                                       "rag.self_rag.retrieval_threshold=0.0"])
    questions, _ = read_dataset(resolve(str(flashrag_files[1])), limit=3)
    layout = RunFolder(str(run)).layout
    search = RetrievalSetting(layout.index.uri, layout.ingest.root.uri, config.embedder, config.retrieval,
                              config.index, router_dir=str(tmp_path / "router"))
    df = rag.answer(questions, ["naive", "self-rag", "flare"], config, search, GeneratorPasses(config.generator, services))
    assert len(df) == 9 and df["retrieval_skipped"].all() and (df["docs"] == "[]").all()
    for method, trace in zip(df["method"], df["trace"], strict=True):
        if method == "self-rag":  # it wanted documents; the router said no
            assert json.loads(trace)["retrieve"] and json.loads(trace)["router_skipped"]
        if method == "flare":  # every sentence was unsure; the router said no, so the look-ahead stands
            t = json.loads(trace)
            assert t["router_skipped"] and t["rounds"][0]["min_prob"] < 1 and not t["rounds"][0]["retrieved"]


def test_a_router_that_searches_everything_leaves_flare_its_sentence_queries(built_run, flashrag_files, tiny, services, tmp_path):
    """The router judges the question; FLARE's search still embeds its own sentence query."""
    import numpy as np

    from wbrag_ray.models.router import QueryRouter

    run, _ = built_run
    QueryRouter(np.zeros(384, np.float32), -10.0, 0.5).save(tmp_path / "router", {"test": "none mastered"})
    config = _config(built_run, tiny, ["rag.flare.threshold=1.0", "rag.flare.max_rounds=1"])
    questions, _ = read_dataset(resolve(str(flashrag_files[1])), limit=3)
    layout = RunFolder(str(run)).layout
    routed = RetrievalSetting(layout.index.uri, layout.ingest.root.uri, config.embedder, config.retrieval,
                              config.index, router_dir=str(tmp_path / "router"))
    plain = RetrievalSetting(layout.index.uri, layout.ingest.root.uri, config.embedder, config.retrieval,
                             config.index)
    with_router = rag.answer(questions, ["flare"], config, routed, GeneratorPasses(config.generator, services))
    without = rag.answer(questions, ["flare"], config, plain, GeneratorPasses(config.generator, services))
    assert not with_router["retrieval_skipped"].any()
    assert with_router.sort_values("id")["docs"].tolist() == without.sort_values("id")["docs"].tolist()


def test_a_pass_that_searches_no_more_ends_its_search_before_it_generates(built_run, flashrag_files, tiny, services):
    """`wbrag eval`'s own passes: the query embedder's service and the search pools end once the questions are
    searched (their memory goes before the generator's batches); the answers are those of a kept search."""
    kept, _ = _answer(built_run, flashrag_files, tiny, services, "naive")
    assert "retrieve" in services._live and services._pools
    run, _ = built_run
    config = _config(built_run, tiny)
    questions, _ = read_dataset(resolve(str(flashrag_files[1])), limit=N)
    layout = RunFolder(str(run)).layout
    search = RetrievalSetting(layout.index.uri, layout.ingest.root.uri, config.embedder, config.retrieval,
                              config.index)
    ended = rag.answer(questions, ["naive"], config, search, GeneratorPasses(config.generator, services),
                       "prediction", keep_search=False).set_index("id")
    assert "retrieve" not in services._live and not services._pools and "generate" in services._live
    assert ended.loc[kept.index, "prediction"].tolist() == kept["prediction"].tolist()
