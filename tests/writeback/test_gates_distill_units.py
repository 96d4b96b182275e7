"""WriteBack-RAG's gates, distiller stages, dedupe and statistics on hand-made scores and answers (no model),
plus the RAG methods' fan-out / fan-in that feeds them."""

import json

import numpy as np
import pandas as pd
import pytest

from wbrag_ray import rag
from wbrag_ray.config import WritebackConfig
from wbrag_ray.retrieval.hits import Hit, hits_to_json
from wbrag_ray.writeback.distill import dedupe, distill, ground_extraction, parse_unit, table3
from wbrag_ray.writeback.gates import document_gate, document_scores, utility_gate, utility_scores

SENTINEL = "Zorblax-7"  # a gold answer that occurs in no question and no document


def _hits(n=5):
    titles = ["Amazon River", "Nile", "Pacific Ocean", "Sahara Desert", "Moon"]
    texts = [
        "The Amazon River flows across South America. It empties into the Atlantic Ocean.",
        "The Nile flows north through Egypt. It drains into the Mediterranean Sea.",
        "The Pacific Ocean is the largest ocean. Magellan gave it its name.",
        "The Sahara is the largest hot desert. It covers much of North Africa.",
        "The Moon is Earth's only natural satellite. Its gravity causes the tides.",
    ]
    return [Hit(100 + j, 0.9 - 0.1 * j, j, titles[j], texts[j]) for j in range(n)]


# --- utility gate ---------------------------------------------------------------------------------------


def test_utility_gate_keeps_exactly_what_its_rule_keeps():
    # (s_nr, s_rag) -> kept?   rule: s_rag >= 0.1 and s_rag - s_nr > 0.01
    cases = {
        (0.0, 1.0): True,
        (1.0, 1.0): False,  # retrieval does not help
        (0.0, 0.1): True,  # s_rag exactly at tau_s passes
        (0.0, 0.09): False,  # below tau_s
        (0.5, 0.51): False,  # delta exactly 0.01 is not > tau_delta
        (0.5, 0.52): True,
        (0.8, 0.3): False,  # retrieval hurts
    }
    for (s_nr, s_rag), expected in cases.items():
        assert utility_gate(s_rag, s_nr, 0.1, 0.01) is expected, (s_nr, s_rag)


def test_utility_gate_stage_scores_answers_with_the_task_metric():
    batch = pd.DataFrame(
        {
            "id": ["a", "b", "c", "d"],
            "golden_answers": [["Paris"], ["1859"], ["Titan"], ["Edmund Hillary", "Hillary"]],
            "nr_answer": ["London", "1859", "Mars", "Sir Edmund Hillary"],
            "rag_answer": ["It is Paris.", "1859", "Titan", "Tenzing"],
        }
    )
    out = utility_scores(batch, WritebackConfig(metric="acc"))
    assert out["s_nr"].tolist() == [0.0, 1.0, 0.0, 1.0]
    assert out["s_rag"].tolist() == [1.0, 1.0, 1.0, 0.0]
    assert out["useful"].tolist() == [True, False, True, False]
    em = utility_scores(batch.drop(columns=["s_nr", "s_rag", "delta", "useful"]), WritebackConfig(metric="em"))
    assert em["s_rag"].tolist() == [0.0, 1.0, 1.0, 0.0]  # "It is Paris." is acc but not em


# --- document gate --------------------------------------------------------------------------------------


def test_document_gate_keeps_documents_that_beat_no_retrieval():
    assert document_gate([1.0, 0.0, 1.0, 0.0, 0.5], 0.0, 0.01, 2) == ([0, 2, 4], False)
    assert document_gate([1.0, 0.0, 1.0, 0.0, 0.5], 0.5, 0.01, 2) == ([0, 2], False)
    assert document_gate([0.52, 0.51], 0.5, 0.01, 2) == ([0], False)  # 0.51 - 0.5 is not > 0.01


def test_document_gate_falls_back_to_top_n_min_by_rank_when_none_pass():
    assert document_gate([0.0, 0.0, 0.0, 0.0, 0.0], 0.0, 0.01, 2) == ([0, 1], True)
    assert document_gate([1.0, 1.0, 1.0], 1.0, 0.01, 2) == ([0, 1], True)
    assert document_gate([0.0], 0.0, 0.01, 2) == ([0], True)  # fewer documents than n_min


