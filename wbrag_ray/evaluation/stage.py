"""The evaluation as a stage of the run folder: its declaration, parameters and name, in a module light enough for
the checks a command makes before Ray starts (wbrag_ray.api)."""

from __future__ import annotations

from typing import Any

from wbrag_ray.build_kb import INDEX
from wbrag_ray.config import WbragConfig
from wbrag_ray.run import RunStage

# Results are never silently replaced: other settings under the same label are refused, naming what changed.
EVAL = RunStage(
    "eval-{label}",
    settings=("eval.methods", "eval.limit", "retrieval", "rag", "generator", "embedder", "index.nprobe",
              "index.ef_search", "index.k_factor"),
    uses=(INDEX,),
    fix="pass --force to replace its results, or --name NEW to keep both",
)


def dataset_name(config: WbragConfig, dataset: str) -> str:
    """What results on `dataset` are called: eval.name, else the file's stem."""
    from wbrag_ray.formats import dataset_stem

    return config.eval.name or dataset_stem(dataset)


def eval_params(label: str, dataset: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The evaluation stage's parameters: its label, the dataset, and the setting's own arguments (index, router,
    write-back version; the `setting` label only names them)."""
    return {"label": label, "dataset": dataset, **{k: v for k, v in kwargs.items() if k != "setting"}}
