"""The papers' numbers are cited from their texts (../shared/papers/), each with the settings that made it; a run's
departures come from what made its results and are named whole; the paper-vs-run table compares a result with the
numbers of the same paper, naming every setting that differs."""

import dataclasses
import os
from pathlib import Path

import pytest

from tests.paper_citations import citation_problems
from wbrag_ray.config import load_config
from wbrag_ray.formats import dataset_name
from wbrag_ray.paper_numbers import GEMMA, LLAMA_33_70B, NUMBERS, SAYS, TEXTS, PaperNumber
from wbrag_ray.papers import (
    CHOICES,
    WRITEBACK,
    ZERO_RAG,
    claims_to_follow,
    gate_metric,
    paper_vs_run,
    print_departures,
    run_departures,
)

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "jobs" / "configs"
# ../shared/papers/ from the project root (WBRAG_PAPERS: elsewhere, as from a git worktree)
PAPERS = Path(os.environ.get("WBRAG_PAPERS") or ROOT.parent / "shared" / "papers")


def departures(config, paper: str, train: str | None = None) -> list[str]:
    """The config values of a run following `paper` that differ from the paper's ('path: value (...)')."""
    return [d.what for d in run_departures(config, (paper,), train) if d.kind == "setting"]


def method_departures(config, paper: str) -> list[str]:
    """Where a run following `paper` differs from it beyond config values ('what the run does (the paper: ...)')."""
    return [d.what for d in run_departures(config, (paper,)) if d.kind == "method"]


def _texts() -> dict[str, str]:
    missing = [name for name in TEXTS.values() if not (PAPERS / name).exists()]
    assert not missing, f"the papers' texts are missing from {PAPERS}: {', '.join(missing)} (they are in CI)"
    return {paper: (PAPERS / name).read_text() for paper, name in TEXTS.items()}


def test_every_number_and_statement_is_in_the_text_it_cites():
    assert citation_problems(_texts()) == []


def test_a_number_or_a_quote_the_texts_do_not_hold_fails_the_check():
    texts = {WRITEBACK: "Table 4 ablates three controls (Naive RAG baseline: 31.44% Acc) of the write-back pipeline.",
             ZERO_RAG: "speeds up retrieval by 22%"}
    cited = PaperNumber(WRITEBACK, "Table 4", "baseline", "NQ acc", "acc", "31.44", "(Naive RAG baseline: 31.44% Acc)")
    assert citation_problems(texts, (cited,), {}) == []
    wrong = PaperNumber(WRITEBACK, "Table 4", "baseline", "NQ acc", "acc", "31.4", "(Naive RAG baseline: 31.44% Acc)")
    (problem,) = citation_problems(texts, (wrong,), {})
    assert "31.4 is not in its quote" in problem  # a prefix of a number is not the number
    invented = PaperNumber(ZERO_RAG, "Table 7", "30% pruned", "speedup", "speedup", "25", "speeds up retrieval by 25%")
    assert [p.split(":")[0] for p in citation_problems(texts, (invented,), {})] == ["Zero-RAG Table 7 30% pruned / speedup"]
    # and against the real texts: a number they do not state
    made_up = PaperNumber(ZERO_RAG, "Table 4", "30% pruned", "TriviaQA", "seconds", "9.01",
                          "At 30% pruning these become 10.89 s, 9.09 s, and 9.01 s")
    assert citation_problems(_texts(), (made_up,), {})


def _moved(texts: dict[str, str], *changes: tuple) -> list[str]:
    """The problems of NUMBERS with some numbers changed: (a test of the number, its fields changed)."""
    numbers = list(NUMBERS)
    for test, changed in changes:
        at = next(i for i, n in enumerate(numbers) if test(n))
        numbers[at] = dataclasses.replace(numbers[at], **changed)
    return citation_problems(texts, tuple(numbers), {})


