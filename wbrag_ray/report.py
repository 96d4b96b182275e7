"""Run reports: one HTML file plus PNGs (matplotlib), and a Markdown twin with the same tables.

A report is built from what the run folder holds: the resolved config, every stage's stats, evaluation
metrics, and the outputs that have distributions worth seeing (sentences per passage, write-back selection,
source vs distilled tokens, ranks of retained documents; Zero-RAG's mastery scores, pruner fit, predicted
mastery with the prune thresholds, and the pruning-ratio sweep). Sections appear only for stages the run has,
and a plot only when its input exists.

Over 500 lines, not split yet: every section's table and plot; issue 14 plans report sections beside
the run-folder layout they read.
"""

from __future__ import annotations

import html
import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from wbrag_ray.run import RunFolder

# The Table 3 figures of WriteBack-RAG, in the paper's order, with the labels people read.
TABLE3 = [
    ("selection_rate", "selection rate"),
    ("mean_retained_docs", "mean retained docs"),
    ("source_tokens", "source tokens"),
    ("distilled_tokens", "distilled tokens"),
    ("compression_ratio", "compression ratio"),
    ("fallback_rate", "fallback rate"),
]


@dataclass
class Table:
    title: str
    header: list[str]
    rows: list[list[Any]]


@dataclass
class Section:
    title: str
    tables: list[Table] = field(default_factory=list)
    images: list[tuple[str, str]] = field(default_factory=list)  # (file name, caption)
    text: str = ""


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (dict, list)):
        return json.dumps(v)[:80]
    return "" if v is None else str(v)


# --- plots ----------------------------------------------------------------------------------------------


def _figure(ncols: int = 1):
    """A figure with one axis, or a row of `ncols` panels (then the axes come as an array)."""
    import matplotlib

    matplotlib.use("Agg")  # no display on cluster nodes or CI
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, ncols, figsize=(6.4, 3.6) if ncols == 1 else (min(4.3, 11 / ncols) * ncols, 3.8), dpi=110, squeeze=False)
    for a in ax.flat:
        a.grid(alpha=0.3)
    return plt, fig, ax[0, 0] if ncols == 1 else ax[0]


def _save(plt, fig, out: Path, name: str, rect: tuple[float, float, float, float] | None = None) -> str:
    fig.tight_layout(rect=rect)  # rect: room kept free for a figure-level legend
    fig.savefig(out / name)
    plt.close(fig)
    return name


def plot_stage_times(stats: dict[str, dict[str, Any]], out: Path) -> str | None:
    timed = {k: v["seconds"] for k, v in stats.items() if isinstance(v.get("seconds"), (int, float))}
    if not timed:
        return None
    plt, fig, ax = _figure()
    names = list(timed)
    ax.barh(names, [timed[n] for n in names], color="#4C72B0")
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title("wall time per stage")
    return _save(plt, fig, out, "stage_times.png")


def plot_eval(results: dict[str, dict[str, Any]], out: Path) -> str | None:
    if not results:
        return None
    plt, fig, ax = _figure()
    names = list(results)
    x = np.arange(len(names))
    for i, m in enumerate(("em", "f1", "acc")):
        ax.bar(x + (i - 1) * 0.27, [results[n].get(m, 0) for n in names], width=0.27, label=m)
    ax.set_xticks(x, names, rotation=20, ha="right", fontsize=8)
    ax.set_ylim(0, 1)
    ax.set_ylabel("score")
    ax.set_title("answer metrics per setting")
    ax.legend()
    return _save(plt, fig, out, "eval_metrics.png")


