"""The report's table of the tuned adapter's effect per grid setting: answers without and with it, the
questions it fixed and broke, and where it does not gain, the measured reason."""

from __future__ import annotations

from typing import Any

import pandas as pd

from wbrag_ray.evaluation.evaluate import load_results
from wbrag_ray.evaluation.stage import dataset_name
from wbrag_ray.metrics import sign_test
from wbrag_ray.report.render import Table
from wbrag_ray.run import RunFolder
from wbrag_ray.storage import Location
from wbrag_ray.zerorag.grid import eval_label

# a gain or loss of fewer questions than a two-sided sign test at this level can tell from chance is "noise"
SIGNIFICANCE = 0.05


def adapter_effect(run: RunFolder) -> list[dict[str, Any]]:
    """One row per grid setting evaluated with and without the adapter: their figures, fixed, broken."""
    grid = run.layout.zero_rag.grid
    if not grid.exists():
        return []
    rows = grid.read_json().get("rows", [])

    def key(r: dict[str, Any]) -> tuple:
        return r.get("ratio", 0.0), r.get("method"), bool(r.get("router")), bool(r.get("writeback"))

    without = {key(r): r for r in rows if not r.get("adapter")}
    tuned = {key(r): r for r in rows if r.get("adapter")}
    results = {(m.get("setting"), m.get("method")): m for m in load_results(run).values()}
    label = _labeller(run, results)
    out = []
    for k in sorted(set(without) & set(tuned), key=lambda k: (k[2], k[3], k[1], k[0])):
        ratio, method, router, writeback = k
        a, b = without[k], tuned[k]
        labels = [label(ratio, writeback, router, adapter) for adapter in (False, True)]
        words = [(results.get((lb, method)) or {}).get("answer_words") for lb in labels]
        out.append({"ratio": ratio, "method": method, "router": router, "writeback": writeback, "n": b.get("n"),
                    "acc_without": a.get("acc"), "acc_with": b.get("acc"), "em_without": a.get("em"),
                    "em_with": b.get("em"), "delta_acc": round(b["acc"] - a["acc"], 4)
                    if a.get("acc") is not None and b.get("acc") is not None else None, "words_without": words[0],
                    "words_with": words[1], **_flips(*(run.layout.eval_result(lb, method).predictions for lb in labels))})
    return out


def _labeller(run: RunFolder, results: dict[tuple, str]):
    """The evaluation label of a grid cell (`zerorag.grid.eval_label` with the run's dataset name)."""
    name = None
    if run.layout.run_json.exists():
        config = run.load_config()
        name = dataset_name(config, config.eval.dataset) if config.eval.dataset else None
    if name is None:  # a run without its config: the label the unpruned no-adapter cell was evaluated under
        settings = [s for s, _ in results if s and s.endswith(eval_label("", 0.0))]
        name = settings[0][: -len(eval_label("", 0.0))] if settings else ""
    return lambda ratio, writeback, router, adapter: eval_label(name, ratio, writeback, router, adapter)


def _flips(without: Location, tuned: Location) -> dict[str, Any]:
    """Per question: how many the adapter fixed and broke, and the sign test; None each without both predictions."""
    if not (without.exists() and tuned.exists()):
        return dict.fromkeys(("fixed", "broken", "sign_p"))
    a, b = (t.read_table(["id", "acc"]).to_pandas().set_index("id")["acc"] for t in (without, tuned))
    both = pd.concat({"a": a, "b": b}, axis=1, join="inner")
    fixed = int(((both["a"] == 0) & (both["b"] > 0)).sum())
    broken = int(((both["a"] > 0) & (both["b"] == 0)).sum())
    return {"fixed": fixed, "broken": broken, "sign_p": round(sign_test(fixed, broken, two_sided=True), 4)}


def loss_reason(row: dict[str, Any], tune: dict[str, Any]) -> str:
    """Why the adapter did not gain in this cell, in one line, from the answers' form, the questions it turned and
    how much the tuning saw."""
    parts = []
    em0, em1, w0, w1 = row.get("em_without"), row.get("em_with"), row.get("words_without"), row.get("words_with")
    seen = f"{tune.get('examples_seen')} examples seen, {tune.get('epochs_seen')} epochs" if tune else "its steps"
    if row.get("fixed") == row.get("broken") == 0:
        parts.append(f"no answer turned right or wrong: the tuning ({seen}) changed nothing this setting scores")
    elif None not in (em0, em1, w0, w1):
        form = f"em {em0:.3f} -> {em1:.3f}, {w0:g} -> {w1:g} words per answer"
        if em1 - em0 >= 0.1 and w1 < 0.6 * w0:
            parts.append(f"tuned to the gold's short form ({form}) the model picks the wrong span more often than its "
                         "untuned sentence holds the gold, which acc credits")
        elif abs(em1 - em0) < 0.05 and w0 and abs(w1 - w0) < 0.25 * w0:
            parts.append(f"answer form unchanged ({form}): the tuning ({seen}) changed which answers are right, not "
                         "how the model answers")
        else:
            parts.append(form)
    if row.get("fixed") is not None and row["fixed"] + row["broken"]:
        p = row["sign_p"]
        parts.append(f"fixed {row['fixed']}, broke {row['broken']} of {row['n']} (sign test p={p:.2g}"
                     + (", within chance)" if p >= SIGNIFICANCE else ")"))
    return "; ".join(parts)


def adapter_tables(run: RunFolder, tune: dict[str, Any] | None) -> list[Table]:
    """The effect table and, where the adapter does not gain accuracy, the reasons table."""
    rows = adapter_effect(run)
    if not rows:
        return []
    yes = {True: "yes", False: "no"}
    tables = [Table("noise-tolerant adapter: effect per ratio, without vs with it", [
        "ratio", "method", "router", "write-back", "n", "acc without", "acc with", "delta acc", "em without", "em with",
        "words without", "words with", "fixed", "broken", "sign test p"],
        [[r["ratio"], r["method"], yes[r["router"]], yes[r["writeback"]], r["n"], r["acc_without"], r["acc_with"],
          r["delta_acc"], r["em_without"], r["em_with"], r["words_without"], r["words_with"], r["fixed"], r["broken"],
          r["sign_p"]] for r in rows])]
    losses = [r for r in rows if r["delta_acc"] is not None and r["delta_acc"] <= 0]
    if losses:
        tables.append(Table("where the adapter does not gain: the measured reason", ["ratio", "method", "router",
                                                                                   "write-back", "delta acc", "reason"],
                            [[r["ratio"], r["method"], yes[r["router"]], yes[r["writeback"]], r["delta_acc"],
                              loss_reason(r, tune or {})] for r in losses]))
    return tables
