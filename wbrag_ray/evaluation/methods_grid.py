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
    with, same_method, metrics and their change over the base; for a version, the union setting
    (retrieval.union) and the questions a unit entered the top K of, won and lost; methods_grid-<name>.json for
    a Zero-RAG setting) and prints the table. A grid run under another union setting adds its rows beside the
    ones already there (labels: `union_suffix`)."""
    from wbrag_ray.evaluation.effect import writeback_effect
    from wbrag_ray.evaluation.stage import union_label, union_suffix
    from wbrag_ray.writeback.versions import trained_method, versions

    name = name or dataset_name(config, dataset)
    methods = list(dict.fromkeys(config.eval.methods))
    trained = {v: trained_method(run, v) for v in versions(run)}
    union = union_label(config)
    rows: list[dict[str, Any]] = []
    base: dict[str, dict[str, Any]] = {}

    def predictions(label: str, method: str):
        return run.layout.eval_result(label, method).predictions.read_table().to_pandas()

    # One generator for every cell (the retrieval service changes with the cell's write-back index).
    with GeneratorPasses(config.generator) as passes:
        for version in [None, *trained]:
            # The closed-book baseline searches nothing: once, on the base, is enough.
            evaluated = [m for m in methods if version is None or m != "no-retrieval"]
            if not evaluated:
                continue
            cfg = config.model_copy(update={"eval": config.eval.model_copy(update={"methods": evaluated})})
            label = f"{name}-grid" + (f"-wb-{version}{union_suffix(config)}" if version else "")
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
                    effect = writeback_effect(predictions(f"{name}-grid", method), predictions(label, method))
                    row.update(union=union, **{k: effect[k] for k in ("unit_in_top_k", "changed", "won", "lost")})
                rows.append(row)
    zero_rag_setting = bool(kwargs) or bool(config.generator.lora_adapter)  # pruned / routed base, tuned adapter
    out = run.layout.methods_grid(name if zero_rag_setting else None)
    earlier = out.read_json() if out.exists() else {}
    if earlier.get("dataset") == dataset:  # the rows of other union settings stay
        rows += [r for r in earlier["rows"]
                 if r["version"] in trained and r.get("union") not in (None, union) and r["method"] in methods]
    grid = {"dataset": dataset, "name": name, "methods": methods, "versions": trained, "rows": rows, **kwargs}
    out.write_json(grid)
    print(format_methods_grid(grid), flush=True)
    return grid


def format_methods_grid(grid: dict[str, Any], metric: str = "acc") -> str:
    """Methods down, settings across (base, then each write-back version with the method it was trained
    with, and its union setting where the grid holds several); each write-back cell shows the change over the
    base, * where the version's method is the row's. Below: per write-back cell, the questions a unit entered the
    top K of, won and lost."""
    versions = grid["versions"]
    columns = [(None, None), *dict.fromkeys((r["version"], r.get("union")) for r in grid["rows"] if r["version"])]
    several = len({u for _, u in columns[1:]}) > 1
    cells = {(r["method"], r["version"], r.get("union") if r["version"] else None): r for r in grid["rows"]}
    heads = ["base"] + [f"+wb {v} [{versions[v]}]" + (f" {u}" if several else "") for v, u in columns[1:]]
    width = max(16, *(len(h) + 2 for h in heads))

    def table(cell) -> list[str]:
        lines = [f"{'method':<14}" + "".join(f"{h:>{width}}" for h in heads)]
        for method in grid["methods"]:
            texts = [cell(cells[(method, *c)]) if (method, *c) in cells else "" for c in columns]
            lines.append(f"{method:<14}" + "".join(f"{t:>{width}}" for t in texts))
        return lines

    def score(r: dict[str, Any]) -> str:
        text = f"{r[metric]:.3f}"
        if "delta" in r:
            text += f" ({r['delta'][metric]:+.3f}){'*' if r['same_method'] else ' '}"
        return text

    lines = [f"RAG methods x knowledge base on {grid['name']} ({metric}; * = written back under the same method)",
             *table(score)]
    if any("won" in r for r in grid["rows"]):
        lines += ["questions a write-back unit entered the top K of: won / lost (over those questions)",
                  *table(lambda r: f"{r['unit_in_top_k']}: +{r['won']} -{r['lost']}" if "won" in r else "")]
    return "\n".join(lines)
