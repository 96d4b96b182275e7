"""Input formats (FlashRAG corpus and dataset files, jsonl or Parquet) and the Parquet schemas we write. Every
record becomes a row or a reject with a reason."""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from wbrag_ray.storage import Location, resolve

PASSAGES = pa.schema([("pid", pa.int64()), ("doc_id", pa.string()), ("title", pa.string()), ("text", pa.string())])
SENTENCES = pa.schema([("sid", pa.int64()), ("pid", pa.int64()), ("position", pa.int32()), ("text", pa.string())])
REJECTS = pa.schema(
    [("source", pa.string()), ("offset", pa.int64()), ("doc_id", pa.string()), ("reason", pa.string()), ("raw", pa.string())]
)
QUESTIONS = pa.schema(
    [("id", pa.string()), ("question", pa.string()), ("golden_answers", pa.list_(pa.string())), ("metadata", pa.string())]
)

RAW_EXCERPT = 500  # characters of a rejected record kept for inspection


class InputError(ValueError):
    """Input that cannot be read at all (missing file, unknown format); bad rows are rejects instead."""


def excerpt(raw: bytes | str) -> str:
    if isinstance(raw, bytes):
        raw = raw[: RAW_EXCERPT * 4].decode("utf-8", errors="replace")
    return raw[:RAW_EXCERPT]


def input_files(loc: Location, what: str = "input") -> list[Location]:
    """The corpus or dataset files at `loc` (a file, or a folder of .jsonl / .parquet); `what` names it in errors."""
    if not loc.exists():
        raise InputError(f"{what} {loc.uri} does not exist")
    files = [f for f in loc.list_files() if f.name.endswith((".jsonl", ".json", ".parquet"))]
    if not files:
        raise InputError(f"{what} {loc.uri}: no .jsonl or .parquet files there (FlashRAG jsonl or Parquet expected)")
    return files


def listing_identity(loc: Location) -> dict[str, Any]:
    """Provenance of an input: its files' names and sizes (not folder or times) and a short digest."""
    files = [(f.name, f.size()) for f in input_files(loc, "ingest.corpus")]
    digest = hashlib.sha256(json.dumps(files).encode()).hexdigest()[:16]
    total = sum(size for _, size in files)
    return {"files": len(files), "bytes": total, "digest": digest}


SMALL_INPUT_BYTES = 64 << 20  # inputs up to this size are identified by their content too


def input_identity(loc: Location, what: str) -> str:
    """A short digest of a question set for a stage's fingerprint: names and sizes, plus bytes up to
    SMALL_INPUT_BYTES (larger files: modification times), so a file edited in place is another input."""
    files = input_files(loc, what)
    sizes = [f.size() for f in files]
    digest = hashlib.sha256(json.dumps([(f.name, n) for f, n in zip(files, sizes, strict=True)]).encode())
    for f in files:
        if sum(sizes) <= SMALL_INPUT_BYTES:
            digest.update(f.read_bytes())
        else:
            digest.update(str(f.fs.get_file_info(f.path).mtime_ns).encode())
    return digest.hexdigest()[:16]


def input_params(path: str, what: str) -> dict[str, Any]:
    """A stage's parameters for a question set read by path: the path and its `input_identity`."""
    return {"train": path, "made_from": {"train": input_identity(resolve(path), what)}}


def reject_reasons(rejects: pa.Table | list[str], top: int = 3) -> str:
    """The leading reasons of a rejects table, with counts ('21 x invalid UTF-8 at byte 0, ...')."""
    reasons = rejects.column("reason").to_pylist() if isinstance(rejects, pa.Table) else list(rejects)
    counts = Counter(re.sub(r" at (byte|column|line) \d+", "", r or "") for r in reasons)
    parts = [f"{n} x {reason}" for reason, n in counts.most_common(top)]
    more = len(counts) - top
    return "; ".join(parts) + (f"; and {more} other reasons" if more > 0 else "")


def file_kind(loc: Location) -> str:
    return "parquet" if loc.name.endswith(".parquet") else "jsonl"


# --- corpus records -------------------------------------------------------------------------------------


@dataclass
class Passage:
    doc_id: str
    title: str
    text: str