def test_a_number_moved_to_another_table_model_dataset_ratio_row_or_column_fails_the_check():
    texts = _texts()
    assert _moved(texts) == []
    table_4 = [n for n in NUMBERS if n.where == "Table 4" and n.paper == WRITEBACK]
    assert {n.generator for n in table_4} == {None} and {n.dataset for n in table_4} == {"nq"}
    assert {n.method for n in table_4} == {"naive"}  # NQ, the Naive RAG baseline; no LLM named
    (p,) = _moved(texts, (lambda n: n.shown == "31.44", {"where": "Table 3"}))
    assert "names Table 4, not Table 3" in p
    (p,) = _moved(texts, (lambda n: n.shown == "14.65", {"where": "Table 7"}))  # Zero-RAG's latency is Table 4's
    assert "names Table 4, not Table 7" in p
    (p,) = _moved(texts, (lambda n: n.shown == "+2.14", {"where": "§6.2"}))
    assert "not in the text's section §6.2" in p
    # the model: Table 4's default row under Gemma-3-12B (the text names it for Table 3 only); Llama3-70B's row
    (p,) = _moved(texts, (lambda n: n.shown == "34.82" and n.where == "Table 4", {"generator": GEMMA}))
    assert "names no model, not Gemma-3-12B" in p
    (p,) = _moved(texts, (lambda n: n.shown == "30.67", {"generator": LLAMA_33_70B}))
    assert "names Llama3-70B, not Llama3.3-70B" in p
    # the dataset (a number in another column of its row), and one alone in its sentence
    assert any("the text's order ['popqa', 'hotpotqa'" in p
               for p in _moved(texts, (lambda n: n.shown == "34.80", {"dataset": "hotpotqa"})))
    (p,) = _moved(texts, (lambda n: n.shown == "37.89", {"dataset": "nq"}))
    assert "names fever, not nq" in p
    # the pruning ratio
    (p,) = _moved(texts, (lambda n: n.shown == "34.80", {"pruning_ratio": 0.0}))
    assert "pruning ratios [0.3], not 0" in p
    (p,) = _moved(texts, (lambda n: n.shown == "32.91", {"pruning_ratio": 0.3}))
    assert "pruning ratios [0.7], not 0.3" in p
    # the row: two numbers swapped between the rows of one quote
    (p,) = _moved(texts, (lambda n: n.shown == "33.85", {"shown": "33.76"}),
                  (lambda n: n.shown == "33.76" and n.row == "τdoc = 0.10", {"shown": "33.85"}))
    assert "stand in another order" in p
    (p,) = _moved(texts, (lambda n: n.shown == "16.25", {"shown": "16.35"}),
                  (lambda n: n.shown == "16.35" and n.method == "naive", {"shown": "16.25"}))
    assert "column PopQA: 16.35, 16.25 stand in another order" in p


