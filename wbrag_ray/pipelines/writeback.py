"""WriteBack-RAG training, top to bottom: a labeled QA set -> a versioned write-back index beside the base.

    answer closed-book (s_nr) and by writeback.rag_method (s_rag: naive / replug retrieve the top K and answer
    in one pass with s_nr; self-rag / flare decide per example what to retrieve, in their own passes)
      -> utility gate (an example whose method retrieved nothing has nothing to write back)
      -> document gate over the documents the method answered from (one call per document of a kept
         example; none for replug, whose per-document answers are s_j)
      -> distiller: extract (1 call per kept example) -> rewrite (1 call) -> knowledge units
      -> embed with the base embedder -> dedupe -> write-back corpus + index -> Table 3 stats

Layout of one version (the base index is only read, never written):
    RUN/writeback/<version>/scored.parquet     per example: answers, scores, gate decisions
    RUN/writeback/<version>/distill.parquet    every prompt sent to the distiller and its output
    RUN/writeback/<version>/corpus/            the write-back corpus: units with provenance
    RUN/writeback/<version>/embed/, index/     its embeddings and FAISS index (unit "writeback")
    RUN/writeback/<version>/stats.json         Table 3, generator calls and seconds per pass
    RUN/writeback/ACTIVE                       the version searched beside the base, and its history

Every model pass is one Ray Data pass over an actor pool; between passes the driver holds only per-example
rows (answers and decisions), because a gate needs every answer of its example at once.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from wbrag_ray.config import ConfigError, WbragConfig
from wbrag_ray.pipelines.passes import GeneratorPasses, from_pandas
from wbrag_ray.run import RunFolder
from wbrag_ray.storage import resolve

# Write-back ids live in their own namespace: far above any base pid / sid, and named by Hit.source.
WRITEBACK_ID_BASE = 1 << 62
ACTIVE = "ACTIVE"

UNITS = pa.schema(
    [
        ("id", pa.int64()),
        ("unit_id", pa.string()),
        ("title", pa.string()),
        ("text", pa.string()),
        ("version", pa.string()),
        ("source_example_id", pa.string()),
        ("question", pa.string()),
        ("source_doc_ids", pa.list_(pa.int64())),
        ("source_doc_ranks", pa.list_(pa.int32())),
        ("fallback", pa.bool_()),
        ("source_tokens", pa.int64()),
        ("distilled_tokens", pa.int64()),
        ("merged_from", pa.list_(pa.string())),
    ]
)


def default_version(config: WbragConfig, train: str) -> str:
    """The version name: writeback.version, else the training file's stem (a rerun finds its own stage)."""
    return config.writeback.version or Path(train.rstrip("/")).name.split(".")[0]


# --- training -------------------------------------------------------------------------------------------


def score_examples(run: RunFolder, config: WbragConfig, train: str, passes: GeneratorPasses) -> pd.DataFrame:
    """Answer without and with retrieval by writeback.rag_method, and apply both gates.

    The documents an example is distilled from are the ones its method answered from: the top K for naive
    and RePlug, the ones judged relevant for Self-RAG, the ones retrieved for its unsure sentences for FLARE.
    An example whose method retrieved nothing has nothing to write back and is not kept."""
    from wbrag_ray import rag
    from wbrag_ray.formats import read_dataset
    from wbrag_ray.index.retriever import RetrievalSetting
    from wbrag_ray.ray_runtime import LIGHT_CPUS
    from wbrag_ray.stages.base import run_local
    from wbrag_ray.stages.writeback import DocumentGateStage, UtilityGateStage

    wb = config.writeback
    questions, rejects = read_dataset(resolve(train), limit=wb.limit)
    if questions.num_rows == 0:
        raise ConfigError(f"writeback.train {train} has no usable examples ({rejects.num_rows} rejected)")
    search = RetrievalSetting(
        run.path("index").uri, run.path("ingest").uri, config.embedder, config.retrieval, config.index.nprobe
    )
    answered = rag.answer(questions, ["no-retrieval", wb.rag_method], config, search, passes, "answer")

    nr = answered[answered["method"] == "no-retrieval"].set_index("id")
    examples = answered[answered["method"] == wb.rag_method].set_index("id")
    examples = examples[["question", "golden_answers", "docs"]].assign(
        nr_answer=nr["answer"], rag_answer=examples["answer"], rag_slot_answers=examples["slot_answers"],
        rag_trace=examples["trace"],
    ).reset_index()
    # The fan-in already brought every answer to the driver; scoring is microseconds a row, so the gates
    # run here, in-process, rather than as another actor pool.
    examples = run_local(UtilityGateStage(wb), examples)
    examples["useful"] = examples["useful"] & (examples["docs"] != "[]")

    useful = examples[examples["useful"]].copy()
    if wb.rag_method == "replug":
        useful["doc_answers"] = useful["rag_slot_answers"]  # RePlug already answered from each document alone
    elif len(useful):
        per_doc = from_pandas(useful[["id", "question", "docs"]]).map_batches(
            rag.expand, fn_kwargs={"methods": ["replug"]}, batch_format="pandas", num_cpus=LIGHT_CPUS
        )
        per_doc = rag.combine(passes.generate("document_gate", per_doc, "prompt", "answer"), "answer")
        useful["doc_answers"] = useful["id"].map(per_doc.set_index("id")["slot_answers"])
    if len(useful):
        useful = run_local(DocumentGateStage(wb), useful)
        examples = examples.merge(
            useful[["id", "doc_answers", "doc_scores", "kept_ranks", "fallback"]], how="left", on="id"
        )
    else:
        examples = examples.assign(doc_answers=None, doc_scores=None, kept_ranks=None, fallback=None)
    examples["rejected_questions"] = rejects.num_rows
    return examples


