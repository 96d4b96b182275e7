"""`wbrag inspect RUN`: samples to read as text: rejects, a segmented passage, answers (wrong first), write-back
units with their sources, Zero-RAG's pruned sentences and QA pairs."""

from __future__ import annotations

import json
import textwrap

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from wbrag_ray.checkpoints import progress
from wbrag_ray.layout import subdirs
from wbrag_ray.report.sections import QA_STATUSES
from wbrag_ray.run import RunFolder
from wbrag_ray.storage import Location
from wbrag_ray.zerorag.qa import NOT_IN_SENTENCE, OK, UNPARSEABLE


def _short(s: str, n: int = 140) -> str:
    s = " ".join(str(s).split())
    return s if len(s) <= n else s[: n - 3] + "..."


def _head(loc, n: int) -> list[dict]:
    """The first `n` rows of a Parquet folder, reading row groups only until there are enough."""
    rows: list[dict] = []
    for f in loc.list_files(".parquet"):
        pf = pq.ParquetFile(f.path, filesystem=f.fs)
        for g in range(pf.metadata.num_row_groups):
            rows += pf.read_row_group(g).slice(0, n - len(rows)).to_pylist()
            if len(rows) >= n:
                return rows
    return rows


def run_status(run: RunFolder) -> list[str]:
    """One line per stage: complete ones with their rows, then incomplete ones with their checkpointed rows."""
    lines = [f"run {run.uri}"]
    complete = run.completed_stages()
    for name in complete:
        stats = run.stats(name) or {}
        rows = stats.get("rows_out")
        resumed = f", {stats['rows_resumed']:,} of them resumed after a stop" if stats.get("rows_resumed") else ""
        lines.append(f"  {name:<28} complete    {'' if rows is None else f'{rows:,} rows out'}{resumed}")
    started = set(subdirs(run.layout.stages)) | set(subdirs(run.layout.checkpoints))
    for name in sorted(started - set(complete)):
        folder = run.layout.checkpoint(name)
        if not folder.exists():
            lines.append(f"  {name:<28} incomplete  nothing committed: the same command starts it over")
            continue
        info = progress(folder)
        if "trained_steps" in info:
            lines.append(f"  {name:<28} incomplete  training checkpointed at step {info['trained_steps']:,}: the same "
                         "command resumes it")
            continue
        of = f" of {info['rows']:,}" if "rows" in info else ""
        in_pass = f" in pass {info['pass']}" if "pass" in info else ""
        lines.append(f"  {name:<28} incomplete  {info['committed']:,}{of} rows committed{in_pass}: the same "
                     "command resumes it")
    return lines


def inspect_run(run: RunFolder, n: int = 3) -> str:
    out: list[str] = run_status(run)
    layout = run.layout
    rejects = layout.ingest.rejects
    if rejects.exists():  # the count from the footers; only the first rows printed are read
        out.append(f"\n== corpus rejects: {rejects.num_rows()} ==")
        out += [f"  [{r['doc_id']}] {r['reason']}  <- {_short(r['raw'], 90)}" for r in _head(rejects, n)]

    sentences = layout.ingest.sentences
    if sentences.exists():
        head = _head(sentences, 200)
        first = head[0]["pid"] if head else None
        mine = [r for r in head if r["pid"] == first]
        out.append(f"\n== passage {first} as sentences (Zero-RAG's unit) ==")
        out += [f"  {r['sid']}: {_short(r['text'])}" for r in mine]

    for result in layout.eval_results():
        if not result.predictions.exists():
            continue
        rows = sorted(result.predictions.read_table().to_pylist(), key=lambda r: r["acc"])
        out.append(f"\n== {result.root.name}: wrong answers first ==")
        for r in rows[:n]:
            docs = json.loads(r["docs"] or "[]")
            out.append(f"  Q: {r['question']}\n  gold: {r['golden_answers']}  predicted: {_short(r['prediction'], 80)}"
                       f"  (acc={r['acc']:.0f})")
            out += [f"     doc {d['rank'] + 1} [{d['source']}:{d['id']}] {d['title']} ({d['score']:.3f})" for d in docs[:3]]

    for version in layout.writeback_versions():
        if not version.units.exists():
            continue
        rows = version.units.read_table().to_pylist()
        out.append(f"\n== write-back {version.version}: {len(rows)} knowledge units ==")
        for r in rows[:n]:
            out.append(f"  unit {r['id']} from question: {r.get('question', r.get('source_example_id'))}")
            out.append(textwrap.indent(textwrap.fill(_short(f"{r['title']}: {r['text']}", 400), 100), "     "))
            out.append(f"     sources: {r.get('source_doc_ids')} ranks {r.get('source_ranks')}")
    out += inspect_zero_rag(run, n)
    return "\n".join(out)


# --- Zero-RAG --------------------------------------------------------------------------------------------

ZR_STATUS_WHY = {UNPARSEABLE: "the QA generator's output could not be read as question + answer",
                 NOT_IN_SENTENCE: "the answer is not in the sentence, so the pair does not test what it says"}


