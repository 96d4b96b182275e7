"""What an export holds: one view of a run's knowledge base (base or pruned base, plus a write-back version's
units), read one embedding shard per Ray task as (codes, documents), filling one FAISS index in order (row i =
document i). Documents are found by id range; a missing one is an error except in a pruned level."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from wbrag_ray.build_kb import INDEX
from wbrag_ray.config import ConfigError, EmbedderConfig, IndexConfig
from wbrag_ray.export.embedder import embedder_info
from wbrag_ray.index.files import (
    TRAINED_FILE,
    IndexError_,
    embedding_files,
    from_bytes,
    load_manifest,
    read_embedding_shard,
    to_bytes,
)
from wbrag_ray.index.parts import add_codes, codes_index
from wbrag_ray.index.search import measured_settings, search_nprobe, set_search_params
from wbrag_ray.ray_runtime import LIGHT_CPUS, shared_value
from wbrag_ray.run import RunFolder
from wbrag_ray.storage import Location, resolve
from wbrag_ray.writeback.versions import active_index, read_active

BASE, WRITEBACK = "base", "writeback"  # the id namespaces, as `Hit.source` names them

# Every document carries the same metadata keys, so a reader inferring one schema sees one.
METADATA_KEYS = ("source", "wbrag_id", "unit", "title", "doc_id", "passage_id", "version", "source_doc_ids",
                 "source_example_id")


@dataclass(frozen=True)
class Document:
    """One exported document: a unique `id` and FlashRAG's "title\\ntext" `contents`."""

    id: str
    title: str
    text: str
    metadata: dict[str, Any]

    @property
    def contents(self) -> str:
        return f"{self.title}\n{self.text}"


@dataclass(frozen=True)
class Part:
    """One index of the view: where its vectors, its documents and (for sentences) their passages' titles are."""

    source: str  # BASE or WRITEBACK
    unit: str  # passage, sentence or writeback: what the index holds
    index: Location  # the index folder the run searches for this part (its manifest holds the expected count)
    embeddings: Location
    docs: Location
    titles: Location | None = None  # the passages, when the documents are sentences
    pruned: bool = False  # ids missing from `docs` were pruned

    @property
    def id_column(self) -> str:
        return {"passage": "pid", "sentence": "sid"}.get(self.unit, "id")


