"""The union of the base and write-back indices (`retrieval.union`), on hand-made hit lists: every expected top K
below is worked out by hand from the scores and provenance written in the test."""

import json

import pytest

from wbrag_ray.retrieval.hits import Hit, hits_from_json, hits_to_json
from wbrag_ray.retrieval.union import UnionRule, read_provenance, with_provenance, write_provenance
from wbrag_ray.storage import resolve


def passages(*scored):
    """Base hits p<id> with the given (id, score), in rank order; each passage's text names its id."""
    return [Hit(i, s, r, f"P{i}", f"passage {i} says fact {i}") for r, (i, s) in enumerate(scored)]


def unit(i, score, rank, sources=None, text=None):
    return Hit(i, score, rank, f"U{i}", text or f"unit {i} distilled", "writeback", sources)


def keys(hits):
    return [("p" if h.source == "base" else "u") + str(h.id) for h in hits]


BASE = passages((10, 0.80), (11, 0.70), (12, 0.60), (13, 0.50), (14, 0.40))


def test_the_papers_merge_is_the_top_k_by_raw_score():
    units = [unit(0, 0.85, 0, [10]), unit(1, 0.65, 1, [13])]
    top = UnionRule("score")([BASE, units], 5)
    # 0.85 u0 > 0.80 p10 > 0.70 p11 > 0.65 u1 > 0.60 p12
    assert keys(top) == ["u0", "p10", "p11", "u1", "p12"]
    assert [h.rank for h in top] == [0, 1, 2, 3, 4] and [h.score for h in top] == [0.85, 0.80, 0.70, 0.65, 0.60]


def test_a_unit_whose_sources_are_all_in_the_top_k_takes_no_slot_and_freed_slots_cascade():
    units = [unit(0, 0.85, 0, [10]), unit(1, 0.65, 1, [13])]
    top = UnionRule("provenance")([BASE, units], 5)
    # first cut: u0 p10 p11 u1 p12; u0's source p10 is in it -> u0 takes no slot. Second cut: p10 p11 u1 p12 p13;
    # now u1's source p13 is in it -> u1 goes too. Third cut: the base top 5, which covers both units.
    assert keys(top) == ["p10", "p11", "p12", "p13", "p14"]
    assert [h.rank for h in top] == [0, 1, 2, 3, 4]


def test_a_unit_with_a_source_outside_the_top_k_keeps_its_slot():
    units = [unit(0, 0.85, 0, [10, 20]), unit(1, 0.75, 1, [99])]
    top = UnionRule("provenance")([BASE, units], 5)
    # p20 and p99 are not retrieved: both units bring something new and keep their places by score
    assert keys(top) == ["u0", "p10", "u1", "p11", "p12"]
    assert top[0].sources == [10, 20]


def test_a_unit_and_a_passage_never_both_take_slots_for_the_same_text():
    units = [
        unit(0, 0.90, 0, text="Passage 11 says FACT 11!"),  # p11's text, other case and punctuation
        unit(1, 0.88, 1, text="says fact 12"),  # inside p12's text
        unit(2, 0.86, 2, text="passage 1 says"),  # not inside "passage 10 says ...": whole words only
        unit(3, 0.84, 3, text="passage 1 says"),  # the same text as u2, taken after it
    ]
    top = UnionRule("provenance")([BASE, units], 5)
    # first cut: u0 u1 u2 u3 p10 -> u3 repeats u2 (u0 and u1 are not yet covered: p11 and p12 are not taken);
    # second cut: u0 u1 u2 p10 p11 -> u0 holds p11's text; third: u1 u2 p10 p11 p12 -> u1 is inside p12;
    # fourth: u2 p10 p11 p12 p13, none covered
    assert keys(top) == ["u2", "p10", "p11", "p12", "p13"]


def test_max_units_caps_the_units_per_query():
    units = [unit(0, 0.95, 0, [50]), unit(1, 0.90, 1, [51]), unit(2, 0.85, 2, [52])]
    top = UnionRule("provenance", max_units=1)([BASE, units], 5)
    assert keys(top) == ["u0", "p10", "p11", "p12", "p13"]
    assert keys(UnionRule("provenance", max_units=0)([BASE, units], 3)) == ["p10", "p11", "p12"]
    # the paper's merge has no cap
    assert keys(UnionRule("score", max_units=1)([BASE, units], 4)) == ["u0", "u1", "u2", "p10"]


