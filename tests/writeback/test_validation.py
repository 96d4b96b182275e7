"""A write-back version's effect where it can act (won / lost over the questions whose top K changed), the held-out
validation split, the verdict on a version that hurts, the grid's columns and Same-WB's table: hand-made rows, no Ray."""

import hashlib

import pandas as pd
import pyarrow as pa

from wbrag_ray.evaluation.effect import writeback_effect
from wbrag_ray.evaluation.methods_grid import format_methods_grid
from wbrag_ray.retrieval.hits import Hit, hits_to_json
from wbrag_ray.writeback.validation import held_out, split
from wbrag_ray.writeback.versions import hurts


def docs(*keys):
    return hits_to_json([Hit(i, 1.0 - r / 10, r, "t", "x", source) for r, (source, i) in enumerate(keys)])


P = [("base", 1), ("base", 2), ("base", 3)]


def test_won_and_lost_are_counted_only_where_the_top_k_changed_and_a_flip_under_an_unchanged_top_k_is_not():
    """The counting rule on hand-made rows. Row a's flip is one a real command cannot make (the same prompt gets the
    same answer: `AnswerMemo`); that an unchanged top K keeps its base answer on real answers is checked in
    tests/pipelines/test_writeback_pipeline.py (the validation and the Same-WB grid)."""
    base = pd.DataFrame({"id": ["a", "b", "c", "d", "e"], "docs": [docs(*P)] * 5, "acc": [1.0, 0.0, 1.0, 0.0, 1.0]})
    union = pd.DataFrame({
        "id": ["e", "d", "c", "b", "a"],  # another order: matched by id
        "docs": [docs(*P), docs(("writeback", 9), *P[:2]), docs(("writeback", 9), *P[:2]),
                 docs(P[0], ("writeback", 7), P[1]), docs(*P)],
        # a: unchanged top K, answer flipped (hand-made): not counted; b: changed and won; c: changed and lost;
        # d: changed, still wrong; e: unchanged
        "acc": [1.0, 0.0, 0.0, 1.0, 0.0],
    })
    effect = writeback_effect(base, union)
    assert effect == {"questions": 5, "unit_in_top_k": 3, "changed": 3, "won": 1, "lost": 1,
                      "won_ids": ["b"], "lost_ids": ["c"]}


def test_the_validation_split_holds_out_the_ids_whose_hash_comes_first_whatever_the_order():
    ids = [f"q{i}" for i in range(10)]
    by_hash = sorted(ids, key=lambda i: hashlib.blake2b(i.encode(), digest_size=8).hexdigest())
    assert held_out(ids, 0.3) == set(by_hash[:3]) == held_out(ids[::-1], 0.3)
    assert held_out(ids, 0.01) == {by_hash[0]}  # a fraction keeps at least one question out
    assert held_out(ids, None) == set()
    table = pa.table({"id": ids, "question": [f"question {i}" for i in range(10)]})
    train, val = split(table, 0.3)
    assert sorted(val["id"].to_pylist()) == sorted(by_hash[:3])
    assert train.num_rows == 7 and not set(train["id"].to_pylist()) & set(val["id"].to_pylist())


def test_a_version_hurts_when_it_loses_more_than_it_wins_beyond_chance():
    ok = {"metric": "acc", "base": 0.5, "with_version": 0.5, "won": 1, "lost": 1}
    assert hurts(ok) is None and hurts(None) is None
    # one or two questions lost more than won is what a coin gives: the version is activated, its figures said
    assert hurts({**ok, "with_version": 0.49, "won": 0}) is None
    assert hurts({**ok, "with_version": 0.48, "lost": 3}) is None
    assert hurts({**ok, "with_version": 0.42, "won": 0, "lost": 5}) == (
        "5 questions lost against 0 won (p = 0.031); acc 0.420 with it against 0.500 without")


def test_the_grid_shows_each_union_setting_with_its_units_won_and_lost():
    def row(version, union, acc, effect=None):
        r = {"method": "naive", "version": version, "same_method": None if version is None else True, "acc": acc}
        if version:
            r.update(union=union, delta={"acc": round(acc - 0.5, 4)}, unit_in_top_k=effect[0], won=effect[1],
                     lost=effect[2])
        return r

    grid = {"name": "qa", "methods": ["naive"], "versions": {"v1": "naive"},
            "rows": [row(None, None, 0.5), row("v1", "provenance", 0.55, (4, 2, 0)), row("v1", "score", 0.45, (9, 1, 3))]}
    lines = format_methods_grid(grid).splitlines()
    assert "+wb v1 [naive] provenance" in lines[1] and "+wb v1 [naive] score" in lines[1]
    assert lines[2].split() == ["naive", "0.500", "0.550", "(+0.050)*", "0.450", "(-0.050)*"]
    assert lines[-1].split() == ["naive", "4:", "+2", "-0", "9:", "+1", "-3"]


