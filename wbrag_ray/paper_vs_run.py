"""The papers' numbers beside a run's results (`paper_vs_run`): each result of the run set beside the numbers of the
same paper that measure what it measures (`wbrag_ray.paper_numbers`: the same dataset, RAG method and setting), with
every setting that changes a number and differs named (`paper_settings_differ`): the question count and subset, the
training set, the gates, deduplication, validation, the adapter, the pruning ratio, the generator, the retriever, K,
the union and the answer form. `wbrag eval` prints the table as it ends; the report has it as "Paper vs this run"."""

from __future__ import annotations

from typing import Any

from wbrag_ray.config import WbragConfig
from wbrag_ray.paper_numbers import (
    NOT_STATED,
    NUMBERS,
    WRITEBACK,
    WRITEBACK_GATES,
    ZERO_RAG,
    ZERO_RAG_K,
    ZERO_RAG_LEARNING_RATE,
    ZERO_RAG_RETRIEVER,
    PaperNumber,
)
from wbrag_ray.papers import model_name, same_model

PERCENT_METRICS = ("em", "f1", "acc")  # 0-1 in metrics.json, in % in the papers: the numbers a result is set beside


def _named(run: str | None, paper: str | None) -> bool:
    return bool(run) and bool(paper) and same_model(run, paper)


def paper_settings_differ(n: PaperNumber, made: dict[str, Any]) -> list[str]:
    """Each setting that changes a number and in which the run's result (`made`: its metrics.json's `made_by`)
    differs from what made the paper's number `n`; a setting the text does not state is named as such where the
    run's is known. 'K 5 (the paper: 20)'."""
    out = []
    gen = made.get("generator")
    if n.generator is None:
        out.append(f"generator {model_name(gen) if gen else 'unknown'} (the paper: {NOT_STATED})")
    elif not _named(gen, n.generator):
        out.append(f"generator {model_name(gen) if gen else 'unknown'} (the paper: {n.generator})")
    ret = made.get("retriever")
    if n.retriever and not (ret and n.retriever.lower() in str(ret).lower()):
        out.append(f"retriever {model_name(ret) if ret else 'unknown'} (the paper: {n.retriever})")
    if n.top_k is not None and made.get("top_k") != n.top_k:
        out.append(f"K {made.get('top_k')} (the paper: {n.top_k})")
    if (made.get("answer_form") or "as generated") != "as generated":
        out.append(f"answers scored {made.get('answer_form')} (the paper: as generated)")
    questions = made.get("questions")
    if questions and questions.get("limit"):
        out.append(f"the first {questions.get('n')} questions of {questions.get('dataset')} (eval.limit "
                   f"{questions['limit']}; the paper: the whole test set)")
    if n.paper == ZERO_RAG:
        if n.pruning_ratio is None and made.get("pruning_ratio") is not None and n.knowledge_base == "corpus" \
                and n.method != "no-retrieval":
            out.append(f"pruning ratio {made['pruning_ratio']:g} (the paper: {NOT_STATED})")
        adapter = made.get("adapter")
        if adapter and n.adapter:
            if adapter.get("targets") not in (None, "gold"):
                out.append(f"adapter tuned to targets {adapter['targets']!r}, only the rows it answered right (the "
                           "paper: every training query, in three formats)")
            if adapter.get("learning_rate") not in (None, ZERO_RAG_LEARNING_RATE):
                out.append(f"adapter tuned at learning rate {adapter['learning_rate']:g} (the paper: "
                           f"{ZERO_RAG_LEARNING_RATE:g})")
    if n.paper == WRITEBACK and n.knowledge_base == "write-back":
        version = made.get("writeback") or {}
        gates = dict(n.gates) if n.gates is not None else None
        for key in ("tau_s", "tau_delta", "tau_doc", "n_min"):
            have = repr(version[key]) if key in version else "not recorded"
            if gates is None:
                out.append(f"{key} {have} (the paper: {NOT_STATED})")
            elif key not in version or version[key] != gates[key]:
                out.append(f"{key} {have} (the paper: {gates[key]!r})")
        if version.get("dedupe_threshold") is not None:
            out.append(f"deduplicated at {version['dedupe_threshold']} (the paper: no deduplication)")
        held_out = version.get("held_out")
        if held_out or (held_out is None and version.get("validation") is not None):
            out.append(f"{held_out if held_out else 'some'} training questions held out for validation "
                       f"(writeback.validation {version.get('validation')!r}; the paper: every one trained on)")
        if version.get("limit"):
            out.append(f"trained on the first {version['limit']} training questions (the paper: every one)")
        examples = version.get("examples")
        if n.dataset == TRAINING_SET[0] and examples is not None and examples != TRAINING_SET[1]:
            out.append(f"written back from {examples:,} training questions (the paper: NQ's {TRAINING_SET[1]:,})")
        train = version.get("train")
        if n.dataset and train:
            from wbrag_ray.formats import dataset_name

            if dataset_name(str(train)) != n.dataset:
                out.append(f"written back from {dataset_name(str(train))} (the paper: {n.dataset}'s training set)")
        if version.get("rag_method") and n.method and version["rag_method"] != n.method:
            out.append(f"written back under {version['rag_method']} (the paper: {n.method})")
        union = made.get("union")
        if union != "score":
            out.append(f"union {union or 'not recorded'} (the paper: score, the merge into one top K)")
    return out


