"""Units that are retrievable statements (the distiller's statement check, and what building the units drops, by
reason, into Table 3), and the union rule a version's validation chooses: hand-made texts and figures, no model.
The validation's real run (every candidate evaluated on held-out questions, the choice written beside the index
and read by the searches) is tests/pipelines/test_writeback_pipeline.py's."""

import json

import pandas as pd
import pytest

from wbrag_ray.evaluation.effect import CHANCE
from wbrag_ray.metrics import sign_test
from wbrag_ray.retrieval.hits import Hit, hits_to_json
from wbrag_ray.writeback.distill import BARE_ANSWER, UNSUPPORTED, build_units, statement_check, table3
from wbrag_ray.writeback.validation import CANDIDATES, UNION_CHOICE_MIN, choose_union, decided

SOURCE = [
    Hit(1, 0.9, 0, "Let Them Eat Bingo", "Let Them Eat Bingo is the debut album of Beats International. It was "
        "released in February 1990. The album peaked at number 17 on the UK Albums Chart."),
    Hit(2, 0.8, 1, "Albligen", "Albligen is a former municipality in the canton of Bern. In 2010 the municipality "
        "of Albligen had a population of 477."),
]


def test_a_bare_answer_is_no_statement():
    for bare in ("2018", "February 1990", "Alan Turing", "the Atlantic Ocean"):
        assert statement_check(bare, SOURCE) == BARE_ANSWER, bare


def test_a_statement_one_source_sentence_holds_with_its_figures_is_supported():
    assert statement_check("The population of the municipality of Albligen in 2010 was 477.", SOURCE) is None
    assert statement_check("Let Them Eat Bingo peaked at number 17 on the UK Albums Chart.", SOURCE) is None
    # each sentence on its own: two supported sentences are a supported unit; the first is "It was released in
    # February 1990." read with its passage's title (the rewrite names what "It" is)
    assert statement_check("Let Them Eat Bingo was released in February 1990. Albligen is in the canton of Bern.",
                           SOURCE) is None


def test_two_facts_joined_into_a_wrong_one_or_words_of_no_source_are_unsupported():
    # the chart sentence holds most of its words but not 1990, and the release sentence not the chart: the unit
    assert statement_check("The peak position of let them eat bingo on the uk albums chart was February 1990.",
                           SOURCE) == UNSUPPORTED
    assert statement_check("Albligen had a population of 478 in 2010.", SOURCE) == UNSUPPORTED  # a figure changed
    assert statement_check("Albligen is a city of steel mills and ports on the coast.", SOURCE) == UNSUPPORTED
    assert statement_check("Albligen is in the canton of Bern. It is famous for its steel mills and harbors.",
                           SOURCE) == UNSUPPORTED  # one sentence of two is enough to fail


def _examples(*rewrites_and_extractions):
    """Kept examples over SOURCE (both documents kept) and the distiller's outputs for them."""
    ids = [f"q{i}" for i in range(len(rewrites_and_extractions))]
    kept = pd.DataFrame({"id": ids, "question": ["q?"] * len(ids), "docs": [hits_to_json(SOURCE)] * len(ids),
                         "kept_ranks": [json.dumps([0, 1])] * len(ids), "fallback": [False] * len(ids)})
    distilled = pd.DataFrame({"id": ids, "rewritten": [r for r, _ in rewrites_and_extractions],
                              "extracted_verbatim": [e for _, e in rewrites_and_extractions]})
    return kept, distilled


def test_a_rewrite_that_is_no_statement_is_dropped_by_reason_and_its_grounded_extraction_kept():
    release = "It was released in February 1990."
    kept, distilled = _examples(
        ("Albligen\nThe population of the municipality of Albligen in 2010 was 477.", release),  # kept as written
        ("2018", release),  # bare: step 1's sentence instead
        ("Bingo\nThe peak position of let them eat bingo on the uk albums chart was February 1990.", release),
        ("1990", "1990"),  # bare, and so is its extraction: no unit
        ("", ""),  # nothing at all
    )
    units, drops = build_units("v", kept, distilled)
    assert units["text"].tolist() == ["The population of the municipality of Albligen in 2010 was 477.", release,
                                      release]
    assert units["title"].tolist() == ["Albligen", "Let Them Eat Bingo", "Let Them Eat Bingo"]
    assert units["source_example_id"].tolist() == ["q0", "q1", "q2"]
    # "1990" is its own extraction: no rewrite to drop, the unit is dropped
    assert drops == {"empty": 1, "rewrites": {BARE_ANSWER: 1, UNSUPPORTED: 1}, "units": {BARE_ANSWER: 1,
                                                                                        UNSUPPORTED: 0}}
    # Table 3's rows: rates over the 5 selected examples
    scored = pd.DataFrame({"useful": [True] * 5, "kept_ranks": [json.dumps([0, 1])] * 5, "fallback": [False] * 5,
                           "s_nr": [0.0] * 5, "s_rag": [1.0] * 5})
    t = table3(scored, units.assign(source_tokens=10, distilled_tokens=5), top_k=5, drops=drops)
    assert (t["rewrite_drop_rate"], t["unit_drop_rate"], t["empty_units"]) == (0.4, 0.2, 1)
    assert t["rewrites_dropped"] == {BARE_ANSWER: 1, UNSUPPORTED: 1}
    assert t["units_dropped"] == {BARE_ANSWER: 1, UNSUPPORTED: 0}


