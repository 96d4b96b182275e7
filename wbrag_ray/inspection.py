"""`wbrag inspect RUN`: samples a person wants to read, printed as text.

Rejected corpus rows with their reasons, a segmented passage, evaluation answers (wrong ones first) with
the documents they saw, and write-back units with the question and source documents that produced them.
"""

from __future__ import annotations

import json
import textwrap

from wbrag_ray.run import RunFolder


def _short(s: str, n: int = 140) -> str:
    s = " ".join(str(s).split())
    return s if len(s) <= n else s[: n - 3] + "..."


def inspect_run(run: RunFolder, n: int = 3) -> str:
    out: list[str] = [f"run {run.uri}", f"completed stages: {', '.join(run.completed_stages()) or 'none'}"]

    rejects = run.path("ingest", "rejects")
    if rejects.exists():
        rows = rejects.read_table().to_pylist()
        out.append(f"\n== corpus rejects: {len(rows)} ==")
        for r in rows[:n]:
            out.append(f"  [{r['doc_id']}] {r['reason']}  <- {_short(r['raw'], 90)}")

    sentences = run.path("ingest", "sentences")
    if sentences.exists():
        table = sentences.read_table()
        first = table["pid"][0].as_py()
        mine = [r for r in table.slice(0, 200).to_pylist() if r["pid"] == first]
        out.append(f"\n== passage {first} as sentences (Zero-RAG's unit) ==")
        out += [f"  {r['sid']}: {_short(r['text'])}" for r in mine]

    ev = run.path("eval")
    if ev.exists():
        import pyarrow.fs as pafs

        for info in sorted(ev.fs.get_file_info(pafs.FileSelector(ev.path)), key=lambda i: i.base_name):
            preds = ev.join(info.base_name, "predictions.parquet")
            if not preds.exists():
                continue
            rows = sorted(preds.read_table().to_pylist(), key=lambda r: r["acc"])
            out.append(f"\n== {info.base_name}: wrong answers first ==")
            for r in rows[:n]:
                docs = json.loads(r["docs"] or "[]")
                out.append(f"  Q: {r['question']}\n  gold: {r['golden_answers']}  predicted: {_short(r['prediction'], 80)}"
                           f"  (acc={r['acc']:.0f})")
                out += [f"     doc {d['rank'] + 1} [{d['source']}:{d['id']}] {d['title']} ({d['score']:.3f})" for d in docs[:3]]

    from wbrag_ray.report import _writeback_versions

    for stats in _writeback_versions(run):
        units = run.path("writeback", stats["version"], "corpus")
        if not units.exists():
            continue
        rows = units.read_table().to_pylist()
        out.append(f"\n== write-back {stats['version']}: {len(rows)} knowledge units ==")
        for r in rows[:n]:
            out.append(f"  unit {r['id']} from question: {r.get('question', r.get('source_example_id'))}")
            out.append(textwrap.indent(textwrap.fill(_short(f"{r['title']}: {r['text']}", 400), 100), "     "))
            out.append(f"     sources: {r.get('source_doc_ids')} ranks {r.get('source_ranks')}")
    return "\n".join(out)