def test_the_numbers_carry_their_settings_and_the_wrong_attributions_are_gone():
    for n in NUMBERS:
        assert n.paper and n.where and n.row and n.column and n.metric and n.quote
        assert n.retriever and (n.paper == ZERO_RAG or n.top_k == 5)
    by = {(n.paper, n.where, n.row, n.shown): n for n in NUMBERS}
    # 31.44 / 34.82: Table 4's baseline and default row, NQ with the Naive RAG baseline; the text names no LLM for it
    base = by[(WRITEBACK, "Table 4", "Naive RAG baseline", "31.44")]
    default = next(n for n in NUMBERS if n.shown == "34.82" and n.row.startswith("default"))
    assert (base.generator, base.dataset, base.method, base.knowledge_base) == (None, "nq", "naive", "base")
    assert (default.generator, default.knowledge_base, default.where) == (None, "write-back", "Table 4")
    # Same-WB and Cross-WB are Figure 4's; Table 3's numbers are Gemma-3-12B's
    assert {n.where for n in NUMBERS if n.row.startswith(("Same-WB", "Cross-WB"))} == {"Figure 4"}
    assert {n.generator for n in NUMBERS if n.where == "Table 3"} == {"Gemma-3-12B"}
    # Zero-RAG: the 22% is the summary's opening section's; Table 4 is latency, Table 7 total time
    assert {n.where for n in NUMBERS if n.shown == "22"} == {"What This Paper Is About"}
    assert {n.metric for n in NUMBERS if n.where == "Table 4" and n.paper == ZERO_RAG} == {"seconds"}
    assert {n.metric for n in NUMBERS if n.where == "Table 7"} == {"total_seconds"}
    # the numbers the issue lists as missing are there
    shown = {(n.paper, n.shown) for n in NUMBERS}
    for number in ("35.78", "51.28", "82.69", "63.70", "34.80", "60.43", "32.91", "56.29", "16.35", "38.94", "80.55",
                   "35.17", "21.29", "43.19", "30.67", "12.28", "9.66", "717.13", "441.80"):
        assert (ZERO_RAG, number) in shown
    for number in ("+2.14", "+2.29", "+2.40", "+1.90", "+1.99", "+1.92", "+2.36", "34.24", "32.77", "37.89", "34.89",
                   "33.85", "33.76", "33.19", "12,295", "79,168", "220", "0.5"):
        assert (WRITEBACK, number) in shown
    # FEVER's numbers: the text does not say under which LLM
    assert {n.generator for n in NUMBERS if n.dataset == "fever" and n.where == "§6.1" and n.metric == "f1"} == {None}


@pytest.mark.parametrize(("name", "paper"), [("paper_zero_rag.yaml", ZERO_RAG), ("paper_writeback.yaml", WRITEBACK)])
def test_the_paper_configs_set_every_value_their_paper_states(name, paper):
    assert departures(load_config(str(CONFIGS / name)), paper) == []


def test_the_paper_zero_rag_config_names_its_method_departures_the_7b_backbone_among_them(capsys):
    config = load_config(str(CONFIGS / "paper_zero_rag.yaml"))
    found = method_departures(config, ZERO_RAG)
    assert ("the LM pruner's backbone is meta-llama/Llama-3.2-1B, a 1B model (the Zero-RAG paper: a 7B model trained "
            "to predict a 70B model's mastery)") in found
    assert any(d.startswith("the pruner drops the sentences of highest predicted mastery, as the paper's Appendix A.1")
               for d in found)
    assert "the retrieval candidates are sentences: 20 retrieved sentences per query (the Zero-RAG paper: 20 document " \
           "candidates per query)" in found
    assert "sentences are split by nupunkt (the Zero-RAG paper: NLTK's sentence tokenizer)" in found
    # a 7B backbone is the paper's size; its training length is not in the text, so none is compared
    seven = load_config(str(CONFIGS / "paper_zero_rag.yaml"), ["zerorag.lm_pruner.backbone=Qwen/Qwen2.5-7B",
                                                                "zerorag.lm_pruner.epochs=5"])
    assert not any("backbone" in d or "epochs" in d for d in
                   [*method_departures(seven, ZERO_RAG), *departures(seven, ZERO_RAG)])
    # it claims to follow the paper (its generator is the paper's): the block is printed, one line a departure
    assert claims_to_follow(config, (ZERO_RAG,))
    print_departures(config)
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "this run departs from Zero-RAG in:" and len(printed) == 1 + len(run_departures(config))
    assert any("a 7B model" in line for line in printed)


def test_wbrag_plan_on_the_paper_zero_rag_config_lists_the_backbone_departure(capsys):
    from wbrag_ray.cli import main

    assert main(["plan", str(CONFIGS / "paper_zero_rag.yaml"), "--nodes", "4", "--gpus-per-node", "8",
                 "--cpus-per-node", "96", "--memory-per-node", "1024"]) in (0, 2)
    out = capsys.readouterr().out
    assert "this run departs from Zero-RAG in:" in out and "meta-llama/Llama-3.2-1B, a 1B model" in out


