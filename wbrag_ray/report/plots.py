"""The report's figures (matplotlib, Agg): each takes plain data and writes one PNG, or returns None."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


def as_float(col) -> np.ndarray:
    """A numeric column as float64, nulls as NaN."""
    return np.asarray(col.to_numpy(zero_copy_only=False), dtype=np.float64)


def _figure(ncols: int = 1):
    """A figure with one axis, or a row of `ncols` panels (then the axes come as an array). No pyplot: nothing
    global to close, and no display wanted on cluster nodes or CI (savefig draws with Agg)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 3.6) if ncols == 1 else (min(4.3, 11 / ncols) * ncols, 3.8), dpi=110)
    ax = fig.subplots(1, ncols, squeeze=False)
    for a in ax.flat:
        a.grid(alpha=0.3)
    return fig, ax[0, 0] if ncols == 1 else ax[0]


def _save(fig, out: Path, name: str, rect: tuple[float, float, float, float] | None = None) -> str:
    fig.tight_layout(rect=rect)  # rect: room kept free for a figure-level legend
    fig.savefig(out / name)
    return name


def plot_stage_times(stats: dict[str, dict[str, Any]], out: Path) -> str | None:
    timed = {k: v["seconds"] for k, v in stats.items() if isinstance(v.get("seconds"), (int, float))}
    if not timed:
        return None
    fig, ax = _figure()
    names = list(timed)
    ax.barh(names, [timed[n] for n in names], color="#4C72B0")
    ax.invert_yaxis()
    ax.set(xlabel="seconds", title="wall time per stage")
    return _save(fig, out, "stage_times.png")


def plot_eval(results: dict[str, dict[str, Any]], out: Path) -> str | None:
    if not results:
        return None
    fig, ax = _figure()
    names = list(results)
    x = np.arange(len(names))
    for i, m in enumerate(("em", "f1", "acc")):
        ax.bar(x + (i - 1) * 0.27, [results[n].get(m, 0) for n in names], width=0.27, label=m)
    ax.set_xticks(x, names, rotation=20, ha="right", fontsize=8)
    ax.set(ylim=(0, 1), ylabel="score", title="answer metrics per setting")
    ax.legend()
    return _save(fig, out, "eval_metrics.png")


