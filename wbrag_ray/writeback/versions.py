"""Write-back versions: the active one (RUN/writeback/ACTIVE, written atomically), replacing it, rolling back."""

from __future__ import annotations

from typing import Any

from wbrag_ray.build_kb import INDEX
from wbrag_ray.config import ConfigError, WbragConfig
from wbrag_ray.evaluation.effect import CHANCE
from wbrag_ray.formats import dataset_stem
from wbrag_ray.metrics import sign_test
from wbrag_ray.run import RunFolder, RunStage

# One trained version is one stage. What it is made from: the write-back settings, the generator and retrieval
# that answer and gate, the embedder of its units, and the adaptive method's own thresholds when it trains
# with one ("rag.self_rag" / "rag.flare": the `method` parameter, empty for naive, replug and replug-vote).
WRITEBACK = RunStage(
    "writeback-{version}",
    settings=("writeback", "retrieval", "index.nprobe", "generator", "embedder", "rag.{method}"),
    # the union settings shape what a search of base + write-back returns; training searches the base alone
    ignore=("writeback.train", "writeback.version", "writeback.activate", "writeback.evaluate", "retrieval.union",
            "retrieval.max_units", "retrieval.rrf_k", "retrieval.gate_margin", "retrieval.additive_margin"),
    requires=(INDEX,),
    command="wbrag writeback RUN --train PATH",
    fix="pick another --version (writeback.version) or pass --force to retrain it",
)


def default_version(config: WbragConfig, train: str) -> str:
    """The version name: writeback.version, else the training file's stem (a rerun finds its own stage)."""
    return config.writeback.version or dataset_stem(train)


def read_active(run: RunFolder) -> dict[str, Any]:
    """{"version": active version or None, "history": earlier active versions, oldest first}."""
    loc = run.layout.writeback_active
    return loc.read_json() if loc.exists() else {"version": None, "history": []}


def versions(run: RunFolder) -> list[str]:
    """Trained write-back versions (complete, with an index), by name."""
    return [v.version for v in run.layout.writeback_versions()
            if run.is_complete(WRITEBACK.instance({"version": v.version})) and v.index.exists()]


def trained_method(run: RunFolder, version: str) -> str:
    """The RAG method a write-back version was trained (scored and written back) with."""
    stats = run.layout.writeback_version(version).stats
    return stats.read_json().get("rag_method", "naive") if stats.exists() else "naive"


def _require_trained(run: RunFolder, version: str) -> None:
    if version not in versions(run):
        known = ", ".join(versions(run)) or "none"
        raise ConfigError(f"write-back version {version!r} of {run.uri} is not trained (trained: {known})")


def activate(run: RunFolder, version: str) -> dict[str, Any]:
    """Make `version` the write-back index searched beside the base (replace); the base index is untouched."""
    _require_trained(run, version)
    validation = run.layout.writeback_version(version).validation
    why = hurts(validation.read_json() if validation.exists() else None)
    if why:
        print(f"warning: write-back version {version} hurt on its validation questions ({why})", flush=True)
    state = read_active(run)
    if state["version"] != version:
        history = [*state["history"], state["version"]] if state["version"] else state["history"]
        state = {"version": version, "history": history}
        run.layout.writeback_active.write_json(state)  # one small file, written atomically: the switch is one rename
    print(f"write-back index active: {version}", flush=True)
    return state


def rollback(run: RunFolder, version: str | None = None) -> dict[str, Any]:
    """Go back to the previously active version (or `version`); 'base' = base index only (remembered for later)."""
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
    run.layout.writeback_active.write_json(state)
    print(f"write-back index active: {previous or 'none (base index only)'}", flush=True)
    return state


def active_index(run: RunFolder, version: str | None = None) -> tuple[str, str, None]:
    """(version, index folder, None) of the active write-back index (or `version`), for a union search."""
    if version is not None:
        _require_trained(run, version)
    version = version or read_active(run)["version"]
    if not version:
        raise ConfigError(
            f"run {run.uri} has no active write-back index; train one with `wbrag writeback RUN --train PATH` "
            "or activate one with `wbrag writeback RUN --activate VERSION`"
        )
    folder = run.layout.writeback_version(version)
    return version, folder.index.uri, None  # its documents: the store its manifest names


def hurts(result: dict[str, Any] | None) -> str | None:
    """Why a validated version hurts: it lost more than it won beyond chance (`metrics.sign_test`); else None."""
    if not result:
        return None
    p = sign_test(result["lost"], result["won"])
    if result["lost"] <= result["won"] or p >= CHANCE:
        return None
    return (f"{result['lost']} questions lost against {result['won']} won (p = {p:.3f}); {result['metric']} "
            f"{result['with_version']:.3f} with it against {result['base']:.3f} without")
