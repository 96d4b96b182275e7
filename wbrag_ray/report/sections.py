"""The report's sections in reading order: what each reads from the run folder and shows; a section appears
only when the run has its stage."""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq

import wbrag_ray.report.plots as plots
from wbrag_ray.build_kb import INGEST
from wbrag_ray.evaluation.evaluate import load_results
from wbrag_ray.evaluation.methods_grid import same_writeback_rows
from wbrag_ray.index.files import MANIFEST
from wbrag_ray.layout import WritebackVersion
from wbrag_ray.metrics import METRICS
from wbrag_ray.plan.against_run import load_plan, planned_vs_measured, run_wall_seconds
from wbrag_ray.ray_runtime import LIGHT_CPUS, run_tasks
from wbrag_ray.report.adapter_effect import adapter_tables
from wbrag_ray.report.paper_rows import departures_tables, paper_section
from wbrag_ray.report.render import Section, Table, figures
from wbrag_ray.run import RunFolder
from wbrag_ray.storage import Location, resolve
from wbrag_ray.zerorag.qa import NOT_IN_SENTENCE, OK, UNPARSEABLE

# The Table 3 figures of WriteBack-RAG in the paper's order, then (not the paper's) the distilled texts that were no
# retrievable statement (writeback.distill.statement_check), by stats key, with the labels people read
TABLE3 = {key: key.replace("_", " ") for key in ("selection_rate", "mean_retained_docs", "source_tokens",
                                                 "distilled_tokens", "compression_ratio", "fallback_rate")} | {
    "rewrite_drop_rate": "rewrites dropped (bare answer or unsupported; the extraction kept)",
    "unit_drop_rate": "units dropped (bare answer or unsupported)", "units_written": "units written"}
QA_STATUSES = (OK, UNPARSEABLE, NOT_IN_SENTENCE)  # the order the report and `wbrag inspect` show them in


def collect(run: RunFolder, out: Path) -> list[Section]:
    """Every section the run has; the figures are written to the local folder `out`."""
    stats = {name: run.stats(name) or {} for name in run.completed_stages()}
    sections = [stages_section(stats, out), plan_section(run, stats),
                corpus_section(run, stats[INGEST.name], out) if INGEST.name in stats else None,
                *evaluation_sections(run, out), paper_section(run),
                *(writeback_section(v, out) for v in run.layout.writeback_versions()),
                *zero_rag_sections(run, out), config_section(run)]
    return [s for s in sections if s is not None]


def stages_section(stats: dict[str, dict[str, Any]], out: Path) -> Section:
    sec = Section("Stages")
    rows = [[name, s.get("rows_in"), s.get("rows_out"), s.get("rows_rejected"), s.get("seconds"), s.get("rows_per_s")]
            for name, s in stats.items()]
    sec.tables.append(Table("per-stage summary", ["stage", "rows in", "rows out", "rejected", "seconds", "rows/s"], rows))
    sec.image(plots.plot_stage_times(stats, out), "Wall time per stage: the slowest stage is the one to scale out.")
    return sec


def plan_section(run: RunFolder, stats: dict[str, dict[str, Any]]) -> Section | None:
    """Each stage's planned time (and rate source) beside its measured time; None without a stored plan."""
    plan = load_plan(run)
    if plan is None:
        return None
    rows = planned_vs_measured(plan, stats, run_wall_seconds(run, plan))
    sec = Section("Planned against measured")
    sec.tables.append(Table(f"the plan made {plan.get('made')} ({plan.get('gpus_total', 0):g} GPUs; measured / "
                            "planned: over 1, the run took longer)",
                            ["stage", "planned s", "rate source", "measured s", "measured / planned", "run stages"],
                            [[r["stage"], r["planned_s"], r["rate_source"], r["measured_s"], r["ratio"],
                              ", ".join(r["run_stages"])] for r in rows]))
    return sec