def plot_methods_grid(grid: dict[str, Any], out: Path, file_name: str, metric: str = "acc") -> str | None:
    """Per method, a bar for the base and one beside each write-back version (own method hatched)."""
    rows = grid.get("rows") or []
    if not rows:
        return None
    methods = [m for m in grid["methods"] if any(r["method"] == m for r in rows)]
    settings = [None, *grid.get("versions", {})]
    cells = {(r["method"], r["version"]): r for r in rows}
    fig, ax = _figure()
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
    ax.set(ylim=(0, 1), ylabel=metric)
    ax.set_title(f"{metric} per RAG method and knowledge base (hatched: same-method write-back)", fontsize=9)
    # below the axes: bars reach the top, where a legend inside would cover them
    ncol = min(3, len(settings))
    fig.legend(*ax.get_legend_handles_labels(), loc="lower center", ncol=ncol, fontsize=8, frameon=False)
    return _save(fig, out, file_name, rect=(0, 0.07 * -(-len(settings) // ncol) + 0.02, 1, 1))


def plot_sentences_per_passage(histogram: np.ndarray, out: Path) -> str | None:
    """`histogram[k]`: how many passages hold k sentences."""
    if histogram.sum() == 0:
        return None
    fig, ax = _figure()
    sizes = np.arange(len(histogram))
    ax.bar(sizes[1:], histogram[1:], color="#55A868", width=0.85)
    ax.locator_params(axis="x", integer=True)  # sentence counts are whole numbers
    ax.set(xlabel="sentences in a passage", ylabel="passages",
           title=f"segmentation: {int((sizes * histogram).sum()):,} sentences in {int(histogram.sum()):,} passages")
    return _save(fig, out, "sentences_per_passage.png")


def plot_search_setting(search: dict[str, Any], out: Path) -> str | None:
    """Recall against exact search and time per query at each setting the index build tried (its `search`)."""
    steps = search.get("measured") or []
    if len(steps) < 2:
        return None
    fig, ax = _figure()
    ms = [m["ms_per_query"] for m in steps]
    ax.plot(ms, [m["recall"] for m in steps], "o-", color="#4C72B0")
    for m in steps:
        ax.annotate(str(m["value"]), (m["ms_per_query"], m["recall"]), textcoords="offset points", xytext=(4, -10),
                    fontsize=8)
    ax.axhline(search["target_recall"], color="#C44E52", linestyle="--", linewidth=1, label="target")
    ax.set(xlabel="ms per query (one shard's search)", ylabel=f"recall@{search['k']} of exact search",
           title=f"index search: {search['parameter']} {search['value']} chosen")
    ax.legend(loc="lower right")
    return _save(fig, out, "search_setting.png")


def plot_token_scatter(units: pa.Table | None, out: Path, version: str) -> str | None:
    if units is None or units.num_rows == 0:
        return None
    src = units["source_tokens"].to_numpy()
    dst = units["distilled_tokens"].to_numpy()
    fig, ax = _figure()
    ax.scatter(src, dst, s=14, alpha=0.7, color="#C44E52")
    top = max(src.max(), dst.max()) * 1.05
    ax.plot([0, top], [0, top], "k--", lw=1, label="identity (no compression)")
    ax.set(xlabel="source tokens (retained documents)", ylabel="distilled tokens (knowledge unit)",
           title=f"write-back {version}: distillation compresses evidence")
    ax.legend()
    return _save(fig, out, f"writeback_{version}_tokens.png")


def plot_rank_distribution(ranks: dict[str, int], out: Path, version: str) -> str | None:
    if not ranks:
        return None
    fig, ax = _figure()
    keys = sorted(ranks, key=lambda r: int(r))
    ax.bar([str(int(k) + 1) if str(k).isdigit() else k for k in keys], [ranks[k] for k in keys], color="#8172B2")
    ax.set(xlabel="retrieval rank of a retained document (1 = top)", ylabel="retained documents",
           title=f"write-back {version}: which ranks the document gate keeps")
    return _save(fig, out, f"writeback_{version}_ranks.png")


# --- Zero-RAG plots --------------------------------------------------------------------------------------


def _mean_em_values(n_valid: np.ndarray) -> np.ndarray:
    """Every value a mean of n 0/1 exact matches can take, for each n the sample has."""
    return np.unique(np.concatenate([np.arange(n + 1) / n for n in np.unique(n_valid) if n > 0] or [np.zeros(1)]))


def plot_mastery_histogram(scores: pa.Table, out: Path) -> str | None:
    scored = scores.filter(pc.is_valid(scores["mastery"]))
    if scored.num_rows == 0:
        return None
    m, n_valid = as_float(scored["mastery"]), scored["n_valid"].to_numpy().astype(int)
    values = _mean_em_values(n_valid)
    nearest = np.abs(m[:, None] - values[None, :]).argmin(axis=1)
    fig, ax = _figure()
    if np.abs(m - values[nearest]).max() < 1e-6:
        # Scores are means of few 0/1 EMs: one bar per value they can take.
        gap = np.diff(values).min() if len(values) > 1 else 1.0
        ax.bar(values, np.bincount(nearest, minlength=len(values)), width=min(0.8 * gap, 0.06), color="#4C72B0")
        if len(values) <= 13:
            ax.set_xticks(values, [str(Fraction(v).limit_denominator(int(n_valid.max()))) for v in values])
        ax.locator_params(axis="y", integer=True)  # counts of sentences
    else:  # a non-binary metric: plain bins
        ax.hist(m, bins=20, range=(0, 1), color="#4C72B0", rwidth=0.9)
    ax.set(xlabel="mastery score (mean closed-book EM over a sentence's valid QA pairs)", ylabel="sentences",
           title=f"measured mastery: {len(m):,} scored sentences, mean {m.mean():.2f}")
    return _save(fig, out, "zero_rag_mastery.png")


def plot_pruner_fit(validation: dict[str, pa.Table], metrics: dict[str, dict[str, Any]], out: Path) -> str | None:
    validation = {k: t for k, t in validation.items() if t.num_rows}
    if not validation:
        return None
    fig, axes = _figure(ncols=max(2, len(validation)))  # two panels at least: one alone would be too wide
    for ax, (kind, t) in zip(axes, validation.items(), strict=False):  # spare panels hidden below
        x, y = as_float(t["measured"]), as_float(t["predicted"])
        ax.scatter(x, y, s=12, alpha=0.45, color="#4C72B0", label="held-out sentence")
        levels = np.unique(x[~np.isnan(x)])
        if len(levels) <= 25:  # measured scores are few discrete values: their mean prediction shows calibration
            ax.plot(levels, [np.nanmean(y[x == v]) for v in levels], "D-", color="#DD8452", ms=5, label="mean prediction")
        lo, hi = min(0.0, np.nanmin(y)), max(1.0, np.nanmax(y))
        ax.plot([lo, hi], [lo, hi], "k--", lw=1, label="identity")
        rho = metrics.get(kind, {}).get("spearman")
        ax.set_title(f"{kind} pruner: n={t.num_rows}" + (f", Spearman {rho:.2f}" if rho is not None else ""), fontsize=10)
        ax.set(xlabel="measured mastery", ylabel="predicted mastery")
        ax.legend(fontsize=7, loc="upper left")
    for ax in axes[len(validation):]:
        ax.set_visible(False)
    return _save(fig, out, "zero_rag_pruners.png")


def plot_predicted_mastery(pred: np.ndarray, total: int, levels: list[dict[str, Any]], out: Path) -> str | None:
    pred = pred[~np.isnan(pred)]
    if len(pred) == 0:
        return None
    fig, ax = _figure()
    ax.hist(pred, bins=int(np.clip(np.sqrt(len(pred)), 10, 60)), color="#55A868", edgecolor="white", lw=0.4)  # few sentences, few bins
    colors = ["#C44E52", "#8172B2", "#DD8452", "#937860", "#DA8BC3", "#8C8C8C"]
    for i, lv in enumerate(lv for lv in levels if isinstance(lv.get("threshold"), (int, float)) and np.isfinite(lv["threshold"])):
        ax.axvline(lv["threshold"], color=colors[i % len(colors)], ls="--", lw=1.4,
                   label=f"prune {lv['ratio']:g}: threshold {lv['threshold']:.3g}")
    sampled = f", sample of {len(pred):,}" if len(pred) < total else ""
    ax.set_title(f"predicted mastery over the corpus ({total:,} sentences{sampled})", fontsize=10)
    ax.set(xlabel="predicted mastery (sentences right of a threshold are dropped)", ylabel="sentences")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    return _save(fig, out, "zero_rag_predicted_mastery.png")


def setting_label(row: dict[str, Any]) -> str:
    """A Zero-RAG grid row's setting: its RAG method and the parts switched on."""
    flags = [("writeback", "write-back"), ("router", "router"), ("adapter", "adapter")]
    return " + ".join([row.get("method", "?")] + [label for key, label in flags if row.get(key)])


def _num(v: Any, scale: float = 1.0) -> float:
    return float(v) * scale if isinstance(v, (int, float)) else float("nan")


def plot_ratio_sweep(rows: list[dict[str, Any]], out: Path) -> str | None:
    if not rows:
        return None
    combos: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        combos.setdefault(setting_label(r), []).append(r)
    fig, axes = _figure(ncols=3)
    panels = [("acc", 1.0, "acc", "answer quality"), ("latency_ms_per_query", 1.0, "ms per query", "retrieval latency"),
              ("index_bytes", 1e-6, "index MB", "index size")]
    for i, (label, rs) in enumerate(combos.items()):
        rs = sorted(rs, key=lambda r: r["ratio"])
        # Earlier lines are drawn wider underneath, so coinciding settings still show.
        wide = (len(combos) - 1 - i) / max(1, len(combos) - 1)
        for ax, (key, scale, _, _) in zip(axes, panels, strict=True):
            ax.plot([r["ratio"] for r in rs], [_num(r.get(key), scale) for r in rs], marker="osD^vP*X"[i % 8],
                    lw=1.5 + 3 * wide, ms=5 + 5 * wide, alpha=0.9, label=label)
    for ax, (_, _, ylabel, title) in zip(axes, panels, strict=True):
        ax.set(xlabel="pruning ratio", ylabel=ylabel)
        ax.set_title(title, fontsize=10)
        ax.set_ylim(bottom=0)  # pruning trades size for quality: distances from zero are what matter
    axes[0].set_ylim(0, 1)
    handles, labels = axes[0].get_legend_handles_labels()
    ncol = min(5, len(labels))  # five labels still fit one row under three panels
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=9, frameon=False)
    return _save(fig, out, "zero_rag_ratio_sweep.png", rect=(0, 0.06 * -(-len(labels) // ncol) + 0.02, 1, 1))


TERM_LABELS = {"none": "retrieval-free", "relevant": "retrieval-augmented", "distracting": "noise suppression"}


def plot_tuning_loss(losses: list[float], out: Path, terms: dict[str, list[float | None]] | None = None) -> str | None:
    """The objective per step, and each of its three terms (the mean loss of the batch's rows of that format)."""
    if not losses:
        return None
    fig, ax = _figure()
    steps = np.arange(1, len(losses) + 1)
    ax.plot(steps, losses, color="#4C72B0", alpha=0.5 if len(losses) >= 20 else 1, marker="" if len(losses) >= 20 else "o",
            ms=3, label="objective per step")
    for (term, per_step), color in zip((terms or {}).items(), ("#55A868", "#8172B2", "#CCB974"), strict=False):
        values = np.array([np.nan if v is None else v for v in per_step], dtype=float)
        if len(values) == len(steps) and not np.isnan(values).all():
            ax.plot(steps, values, color=color, lw=1, alpha=0.8, label=TERM_LABELS.get(term, term))
    if len(losses) >= 20:  # per-step losses are noisy at small batches: a moving mean shows the trend
        w = max(2, len(losses) // 10)
        ax.plot(steps[w - 1:], np.convolve(losses, np.ones(w) / w, mode="valid"), color="#C44E52", label=f"mean of {w} steps")
    ax.set(xlabel="optimizer step", ylabel="training loss", title="noise-tolerant tuning of the generator (LoRA)")
    ax.legend(fontsize=8)
    return _save(fig, out, "zero_rag_tuning_loss.png")
