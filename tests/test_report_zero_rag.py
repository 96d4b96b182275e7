"""Zero-RAG in `wbrag report` and `wbrag inspect`, on a synthetic run folder with the layout the Zero-RAG
pipeline writes (no Ray, no models): every plot it references exists, the Markdown twin has the HTML's tables,
and inspect shows pruned sentences with their QA pairs."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from wbrag_ray.inspection import inspect_run
from wbrag_ray.metrics import sign_test
from wbrag_ray.report import write_report
from wbrag_ray.report.adapter_effect import adapter_effect
from wbrag_ray.report.sections import sample_column
from wbrag_ray.run import RunFolder
from wbrag_ray.storage import Location
from wbrag_ray.zerorag.grid import eval_label

N_SENTENCES = 40
SAMPLE = range(12)  # sids in the mastery sample
ZR_PLOTS = {"zero_rag_mastery.png", "zero_rag_pruners.png", "zero_rag_predicted_mastery.png",
            "zero_rag_ratio_sweep.png", "zero_rag_tuning_loss.png"}


def _parquet(loc: Location, columns: dict, schema: pa.Schema) -> None:
    loc.write_table(pa.table(columns, schema=schema))


def _qa_rows():
    """Three QA pairs per sampled sentence; every fifth pair unparseable, every seventh answer off-sentence."""
    rows = []
    for sid in SAMPLE:
        for i in range(3):
            k = sid * 3 + i
            status = "unparseable" if k % 5 == 4 else "answer_not_in_sentence" if k % 7 == 6 else "ok"
            ok = status == "ok"
            rows.append(dict(sid=sid, qa_index=i, question=f"What is fact {i} of sentence {sid}?", answer=f"answer{sid}-{i}",
                             status=status, raw=f"garbled output {k}" if status == "unparseable" else f"Q: ... A: answer{sid}-{i}",
                             prediction=(f"answer{sid}-{i}" if k % 2 else "no idea") if ok else None,
                             em=float(k % 2) if ok else None))
    return rows


def _build_zero_rag_run(root: Path, full: bool = True) -> Path:
    run = root / "run"
    layout = RunFolder(str(run)).layout
    sids = np.arange(N_SENTENCES)
    _parquet(layout.ingest.sentences.join("part-00000.parquet"),
             {"sid": sids, "pid": sids // 4, "position": (sids % 4).astype(np.int32),
              "text": [f"Sentence {s} states fact number {s}." for s in sids]},
             pa.schema([("sid", pa.int64()), ("pid", pa.int64()), ("position", pa.int32()), ("text", pa.string())]))

    zr = layout.zero_rag
    qa = _qa_rows()
    _parquet(zr.qa, {k: [r[k] for r in qa] for k in qa[0]}, pa.schema([
        ("sid", pa.int64()), ("qa_index", pa.int32()), ("question", pa.string()), ("answer", pa.string()),
        ("status", pa.string()), ("raw", pa.string()), ("prediction", pa.string()), ("em", pa.float64())]))
    scores = []
    for sid in SAMPLE:
        ems = [r["em"] for r in qa if r["sid"] == sid and r["status"] == "ok"]
        scores.append(dict(sid=sid, title=f"T{sid // 4}", text=f"Sentence {sid} states fact number {sid}.", n_qa=3,
                           n_valid=len(ems), mastery=sum(ems) / len(ems) if ems else None))
    _parquet(zr.scores, {k: [r[k] for r in scores] for k in scores[0]}, pa.schema([
        ("sid", pa.int64()), ("title", pa.string()), ("text", pa.string()), ("n_qa", pa.int32()), ("n_valid", pa.int32()),
        ("mastery", pa.float64())]))
    counts = {st: sum(r["status"] == st for r in qa) for st in ("ok", "unparseable", "answer_not_in_sentence")}
    zr.mastery_stats.write_json({
        "mode": "llm", "sample": len(SAMPLE), "sentences": len(SAMPLE), "qa_pairs": len(qa), "valid": counts["ok"],
        "unparseable": counts["unparseable"], "answer_not_in_sentence": counts["answer_not_in_sentence"],
        "scored_sentences": sum(s["mastery"] is not None for s in scores), "mean_mastery": 0.5, "generator_calls": 24,
        "seconds": 12.5, "calls_per_s": 1.9})
    if not full:
        return run

    rng = np.random.default_rng(0)
    measured = [s["mastery"] for s in scores if s["mastery"] is not None]
    for kind in ("embedding", "lm"):
        zr.pruner_metrics(kind).write_json({"kind": kind, "n_train": 8, "n_val": len(measured), "mse": 0.08,
              "spearman": 0.41, "top_quantile": {"q": 0.3, "precision": 0.5, "recall": 0.5}, "seconds": 3.2})
        _parquet(zr.pruner_validation(kind),
                 {"sid": np.arange(len(measured)), "measured": measured,
                  "predicted": np.clip(np.array(measured) + rng.normal(0, 0.2, len(measured)), 0, 1)},
                 pa.schema([("sid", pa.int64()), ("measured", pa.float64()), ("predicted", pa.float64())]))

    pred = rng.uniform(0, 0.8, N_SENTENCES).astype(np.float32)
    pred[5] = 0.99  # a sampled sentence (with QA pairs) that the pruner is surest about
    pred[30] = 0.97  # one outside the sample: its text comes from ingest/sentences alone
    _parquet(zr.predictions.join("part-00000.parquet"), {"sid": sids, "mastery_pred": pred},
             pa.schema([("sid", pa.int64()), ("mastery_pred", pa.float32())]))
    for ratio in (0.3, 0.5):
        threshold = float(np.quantile(pred, 1 - ratio))
        keep = pred < threshold
        zr.pruned(ratio).stats.write_json({
            "ratio": ratio, "achieved_ratio": 1 - keep.mean(), "threshold": threshold, "sentences_in": N_SENTENCES,
            "kept": int(keep.sum()), "dropped": int((~keep).sum()), "index_bytes": int(keep.sum()) * 1536,
            "source_index_bytes": N_SENTENCES * 1536, "pruner": "embedding"})
        _parquet(zr.pruned(ratio).keep.join("part-00000.parquet"), {"id": sids, "mastery_pred": pred, "keep": keep},
                 pa.schema([("id", pa.int64()), ("mastery_pred", pa.float32()), ("keep", pa.bool_())]))

    rows = [{"ratio": 0.0, "router": False, "adapter": False, "writeback": False, "method": "no-retrieval", "n": 40,
             "em": 0.05, "f1": 0.1, "acc": 0.1, "latency_ms_per_query": 0.0, "index_bytes": N_SENTENCES * 1536,
             "sentences": N_SENTENCES, "retrieval_skipped": 1.0}]
    for ratio in (0.0, 0.3, 0.5):
        for router, adapter, writeback in ((False, False, False), (True, False, False), (True, True, False), (False, False, True)):
            if writeback and ratio == 0.0:
                continue
            acc = 0.4 - 0.1 * ratio + 0.05 * adapter + 0.08 * writeback
            rows.append({"ratio": ratio, "router": router, "adapter": adapter, "writeback": writeback, "method": "naive",
                         "n": 40, "em": acc - 0.1, "f1": acc, "acc": acc,
                         "latency_ms_per_query": 5.0 * (1 - ratio) * (0.7 if router else 1),
                         "index_bytes": int(N_SENTENCES * 1536 * (1 - ratio)), "sentences": int(N_SENTENCES * (1 - ratio)),
                         "retrieval_skipped": 0.3 if router else 0.0})
    zr.grid.write_json({"rows": rows})
    zr.router_metrics.write_json({"n_train": 80, "n_val": 20, "positives": 31, "val_accuracy": 0.7,
                                       "val_auc": 0.74, "threshold": 0.5})
    zr.adapter_tune.write_json({"losses": list(np.linspace(2.5, 1.2, 30) + rng.normal(0, 0.1, 30)), "steps": 30,
                                     "seconds": 75.0, "formats": {"relevant": 40, "distracting": 40, "none": 40}})
    return run


def _report(run: Path) -> tuple[str, str, list[str]]:
    layout = RunFolder(str(run)).layout
    write_report(RunFolder(str(run)))
    html_text = layout.report_html.read_bytes().decode()
    md = layout.report_markdown.read_bytes().decode()
    images = re.findall(r"<img src='([^']+)'", html_text)
    for img in images:
        data = layout.report.join(img).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000, img
    html_tables = re.findall(r"<caption>([^<]+)</caption>", html_text)
    assert html_tables == re.findall(r"^\*\*(.+)\*\*$", md, re.M)
    assert re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md) == images
    return html_text, md, images


@pytest.fixture
def zr_run(tmp_path) -> Path:
    return _build_zero_rag_run(tmp_path)


def test_report_shows_every_zero_rag_plot_and_table(zr_run):
    html_text, md, images = _report(zr_run)
    assert ZR_PLOTS <= set(images)
    for title in ("mastery sample", "QA pairs by status", "pruning levels", "answers, latency and size per pruning ratio",
                  "query router", "noise-tolerant tuning"):
        assert f"**{title}**" in md
    assert "pruner validation" in md
    # one grid row per (ratio, write-back, router, adapter, method), each in both renderings, and one row of the
    # adapter's effect per (ratio, router) it was evaluated at with and without (with the router, at 3 ratios)
    assert md.count("| naive |") == 11 + 3 and html_text.count("<td>naive</td>") == 11 + 3
    assert "**noise-tolerant adapter: effect per ratio, without vs with it**" in md
    assert "| 0.3 | naive | yes | no | 40 | 0.37 | 0.42 | 0.05 |" in md
    assert "does not gain" not in md  # it gains everywhere here
    assert md.count("| no-retrieval |") == 1 and "| 0.5 | naive | yes | no | no | 40 |" in md
    assert re.search(r"^\| answer_not_in_sentence \| 4 \| 0\.1111 \|  \|$", md, re.M)  # status table: count, share, no EM
    assert "| embedding | 8 |" in md and "| lm | 8 |" in md


def test_report_draws_only_what_the_run_has(tmp_path):
    run = _build_zero_rag_run(tmp_path, full=False)  # the mastery stage alone
    html_text, md, images = _report(run)
    assert set(images) & ZR_PLOTS == {"zero_rag_mastery.png"}
    assert "Zero-RAG: mastery scores" in html_text and "Zero-RAG: pruners" not in html_text

    bare = tmp_path / "bare"
    RunFolder(str(bare)).layout.ingest.root.mkdir()
    html_text, _, images = _report(bare)
    assert "Zero-RAG" not in html_text and not set(images) & ZR_PLOTS


def _cell(run: RunFolder, ratio: float, adapter: bool, right: list[int], em: float, words: float) -> dict:
    """One evaluated grid cell (naive, no router): metrics, predictions of 10 questions (those in `right`
    correct), and its grid row."""
    label = eval_label("demo_qa", ratio, adapter=adapter)
    result = run.layout.eval_result(label, "naive")
    acc = len(right) / 10
    result.metrics.write_json({"setting": label, "method": "naive", "n": 10, "acc": acc, "em": em, "f1": acc,
                               "answer_words": words})
    ids = [f"q{i}" for i in range(10)]
    _parquet(result.predictions, {"id": ids, "acc": [float(i in right) for i in range(10)],
                                  "answer": ["an answer"] * 10},
             pa.schema([("id", pa.string()), ("acc", pa.float64()), ("answer", pa.string())]))
    return {"ratio": ratio, "router": False, "adapter": adapter, "writeback": False, "method": "naive", "n": 10,
            "em": em, "f1": acc, "acc": acc, "latency_ms_per_query": 1.0, "index_bytes": 1, "sentences": 1,
            "retrieval_skipped": 0.0}


def test_adapter_effect_per_ratio_with_the_measured_reason_where_it_loses(tmp_path):
    assert sign_test(1, 6, two_sided=True) == 0.125 and sign_test(0, 0, True) == 1.0 and sign_test(5, 5, True) == 1.0
    run = RunFolder(str(tmp_path / "run"))
    rows = [
        _cell(run, 0.0, False, [0, 1, 2, 3, 4, 5, 6], 0.0, 9.5),
        _cell(run, 0.0, True, [0, 1, 2, 3, 4, 5, 6, 7], 0.0, 9.0),  # fixed 7
        _cell(run, 0.3, False, [0, 1, 2, 3, 4, 5, 6], 0.0, 9.5),
        _cell(run, 0.3, True, [0, 1, 7], 0.3, 2.0),  # fixed 7, broke 3-6: short answers, em up
        _cell(run, 0.5, False, [0, 1, 2, 3, 4], 0.0, 9.5),
        _cell(run, 0.5, True, [0, 1, 2, 3], 0.0, 9.0),  # broke 4, the form unchanged
        _cell(run, 0.7, False, [0, 1], 0.0, 9.5),
        _cell(run, 0.7, True, [0, 1], 0.0, 9.0),  # the same questions right
    ]
    run.layout.zero_rag.grid.write_json({"rows": rows})
    effect = adapter_effect(run)
    assert [(r["ratio"], r["acc_without"], r["acc_with"], r["delta_acc"], r["fixed"], r["broken"]) for r in effect] == [
        (0.0, 0.7, 0.8, 0.1, 1, 0), (0.3, 0.7, 0.3, -0.4, 1, 5), (0.5, 0.5, 0.4, -0.1, 0, 1), (0.7, 0.2, 0.2, 0.0, 0, 0)]
    assert effect[1]["sign_p"] == 0.2188 and effect[1]["words_with"] == 2.0

    run.layout.zero_rag.adapter_tune.write_json({"losses": [2.0, 1.5], "steps": 2, "examples_seen": 8,
                                                 "epochs_seen": 0.5, "config": {"targets": "gold"}})
    _, md, _ = _report(tmp_path / "run")
    assert "| 0.3 | naive | no | no | 10 | 0.7 | 0.3 | -0.4 | 0 | 0.3 | 9.5 | 2 | 1 | 5 | 0.2188 |" in md
    reasons = md.split("**where the adapter does not gain: the measured reason**")[1]
    assert "| 0.0 |" not in reasons.split("\n\n")[0] and "| 0 | naive |" not in reasons
    assert "tuned to the gold's short form (em 0.000 -> 0.300, 9.5 -> 2 words per answer)" in reasons
    assert "fixed 1, broke 5 of 10 (sign test p=0.22, within chance)" in reasons
    assert ("answer form unchanged (em 0.000 -> 0.000, 9.5 -> 9 words per answer): the tuning (8 examples seen, "
            "0.5 epochs) changed which answers are right, not how the model answers; fixed 0, broke 1 of 10") in reasons
    assert ("| 0.7 | naive | no | no | 0 | no answer turned right or wrong: the tuning (8 examples seen, 0.5 epochs) "
            "changed nothing this setting scores |") in reasons
    assert "| targets | gold |" in md


def test_predicted_mastery_is_sampled_by_row_group_when_large(tmp_path):
    loc = RunFolder(str(tmp_path)).layout.zero_rag.predictions
    for part in range(4):
        _parquet(loc.join(f"part-{part}.parquet"),
                 {"sid": np.arange(1000) + 1000 * part, "mastery_pred": np.full(1000, part, np.float32)},
                 pa.schema([("sid", pa.int64()), ("mastery_pred", pa.float32())]))
    values, total = sample_column(loc, "mastery_pred", limit=1500)
    assert total == 4000 and len(values) == 1500 and set(np.unique(values)) == {0.0, 3.0}  # every 3rd group, cut
    values, total = sample_column(loc, "mastery_pred", limit=10_000)
    assert total == 4000 and len(values) == 4000


def test_inspect_shows_pruned_sentences_with_their_qa_pairs(zr_run):
    out = inspect_run(RunFolder(str(zr_run)), n=3)
    pruned = out.split("== Zero-RAG prune-0.5:")[1].split("\n==")[0]
    lines = pruned.splitlines()
    assert "20 of 40 sentences dropped" in lines[0]
    assert lines[1].startswith("  sentence 5  predicted 0.990  measured")  # highest predicted mastery first
    assert "Sentence 5 states fact number 5." in lines[2]
    assert "[ok] Q: What is fact 0 of sentence 5?" in pruned and "model: " in pruned and "em=" in pruned
    assert "sentence 30  predicted 0.970" in pruned and "Sentence 30 states fact number 30." in pruned
    statuses = out.split("== Zero-RAG mastery QA pairs:")[1]
    assert "-- unparseable" in statuses and "generator wrote: garbled output" in statuses
    assert "-- answer_not_in_sentence" in statuses and "[answer_not_in_sentence] Q:" in statuses
    assert "-- ok" in statuses
