"""Run reports: one HTML file plus PNGs (matplotlib), and a Markdown twin with the same tables.

A report is built from what the run folder holds: the resolved config, every stage's stats, evaluation
metrics, and the outputs that have distributions worth seeing (sentences per passage, write-back selection,
source vs distilled tokens, ranks of retained documents). Sections appear only for stages the run has.
"""

from __future__ import annotations

import html
import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc

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


def _figure():
    import matplotlib

    matplotlib.use("Agg")  # no display on cluster nodes or CI
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=110)
    ax.grid(alpha=0.3)
    return plt, fig, ax


def _save(plt, fig, out: Path, name: str) -> str:
    fig.tight_layout()
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

    wb_root = run.path("writeback")
    for version_stats in _writeback_versions(run):
        version = version_stats["version"]
        sec = Section(f"Write-back {version}")
        sec.tables.append(Table("selection (the paper's Table 3)", ["figure", "value"],
                                [[label, version_stats.get(key)] for key, label in TABLE3]))
        units_loc = wb_root.join(version, "corpus")
        units = units_loc.read_table(["source_tokens", "distilled_tokens"]) if units_loc.exists() else None
        if img := plot_token_scatter(units, out, version):
            sec.images.append((img, "Each knowledge unit: tokens of its retained documents vs tokens after distillation."))
        if img := plot_rank_distribution(version_stats.get("rank_distribution") or {}, out, version):
            sec.images.append((img, "Retrieval ranks of the documents that passed the document gate."))
        sections.append(sec)

    config = Section("Configuration")
    config.text = json.dumps(run_json.get("config", {}), indent=2)
    sections.append(config)
    return sections


def _writeback_versions(run: RunFolder) -> list[dict[str, Any]]:
    import pyarrow.fs as pafs

    root = run.path("writeback")
    if not root.exists():
        return []
    found = []
    for info in sorted(root.fs.get_file_info(pafs.FileSelector(root.path)), key=lambda i: i.base_name):
        s = root.join(info.base_name, "stats.json")
        if info.type == pafs.FileType.Directory and s.exists():
            found.append({"version": info.base_name, **s.read_json()})
    return found


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
