"""A report's sections of tables, images and text, rendered as an HTML page and a Markdown twin."""

from __future__ import annotations

import html
import json
from dataclasses import dataclass, field
from typing import Any


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

    def image(self, name: str | None, caption: str) -> None:
        """Add a figure; None (the plot had nothing to draw) adds nothing."""
        if name:
            self.images.append((name, caption))


def figures(title: str, values: dict[str, Any]) -> Table:
    """A two-column table of named figures."""
    return Table(title, ["figure", "value"], [[k, v] for k, v in values.items()])


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (dict, list)):
        return json.dumps(v)[:80]
    return "" if v is None else str(v)


def to_markdown(uri: str, sections: list[Section]) -> str:
    lines = [f"# wbrag run report: {uri}", ""]
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


def to_html(uri: str, sections: list[Section]) -> str:
    e = html.escape
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>wbrag report {e(uri)}</title>"
             f"<style>{_CSS}</style></head><body><h1>wbrag run report</h1><p><code>{e(uri)}</code></p>"]
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
