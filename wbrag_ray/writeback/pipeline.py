"""WriteBack-RAG training, top to bottom: a labeled QA set -> a versioned write-back index beside the base.
Closed-book and RAG answers -> utility gate -> document gate -> distiller (extract, rewrite) -> units -> embed,
dedupe, index -> Table 3. Every model pass runs on the generator service; the base index is never written."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import pyarrow as pa

from wbrag_ray import prompts, rag
from wbrag_ray.config import ConfigError, IndexConfig, WbragConfig, WritebackConfig
from wbrag_ray.evaluation.stage import union_settings
from wbrag_ray.formats import dataset_name, embeddings_table, input_params, plain_table, read_questions
from wbrag_ray.generation.passes import GeneratorPasses
from wbrag_ray.index.build import build_index
from wbrag_ray.index.files import load_manifest
from wbrag_ray.layout import WritebackVersion, plain_name
from wbrag_ray.metrics import sign_test
from wbrag_ray.papers import WRITEBACK as PAPER
from wbrag_ray.papers import gate_metric, print_departures
from wbrag_ray.retrieval.docstore import write_doc_store
from wbrag_ray.retrieval.stage import RetrievalSetting
from wbrag_ray.retrieval.union import FALLBACK_UNION, write_provenance
from wbrag_ray.run import RunFolder
from wbrag_ray.work import Generate, Pass, Sizes
from wbrag_ray.writeback.distill import UNITS, build_units, dedupe, distill, embed_units, table3
from wbrag_ray.writeback.gates import document_scores, gate_examples
from wbrag_ray.writeback.validation import split, validate
from wbrag_ray.writeback.versions import WRITEBACK, activate, default_version, hurts

if TYPE_CHECKING:
    from wbrag_ray.stages.service import Services


def with_gate_metric(wb: WritebackConfig, train: str) -> WritebackConfig:
    """The write-back settings with `metric: auto` resolved to the paper's metric for the training set."""
    if wb.metric != "auto":
        return wb
    return wb.model_copy(update={"metric": gate_metric(dataset_name(train))})


def base_search(run: RunFolder, config: WbragConfig) -> RetrievalSetting:
    """What write-back searches: the run's base index, with the base embedder."""
    return RetrievalSetting(run.layout.index.uri, None, config.embedder, config.retrieval, config.index)


def score_examples(run: RunFolder, config: WbragConfig, train: str, passes: GeneratorPasses,
                   search: RetrievalSetting) -> pd.DataFrame:
    """Answer without and with retrieval by writeback.rag_method, and apply both gates."""
    wb = with_gate_metric(config.writeback, train)
    questions, rejects = read_questions(train, "writeback.train", limit=wb.limit)
    # the held-out questions validate the version instead
    questions = split(questions, wb.validation_fraction(questions.num_rows))[0]
    answered = rag.answer(questions, ["no-retrieval", wb.rag_method], config, search, passes, "answer")

    examples = gate_examples(answered, wb.rag_method, wb)

    useful = examples[examples["useful"]].copy()
    if wb.rag_method == "replug-vote":
        useful["doc_answers"] = useful["rag_slot_answers"]  # the vote already answered from each document alone
    elif len(useful):  # each document alone, answered on its own (RePlug's mixture decodes them together)
        per_doc = rag.expand(useful[["id", "question", "docs"]], ["replug-vote"])
        per_doc = rag.combine(passes.generate("document_gate", per_doc, "prompt", "answer"), "answer")
        useful["doc_answers"] = useful["id"].map(per_doc.set_index("id")["slot_answers"])
    if len(useful):
        useful = document_scores(useful, wb)
        examples = examples.merge(
            useful[["id", "doc_answers", "doc_scores", "kept_ranks", "fallback"]], how="left", on="id"
        )
    else:
        examples = examples.assign(doc_answers=None, doc_scores=None, kept_ranks=None, fallback=None)
    examples["rejected_questions"] = rejects.num_rows
    return examples


