"""The document store: id -> (title, text) for the units an index holds, without holding the corpus. A folder of
uncompressed Arrow IPC files, each sorted by id and covering one source file:

    DOCS/docs.json          {"format", "unit", "count", "files": [{"file", "count", "id_min", "id_max"}]}
    DOCS/docs-NNNNN.arrow   record batches of (id int64, title string, text string), ids ascending

A reader memory-maps a file on first use and finds a row by binary search over every SPARSE-th id, then one page of
the mapped ids; remote files are fetched once per node. Sources: an ingest folder or a Parquet folder of (id,
title, text) (the write-back corpus).
"""

from __future__ import annotations

import bisect
import hashlib
import mmap
import os
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from wbrag_ray.identity import content_identity
from wbrag_ray.layout import IngestFolder
from wbrag_ray.ray_runtime import run_tasks
from wbrag_ray.storage import Location, cache_root, node_cached, resolve

LISTING = "docs.json"
FORMAT = 1
BATCH_ROWS = 65_536  # rows per record batch: keeps every string buffer far below Arrow's 2 GiB offsets
SPARSE = 512  # ids per page of the mapped id column (4 KiB): a lookup reads one such page, found in memory
SAMPLE_KEY = b"wbrag.id_sample"  # schema metadata: every SPARSE-th id, little-endian int64
SCHEMA = pa.schema([("id", pa.int64()), ("title", pa.string()), ("text", pa.string())])


class DocStoreError(RuntimeError):
    """A missing or damaged document store, or an id it does not hold; the message names the file."""


# --- writing --------------------------------------------------------------------------------------------


def _sources(source: Location, unit: str) -> list[tuple[str, str | None]]:
    """(documents file, its titles file or None) per output file, in file-name order."""
    ingest = IngestFolder(source)
    if ingest.passages.exists():
        if unit == "sentence":
            return [(f.uri, ingest.passages.join(f.name).uri) for f in ingest.sentences.list_files(".parquet")]
        return [(f.uri, None) for f in ingest.passages.list_files(".parquet")]
    files = source.list_files(".parquet")
    if not files:
        raise DocStoreError(f"no documents at {source.uri}: expected an ingest folder (passages/, sentences/) "
                            f"or Parquet files with columns id, title, text")
    return [(f.uri, None) for f in files]


def _doc_table(doc_uri: str, titles_uri: str | None) -> pa.Table:
    """(id, title, text) of one source file, sorted by id."""
    f = resolve(doc_uri)
    names = pq.read_schema(f.path, filesystem=f.fs).names
    try:
        if "sid" in names:  # a sentences shard: titles from the passages shard written beside it
            sentences = pq.read_table(f.path, filesystem=f.fs, columns=["sid", "pid", "text"])
            t = resolve(titles_uri)
            passages = pq.read_table(t.path, filesystem=t.fs, columns=["pid", "title"])
            table = sentences.join(passages, "pid", join_type="left outer").select(["sid", "title", "text"])
        else:
            table = pq.read_table(f.path, filesystem=f.fs, columns=["pid" if "pid" in names else "id", "title", "text"])
    except (KeyError, pa.ArrowInvalid) as exc:
        raise DocStoreError(f"documents file {f.uri} lacks the columns a document store needs: {exc}") from None
    table = table.rename_columns(["id", "title", "text"]).cast(SCHEMA)
    return table.sort_by("id")


def _write_task(_shared: None, item: tuple[str, str | None, str]) -> dict[str, Any]:
    doc_uri, titles_uri, out_uri = item
    table = _doc_table(doc_uri, titles_uri)
    out = resolve(out_uri)
    table = table.combine_chunks()  # one chunk: record batches of exactly BATCH_ROWS rows but the last
    ids = table["id"]
    # the reader's in-memory sample of the ids, in the schema's metadata: opening a file reads it from the
    # footer instead of touching every page of the mapped id column to collect it
    sample = ids.to_numpy()[::SPARSE].astype("<i8").tobytes()
    schema = SCHEMA.with_metadata({SAMPLE_KEY: sample})
    with out.open_write() as stream, pa.ipc.new_file(stream, schema) as writer:
        writer.write_table(table.replace_schema_metadata(schema.metadata), max_chunksize=BATCH_ROWS)
    return {"file": out.name, "count": table.num_rows,
            "id_min": int(ids[0].as_py()) if table.num_rows else None,
            "id_max": int(ids[-1].as_py()) if table.num_rows else None}


def write_doc_store(source: Location, unit: str, out: Location, *, parallel: bool | None = None) -> dict[str, Any]:
    """Write the store of `source`'s `unit`s (passage / sentence; a plain Parquet folder holds one kind) into
    `out`: one task per source file (Ray tasks when Ray is up), then docs.json, last."""
    sources = _sources(source, unit)
    out.join(LISTING).delete()  # a reader never pairs an old listing with half-rewritten files
    items = [(doc, titles, out.join(f"docs-{i:05d}.arrow").uri) for i, (doc, titles) in enumerate(sources)]
    files = [f for f in run_tasks(_write_task, None, items, num_cpus=0.5, parallel=parallel,
                                         own_errors=(DocStoreError, ValueError)) if f["count"]]
    listing = {"format": FORMAT, "unit": unit, "source": source.uri, "count": sum(f["count"] for f in files),
               "files": files}
    out.join(LISTING).write_json(listing)
    return {"rows_in": listing["count"], "rows_out": listing["count"], "files": len(files)}


