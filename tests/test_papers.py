"""The papers' configurations load and validate, depart from their paper in none of the recorded choices, and
the demo defaults say where they do."""

from pathlib import Path

import pytest

from wbrag_ray.config import load_config
from wbrag_ray.papers import WRITEBACK, ZERO_RAG, departures, gate_metric, paper_vs_run

CONFIGS = Path(__file__).resolve().parents[1] / "jobs" / "configs"


@pytest.mark.parametrize(("name", "paper"), [("paper_zero_rag.yaml", ZERO_RAG), ("paper_writeback.yaml", WRITEBACK)])
def test_the_paper_configs_load_and_follow_their_paper(name, paper):
    config = load_config(str(CONFIGS / name))
    assert departures(config, paper) == []


def test_the_demo_defaults_name_each_departure_with_the_papers_choice():
    found = departures(load_config(str(CONFIGS / "zero_rag_demo.yaml")), ZERO_RAG)
    assert any(d.startswith("zerorag.qa_mode: 'cloze'") and "'llm'" in d for d in found)
    assert any(d.startswith("zerorag.pruner: 'embedding'") for d in found)
    assert any(d.startswith("zerorag.tune.targets: 'own'") and "'gold'" in d for d in found)
    defaults = departures(load_config(), WRITEBACK)
    assert any(d.startswith("writeback.dedupe_threshold: 0.95") and "no deduplication" in d for d in defaults)
    assert any(d.startswith("rag.flare.look_ahead_tokens: 32") for d in defaults)
    # the default union is the gate, chosen on a validation half of held-out questions: named against the paper's merge
    assert any(d.startswith("retrieval.union: 'gate'") and "merged by score" in d for d in defaults)
    paper = departures(load_config(overrides=["retrieval.union=score"]), WRITEBACK)
    assert not any(d.startswith("retrieval.union") for d in paper)


def test_the_gate_metric_follows_the_dataset():
    assert [gate_metric(n) for n in ("nq", "NQ_train", "hotpotqa-dev", "fever", "squad", "triviaqa")] == \
        ["acc", "acc", "acc", "f1", "em", "acc"]


def test_an_auto_gate_metric_is_the_papers_metric_for_the_training_set():
    from wbrag_ray.config import WritebackConfig
    from wbrag_ray.writeback.pipeline import with_gate_metric

    assert with_gate_metric(WritebackConfig(metric="auto"), "s3://b/fever_train.jsonl").metric == "f1"
    assert with_gate_metric(WritebackConfig(metric="em"), "s3://b/fever_train.jsonl").metric == "em"


def test_the_dataset_name_follows_flashrags_layout_folder_or_flat_file():
    from wbrag_ray.formats import dataset_name

    assert dataset_name("data/nq/train.jsonl") == "nq"  # FlashRAG: a split file in its dataset's folder
    assert dataset_name("s3://bucket/flashrag/fever/dev.jsonl") == "fever"
    assert dataset_name("squad/test.parquet") == "squad"
    assert dataset_name("nq_train.jsonl") == "nq" and dataset_name("/d/FEVER-dev.jsonl") == "fever"  # flat files
    assert dataset_name("train.jsonl") == "train"  # no folder to name it: the stem
    assert dataset_name("my_questions.jsonl") == "my_questions" and dataset_name("s3://b/train.jsonl") == "train"


