"""The evaluation as a run-folder stage: declaration, parameters and name, light enough for pre-Ray checks."""

from __future__ import annotations

from typing import Any

from wbrag_ray.build_kb import INDEX
from wbrag_ray.config import WbragConfig
from wbrag_ray.formats import dataset_stem, input_identity
from wbrag_ray.identity import content_identity, index_identity
from wbrag_ray.retrieval.union import OWN_SETTING, UnionRule
from wbrag_ray.run import RunFolder, RunStage
from wbrag_ray.storage import resolve

# Results are never silently replaced: other settings under the same label are refused, naming what changed. The
# methods are not a setting: each method's rows are its own, and a method the label lacks is added to it
# (`evaluate_stage`).
EVAL = RunStage(
    "eval-{label}",
    settings=("eval.limit", "eval.answer_form", "retrieval", "rag", "generator", "embedder", "index.nprobe",
              "index.ef_search", "index.k_factor"),
    uses=(INDEX,),
    # the union of base and write-back hits matters only beside a write-back index: a parameter there
    ignore=("retrieval.union", "retrieval.max_units", "retrieval.rrf_k", "retrieval.gate_margin",
            "retrieval.additive_margin"),
    fix="pass --force to replace its results, or --name NEW to keep both",
)


def dataset_name(config: WbragConfig, dataset: str) -> str:
    """What results on `dataset` are called: eval.name, else the file's stem."""
    return config.eval.name or dataset_stem(dataset)


def eval_params(label: str, dataset: str, kwargs: dict[str, Any], config: WbragConfig | None = None,
                run: RunFolder | None = None) -> dict[str, Any]:
    """The evaluation stage's parameters: label, dataset, setting arguments, union settings, and `made_from`."""
    params = {"label": label, "dataset": dataset, **{k: v for k, v in kwargs.items() if k != "setting"}}
    if config is not None and (kwargs.get("writeback") or kwargs.get("writeback_version")):
        params["union"] = union_settings(config)
    if config is not None:
        # the questions by content too: a dataset edited in place is not the one the stored results answered
        params["made_from"] = {**made_from(config, kwargs, run), "dataset": input_identity(resolve(dataset), "dataset")}
    return params


def made_from(config: WbragConfig, kwargs: dict[str, Any], run: RunFolder | None = None) -> dict[str, Any]:
    """The content identity of each input read by path, so a folder rebuilt in place is another input."""
    base = kwargs.get("base_index") or (run.layout.index.uri if run is not None else None)
    version = kwargs.get("writeback_version")
    out = {
        "generator.model": content_identity(config.generator.model),
        "generator.lora_adapter": content_identity(config.generator.lora_adapter),
        "embedder.model": content_identity(config.embedder.model),
        "base_index": index_identity(base),
        "router": content_identity(kwargs.get("router")),
        "writeback_version": index_identity(run.layout.writeback_version(version).index.uri)
        if version and run is not None else None,
    }
    return {k: v for k, v in out.items() if v is not None}


def union_settings(config: WbragConfig) -> dict[str, Any]:
    """retrieval.union and the settings it reads, as recorded with an evaluation beside a write-back index."""
    return UnionRule.of(config.retrieval).settings()


def union_label(config: WbragConfig) -> str:
    """retrieval.union as a table names it ('gate, gate_margin 0.05'; defaults not named)."""
    settings = union_settings(config)
    defaults = type(config.retrieval)()
    extra = [f"{k} {v}" for k, v in settings.items() if k != "union" and v is not None
             and not (k in OWN_SETTING.values() and v == getattr(defaults, k))]
    return ", ".join([settings["union"], *extra])


def union_suffix(config: WbragConfig) -> str:
    """What a grid's write-back labels add for a union other than the default ('' for the default)."""
    label = union_label(config)
    default = union_label(type(config)())
    return "" if label == default else "-" + label.replace(", ", "-").replace(" ", "")