def distill(config: WbragConfig, kept: pd.DataFrame, passes: GeneratorPasses) -> pd.DataFrame:
    """The distiller's two steps over the kept examples; the frame passed on holds no gold answers."""
    from wbrag_ray.stages.base import apply_stage
    from wbrag_ray.stages.writeback import DistillExtractStage, DistillRewriteStage

    wb = config.writeback
    # Only these columns travel to the distiller: the gold answers stay behind in the driver.
    ds = apply_stage(from_pandas(kept[["id", "question", "docs", "kept_ranks"]]), DistillExtractStage())
    step1 = passes.generate("distill_extract", ds, "extract_prompt", "extracted", wb.extract_max_new_tokens,
                            multiline=True)
    ds = apply_stage(from_pandas(step1), DistillRewriteStage())
    return passes.generate("distill_rewrite", ds, "rewrite_prompt", "rewritten", wb.rewrite_max_new_tokens,
                           multiline=True)


def build_units(version: str, kept: pd.DataFrame, distilled: pd.DataFrame) -> tuple[pd.DataFrame, int]:
    """Knowledge units with provenance, in example order; returns (units, examples that produced nothing)."""
    from wbrag_ray.stages.writeback import kept_hits, parse_unit, word_count

    out = distilled.set_index("id")
    rows, empty = [], 0
    for ex in kept.sort_values("id").itertuples(index=False):
        hits = kept_hits(ex.docs, ex.kept_ranks)
        unit = parse_unit(out.at[ex.id, "rewritten"], out.at[ex.id, "extracted_verbatim"], hits[0].title if hits else "")
        if unit is None:
            empty += 1
            continue
        title, text = unit
        n = len(rows)
        rows.append(
            {
                "id": WRITEBACK_ID_BASE + n,
                "unit_id": f"wb:{version}:{n}",
                "title": title,
                "text": text,
                "version": version,
                "source_example_id": str(ex.id),
                "question": ex.question,
                "source_doc_ids": [h.id for h in hits],
                "source_doc_ranks": [h.rank for h in hits],
                "fallback": bool(ex.fallback),
                "source_tokens": sum(word_count(h.title) + word_count(h.text) for h in hits),
                "distilled_tokens": word_count(title) + word_count(text),
                "merged_from": [],
            }
        )
    return pd.DataFrame(rows, columns=UNITS.names), empty


def embed_units(config: WbragConfig, units: pd.DataFrame) -> np.ndarray:
    """Unit vectors from the base embedder, as the base passages are embedded ('Title\\ntext'), in unit order."""
    import ray

    from wbrag_ray.index.faiss_index import vectors_of
    from wbrag_ray.pipelines.build_kb import _unit_text
    from wbrag_ray.stages.base import apply_stage
    from wbrag_ray.stages.embed import EmbedStage

    ds = from_pandas(_unit_text(units[["id", "title", "text"]], id_col="id"))
    table = pa.concat_tables(ray.get(apply_stage(ds, EmbedStage(config.embedder)).to_arrow_refs())).sort_by("id")
    return vectors_of(table)