def test_the_gate_metric_of_flashrag_files_and_its_departures_are_resolved_not_literal():
    from wbrag_ray.config import WritebackConfig, load_config
    from wbrag_ray.writeback.pipeline import with_gate_metric

    auto = WritebackConfig(metric="auto")
    assert with_gate_metric(auto, "flashrag/fever/train.jsonl").metric == "f1"  # was 'acc': the stem is 'train'
    assert with_gate_metric(auto, "flashrag/squad/train.jsonl").metric == "em"
    assert with_gate_metric(auto, "flashrag/nq/train.jsonl").metric == "acc"

    def metric_departures(metric: str, train: str) -> list[str]:
        config = load_config(overrides=[f"writeback.metric={metric}"])
        return [d for d in departures(config, WRITEBACK, train) if d.startswith("writeback.metric")]

    assert metric_departures("auto", "flashrag/fever/train.jsonl") == []  # resolved as the paper did
    assert metric_departures("f1", "flashrag/fever/train.jsonl") == []  # explicitly the paper's: no departure
    (found,) = metric_departures("acc", "flashrag/fever/train.jsonl")
    assert "'acc' for fever" in found and "paper: 'f1'" in found


def _result(dataset: str, method: str = "naive", version: str | None = None, acc: float = 0.0, **more) -> dict:
    return {"method": method, "dataset": dataset, "writeback_version": version, "router": None, "acc": acc,
            "generator": {"model": "bundled:smollm2"}, **more}


def test_the_papers_headline_rows_sit_beside_the_runs_comparable_results(tmp_path):
    from wbrag_ray.report.paper_rows import paper_section
    from wbrag_ray.run import RunFolder

    results = {
        "t-naive": _result("s3://b/flashrag/nq/test.jsonl", acc=0.3),  # NQ by its folder, base index
        "t-wb-naive": _result("/data/nq_test.jsonl", version="v1", acc=0.345),  # NQ by a flat name, write-back
        "t-replug": _result("/data/nq/test.jsonl", method="replug", acc=0.5),  # another method
        "f-naive": _result("/data/fever/test.jsonl", acc=0.9),  # another dataset
        "t-prune0.3-naive": _result("/data/nq/test.jsonl", acc=0.9),  # a pruned index's evaluation
        "r-naive": _result("/data/nq/test.jsonl", acc=0.9, router="/run/zero_rag/router"),  # routed
    }
    grid = [{"ratio": 0.0, "method": "naive", "retrieval_speedup_pct": 0.0},
            {"ratio": 0.3, "method": "naive", "retrieval_speedup_pct": 18.5},
            {"ratio": 0.3, "method": "naive", "router": True, "retrieval_speedup_pct": 18.5}]
    rows = paper_vs_run(results, grid)
    assert [(r["paper"], r["knowledge_base"], r["paper_value"], r["run_value"], r["run_result"]) for r in rows] == [
        (WRITEBACK, "base", 31.44, 30.0, "t-naive"),
        (WRITEBACK, "write-back", 34.82, 34.5, "t-wb-naive"),
        (ZERO_RAG, "pruned 30%", 22.0, 18.5, "grid naive at ratio 0.3"),
    ]
    assert rows[0]["paper_model"] == "Llama-3.1-8B" and rows[0]["run_model"] == "bundled:smollm2"

    # the report's section reads the run's evaluations; a run with none comparable has no section
    run = RunFolder(str(tmp_path / "run"))
    assert paper_section(run) is None
    run.layout.eval_result("t", "naive").metrics.write_json(results["t-naive"])
    section = paper_section(run)
    assert section.title == "Paper vs this run"
    assert section.tables[0].rows == [["WriteBack-RAG", "nq", "naive", "base", "acc", 31.44, 30.0, "Llama-3.1-8B",
                                       "bundled:smollm2", "t-naive", f"table not recorded; row not recorded; column not "
                                       f"recorded; {rows[0]['source']}", "; ".join(rows[0]["differs"])]]