def corpus_section(run: RunFolder, stats: dict[str, Any], out: Path) -> Section:
    sec = Section("Corpus")
    sec.tables.append(figures("ingest", {k: stats[k] for k in (
        "rows_in", "rows_out", "rows_rejected", "sentences", "shards", "sentences_per_task_second") if k in stats}))
    sentences = run.layout.ingest.sentences
    if sentences.exists():
        sec.image(plots.plot_sentences_per_passage(sentences_per_passage(sentences), out),
                  "How many sentences (Zero-RAG's pruning unit) each passage holds.")

    manifest = run.layout.index.join(MANIFEST)
    search = (manifest.read_json().get("search") if manifest.exists() else None) or {}
    if search.get("measured"):  # the search setting the index build measured (wbrag_ray.index.recall)
        sec.tables.append(Table(
            f"index search, measured at build time on {search['queries']} of its vectors (target recall@"
            f"{search['k']} {search['target_recall']:g}; chosen: {search['parameter']} {search['value']})",
            [search["parameter"] or "setting", f"recall@{search['k']}", "ms/query"],
            [[m["value"], m["recall"], m["ms_per_query"]] for m in search["measured"]]))
        sec.image(plots.plot_search_setting(search, out),
                  "Recall of exact search's top 10 against time per query at each setting tried.")
    return sec


def sentences_per_passage(sentences: Location) -> np.ndarray:
    """histogram[k] = passages with k sentences, one ingest file per task (only histograms travel)."""
    files = [f.uri for f in sentences.list_files(".parquet")]
    parts = run_tasks(_file_histogram, None, files, num_cpus=LIGHT_CPUS)
    total = np.zeros(max((len(h) for h in parts), default=1), np.int64)
    for h in parts:
        total[: len(h)] += h
    return total


def _file_histogram(_shared: None, uri: str) -> np.ndarray:
    pids = resolve(uri).read_table(["pid"])["pid"]
    return np.bincount(pc.value_counts(pids).field("counts").to_numpy()) if len(pids) else np.zeros(1, np.int64)


def evaluation_sections(run: RunFolder, out: Path) -> list[Section]:
    """The metrics of every evaluated setting, then each methods x write-back grid."""
    sections = []
    results = load_results(run)
    if results:
        sec = Section("Evaluation")
        sec.tables.append(Table("answer metrics", ["setting", "n", "em", "f1", "acc", "answer words", "scored"],
                                [[k, v.get("n"), v.get("em"), v.get("f1"), v.get("acc"), v.get("answer_words"),
                                  v.get("answer_form")] for k, v in results.items()]))
        sec.image(plots.plot_eval(results, out), "em / f1 / acc (FlashRAG's definitions) per evaluated setting.")
        sections.append(sec)
    plain = run.layout.methods_grid()
    sections += [methods_grid_section(f.read_json(), out, PurePosixPath(f.name).stem, f.name != plain.name)
                 for f in run.layout.methods_grids()]
    return sections


def methods_grid_section(grid: dict[str, Any], out: Path, stem: str, own_setting: bool = False) -> Section:
    """`wbrag eval --methods-grid`: does a version written back under one method serve the others?"""
    sec = Section("RAG methods x knowledge base" + (f" ({grid.get('name')})" if own_setting else ""))
    sec.text = ("Every RAG method on the base index and beside each write-back version. 'trained with' is the method "
                "whose answers chose what was written back; a row is same-method when it is the evaluated method. "
                "'union' is how base and write-back hits shared the K slots (retrieval.union); 'unit in top K' counts "
                "the questions a write-back unit entered the top K of, of which 'won' were answered right only with "
                "the version and 'lost' only without it.")
    rows = []
    for r in grid.get("rows", []):
        delta = (r.get("delta") or {}).get("acc")
        rows.append([r["method"], r["version"] or "base", r.get("trained_with") or "",
                     "" if r.get("same_method") is None else ("same" if r["same_method"] else "cross"),
                     r.get("union") or "", r["n"], r["em"], r["f1"], r["acc"], "" if delta is None else f"{delta:+.3f}",
                     *(r.get(k, "") for k in ("unit_in_top_k", "won", "lost")),
                     r.get("retrieval_rate"), r.get("generator_calls")])
    sec.tables.append(Table(f"answer metrics on {grid.get('name')}", [
        "method", "knowledge base", "trained with", "write-back", "union", "n", "em", "f1", "acc", "acc vs base",
        "unit in top K", "won", "lost", "retrieval rate", "generator calls"], rows))
    if same := same_writeback_rows(grid):  # `--same-writeback`: WriteBack-RAG's Figure 4 shape
        sec.tables.append(Table("Same-WB: each method on the base and beside the version written back under it", [
            "method", "version", *(h for k in METRICS for h in (k, f"{k} Same-WB"))],
            [[r["method"], r["version"], *(v for k in METRICS for v in (r["base"][k], r["same_wb"][k]))] for r in same]))
    sec.image(plots.plot_methods_grid(grid, out, file_name=f"{stem}.png"),
              "acc per RAG method: base index alone, and with each write-back version beside it.")
    return sec