def train_writeback(
    run: RunFolder, config: WbragConfig, train: str | None = None, version: str | None = None, force: bool = False,
    services: Services | None = None,
) -> dict[str, Any]:
    """Train one write-back version from a labeled QA set, validate it on the held-out part, and activate it when
    writeback.activate and it does not hurt; the stats hold 'validation' and 'activated'."""
    train = train or config.writeback.train
    if not train:
        raise ConfigError("no training set: pass --train PATH or set writeback.train")
    version = version or default_version(config, train)
    plain_name(version, "writeback.version", reserved=("base", "ACTIVE"))
    print_departures(config, PAPER, train)
    method = config.writeback.rag_method
    # the adaptive method's own thresholds decide what is written back
    params = {"version": version, **input_params(train, "writeback.train"),
              "method": method.replace("-", "_") if method in ("self-rag", "flare") else None}
    stats = run.execute(WRITEBACK, config, lambda: _train(run, config, train, params, services), params=params, force=force)
    print(format_table3(stats), flush=True)
    validation = validate(run, config, train, version, with_gate_metric(config.writeback, train).metric, force,
                          services)
    why = hurts(validation) if isinstance(validation, dict) else None
    activated = False
    if config.writeback.activate and stats.get("units_written"):
        if why:
            print(f"write-back {version} is not activated: on its validation questions it hurts ({why}); "
                  f"`wbrag writeback RUN --activate {version}` activates it anyway", flush=True)
        else:
            activate(run, version)
            activated = True
    record = {**validation, "hurts": why, "activated": activated} if isinstance(validation, dict) else validation
    outcome = {"validation": record, "activated": activated, "union_auto": union_auto(record)}
    own = run.layout.writeback_version(version).stats  # the version's stats file: written by its stage
    if own.exists():
        own.write_json({**own.read_json(), **outcome})
    print(format_outcome(version, stats.get("units_written", 0), record, activated), flush=True)
    return {**stats, **outcome}


def union_auto(record: dict[str, Any] | str) -> dict[str, str]:
    """The rule `retrieval.union: auto` searches the version with, and why."""
    if isinstance(record, dict):
        return {"union": record["chosen"], "why": record["choice"]}
    return {"union": FALLBACK_UNION, "why": f"no validation split ({record}): the paper's merge with the provenance "
            "guard"}


def format_outcome(version: str, units: int, record: dict[str, Any] | str, activated: bool) -> str:
    """The end of `wbrag writeback`: units written, whether active, and the effect on its validation questions."""
    state = "active" if activated else "not active"
    auto = union_auto(record)
    if not isinstance(record, dict):
        return (f"write-back {version}: {units} units written, {state}; its effect is not measured (validation "
                f"{record}); retrieval.union auto searches it with {auto['union']}")
    r = record
    how = f"chosen on them: {r['choice']}" if r["configured"] == "auto" else "retrieval.union"
    line = (f"write-back {version}: {units} units written, {state}; union {r['applied']} ({how}). On its "
            f"{r['questions']} validation questions: {r['units_reached']} units reached a top K (of "
            f"{r['unit_in_top_k']} questions), {r['answers_changed']} answers changed, won {r['won']}, lost {r['lost']}")
    if not r["units_reached"]:
        return line + f"\nwrite-back {version}: no unit reached a validation top K: it has no measured effect"
    if not r["answers_changed"]:
        return line + f"\nwrite-back {version}: it changed no validation answer: it has no measured effect"
    if r["lost"] > r["won"] and not r.get("hurts"):
        return line + (f" (more lost than won, within chance on {r['questions']} questions: p = "
                       f"{sign_test(r['lost'], r['won']):.2f})")
    return line


def _train(run: RunFolder, config: WbragConfig, train: str, params: dict[str, Any],
           services: Services | None = None) -> dict[str, Any]:
    wb = config.writeback
    version = params["version"]
    final = run.layout.writeback_version(version)
    folder = WritebackVersion(run.output(final.root))  # beside the version in use while --force retrains it
    folder.root.delete()
    t0 = time.perf_counter()
    search = base_search(run, config)
    with GeneratorPasses(config.generator, services) as passes:  # the caller's services, where given
        examples = score_examples(run, config, train, passes, search)
        folder.scored.write_table(plain_table(examples))
        kept = examples[examples["useful"]]
        units, drops = pd.DataFrame(columns=UNITS.names), None
        if len(kept):
            distilled = distill(wb, kept, passes)
            folder.distill.write_table(plain_table(distilled))
            units, drops = build_units(version, kept, distilled)
        # on the scoring passes' retrieval actors, the embedder loaded: no pool of its own (`embed_units`)
        vectors = embed_units(units, search, passes.services)
    merged: dict[int, int] = {}
    if len(units):
        merged = dedupe(vectors, wb.dedupe_threshold) if wb.dedupe_threshold is not None else {}
        for dup, keep in merged.items():  # merge: the kept unit also cites the duplicate's example
            units.at[keep, "merged_from"] = [*units.at[keep, "merged_from"], units.at[dup, "source_example_id"]]
        keep_rows = [i for i in range(len(units)) if i not in merged]
        units, vectors = units.iloc[keep_rows].reset_index(drop=True), vectors[keep_rows]
        folder.units.write_table(pa.Table.from_pandas(units, UNITS, preserve_index=False))
        folder.embed_file.write_table(embeddings_table(units["id"].to_numpy(np.int64), vectors))
        # A unit per kept example: written and indexed here, in the driver, not in Ray tasks, which would need
        # the CPUs the command's services hold now.
        write_doc_store(folder.corpus, "passage", folder.docs, parallel=False)
        build_index(
            folder.embed, folder.index, config.embedder.model, "writeback",
            IndexConfig(factory=wb.index_factory, gpu=False, target_recall=None),
            docs=folder.docs.uri,  # the manifest names its documents, in the version committed with it
            parallel=False,
        )
        # each unit's source documents, for the provenance-aware union (retrieval.union)
        write_provenance(folder.index, units["id"].tolist(), units["source_doc_ids"].tolist(),
                         load_manifest(run.layout.index).get("unit", "passage"))
    stats = {
        "version": version,
        "rag_method": wb.rag_method,
        "gate_metric": with_gate_metric(wb, train).metric,
        # retrieval.union when it was trained; under auto, the rule it is searched with is chosen by its validation
        "union": union_settings(config),
        "dataset": dataset_name(train),  # the name the gate metric was resolved from (FlashRAG's layout)
        **table3(examples, units, config.retrieval.top_k, drops),
        "units_written": len(units),
        "duplicates_merged": len(merged),
        "rejected_examples": int(examples["rejected_questions"].iloc[0]),
        "passes": passes.stats,
        "generator_calls": passes.calls,
        "train_seconds": round(time.perf_counter() - t0, 2),
        "settings": run.fingerprint(WRITEBACK, config, params),
    }
    folder.stats.write_json(stats)
    return {"rows_in": len(examples), "rows_out": len(units), **stats}


