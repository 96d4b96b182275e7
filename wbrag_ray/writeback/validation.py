"""A write-back version's validation: held-out training questions answered with the base alone and beside the
version under each union rule of CANDIDATES, so a version that hurts is seen before activation and `auto`
searches with the rule that did best (`choose_union`). Result: RUN/writeback/<version>/validation.json."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from wbrag_ray.config import AUTO_VALIDATION_MIN, WbragConfig, WritebackConfig
from wbrag_ray.evaluation.effect import CHANCE, writeback_effect
from wbrag_ray.evaluation.evaluate import evaluate_stage
from wbrag_ray.formats import read_questions
from wbrag_ray.generation.passes import GeneratorPasses
from wbrag_ray.metrics import sign_test
from wbrag_ray.retrieval.hits import hits_from_json
from wbrag_ray.retrieval.union import AUTO, BASE, FALLBACK_UNION, PAPER_UNION, UnionRule, write_choice
from wbrag_ray.run import RunFolder

if TYPE_CHECKING:
    from wbrag_ray.config import RetrievalConfig
    from wbrag_ray.stages.service import Services


def held_out(ids: Sequence[str], fraction: float | None) -> set[str]:
    """round(fraction x n) of the ids (at least one), the ones whose hash comes first: none without a fraction."""
    if not fraction or not ids:
        return set()
    n = max(1, round(fraction * len(ids)))
    return set(sorted(ids, key=lambda i: hashlib.blake2b(i.encode(), digest_size=8).digest())[:n])


def split(questions: pa.Table, fraction: float | None) -> tuple[pa.Table, pa.Table]:
    """(the questions to train on, the held-out ones)."""
    ids = [str(i) for i in questions["id"].to_pylist()]
    out = held_out(ids, fraction)
    mask = pa.array([i in out for i in ids], pa.bool_())
    return questions.filter(pc.invert(mask)), questions.filter(mask)


def skipped(wb: WritebackConfig, questions: int) -> str | None:
    """Why nothing is held out of `questions` training questions (None: a fraction is)."""
    if wb.validation is None:
        return "off (writeback.validation: null)"
    if wb.validation_fraction(questions) is None:
        return f"skipped, only {questions} training questions (auto needs {AUTO_VALIDATION_MIN})"
    return None


# Union rules a validation answers under (label, settings), the paper's merge first; margins in cosine.
CANDIDATES: tuple[tuple[str, dict[str, Any]], ...] = (
    ("score", {"union": "score"}),
    ("provenance", {"union": "provenance"}),
    ("gate", {"union": "gate", "gate_margin": 0.0}),
    ("gate 0.1", {"union": "gate", "gate_margin": 0.1}),
    ("gate 0.2", {"union": "gate", "gate_margin": 0.2}),
    ("additive", {"union": "additive", "additive_margin": 0.0}),
    ("additive 0.05", {"union": "additive", "additive_margin": 0.05}),
)
CONFIGURED = "configured"  # the label of an explicit retrieval.union that is none of the candidates
# The fewest held-out questions a union is chosen on: all-won over 5 decided is significant at 5%.
UNION_CHOICE_MIN = 60


def _deltas(figures: dict[str, Any]) -> dict[str, int]:
    """{question id: +1 won, -1 lost} of one rule against the base (its won_ids / lost_ids)."""
    return {**dict.fromkeys(figures.get("won_ids", ()), 1), **dict.fromkeys(figures.get("lost_ids", ()), -1)}


def decided(rule: dict[str, Any], other: dict[str, Any] | None) -> tuple[int, int]:
    """(questions `rule` answered better than `other`, worse), against the same base answers."""
    a, b = _deltas(rule), _deltas(other or {})
    ids = a.keys() | b.keys()
    return sum(a.get(i, 0) > b.get(i, 0) for i in ids), sum(a.get(i, 0) < b.get(i, 0) for i in ids)


def choose_union(figures: dict[str, dict[str, Any]], questions: int, metric: str = "acc") -> tuple[str, str]:
    """(label of the rule `auto` searches with, why): the paper's merge unless a candidate beat it beyond chance;
    among those the best `metric`, then fewest lost. Below UNION_CHOICE_MIN, FALLBACK_UNION."""
    if questions < UNION_CHOICE_MIN:
        return FALLBACK_UNION, (f"{questions} validation questions are too few to choose on (at least "
                                f"{UNION_CHOICE_MIN}): the paper's merge with the provenance guard")
    order = [label for label, _ in CANDIDATES if label in figures] + [k for k in figures if k not in dict(CANDIDATES)]
    paper = figures.get(PAPER_UNION)
    versus = {c: decided(figures[c], paper) for c in order if c != PAPER_UNION}
    better = [c for c in versus if sign_test(*versus[c]) < CHANCE]
    if paper is not None and not better:
        runner = min(versus, key=lambda c: (-figures[c][metric], figures[c]["lost"], order.index(c)), default=None)
        beside = "" if runner is None else (
            f"; the best other, {runner} ({metric} {figures[runner][metric]:.3f}), answered {versus[runner][0]} "
            f"better and {versus[runner][1]} worse than it (p = {sign_test(*versus[runner]):.2f})")
        return PAPER_UNION, (f"the paper's merge: no rule did better on {questions} validation questions beyond "
                             f"chance ({metric} {paper[metric]:.3f}, won {paper['won']}, lost {paper['lost']}{beside})")
    best = min(better or order, key=lambda c: (-figures[c][metric], figures[c]["lost"], order.index(c)))
    f = figures[best]
    against = "" if paper is None else (
        f"; better than the paper's merge on {versus[best][0]} questions, worse on {versus[best][1]}: "
        f"p = {sign_test(*versus[best]):.3f}")
    return best, (f"the best of {len(figures)} rules on {questions} validation questions ({metric} {f[metric]:.3f}, "
                  f"won {f['won']}, lost {f['lost']}{against})")


def effect_figures(base, union, metric: str) -> dict[str, Any]:
    """One rule's figures against the base's: metric, effect counts, distinct units in a top K, changed answers."""
    both = base[["id", "prediction"]].merge(union[["id", "prediction"]], on="id", suffixes=("_base", "_wb"))
    units = {h.id for docs in union["docs"] for h in hits_from_json(docs) if h.source != BASE}
    return {metric: round(float(union[metric].mean()), 4), **writeback_effect(base, union, metric),
            "units_reached": len(units),
            "answers_changed": int((both["prediction_base"] != both["prediction_wb"]).sum())}


def candidate_rules(retrieval: RetrievalConfig) -> dict[str, UnionRule]:
    """{label: rule} of CANDIDATES, each with the rest of `retrieval` (its max_units)."""
    return {label: UnionRule.of(retrieval.model_copy(update=settings)) for label, settings in CANDIDATES}


def answer_under_each_rule(run: RunFolder, config: WbragConfig, dataset: str, label: str, version: str,
                           rules: dict[str, UnionRule], passes, force: bool = False):
    """Predictions with the base alone and beside `version` under each rule: (base, {label: predictions})."""
    method = config.eval.methods[0]

    def predictions(name: str):
        return run.layout.eval_result(name, method).predictions.read_table().to_pandas()

    evaluate_stage(run, config, dataset, f"{label}-base", force=force, passes=passes)
    frames = {}
    for name, rule in rules.items():
        ev = f"{label}-{name.replace(' ', '-')}"
        cfg = config.model_copy(update={"retrieval": config.retrieval.model_copy(update=rule.settings())})
        evaluate_stage(run, cfg, dataset, ev, force=force, passes=passes, writeback_version=version,
                       setting=f"base+writeback:{version} ({name})")
        frames[name] = predictions(ev)
    return predictions(f"{label}-base"), frames


def validate(run: RunFolder, config: WbragConfig, train: str, version: str, metric: str,
             force: bool = False, services: Services | None = None) -> dict[str, Any] | str:
    """Base vs base + `version` on the held-out questions under every candidate rule; writes `auto`'s choice beside
    the index. Headline figures are the run's rule's; or why nothing was held out (`skipped`)."""
    wb = config.writeback
    if wb.validation is None:  # off: the training file is not read again
        return skipped(wb, 0) or ""
    questions, _ = read_questions(train, "writeback.train", limit=wb.limit)
    why = skipped(wb, questions.num_rows)
    if why:
        print(f"write-back {version}: validation {why}", flush=True)
        return why
    folder = run.layout.writeback_version(version)
    folder.validation_questions.write_table(split(questions, wb.validation_fraction(questions.num_rows))[1])
    method = wb.rag_method
    cfg = config.model_copy(update={"eval": config.eval.model_copy(update={"methods": [method], "limit": None})})
    rules = candidate_rules(cfg.retrieval)
    configured = UnionRule.of(cfg.retrieval)
    if configured.union != AUTO and configured.settings() not in [r.settings() for r in rules.values()]:
        rules[CONFIGURED] = configured
    with GeneratorPasses(config.generator, services) as passes:  # one command: an unchanged top K keeps its answer
        base, frames = answer_under_each_rule(run, cfg, folder.validation_questions.uri,
                                              f"writeback-{version}-validation", version, rules, passes, force)
    figures = {name: {**rules[name].settings(), **effect_figures(base, frame, metric)} for name, frame in frames.items()}
    # the fallback (FALLBACK_UNION) is the candidate of its own name: every choice is one of `rules`
    chosen, reason = choose_union({k: v for k, v in figures.items() if k != CONFIGURED}, len(base), metric)
    write_choice(folder.index, rules[chosen], reason)
    applied = chosen if configured.union == AUTO else next(
        k for k, r in rules.items() if r.settings() == configured.settings())
    head = figures[applied]
    result = {"version": version, "method": method, "metric": metric, "base": round(float(base[metric].mean()), 4),
              "with_version": head[metric], "configured": configured.union, "applied": applied,
              **{k: v for k, v in head.items() if k != metric}, "chosen": chosen, "choice": reason,
              "candidates": {k: {c: v for c, v in f.items() if not c.endswith("_ids")} for k, f in figures.items()}}
    folder.validation.write_json(result)
    print(format_validation(result), flush=True)
    return result


def format_validation(r: dict[str, Any]) -> str:
    """What the version's validation measured: every rule's figures, the chosen one, and the applied one's."""
    lines = [f"write-back {r['version']} on {r['questions']} held-out training questions ({r['method']}): "
             f"{r['metric']} {r['base']:.3f} with the base alone; per union rule:",
             f"  {'rule':<14}{r['metric']:>7}{'unit in top K':>15}{'units':>7}{'changed':>9}{'won':>5}{'lost':>6}"]
    for name, f in r.get("candidates", {}).items():
        mark = " <- chosen" if name == r.get("chosen") else ""
        lines.append(f"  {name:<14}{f[r['metric']]:>7.3f}{f['unit_in_top_k']:>15}{f['units_reached']:>7}"
                     f"{f['answers_changed']:>9}{f['won']:>5}{f['lost']:>6}{mark}")
    lines.append(f"  chosen: {r['chosen']} ({r['choice']})")
    return "\n".join(lines)