def _fig(acc, lost, won=0, ids=None):
    """One rule's figures; its won / lost questions are the first `won` / `lost` of `ids` (default q0, q1, ...)."""
    ids = ids or [f"q{i}" for i in range(won + lost)]
    return {"acc": acc, "lost": lost, "won": won, "won_ids": ids[:won], "lost_ids": ids[won:won + lost]}


def test_a_sign_test_tells_a_rule_from_chance():
    assert sign_test(0, 0) == 1.0 and sign_test(1, 0) == 0.5 and sign_test(0, 1) == 1.0
    assert sign_test(5, 0) == 1 / 32 < CHANCE < sign_test(6, 1) == 8 / 128  # 6-1 is not yet beyond chance
    assert sign_test(7, 1) == 9 / 256 < CHANCE
    # questions two rules answered differently, both against the same base answers
    assert decided(_fig(0.7, 1, won=2, ids=["a", "b", "c"]), _fig(0.7, 0, won=1, ids=["c"])) == (2, 1)
    assert decided(_fig(0.7, 0, won=1, ids=["a"]), None) == (1, 0)


def test_the_union_departs_from_the_papers_merge_only_beyond_chance():
    n = UNION_CHOICE_MIN
    figures = {label: _fig(0.70, 1) for label, _ in CANDIDATES}
    chosen, why = choose_union(figures, n)
    assert chosen == "score"  # all tied: the paper's rule
    assert why.startswith(f"the paper's merge: no rule did better on {n} validation questions beyond chance")
    # the demo's held-out validation half (benchmarks/RESULTS.md, issue 69): the paper's merge lost one question
    # and won none, the gate changed nothing. Choosing by accuracy alone made `auto` the gate, which then acted on
    # one test question of 60 while the paper's merge won 2 and lost none there: one question is a coin's toss.
    figures["score"] = _fig(0.700, 1, ids=["heldout-082"])
    figures["gate"] = _fig(0.717, 0)
    assert choose_union(figures, n) == ("score", (
        f"the paper's merge: no rule did better on {n} validation questions beyond chance (acc 0.700, won 0, lost 1; "
        "the best other, gate (acc 0.717), answered 1 better and 0 worse than it (p = 0.50))"))
    # a rule better than the paper's merge on 5 questions and worse on none is chosen, with its figures
    figures["additive 0.05"] = _fig(0.78, 0, won=4, ids=["q1", "q2", "q3", "q4"])
    chosen, why = choose_union(figures, n)
    assert chosen == "additive 0.05"
    assert why == (f"the best of {len(CANDIDATES)} rules on {n} validation questions (acc 0.780, won 4, lost 0; "
                   "better than the paper's merge on 5 questions, worse on 0: p = 0.031)")
    # among the rules beyond chance: the best accuracy, then fewest lost
    figures["gate 0.1"] = _fig(0.78, 0, won=4, ids=["q1", "q2", "q3", "q5"])
    assert choose_union(figures, n)[0] == "gate 0.1"  # the same acc and lost: CANDIDATES' order
    # the metric the gates score (em on a dataset whose paper metric is em)
    em = {"score": {"em": 0.1, **_fig(0, 5, ids=list("abcde"))}, "gate": {"em": 0.3, **_fig(0, 0)}}
    assert choose_union(em, n, "em")[0] == "gate"  # the paper's merge lost 5 the gate kept


@pytest.mark.parametrize("questions", [1, 20, UNION_CHOICE_MIN - 1])
def test_a_split_too_small_to_choose_on_falls_back_to_the_papers_merge_with_the_provenance_guard(questions):
    figures = {label: _fig(0.5, 0) for label, _ in CANDIDATES} | {"gate 0.2": _fig(0.9, 0, won=9)}
    assert choose_union(figures, questions) == ("provenance", (
        f"{questions} validation questions are too few to choose on (at least {UNION_CHOICE_MIN}): the paper's merge "
        "with the provenance guard"))
    assert UNION_CHOICE_MIN == 60 and "provenance" in dict(CANDIDATES)  # the fallback's figures are measured too