def format_table3(stats: dict[str, Any]) -> str:
    names = ("examples", "selection_rate", "mean_retained_docs", "fallback_rate", "source_tokens", "distilled_tokens",
             "compression_ratio")
    rows = [(name.replace("_", " "), stats.get(name)) for name in names]
    rows += [("rewrites dropped", _by_reason(stats, "rewrite")), ("units dropped", _by_reason(stats, "unit")),
             ("units written", stats.get("units_written")), ("duplicates merged", stats.get("duplicates_merged")),
             ("retained ranks", " ".join(f"{r}:{c}" for r, c in stats.get("rank_distribution", {}).items())),
             ("generator calls", stats.get("generator_calls"))]
    return "\n".join([f"write-back {stats.get('version')} (Table 3)"] + [f"  {k:<20}{v}" for k, v in rows])


def _by_reason(stats: dict[str, Any], kind: str) -> str:
    """'rate (n reason, ...)' of the rewrites or units the statement check dropped."""
    counts = stats.get(f"{kind}s_dropped") or {}
    reasons = ", ".join(f"{n} {why}" for why, n in counts.items() if n)
    return f"{stats.get(f'{kind}_drop_rate')}" + (f" ({reasons})" if reasons else "")


def writeback_work(config: WbragConfig, sizes: Sizes, params: dict[str, Any]) -> list[Generate]:
    """s_nr and s_rag for every training question; for the share the utility gate keeps, the document gate's
    answer from each of the K documents alone (none for replug-vote, whose slots are those answers), the
    distiller's extraction from the retained documents and its rewrite."""
    wb, k = config.writeback, config.retrieval.top_k
    q, counted = sizes.questions(wb.train, wb.limit)
    kept, retained, why = sizes.selection()
    extract = Pass(kept, round(retained), wb.extract_max_new_tokens, prompt=prompts.extract_messages,
                   prompt_docs=round(retained), kind="extract")
    rewrite = Pass(kept, 1, wb.rewrite_max_new_tokens, doc_tokens=wb.extract_max_new_tokens,
                   prompt=lambda question, _: prompts.rewrite_messages(question, ""), kind="rewrite")
    # the document gate answers each document alone, in the RAG prompt (`rag.expand`'s replug-vote rows)
    gate = [] if wb.rag_method == "replug-vote" else [Pass(k * kept, 1, kind="document gate")]
    passes = (Pass(1, 0), *rag.passes(wb.rag_method, config), *gate, extract, rewrite)
    calls = sum(p.calls for p in passes)
    total = f", {q * calls:,.0f} in all" if q else ""
    return [Generate(q, passes, f"questions: {counted}; about {calls:.3g} generator calls each{total} (s_nr, "
                     f"{wb.rag_method} s_rag; for the {kept:.1%} the utility gate keeps ({why}): the document gate "
                     f"over K={k}, extract from {retained:.2g} retained documents, rewrite)", retrieval=True,
                     selection=True)]


# `WRITEBACK` (light, in `versions`: read before Ray starts) as `wbrag run` makes it
WRITEBACK_TRAINING = replace(
    WRITEBACK, title="write-back training", work=writeback_work,
    run=lambda folder, config, force, services, params: train_writeback(folder, config, force=force, services=services),
    instances=lambda config: ([{"version": default_version(config, config.writeback.train)}]
                              if config.writeback.train else []),
    resources=("generator", "retrieval"),  # its units are embedded by retrieval's query embedders
    outputs=("writeback/{version}", "writeback/ACTIVE"))