def test_a_demo_config_prints_one_line_with_the_count_and_where_they_are_listed(capsys):
    demo = load_config(str(CONFIGS / "zero_rag_demo.yaml"))
    assert not claims_to_follow(demo, (ZERO_RAG,))
    found = print_departures(demo)
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith(f"this run departs from Zero-RAG in {len(found)} choices") and "metrics.json" in line


def test_the_demo_defaults_name_each_departure_with_the_papers_words():
    found = run_departures(load_config(str(CONFIGS / "zero_rag_demo.yaml")), (ZERO_RAG,))
    whats = [d.what for d in found]
    assert any(w.startswith("zerorag.qa_mode: 'cloze'") and "'llm'" in w for w in whats)
    assert any(w.startswith("zerorag.pruner: 'embedding'") for w in whats)
    assert any(w.startswith("zerorag.tune.targets: 'own'") for w in whats)
    # own targets drop the rows the model answers wrong: named as what it is
    assert any(w.startswith("noise-tolerant tuning keeps only the rows whose own answer holds a gold answer") for w in whats)
    for d in found:  # each cites the paper's words, or says whose choice it is
        assert d.cites, d.what
    defaults = run_departures(load_config(overrides=["writeback.train=s3://b/flashrag/nq/train.jsonl"]), (WRITEBACK,))
    whats = [d.what for d in defaults]
    assert any(w.startswith("writeback.dedupe_threshold: 0.95") and "no deduplication" in w for w in whats)
    assert any(w.startswith("writeback.validation: 'auto'") for w in whats)
    flare = next(d for d in defaults if d.what.startswith("rag.flare.look_ahead_tokens: 32"))
    assert "(FlashRAG's default, which the WriteBack-RAG text does not state: 64" in flare.what  # not the paper's
    assert any(w.startswith("the utility gate keeps delta > tau_delta = 0.01") for w in whats)
    assert any(w.startswith("the distiller's output is grounded by heuristics") for w in whats)
    paper = departures(load_config(overrides=["retrieval.union=score"]), WRITEBACK)
    assert not any(d.startswith("retrieval.union") for d in paper)
    assert any(d.startswith("writeback.tau_doc: 0.05") for d in departures(
        load_config(overrides=["writeback.tau_doc=0.05"]), WRITEBACK))


def test_the_distiller_heuristics_named_are_the_codes():
    import inspect

    from wbrag_ray.writeback.distill import MIN_OVERLAP, ground_extraction, parse_unit

    assert MIN_OVERLAP == 0.6  # the share the departure line names
    assert "[:2]" in inspect.getsource(ground_extraction)  # the two source sentences nearest the question
    assert parse_unit("Title\nThe answer is: Paris is the capital of France.", "", "t") == (
        "Title", "Paris is the capital of France.")


def test_the_gate_metric_follows_the_dataset():
    assert [gate_metric(n) for n in ("nq", "NQ_train", "hotpotqa-dev", "fever", "squad", "triviaqa")] == \
        ["acc", "acc", "acc", "f1", "em", "acc"]


def test_an_auto_gate_metric_is_the_papers_metric_for_the_training_set():
    from wbrag_ray.config import WritebackConfig
    from wbrag_ray.writeback.pipeline import with_gate_metric

    assert with_gate_metric(WritebackConfig(metric="auto"), "s3://b/fever_train.jsonl").metric == "f1"
    assert with_gate_metric(WritebackConfig(metric="em"), "s3://b/fever_train.jsonl").metric == "em"
    assert with_gate_metric(WritebackConfig(metric="auto"), "flashrag/squad/train.jsonl").metric == "em"

    def metric_departures(metric: str, train: str) -> list[str]:
        config = load_config(overrides=[f"writeback.metric={metric}"])
        return [d for d in departures(config, WRITEBACK, train) if d.startswith("writeback.metric")]

    assert metric_departures("auto", "flashrag/fever/train.jsonl") == []  # resolved as the paper did
    (found,) = metric_departures("acc", "flashrag/fever/train.jsonl")
    assert "'acc' for fever" in found and "paper: 'f1'" in found


