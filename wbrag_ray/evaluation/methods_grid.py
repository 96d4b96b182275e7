"""The methods grid: every RAG method on the base index and beside every trained write-back version, so a
knowledge base written back under one method is measured under all the others (RUN/eval/methods_grid.json)."""

from __future__ import annotations

from typing import Any

from wbrag_ray.config import WbragConfig
from wbrag_ray.evaluation.evaluate import dataset_name, evaluate_stage
from wbrag_ray.generation.passes import GeneratorPasses
from wbrag_ray.metrics import METRICS
from wbrag_ray.run import RunFolder


def evaluate_methods_grid(
    run: RunFolder, config: WbragConfig, dataset: str, name: str | None = None, force: bool = False, **kwargs: Any
) -> dict[str, Any]:
    """Every method of `eval.methods` on the base index, and beside every trained write-back version: a
    version written back under one method is measured under the same method and under every other one.
    `kwargs` (`base_index`: a pruned index; `router`) apply to every cell (as does a generator adapter), and
    `name` then says so.

    Writes RUN/eval/methods_grid.json (rows: method, setting, version, the method the version was trained
    with, same_method, metrics and their change over the base; methods_grid-<name>.json for a Zero-RAG
    setting) and prints the table."""
    from wbrag_ray.writeback.versions import trained_method, versions

    name = name or dataset_name(config, dataset)
    methods = list(dict.fromkeys(config.eval.methods))
    trained = {v: trained_method(run, v) for v in versions(run)}
    rows: list[dict[str, Any]] = []
    base: dict[str, dict[str, Any]] = {}
    # One generator for every cell (the retrieval service changes with the cell's write-back index).
    with GeneratorPasses(config.generator) as passes:
        for version in [None, *trained]:
            # The closed-book baseline searches nothing: once, on the base, is enough.
            evaluated = [m for m in methods if version is None or m != "no-retrieval"]
            if not evaluated:
                continue
            cfg = config.model_copy(update={"eval": config.eval.model_copy(update={"methods": evaluated})})
            label = f"{name}-grid" + (f"-wb-{version}" if version else "")
            stats = evaluate_stage(run, cfg, dataset, name, label, force=force, passes=passes, writeback_version=version,
                                   setting="base" if version is None else f"base+writeback:{version}", **kwargs)
            for method, m in stats["methods"].items():
                if version is None:
                    base[method] = m
                row = {
                    "method": method, "setting": "base" if version is None else "base+writeback", "version": version,
                    "trained_with": trained.get(version), "same_method": None if version is None else trained[version] == method,
                    "n": m["n"], **{k: m[k] for k in METRICS},
                    "retrieval_rate": m.get("retrieval_rate", 0.0), "generator_calls": m.get("generator_calls"),
                }
                if version is not None and method in base:
                    row["delta"] = {k: round(m[k] - base[method][k], 4) for k in METRICS}
                rows.append(row)
    grid = {"dataset": dataset, "name": name, "methods": methods, "versions": trained, "rows": rows, **kwargs}
    zero_rag_setting = bool(kwargs) or bool(config.generator.lora_adapter)  # pruned / routed base, tuned adapter
    run.layout.methods_grid(name if zero_rag_setting else None).write_json(grid)
    print(format_methods_grid(grid), flush=True)
    return grid


def format_methods_grid(grid: dict[str, Any], metric: str = "acc") -> str:
    """Methods down, settings across (base, then each write-back version with the method it was trained
    with); each write-back cell shows the change over the base, * where the version's method is the row's."""
    versions = grid["versions"]
    cells = {(r["method"], r["version"]): r for r in grid["rows"]}
    heads = ["base"] + [f"+wb {v} [{m}]" for v, m in versions.items()]
    width = max(16, *(len(h) + 2 for h in heads))
    lines = [f"RAG methods x knowledge base on {grid['name']} ({metric}; * = written back under the same method)",
             f"{'method':<14}" + "".join(f"{h:>{width}}" for h in heads)]
    for method in grid["methods"]:
        line = f"{method:<14}"
        for version in [None, *versions]:
            r = cells.get((method, version))
            if r is None:
                line += f"{'':>{width}}"
                continue
            text = f"{r[metric]:.3f}"
            if "delta" in r:
                text += f" ({r['delta'][metric]:+.3f}){'*' if r['same_method'] else ' '}"
            line += f"{text:>{width}}"
        lines.append(line)
    return "\n".join(lines)