def writeback_section(folder: WritebackVersion, out: Path) -> Section:
    """One write-back version: the paper's Table 3, the distillation's compression, the retained ranks."""
    version, stats = folder.version, folder.stats.read_json()
    sec = Section(f"Write-back {version}")
    method = stats.get("rag_method", "naive")
    sec.tables.append(figures("selection (the paper's Table 3)", {
        "scored with RAG method": method, **{label: stats.get(key) for key, label in TABLE3.items()}}))
    units = folder.units.read_table(["source_tokens", "distilled_tokens"]) if folder.units.exists() else None
    sec.image(plots.plot_token_scatter(units, out, version),
              "Each knowledge unit: tokens of its retained documents vs tokens after distillation.")
    sec.image(plots.plot_rank_distribution(stats.get("rank_distribution") or {}, out, version),
              "Retrieval ranks of the documents that passed the document gate.")
    for kind in ("rewrites", "units"):  # the statement check's drops, by reason
        if any((counts := stats.get(f"{kind}_dropped") or {}).values()):
            sec.tables.append(Table(f"{kind} dropped by the statement check", ["reason", "count"],
                                    [[why, n] for why, n in counts.items()]))
    if folder.validation.exists():  # writeback.validation: base vs base + version on held-out training questions
        v = folder.validation.read_json()
        m = v["metric"]
        rows = [[name + (" (chosen)" if name == v.get("chosen") else "") + (" (searched)" if name == v.get("applied")
                                                                            else ""), v["base"], f[m],
                 f["unit_in_top_k"], f.get("units_reached"), f.get("answers_changed"), f["won"], f["lost"]]
                for name, f in v.get("candidates", {v["union"]: {**v, m: v["with_version"]}}).items()]
        sec.tables.append(Table(f"validation on {v['questions']} held-out training questions ({v['method']}), per "
                                "union rule", ["union", f"{m} base", f"{m} base + version", "questions with a unit",
                                               "units that reached a top K", "answers changed", "won", "lost"], rows))
        if v.get("choice"):
            sec.text = f"retrieval.union auto searches this version with {v['chosen']}: {v['choice']}."
    elif isinstance(stats.get("validation"), str):  # nothing held out, and why (writeback.validation)
        sec.tables.append(figures("validation", {"validation": stats["validation"]}))
    if (outcome := no_effect(stats)) is not None:
        sec.text = " ".join(filter(None, [sec.text, outcome]))
    return sec


def no_effect(stats: dict) -> str | None:
    """What the report says of a version with no measured effect: units, top-K entries, changes, won, lost."""
    v = stats.get("validation")
    state = "active" if stats.get("activated") else "not active"
    if not isinstance(v, dict):
        return (f"This version ({state}, {stats.get('units_written', 0)} units written) was not validated"
                f"{f' ({v})' if v else ''}: its effect is not measured.")
    if v.get("units_reached", v.get("unit_in_top_k")) and v.get("answers_changed", v.get("changed")):
        return None
    return (f"This version ({state}) had no measured effect on its {v['questions']} validation questions: "
            f"{stats.get('units_written', 0)} units written, {v.get('units_reached', v.get('unit_in_top_k'))} reached "
            f"a top K, {v.get('answers_changed', v.get('changed'))} answers changed, won {v['won']}, lost {v['lost']}.")


def config_section(run: RunFolder) -> Section:
    """The run's config, and first the choices in it that differ from the papers (for the methods the run used)."""
    run_json = run.layout.run_json.read_json() if run.layout.run_json.exists() else {}
    sec = Section("Configuration")
    if run_json:
        sec.tables += departures_tables(run)  # as the evaluations' metrics.json recorded them
    sec.text = json.dumps(run_json.get("config", {}), indent=2)
    return sec


