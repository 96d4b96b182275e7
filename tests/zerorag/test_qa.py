"""Zero-RAG's mastery scoring: QA pairs from the QA generator's output (parsed robustly, failures kept with a
status), deterministic cloze pairs, and the score as the mean EM of the valid pairs."""

import pandas as pd

from wbrag_ray.zerorag import qa as m


def test_cloze_spans_prefer_dates_and_numbers_then_names():
    s = "Edmund Hillary and Tenzing Norgay reached the summit on 29 May 1953, at 8,849 meters."
    spans = m.cloze_spans(s, 4)
    assert spans[0] == "29 May 1953"  # the date, not its year alone
    assert "8,849" in spans and "1953" not in spans
    assert "Edmund Hillary and Tenzing Norgay" in spans
    assert m.cloze_spans("The Beatles were formed in Liverpool.", 3) == ["Beatles", "Liverpool"]


def test_cloze_pairs_blank_the_answer_and_record_sentences_without_any():
    rows = m.cloze_pairs("Mount Everest", "It was first climbed in 1953 by Hillary.", 2)
    assert [r["answer"] for r in rows] == ["1953", "Hillary"]
    assert rows[0]["question"] == "Mount Everest: It was first climbed in ____ by Hillary."
    assert all(r["status"] == m.OK for r in rows)
    empty = m.cloze_pairs("", "it was raining.", 2)
    assert len(empty) == 1 and empty[0]["status"] == m.UNPARSEABLE


def test_parse_qa_output_reads_json_lines_and_numbered_pairs():
    assert m.parse_qa_output('[{"question": "Who?", "answer": "Ada"}, {"question": "When?", "answer": "1843"}] tail') == [
        ("Who?", "Ada"), ("When?", "1843")]
    assert m.parse_qa_output("Q: Who wrote it?\nA: Ada Lovelace\nQ: When?\nA: 1843") == [
        ("Who wrote it?", "Ada Lovelace"), ("When?", "1843")]
    assert m.parse_qa_output("1. Question 1: Who?\n   Answer 1: Ada") == [("Who?", "Ada")]
    assert m.parse_qa_output("I cannot help with that.") == []


def test_llm_pairs_keep_failures_with_their_status():
    sentence = "Ada Lovelace published the first algorithm in 1843."
    rows = m.llm_pairs(sentence, " Who published it?\nA: Ada Lovelace\nQ: Where?\nA: London", 3, "Q:")
    assert [(r["answer"], r["status"]) for r in rows] == [("Ada Lovelace", m.OK), ("London", m.NOT_IN_SENTENCE)]
    assert all(r["raw"].startswith(" Who") for r in rows)  # the raw output is kept for inspection
    bad = m.llm_pairs(sentence, "no pairs here", 3)
    assert [r["status"] for r in bad] == [m.UNPARSEABLE] and bad[0]["raw"] == "no pairs here"


def test_mastery_is_the_mean_em_of_the_valid_pairs():
    qa = pd.DataFrame({
        "sid": [1, 1, 1, 2, 3],
        "qa_index": [0, 1, 2, 0, 0],
        "question": ["q"] * 5,
        "answer": ["Paris", "1889", "Eiffel", "x", ""],
        "status": [m.OK, m.OK, m.NOT_IN_SENTENCE, m.OK, m.UNPARSEABLE],
        "prediction": ["paris.", "It was 1889", None, "x", None],
    })
    qa = m.score_answers(qa)
    assert qa["em"].tolist()[:2] == [1.0, 0.0] and qa["acc"].tolist()[:2] == [1.0, 1.0]
    assert qa["em"].isna().tolist() == [False, False, True, False, True]
    sentences = pd.DataFrame({"sid": [1, 2, 3, 4], "title": "", "text": ["a", "b", "c", "d"]})
    scores = m.mastery_scores(sentences, qa).set_index("sid")
    assert scores.loc[1, "mastery"] == 0.5 and scores.loc[1, "n_qa"] == 3 and scores.loc[1, "n_valid"] == 2
    assert scores.loc[2, "mastery"] == 1.0
    assert pd.isna(scores.loc[3, "mastery"]) and scores.loc[3, "n_valid"] == 0  # no valid pair: no score
    assert pd.isna(scores.loc[4, "mastery"]) and scores.loc[4, "n_qa"] == 0
    assert m.mastery_scores(sentences, qa, "acc").set_index("sid").loc[1, "mastery"] == 1.0