def test_the_dataset_name_follows_flashrags_layout_folder_or_flat_file():
    from wbrag_ray.formats import dataset_name

    assert dataset_name("data/nq/train.jsonl") == "nq" and dataset_name("s3://bucket/flashrag/fever/dev.jsonl") == "fever"
    assert dataset_name("nq_train.jsonl") == "nq" and dataset_name("/d/FEVER-dev.jsonl") == "fever"
    assert dataset_name("train.jsonl") == "train" and dataset_name("my_questions.jsonl") == "my_questions"


def test_the_methods_departures_for_the_models_and_data_a_run_uses():
    other = load_config(str(CONFIGS / "paper_zero_rag.yaml"), [
        "zerorag.qa_generator=null", "embedder.model=intfloat/e5-base-v2", "embedder.query_prompt=null",
        "eval.dataset=s3://b/flashrag/nq/test.jsonl", "retrieval.top_k=5"])
    found = method_departures(other, ZERO_RAG)
    assert "the retriever is intfloat/e5-base-v2 (the Zero-RAG paper: stella_en_400M_v5)" in found
    assert "evaluated on nq (the Zero-RAG paper: triviaqa, popqa, hotpotqa, entityquestions)" in found
    assert any(d.startswith("the target model writes its own mastery QA pairs") for d in found)
    assert departures(other, ZERO_RAG) == ["retrieval.top_k: 5 (the Zero-RAG paper: 20, 20 document candidates per "
                                           "query)"]
    writeback = load_config(str(CONFIGS / "paper_writeback.yaml"))
    assert [d.split(":")[0].split(" (")[0] for d in method_departures(writeback, WRITEBACK)][:2] == [
        "replug-vote stands in for REPLUG", "Self-RAG is prompted"]
    assert method_departures(writeback, ZERO_RAG) == []  # Zero-RAG off in that config


def _result(dataset: str, method: str = "naive", acc: float = 0.0, **made) -> dict:
    """metrics.json as an evaluation writes it (its `made_by` record)."""
    base = {"dataset": dataset_name(dataset), "questions": {"dataset": dataset, "n": 100, "limit": None}, "method": method,
            "generator": "meta-llama/Llama-3.1-8B-Instruct", "retriever": "intfloat/e5-base-v2", "top_k": 5,
            "answer_form": "as generated", "union": None, "writeback": None, "adapter": None, "router": False,
            "pruning_ratio": 0.0}
    return {"method": method, "dataset": dataset, "acc": acc, "em": acc, "f1": acc, "made_by": {**base, **made}}


PAPER_VERSION = {"version": "v", "tau_s": 0.1, "tau_delta": 0.01, "tau_doc": 0.01, "n_min": 2, "dedupe_threshold": None,
                 "validation": None, "limit": None, "rag_method": "naive", "train": "/d/flashrag/nq/train.jsonl"}