# --- reading --------------------------------------------------------------------------------------------


class _MappedFile:
    """One memory-mapped store file: its record batches, and every SPARSE-th id of each in memory (from the
    schema's metadata). The mapping is advised random: a lookup reads its pages, not a read-ahead window."""

    def __init__(self, path: str):
        with open(path, "rb") as f:
            self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if hasattr(mmap, "MADV_RANDOM"):  # Linux, macOS
            self.map.madvise(mmap.MADV_RANDOM)
        self.reader = pa.ipc.open_file(pa.py_buffer(self.map))
        self.batches = [self.reader.get_batch(i) for i in range(self.reader.num_record_batches)]
        # zero-copy views of the mapped id columns (int64 without nulls)
        self.ids = [b.column(0).to_numpy() for b in self.batches]
        # batches of BATCH_ROWS (a multiple of SPARSE) but the last: each batch's part of the stored sample
        sample = np.frombuffer((self.reader.schema.metadata or {})[SAMPLE_KEY], "<i8")
        per_batch = BATCH_ROWS // SPARSE
        self.samples = [sample[i * per_batch:(i + 1) * per_batch] for i in range(len(self.batches))]
        self.firsts = np.array([s[0] for s in self.samples], np.int64)

    def row(self, doc_id: int) -> tuple[str, str] | None:
        b = int(np.searchsorted(self.firsts, doc_id, side="right")) - 1
        if b < 0:
            return None
        start = (int(np.searchsorted(self.samples[b], doc_id, side="right")) - 1) * SPARSE
        window = self.ids[b][start : start + SPARSE]
        i = int(np.searchsorted(window, doc_id))
        if i >= len(window) or window[i] != doc_id:
            return None
        batch = self.batches[b]
        return batch.column(1)[start + i].as_py() or "", batch.column(2)[start + i].as_py()


class DocStore:
    """Lookups in a document store folder (see the module doc). Cheap to open and to pickle: files are
    mapped on first use, in the process that uses them."""

    def __init__(self, loc: Location):
        if not loc.join(LISTING).exists():
            raise DocStoreError(f"no document store at {loc.uri} ({LISTING} missing); build it with `wbrag index RUN`")
        try:
            self.listing = loc.join(LISTING).read_json()
        except ValueError as exc:
            raise DocStoreError(f"{loc.join(LISTING).uri} is not valid JSON: {exc}") from None
        self.loc, self.uri = loc, loc.uri
        self.unit = self.listing.get("unit")
        files = sorted(self.listing["files"], key=lambda f: f["id_min"])
        self._names = [f["file"] for f in files]
        self._mins = [f["id_min"] for f in files]
        self._maxs = [f["id_max"] for f in files]
        # Plain Parquet sources need not be split by id: where ranges overlap, every file covering an id is asked.
        self._disjoint = all(a < b for a, b in zip(self._maxs, self._mins[1:], strict=False))
        self._open: dict[str, _MappedFile] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_open": {}}  # mappings are per process

    def _file(self, name: str) -> _MappedFile:
        if name not in self._open:
            f = self.loc.join(name)
            if not f.exists():
                raise DocStoreError(f"document store file {f.uri} named by {self.loc.join(LISTING).uri} is missing")
            try:
                self._open[name] = _MappedFile(f.path if f.is_local else _node_copy(f))
            except (OSError, KeyError, pa.ArrowInvalid) as exc:  # KeyError: no id sample in its schema
                raise DocStoreError(f"document store file {f.uri} is damaged: {exc}") from None
        return self._open[name]

    def _candidates(self, doc_id: int) -> list[str]:
        if self._disjoint:
            i = bisect.bisect_right(self._mins, doc_id) - 1
            return [self._names[i]] if i >= 0 and doc_id <= self._maxs[i] else []
        return [n for n, lo, hi in zip(self._names, self._mins, self._maxs, strict=True) if lo <= doc_id <= hi]

    def get(self, doc_id: int) -> tuple[str, str]:
        for name in self._candidates(int(doc_id)):
            found = self._file(name).row(int(doc_id))
            if found is not None:
                return found
        raise KeyError(f"document id {doc_id} is in the index but not in the document store at {self.uri}")


def _node_copy(f: Location) -> str:
    """A node-local copy of one remote store file (fetched once per node: keyed by URI, size and time)."""
    import pyarrow.fs as pafs

    info = f.fs.get_file_info(f.path)
    key = hashlib.sha1(repr((f.uri, info.size, info.mtime_ns)).encode()).hexdigest()[:16]
    return node_cached(os.path.join(cache_root(), "docs", f"{key}-{f.name}"), lambda tmp: pafs.copy_files(
        f.path, tmp, source_filesystem=f.fs, destination_filesystem=pafs.LocalFileSystem()))


def open_doc_store(loc: Location, unit: str = "passage") -> DocStore:
    """The store at `loc`; or, where `loc` is a source (an ingest folder, a Parquet folder of id, title, text),
    a store built from it once into the node-local cache (keyed by the source's files, names, sizes and times)."""
    if loc.join(LISTING).exists():
        return DocStore(loc)
    key = hashlib.sha1(repr((loc.uri, unit, content_identity(loc.uri))).encode()).hexdigest()[:16]
    # once per node: the node's other processes that need it wait for the first one's copy
    cached = node_cached(os.path.join(cache_root(), "docstores", key),
                         lambda tmp: write_doc_store(loc, unit, resolve(tmp), parallel=False))
    return DocStore(resolve(cached))
