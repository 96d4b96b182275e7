"""The papers' configurations load and validate, depart from their paper in none of the recorded choices, and
the demo defaults say where they do."""

from pathlib import Path

import pytest

from wbrag_ray.config import load_config
from wbrag_ray.papers import WRITEBACK, ZERO_RAG, departures, gate_metric

CONFIGS = Path(__file__).resolve().parents[1] / "jobs" / "configs"


@pytest.mark.parametrize(("name", "paper"), [("paper_zero_rag.yaml", ZERO_RAG), ("paper_writeback.yaml", WRITEBACK)])
def test_the_paper_configs_load_and_follow_their_paper(name, paper):
    config = load_config(str(CONFIGS / name))
    assert departures(config, paper) == []


def test_the_demo_defaults_name_each_departure_with_the_papers_choice():
    found = departures(load_config(str(CONFIGS / "zero_rag_demo.yaml")), ZERO_RAG)
    assert any(d.startswith("zerorag.qa_mode: 'cloze'") and "'llm'" in d for d in found)
    assert any(d.startswith("zerorag.pruner: 'embedding'") for d in found)
    defaults = departures(load_config(), WRITEBACK)
    assert any(d.startswith("writeback.dedupe_threshold: 0.95") and "no deduplication" in d for d in defaults)
    assert any(d.startswith("rag.flare.look_ahead_tokens: 32") for d in defaults)


def test_the_gate_metric_follows_the_dataset():
    assert [gate_metric(n) for n in ("nq", "NQ_train", "hotpotqa-dev", "fever", "squad", "triviaqa")] == \
        ["acc", "acc", "acc", "f1", "em", "acc"]


def test_an_auto_gate_metric_is_the_papers_metric_for_the_training_set():
    from wbrag_ray.config import WritebackConfig
    from wbrag_ray.writeback.pipeline import with_gate_metric

    assert with_gate_metric(WritebackConfig(metric="auto"), "s3://b/fever_train.jsonl").metric == "f1"
    assert with_gate_metric(WritebackConfig(metric="em"), "s3://b/fever_train.jsonl").metric == "em"