def test_reciprocal_rank_fusion_ranks_each_index_by_its_own_order():
    units = [unit(0, 0.99, 0, [77]), unit(1, 0.98, 1, [78]), unit(2, 0.97, 2, [79])]
    # rrf_k = 1: fused 1/(1+1) = 0.5 for each index's first hit, 1/3 for the second, 1/4 for the third; a tie
    # goes to the base. Raw scores would have put all three units first.
    top = UnionRule("rrf", rrf_k=1)([BASE, units], 5)
    assert keys(top) == ["p10", "u0", "p11", "u1", "p12"]
    assert [h.score for h in top] == [0.80, 0.99, 0.70, 0.98, 0.60]  # retrieval scores kept (RePlug weighs them)
    # the provenance rule applies after the fusion: u0 drawn from p10, u1 from p12 (in the top K once u0 left)
    units[0].sources, units[1].sources = [10], [12]
    # cut 1: p10 u0 p11 u1 p12 -> u0 (p10) and u1 (p12) both covered; cut 2: p10 p11 u2 p12 p13 (u2 ties p12 at
    # 1/4 and the base goes first: p12 1/4, u2 1/4 -> p12 before u2)
    assert keys(UnionRule("rrf", rrf_k=1)([BASE, units], 5)) == ["p10", "p11", "p12", "u2", "p13"]


def test_the_gate_lets_a_unit_in_only_at_the_level_of_the_querys_best_passage():
    # The benchmark's two cases, in small, under the gate without the provenance rule: a unit restating the top
    # passage at a higher cosine (u0, 0.90 against p10's 0.80) takes rank 0 as in the paper's merge; a unit about a
    # neighbouring fact (u1, 0.65: above p12, below p10) would push p14 out under the paper's merge, and stays out.
    units = [unit(0, 0.90, 0, [10]), unit(1, 0.65, 1, [99])]
    gate = "gate-no-provenance"
    assert keys(UnionRule("score")([BASE, units], 5)) == ["u0", "p10", "p11", "u1", "p12"]
    assert keys(UnionRule(gate)([BASE, units], 5)) == ["u0", "p10", "p11", "p12", "p13"]
    # a margin of 0.2 lets in what scores >= 0.60 (u1 at 0.65); -0.15, only what beats p10 by 0.15 (nothing)
    assert keys(UnionRule(gate, gate_margin=0.2)([BASE, units], 5)) == ["u0", "p10", "p11", "u1", "p12"]
    assert keys(UnionRule(gate, gate_margin=-0.15)([BASE, units], 5)) == ["p10", "p11", "p12", "p13", "p14"]
    # max_units applies; with no passage retrieved there is nothing to calibrate against and units stay
    assert keys(UnionRule(gate, gate_margin=0.2, max_units=1)([BASE, units], 3)) == ["u0", "p10", "p11"]
    assert keys(UnionRule(gate)([[], units], 5)) == ["u0", "u1"]


def test_under_the_gate_a_covered_unit_above_the_gate_takes_no_slot_and_the_next_passage_gets_it():
    # u0 (0.90, source p10) and u2 (0.85, p11's text) pass the gate (p10's 0.80) but add nothing: p10 is in the top
    # K, p11 holds u2's text; u1 (0.95, source p99, not retrieved) passes the gate and brings something new.
    units = [unit(1, 0.95, 0, [99]), unit(0, 0.90, 1, [10]), unit(2, 0.85, 2, text="passage 11 says fact 11")]
    # without the rule: u1 u0 u2 p10 p11
    assert keys(UnionRule("gate-no-provenance")([BASE, units], 5)) == ["u1", "u0", "u2", "p10", "p11"]
    # with it (union 'gate'): cut 1 u1 u0 u2 p10 p11 -> u0 (p10 taken) and u2 (inside p11) dropped; cut 2 u1 p10
    # p11 p12 p13: their slots go to the next passages by score
    assert keys(UnionRule("gate")([BASE, units], 5)) == ["u1", "p10", "p11", "p12", "p13"]
    # a covered unit below the gate never counts: the gate drops u3 (0.50 < 0.80) before the rule looks
    assert keys(UnionRule("gate")([BASE, [unit(3, 0.5, 0, [99])]], 3)) == ["p10", "p11", "p12"]
    # the gate's margin still decides what reaches the rule: at 0.2 u4 (0.65, source p14 outside the top 3) enters
    assert keys(UnionRule("gate", gate_margin=0.2)([BASE, [unit(4, 0.65, 0, [14])]], 3)) == ["p10", "p11", "u4"]


