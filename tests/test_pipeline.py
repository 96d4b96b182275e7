"""The stage registry (wbrag_ray.pipeline): `wbrag run` executes it, `wbrag plan` prices it, both in the same order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from wbrag_ray.config import load_config
from wbrag_ray.pipeline import PIPELINE, instances
from wbrag_ray.placement import stated_cluster
from wbrag_ray.plan.planner import make_plan

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "wbrag_ray" / "data"


def _config(name: str, *overrides: str):
    return load_config(str(ROOT / "jobs" / "configs" / name), list(overrides))


def test_every_stage_declares_its_outputs_and_its_work_once():
    names = [stage.title or stage.name for stage in PIPELINE]
    assert len(names) == len(set(names))
    for stage in PIPELINE:
        assert stage.outputs and callable(stage.work) and callable(stage.run), stage.name
        assert stage.command or stage.fix, stage.name  # how a person makes it, named when it is missing


@pytest.mark.parametrize("config, expected", [
    ("writeback_demo.yaml", ["ingest", "embed", "index", "write-back training", "evaluation",
                             "evaluation with write-back"]),
    ("zero_rag_demo.yaml", ["ingest", "embed", "index", "mastery", "pruner training (embedding head)",
                            "pruner training (LM regressor)", "prediction (embedding pruner)", "pruning at 0.3",
                            "pruning at 0.5", "pruning at 0.7", "tuning: LoRA training", "router", "evaluation grid"]),
])
def test_the_plan_prices_the_stages_the_run_makes_in_its_order(config, expected):
    c = _config(config, f"ingest.corpus={DATA / 'demo_corpus.jsonl'}", f"eval.dataset={DATA / 'demo_qa.jsonl'}")
    run_order = [stage.heading(params) for stage, params in instances(c)]
    plan = make_plan(c, stated_cluster(1, 0, 2, 24, 80))
    planned = [s.name for s in plan.stages if s.measured_by]  # a search priced before its stage has no run stage
    assert run_order == expected
    assert planned == run_order


@pytest.fixture
def toy_stage():
    """A stage a developer adds: its fingerprint, its work declared as data and how it runs, in one declaration."""
    from wbrag_ray.build_kb import INGEST
    from wbrag_ray.run import RunStage
    from wbrag_ray.work import ReadCorpus

    def run_toy(folder, config, force, services, params):
        passages = folder.stats(INGEST.name)["rows_out"]
        return folder.execute(toy, config, lambda: {"rows_in": passages, "rows_out": passages}, force=force)

    toy = RunStage("toy", settings=("ingest.max_passage_chars",), requires=(INGEST,), command="wbrag run CONFIG",
                   title="toy count", work=lambda config, sizes, params: [ReadCorpus(sizes.passages)], run=run_toy,
                   outputs=("_stages/toy/stats.json",))
    return toy


def test_a_stage_added_to_the_registry_is_planned_and_run(ray_cluster, toy_stage, tmp_path, monkeypatch):
    import wbrag_ray.pipeline as pipeline
    from wbrag_ray.build_kb import INGEST
    from wbrag_ray.cli import main

    monkeypatch.setattr(pipeline, "PIPELINE", [INGEST, toy_stage])
    run = tmp_path / "run"
    config = ROOT / "jobs" / "configs" / "writeback_demo.yaml"
    assert main(["run", str(config), "--run", str(run), "--set", f"ingest.corpus={DATA / 'demo_corpus.jsonl'}",
                 "--set", "writeback.train=null", "--set", "eval.dataset=null"]) == 0
    planned = json.loads((run / "plan" / "plan.json").read_text())["stages"]
    assert [s["name"] for s in planned] == ["ingest", "toy count"]
    toy = json.loads((run / "_stages" / "toy" / "stats.json").read_text())
    assert toy["rows_out"] == toy["rows_in"] > 0
    from wbrag_ray.plan.against_run import planned_vs_measured
    from wbrag_ray.run import RunFolder

    folder = RunFolder(str(run))
    rows = planned_vs_measured({"stages": planned}, {n: folder.stats(n) for n in folder.completed_stages()})
    assert rows[1]["stage"] == "toy count" and rows[1]["run_stages"] == ["toy"] and rows[1]["measured_s"] is not None