@dataclass
class View:
    """The parts an export holds, in order, and the base index's manifest they share."""

    run: RunFolder
    parts: list[Part]
    manifest: dict[str, Any]  # the base part's index manifest
    prune_ratio: float | None = None
    version: str | None = None
    counts: dict[str, int] = field(default_factory=dict)  # documents read so far, per source

    @property
    def dim(self) -> int:
        return int(self.manifest["dim"])

    def index_bytes(self) -> int:
        """About the size of the export's index, from the index files the run searches."""
        return sum(s["bytes"] for p in self.parts for s in load_manifest(p.index)["shards"])

    def fill(self, index) -> Iterator[list[Document]]:
        """Fill `index` with every part's vectors in order and yield each shard's documents as added; counts are
        checked against the manifests. With Ray and a codes index the shards encode in Ray tasks (`EXPORT_IN_FLIGHT`)."""
        self.counts = {}
        inner = codes_index(index)
        trained = self.empty_index_bytes if inner is not None else None
        for part in self.parts:
            n = 0
            for payload, docs in self._part_batches(part, trained):
                if trained is None:
                    index.add(payload)
                else:
                    add_codes(index, inner, payload)
                n += len(docs)
                yield docs
            expected = load_manifest(part.index)["count"]
            if n != expected:
                raise IndexError_(f"the export read {n} {part.source} documents, but the index {part.index.uri} "
                                  f"holds {expected}")
            self.counts[part.source] = n

    def _part_batches(self, part: Part, trained: bytes | None) -> Iterator[tuple[np.ndarray, list[Document]]]:
        """(vectors or codes, documents) of each embedding shard of `part`, in order (codes in Ray tasks when Ray is
        up, counted in `shards_in_tasks`)."""
        import ray

        readers = _Readers.of(part)
        files = [f.uri for f in embedding_files(part.embeddings)]
        if trained is None or not ray.is_initialized():
            for uri in files:
                found = _shard_batch(readers, None, uri)
                if found is not None:
                    yield found if trained is None else (encoder(trained)(found[0]), found[1])
            return
        task = ray.remote(num_cpus=LIGHT_CPUS + 0.75, max_retries=2)(_shard_batch)
        shared = (ray.put(readers), ray.put(np.frombuffer(trained, np.uint8)))
        pending = [task.remote(*shared, uri) for uri in files[:EXPORT_IN_FLIGHT]]
        for i in range(len(files)):
            found = ray.get(pending[i])
            self.shards_in_tasks += 1
            pending[i] = None  # its result is the writer's now: released from the object store as it is written
            if i + EXPORT_IN_FLIGHT < len(files):
                pending.append(task.remote(*shared, files[i + EXPORT_IN_FLIGHT]))
            if found is not None:
                yield found

    empty_index_bytes: bytes | None = None  # the trained empty index, serialized: what encoding tasks rebuild
    shards_in_tasks: int = 0  # embedding shards read and encoded by Ray tasks (the rest: in this process)
    search: dict[str, Any] = field(default_factory=dict)  # the exported index's settings, set by `empty_index`

    def empty_index(self, ic: IndexConfig):
        """A copy of the base's trained empty index without id map, with the run's search settings set ('auto'
        taking what the base index's build measured)."""
        import faiss

        base = self.parts[0].index
        trained = base.join(self.manifest.get("trained", TRAINED_FILE))
        if not trained.exists():
            raise IndexError_(f"trained index {trained.uri} named by the manifest of {base.uri} is missing; "
                              "rebuild the index with `wbrag index RUN --force`")
        index = from_bytes(trained.read_bytes(), trained.uri)
        if isinstance(index, faiss.IndexIDMap):  # IndexIDMap2 too: it derives from IndexIDMap
            index = faiss.clone_index(faiss.downcast_index(index.index))  # a copy this proxy owns
        if index.ntotal:
            raise IndexError_(f"trained index {trained.uri} is not empty ({index.ntotal} vectors)")
        nprobe, ef_search = measured_settings(self.manifest, ic.nprobe, ic.ef_search)
        set_search_params(index, nprobe, ef_search, ic.k_factor)
        self.search = {"factory": self.manifest.get("factory"), "metric": "inner_product",
                       "nprobe": search_nprobe(index, nprobe), "ef_search": ef_search, "k_factor": ic.k_factor}
        self.empty_index_bytes = to_bytes(index)
        return index

    def describe(self, embedder: EmbedderConfig) -> dict[str, Any]:
        """The view and its embedder, for the export's manifest (after `empty_index`)."""
        return {
            "run": self.run.uri,
            "prune_ratio": self.prune_ratio,
            "writeback_version": self.version,
            "counts": dict(self.counts),
            "count": sum(self.counts.values()),
            "shards_in_tasks": self.shards_in_tasks,
            "indices": {p.source: p.index.uri for p in self.parts},
            "embedder": embedder_info(embedder, self.dim),
            "index": self.search,
        }


