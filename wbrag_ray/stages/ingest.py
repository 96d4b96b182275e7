"""Ingest: a FlashRAG corpus -> passages and sentences as Parquet shards, plus rejects with reasons.

Each shard (a byte range of a jsonl file, row groups of a Parquet file) is one Ray task that streams its records,
segments them into sentences, writes its three outputs, then a marker; a rerun skips shards with a marker.

Ids derive from where a record sits in its file, so they are unique and the same on every rerun:
    pid = file_index << 48 | unit, where unit = the line's byte offset (jsonl) or row_index << 16 (Parquet)
    sid = pid + position of the sentence in its passage
sids cannot collide: a jsonl line of n bytes holds at most n sentences and the next line starts n + 1 bytes
later; a Parquet passage with 65,536 sentences or more is rejected.

Duplicate document ids are found after all shards by one Arrow group-by over doc_id and pid only (about 1 GB for
the 21M-passage wiki corpus); later duplicates go to the rejects with the pid they duplicate.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from wbrag_ray.config import IngestConfig
from wbrag_ray.formats import (
    PASSAGES,
    REJECTS,
    SENTENCES,
    corpus_record,
    excerpt,
    file_kind,
    input_files,
    iter_jsonl,
    parse_corpus_line,
)
from wbrag_ray.layout import IngestFolder
from wbrag_ray.storage import Location, resolve

FILE_BITS = 48
PARQUET_ROW_SHIFT = 16
MAX_FILES = 1 << (63 - FILE_BITS)
FLUSH_ROWS = 20_000  # rows buffered before a Parquet row group is written: bounds a shard's memory
PROGRESS_EVERY_S = 5.0


class Segmenter:
    """Sentence segmentation with nupunkt: Punkt-style (as the Zero-RAG paper's NLTK Punkt), model in the wheel."""

    def __init__(self, min_chars: int = 1):
        import nupunkt

        self._spans = nupunkt.sent_spans_with_text
        self.min_chars = min_chars

    def split(self, text: str) -> list[str]:
        sentences = [s.strip() for s, _ in self._spans(text)]
        return [s for s in sentences if len(s) >= self.min_chars]


@dataclass(frozen=True)
class ShardSpec:
    index: int
    uri: str
    file_index: int
    kind: str  # "jsonl" | "parquet"
    start: int  # jsonl: byte offset; parquet: first row group
    end: int  # jsonl: byte offset (exclusive); parquet: row group (exclusive)

    @property
    def name(self) -> str:
        return f"part-{self.index:05d}"


def plan_shards(corpus: str, config: IngestConfig) -> list[ShardSpec]:
    """Cut every corpus file into shards of about `shard_bytes`."""
    files = input_files(resolve(corpus))
    if len(files) > MAX_FILES:
        raise ValueError(f"corpus has {len(files)} files; at most {MAX_FILES} fit the id layout")
    shards: list[ShardSpec] = []
    for file_index, f in enumerate(files):
        if file_kind(f) == "jsonl":
            size = f.size()
            for start in range(0, max(size, 1), config.shard_bytes):
                shards.append(ShardSpec(len(shards), f.uri, file_index, "jsonl", start, min(start + config.shard_bytes, size)))
        else:
            meta = pq.ParquetFile(f.path, filesystem=f.fs).metadata
            group, acc = 0, 0
            for rg in range(meta.num_row_groups):
                acc += meta.row_group(rg).total_byte_size
                if acc >= config.shard_bytes or rg == meta.num_row_groups - 1:
                    shards.append(ShardSpec(len(shards), f.uri, file_index, "parquet", group, rg + 1))
                    group, acc = rg + 1, 0
    return shards


def _iter_records(spec: ShardSpec):
    """Yield (unit, Passage | reason, raw) for the records of one shard."""
    loc = resolve(spec.uri)
    if spec.kind == "jsonl":
        for offset, line in iter_jsonl(loc, spec.start, spec.end):
            yield offset, parse_corpus_line(line), line
        return
    pf = pq.ParquetFile(loc.path, filesystem=loc.fs)
    row = sum(pf.metadata.row_group(rg).num_rows for rg in range(spec.start))
    for rg in range(spec.start, spec.end):
        for obj in pf.read_row_group(rg).to_pylist():
            yield row << PARQUET_ROW_SHIFT, corpus_record(obj), obj
            row += 1


class _ShardWriter:
    """Buffered Parquet writer of one output file of one shard, in row groups of FLUSH_ROWS, column by column."""

    def __init__(self, loc: Location, schema: pa.Schema):
        self.loc, self.schema, self.count = loc, schema, 0
        self.columns: dict[str, list[Any]] = {name: [] for name in schema.names}
        loc.parent().mkdir()
        self.tmp = loc.path + ".inprogress" if loc.is_local else loc.path
        self.writer = pq.ParquetWriter(self.tmp, schema, filesystem=loc.fs)

    def add(self, *values: Any) -> None:
        """One row, values in schema order."""
        for column, value in zip(self.columns.values(), values, strict=True):
            column.append(value)
        if len(self.columns[self.schema.names[0]]) >= FLUSH_ROWS:
            self.flush()

    def flush(self) -> None:
        n = len(self.columns[self.schema.names[0]])
        if n:
            self.writer.write_table(pa.Table.from_pydict(self.columns, schema=self.schema))
            self.count += n
            self.columns = {name: [] for name in self.schema.names}

    def close(self) -> None:
        self.flush()
        self.writer.close()
        if self.tmp != self.loc.path:
            self.loc.fs.move(self.tmp, self.loc.path)


def ingest_shard(spec: ShardSpec, out_uri: str, config: IngestConfig) -> dict[str, Any]:
    """Stream one shard into passages/, sentences/ and rejects/; write its stats and marker last."""
    out = IngestFolder(resolve(out_uri))
    t0 = time.perf_counter()
    segmenter = Segmenter(config.min_sentence_chars)
    file_base = spec.file_index << FILE_BITS
    passages_file, sentences_file, rejects_file = out.shard_outputs(spec.name)
    passages = _ShardWriter(passages_file, PASSAGES)
    sentences = _ShardWriter(sentences_file, SENTENCES)
    rejects = _ShardWriter(rejects_file, REJECTS)
    rows_in = 0
    for unit, rec, raw in _iter_records(spec):
        rows_in += 1
        pid = file_base | unit
        if not isinstance(rec, str) and len(rec.text) > config.max_passage_chars:
            rec = f"passage too long: {len(rec.text)} chars > ingest.max_passage_chars={config.max_passage_chars}"
        sents: list[str] = []
        if not isinstance(rec, str):
            sents = segmenter.split(rec.text)
            if spec.kind == "parquet" and len(sents) >= 1 << PARQUET_ROW_SHIFT:
                rec = f"too many sentences: {len(sents)}"
        if isinstance(rec, str):
            doc_id = raw.get("id") if isinstance(raw, dict) else _peek_id(raw)
            raw_text = raw if isinstance(raw, bytes) else json.dumps(raw, default=str)
            rejects.add(spec.uri, unit, doc_id, rec, excerpt(raw_text))
            continue
        passages.add(pid, rec.doc_id, rec.title, rec.text)
        for position, sentence in enumerate(sents):
            sentences.add(pid + position, pid, position, sentence)
    for w in (passages, sentences, rejects):
        w.close()
    stats = {
        "shard": spec.name,
        "spec": asdict(spec),
        "rows_in": rows_in,
        "rows_out": passages.count,
        "rows_rejected": rejects.count,
        "sentences": sentences.count,
        "seconds": round(time.perf_counter() - t0, 3),
    }
    out.shard_marker(spec.name).write_json(stats)  # the shard's marker, written last
    return stats


_ID_PATTERN = re.compile(rb'"id"\s*:\s*"?([^",}\s]+)')


def _peek_id(line: bytes) -> str | None:
    """The id of a rejected line where one can be read, so a person can find the record in the source."""
    try:
        obj = json.loads(line)
        return None if not isinstance(obj, dict) or obj.get("id") is None else str(obj["id"])
    except (ValueError, UnicodeDecodeError):
        m = _ID_PATTERN.search(line[:4096])
        return m.group(1).decode("utf-8", errors="replace") if m else None


def resolve_duplicate_ids(out: IngestFolder) -> int:
    """Keep the first passage (lowest pid) of every doc_id; move later ones and their sentences to rejects.
    Idempotent: a shard's dedupe rejects are written before the shard is rewritten, so a rerun finishes a crash."""
    tables = []
    for f in out.passages.list_files(".parquet"):
        t = pq.read_table(f.path, filesystem=f.fs, columns=["doc_id", "pid"])
        shard = pa.DictionaryArray.from_arrays(pa.array(np.zeros(t.num_rows, np.int32)), pa.array([f.name]))
        tables.append(t.append_column("shard", shard.cast(pa.string())))
    if not tables:
        return 0
    ids = pa.concat_tables(tables)
    groups = ids.group_by("doc_id").aggregate([("pid", "min"), ("pid", "count")])
    dups = groups.filter(pc.greater(groups["pid_count"], 1))
    if dups.num_rows == 0:
        return 0
    first = dict(zip(dups["doc_id"].to_pylist(), dups["pid_min"].to_pylist(), strict=True))
    losers = ids.filter(pc.is_in(ids["doc_id"], dups["doc_id"]))
    losers = losers.filter(pc.invert(pc.is_in(losers["pid"], pa.array(list(first.values()), pa.int64()))))
    for shard in sorted(set(losers["shard"].to_pylist())):
        mine = losers.filter(pc.equal(losers["shard"], shard))
        drop = mine["pid"]
        p_loc = out.passages.join(shard)
        passages = pq.read_table(p_loc.path, filesystem=p_loc.fs)
        dropped = passages.filter(pc.is_in(passages["pid"], drop))
        rejects = [
            {"source": "dedupe", "offset": r["pid"], "doc_id": r["doc_id"],
             "reason": f"duplicate id {r['doc_id']!r} (first at pid {first[r['doc_id']]})",
             "raw": excerpt(json.dumps({"id": r["doc_id"], "contents": r["title"] + "\n" + r["text"]}))}
            for r in dropped.to_pylist()
        ]
        out.dedupe_rejects(shard).write_table(pa.Table.from_pylist(rejects, schema=REJECTS))
        s_loc = out.sentences.join(shard)
        sentences = pq.read_table(s_loc.path, filesystem=s_loc.fs)
        s_loc.write_table(sentences.filter(pc.invert(pc.is_in(sentences["pid"], drop))))
        p_loc.write_table(passages.filter(pc.invert(pc.is_in(passages["pid"], drop))))
    return losers.num_rows


def run_ingest(corpus: str, out_uri: str, config: IngestConfig, max_in_flight: int | None = None) -> dict[str, Any]:
    """Ingest `corpus` into `out_uri` with one Ray task per shard; return totals (rows in = out + rejected)."""
    import ray

    shards = plan_shards(corpus, config)
    out = IngestFolder(resolve(out_uri))
    done = out.finished_shards()
    todo = [s for s in shards if s.name not in done]
    task = ray.remote(num_cpus=1, max_retries=3)(ingest_shard)
    max_in_flight = max_in_flight or max(2, int(ray.cluster_resources().get("CPU", 2)) * 2)
    pending: list[Any] = []
    finished = len(shards) - len(todo)
    if finished:
        print(f"[ingest] resuming: {finished}/{len(shards)} shards already complete", flush=True)
    queue = list(todo)
    t0 = last_report = time.perf_counter()
    rows = 0
    while queue or pending:
        while queue and len(pending) < max_in_flight:
            pending.append(task.remote(queue.pop(0), out.root.uri, config))
        ready, pending = ray.wait(pending, num_returns=1)
        stats = ray.get(ready[0])
        finished += 1
        rows += stats["rows_in"]
        now = time.perf_counter()
        if now - last_report >= PROGRESS_EVERY_S or finished == len(shards):
            last_report = now
            rate = rows / max(now - t0, 1e-9)
            print(f"[ingest] {finished}/{len(shards)} shards, {rows:,} records this run ({rate:,.0f}/s)", flush=True)
    duplicates = resolve_duplicate_ids(out)
    per_shard = [out.shard_marker(s.name).read_json() for s in shards]
    rows_in = sum(s["rows_in"] for s in per_shard)
    rejected = sum(s["rows_rejected"] for s in per_shard) + sum(f.num_rows() for f in out.dedupe_rejects_files())
    rows_out = rows_in - rejected
    sentences = out.sentences.num_rows()
    kept = out.passages.num_rows()
    if kept != rows_out:  # the reconciliation every run must satisfy
        raise RuntimeError(f"ingest reconciliation failed: {rows_in} in, {kept} out, {rejected} rejected")
    seg_seconds = sum(s["seconds"] for s in per_shard)
    return {
        "rows_in": rows_in,
        "rows_out": rows_out,
        "rows_rejected": rejected,
        "duplicates_rejected_this_run": duplicates,
        "sentences": sentences,
        "shards": len(shards),
        "shard_task_seconds": round(seg_seconds, 3),
        "records_per_task_second": round(rows_in / seg_seconds, 1) if seg_seconds else None,
        "sentences_per_task_second": round(sentences / seg_seconds, 1) if seg_seconds else None,
    }