def test_same_wb_shows_each_method_beside_its_own_version_not_a_cross_cell():
    """WriteBack-RAG's Figure 4 (`--same-writeback`) from hand-made cells, every one of them a different number: each
    method's line holds its base cell and its cell beside the version written back under it, never the cell beside
    the other method's version (the cross cell); a row kept from a grid of another union setting is not shown."""
    from wbrag_ray.evaluation.methods_grid import format_same_writeback

    def row(method, version, em, union="gate"):
        return {"method": method, "version": version, "union": None if version is None else union,
                "em": em, "f1": em + 0.01, "acc": em + 0.02}

    own = {"naive": "train-naive", "replug-vote": "train"}
    rows = [row("naive", None, 0.10), row("naive", "train-naive", 0.30), row("naive", "train", 0.50),
            row("replug-vote", None, 0.20), row("replug-vote", "train-naive", 0.70), row("replug-vote", "train", 0.40),
            row("replug-vote", "train", 0.90, union="score")]  # kept from an earlier grid under another union
    lines = format_same_writeback({"name": "sw", "rows": rows, "same_writeback": own}).splitlines()
    assert lines[0] == "Same-WB on sw: each method beside the version written back under it" and len(lines) == 4
    # by hand: em, em Same-WB (change), f1, f1 Same-WB (change), acc, acc Same-WB (change)
    assert lines[2].split() == ["naive", "train-naive", "0.100", "0.300", "(+0.200)", "0.110", "0.310", "(+0.200)",
                                "0.120", "0.320", "(+0.200)"]
    assert lines[3].split() == ["replug-vote", "train", "0.200", "0.400", "(+0.200)", "0.210", "0.410", "(+0.200)",
                                "0.220", "0.420", "(+0.200)"]


def test_auto_validation_holds_out_a_fifth_from_100_training_questions_and_says_why_not_below():
    from wbrag_ray.config import AUTO_VALIDATION_MIN, WritebackConfig
    from wbrag_ray.writeback.validation import skipped

    auto = WritebackConfig()
    assert auto.validation == "auto" and AUTO_VALIDATION_MIN == 100
    assert auto.validation_fraction(99) is None and auto.validation_fraction(100) == 0.2
    assert len(held_out([f"q{i}" for i in range(100)], auto.validation_fraction(100))) == 20  # at least 20 held out
    assert skipped(auto, 30) == "skipped, only 30 training questions (auto needs 100)"
    assert skipped(auto, 100) is None
    assert skipped(WritebackConfig(validation=None), 1000) == "off (writeback.validation: null)"
    fixed = WritebackConfig(validation=0.5)
    assert skipped(fixed, 2) is None and fixed.validation_fraction(2) == 0.5  # an explicit fraction at any size