def test_whether_the_provenance_rule_applies_is_a_function_of_the_union_name_alone():
    import typing

    from wbrag_ray.config import RetrievalConfig
    from wbrag_ray.retrieval.union import UNIONS

    assert set(typing.get_args(RetrievalConfig.model_fields["union"].annotation)) == {"auto", *UNIONS}
    assert tuple(n for n, u in UNIONS.items() if u.provenance_rule) == ("provenance", "rrf", "gate", "additive")
    assert {n for n, u in UNIONS.items() if u.gate} == {"gate", "gate-no-provenance"}


def test_a_query_without_units_keeps_the_base_top_k_in_every_setting():
    for name in ("auto", "score", "provenance", "rrf", "gate", "gate-no-provenance", "additive"):
        assert keys(UnionRule(name)([BASE, []], 3)) == ["p10", "p11", "p12"]


def test_unknown_union_is_named():
    with pytest.raises(ValueError, match="retrieval.union: 'max' is not one of auto, score, provenance, rrf, gate, "
                       "gate-no-provenance, additive"):
        UnionRule("max")


def test_provenance_travels_in_the_docs_json_only_for_units():
    text = hits_to_json([BASE[0], unit(0, 0.5, 1, [10, 11])])
    rows = json.loads(text)
    assert "sources" not in rows[0] and rows[1]["sources"] == [10, 11]
    assert [h.sources for h in hits_from_json(text)] == [None, [10, 11]]


def test_provenance_beside_the_index_applies_to_the_unit_kind_it_was_trained_on(tmp_path):
    loc = resolve(str(tmp_path / "index"))
    write_provenance(loc, [1 << 62, (1 << 62) + 1], [[3, 4], [9]], "passage")
    assert read_provenance(loc, "passage") == {1 << 62: [3, 4], (1 << 62) + 1: [9]}
    # a pruned sentence index numbers sentences: passage ids say nothing about them
    assert read_provenance(loc, "sentence") == {}
    assert read_provenance(resolve(str(tmp_path / "elsewhere")), "passage") == {}
    hits = with_provenance([[unit(1 << 62, 0.5, 0), unit(7, 0.4, 1)]], read_provenance(loc, "passage"))
    assert [h.sources for h in hits[0]] == [[3, 4], None]


def test_an_evaluation_records_and_names_the_setting_its_union_reads():
    from wbrag_ray.config import load_config
    from wbrag_ray.evaluation.stage import union_label, union_settings, union_suffix

    def config(*overrides):
        return load_config(overrides=list(overrides))

    assert union_label(config()) == "auto" and union_suffix(config()) == ""  # the default
    assert union_settings(config()) == {"union": "auto", "max_units": None}
    assert union_settings(config("retrieval.union=gate")) == {"union": "gate", "max_units": None, "gate_margin": 0.0}
    assert union_settings(config("retrieval.union=additive", "retrieval.additive_margin=0.3")) == {
        "union": "additive", "max_units": None, "additive_margin": 0.3}
    assert union_label(config("retrieval.union=score")) == "score" and union_suffix(
        config("retrieval.union=score")) == "-score"
    gate = config("retrieval.union=gate", "retrieval.gate_margin=0.05", "retrieval.rrf_k=10")
    assert union_label(gate) == "gate, gate_margin 0.05" and union_suffix(gate) == "-gate-gate_margin0.05"
    assert union_label(config("retrieval.union=rrf", "retrieval.rrf_k=10", "retrieval.max_units=1")) == \
        "rrf, max_units 1, rrf_k 10"


def test_the_rule_built_without_a_config_is_the_configs_default():
    from wbrag_ray.config import RetrievalConfig

    assert UnionRule() == UnionRule.of(RetrievalConfig())


def test_one_union_serves_the_in_process_retriever_and_the_service(monkeypatch):
    """`cut_union` is the union of both searchers: each member's hits get its provenance (read from the index, so
    the hits carry none), then each query's lists are cut by the rule; a lone index is its own top K. Both the
    in-process `IndexUnion` and the service's `RetrievalService` hand their members' hits to it."""
    from wbrag_ray.retrieval import local, service
    from wbrag_ray.retrieval.union import cut_union

    units = [unit(0, 0.85, 0), unit(1, 0.65, 1)]  # no sources on the hits: the provenance map gives them
    provenance = [{}, {0: [10], 1: [99]}]
    top = cut_union([[BASE], [units]], provenance, UnionRule("provenance"), 5)
    # u0's source p10 is taken, so u0 takes no slot; u1's p99 is not retrieved: it keeps its place by score
    assert [keys(q) for q in top] == [["p10", "p11", "u1", "p12", "p13"]]
    assert top[0][2].sources == [99]
    assert cut_union([[BASE]], [{}], UnionRule("provenance"), 5) == [BASE]
    assert local.cut_union is cut_union and issubclass(service.RetrievalService, local.IndexUnion)