def test_a_result_is_set_beside_the_same_papers_number_and_every_setting_that_differs_is_named():
    results = {
        "llama-naive": _result("/d/flashrag/nq/test.jsonl", acc=0.31),
        "gemma-wb": _result("/d/nq/test.jsonl", acc=0.35, generator="google/gemma-3-12b-it", union="score",
                            writeback=PAPER_VERSION),
        "deduped-wb": _result("/d/nq/test.jsonl", acc=0.36, union="provenance", top_k=3, answer_form="span",
                              questions={"dataset": "/d/nq/test.jsonl", "n": 40, "limit": 40},
                              writeback={**PAPER_VERSION, "dedupe_threshold": 0.95, "validation": "auto", "limit": 80,
                                         "held_out": 16, "examples": 64}),
        "small-wb": _result("/d/nq/test.jsonl", acc=0.35, generator="google/gemma-3-12b-it", union="score",
                            writeback={**PAPER_VERSION, "validation": "auto", "held_out": 0}),  # none held out
        "tau-doc-wb": _result("/d/nq/test.jsonl", acc=0.338, generator="google/gemma-3-12b-it", union="score",
                              writeback={**PAPER_VERSION, "tau_doc": 0.05}),
        "adapter-nq": _result("/d/nq/test.jsonl", acc=0.5, adapter={"targets": "own"}),  # a Zero-RAG setting
        "zr-triviaqa": _result("/d/triviaqa/test.jsonl", acc=0.8, adapter={"targets": "own", "learning_rate": 3e-4},
                               router=True, pruning_ratio=0.3, top_k=20),
    }
    rows = paper_vs_run(results)
    got = {(r["run_result"], r["where"], r["row"], r["paper_shown"]) for r in rows}
    assert ("llama-naive", "Table 4", "Naive RAG baseline", "31.44") in got
    assert ("gemma-wb", "Table 4", "default (τs 0.1, τdoc 0.01, n_min 2)", "34.82") in got
    assert ("tau-doc-wb", "Table 4", "τdoc = 0.05", "33.85") in got  # the row of the version's changed gate
    assert not any(r["run_result"] == "tau-doc-wb" and r["paper_shown"] == "34.82" for r in rows)
    assert not any(r["run_result"] == "adapter-nq" for r in rows)  # never beside WriteBack-RAG's numbers
    assert ("zr-triviaqa", "Main Findings", "Zero-RAG, 30% pruned", "82.42") in got
    assert not any(r["run_result"] == "zr-triviaqa" and r["paper"] == WRITEBACK for r in rows)

    def differs(name: str, shown: str) -> list[str]:
        return next(r["differs"] for r in rows if r["run_result"] == name and r["paper_shown"] == shown)

    # Table 4 names no LLM: the run's is named against "not stated"; a run with the paper's version: nothing else
    assert differs("llama-naive", "31.44") == ["generator meta-llama/Llama-3.1-8B-Instruct (the paper: not stated)"]
    assert differs("gemma-wb", "34.82") == ["generator google/gemma-3-12b-it (the paper: not stated)"]
    assert differs("deduped-wb", "34.82")[1:] == [
        "K 3 (the paper: 5)", "answers scored span (the paper: as generated)",
        "the first 40 questions of /d/nq/test.jsonl (eval.limit 40; the paper: the whole test set)",
        "deduplicated at 0.95 (the paper: no deduplication)",
        "16 training questions held out for validation (writeback.validation 'auto'; the paper: every one trained on)",
        "trained on the first 80 training questions (the paper: every one)",
        "written back from 64 training questions (the paper: NQ's 79,168)",
        "union provenance (the paper: score, the merge into one top K)"]
    assert differs("small-wb", "34.82")[1:] == []  # validation 'auto' that held out none of its questions
    assert "adapter tuned to targets 'own', only the rows it answered right (the paper: every training query, in three " \
        "formats)" in differs("zr-triviaqa", "82.42")
    # one row per setting: the paper's main model's where the run's generator is none it ran
    assert [r["paper_model"] for r in rows if r["run_result"] == "zr-triviaqa"] == ["Llama3.3-70B"]


def test_zero_rags_retrieval_speedup_is_set_beside_the_overviews_and_table_4s():
    grid = [{"ratio": 0.3, "method": "naive", "retrieval_speedup_pct": 18.5}]
    config = load_config(str(CONFIGS / "paper_zero_rag.yaml"), ["retrieval.top_k=5"])
    rows = paper_vs_run({}, grid, config, "/d/triviaqa/test.jsonl")
    assert [(r["where"], r["paper_value"], r["run_value"]) for r in rows] == [
        ("What This Paper Is About", 22.0, 18.5), ("Table 4", 19.93, 18.5)]  # 100 x (1 - 9.00 / 11.24)
    assert rows[1]["paper_shown"] == "19.93 (100 x (1 - 9.00 / 11.24))"
    assert rows[0]["differs"] == ["K 5 (the paper: 20)"]


def test_every_statement_a_departure_cites_is_a_key_of_says():
    assert {c.cites for c in CHOICES if c.cites} <= set(SAYS)
    assert all(c.cites or c.source for c in CHOICES)  # the paper's words, or whose choice it is


