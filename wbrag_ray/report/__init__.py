"""Run reports: one HTML file plus PNGs and a Markdown twin, built from what the run folder holds. `sections`
reads the run and says what each section shows, `plots` draws the figures, `render` writes HTML and Markdown."""

from __future__ import annotations

import tempfile
from pathlib import Path

from wbrag_ray.report.render import to_html, to_markdown
from wbrag_ray.report.sections import collect
from wbrag_ray.run import RunFolder

__all__ = ["write_report"]


def write_report(run: RunFolder) -> str:
    """Write the report (RUN/report/: the HTML page, its Markdown twin and the PNGs); return the page's URI."""
    html, markdown = run.layout.report_html, run.layout.report_markdown
    with tempfile.TemporaryDirectory() as tmp:
        tmp_dir = Path(tmp)
        sections = collect(run, tmp_dir)
        (tmp_dir / html.name).write_text(to_html(run.uri, sections))
        (tmp_dir / markdown.name).write_text(to_markdown(run.uri, sections))
        for f in sorted(tmp_dir.iterdir()):  # local or s3://: every file through the run folder's filesystem
            run.layout.report.join(f.name).write_bytes(f.read_bytes())
    return html.uri