def test_the_additive_rule_keeps_the_base_top_k_whole_and_appends_units_that_pass_its_margin():
    """Worked by hand: BASE's 3rd passage (the K-th at K = 3) scores 0.60. additive_margin 0: a unit needs 0.60
    (what the paper's merge would let into the top 3); 0.15: 0.45."""
    units = [unit(0, 0.95, 0, [50]), unit(1, 0.65, 1, [51]), unit(2, 0.50, 2, [52])]
    top = UnionRule("additive")([BASE, units], 3)
    # the base's 3 whole and in order; one unit where max_units is unset (ADDITIVE_UNITS): the best, u0
    assert keys(top) == ["p10", "p11", "p12", "u0"] and [h.rank for h in top] == [0, 1, 2, 3]
    # max_units 3: u1 (0.65 >= 0.60) too; u2 (0.50) is below the K-th passage even with room for it
    assert keys(UnionRule("additive", max_units=3)([BASE, units], 3)) == ["p10", "p11", "p12", "u0", "u1"]
    assert keys(UnionRule("additive", max_units=3, additive_margin=0.15)([BASE, units], 3)) == [
        "p10", "p11", "p12", "u0", "u1", "u2"]
    # where the paper's merge would push p12 out for u0 and u1, the additive rule keeps it
    assert keys(UnionRule("score")([BASE, units], 3)) == ["u0", "p10", "p11"]
    assert keys(UnionRule("additive", max_units=0)([BASE, units], 3)) == ["p10", "p11", "p12"]
    # fewer passages than K: nothing to compare with, every unit may join (up to the cap)
    assert keys(UnionRule("additive", max_units=3)([BASE[:2], units], 3)) == ["p10", "p11", "u0", "u1", "u2"]


def test_the_additive_rule_appends_no_unit_the_taken_passages_or_an_earlier_unit_already_hold():
    units = [unit(0, 0.95, 0, [10]),  # its source p10 is in the top 3: covered
             unit(1, 0.90, 1, text="passage 11 says fact 11"),  # p11's text: covered
             unit(2, 0.85, 2, [60], text="fact 60 holds"),
             unit(3, 0.84, 3, [61], text="fact 60 holds")]  # u2's text, appended before it: covered
    top = UnionRule("additive", max_units=3)([BASE, units], 3)
    assert keys(top) == ["p10", "p11", "p12", "u2"]
    # a unit whose source is p12: appended after the top 2, which lack it; covered by the top 3, which hold it
    late = [unit(4, 0.95, 0, [12])]
    assert keys(UnionRule("additive")([BASE, late], 2)) == ["p10", "p11", "u4"]
    assert keys(UnionRule("additive")([BASE, late], 3)) == ["p10", "p11", "p12"]


def test_auto_searches_with_the_rule_the_version_chose_else_the_papers_merge_with_the_provenance_guard(tmp_path):
    from wbrag_ray.retrieval.union import FALLBACK_UNION, UNION_CHOICE, read_choice, write_choice

    chosen, unchosen = resolve(str(tmp_path / "chosen")), resolve(str(tmp_path / "unchosen"))
    write_choice(chosen, UnionRule("gate", max_units=2, gate_margin=0.2), "the best of 7 rules")
    assert chosen.join(UNION_CHOICE).read_json() == {"union": "gate", "max_units": 2, "gate_margin": 0.2,
                                                     "why": "the best of 7 rules"}
    assert read_choice(chosen) == {"union": "gate", "max_units": 2, "gate_margin": 0.2}
    assert read_choice(unchosen) is None
    auto = UnionRule("auto", max_units=1, additive_margin=0.4)
    assert auto.resolved([chosen]) == UnionRule("gate", max_units=2, gate_margin=0.2, additive_margin=0.4)
    assert auto.resolved([unchosen]) == UnionRule(FALLBACK_UNION, max_units=1, additive_margin=0.4)
    assert FALLBACK_UNION == "provenance"
    # an explicit rule is searched as set, whatever the version chose
    assert UnionRule("score").resolved([chosen]) == UnionRule("score")
    # what the resolved rule does: the version's gate at 0.2, where the default gate (margin 0) keeps u0 out
    units = [unit(0, 0.70, 0, [99])]  # 0.10 below the best passage: in under gate 0.2, out under gate 0
    assert keys(auto.resolved([chosen])([BASE, units], 3)) == ["p10", "p11", "u0"]  # a tie: the base's first
    assert keys(UnionRule("gate")([BASE, units], 3)) == ["p10", "p11", "p12"]
