"""What made an evaluation's results, as its stages recorded it (a write-back version's stats.json `settings`, the
tuned adapter's and the pruner's stage records), not the evaluating config: `made_config` for
`papers.run_departures`, `made_by` for metrics.json's `made_by` that `papers.paper_vs_run` compares."""

from __future__ import annotations

from typing import Any

from wbrag_ray.config import WbragConfig
from wbrag_ray.formats import dataset_name
from wbrag_ray.layout import PRUNE_LEVEL
from wbrag_ray.papers import MadeBy, papers_followed
from wbrag_ray.retrieval.union import UnionRule
from wbrag_ray.run import RunFolder
from wbrag_ray.zerorag.mastery import MASTERY
from wbrag_ray.zerorag.prune import PREDICT
from wbrag_ray.zerorag.pruners import PRUNERS
from wbrag_ray.zerorag.tune import TUNE

_WRITEBACK_KEYS = ("tau_s", "tau_delta", "tau_doc", "n_min", "metric", "dedupe_threshold", "validation", "limit",
                   "rag_method")


def _recorded(stats: dict[str, Any] | None) -> dict[str, Any]:
    return ((stats or {}).get("settings") or {}).get("config") or {}


def _version_stats(run: RunFolder, version: str) -> dict[str, Any]:
    stats_file = run.layout.writeback_version(version).stats
    return stats_file.read_json() if stats_file.exists() else {}


def version_settings(run: RunFolder, version: str) -> dict[str, Any]:
    """The settings write-back `version` was made with: its gates, deduplication, validation (and the questions it
    held out), limit, method, gate metric, training set, K and generator, from its stats.json; {"version"} alone for
    a version that recorded none."""
    stats = _version_stats(run, version)
    made = _recorded(stats)
    wb = made.get("writeback") or {}
    out: dict[str, Any] = {k: wb[k] for k in _WRITEBACK_KEYS if k in wb}
    if stats.get("gate_metric"):
        out["metric"] = stats["gate_metric"]
    if stats.get("rag_method"):
        out["rag_method"] = stats["rag_method"]
    if isinstance(stats.get("examples"), int):  # the training questions scored (Table 3's)
        out["examples"] = stats["examples"]
    train = ((stats.get("settings") or {}).get("params") or {}).get("train")
    # the training questions validation held out: its result's count; a string says why none was
    validation = stats.get("validation")
    if isinstance(validation, dict) and isinstance(validation.get("questions"), int):
        out["held_out"] = validation["questions"]
    elif isinstance(validation, str):
        out["held_out"] = 0
    return {"version": version, **out, **({"train": train} if train else {}),
            **({"top_k": made["retrieval"].get("top_k")} if isinstance(made.get("retrieval"), dict) else {}),
            **({"generator": made["generator"].get("model")} if isinstance(made.get("generator"), dict) else {})}


def searched_union(run: RunFolder, config: WbragConfig, version: str) -> dict[str, Any]:
    """The union rule a search beside `version` uses (`UnionRule.resolved`: under `auto`, the rule the version's
    validation chose), as `UnionRule.settings` records it."""
    return UnionRule.of(config.retrieval).resolved([run.layout.writeback_version(version).index]).settings()


def adapter_settings(run: RunFolder) -> dict[str, Any]:
    """The settings the run's tuned adapter was made with (the `tune` stage's record), and the rows its own-answer
    targets dropped; {} where none was recorded."""
    stats = run.stats(TUNE.name) or {}
    tune = dict(_recorded(stats).get("zerorag.tune") or {})
    for key in ("rows_built", "rows_without_own_answer"):
        if key in stats:
            tune[key] = stats[key]
    train = ((stats.get("settings") or {}).get("params") or {}).get("train")
    return {**tune, **({"train": train} if train else {})}


def pruner_settings(run: RunFolder) -> dict[str, Any]:
    """The pruner the run's pruned indices were made by, and its LM backbone's recorded settings."""
    out: dict[str, Any] = {}
    predict = _recorded(run.stats(PREDICT.name))
    if "zerorag.pruner" in predict:
        out["pruner"] = predict["zerorag.pruner"]
    lm = _recorded(run.stats(PRUNERS["lm"].name)).get("zerorag.lm_pruner")
    if lm:
        out["lm_pruner"] = lm
    mastery = _recorded(run.stats(MASTERY.name))
    out.update({k.removeprefix("zerorag."): v for k, v in mastery.items()
                if k in ("zerorag.qa_mode", "zerorag.mastery_metric", "zerorag.qa_generator")})
    return out