def test_an_evaluations_departures_come_from_the_version_and_adapter_that_made_it(tmp_path):
    """Hand-written records, as the write-back and tuning stages write them (the stages themselves run in
    tests/pipelines/test_departures_recorded.py): the evaluating config's values do not hide the version's."""
    from wbrag_ray.evaluation.made_by import made_by, made_config
    from wbrag_ray.retrieval.union import UnionRule, write_choice
    from wbrag_ray.run import RunFolder
    from wbrag_ray.writeback.versions import WRITEBACK as WRITEBACK_STAGE
    from wbrag_ray.zerorag.tune import TUNE

    def _departures(run, config, dataset, version=None, adapter=False):
        made, facts = made_config(run, config, version, adapter)
        return run_departures(made, dataset=dataset, made=facts)

    run = RunFolder(str(tmp_path / "run"))
    train = "/d/flashrag/nq/train.jsonl"
    made = load_config(overrides=[f"writeback.train={train}", "writeback.dedupe_threshold=0.95",
                                  "writeback.limit=80", "zerorag.tune.targets=own"])
    params = {"version": "v", "train": train, "method": None}
    folder = run.layout.writeback_version("v")
    folder.index.mkdir()
    folder.stats.write_json({"version": "v", "rag_method": "naive", "gate_metric": "acc",
                             "units_dropped": {"bare answer": 2, "unsupported by its source passages": 1},
                             "settings": run.fingerprint(WRITEBACK_STAGE, made, params)})
    tune = {"rows_built": 90, "rows_without_own_answer": 40, "settings": run.fingerprint(TUNE, made)}
    run.mark_complete(TUNE.name, tune)
    # evaluated under the paper's settings: no deduplication, every question, gold targets, the paper's union
    paper_like = load_config(overrides=["writeback.dedupe_threshold=null", "writeback.validation=null",
                                        "zerorag.tune.targets=gold", "retrieval.union=auto"])
    found = [d.what for d in _departures(run, paper_like, "/d/nq/test.jsonl", "v")]
    assert any(w.startswith("writeback.dedupe_threshold: 0.95") for w in found)
    assert any(w.startswith("writeback.validation: 'auto'") for w in found)
    assert any(w.startswith("3 distilled rewrites or units of the version were dropped by its statement check")
               for w in found)
    # auto searches this version with its fallback rule (no choice written): that rule is named
    assert any(w.startswith("retrieval.union: 'provenance'") for w in found)
    write_choice(folder.index, UnionRule("score"), "chosen by this test")
    assert not any(w.startswith("retrieval.union") for w in
                   (d.what for d in _departures(run, paper_like, "/d/nq/test.jsonl", "v")))
    record = made_by(run, paper_like, "/d/nq/test.jsonl", 10, "naive", "v", None, None)
    assert record["writeback"]["dedupe_threshold"] == 0.95 and record["writeback"]["limit"] == 80
    assert record["union"] == "score" and record["pruning_ratio"] == 0.0 and record["dataset"] == "nq"
    # with the run's adapter: its own targets, and the rows they dropped
    adapted = load_config(overrides=["zerorag.tune.enabled=true", "zerorag.tune.targets=gold"])
    found = [d.what for d in _departures(run, adapted, "/d/triviaqa/test.jsonl", adapter=True)]
    assert any(w.startswith("zerorag.tune.targets: 'own'") for w in found)
    assert any("targets: own): 40 of 90 rows dropped: the model is tuned only on questions it already answers" in w
               for w in found)