def test_document_gate_stage_scores_each_document_alone():
    batch = pd.DataFrame(
        {
            "id": ["a", "b"],
            "golden_answers": [["Atlantic Ocean"], ["Khartoum"]],
            "s_nr": [0.0, 0.0],
            "doc_answers": [
                json.dumps(["Pacific", "the Atlantic Ocean", "Atlantic ocean.", "no idea", "Arctic"]),
                json.dumps(["Cairo", "Aswan", "Alexandria", "Giza", "Luxor"]),
            ],
        }
    )
    out = document_scores(batch, WritebackConfig())
    assert json.loads(out["doc_scores"][0]) == [0.0, 1.0, 1.0, 0.0, 0.0]
    assert [json.loads(k) for k in out["kept_ranks"]] == [[1, 2], [0, 1]]
    assert out["fallback"].tolist() == [False, True]


# --- RePlug and the fan-out / fan-in ----------------------------------------------------------------------


def test_replug_weights_and_weighted_vote():
    w = rag.replug_weights([0.9, 0.8, 0.7], temperature=0.1)
    assert sum(w) == pytest.approx(1.0) and w[0] > w[1] > w[2]
    # two weaker documents that agree outweigh the strongest one alone; answers are compared normalized
    assert rag.weighted_vote(["Paris", "the Lyon.", "Lyon"], [0.4, 0.35, 0.25]) == "the Lyon."
    assert rag.weighted_vote(["A", "B"], [0.5, 0.5]) == "A"  # ties go to the better rank


def test_expand_and_combine_round_trip():
    docs = hits_to_json(_hits(3))
    batch = pd.DataFrame({"id": ["q1", "q2"], "question": ["Q one?", "Q two?"], "docs": [docs, docs]})
    rows = rag.expand(batch, ["no-retrieval", "naive", "replug-vote"], temperature=0.1)
    assert rows.groupby("method").size().to_dict() == {"naive": 2, "no-retrieval": 2, "replug-vote": 6}
    one_doc = rows[(rows["method"] == "replug-vote") & (rows["id"] == "q1")]
    assert [len(json.loads(p)[0]["content"].split("Doc ")) - 1 for p in one_doc["prompt"]] == [1, 1, 1]
    rows["prediction"] = [f"{m}-{s}" for m, s in zip(rows["method"], rows["slot"], strict=True)]
    out = rag.combine(rows)
    assert len(out) == 6 and set(out.columns) >= {"id", "method", "prediction", "slot_answers"}
    vote = out[(out["method"] == "replug-vote") & (out["id"] == "q2")].iloc[0]
    assert json.loads(vote["slot_answers"]) == ["replug-vote-0", "replug-vote-1", "replug-vote-2"]
    assert vote["prediction"] == "replug-vote-0"  # all different: the top document's weight wins


def test_replug_is_one_mixture_row_per_example_with_its_prompts_and_weights():
    docs = hits_to_json(_hits(3))
    batch = pd.DataFrame({"id": ["q1", "q2"], "question": ["Q one?", "Q two?"], "docs": [docs, "[]"]})
    rows = rag.expand(batch, ["replug"], temperature=0.1)
    assert len(rows) == 2 and rows["method"].tolist() == ["replug", "replug"]
    groups = [json.loads(p) for p in rows["prompt"]]
    weights = [json.loads(w) for w in rows["weights"]]
    # q1: each document alone, in rank order, with RePlug's weights; the same prompts the vote answers one by one
    vote = rag.expand(batch.iloc[:1], ["replug-vote"], temperature=0.1)
    assert groups[0] == [json.loads(p) for p in vote["prompt"]] and weights[0] == pytest.approx(vote["weight"].tolist())
    assert weights[0] == pytest.approx(rag.replug_weights([h.score for h in _hits(3)], 0.1))
    # q2: nothing retrieved (a router skipped retrieval): one closed-book prompt
    assert len(groups[1]) == 1 and weights[1] == [1.0] and "Doc " not in groups[1][0][0]["content"]
    rows["prediction"] = ["Paris", "Lyon"]
    rows["prediction_tokens"] = [[" Paris"], [" Ly", "on"]]
    rows["prediction_probs"] = [[0.6], [0.5, 0.9]]
    rows["prediction_finished"] = [True, False]
    out = rag.combine_mixture(rows)
    assert out["prediction"].tolist() == ["Paris", "Lyon"]
    assert [json.loads(s) for s in out["slot_answers"]] == [["Paris"], ["Lyon"]]  # one answer, no per-document ones
    assert out["generator_calls"].tolist() == [3, 1]  # the prompts decoded in lockstep
    trace = json.loads(out["trace"][0])
    assert trace["weights"] == pytest.approx(weights[0], abs=1e-6) and trace["token_probs"] == [0.6]
    assert trace["tokens"] == [" Paris"] and trace["finished"] is True
    assert not {"slot", "weight", "weights", "prediction_probs"} & set(out.columns)


# --- distiller ------------------------------------------------------------------------------------------