# --- Zero-RAG --------------------------------------------------------------------------------------------


def zero_rag_sections(run: RunFolder, out: Path) -> list[Section]:
    """Zero-RAG's sections, each from the files its stage wrote; none when the run has no Zero-RAG folder."""
    if not run.layout.zero_rag.root.exists():
        return []
    sections = [mastery_section(run, out), pruners_section(run, out), pruned_indices_section(run, out),
                ratio_sweep_section(run, out), router_and_tuning_section(run, out)]
    return [s for s in sections if s.tables or s.images]


def mastery_section(run: RunFolder, out: Path) -> Section:
    zr = run.layout.zero_rag
    sec = Section("Zero-RAG: mastery scores")
    if zr.mastery_stats.exists():
        sec.tables.append(figures("mastery sample", zr.mastery_stats.read_json()))
    if zr.qa.exists():
        qa = zr.qa.read_table(["status", "em"])
        statuses = list(QA_STATUSES) + sorted(set(qa["status"].to_pylist()) - set(QA_STATUSES))
        rows = []
        for status in statuses:
            part = qa.filter(pc.equal(qa["status"], status))
            rows.append([status, part.num_rows, part.num_rows / max(1, qa.num_rows), pc.mean(part["em"]).as_py()])
        sec.tables.append(Table("QA pairs by status", ["status", "pairs", "share", "mean EM"], rows))
    if zr.scores.exists():
        sec.image(plots.plot_mastery_histogram(zr.scores.read_table(["n_valid", "mastery"]), out),
                  "Measured mastery of the sampled sentences: the target model's mean closed-book exact match on the "
                  "QA pairs written from each sentence (sentences without a valid pair are left out).")
    return sec


def pruners_section(run: RunFolder, out: Path) -> Section:
    zr = run.layout.zero_rag
    sec = Section("Zero-RAG: pruners")
    metrics, validation = {}, {}
    for kind in zr.pruner_kinds():
        if zr.pruner_metrics(kind).exists():
            metrics[kind] = zr.pruner_metrics(kind).read_json()
        if zr.pruner_validation(kind).exists():
            validation[kind] = zr.pruner_validation(kind).read_table(["measured", "predicted"])
    if metrics:
        rows = [[k, *(v.get(f) for f in ("n_train", "n_val", "mse", "spearman")),
                 *((v.get("top_quantile") or {}).get(f) for f in ("q", "precision", "recall")), v.get("seconds")]
                for k, v in metrics.items()]
        sec.tables.append(Table("pruner validation (top quantile: the most-mastered fraction q, measured vs predicted)",
                                ["pruner", "n train", "n val", "mse", "spearman", "top q", "precision", "recall", "seconds"], rows))
    sec.image(plots.plot_pruner_fit(validation, metrics, out), "Held-out sentences: predicted vs measured mastery per "
              "pruner; points on the dashed line are predicted exactly, and the ranking (Spearman) is what pruning uses.")
    return sec


def _mb(v: Any) -> float | None:
    return round(v / 1e6, 3) if isinstance(v, (int, float)) else None


def pruned_indices_section(run: RunFolder, out: Path) -> Section:
    zr = run.layout.zero_rag
    levels = sorted((lv.stats.read_json() for lv in zr.pruned_levels()), key=lambda s: s.get("ratio", 0.0))
    sec = Section("Zero-RAG: pruned indices")
    if levels:
        rows = [[lv.get("ratio"), lv.get("achieved_ratio"), lv.get("threshold"), lv.get("sentences_in"), lv.get("kept"), lv.get("dropped"),
                 _mb(lv.get("index_bytes")), _mb(lv.get("source_index_bytes")), lv.get("pruner")] for lv in levels]
        sec.tables.append(Table("pruning levels", ["ratio", "achieved", "threshold", "sentences in", "kept", "dropped",
                                                   "index MB", "source index MB", "pruner"], rows))
    if zr.predictions.list_files(".parquet"):
        pred, total = sample_column(zr.predictions, "mastery_pred")
        sec.image(plots.plot_predicted_mastery(pred, total, levels, out), "The pruner's predicted mastery for every "
                  "corpus sentence; each dashed line is the corpus-wide percentile of one pruning ratio.")
    return sec