def open_view(run: RunFolder, embedder: EmbedderConfig, prune_ratio: float | None = None,
              writeback: str | None = None) -> View:
    """The base (or pruned) index plus the units of `writeback` ('active', 'none' or a version)."""
    from wbrag_ray.zerorag.prune import index_for_ratio

    run.require(INDEX)
    layout = run.layout
    ratio = prune_ratio or 0.0
    index = index_for_ratio(run, ratio)  # a ratio not pruned yet is refused with the command that prunes it
    manifest = load_manifest(index)
    if manifest["embedder"] != embedder.model:
        raise ConfigError(f"index {index.uri} was built with embedder {manifest['embedder']!r}, but embedder.model is "
                          f"{embedder.model!r}; export with the run's config (drop --config / --set embedder.*)")
    unit = manifest.get("unit", "passage")
    if ratio:
        if unit != "sentence":
            raise ConfigError(f"the index of {run.uri} holds {unit}s; Zero-RAG prunes sentences (index.unit=sentence)")
        level = layout.zero_rag.pruned(ratio)
        base = Part(BASE, unit, index, layout.embed, level.sentences, layout.ingest.passages, pruned=True)
    else:
        docs, _ = layout.ingest.units(unit)
        base = Part(BASE, unit, index, layout.embed, docs, layout.ingest.passages if unit == "sentence" else None)
    parts = [base]
    version = _writeback_version(run, writeback)
    if version:
        folder = layout.writeback_version(version)
        wb_manifest = load_manifest(folder.index)
        for key in ("embedder", "dim"):
            if wb_manifest.get(key) != manifest.get(key):
                raise IndexError_(f"write-back index {folder.index.uri} differs from {index.uri} in {key} "
                                  f"({wb_manifest.get(key)!r} vs {manifest.get(key)!r}): one export cannot hold both")
        parts.append(Part(WRITEBACK, WRITEBACK, folder.index, folder.embed, folder.units))
    return View(run, parts, manifest, prune_ratio=ratio or None, version=version)


def _writeback_version(run: RunFolder, writeback: str | None) -> str | None:
    if writeback == "none":
        return None
    if writeback is None:  # by default what the run searches: the active version, when there is one
        return read_active(run)["version"]
    version, _index, _corpus = active_index(run, None if writeback == "active" else writeback)
    return version


# --- documents by id ----------------------------------------------------------------------------------------


class RowsById:
    """Rows of a Parquet folder by id, reading only files and row groups whose id range overlaps the batch."""

    def __init__(self, folder: Location, id_column: str, columns: list[str]):
        self.id_column, self.columns = id_column, columns
        files = folder.list_files(".parquet")
        if not files:
            raise IndexError_(f"no documents at {folder.uri}")
        with ThreadPoolExecutor(min(32, len(files))) as pool:  # one footer per file: round trips, in parallel
            ranges = list(pool.map(lambda f: _id_range(f, id_column), files))
        self.files = [(f, *r) for f, r in zip(files, ranges, strict=True)]

    def take(self, ids: np.ndarray) -> tuple[np.ndarray, pa.Table]:
        """(positions in `ids` that have a row, their rows in that order)."""
        lo, hi = int(ids.min()), int(ids.max())
        col = self.id_column
        tables = [pq.read_table(f.path, filesystem=f.fs, columns=self.columns, filters=[(col, ">=", lo), (col, "<=", hi)])
                  for f, f_lo, f_hi in self.files if f_lo <= hi and f_hi >= lo]
        if not tables:
            return np.zeros(0, np.int64), pa.table({c: [] for c in self.columns})
        table = pa.concat_tables(tables)
        where = pc.index_in(pa.array(ids, pa.int64()), value_set=table[col].combine_chunks())
        found = pc.is_valid(where)
        positions = np.flatnonzero(found.to_numpy(zero_copy_only=False))
        return positions, table.take(where.filter(found))


def _id_range(f: Location, column: str) -> tuple[int, int]:
    """The id range of one Parquet file from its footer's statistics (the whole int64 range without them)."""
    lo, hi = np.iinfo(np.int64).max, np.iinfo(np.int64).min
    meta = pq.ParquetFile(f.path, filesystem=f.fs).metadata
    names = [meta.schema.column(i).name for i in range(meta.num_columns)]
    if column not in names:
        raise IndexError_(f"{f.uri} has no column {column!r} (columns: {names})")
    j = names.index(column)
    for g in range(meta.num_row_groups):
        stats = meta.row_group(g).column(j).statistics
        if stats is None or not stats.has_min_max:
            return np.iinfo(np.int64).min, np.iinfo(np.int64).max
        lo, hi = min(lo, stats.min), max(hi, stats.max)
    return int(lo), int(hi)