def plot_methods_grid(grid: dict[str, Any], out: Path, metric: str = "acc", file_name: str = "methods_grid.png") -> str | None:
    """Per RAG method, one bar for the base and one beside each write-back version; the version trained under
    the method's own scoring is hatched (same-method), the others are cross-method."""
    rows = grid.get("rows") or []
    if not rows:
        return None
    methods = [m for m in grid["methods"] if any(r["method"] == m for r in rows)]
    settings = [None, *grid.get("versions", {})]
    cells = {(r["method"], r["version"]): r for r in rows}
    plt, fig, ax = _figure()
    width = 0.8 / len(settings)
    x = np.arange(len(methods))
    for k, version in enumerate(settings):
        label = "base" if version is None else f"+ write-back {version} [{grid['versions'][version]}]"
        values = [cells[(m, version)][metric] if (m, version) in cells else np.nan for m in methods]
        bars = ax.bar(x + (k - (len(settings) - 1) / 2) * width, values, width=width, label=label)
        for m, bar in zip(methods, bars, strict=True):
            if version is not None and (m, version) in cells and cells[(m, version)]["same_method"]:
                bar.set_hatch("//")
    ax.set_xticks(x, methods, fontsize=8)
    ax.set_ylim(0, 1)
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} per RAG method and knowledge base (hatched: same-method write-back)", fontsize=9)
    # below the axes: bars reach the top, where a legend inside would cover them
    ncol = min(3, len(settings))
    fig.legend(*ax.get_legend_handles_labels(), loc="lower center", ncol=ncol, fontsize=8, frameon=False)
    return _save(plt, fig, out, file_name, rect=(0, 0.07 * -(-len(settings) // ncol) + 0.02, 1, 1))


def plot_sentences_per_passage(run: RunFolder, out: Path) -> str | None:
    loc = run.path("ingest", "sentences")
    if not loc.exists():
        return None
    pids = loc.read_table(["pid"])["pid"]
    counts = pc.value_counts(pids).field("counts").to_numpy()
    if len(counts) == 0:
        return None
    plt, fig, ax = _figure()
    from matplotlib.ticker import MaxNLocator

    ax.hist(counts, bins=range(1, int(counts.max()) + 2), color="#55A868", align="left", rwidth=0.85)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # sentence counts are whole numbers
    ax.set_xlabel("sentences in a passage")
    ax.set_ylabel("passages")
    ax.set_title(f"segmentation: {int(counts.sum()):,} sentences in {len(counts):,} passages")
    return _save(plt, fig, out, "sentences_per_passage.png")


def plot_token_scatter(units, out: Path, version: str) -> str | None:
    if units is None or units.num_rows == 0:
        return None
    src = units["source_tokens"].to_numpy()
    dst = units["distilled_tokens"].to_numpy()
    plt, fig, ax = _figure()
    ax.scatter(src, dst, s=14, alpha=0.7, color="#C44E52")
    top = max(src.max(), dst.max()) * 1.05
    ax.plot([0, top], [0, top], "k--", lw=1, label="identity (no compression)")
    ax.set_xlabel("source tokens (retained documents)")
    ax.set_ylabel("distilled tokens (knowledge unit)")
    ax.set_title(f"write-back {version}: distillation compresses evidence")
    ax.legend()
    return _save(plt, fig, out, f"writeback_{version}_tokens.png")


def plot_rank_distribution(ranks: dict[str, int], out: Path, version: str) -> str | None:
    if not ranks:
        return None
    plt, fig, ax = _figure()
    keys = sorted(ranks, key=lambda r: int(r))
    ax.bar([str(int(k) + 1) if str(k).isdigit() else k for k in keys], [ranks[k] for k in keys], color="#8172B2")
    ax.set_xlabel("retrieval rank of a retained document (1 = top)")
    ax.set_ylabel("retained documents")
    ax.set_title(f"write-back {version}: which ranks the document gate keeps")
    return _save(plt, fig, out, f"writeback_{version}_ranks.png")


# --- Zero-RAG plots --------------------------------------------------------------------------------------


def _np(col) -> np.ndarray:
    """A numeric column as float64, nulls as NaN."""
    return np.asarray(col.to_numpy(zero_copy_only=False), dtype=np.float64)


def _mean_em_values(n_valid: np.ndarray) -> np.ndarray:
    """Every value a mean of n 0/1 exact matches can take, for each n the sample has."""
    return np.unique(np.concatenate([np.arange(n + 1) / n for n in np.unique(n_valid) if n > 0] or [np.zeros(1)]))


def plot_mastery_histogram(scores: pa.Table, out: Path) -> str | None:
    scored = scores.filter(pc.is_valid(scores["mastery"]))
    if scored.num_rows == 0:
        return None
    m, n_valid = _np(scored["mastery"]), scored["n_valid"].to_numpy().astype(int)
    values = _mean_em_values(n_valid)
    nearest = np.abs(m[:, None] - values[None, :]).argmin(axis=1)
    plt, fig, ax = _figure()
    from matplotlib.ticker import MaxNLocator

    if np.abs(m - values[nearest]).max() < 1e-6:
        # Scores are means of 0/1 EM over few pairs: a bar per value they can take, not arbitrary bins that
        # would split or merge those values.
        from fractions import Fraction

        gap = np.diff(values).min() if len(values) > 1 else 1.0
        ax.bar(values, np.bincount(nearest, minlength=len(values)), width=min(0.8 * gap, 0.06), color="#4C72B0")
        if len(values) <= 13:
            ax.set_xticks(values, [str(Fraction(v).limit_denominator(int(n_valid.max()))) for v in values])
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # counts of sentences
    else:  # a non-binary metric: plain bins
        ax.hist(m, bins=20, range=(0, 1), color="#4C72B0", rwidth=0.9)
    ax.set_xlabel("mastery score (mean closed-book EM over a sentence's valid QA pairs)")
    ax.set_ylabel("sentences")
    ax.set_title(f"measured mastery: {len(m):,} scored sentences, mean {m.mean():.2f}")
    return _save(plt, fig, out, "zero_rag_mastery.png")


def plot_pruner_fit(validation: dict[str, pa.Table], metrics: dict[str, dict[str, Any]], out: Path) -> str | None:
    validation = {k: t for k, t in validation.items() if t.num_rows}
    if not validation:
        return None
    plt, fig, axes = _figure(ncols=max(2, len(validation)))  # two panels at least: one alone would be too wide
    for ax, (kind, t) in zip(axes, validation.items(), strict=False):  # spare panels hidden below
        x, y = _np(t["measured"]), _np(t["predicted"])
        ax.scatter(x, y, s=12, alpha=0.45, color="#4C72B0", label="held-out sentence")
        levels = np.unique(x[~np.isnan(x)])
        if len(levels) <= 25:  # measured scores are few discrete values: their mean prediction shows calibration
            ax.plot(levels, [np.nanmean(y[x == v]) for v in levels], "D-", color="#DD8452", ms=5, label="mean prediction")
        lo, hi = min(0.0, np.nanmin(y)), max(1.0, np.nanmax(y))
        ax.plot([lo, hi], [lo, hi], "k--", lw=1, label="identity")
        rho = metrics.get(kind, {}).get("spearman")
        ax.set_title(f"{kind} pruner: n={t.num_rows}" + (f", Spearman {rho:.2f}" if rho is not None else ""), fontsize=10)
        ax.set_xlabel("measured mastery")
        ax.set_ylabel("predicted mastery")
        ax.legend(fontsize=7, loc="upper left")
    for ax in axes[len(validation):]:
        ax.set_visible(False)
    return _save(plt, fig, out, "zero_rag_pruners.png")


def _sample_column(loc, column: str, limit: int = 1_000_000, seed: int = 0) -> tuple[np.ndarray, int]:
    """One numeric column of a Parquet folder that may hold a whole corpus, and its total row count: all of it
    when small; otherwise evenly spaced row groups (footers tell their sizes, so the rest is never read), cut
    to `limit` rows by a seeded random choice."""
    groups = []
    for f in loc.list_files(".parquet"):
        meta = pq.ParquetFile(f.path, filesystem=f.fs).metadata
        groups += [(f, g, meta.row_group(g).num_rows) for g in range(meta.num_row_groups)]
    total = sum(n for _, _, n in groups)
    step = max(1, -(-total // limit))  # ceil: about `limit` rows when the groups are of even size
    parts = []
    for f, g, _ in groups[::step]:
        parts.append(_np(pq.ParquetFile(f.path, filesystem=f.fs).read_row_group(g, columns=[column])[column]))
    values = np.concatenate(parts) if parts else np.zeros(0)
    if len(values) > limit:
        values = np.random.default_rng(seed).choice(values, limit, replace=False)
    return values, total


def plot_predicted_mastery(pred: np.ndarray, total: int, levels: list[dict[str, Any]], out: Path) -> str | None:
    pred = pred[~np.isnan(pred)]
    if len(pred) == 0:
        return None
    plt, fig, ax = _figure()
    ax.hist(pred, bins=int(np.clip(np.sqrt(len(pred)), 10, 60)), color="#55A868", edgecolor="white", lw=0.4)  # few sentences, few bins
    colors = ["#C44E52", "#8172B2", "#DD8452", "#937860", "#DA8BC3", "#8C8C8C"]
    for i, lv in enumerate(lv for lv in levels if isinstance(lv.get("threshold"), (int, float)) and np.isfinite(lv["threshold"])):
        ax.axvline(lv["threshold"], color=colors[i % len(colors)], ls="--", lw=1.4,
                   label=f"prune {lv['ratio']:g}: threshold {lv['threshold']:.3g}")
    sampled = f", sample of {len(pred):,}" if len(pred) < total else ""
    ax.set_title(f"predicted mastery over the corpus ({total:,} sentences{sampled})", fontsize=10)
    ax.set_xlabel("predicted mastery (sentences right of a threshold are dropped)")
    ax.set_ylabel("sentences")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    return _save(plt, fig, out, "zero_rag_predicted_mastery.png")


def _combo(row: dict[str, Any]) -> str:
    flags = [("writeback", "write-back"), ("router", "router"), ("adapter", "adapter")]
    return " + ".join([row.get("method", "?")] + [label for key, label in flags if row.get(key)])


def _num(v: Any, scale: float = 1.0) -> float:
    return float(v) * scale if isinstance(v, (int, float)) else float("nan")


def plot_ratio_sweep(rows: list[dict[str, Any]], out: Path) -> str | None:
    if not rows:
        return None
    combos: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        combos.setdefault(_combo(r), []).append(r)
    plt, fig, axes = _figure(ncols=3)
    panels = [("acc", 1.0, "acc", "answer quality"), ("latency_ms_per_query", 1.0, "ms per query", "retrieval latency"),
              ("index_bytes", 1e-6, "index MB", "index size")]
    for i, (label, rs) in enumerate(combos.items()):
        rs = sorted(rs, key=lambda r: r["ratio"])
        # Settings often coincide (the router and the adapter leave the index alone): earlier lines are drawn
        # wider underneath, so a line hidden by a later one still shows as its outline.
        wide = (len(combos) - 1 - i) / max(1, len(combos) - 1)
        for ax, (key, scale, _, _) in zip(axes, panels, strict=True):
            ax.plot([r["ratio"] for r in rs], [_num(r.get(key), scale) for r in rs], marker="osD^vP*X"[i % 8],
                    lw=1.5 + 3 * wide, ms=5 + 5 * wide, alpha=0.9, label=label)
    for ax, (_, _, ylabel, title) in zip(axes, panels, strict=True):
        ax.set_xlabel("pruning ratio")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        ax.set_ylim(bottom=0)  # pruning trades size for quality: distances from zero are what matter
    axes[0].set_ylim(0, 1)
    handles, labels = axes[0].get_legend_handles_labels()
    ncol = min(5, len(labels))  # five labels still fit one row under three panels
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=9, frameon=False)
    return _save(plt, fig, out, "zero_rag_ratio_sweep.png", rect=(0, 0.06 * -(-len(labels) // ncol) + 0.02, 1, 1))


def plot_tuning_loss(losses: list[float], out: Path) -> str | None:
    if not losses:
        return None
    plt, fig, ax = _figure()
    steps = np.arange(1, len(losses) + 1)
    ax.plot(steps, losses, color="#4C72B0", alpha=0.5 if len(losses) >= 20 else 1, marker="" if len(losses) >= 20 else "o",
            ms=3, label="loss per step")
    if len(losses) >= 20:  # per-step losses are noisy at small batches: a moving mean shows the trend
        w = max(2, len(losses) // 10)
        ax.plot(steps[w - 1:], np.convolve(losses, np.ones(w) / w, mode="valid"), color="#C44E52", label=f"mean of {w} steps")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.set_title("noise-tolerant tuning of the generator (LoRA)")
    ax.legend(fontsize=8)
    return _save(plt, fig, out, "zero_rag_tuning_loss.png")


# --- collecting ------------------------------------------------------------------------------------------


def collect(run: RunFolder, out: Path) -> list[Section]:
    from wbrag_ray.pipelines.evaluate import load_results

    sections: list[Section] = []
    run_json = run.path("run.json").read_json() if run.path("run.json").exists() else {}
    stats = {name: run.stats(name) or {} for name in run.completed_stages()}

    overview = Section("Stages")
    rows = [[name, s.get("rows_in"), s.get("rows_out"), s.get("rows_rejected"), s.get("seconds"), s.get("rows_per_s")]
            for name, s in stats.items()]
    overview.tables.append(Table("per-stage summary", ["stage", "rows in", "rows out", "rejected", "seconds", "rows/s"], rows))
    if img := plot_stage_times(stats, out):
        overview.images.append((img, "Wall time per stage: the slowest stage is the one to scale out."))
    sections.append(overview)

    if "ingest" in stats:
        ingest = Section("Corpus")
        s = stats["ingest"]
        ingest.tables.append(Table("ingest", ["figure", "value"], [[k, s[k]] for k in (
            "rows_in", "rows_out", "rows_rejected", "sentences", "shards", "sentences_per_task_second") if k in s]))
        if img := plot_sentences_per_passage(run, out):
            ingest.images.append((img, "How many sentences (Zero-RAG's pruning unit) each passage holds."))
        sections.append(ingest)

    results = load_results(run)
    if results:
        ev = Section("Evaluation")
        ev.tables.append(Table("answer metrics", ["setting", "n", "em", "f1", "acc"],
                               [[k, v.get("n"), v.get("em"), v.get("f1"), v.get("acc")] for k, v in results.items()]))
        if img := plot_eval(results, out):
            ev.images.append((img, "em / f1 / acc (FlashRAG's definitions) per evaluated setting."))
        sections.append(ev)
    for grid_name in _methods_grids(run):  # methods_grid.json, and one per Zero-RAG setting it was run with
        sections.append(methods_grid_section(run.path("eval", grid_name).read_json(), out, grid_name))

    wb_root = run.path("writeback")
    for version_stats in _writeback_versions(run):
        version = version_stats["version"]
        sec = Section(f"Write-back {version}")
        method = (version_stats.get("settings") or {}).get("rag_method", "naive")
        sec.tables.append(Table("selection (the paper's Table 3)", ["figure", "value"],
                                [["scored with RAG method", method]]
                                + [[label, version_stats.get(key)] for key, label in TABLE3]))
        units_loc = wb_root.join(version, "corpus")
        units = units_loc.read_table(["source_tokens", "distilled_tokens"]) if units_loc.exists() else None
        if img := plot_token_scatter(units, out, version):
            sec.images.append((img, "Each knowledge unit: tokens of its retained documents vs tokens after distillation."))
        if img := plot_rank_distribution(version_stats.get("rank_distribution") or {}, out, version):
            sec.images.append((img, "Retrieval ranks of the documents that passed the document gate."))
        sections.append(sec)

    sections += zero_rag_sections(run, out)

    config = Section("Configuration")
    config.text = json.dumps(run_json.get("config", {}), indent=2)
    sections.append(config)
    return sections


def _methods_grids(run: RunFolder) -> list[str]:
    base = run.path("eval")
    if not base.exists():
        return []
    import pyarrow.fs as pafs

    names = [i.base_name for i in base.fs.get_file_info(pafs.FileSelector(base.path))]
    return sorted(n for n in names if n.startswith("methods_grid") and n.endswith(".json"))


def methods_grid_section(grid: dict[str, Any], out: Path, file_name: str = "methods_grid.json") -> Section:
    """`wbrag eval --methods-grid`: does a knowledge base written back under one RAG method serve the others?"""
    stem = file_name.removesuffix(".json")
    sec = Section("RAG methods x knowledge base" + ("" if stem == "methods_grid" else f" ({grid.get('name')})"))
    sec.text = ("Every RAG method on the base index and beside each write-back version. 'trained with' is the method "
                "whose answers chose what was written back; a row is same-method when it is the evaluated method.")
    rows = []
    for r in grid.get("rows", []):
        delta = (r.get("delta") or {}).get("acc")
        rows.append([r["method"], r["version"] or "base", r.get("trained_with") or "",
                     "" if r.get("same_method") is None else ("same" if r["same_method"] else "cross"),
                     r["n"], r["em"], r["f1"], r["acc"], "" if delta is None else f"{delta:+.3f}",
                     r.get("retrieval_rate"), r.get("generator_calls")])
    sec.tables.append(Table(f"answer metrics on {grid.get('name')}", [
        "method", "knowledge base", "trained with", "write-back", "n", "em", "f1", "acc", "acc vs base",
        "retrieval rate", "generator calls"], rows))
    if img := plot_methods_grid(grid, out, file_name=f"{stem}.png"):
        sec.images.append((img, "acc per RAG method: base index alone, and with each write-back version beside it."))
    return sec


def _writeback_versions(run: RunFolder) -> list[dict[str, Any]]:
    root = run.path("writeback")
    return [{"version": v, **root.join(v, "stats.json").read_json()} for v in _subdirs(root) if root.join(v, "stats.json").exists()]


QA_STATUSES = ("ok", "unparseable", "answer_not_in_sentence")


def _subdirs(loc) -> list[str]:
    import pyarrow.fs as pafs

    if not loc.exists():
        return []
    infos = loc.fs.get_file_info(pafs.FileSelector(loc.path))
    return sorted(i.base_name for i in infos if i.type == pafs.FileType.Directory)


def _prune_levels(run: RunFolder) -> list[dict[str, Any]]:
    """Every RUN/zero_rag/prune-<ratio> that has its stats, smallest ratio first, with its folder name."""
    root = run.path("zero_rag")
    found = [{"folder": d, **root.join(d, "stats.json").read_json()}
             for d in _subdirs(root) if d.startswith("prune-") and root.join(d, "stats.json").exists()]
    return sorted(found, key=lambda s: s.get("ratio", 0.0))


def _mb(v: Any) -> float | None:
    return round(v / 1e6, 3) if isinstance(v, (int, float)) else None


def zero_rag_sections(run: RunFolder, out: Path) -> list[Section]:
    """Zero-RAG's sections, each from the files its stage wrote; none when the run has no RUN/zero_rag."""
    root = run.path("zero_rag")
    if not root.exists():
        return []
    sections = []

    mastery = Section("Zero-RAG: mastery scores")
    m = root.join("mastery")
    if m.join("stats.json").exists():
        mastery.tables.append(Table("mastery sample", ["figure", "value"], [[k, v] for k, v in m.join("stats.json").read_json().items()]))
    if m.join("qa.parquet").exists():
        qa = m.join("qa.parquet").read_table(["status", "em"])
        statuses = list(QA_STATUSES) + sorted(set(qa["status"].to_pylist()) - set(QA_STATUSES))
        rows = []
        for status in statuses:
            part = qa.filter(pc.equal(qa["status"], status))
            rows.append([status, part.num_rows, part.num_rows / max(1, qa.num_rows), pc.mean(part["em"]).as_py()])
        mastery.tables.append(Table("QA pairs by status", ["status", "pairs", "share", "mean EM"], rows))
    if m.join("scores.parquet").exists() and (img := plot_mastery_histogram(m.join("scores.parquet").read_table(["n_valid", "mastery"]), out)):
        mastery.images.append((img, "Measured mastery of the sampled sentences: the target model's mean closed-book exact "
                                    "match on the QA pairs written from each sentence (sentences without a valid pair are left out)."))
    sections.append(mastery)

    pruners = Section("Zero-RAG: pruners")
    metrics, validation = {}, {}
    for kind in _subdirs(root.join("pruner")):
        d = root.join("pruner", kind)
        if d.join("metrics.json").exists():
            metrics[kind] = d.join("metrics.json").read_json()
        if d.join("validation.parquet").exists():
            validation[kind] = d.join("validation.parquet").read_table(["measured", "predicted"])
    if metrics:
        rows = [[k, v.get("n_train"), v.get("n_val"), v.get("mse"), v.get("spearman"), (v.get("top_quantile") or {}).get("q"),
                 (v.get("top_quantile") or {}).get("precision"), (v.get("top_quantile") or {}).get("recall"), v.get("seconds")]
                for k, v in metrics.items()]
        pruners.tables.append(Table("pruner validation (top quantile: the most-mastered fraction q, measured vs predicted)",
                                    ["pruner", "n train", "n val", "mse", "spearman", "top q", "precision", "recall", "seconds"], rows))
    if img := plot_pruner_fit(validation, metrics, out):
        pruners.images.append((img, "Held-out sentences: predicted vs measured mastery per pruner; points on the dashed "
                                    "line are predicted exactly, and the ranking (Spearman) is what pruning uses."))
    sections.append(pruners)

    levels = _prune_levels(run)
    pruning = Section("Zero-RAG: pruned indices")
    if levels:
        rows = [[lv.get("ratio"), lv.get("achieved_ratio"), lv.get("threshold"), lv.get("sentences_in"), lv.get("kept"), lv.get("dropped"),
                 _mb(lv.get("index_bytes")), _mb(lv.get("source_index_bytes")), lv.get("pruner")] for lv in levels]
        pruning.tables.append(Table("pruning levels", ["ratio", "achieved", "threshold", "sentences in", "kept", "dropped",
                                                       "index MB", "source index MB", "pruner"], rows))
    if root.join("predictions").list_files(".parquet"):
        pred, total = _sample_column(root.join("predictions"), "mastery_pred")
        if img := plot_predicted_mastery(pred, total, levels, out):
            pruning.images.append((img, "The pruner's predicted mastery for every corpus sentence; each dashed line is the "
                                        "corpus-wide percentile of one pruning ratio."))
    sections.append(pruning)

    if root.join("grid.json").exists():
        grid = sorted(root.join("grid.json").read_json().get("rows", []), key=lambda r: (_combo(r), r.get("ratio", 0.0)))
        sweep = Section("Zero-RAG: pruning ratio sweep")
        yes = {True: "yes", False: "no"}
        sweep.tables.append(Table("answers, latency and size per pruning ratio", [
            "ratio", "method", "write-back", "router", "adapter", "n", "em", "f1", "acc", "ms/query", "index MB", "sentences",
            "retrieval skipped"],
            [[r.get("ratio"), r.get("method"), *(yes.get(r.get(k), r.get(k)) for k in ("writeback", "router", "adapter")), r.get("n"), r.get("em"), r.get("f1"), r.get("acc"), r.get("latency_ms_per_query"), _mb(r.get("index_bytes")),
              r.get("sentences"), r.get("retrieval_skipped")] for r in grid]))
        if img := plot_ratio_sweep(grid, out):
            sweep.images.append((img, "Per pruning ratio (0 = the full index) and setting: answer accuracy, retrieval "
                                      "latency per query, and index size. Zero-RAG's claim: size and latency fall, accuracy holds."))
        sections.append(sweep)

    extras = Section("Zero-RAG: query router and noise-tolerant tuning")
    if root.join("router", "metrics.json").exists():
        extras.tables.append(Table("query router", ["figure", "value"], [[k, v] for k, v in root.join("router", "metrics.json").read_json().items()]))
    if root.join("adapter", "tune.json").exists():
        tune = root.join("adapter", "tune.json").read_json()
        losses = [float(x) for x in tune.get("losses") or []]
        rows = [["steps", tune.get("steps")], ["seconds", tune.get("seconds")]]
        rows += [[f"examples: {k}", v] for k, v in (tune.get("formats") or {}).items()]
        rows += [["first loss", losses[0]], ["last loss", losses[-1]]] if losses else []
        extras.tables.append(Table("noise-tolerant tuning", ["figure", "value"], rows))
        if img := plot_tuning_loss(losses, out):
            extras.images.append((img, "Training loss of the generator's LoRA adapter on questions with relevant, "
                                       "distracting and no documents."))
    sections.append(extras)
    return [s for s in sections if s.tables or s.images]


# --- rendering -------------------------------------------------------------------------------------------


def to_markdown(run: RunFolder, sections: list[Section]) -> str:
    lines = [f"# wbrag run report: {run.uri}", ""]
    for sec in sections:
        lines += [f"## {sec.title}", ""]
        for t in sec.tables:
            lines += [f"**{t.title}**", "", "| " + " | ".join(t.header) + " |", "|" + "---|" * len(t.header)]
            lines += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in t.rows]
            lines.append("")
        for img, caption in sec.images:
            lines += [f"![{caption}]({img})", "", f"*{caption}*", ""]
        if sec.text:
            lines += ["```json", sec.text, "```", ""]
    return "\n".join(lines)


_CSS = """body{font-family:system-ui,sans-serif;max-width:980px;margin:2em auto;color:#222;padding:0 1em}
h1{font-size:1.5em}h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:1.8em}
table{border-collapse:collapse;margin:.6em 0 1.2em}td,th{border:1px solid #ccc;padding:.25em .6em;text-align:right}
td:first-child,th:first-child{text-align:left}th{background:#f3f3f3}figure{margin:1em 0}
figcaption{color:#555;font-size:.9em}img{max-width:100%;border:1px solid #eee}
pre{background:#f7f7f7;padding:1em;overflow:auto;font-size:.8em;max-height:30em}"""


def to_html(run: RunFolder, sections: list[Section]) -> str:
    e = html.escape
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>wbrag report {e(run.uri)}</title>"
             f"<style>{_CSS}</style></head><body><h1>wbrag run report</h1><p><code>{e(run.uri)}</code></p>"]
    for sec in sections:
        parts.append(f"<h2>{e(sec.title)}</h2>")
        for t in sec.tables:
            parts.append(f"<table><caption>{e(t.title)}</caption><tr>" + "".join(f"<th>{e(h)}</th>" for h in t.header) + "</tr>")
            for row in t.rows:
                parts.append("<tr>" + "".join(f"<td>{e(_fmt(v))}</td>" for v in row) + "</tr>")
            parts.append("</table>")
        for img, caption in sec.images:
            parts.append(f"<figure><img src='{e(img)}' alt='{e(caption)}'><figcaption>{e(caption)}</figcaption></figure>")
        if sec.text:
            parts.append(f"<details><summary>resolved config</summary><pre>{e(sec.text)}</pre></details>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(run: RunFolder) -> str:
    """Write RUN/report/index.html, report.md and the PNGs; return the HTML's location."""
    out_loc = run.path("report")
    with tempfile.TemporaryDirectory() as tmp:
        tmp_dir = Path(tmp)
        sections = collect(run, tmp_dir)
        (tmp_dir / "index.html").write_text(to_html(run, sections))
        (tmp_dir / "report.md").write_text(to_markdown(run, sections))
        for f in sorted(tmp_dir.iterdir()):  # local or s3://: every file through the run folder's filesystem
            out_loc.join(f.name).write_bytes(f.read_bytes())
    return out_loc.join("index.html").uri
