"""The methods grid: every RAG method on the base and beside every write-back version
(RUN/eval/methods_grid.json)."""

from __future__ import annotations

from typing import Any

from wbrag_ray.config import WbragConfig
from wbrag_ray.evaluation.effect import writeback_effect
from wbrag_ray.evaluation.evaluate import dataset_name, evaluate_stage
from wbrag_ray.evaluation.stage import union_label, union_settings, union_suffix
from wbrag_ray.generation.passes import GeneratorPasses
from wbrag_ray.metrics import METRICS
from wbrag_ray.run import RunFolder, settings_value
from wbrag_ray.writeback.pipeline import train_writeback, with_gate_metric
from wbrag_ray.writeback.versions import default_version, trained_method, versions


def evaluate_methods_grid(
    run: RunFolder, config: WbragConfig, dataset: str, name: str | None = None, force: bool = False,
    same_writeback: bool = False, **kwargs: Any
) -> dict[str, Any]:
    """Every method of `eval.methods` on the base index and beside every trained write-back version (each version
    under its own method and every other). `kwargs` (`base_index`, `router`) apply to every cell, as does a generator
    adapter (then methods_grid-<name>.json). A grid under another union setting adds its rows beside those already
    there (labels: `union_suffix`). `same_writeback`: first train a version under each method that has none, and add
    WriteBack-RAG's Figure 4 view. Writes RUN/eval/methods_grid.json and prints the table."""
    name = name or dataset_name(config, dataset)
    methods = list(dict.fromkeys(config.eval.methods))
    own = same_writeback_versions(run, config) if same_writeback else {}
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
            stats = evaluate_stage(run, cfg, dataset, label, force=force, passes=passes, writeback_version=version,
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
    if own:
        grid["same_writeback"] = own
    out.write_json(grid)
    print(format_methods_grid(grid), flush=True)
    if own:
        print(format_same_writeback(grid), flush=True)
    return grid


def same_writeback_rows(grid: dict[str, Any]) -> list[dict[str, Any]]:
    """Figure 4's Same-WB cells: per method with a version of its own, its base row and its row beside that version."""
    cells: dict[tuple[str, str | None], dict[str, Any]] = {}
    for r in grid["rows"]:  # this grid's own union setting first; rows of others kept from earlier grids follow
        cells.setdefault((r["method"], r["version"]), r)
    return [{"method": m, "version": v, "base": cells[(m, None)], "same_wb": cells[(m, v)]}
            for m, v in grid.get("same_writeback", {}).items() if (m, None) in cells and (m, v) in cells]


def format_same_writeback(grid: dict[str, Any]) -> str:
    """WriteBack-RAG's Figure 4 shape: each method on the base and on the knowledge base written back under it."""
    lines = [f"Same-WB on {grid['name']}: each method beside the version written back under it",
             f"{'method':<14}{'version':>18}" + "".join(f"{h:>18}" for k in METRICS for h in (k, f"{k} Same-WB"))]
    for row in same_writeback_rows(grid):
        texts = []
        for k in METRICS:
            texts += [f"{row['base'][k]:.3f}", f"{row['same_wb'][k]:.3f} ({row['same_wb'][k] - row['base'][k]:+.3f})"]
        lines.append(f"{row['method']:<14}{row['version']:>18}" + "".join(f"{t:>18}" for t in texts))
    return "\n".join(lines)


def same_writeback_versions(run: RunFolder, config: WbragConfig) -> dict[str, str]:
    """{method: its write-back version}: a version trained under the method is reused only when made as the grid
    would make it (`same_writeback_differences`); else one is trained as `<version>-<method>`, not activated."""
    train = config.writeback.train
    trained = sorted(versions(run))
    own: dict[str, str] = {}
    for method in dict.fromkeys(config.eval.methods):
        if method == "no-retrieval":
            continue
        passed_over = []
        for version in trained:
            stats = run.layout.writeback_version(version).stats.read_json()
            if stats.get("settings", {}).get("params", {}).get("train") != train or \
                    stats.get("rag_method", "naive") != method:
                continue
            differs = same_writeback_differences(config, method, stats)
            if not differs:
                own[method] = version
                print(f"Same-WB {method}: reusing write-back version {version} (same generator, embedder, "
                      "questions, gates, deduplication, validation, union and K)", flush=True)
                break
            passed_over.append(f"{version} ({'; '.join(differs)})")
        if method in own:
            continue
        wb = config.writeback.model_copy(update={"rag_method": method, "activate": False, "version": None})
        version = name = f"{default_version(config, train)}-{method}"
        n = 1
        while run.layout.writeback_version(version).root.exists():
            n += 1
            version = f"{name}-{n}"
        why = f": {', '.join(passed_over)} differ from the grid" if passed_over else ": none was trained under it"
        print(f"Same-WB {method}: training write-back version {version}{why}", flush=True)
        train_writeback(run, config.model_copy(update={"writeback": wb}), train, version)
        own[method] = version
    return {m: own[m] for m in config.eval.methods if m in own}


def same_writeback_differences(config: WbragConfig, method: str, stats: dict[str, Any]) -> list[str]:
    """What a version's stats record that differs from what the grid would train for `method`."""
    made = stats.get("settings", {}).get("config", {})
    wb = with_gate_metric(config.writeback, config.writeback.train or "")
    # every write-back setting that changes the version's units: the question subset, gates, deduplication, hold-out
    written = ("limit", "tau_s", "tau_delta", "tau_doc", "n_min", "dedupe_threshold", "validation")
    recorded = made.get("writeback", {})
    compared = [  # (setting, the grid's value, the version's recorded one)
        ("generator", settings_value(config.generator), made.get("generator")),
        ("embedder", settings_value(config.embedder), made.get("embedder")),
        *((f"writeback.{k}", settings_value(getattr(wb, k)), recorded.get(k, "not recorded")) for k in written),
        ("writeback.metric", wb.metric, stats.get("gate_metric", recorded.get("metric"))),
        ("retrieval.union", union_settings(config), stats.get("union", "not recorded")),
        ("retrieval.top_k", config.retrieval.top_k, made.get("retrieval", {}).get("top_k")),
    ]
    out = []
    for key, value, have in compared:
        if have == value:
            continue
        if key == "generator" and isinstance(have, dict):  # name the generator's settings that differ
            keys = [k for k in sorted(set(value) | set(have)) if have.get(k) != value.get(k)]
            out.append(f"generator: {', '.join(f'{k} {have.get(k)!r}' for k in keys)} (the grid: "
                       f"{', '.join(f'{k} {value.get(k)!r}' for k in keys)})")
        else:
            out.append(f"{key}: {have!r} (the grid: {value!r})")
    return out


def format_methods_grid(grid: dict[str, Any], metric: str = "acc") -> str:
    """Methods down, settings across; write-back cells show the change over the base (* own method)."""
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
