"""Export the trained knowledge base to FlashRAG, LangChain or LlamaIndex on-disk formats (docs/guide.md): one
view of the run (`view.py`) read per embedding shard in Ray tasks, written by one format module in a task that
declares the index's size; `wbrag_export.json` (view, counts, index settings, embedder, union) is written last."""

from __future__ import annotations

import importlib
import time
from typing import Any

from wbrag_ray import __version__
from wbrag_ray.config import ConfigError, RetrievalConfig, WbragConfig
from wbrag_ray.export import flashrag, langchain, llamaindex
from wbrag_ray.export.embedder import MANIFEST_FILE
from wbrag_ray.export.view import WRITEBACK, open_view
from wbrag_ray.index.files import write_index_file
from wbrag_ray.index.sizing import TASK_BASE_BYTES, node_bounded
from wbrag_ray.index.tasks import largest_node
from wbrag_ray.ray_runtime import LIGHT_CPUS
from wbrag_ray.retrieval.union import UnionRule
from wbrag_ray.run import RunFolder
from wbrag_ray.storage import Location, resolve

FORMATS = {"flashrag": flashrag, "langchain": langchain, "llamaindex": llamaindex}  # each format's writer module


def export_kb(run: RunFolder, config: WbragConfig, format: str, out: str | Location, *,
              prune_ratio: float | None = None, writeback: str | None = None, force: bool = False) -> dict[str, Any]:
    """Write the view in `format` into `out` (local or s3://); returns the manifest. A folder holding anything but an
    earlier export is refused unless `force`."""
    if format not in FORMATS:
        raise ConfigError(f"--format {format!r}: choose one of {', '.join(FORMATS)}")
    _writer(format)  # its library is checked here, before any file is written
    view = open_view(run, config.embedder, prune_ratio, writeback)
    out = resolve(out) if isinstance(out, str) else out
    _clear(out, force)
    t0 = time.perf_counter()
    files, described = _write_in_task(format, view, out.uri, config)
    manifest = {"format": format, "wbrag_version": __version__, **described, "union": union_record(view, config.retrieval),
                "files": files, "seconds": round(time.perf_counter() - t0, 3)}
    out.join(MANIFEST_FILE).write_json(manifest)
    union = manifest.get("union")
    if union and not union["same_as_run"]:
        print(f"note: this export is a score merge ({union['what']}); the run searches write-back version "
              f"{view.version} with union {union['run']['union']!r}, so the export's top K may differ from the run's",
              flush=True)
    return manifest


SCORE_MERGE = ("base passages and write-back units in one index: a search returns the top K of both by score, "
               "the WriteBack-RAG paper's merge (retrieval.union: score)")


def union_record(view, retrieval: RetrievalConfig) -> dict[str, Any] | None:
    """How an export merges passages and units (one index, by score) beside the rule the run uses; None: no units."""
    units = [p for p in view.parts if p.source == WRITEBACK]
    if not units:
        return None
    run_rule = UnionRule.of(retrieval).resolved([units[0].index]).settings()
    return {"export": "score", "what": SCORE_MERGE, "run": run_rule, "same_as_run": run_rule["union"] == "score"}


def _write(format: str, view, out_uri: str, config: WbragConfig) -> tuple[list[str], dict[str, Any]]:
    """The format's files of `view` in `out_uri`, its index last: (their names, the view described once read)."""
    writer, out = _writer(format), resolve(out_uri)
    index = view.empty_index(config.index)
    files = writer.write(view, view.fill(index), out, config)
    write_index_file(index, out.join(writer.INDEX_FILE))
    return [*files, writer.INDEX_FILE], view.describe(config.embedder)


def _write_in_task(format: str, view, out_uri: str, config: WbragConfig) -> tuple[list[str], dict[str, Any]]:
    """`_write` in a Ray task that declares the index's size when Ray is up; in this process otherwise."""
    import ray

    if not ray.is_initialized():
        return _write(format, view, out_uri, config)

    memory = node_bounded(view.index_bytes() + TASK_BASE_BYTES, largest_node(True))
    return ray.get(ray.remote(num_cpus=LIGHT_CPUS, memory=memory, max_retries=1)(_write).remote(
        format, view, out_uri, config))


def _writer(format: str):
    """The format's module, after checking that its library is installed (before any file is written)."""
    module = FORMATS[format]
    try:
        for name in getattr(module, "NEEDS", ()):
            importlib.import_module(name)
    except ImportError as exc:
        raise ConfigError(f"--format {format} needs {module.PACKAGES} ({exc}); pip install 'wbrag-ray[export]'") from None
    return module


def _clear(out: Location, force: bool) -> None:
    """Remove an earlier export's files (manifest first); refuse a folder holding anything else unless `force`."""
    if out.is_file():
        raise ConfigError(f"--out {out.uri} is a file; give a folder")
    previous = out.join(MANIFEST_FILE)
    if previous.exists():
        files = previous.read_json().get("files", [])
        previous.delete()
        for name in files:
            out.join(name).delete()
    others = [f.name for f in out.list_files()]
    if others and not force:
        raise ConfigError(f"--out {out.uri} is not empty ({', '.join(others[:3])}{', ...' if len(others) > 3 else ''}); "
                          "give an empty or new folder, or pass --force to write into it")
    out.mkdir()