def _section(section, recorded: dict[str, Any]):
    """A config section with the recorded values in place of its own: the plain values it still has fields for (not
    validated again: a section's checks across fields, placement among them, are the evaluating config's to pass)."""
    fields = type(section).model_fields
    return section.model_copy(update={k: v for k, v in recorded.items() if k in fields and not isinstance(v, dict)})


def made_config(run: RunFolder, config: WbragConfig, version: str | None = None, adapter: bool = False,
                zero_rag: bool = False, writeback: bool = False) -> tuple[WbragConfig, MadeBy]:
    """`config` with what made a result in place of its own values: write-back `version`'s recorded settings and the
    union searched beside it, the tuned adapter's (`adapter`), the pruner's and mastery's (`zero_rag`); and
    `MadeBy`: the papers the result follows (`writeback`: beside versions without one to read), the version's
    training set and what else was recorded."""
    distiller = rows = dropped = dropped_units = train = None
    made = config
    if version:
        wb = version_settings(run, version)
        rule = searched_union(run, config, version)
        made = made.model_copy(update={"writeback": _section(config.writeback, wb),
                                       "retrieval": config.retrieval.model_copy(update={"union": rule["union"]})})
        # the distilled rewrites and units the version's checks dropped (its stats' counts by reason)
        dropped_units = sum(n for kind in ("rewrites_dropped", "units_dropped")
                            for n in (_version_stats(run, version).get(kind) or {}).values() if isinstance(n, int))
        distiller, train = wb.get("generator"), wb.get("train")
    z = made.zerorag
    if adapter:
        tune = adapter_settings(run)
        rows, dropped = tune.get("rows_built"), tune.get("rows_without_own_answer")
        z = z.model_copy(update={"tune": _section(z.tune, {**tune, "enabled": True})})
    if zero_rag:
        pruner = pruner_settings(run)
        update = {k: pruner[k] for k in ("pruner", "qa_mode", "mastery_metric") if k in pruner}
        if "lm_pruner" in pruner:
            update["lm_pruner"] = _section(z.lm_pruner, pruner["lm_pruner"])
        if isinstance(pruner.get("qa_generator"), dict) and z.qa_generator is not None:
            update["qa_generator"] = _section(z.qa_generator, pruner["qa_generator"])
        z = z.model_copy(update=update)
    if adapter or zero_rag:  # a Zero-RAG result, whatever the evaluating config's zerorag.enabled
        made = made.model_copy(update={"zerorag": z.model_copy(update={"enabled": True})})
    papers = papers_followed(config, writeback or bool(version), zero_rag or adapter)
    return made, MadeBy(papers, train if version else made.writeback.train, distiller, rows, dropped, dropped_units)


def own_adapter(run: RunFolder, config: WbragConfig) -> bool:
    """Whether the generator carries the run's tuned adapter (its settings are recorded by the run)."""
    return bool(config.generator.lora_adapter) and config.generator.lora_adapter == run.layout.zero_rag.adapter.uri


def pruning_ratio(run: RunFolder, base_index: str | None) -> float | None:
    """The pruning ratio of the base index an evaluation searched: 0 for the run's full index, the level's for a
    pruned one, None for another folder."""
    if base_index in (None, run.layout.index.uri):
        return 0.0
    prefix = PRUNE_LEVEL.split("{")[0]
    for level in run.layout.zero_rag.pruned_levels():
        if level.index.uri == base_index:
            return float(level.root.name.removeprefix(prefix))
    return None


def made_by(run: RunFolder, config: WbragConfig, dataset: str, n: int, method: str, version: str | None,
            base_index: str | None, router: str | None) -> dict[str, Any]:
    """The record of what made one method's results (metrics.json's `made_by`): the questions (dataset, count,
    eval.limit), the generator, retriever, K, answer form, the union searched beside a version, the version's
    recorded settings, the adapter's, the router and the pruning ratio."""
    retrieves = method != "no-retrieval"
    return {
        "dataset": dataset_name(dataset),
        "questions": {"dataset": dataset, "n": n, "limit": config.eval.limit},
        "method": method,
        "generator": config.generator.model,
        "retriever": config.embedder.model if retrieves else None,
        "top_k": config.retrieval.top_k if retrieves else 0,
        "answer_form": config.eval.answer_form or "as generated",
        "union": searched_union(run, config, version)["union"] if version and retrieves else None,
        "writeback": version_settings(run, version) if version and retrieves else None,
        "adapter": adapter_settings(run) if own_adapter(run, config) else None,
        "router": bool(router) if retrieves else False,
        "pruning_ratio": pruning_ratio(run, base_index) if retrieves else None,
    }