EXPORT_IN_FLIGHT = 8  # encoding tasks ahead of the writer: enough to keep a cluster's CPUs busy, and bounded:
# each holds one shard's codes and documents until its turn


def encoder(trained: bytes):
    """The trained empty index's standalone encoder: vectors -> the codes `index.parts.add_codes` appends."""
    index = from_bytes(trained, TRAINED_FILE)
    return lambda vectors: index.sa_encode(np.ascontiguousarray(vectors, dtype=np.float32))


@dataclass(frozen=True)
class _Readers:
    """A shard task's inputs: the part and its documents' files with their id ranges, read once here."""

    part: Part
    docs: RowsById
    titles: RowsById | None

    @classmethod
    def of(cls, part: Part) -> _Readers:
        columns = {"passage": ["pid", "doc_id", "title", "text"], "sentence": ["sid", "pid", "text"],
                   WRITEBACK: ["id", "unit_id", "title", "text", "version", "source_example_id",
                               "source_doc_ids"]}[part.unit]
        titles = RowsById(part.titles, "pid", ["pid", "doc_id", "title"]) if part.titles else None
        return cls(part, RowsById(part.docs, part.id_column, columns), titles)


def _shard_batch(readers: _Readers, trained, uri: str) -> tuple[np.ndarray, list[Document]] | None:
    """One embedding shard's vectors (or codes) and documents in order; None when it holds none of the view."""
    f = resolve(uri)
    part = readers.part
    ids, vectors = read_embedding_shard(f)
    if not len(ids):
        return None
    positions, rows = readers.docs.take(ids)
    if len(positions) < len(ids) and not part.pruned:
        missing = np.setdiff1d(ids, ids[positions])
        raise IndexError_(f"{len(missing)} ids of embedding shard {f.uri} have no document in {part.docs.uri} "
                          f"(e.g. {int(missing[0])})")
    if not len(positions):
        return None
    vectors = vectors[positions]
    if trained is not None:
        vectors = encoder(shared_value(trained).tobytes())(vectors)
    return vectors, _documents(part, rows.to_pylist(), readers.titles)


def _documents(part: Part, rows: list[dict[str, Any]], titles: RowsById | None) -> list[Document]:
    if part.unit == "passage":
        return [_doc(str(r["pid"]), r["title"], r["text"], source=BASE, wbrag_id=r["pid"], unit="passage",
                     doc_id=r["doc_id"], passage_id=r["pid"]) for r in rows]
    if part.unit == "sentence":
        pids = np.unique(np.array([r["pid"] for r in rows], np.int64))
        _pos, passages = titles.take(pids) if len(pids) else (None, pa.table({"pid": [], "doc_id": [], "title": []}))
        by_pid = {p["pid"]: p for p in passages.to_pylist()}
        out = []
        for r in rows:
            passage = by_pid.get(r["pid"])
            if passage is None:
                raise IndexError_(f"sentence {r['sid']} names passage {r['pid']}, which is not in {part.titles.uri}")
            out.append(_doc(str(r["sid"]), passage["title"], r["text"], source=BASE, wbrag_id=r["sid"],
                            unit="sentence", doc_id=passage["doc_id"], passage_id=r["pid"]))
        return out
    return [_doc(r["unit_id"], r["title"], r["text"], source=WRITEBACK, wbrag_id=r["id"], unit=WRITEBACK,
                 version=r["version"], source_doc_ids=list(r["source_doc_ids"] or []),
                 source_example_id=r["source_example_id"]) for r in rows]


def _doc(key: str, title: str | None, text: str | None, /, **metadata: Any) -> Document:
    title, text = title or "", text or ""
    meta = dict.fromkeys(METADATA_KEYS)
    meta.update(metadata, title=title)
    return Document(key, title, text, meta)