# The one training set whose size the WriteBack-RAG text states: NQ's N (§5.2)
TRAINING_SET = next((n.dataset, int(n.value)) for n in NUMBERS if n.column == "N (training questions)")


def _matches(n: PaperNumber, made: dict[str, Any]) -> bool:
    """Whether a result measures what the paper's number `n` measures: the same paper's setting (its dataset, RAG
    method, write-back or not, pruning ratio, router, adapter, and a Table 4 row's changed gate), whatever the
    models; a number whose setting the text leaves open where it picks the result is never matched."""
    if n.metric not in PERCENT_METRICS or n.dataset is None or n.method is None or made.get("dataset") != n.dataset \
            or made.get("method") != n.method:
        return False
    if n.paper == WRITEBACK:
        if made.get("router") or made.get("adapter") or made.get("pruning_ratio"):
            return False  # a Zero-RAG setting's result
        wb = bool(made.get("writeback"))
        if wb != (n.knowledge_base == "write-back"):
            return False
        if wb:  # the row whose gates the version has: a Table 4 row by its changed gate, else the defaults' row
            return n.gates is not None and n is _gate_row(n, made["writeback"])
        return True
    if made.get("writeback"):
        return False
    if n.method != "no-retrieval":
        if n.pruning_ratio is not None and made.get("pruning_ratio") != n.pruning_ratio:
            return False
        if n.router is not None and bool(made.get("router")) != n.router:
            return False
        if n.top_k is not None and n.top_k != ZERO_RAG_K and made.get("top_k") != n.top_k:
            return False  # a top-k robustness row is the result at its K
    return n.adapter is None or bool(made.get("adapter")) == n.adapter


def _gate_row(n: PaperNumber, version: dict[str, Any]) -> PaperNumber | None:
    """Of the numbers in `n`'s place (its table, dataset, method and metric) that differ only in the write-back gates,
    the one for `version`'s gates: the row whose changed gates (against the paper's defaults) the version has,
    else the defaults' row."""
    same_place = [m for m in NUMBERS if (m.where, m.dataset, m.method, m.metric, m.knowledge_base) ==
                  (n.where, n.dataset, n.method, n.metric, n.knowledge_base) and m.gates is not None]
    defaults = dict(WRITEBACK_GATES)
    for m in same_place:
        changed = [(k, v) for k, v in m.gates if defaults[k] != v]
        if changed and all(version.get(k) == v for k, v in changed):
            return m
    return next((m for m in same_place if dict(m.gates) == defaults), None)


def result_made_by(result: dict[str, Any]) -> dict[str, Any]:
    """What made a result (its metrics.json), as `paper_vs_run` compares it: its `made_by` where the evaluation
    recorded one; for older results what their fields say."""
    from wbrag_ray.formats import dataset_name

    made = dict(result.get("made_by") or {})
    gen = result.get("generator")
    made.setdefault("generator", gen.get("model") if isinstance(gen, dict) else gen)
    made.setdefault("retriever", result.get("embedder"))
    made.setdefault("top_k", result.get("top_k"))
    made.setdefault("answer_form", result.get("answer_form"))
    made.setdefault("method", result.get("method"))
    made.setdefault("router", result.get("router"))
    made.setdefault("union", (result.get("union") or {}).get("union") if result.get("writeback_version") else None)
    made.setdefault("writeback", {"version": result["writeback_version"]} if result.get("writeback_version") else None)
    made["dataset"] = dataset_name(str(made.get("dataset") or result.get("dataset", "")))
    return made


def paper_vs_run(results: dict[str, dict[str, Any]], zero_rag_rows: list[dict[str, Any]] | None = None,
                 config: WbragConfig | None = None, grid_dataset: str | None = None) -> list[dict[str, Any]]:
    """Each paper number a run's result measures (`_matches`), beside it: `results` are its evaluations'
    metrics.json by name. The models may differ: both are named, and `differs` lists every setting of the result
    that differs from the ones that made the paper's number (`paper_settings_differ`). Then Zero-RAG's retrieval
    speedup at 30% pruning: the paper's (its overview's 22%, and Table 4's latencies, dataset by dataset) beside
    the run's grid (`zero_rag_rows` of `grid_dataset`, under `config`)."""
    out = []
    for name, result in results.items():
        made = result_made_by(result)
        measured = [n for n in NUMBERS if result.get(n.metric) is not None and _matches(n, made)]
        for n in _one_generator_each(measured, made.get("generator")):
            value = result[n.metric]
            out.append(_row(n, 100 * value if n.metric in PERCENT_METRICS else value, made, name,
                            paper_settings_differ(n, made)))
    out += _speedup_rows(zero_rag_rows or [], config, grid_dataset)
    return out


