"""The stated rule that scores a sentence-long answer on its answer span (`eval.answer_form: span`): each of its
steps on answers the bundled SmolLM2 gave to the demo's questions, and an evaluation that scores the spans."""

import pyarrow.parquet as pq
import pytest

from wbrag_ray.evaluation.short_answer import short_answer
from wbrag_ray.metrics import exact_match, substring_match

CASES = [
    # the question's words and the function words struck out: what is left is the answer
    ("What is the capital of Iceland?", "The capital of Iceland is Reykjavik.", "Reykjavik"),
    # the first sentence only; a comma ends a run
    ("Which river carved the Grand Canyon?",
     "The Grand Canyon is carved by the Colorado River, which is a tributary of the Yuma River. The Colorado River is",
     "Colorado"),
    # a lead-in dropped, the question's words struck from what follows it
    ("Who assassinated Abraham Lincoln?",
     "The answer is: Abraham Lincoln was assassinated by John Wilkes Booth on April 11, 1865", "John Wilkes Booth"),
    ("How many bones are in the adult human skeleton?", "The answer is: 206", "206"),
    # "and" joins a run (even where the question has an "and"); a past form is the question's word
    ("Which two elements did Marie Curie and her husband Pierre discover?",
     "The two elements that were discovered by Marie Curie and her husband Pierre were polonium and radium.",
     "polonium and radium"),
    # the first run with a name or a number, not the descriptive one before it
    ("Who invented basketball in 1891?",
     "The invention of basketball in 1891 by James Naismith is often credited to the American sportsman and",
     "James Naismith"),
    # no name or number: the last run (the predicate); a plural and a possessive are the question's words
    ("What tiny animals do blue whales mainly feed on?",
     "The blue whale's diet primarily consists of tiny shrimp-like animals called krill.", "krill"),
    # a date's comma kept; hyphenated and decimal words whole
    ("In what year was the Hubble Space Telescope launched?",
     "The Hubble Space Telescope was launched on January 24, 1990, by NASA's Space Shuttle Discovery",
     "January 24, 1990"),
    ("In which town was William Shakespeare born?",
     "The town of Stratford-upon-Avon in England is the birthplace of William Shakespeare.", "Stratford-upon-Avon"),
    ("What is Usain Bolt's world record time in the 100 meters?",
     "Usain Bolt's record time in the 100 meters is 9.58 seconds.", "9.58 seconds"),
    # an answer that is already a span stays itself; one that only restates the question stays a sentence
    ("Which Roman emperor completed the Colosseum in 80 AD?", "Titus", "Titus"),
    ("What was the name of Yuri Gagarin's spacecraft?", "The name of Yuri Gagarin's spacecraft is Gagarin.",
     "The name of Yuri Gagarin's spacecraft is Gagarin"),
]


@pytest.mark.parametrize(("question", "prediction", "span"), CASES)
def test_the_rule_cuts_the_answer_span(question, prediction, span):
    assert short_answer(prediction, question) == span


def test_spans_score_exact_matches_the_sentences_never_do():
    golds = {"Reykjavik": ["Reykjavik", "Reykjavík"], "Colorado": ["Colorado River", "the Colorado"],
             "polonium and radium": ["polonium and radium"], "krill": ["krill"]}
    for question, prediction, span in CASES:
        if span in golds:
            assert exact_match(short_answer(prediction, question), golds[span]) == 1.0
            assert exact_match(prediction, golds[span]) == 0.0 and substring_match(prediction, golds[span]) == 1.0


@pytest.mark.slow
def test_an_evaluation_scores_the_spans_and_keeps_the_generated_text(demo_run, tmp_path):
    """`--set eval.answer_form=span` on a built run (the tiny generator): every metric is computed on the span the
    rule cuts from the prediction, both are in the predictions, and metrics.json says which was scored and how
    long the scored answers are; the unchanged evaluation scored the generated text.

    The random-weight generator answers no question, so the questions' gold answers here are the spans of what it
    generated for them in the run's own evaluation (`qa`, the same prompts): by hand, every span's em is 1, and a
    generated text longer than its span scores em 0."""
    import json

    from tests.conftest import demo_questions, write_jsonl
    from wbrag_ray.cli import main
    from wbrag_ray.metrics import METRICS, score_answer
    from wbrag_ray.run import RunFolder

    run, _ = demo_run
    layout = RunFolder(str(run)).layout
    generated = {r["id"]: r["prediction"] for r in pq.read_table(layout.eval_result("qa", "naive").predictions.path)
                 .to_pylist()}
    questions = [{**q, "golden_answers": [short_answer(generated[q["id"]], q["question"])]} for q in demo_questions(4)]
    qa = write_jsonl(tmp_path / "qa-spans.jsonl", questions)
    longer = [q["id"] for q in questions if len(q["golden_answers"][0].split()) < len(generated[q["id"]].split())]
    assert longer, json.dumps(generated)  # else scoring the text would score the same
    assert main(["eval", str(run), "--dataset", str(qa), "--name", "spans", "--methods", "naive",
                 "--set", "eval.answer_form=span"]) == 0
    rows = pq.read_table(layout.eval_result("spans", "naive").predictions.path).to_pylist()
    metrics = layout.eval_result("spans", "naive").metrics.read_json()
    assert metrics["answer_form"] == "span" and len(rows) == metrics["n"] == 4
    assert {r["id"]: r["prediction"] for r in rows} == generated  # the same prompts, the same text
    assert [r["em"] for r in rows] == [1.0] * 4 and metrics["em"] == 1.0
    for row in rows:
        assert row["answer"] == short_answer(row["prediction"], row["question"])
        assert {m: row[m] for m in METRICS} == score_answer(row["answer"], row["golden_answers"])
    for m in METRICS:
        assert metrics[m] == pytest.approx(sum(r[m] for r in rows) / len(rows), abs=1e-4)
    assert metrics["answer_words"] == pytest.approx(sum(len(r["answer"].split()) for r in rows) / len(rows), abs=0.01)
    plain = pq.read_table(layout.eval_result("qa", "naive").predictions.path).to_pylist()
    assert all(r["answer"] == r["prediction"] for r in plain)  # as generated
    assert layout.eval_result("qa", "naive").metrics.read_json()["answer_form"] == "as generated"