def sample_column(loc: Location, column: str, limit: int = 1_000_000, seed: int = 0) -> tuple[np.ndarray, int]:
    """One numeric column of a possibly corpus-sized Parquet folder and its row count: all when small, else evenly
    spaced row groups cut to `limit` rows by a seeded choice."""
    groups = []
    for f in loc.list_files(".parquet"):
        meta = pq.ParquetFile(f.path, filesystem=f.fs).metadata
        groups += [(f, g, meta.row_group(g).num_rows) for g in range(meta.num_row_groups)]
    total = sum(n for _, _, n in groups)
    step = max(1, -(-total // limit))  # ceil: about `limit` rows when the groups are of even size
    parts = [plots.as_float(pq.ParquetFile(f.path, filesystem=f.fs).read_row_group(g, columns=[column])[column])
             for f, g, _ in groups[::step]]
    values = np.concatenate(parts) if parts else np.zeros(0)
    if len(values) > limit:
        values = np.random.default_rng(seed).choice(values, limit, replace=False)
    return values, total


def ratio_sweep_section(run: RunFolder, out: Path) -> Section:
    sec = Section("Zero-RAG: pruning ratio sweep")
    if not run.layout.zero_rag.grid.exists():
        return sec
    grid = sorted(run.layout.zero_rag.grid.read_json().get("rows", []), key=lambda r: (plots.setting_label(r), r.get("ratio", 0.0)))
    yes = {True: "yes", False: "no"}
    sec.tables.append(Table("answers, latency and size per pruning ratio", [
        "ratio", "method", "write-back", "router", "adapter", "n", "em", "f1", "acc", "ms/query", "retrieval speedup %",
        "s/question", "index MB", "sentences", "retrieval skipped"],
        [[r.get("ratio"), r.get("method"), *(yes.get(r.get(k), r.get(k)) for k in ("writeback", "router", "adapter")), r.get("n"),
          r.get("em"), r.get("f1"), r.get("acc"), r.get("latency_ms_per_query"), r.get("retrieval_speedup_pct"),
          r.get("seconds_per_question"), _mb(r.get("index_bytes")), r.get("sentences"),
          r.get("retrieval_skipped")] for r in grid]))
    sec.image(plots.plot_ratio_sweep(grid, out), "Per pruning ratio (0 = the full index) and setting: answer accuracy, "
              "retrieval latency per query, and index size. Zero-RAG's claim: size and latency fall, accuracy holds.")
    return sec


def router_and_tuning_section(run: RunFolder, out: Path) -> Section:
    zr = run.layout.zero_rag
    sec = Section("Zero-RAG: query router and noise-tolerant tuning")
    if zr.router_metrics.exists():
        sec.tables.append(figures("query router", zr.router_metrics.read_json()))
    if zr.adapter_tune.exists():
        tune = zr.adapter_tune.read_json()
        losses = [float(x) for x in tune.get("losses") or []]
        rows = {"steps": tune.get("steps"), "seconds": tune.get("seconds"),
                "examples seen (epochs)": f"{tune.get('examples_seen')} ({tune.get('epochs_seen')})",
                "targets": (tune.get("config") or {}).get("targets", "gold")}
        rows |= {f"examples: {k}": v for k, v in (tune.get("formats") or {}).items()}
        rows |= {"first loss": losses[0], "last loss": losses[-1]} if losses else {}
        terms = tune.get("term_losses") or {}
        rows |= {f"{plots.TERM_LABELS.get(t, t)} loss: first -> last": f"{v.get('first')} -> {v.get('last')}"
                 for t, v in terms.items()}
        sec.tables.append(figures("noise-tolerant tuning", rows))
        sec.tables += adapter_tables(run, tune)  # with and without it, per ratio of the grid
        sec.image(plots.plot_tuning_loss(losses, out, {t: v.get("per_step") or [] for t, v in terms.items()}),
                  "Training loss of the generator's LoRA adapter: the weighted objective and its three terms "
                  "(questions with relevant, distracting and no documents).")
    return sec