def test_the_methods_departures_are_named_for_the_methods_and_data_a_run_uses():
    from wbrag_ray.papers import method_departures

    # the paper's Zero-RAG config: its QA writer, retriever, K and dataset; only the segmentation departs
    zero_rag = method_departures(load_config(str(CONFIGS / "paper_zero_rag.yaml")), ZERO_RAG)
    assert zero_rag == ["sentences are split by nupunkt (the Zero-RAG paper's segmentation is its own)"]
    # the target model writing its own QA pairs, another retriever, another dataset: each named
    other = load_config(str(CONFIGS / "paper_zero_rag.yaml"), [
        "zerorag.qa_generator=null", "embedder.model=intfloat/e5-base-v2", "embedder.query_prompt=null",
        "eval.dataset=s3://b/flashrag/nq/test.jsonl", "retrieval.top_k=5"])
    assert method_departures(other, ZERO_RAG) == [*zero_rag,
        "the target model writes its own mastery QA pairs, zerorag.qa_generator unset (the Zero-RAG paper: "
        "GPT-4o-mini writes them, the target model answers)",
        "the retriever is intfloat/e5-base-v2 (the Zero-RAG paper: stella_en_400M_v5)",
        "evaluated on nq (the Zero-RAG paper: triviaqa, popqa, hotpotqa, entityquestions)",
    ]
    assert departures(other, ZERO_RAG) == ["retrieval.top_k: 5 (the Zero-RAG paper: 20, 20 retrieved candidates "
                                           "per query)"]
    # every other of the paper's datasets is one setting away, and departs in nothing more
    for dataset in ("popqa/test", "hotpotqa/dev", "entityquestions/test"):
        again = load_config(str(CONFIGS / "paper_zero_rag.yaml"), [f"eval.dataset=s3://b/flashrag/{dataset}.jsonl"])
        assert method_departures(again, ZERO_RAG) == zero_rag and departures(again, ZERO_RAG) == []
    # WriteBack-RAG: replug-vote and prompted Self-RAG where the run uses them (its paper config does, on vLLM),
    # and the two every run has
    writeback = load_config(str(CONFIGS / "paper_writeback.yaml"))
    assert [d.split(":")[0].split(" (")[0] for d in method_departures(writeback, WRITEBACK)] == [
        "replug-vote stands in for REPLUG", "Self-RAG is prompted",
        "distillation is two calls, extract then rewrite from the extract only",
        "Table 3's lengths are whitespace words"]
    naive = load_config(str(CONFIGS / "paper_writeback.yaml"), ["eval.methods=[no-retrieval, naive]"])
    assert method_departures(naive, WRITEBACK) == method_departures(writeback, WRITEBACK)[2:]
    assert method_departures(naive, ZERO_RAG) == []  # Zero-RAG off in that config


def test_a_runs_departures_are_resolved_and_only_for_the_papers_it_follows():
    from wbrag_ray.papers import papers_followed, run_departures

    # a write-back run on FlashRAG's NQ: only WriteBack-RAG's choices, the default gate metric resolved (acc is the
    # paper's for NQ: no departure), the bundled generator by the model it is
    wb_only = load_config(overrides=["writeback.train=s3://b/flashrag/nq/train.jsonl"])
    assert papers_followed(wb_only) == (WRITEBACK,) and papers_followed(wb_only, True, False) == (WRITEBACK,)
    found = run_departures(wb_only, dataset="s3://b/flashrag/nq/test.jsonl")
    assert found and {d.paper for d in found} == {WRITEBACK}
    assert not any("zerorag." in d.what or "Zero-RAG" in d.what or "top_k" in d.what for d in found)
    assert not any(d.what.startswith("writeback.metric") for d in found)
    auto = load_config(overrides=["writeback.train=s3://b/flashrag/nq/train.jsonl", "writeback.metric=auto"])
    assert not any(d.what.startswith("writeback.metric") for d in run_departures(auto))  # auto -> acc on nq
    assert ("the generator is bundled:smollm2 (SmolLM2-135M-Instruct) (the WriteBack-RAG paper: Llama-3.1-8B and "
            "Gemma-3-12B)") in [d.what for d in found]
    # the same default on FEVER is not the paper's metric; an evaluation outside the paper's six datasets is named
    fever = load_config(overrides=["writeback.train=/d/flashrag/fever/train.jsonl"])
    assert any(d.what.startswith("writeback.metric: 'acc' for fever") for d in run_departures(fever))
    assert any(d.what.startswith("evaluated on my_questions (the WriteBack-RAG paper: nq, boolq, zsre") for d in
               run_departures(wb_only, dataset="/d/my_questions.jsonl"))
    # Zero-RAG: the LM regressor's backbone and training length against the paper config's, a QA writer other
    # than the paper's
    zero_rag = load_config(str(CONFIGS / "paper_zero_rag.yaml"), [
        "zerorag.lm_pruner.backbone=bundled:smollm2", "zerorag.lm_pruner.epochs=1",
        "zerorag.qa_generator.model=Qwen/Qwen2.5-7B-Instruct"])
    whats = [d.what for d in run_departures(zero_rag)]
    assert {d.paper for d in run_departures(zero_rag)} == {ZERO_RAG}
    assert any(w.startswith("zerorag.lm_pruner.backbone: 'bundled:smollm2' (SmolLM2-135M-Instruct) (the Zero-RAG "
                            "paper: 'meta-llama/Llama-3.2-1B'") for w in whats)
    assert any(w.startswith("zerorag.lm_pruner.epochs: 1.0 (the Zero-RAG paper: 2.0") for w in whats)
    assert "Qwen/Qwen2.5-7B-Instruct writes the mastery QA pairs (the Zero-RAG paper: GPT-4o-mini writes them)" in whats
    # an embedding pruner trains no LM regressor: its settings are not compared
    assert not any("lm_pruner" in d.what for d in run_departures(load_config(overrides=["zerorag.enabled=true"])))