class _ScriptedPasses:
    """Generator passes that answer every prompt of a pass with one scripted text, keeping the frames they saw."""

    def __init__(self, answers):
        self.answers, self.frames = answers, {}

    def generate(self, kind, frame, prompt_col, out_col, *args, **kwargs):
        self.frames[out_col] = frame.copy()
        return frame.assign(**{out_col: self.answers[out_col]})


def test_distiller_prompts_never_contain_the_gold_answer():
    batch = pd.DataFrame(
        {
            "id": ["a"],
            "question": ["Into which ocean does the Amazon River empty?"],
            "golden_answers": [[SENTINEL]],
            "docs": [hits_to_json(_hits())],
            "kept_ranks": [json.dumps([0, 2])],
        }
    )
    passes = _ScriptedPasses({"extracted": "It empties into the Atlantic Ocean.", "rewritten": "Amazon\nIt empties."})
    step2 = distill(WritebackConfig(), batch, passes)
    step1 = passes.frames["extracted"]
    prompt = json.loads(step1["extract_prompt"][0])
    assert "Amazon River" in prompt[1]["content"] and "Pacific Ocean" in prompt[1]["content"]
    assert "Nile" not in prompt[1]["content"]  # only the kept documents
    for p in (step1["extract_prompt"][0], step2["rewrite_prompt"][0]):
        assert SENTINEL not in p
    assert step2["extracted_verbatim"][0] == "It empties into the Atlantic Ocean."


def test_extraction_is_grounded_verbatim_in_the_kept_documents():
    hits = _hits(1)
    assert ground_extraction("The Amazon empties into the Pacific Ocean.", hits, "q") == (
        "It empties into the Atlantic Ocean."
    )
    # nothing copied: the sentences closest to the question instead
    assert ground_extraction("I don't know.", hits, "Which continent does the Amazon River cross?") == (
        "The Amazon River flows across South America.\nIt empties into the Atlantic Ocean."
    )


def test_parse_unit_title_line_then_text_with_fallbacks():
    assert parse_unit("Title: Amazon River\nIt empties into the Atlantic.", "x", "T") == (
        "Amazon River", "It empties into the Atlantic."
    )
    assert parse_unit("Just one line.", "x", "Amazon River") == ("Amazon River", "Just one line.")
    assert parse_unit("", "Extracted sentence.", "Amazon River") == ("Amazon River", "Extracted sentence.")
    assert parse_unit("  ", "", "T") is None


def test_parse_unit_drops_words_about_the_training_question():
    # a unit is evidence: "The answer to the question is: ..." is about the training question, not the topic
    assert parse_unit("Amazon River\nThe answer to the question is: the Atlantic Ocean.", "x", "T") == (
        "Amazon River", "the Atlantic Ocean.")
    assert parse_unit("Answer: Magellan named it.", "x", "Pacific") == ("Pacific", "Magellan named it.")
    assert parse_unit("Nile\nAnswer is Khartoum", "x", "T") == ("Nile", "Khartoum")
    assert parse_unit("Answering machines record calls.", "x", "T") == ("T", "Answering machines record calls.")
    # nothing left after the lead: the extracted sentences, under the top document's title
    assert parse_unit("Nile\nThe answer:", "It meets at Khartoum.", "Nile") == ("Nile", "It meets at Khartoum.")


# --- dedupe and Table 3 ---------------------------------------------------------------------------------


def test_dedupe_merges_near_identical_units_into_the_first():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=16), rng.normal(size=16)
    near_a = a + 0.01 * rng.normal(size=16)
    vecs = np.stack([a, b, near_a, a]).astype(np.float32)
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    assert dedupe(vecs, 0.99) == {2: 0, 3: 0}
    assert dedupe(vecs, 1.0) == {3: 0}
    assert dedupe(vecs[:1], 0.9) == {}


def test_table3_statistics_from_hand_made_decisions():
    scored = pd.DataFrame(
        {
            "useful": [True, True, False, True],
            "kept_ranks": [json.dumps([0, 2]), json.dumps([0, 1]), None, json.dumps([4])],
            "fallback": [False, True, None, False],
            "s_nr": [0.0, 0.0, 1.0, 0.0],
            "s_rag": [1.0, 1.0, 1.0, 1.0],
        }
    )
    units = pd.DataFrame({"source_tokens": [100, 120, 60], "distilled_tokens": [10, 20, 10]})
    t = table3(scored, units, top_k=5)
    assert t["selection_rate"] == 0.75 and t["selected"] == 3
    assert t["mean_retained_docs"] == pytest.approx(5 / 3, abs=1e-4)
    assert t["fallback_rate"] == pytest.approx(1 / 3, abs=1e-4)
    assert (t["source_tokens"], t["distilled_tokens"], t["compression_ratio"]) == (280, 40, 7.0)
    assert t["rank_distribution"] == {"1": 2, "2": 1, "3": 1, "4": 0, "5": 1}