def _one_generator_each(numbers: list[PaperNumber], generator: str | None) -> list[PaperNumber]:
    """Of numbers that differ only in the generator (Zero-RAG's rows for Llama3.3-70B, Llama3-70B, Llama3-8B), the
    run's generator's where the paper ran it, else the first the text gives (its main model's)."""
    groups: dict[tuple, list[PaperNumber]] = {}
    for n in numbers:
        key = (n.paper, n.dataset, n.method, n.metric, n.knowledge_base, n.pruning_ratio, n.router, n.adapter,
               n.top_k, n.gates)
        groups.setdefault(key, []).append(n)
    return [next((n for n in group if n.generator and same_model(generator, n.generator)), group[0])
            for group in groups.values()]


def _row(n: PaperNumber, run_value: float, made: dict[str, Any], result: str, differs: list[str],
         paper_value: float | None = None, shown: str | None = None) -> dict[str, Any]:
    return {"paper": n.paper, "where": n.where, "row": n.row, "column": n.column, "dataset": n.dataset or "",
            "method": n.method or "", "metric": n.metric, "paper_value": n.value if paper_value is None else paper_value,
            "paper_shown": shown or n.shown, "run_value": round(run_value, 2), "paper_model": n.generator or NOT_STATED,
            "run_model": made.get("generator"), "run_result": result, "quote": " ".join(n.quote.split()),
            "differs": differs}


_SEARCH = PaperNumber(ZERO_RAG, "", "", "", "speedup", "0", "", generator=NOT_STATED, retriever=ZERO_RAG_RETRIEVER,
                      top_k=ZERO_RAG_K)  # what a retrieval speedup's settings are compared with


def _speedup_rows(rows: list[dict[str, Any]], config: WbragConfig | None, grid_dataset: str | None
                  ) -> list[dict[str, Any]]:
    """The run's retrieval speedup at 30% pruning (its grid's naive cell, neither router nor adapter nor write-back
    changes the search) beside the paper's: the overview's 22%, and Table 4's, computed from its two latencies for
    the dataset the grid evaluated (`grid_dataset`; their average for another dataset)."""
    cells = [r for r in rows if r.get("ratio") == 0.3 and r.get("method") == "naive" and not r.get("writeback")
             and not r.get("router") and not r.get("adapter") and r.get("retrieval_speedup_pct") is not None]
    if not cells:
        return []
    from wbrag_ray.formats import dataset_name

    cell = cells[0]
    made = {"generator": config.generator.model if config else None,
            "retriever": config.embedder.model if config else None, "top_k": config.retrieval.top_k if config else None}
    # a search's speed: the retriever (its vector size) and K change it, the generator does not
    differs = [] if config is None else [d for d in paper_settings_differ(_SEARCH, made) if not d.startswith("generator")]
    out = []
    headline = next(n for n in NUMBERS if n.metric == "speedup")
    out.append(_row(headline, cell["retrieval_speedup_pct"], made, "grid naive at ratio 0.3", differs))
    grid_dataset = dataset_name(grid_dataset) if grid_dataset else None
    latency = {(n.dataset, n.pruning_ratio): n for n in NUMBERS if n.metric == "seconds" and n.paper == ZERO_RAG}
    datasets = {d for d, _ in latency}
    for dataset in dict.fromkeys(d for d, _ in latency):
        # the grid's dataset's row; Table 4's average where the grid evaluated another dataset
        if dataset != (grid_dataset if grid_dataset in datasets else None):
            continue
        full, pruned = latency[(dataset, 0.0)], latency[(dataset, 0.3)]
        value = round(100 * (1 - pruned.value / full.value), 2)
        out.append(_row(pruned, cell["retrieval_speedup_pct"], made, "grid naive at ratio 0.3", differs,
                        paper_value=value, shown=f"{value:g} (100 x (1 - {pruned.shown} / {full.shown}))")
                   | {"metric": "speedup", "column": f"{pruned.column} retrieval speedup"})
    return out


def format_paper_vs_run(rows: list[dict[str, Any]]) -> str:
    """The paper-vs-run table as `wbrag eval` prints it: each paper's number with where it stands, the run's
    beside it, and the run's settings that differ from the paper's."""
    if not rows:
        return ("paper vs this run: nothing this run evaluated measures what a number of the papers measures (the same "
                "paper's dataset, method and setting: wbrag_ray/paper_numbers.py)")
    lines = ["paper vs this run (acc, em, f1 in %; speedup in %):"]
    for r in rows:
        lines.append(f"  {r['paper']} {r['where']}, row {r['row']}, column {r['column']}: paper {r['paper_shown']} "
                     f"({r['paper_model']}), this run {r['run_value']:g} ({r['run_model'] or 'unknown'}, "
                     f"{r['run_result']})")
        lines.append(f"    differs: {'; '.join(r['differs']) or 'in none of the settings compared'}")
    return "\n".join(lines)