def test_the_versions_stats_hold_its_validation_and_whether_it_was_activated(tmp_path, monkeypatch, capsys):
    """train_writeback with the stage, the validation and the activation stubbed (the validation's real run is
    tests/pipelines/test_writeback_pipeline.py's): what it returns, what the version's stats file holds afterwards
    (the rule `auto` searches it with among them), and what the command says at its end: a version with no
    measured effect is said to be one, not only active."""
    from types import SimpleNamespace

    from wbrag_ray.config import load_config
    from wbrag_ray.storage import resolve
    from wbrag_ray.writeback import pipeline

    train = tmp_path / "train.jsonl"
    train.write_text('{"id": "a", "question": "q", "golden_answers": ["x"]}\n')
    own = resolve(str(tmp_path / "stats.json"))

    class Run:
        layout = SimpleNamespace(writeback_version=lambda version: SimpleNamespace(stats=own))

        def execute(self, stage, config, work, params, force):
            own.write_json({"version": params["version"], "units_written": 3})
            return {"rows_in": 5, "version": params["version"], "units_written": 3}

    activated = []
    monkeypatch.setattr(pipeline, "activate", lambda run, version: activated.append(version))
    config = load_config()

    def train_with(validation):
        monkeypatch.setattr(pipeline, "validate", lambda *a, **k: validation)
        activated.clear()
        return pipeline.train_writeback(Run(), config, str(train), "v")

    why = "skipped, only 1 training questions (auto needs 100)"
    stats = train_with(why)
    fallback = {"union": "provenance", "why": f"no validation split ({why}): the paper's merge with the provenance "
                "guard"}
    assert stats["validation"] == why and stats["activated"] is True and activated == ["v"]
    assert own.read_json() == {"version": "v", "units_written": 3, "validation": why, "activated": True,
                               "union_auto": fallback}
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"write-back v: 3 units written, active; its effect is not measured (validation {why}); retrieval.union auto "
        "searches it with provenance")

    result = {"questions": 70, "metric": "acc", "base": 0.5, "with_version": 0.4, "won": 1, "lost": 8,
              "unit_in_top_k": 9, "units_reached": 4, "answers_changed": 5, "configured": "auto", "applied": "gate 0.1",
              "chosen": "gate 0.1", "choice": "the best of 7 rules"}
    stats = train_with(result)
    expected = {**result, "hurts": "8 questions lost against 1 won (p = 0.020); acc 0.400 with it against 0.500 without",
                "activated": False}
    assert stats["validation"] == expected and stats["activated"] is False and activated == []
    assert own.read_json()["validation"] == expected and own.read_json()["activated"] is False
    assert own.read_json()["union_auto"] == {"union": "gate 0.1", "why": "the best of 7 rules"}
    assert capsys.readouterr().out.splitlines()[-1] == (
        "write-back v: 3 units written, not active; union gate 0.1 (chosen on them: the best of 7 rules). On its 70 "
        "validation questions: 4 units reached a top K (of 9 questions), 5 answers changed, won 1, lost 8")

    stats = train_with({**result, "with_version": 0.6, "lost": 0})
    assert stats["validation"]["hurts"] is None and stats["validation"]["activated"] is True and activated == ["v"]

    # a version whose units changed no answer, and one whose units reached no top K, are said to be ones
    train_with({**result, "with_version": 0.5, "won": 0, "lost": 0, "answers_changed": 0})
    assert capsys.readouterr().out.splitlines()[-1] == (
        "write-back v: it changed no validation answer: it has no measured effect")
    train_with({**result, "with_version": 0.5, "won": 0, "lost": 0, "answers_changed": 0, "unit_in_top_k": 0,
                "units_reached": 0, "configured": "gate", "applied": "gate"})
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "write-back v: no unit reached a validation top K: it has no measured effect"
    assert "union gate (retrieval.union). On its 70 validation questions: 0 units reached a top K" in out[-2]


def test_the_report_shows_every_rule_the_version_was_validated_under_and_says_when_it_had_no_effect(tmp_path):
    """The report's write-back section from a version folder written by hand: the statement check's drops by reason,
    each candidate rule's figures with the chosen and the searched one marked, why auto chose it, and a version
    that changed no validation answer said to have had no measured effect (units written, units that reached a top
    K, answers changed, won, lost), not only 'active'."""
    from wbrag_ray.layout import WritebackVersion
    from wbrag_ray.report.sections import writeback_section
    from wbrag_ray.storage import resolve

    folder = WritebackVersion(resolve(str(tmp_path / "v")))
    rule = {"unit_in_top_k": 3, "units_reached": 2, "answers_changed": 0, "won": 0, "lost": 0}
    validation = {"version": "v", "method": "naive", "metric": "acc", "questions": 64, "base": 0.5,
                  "with_version": 0.5, "union": "gate", "configured": "auto", "applied": "gate", "chosen": "gate",
                  "choice": "the best of 2 rules", **rule,
                  "candidates": {"score": {**rule, "union": "score", "acc": 0.45, "answers_changed": 4, "lost": 3},
                                 "gate": {**rule, "union": "gate", "acc": 0.5}}}
    folder.validation.write_json(validation)
    folder.stats.write_json({"version": "v", "units_written": 7, "activated": True, "validation": validation,
                             "rewrites_dropped": {"bare answer": 2, "unsupported by its source passages": 1},
                             "units_dropped": {"bare answer": 0, "unsupported by its source passages": 0},
                             "rewrite_drop_rate": 0.3, "unit_drop_rate": 0.0})
    sec = writeback_section(folder, tmp_path)
    tables = {t.title: t for t in sec.tables}
    assert tables["rewrites dropped by the statement check"].rows == [
        ["bare answer", 2], ["unsupported by its source passages", 1]]
    assert "units dropped by the statement check" not in tables  # none dropped: no table
    rules = tables["validation on 64 held-out training questions (naive), per union rule"]
    assert rules.rows == [["score", 0.5, 0.45, 3, 2, 4, 0, 3], ["gate (chosen) (searched)", 0.5, 0.5, 3, 2, 0, 0, 0]]
    table3 = dict((row[0], row[1]) for row in tables["selection (the paper's Table 3)"].rows)
    assert table3["rewrites dropped (bare answer or unsupported; the extraction kept)"] == 0.3
    assert sec.text == ("retrieval.union auto searches this version with gate: the best of 2 rules. This version "
                        "(active) had no measured effect on its 64 validation questions: 7 units written, 2 reached a "
                        "top K, 0 answers changed, won 0, lost 0.")