def json_object(line: bytes) -> dict[str, Any] | str:
    """A JSON-lines line -> its object, or the reason it is not one."""
    if not line.strip():
        return "blank line"
    try:
        obj = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as exc:
        return f"invalid UTF-8 at byte {exc.start}"
    except json.JSONDecodeError as exc:
        return f"malformed JSON: {exc.msg} at column {exc.colno}"
    return obj if isinstance(obj, dict) else f"expected a JSON object, got {type(obj).__name__}"


def parse_corpus_line(line: bytes) -> Passage | str:
    """A FlashRAG corpus line -> Passage, or the reason it is rejected."""
    obj = json_object(line)
    return obj if isinstance(obj, str) else corpus_record(obj)


def corpus_record(obj: dict[str, Any]) -> Passage | str:
    """A corpus record with `id` and `contents` ("Title\\ntext"), or `title` and `text`."""
    if obj.get("id") is None:
        return "missing 'id'"
    doc_id = str(obj["id"])
    if "contents" in obj:
        contents = obj["contents"]
        if not isinstance(contents, str):
            return f"'contents' must be a string, got {type(contents).__name__}"
        title, _, text = contents.partition("\n")
        if not _:  # no title line: the whole contents is text
            title, text = "", contents
    elif "text" in obj:
        title, text = obj.get("title") or "", obj["text"]
        if not isinstance(text, str) or not isinstance(title, str):
            return "'title' and 'text' must be strings"
    else:
        return "missing 'contents' (FlashRAG corpus lines are {\"id\", \"contents\": \"Title\\ntext\"})"
    # FlashRAG's wiki dump quotes titles: "Aaron"
    title = title.strip()
    if len(title) >= 2 and title[0] == title[-1] == '"':
        title = title[1:-1]
    text = text.strip()
    if not text:
        return "empty contents"
    return Passage(doc_id, title, text)


# --- QA datasets ----------------------------------------------------------------------------------------


def dataset_record(obj: Any) -> dict[str, Any] | str:
    """A FlashRAG dataset record -> row, or the reason it is rejected."""
    if not isinstance(obj, dict):
        return f"expected a JSON object, got {type(obj).__name__}"
    question = obj.get("question")
    if not isinstance(question, str) or not question.strip():
        return "missing or empty 'question'"
    answers = obj.get("golden_answers")
    if isinstance(answers, str):
        answers = [answers]
    if answers is not None and not isinstance(answers, list):
        return "'golden_answers' must be a list of strings"
    answers = [str(a) for a in (answers or []) if a is not None and str(a).strip()]
    if not answers:
        return "missing or empty 'golden_answers'"
    if obj.get("id") is None:
        return "missing 'id'"
    meta = obj.get("metadata")
    return {
        "id": str(obj["id"]),
        "question": question.strip(),
        "golden_answers": answers,
        "metadata": json.dumps(meta) if meta is not None else None,
    }


def read_dataset(loc: Location, limit: int | None = None) -> tuple[pa.Table, pa.Table]:
    """A QA dataset file or folder -> (questions, rejects). Duplicate ids are rejected after the first."""
    rows: list[dict[str, Any]] = []
    rejects: list[dict[str, Any]] = []
    seen: set[str] = set()

    def add(source: str, offset: int, rec: dict[str, Any] | str, raw: Any) -> None:
        if isinstance(rec, dict) and rec["id"] in seen:
            rec = f"duplicate id {rec['id']!r}"
        if isinstance(rec, str):
            doc_id = raw.get("id") if isinstance(raw, dict) else None
            rejects.append(
                {"source": source, "offset": offset, "doc_id": None if doc_id is None else str(doc_id),
                 "reason": rec, "raw": excerpt(raw if isinstance(raw, (bytes, str)) else json.dumps(raw, default=str))}
            )
        else:
            seen.add(rec["id"])
            rows.append(rec)

    for f in input_files(loc):
        if file_kind(f) == "parquet":
            for i, obj in enumerate(f.read_table().to_pylist()):
                add(f.uri, i, dataset_record(obj), obj)
        else:
            for offset, line in iter_jsonl(f):
                obj = json_object(line)
                if isinstance(obj, dict):
                    add(f.uri, offset, dataset_record(obj), obj)
                elif obj != "blank line":  # blank lines in a small QA file carry no record
                    add(f.uri, offset, obj, line)
        if limit and len(rows) >= limit:
            break
    if limit:
        rows = rows[:limit]
    return pa.Table.from_pylist(rows, schema=QUESTIONS), pa.Table.from_pylist(rejects, schema=REJECTS)


