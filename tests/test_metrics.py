import pytest

from wbrag_ray.metrics import exact_match, f1_score, metric, normalize_answer, score_answer, substring_match


def test_normalization_drops_case_punctuation_articles_and_spaces():
    assert normalize_answer("  The  Eiffel-Tower, in PARIS! ") == "eiffeltower in paris"
    assert normalize_answer("an apple a day") == "apple day"


def test_em_and_acc_take_the_max_over_gold_answers():
    golds = ["Edmund Hillary", "Sir Edmund Hillary"]
    assert exact_match("sir edmund hillary.", golds) == 1.0
    assert exact_match("Hillary", golds) == 0.0
    assert substring_match("It was Edmund Hillary, in 1953.", golds) == 1.0
    assert substring_match("Tenzing Norgay", golds) == 0.0


def test_f1_token_overlap():
    assert f1_score("Colorado River", ["the Colorado River"]) == 1.0
    # precision 1/3, recall 1/2 -> f1 0.4
    assert f1_score("Colorado big canyon", ["Colorado River"]) == pytest.approx(0.4)
    assert f1_score("nothing shared", ["Colorado"]) == 0.0


def test_f1_yes_no_rule_gives_no_partial_credit():
    assert f1_score("no", ["yes"]) == 0.0
    assert f1_score("yes", ["yes"]) == 1.0
    assert f1_score("yes it is", ["yes"]) == 0.0  # normalized 'yes' gold needs exactly 'yes'
    assert f1_score("noanswer", ["no answer"]) == 0.0


def test_score_answer_and_metric_by_name():
    s = score_answer("The answer is 79.", ["79"])
    assert s == {"em": 0.0, "f1": pytest.approx(2 * (1 / 3) * 1 / (1 / 3 + 1)), "acc": 1.0}
    assert metric("acc", "79", ["79"]) == 1.0
    with pytest.raises(ValueError, match="unknown metric"):
        metric("bleu", "x", ["x"])
