"""`wbrag plan --calibrate` measures what `wbrag run` does (issue 67, its last gaps): the utility gate's keep rate is
decided on the sample as the run's write-back decides it (the same top K, prompts, generator stage and gate), and
the embed stage's fixed cost is the run's own embed stage timed (a Ray Data pass whose actors start in it), not a
bare worker's start and load."""

from __future__ import annotations

import json

import pytest

from tests.conftest import DATA, DEMO_CORPUS, write_jsonl
from wbrag_ray.config import load_config
from wbrag_ray.plan import Cluster, make_plan


@pytest.fixture(autouse=True)
def no_cache(tmp_path, monkeypatch):
    """An empty calibration cache: what this machine calibrated before stays out of the test."""
    monkeypatch.setenv("WBRAG_RATES_CACHE", str(tmp_path / "rates.json"))


def _config(tiny, train=None):
    # the settings the session's demo run was built with (`tests.conftest.demo_run`), short distiller outputs
    overrides = [*tiny.overrides(), "generator.max_new_tokens=16", "generator.num_cpus=1",
                 "writeback.extract_max_new_tokens=8", "writeback.rewrite_max_new_tokens=8",
                 "embedder.num_cpus=0.5", "eval.methods=[no-retrieval,naive]"]
    extra = {"ingest": {"corpus": str(DEMO_CORPUS)}}
    if train:
        extra["writeback"] = {"train": str(train), "metric": "acc"}
    return load_config(overrides=overrides, extra=extra)


def test_the_calibrations_utility_gate_is_the_runs_on_the_same_questions(tiny, demo_run, one_command, tmp_path):
    """The calibration's sample against `score_examples` (what `wbrag writeback` scores) on the session's demo run:
    each question's top K (the run embeds a passage with its title), its closed-book and RAG answers (on the tiny
    models an answer is the prompt's fingerprint: another prompt or another batch answers otherwise) and the gate's
    decision, question by question. The calibration once embedded the passages' text alone: 16 of the demo's 30
    training questions got another top K than the run's index gives them, and kept 10 where the run kept 5."""
    from wbrag_ray.generation.passes import GeneratorPasses
    from wbrag_ray.generation.stage import GenerateStage
    from wbrag_ray.plan.selection import (
        SAMPLE_PASSAGES,
        calibrate_writeback,
        corpus_passages,
        run_pass,
        sample_rows,
        score_sample,
        search_sample,
    )
    from wbrag_ray.run import RunFolder
    from wbrag_ray.writeback.pipeline import base_search, score_examples

    run_dir, _ = demo_run
    lines = (DATA / "demo_train.jsonl").read_text().splitlines()[:12]
    train = write_jsonl(tmp_path / "train.jsonl", [json.loads(line) for line in lines])
    config = _config(tiny, train)
    run = RunFolder(str(run_dir))
    with GeneratorPasses(config.generator) as passes:
        scored = score_examples(run, config, str(train), passes, base_search(run, config)).set_index("id")

    rows, passages = sample_rows(str(train)), corpus_passages(str(DEMO_CORPUS), SAMPLE_PASSAGES)
    record = calibrate_writeback(config, rows, passages, len(passages), budget=0.0)
    assert [q["id"] for q in record["sample"]] == list(scored.index)  # every question of the small file
    for q in record["sample"]:
        run_row = scored.loc[q["id"]]
        # the record names a document by its place among the corpus's passages, the run by its passage id
        assert [passages[j] for j in q["docs"]] == [(h["title"], h["text"]) for h in json.loads(run_row["docs"])]
        assert (q["s_nr"], q["s_rag"], q["useful"]) == (run_row["s_nr"], run_row["s_rag"], bool(run_row["useful"]))
    assert record["kept"] == int(scored["useful"].sum())

    # the answers the calibration's gate read are the run's, word for word
    stage = GenerateStage(config.generator, "prompt", "answer")
    stage.setup()
    mine = score_sample(config, rows, search_sample(config, [r["question"] for r in rows], passages),
                        run_pass(stage)).set_index("id")
    assert mine["nr_answer"].to_dict() == scored["nr_answer"].to_dict()
    assert mine["rag_answer"].to_dict() == scored["rag_answer"].to_dict()


def test_the_embed_stages_fixed_cost_is_the_runs_embed_stage_timed(tiny, ray_cluster, one_command):
    """Calibration runs the run's own embed stage (`build_kb.embed`) on the corpus's first passages (the demo
    corpus's 100, all of it): its seconds beyond their tokens at the warm rate are the stage's start (the Ray Data
    pass, its actors' start, imports and load, the write), which the plan adds to the embed stage in place of a bare
    worker's start and load (the demo's 100 passages ran 1.57x a plan that counted only those): a corpus no larger
    than the probe is planned at its own stage's time."""
    from wbrag_ray.plan.calibrate import calibrate

    config = _config(tiny)
    records = calibrate(config, seconds=2.0)
    emb = next(r for r in records if r["role"] == "embedder")
    assert emb["pass_texts"] == 100 and emb["pass_tokens"] > 0  # the demo corpus: 100 passages in all
    assert emb["pass_start_seconds"] == pytest.approx(max(0.0, emb["pass_seconds"]
                                                          - emb["pass_tokens"] * emb["seconds_per_token"]))
    assert emb["pass_start_seconds"] > 0

    plan = make_plan(config, Cluster.uniform(1, 2, 0, 8, 80, "stated"), records=records)
    embed = next(s for s in plan.stages if s.name == "embed")
    assert embed.rate_source == "calibrated"
    assert f"embed pass start, load and first use {emb['pass_start_seconds']:.1f} s" in embed.how
    # the plan's tokens of the corpus are the probe's (characters / 4 of each 'Title\ntext'): the stage's own time
    assert plan.corpus.passages * plan.tokens.passage == pytest.approx(emb["pass_tokens"], rel=0.02)
    assert embed.seconds == pytest.approx(emb["pass_seconds"], rel=0.02)