def read_questions(path: str, what: str, limit: int | None = None) -> tuple[pa.Table, pa.Table]:
    """`read_dataset` of a user's QA file; no usable question is an input error naming the leading reject reasons."""
    questions, rejects = read_dataset(resolve(path), limit=limit)
    if questions.num_rows == 0:
        why = f": {reject_reasons(rejects)}" if rejects.num_rows else " (it is empty)"
        raise InputError(f"{what} {path} has no usable questions ({rejects.num_rows} rejected{why}); FlashRAG dataset "
                         'lines are {"id", "question", "golden_answers": [...]}')
    return questions, rejects


# --- streaming jsonl by byte range ----------------------------------------------------------------------


def iter_jsonl(loc: Location, start: int = 0, end: int | None = None, chunk: int = 4 << 20) -> Iterator[tuple[int, bytes]]:
    """Yield (byte offset, line) for every line that starts in [start, end), `chunk` bytes at a time: a line
    belongs to the shard where it starts, so every line is read exactly once."""
    end = loc.size() if end is None else end
    with loc.fs.open_input_file(loc.path) as f:
        # From the byte before `start`, the text up to its first newline belongs to the shard before (a lone
        # newline where a line starts exactly at `start`).
        pos, skip = max(0, start - 1), start > 0
        f.seek(pos)
        buf, off = b"", 0
        # Invariant: buf[off] is the first byte of the line (or skipped text) that starts at `pos`.
        while pos < end or skip:
            i = buf.find(b"\n", off)
            if i < 0:
                data = f.read(chunk)
                if not data:
                    if off < len(buf) and not skip:
                        yield pos, buf[off:]
                    return
                buf, off = buf[off:] + data, 0
                continue
            if not skip:
                yield pos, buf[off:i]
            pos, off, skip = pos + i + 1 - off, i + 1, False


def embeddings_table(ids: np.ndarray, vectors: np.ndarray, id_column: str = "id") -> pa.Table:
    """(id, vector) rows with a fixed-size-list vector column: the layout of embedding shards."""
    dim = vectors.shape[1]
    flat = pa.array(np.ascontiguousarray(vectors).reshape(-1))
    return pa.table({id_column: pa.array(ids, pa.int64()), "vector": pa.FixedSizeListArray.from_arrays(flat, dim)})


def plain_table(df) -> pa.Table:
    """A DataFrame as an Arrow table without pandas metadata."""
    return pa.Table.from_pandas(df, preserve_index=False).replace_schema_metadata(None)


def _folders_and_stem(path: str) -> tuple[list[str], str]:
    """A QA file's folders (an object store's bucket left out: it is no dataset's folder) and its name's stem."""
    parts = path.rstrip("/").split("://", 1)[-1].split("/")[1 if "://" in path else 0:]
    return parts[:-1], parts[-1].split(".")[0]


def dataset_stem(path: str) -> str:
    """A dataset's name from its path: the stem, with FlashRAG's folder ('nq/test.jsonl' -> 'nq-test')."""
    folders, stem = _folders_and_stem(path)
    if stem.lower() in SPLITS and folders and folders[-1].lower() in DATASET_FOLDERS:
        return f"{folders[-1]}-{stem}"
    return stem


SPLITS = ("train", "dev", "test", "val", "valid", "validation")  # FlashRAG's split file names

# FlashRAG's dataset folders (from its README and file listing): names `<folder>-<split>` files offline.
DATASET_FOLDERS = frozenset({
    "nq", "triviaqa", "popqa", "domainrag", "squad", "ms_marco", "narrativeqa", "wiki_qa", "web_questions",
    "curatedtrec", "ambig_qa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle", "asqa", "eli5", "mmlu",
    "truthful_qa", "hellaswag", "arc", "openbookqa", "quartz", "siqa", "piqa", "commonsenseqa", "boolq", "fermi",
    "fever", "wow", "wned", "trex", "zsre", "ay2", "wikiasp",
})


def dataset_name(path: str) -> str:
    """The dataset of a QA file by FlashRAG's layout ('nq/train.jsonl', 'fever_dev.parquet'), else its stem."""
    folders, stem = _folders_and_stem(path)
    stem = stem.lower()
    if stem in SPLITS and folders and folders[-1]:
        return folders[-1].lower()
    flat = re.fullmatch(rf"(.+)[_-](?:{'|'.join(SPLITS)})", stem, re.S)  # 'fever_dev'
    return flat.group(1) if flat else stem