def train_writeback(
    run: RunFolder, config: WbragConfig, train: str | None = None, version: str | None = None, force: bool = False
) -> dict[str, Any]:
    """Train one write-back index version from a labeled QA set; activate it when writeback.activate."""
    from wbrag_ray.formats import embeddings_table
    from wbrag_ray.index.faiss_index import build_index
    from wbrag_ray.stages.writeback import dedupe, table3

    train = train or config.writeback.train
    if not train:
        raise ConfigError("no training set: pass --train PATH or set writeback.train")
    if not run.is_complete("index"):
        raise ConfigError(f"write-back training retrieves from the base index of {run.uri}; run `wbrag index RUN` first")
    version = version or default_version(config, train)
    if not version.replace("-", "").replace("_", "").replace(".", "").isalnum() or version in ("base", ACTIVE):
        raise ConfigError(f"writeback.version {version!r}: use letters, digits, '-', '_' or '.' (not 'base')")
    wb = config.writeback
    stage = f"writeback-{version}"
    settings = {"train": train, **wb.model_dump(mode="json", exclude={"train", "version", "activate", "evaluate"}),
                "top_k": config.retrieval.top_k, "generator": config.generator.model, "embedder": config.embedder.model}
    if wb.rag_method in ("self-rag", "flare"):  # the adaptive method's own thresholds decide what is written back
        settings["rag"] = config.rag.model_dump(mode="json")[wb.rag_method.replace("-", "_")]
    run.check_settings(stage, settings, force,
                       fix="pick another --version (writeback.version) or pass --force to retrain it")
    root = run.path("writeback", version)

    def work() -> dict[str, Any]:
        root.delete()
        t0 = time.perf_counter()
        # The passes' services (the generator's and the index's actors) end before the units are embedded.
        with GeneratorPasses(config.generator) as passes:
            examples = score_examples(run, config, train, passes)
            root.join("scored.parquet").write_table(_arrow(examples))
            kept = examples[examples["useful"]]
            units, empty = pd.DataFrame(columns=UNITS.names), 0
            if len(kept):
                distilled = distill(config, kept, passes)
                root.join("distill.parquet").write_table(_arrow(distilled))
                units, empty = build_units(version, kept, distilled)
        merged: dict[int, int] = {}
        if len(units):
            vectors = embed_units(config, units)
            merged = dedupe(vectors, wb.dedupe_threshold)
            for dup, keep in merged.items():  # merge: the kept unit also cites the duplicate's example
                units.at[keep, "merged_from"] = [*units.at[keep, "merged_from"], units.at[dup, "source_example_id"]]
            keep_rows = [i for i in range(len(units)) if i not in merged]
            units, vectors = units.iloc[keep_rows].reset_index(drop=True), vectors[keep_rows]
            root.join("corpus", "units.parquet").write_table(pa.Table.from_pandas(units, UNITS, preserve_index=False))
            root.join("embed", "emb-000000.parquet").write_table(
                embeddings_table(units["id"].to_numpy(np.int64), vectors)
            )
            build_index(
                root.join("embed"), root.join("index"), wb.index_factory, config.embedder.model, "writeback",
                docs=root.join("corpus").uri,  # the manifest names its documents: the index folder is self-contained
            )
        stats = {
            "version": version,
            **table3(examples, units, config.retrieval.top_k),
            "units_written": len(units),
            "duplicates_merged": len(merged),
            "empty_units": empty,
            "rejected_examples": int(examples["rejected_questions"].iloc[0]),
            "passes": passes.stats,
            "generator_calls": sum(p["generator_calls"] for p in passes.stats.values()),
            "train_seconds": round(time.perf_counter() - t0, 2),
            "settings": settings,
        }
        root.join("stats.json").write_json(stats)
        return {"rows_in": len(examples), "rows_out": len(units), **stats}

    stats = run.run_stage(stage, work, force=force)
    print(format_table3(stats), flush=True)
    if wb.activate and stats.get("units_written"):
        activate(run, version)
    return stats