def test_each_papers_number_carries_its_source_and_the_run_settings_that_differ_sit_beside_it():
    from wbrag_ray.papers import HEADLINES, NOT_RECORDED, format_paper_vs_run

    for h in HEADLINES:  # paper, table, row, column, metric and where the repository has the number from
        assert all([h.paper, h.table, h.row, h.column, h.metric]) and h.source != NOT_RECORDED
        assert all([h.model, h.retriever, h.top_k, h.answer_form])  # the settings that made it
    assert [h.union for h in HEADLINES] == [None, "score", None]  # the paper's merge beside its write-back number
    paper_like = _result("/d/nq/test.jsonl", version="v1", acc=0.35, generator={"model": "meta-llama/Llama-3.1-8B-Instruct"},
                         embedder="intfloat/e5-base-v2", top_k=5, union={"union": "score"}, answer_form="as generated")
    demo = _result("/d/nq/test.jsonl", version="v1", acc=0.2, embedder="bundled:all-minilm-l6-v2", top_k=3,
                   union={"union": "gate"}, answer_form="span")
    rows = paper_vs_run({"paper-like": paper_like, "demo": demo}, [])
    assert [r["run_result"] for r in rows] == ["paper-like", "demo"] and rows[0]["differs"] == []
    assert rows[1]["differs"] == [
        "generator bundled:smollm2 (SmolLM2-135M-Instruct) (the paper: Llama-3.1-8B)",
        "retriever bundled:all-minilm-l6-v2 (all-MiniLM-L6-v2) (the paper: e5-base-v2)",
        "K 3 (the paper: 5)", "union gate (the paper: score)", "answers scored span (the paper: as generated)"]
    text = format_paper_vs_run(rows)
    assert "source: table not recorded, row not recorded, column not recorded; issue 29" in text
    assert "differs: generator bundled:smollm2" in text and "K 3 (the paper: 5)" in text
    # the Zero-RAG grid's settings are the run's config's
    grid = [{"ratio": 0.3, "method": "naive", "retrieval_speedup_pct": 18.5}]
    (row,) = paper_vs_run({}, grid, load_config(str(CONFIGS / "paper_zero_rag.yaml"), ["retrieval.top_k=5"]))
    assert row["differs"] == ["K 5 (the paper: 20)"] and row["table"].startswith("7 ")