def _qa_line(q: dict) -> str:
    """One QA pair, showing what decided its fate: the model's answer and EM when scored, else the reason."""
    if q["status"] == OK:
        em = "" if q["em"] is None else f"  em={q['em']:.0f}"
        return f"[ok] Q: {_short(q['question'], 110)}  gold: {_short(q['answer'], 40)}  model: {_short(q['prediction'] or '', 40)}{em}"
    if q["status"] == UNPARSEABLE:
        return f"[unparseable] generator wrote: {_short(q['raw'] or '(nothing)', 150)}"
    return f"[{q['status']}] Q: {_short(q['question'] or '', 110)}  answer: {_short(q['answer'] or '', 40)}"


def _top_dropped(keep: Location, n: int) -> list[dict]:
    """The n dropped sentences with the highest predicted mastery, one keep-mask file at a time."""
    order = [("mastery_pred", "descending"), ("id", "ascending")]  # ties by id: the same sample every time
    best = []
    for f in keep.list_files(".parquet"):
        t = pq.read_table(f.path, filesystem=f.fs, columns=["id", "mastery_pred", "keep"], filters=[("keep", "=", False)])
        if t.num_rows:
            best.append(t.take(pc.select_k_unstable(t, min(n, t.num_rows), order)))
    if not best:
        return []
    t = pa.concat_tables(best)
    return t.take(pc.sort_indices(t, order)).slice(0, n).to_pylist()


def _sentence_texts(run: RunFolder, sids: list[int]) -> dict[int, str]:
    loc = run.layout.ingest.sentences
    found: dict[int, str] = {}
    if not sids or not loc.exists():
        return found
    for f in loc.list_files(".parquet"):  # the sid filter skips row groups by their footer statistics
        t = pq.read_table(f.path, filesystem=f.fs, columns=["sid", "text"], filters=[("sid", "in", sids)])
        found.update(zip(t["sid"].to_pylist(), t["text"].to_pylist(), strict=True))
    return found


def inspect_zero_rag(run: RunFolder, n: int = 3) -> list[str]:
    """Zero-RAG's dropped sentences the pruner is surest of, with their QA pairs; then QA pairs by status."""
    out: list[str] = []
    zr = run.layout.zero_rag
    qa = zr.qa.read_table().to_pylist() if zr.qa.exists() else []
    qa.sort(key=lambda q: (q["sid"], q["qa_index"]))
    by_sid: dict[int, list[dict]] = {}
    for q in qa:
        by_sid.setdefault(q["sid"], []).append(q)
    scored = {r["sid"]: r for r in zr.scores.read_table(["sid", "text", "n_valid", "mastery"]).to_pylist()} if zr.scores.exists() else {}

    levels = [(lv.stats.read_json(), lv) for lv in zr.pruned_levels() if lv.keep.exists()]
    if levels:
        # the largest ratio drops the most, so its top dropped sentences are the boldest calls
        stats, level = max(levels, key=lambda sl: sl[0].get("ratio", 0.0))
        top = _top_dropped(level.keep, n)
        texts = _sentence_texts(run, [r["id"] for r in top])
        out.append(f"\n== Zero-RAG {level.root.name}: {stats.get('dropped', '?')} of {stats.get('sentences_in', '?')} sentences "
                   f"dropped; the {len(top)} with the highest predicted mastery ==")
        for r in top:
            s = scored.get(r["id"])
            measured = ""
            if s is not None:
                measured = ("  measured " + (f"{s['mastery']:.2f} on {s['n_valid']} valid QA pairs" if s["mastery"] is not None
                                             else "none (no valid QA pair)"))
            out.append(f"  sentence {r['id']}  predicted {r['mastery_pred']:.3f}{measured or '  (not in the mastery sample)'}")
            out.append(f"     {_short(texts.get(r['id']) or (s or {}).get('text') or '(text not among the ingested sentences)', 200)}")
            out += [f"       {_qa_line(q)}" for q in by_sid.get(r["id"], [])]

    if qa:
        counts = {st: sum(q["status"] == st for q in qa) for st in QA_STATUSES}
        out.append("\n== Zero-RAG mastery QA pairs: " + ", ".join(f"{c} {st}" for st, c in counts.items()) + " ==")
        for st in QA_STATUSES:
            seen: set[int] = set()  # one pair per sentence: n sentences say more than n pairs of one
            mine = [q for q in qa if q["status"] == st and not (q["sid"] in seen or seen.add(q["sid"]))][:n]
            if mine:
                out.append(f"  -- {st}" + (f": {ZR_STATUS_WHY[st]}" if st in ZR_STATUS_WHY else ": scored by the target model, closed-book"))
            for q in mine:
                out.append(f"  sentence {q['sid']}: {_short((scored.get(q['sid']) or {}).get('text', '?'), 160)}")
                out.append(f"       {_qa_line(q)}")
    return out