def _arrow(df: pd.DataFrame) -> pa.Table:
    # No pandas metadata: readers with another pandas version (or none) get plain Arrow types.
    return pa.Table.from_pandas(df, preserve_index=False).replace_schema_metadata(None)


def format_table3(stats: dict[str, Any]) -> str:
    ranks = " ".join(f"{r}:{c}" for r, c in stats.get("rank_distribution", {}).items())
    rows = [
        ("examples", stats.get("examples")),
        ("selection rate", stats.get("selection_rate")),
        ("mean retained docs", stats.get("mean_retained_docs")),
        ("fallback rate", stats.get("fallback_rate")),
        ("source tokens", stats.get("source_tokens")),
        ("distilled tokens", stats.get("distilled_tokens")),
        ("compression ratio", stats.get("compression_ratio")),
        ("units written", stats.get("units_written")),
        ("duplicates merged", stats.get("duplicates_merged")),
        ("retained ranks", ranks),
        ("generator calls", stats.get("generator_calls")),
    ]
    return "\n".join([f"write-back {stats.get('version')} (Table 3)"] + [f"  {k:<20}{v}" for k, v in rows])


# --- the active write-back index: replace and roll back -------------------------------------------------


def _active_loc(run: RunFolder):
    return run.path("writeback", ACTIVE)


def read_active(run: RunFolder) -> dict[str, Any]:
    """{"version": active version or None, "history": earlier active versions, oldest first}."""
    loc = _active_loc(run)
    return loc.read_json() if loc.exists() else {"version": None, "history": []}


def versions(run: RunFolder) -> list[str]:
    """Trained write-back versions (complete, with an index), by name."""
    return [s.removeprefix("writeback-") for s in run.completed_stages() if s.startswith("writeback-")
            and run.path("writeback", s.removeprefix("writeback-"), "index").exists()]


def trained_method(run: RunFolder, version: str) -> str:
    """The RAG method a write-back version was trained (scored and written back) with."""
    stats = run.path("writeback", version, "stats.json")
    return (stats.read_json().get("settings") or {}).get("rag_method", "naive") if stats.exists() else "naive"


def activate(run: RunFolder, version: str) -> dict[str, Any]:
    """Make `version` the write-back index searched beside the base (replace); the base index is untouched."""
    if version not in versions(run):
        known = ", ".join(versions(run)) or "none"
        raise ConfigError(f"write-back version {version!r} of {run.uri} is not trained (trained: {known})")
    state = read_active(run)
    if state["version"] != version:
        history = [*state["history"], state["version"]] if state["version"] else state["history"]
        state = {"version": version, "history": history}
        _active_loc(run).write_json(state)  # one small file, written atomically: the switch is one rename
    print(f"write-back index active: {version}", flush=True)
    return state


def rollback(run: RunFolder, version: str | None = None) -> dict[str, Any]:
    """Go back to the previously active version (or `version`); 'base' (or no earlier one) = base index only.

    Going to 'base' remembers the version it leaves, so a later plain rollback can return to it."""
    state = read_active(run)
    if version and version != "base":
        return activate(run, version)
    history = list(state["history"])
    if version == "base":
        previous = None
        history += [state["version"]] if state["version"] else []
    else:
        previous = history.pop() if history else None
    if previous is not None and previous not in versions(run):
        raise ConfigError(f"previous write-back version {previous!r} is gone; roll back to a named version or 'base'")
    state = {"version": previous, "history": history}
    _active_loc(run).write_json(state)
    print(f"write-back index active: {previous or 'none (base index only)'}", flush=True)
    return state


def active_index(run: RunFolder, version: str | None = None) -> tuple[str, str, str]:
    """(version, index folder, corpus folder) of the active write-back index (or of `version`), for a union
    search."""
    if version is not None and version not in versions(run):
        known = ", ".join(versions(run)) or "none"
        raise ConfigError(f"write-back version {version!r} of {run.uri} is not trained (trained: {known})")
    version = version or read_active(run)["version"]
    if not version:
        raise ConfigError(
            f"run {run.uri} has no active write-back index; train one with `wbrag writeback RUN --train PATH` "
            "or activate one with `wbrag writeback RUN --activate VERSION`"
        )
    root = run.path("writeback", version)
    return version, root.join("index").uri, root.join("corpus").uri
