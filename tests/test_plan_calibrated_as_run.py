"""`wbrag plan --calibrate` measures what `wbrag run` does: it makes a scratch run of a sample with the run's own
steps (`calibrate.scratch_run`) and reads that run's stats. The utility gate's keep rate is the run's write-back
deciding it (the same top K, prompts, generator service and gate), and the embed stage's fixed cost is the run's own
embed stage timed (a Ray Data pass whose actors start in it), not a bare worker's start and load."""

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
    """The scratch run's scored examples against `score_examples` (what `wbrag writeback` scores) on the session's
    demo run: each question's top K (the run embeds a passage with its title), its closed-book and RAG answers (on
    the tiny models an answer is the prompt's fingerprint: another prompt or another batch answers otherwise) and the
    gate's decision, question by question; and the record the plan reads, made from that run's stats."""
    from wbrag_ray.generation.passes import GeneratorPasses
    from wbrag_ray.plan.calibrate import SAMPLE_QUESTIONS, scratch_run, wilson, writeback_record
    from wbrag_ray.run import RunFolder
    from wbrag_ray.writeback.pipeline import WRITEBACK_TRAINING, base_search, score_examples

    run_dir, _ = demo_run
    rows = [json.loads(line) for line in (DATA / "demo_train.jsonl").read_text().splitlines()]
    assert len(rows) == 30 < SAMPLE_QUESTIONS  # the demo's training set, every question (fewer than the sample)
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    config = _config(tiny, train)
    run = RunFolder(str(run_dir))
    with GeneratorPasses(config.generator) as passes:
        scored = score_examples(run, config, str(train), passes, base_search(run, config)).set_index("id")

    scratch, sample = scratch_run(config, tmp_path / "scratch", writeback=True)
    version = WRITEBACK_TRAINING.instances(sample)[0]["version"]
    mine = scratch.layout.writeback_version(version).scored.read_table().to_pandas().set_index("id")
    assert list(mine.index) == list(scored.index)  # every question of the small file
    for qid, row in mine.iterrows():
        run_row = scored.loc[qid]
        assert [(h["title"], h["text"]) for h in json.loads(row["docs"])] == \
            [(h["title"], h["text"]) for h in json.loads(run_row["docs"])]
        assert (row["s_nr"], row["s_rag"], bool(row["useful"])) == \
            (run_row["s_nr"], run_row["s_rag"], bool(run_row["useful"]))
    # the answers the calibration's gate read are the run's, word for word
    assert mine["nr_answer"].to_dict() == scored["nr_answer"].to_dict()
    assert mine["rag_answer"].to_dict() == scored["rag_answer"].to_dict()

    record = writeback_record(config, scratch, sample, {"device": "cpu"})
    assert record["questions"] == 30 and record["kept"] == int(scored["useful"].sum())
    assert record["kept"] == round(record["keep_rate"] * record["questions"])
    lo, hi = record["keep_interval"]
    assert (lo, hi) == wilson(record["kept"], 30) and lo <= record["keep_rate"] <= hi
    if record["kept"]:
        assert {p["shape"] for p in record["points"]} == {"document gate", "extract", "rewrite"}
    for p in record["points"]:
        assert p["calls"] >= 1 and p["seconds_per_call"] > 0 and p["prompt_tokens"] > 0
        assert 0 <= p["generated_tokens"] <= p["new_tokens"] * 10  # characters / 4 of what it wrote
    assert record["passages_searched"] == record["corpus_passages"] == 100


def test_the_embed_stages_fixed_cost_is_the_runs_embed_stage_timed(tiny, ray_cluster, one_command):
    """Calibration runs the run's own embed stage on the corpus's first passages (the demo corpus's 100, all of it):
    its seconds beyond their tokens at the warm rate are the stage's start (the Ray Data pass, its actors' start,
    imports and load, the write), which the plan adds to the embed stage in place of a bare worker's start and load:
    a corpus no larger than the sample is planned at its own stage's time."""
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
    # the plan's tokens of the corpus are the sample's (characters / 4 of each 'Title\ntext'): the stage's own time
    assert plan.corpus.passages * plan.tokens.passage == pytest.approx(emb["pass_tokens"], rel=0.02)
    assert embed.seconds == pytest.approx(emb["pass_seconds"], rel=0.02)