def test_the_router_the_tuning_formats_and_flare_are_named_with_their_config_keys():
    demo = load_config(str(CONFIGS / "zero_rag_demo.yaml"))
    whats = [d.what for d in run_departures(demo, (ZERO_RAG,))]
    labels = next(w for w in whats if w.startswith("the query router's labels"))
    assert "zerorag.router_metric" in labels and "the tuned adapter" in labels
    assert any(w.startswith("the query router is a class-balanced logistic regression") and
               "zerorag.router_threshold = 0.5" in w for w in whats)
    formats = next(w for w in whats if w.startswith("noise-tolerant tuning builds its three formats"))
    assert "max(retrieval.top_k, zerorag.tune.retrieve_k) = 10 documents" in formats
    assert "the best-ranked deeper one that does, injected last" in formats
    assert "no relevant row" in formats and "without a gold answer no rows" in formats
    untuned = [d.what for d in run_departures(load_config(str(CONFIGS / "zero_rag_demo.yaml"),
                                                          ["zerorag.tune.enabled=false"]), (ZERO_RAG,))]
    assert any(w.startswith("the query router's labels") and "the untuned generator (zerorag.tune.enabled: false)"
               in w for w in untuned)
    assert not any(w.startswith("noise-tolerant tuning builds") for w in untuned)
    for d in run_departures(demo, (ZERO_RAG,)):
        assert d.cites, d.what
    paper = load_config(str(CONFIGS / "paper_writeback.yaml"))
    flare = next(w for w in method_departures(paper, WRITEBACK) if w.startswith("FLARE retrieves"))
    assert "rag.flare.threshold = 0.2" in flare and "rag.flare.max_rounds x rag.flare.look_ahead_tokens = 5 x 64 = 320" \
        in flare and "at most 256 tokens" in flare
    self_rag = next(w for w in method_departures(paper, WRITEBACK) if w.startswith("Self-RAG is prompted"))
    assert "fine-tuned" not in self_rag and "same LLM" in self_rag
    assert any(d.startswith("rag.flare.threshold: 0.5 (FlashRAG's default") for d in departures(
        load_config(overrides=["rag.flare.threshold=0.5"]), WRITEBACK))


def test_a_pruning_ratio_zero_rag_does_not_report_is_a_departure():
    found = method_departures(load_config(str(CONFIGS / "paper_zero_rag.yaml")), ZERO_RAG)
    assert "zerorag.ratios prunes at 0.5 too, a ratio the Zero-RAG paper does not report (the Zero-RAG paper: 0, 30 " \
           "and 70% pruning)" in found
    reported = load_config(str(CONFIGS / "paper_zero_rag.yaml"), ["zerorag.ratios=[0.3,0.7]"])
    assert not any(d.startswith("zerorag.ratios") for d in method_departures(reported, ZERO_RAG))


def test_answers_that_can_depend_on_their_batch_are_a_departure():
    """generator.batch_invariant in effect off (auto on a tensor-parallel replica, or false): named for each paper
    followed; on (auto on one GPU, or true): nothing to say."""
    zero_rag = load_config(str(CONFIGS / "paper_zero_rag.yaml"))  # tensor_parallel_size auto: not decided yet
    tp4 = load_config(str(CONFIGS / "paper_zero_rag.yaml"), ["generator.tensor_parallel_size=4",
                                                              "generator.num_gpus=4"])

    def said(config, paper=ZERO_RAG):
        return [d for d in run_departures(config, (paper,)) if d.what.startswith("generator.batch_invariant")]

    [undecided] = said(zero_rag)
    assert "which tensor_parallel_size auto may choose" in undecided.what and undecided.cites
    [off] = said(tp4)
    assert off.what.startswith("generator.batch_invariant auto: off for a tensor-parallel replica: a greedy answer "
                               "can depend on the prompts batched with it")
    assert said(tp4, WRITEBACK) and not said(load_config(str(CONFIGS / "paper_zero_rag.yaml"), [
        "generator.tensor_parallel_size=4", "generator.num_gpus=4", "generator.batch_invariant=true"]))
    assert not said(load_config(str(CONFIGS / "zero_rag_demo.yaml")))  # hf on one device: on
    [false] = said(load_config(str(CONFIGS / "zero_rag_demo.yaml"), ["generator.batch_invariant=false"]))
    assert false.what.startswith("generator.batch_invariant false: ")
