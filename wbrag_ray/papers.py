"""Where a run departs from the two papers, and the papers' numbers beside a run's results: the one source that
`wbrag plan`, `wbrag run`, `wbrag eval`, the training stages, metrics.json (`departures`) and the report print from.
The papers' words are `paper_numbers`; a default that is another source's (FLARE's are FlashRAG's) says whose.
Over 500 lines in one module: "how does this run differ from the papers" is one question, asked once.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

from wbrag_ray.config import WbragConfig
from wbrag_ray.formats import dataset_name
from wbrag_ray.paper_numbers import (
    GEMMA,
    LLAMA_3_8B,
    LLAMA_3_70B,
    LLAMA_31_8B,
    LLAMA_33_70B,
    NOT_STATED,
    NUMBERS,
    SAYS,
    WRITEBACK,
    WRITEBACK_GATES,
    WRITEBACK_RETRIEVER,
    ZERO_RAG,
    ZERO_RAG_K,
    ZERO_RAG_LEARNING_RATE,
    ZERO_RAG_RETRIEVER,
    PaperNumber,
)

__all__ = ["WRITEBACK", "ZERO_RAG"]

FLASHRAG = "FlashRAG's default, which the WriteBack-RAG text does not state"


@dataclass(frozen=True)
class PaperChoice:
    paper: str  # which paper made the choice
    path: str  # the config path
    value: Any  # the paper's value
    says: str  # the choice in a few words
    cites: str = ""  # the key of its statement in paper_numbers.SAYS; "" where the paper's text does not state it
    source: str = ""  # whose choice it is when the paper's text does not state it


CHOICES = (
    PaperChoice(ZERO_RAG, "zerorag.qa_mode", "llm", "mastery from QA pairs an LLM writes for each sentence", "zr.qa"),
    PaperChoice(ZERO_RAG, "zerorag.mastery_metric", "em", "mastery = the target model's exact match on them", "zr.qa"),
    PaperChoice(ZERO_RAG, "zerorag.pruner", "lm", "a regression model predicts every sentence's mastery", "zr.pruner"),
    PaperChoice(ZERO_RAG, "zerorag.tune.learning_rate", ZERO_RAG_LEARNING_RATE, "noise-tolerant tuning at learning "
                f"rate {ZERO_RAG_LEARNING_RATE:g}", "zr.lr"),
    PaperChoice(ZERO_RAG, "zerorag.tune.targets", "gold",
                "every training query tuned on in three formats to its answer", "zr.tuning"),
    PaperChoice(ZERO_RAG, "retrieval.top_k", 20, "20 document candidates per query", "zr.retrieval"),
    PaperChoice(ZERO_RAG, "eval.answer_form", None, "answers scored as generated",
                source="the text scores the answers with exact match and names no other form"),
    PaperChoice(WRITEBACK, "eval.answer_form", None, "answers scored as generated",
                source="the text scores the answers with its metrics and names no other form"),
    PaperChoice(WRITEBACK, "retrieval.top_k", 5, "K = 5 retrieved documents", "wb.k"),
    PaperChoice(WRITEBACK, "retrieval.union", "score",
                "the base and write-back indices searched apart, their hits merged into one top K", "wb.merge"),
    PaperChoice(WRITEBACK, "writeback.metric", "auto",
                "the gates' metric per dataset: acc (NQ, BoolQ, zsRE, HotpotQA), F1 (FEVER), EM (SQuAD)", "wb.metrics"),
    *(PaperChoice(WRITEBACK, f"writeback.{key}", value, f"{gate} {key} = {value:g}", cites)
      for (key, value), (gate, cites) in zip(WRITEBACK_GATES, (("utility gate", "wb.gates"), ("utility gate", "wb.gates"),
                                                              ("document gate", "wb.doc_gate"),
                                                              ("document gate fallback", "wb.doc_gate")), strict=True)),
    PaperChoice(WRITEBACK, "writeback.dedupe_threshold", None, "only additive write-back, no deduplication",
                "wb.additive"),
    PaperChoice(WRITEBACK, "writeback.validation", None, "every training question scored and written back from "
                "(N = 79,168 for NQ)", "wb.all_questions"),
    PaperChoice(WRITEBACK, "rag.flare.threshold", 0.2, "FLARE retrieves below a token probability of 0.2",
                source=FLASHRAG),
    PaperChoice(WRITEBACK, "rag.flare.look_ahead_tokens", 64, "FLARE looks 64 tokens ahead", source=FLASHRAG),
    PaperChoice(WRITEBACK, "rag.flare.max_rounds", 5, "FLARE writes at most 5 sentences", source=FLASHRAG),
)
FLASHRAG_FLARE_TOKENS = 256  # FlashRAG's FLAREPipeline max_generation_length

# WriteBack-RAG's gate metric per dataset, by the dataset's name (`formats.dataset_name`: FlashRAG's layout).
GATE_METRICS = {"nq": "acc", "boolq": "acc", "zsre": "acc", "hotpotqa": "acc", "fever": "f1", "squad": "em"}


def gate_metric(dataset: str) -> str:
    """The paper's gate metric for a dataset name ('nq_train' -> acc, 'fever' -> f1); acc when it is unknown."""
    name = dataset.lower()
    for key, metric in GATE_METRICS.items():
        if name == key or name.startswith((key + "_", key + "-", key + ".")):
            return metric
    return "acc"


# What the bundled defaults are, by the model's own name
BUNDLED_MODELS = {"bundled:smollm2": "SmolLM2-135M-Instruct", "bundled:all-minilm-l6-v2": "all-MiniLM-L6-v2"}
# The generators each paper ran, as its text names them (a run's model matches where its name holds one of these,
# case and punctuation aside: `same_model`); WriteBack-RAG's main ones, and every one Zero-RAG reports
PAPER_GENERATORS = {WRITEBACK: (LLAMA_31_8B, GEMMA), ZERO_RAG: (LLAMA_33_70B, LLAMA_3_70B, LLAMA_3_8B)}
ZERO_RAG_QA_WRITER = "gpt-4o-mini"
# WriteBack-RAG's six datasets (its gate metrics name them), Zero-RAG's four (as the project names them)
WRITEBACK_DATASETS = tuple(GATE_METRICS)
ZERO_RAG_DATASETS = ("triviaqa", "popqa", "hotpotqa", "entityquestions")
ZERO_RAG_RATIOS = (0.0, 0.3, 0.7)  # the pruning ratios its text reports
PRUNER_PARAMETERS_B = 7.0  # "a 7B model trained to predict the Mastery-Score of a 70B model"


def _key(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def same_model(run_model: str | None, paper_model: str) -> bool:
    """Whether a run's model (a hub id or path) is the paper's as its text names it (Llama-3.3-70B-Instruct too)."""
    return bool(run_model) and _key(paper_model) in _key(str(run_model))


def model_name(spec: str) -> str:
    """A model as a departure names it: a bundled default with the model it resolves to."""
    return f"{spec} ({BUNDLED_MODELS[spec]})" if spec in BUNDLED_MODELS else spec


def parameters_b(model: str) -> float | None:
    """A model's size in billions of parameters as its name says it ('Llama-3.2-1B' -> 1.0); None where it does not."""
    found = re.findall(r"(?<![a-z0-9.])(\d+(?:\.\d+)?)b(?![a-z0-9])", model.lower().replace("_", "-"))
    return float(found[-1]) if found else None


def papers_followed(config: WbragConfig, writeback: bool = False, zero_rag: bool = False) -> tuple[str, ...]:
    """The papers a run or one evaluation follows: WriteBack-RAG beside a write-back version (`writeback`), Zero-RAG
    on a pruned or routed base or with the tuned adapter (`zero_rag`); with neither, the run's (writeback.train,
    zerorag.enabled), and both where it has neither (a plain base evaluation is either paper's baseline)."""
    if not (writeback or zero_rag):
        writeback, zero_rag = bool(config.writeback.train), config.zerorag.enabled
    return tuple(p for p, on in ((WRITEBACK, writeback), (ZERO_RAG, zero_rag)) if on) or (WRITEBACK, ZERO_RAG)


def claims_to_follow(config: WbragConfig, papers: tuple[str, ...]) -> bool:
    """Whether a config sets out to reproduce one of `papers`: it runs a generator that paper ran."""
    return any(same_model(config.generator.model, m) for p in papers for m in PAPER_GENERATORS[p])


def _quote(key: str) -> str:
    return " ".join(SAYS[key].quote.split()) if key else ""


@dataclass(frozen=True)
class Departure:
    paper: str
    kind: str  # "setting" (a config value) or "method" (what the implementation, the models or the data do)
    what: str
    cites: str = ""  # the paper's words it departs from (paper_numbers.SAYS), or whose choice it is


@dataclass(frozen=True)
class MadeBy:
    """What made a result beyond its config values, as the run's stages recorded it (`evaluation.made_by`); None:
    not made, or not recorded."""

    papers: tuple[str, ...] = ()  # the papers the result follows; (): the config's (`papers_followed`)
    train: str | None = None  # the write-back version's training set; None: writeback.train
    distiller: str | None = None  # the generator that distilled the write-back version searched
    tune_rows: int | None = None  # the tuning rows built (zerorag.tune.targets: own) ...
    tune_rows_dropped: int | None = None  # ... and dropped for want of an own right answer
    units_dropped: int | None = None  # distilled units the version's checks dropped (its stats' *_dropped counts)


def _setting_departures(config: WbragConfig, paper: str | None, train: str | None) -> list[Departure]:
    """'path: value (the paper: its value, what it says)' for each config value that differs from the papers' (or
    one paper's). writeback.metric is compared resolved for the training set `train` (default writeback.train)."""
    train = train or config.writeback.train
    out = []
    for choice in CHOICES:
        if (paper and choice.paper != paper) or (choice.path.startswith("zerorag.tune.")
                                                 and not config.zerorag.tune.enabled):
            continue
        value, wanted = functools.reduce(getattr, choice.path.split("."), config), choice.value
        whose = FLASHRAG if choice.source == FLASHRAG else f"the {choice.paper} paper"
        cites = _quote(choice.cites) or choice.source
        if choice.path == "writeback.metric":  # the gates run on nothing without a training set
            if not train:
                continue
            wanted = gate_metric(dataset_name(train))
            value = wanted if value == "auto" else value
            shown = f"{value!r} for {dataset_name(train)}"
        else:
            shown = f"{value!r} ({BUNDLED_MODELS[value]})" if value in BUNDLED_MODELS else repr(value)
        if value != wanted:
            out.append(Departure(choice.paper, "setting", f"{choice.path}: {shown} ({whose}: {wanted!r}, "
                                                          f"{choice.says})", cites))
    return out


def _method_departures(config: WbragConfig, paper: str | None, dataset: str | None,
                       made: MadeBy) -> list[Departure]:
    """Where the run's method differs from the paper's beyond config values: what the implementation does, and
    the models and data (`dataset`, default eval.dataset). 'what the run does (the <paper> paper: what it did)'."""
    methods = set(config.eval.methods)
    out: list[Departure] = []
    wb, z = config.writeback, config.zerorag
    dataset = dataset or config.eval.dataset
    evaluated = dataset_name(dataset) if dataset else None

    def add(who: str, what: str, cites: str = "", source: str = "") -> None:
        out.append(Departure(who, "method", what, _quote(cites) or source))

    if "replug-vote" in methods or wb.rag_method == "replug-vote":
        add(WRITEBACK, "replug-vote stands in for REPLUG: one answer per document, then a vote (the WriteBack-RAG "
                       "paper: RePlug \"ensembles generation probabilities over documents\"; the hf backend's replug "
                       "does)", "wb.methods")
    if "self-rag" in methods or wb.rag_method == "self-rag":
        add(WRITEBACK, "Self-RAG is prompted: the generator is asked each reflection question (the WriteBack-RAG "
                       "paper runs Self-RAG with the same LLM as every method and does not say how it judges)",
            "wb.same_llm")
    if "flare" in methods or wb.rag_method == "flare":  # rag/flare.py
        f = config.rag.flare
        add(WRITEBACK, f"FLARE retrieves where a look-ahead token's probability is below rag.flare.threshold = "
                       f"{f.threshold:g} and writes at most rag.flare.max_rounds x rag.flare.look_ahead_tokens = "
                       f"{f.max_rounds} x {f.look_ahead_tokens} = {f.max_rounds * f.look_ahead_tokens} new tokens "
                       f"(FlashRAG's defaults, which the WriteBack-RAG text does not state: threshold 0.2, at most "
                       f"{FLASHRAG_FLARE_TOKENS} tokens in 5 rounds of 64)",
            source=FLASHRAG)
    add(WRITEBACK, "distillation is two calls, extract then rewrite from the extract only (the WriteBack-RAG paper: "
                   "one distillation of the retained documents)", "wb.distiller")
    # ground_extraction's MIN_OVERLAP and fallback, parse_unit's answer-lead rule (writeback/distill.py)
    add(WRITEBACK, "the distiller's output is grounded by heuristics: each extracted sentence replaced by the source "
                   "sentence holding at least 0.6 of its words, the two source sentences nearest the question where "
                   "none does, a leading 'The answer is' stripped from the unit (the WriteBack-RAG paper: the "
                   "distiller's units as the LLM writes them)", "wb.distiller")
    if made.units_dropped:
        add(WRITEBACK, f"{made.units_dropped} distilled rewrites or units of the version were dropped by its statement "
                       "check (the WriteBack-RAG paper: every distilled unit is written back)", "wb.distiller")
    if wb.tau_delta > 0:
        add(WRITEBACK, f"the utility gate keeps delta > tau_delta = {wb.tau_delta:g} (the WriteBack-RAG paper sets "
                       "tau_delta = 0.01 and says any strict improvement suffices, delta > 0: the same where the gate "
                       "metric is 0 or 1 (acc, EM), not on F1)", "wb.gates")
    add(WRITEBACK, "Table 3's lengths are whitespace words (the WriteBack-RAG paper: tokens)", "wb.tokens")
    if made.distiller and made.distiller != config.generator.model:
        add(WRITEBACK, f"the write-back version was distilled by {model_name(made.distiller)}, the results generated "
                       f"by {model_name(config.generator.model)} (the WriteBack-RAG paper: the same LLM is generator "
                       "and distiller)", "wb.same_llm")
    for who in (WRITEBACK, ZERO_RAG):
        if who == ZERO_RAG and not z.enabled:
            continue
        models = PAPER_GENERATORS[who]
        if not any(same_model(config.generator.model, m) for m in models):
            add(who, f"the generator is {model_name(config.generator.model)} (the {who} paper: {' and '.join(models)})",
                "wb.same_llm" if who == WRITEBACK else "zr.target")
    g, invariant = config.generator, config.generator.batch_invariance()
    if g.backend != "openai" and invariant is not True:  # vLLM's batch-invariant kernels off (or hf's length buckets)
        said = "false" if g.batch_invariant is False else "auto: off for a tensor-parallel replica" + (
            "" if invariant is False else ", which tensor_parallel_size auto may choose")
        for who in (WRITEBACK, ZERO_RAG) if z.enabled else (WRITEBACK,):
            add(who, f"generator.batch_invariant {said}: a greedy answer can depend on the prompts batched with it, "
                     f"so a repeated or resumed pass can answer otherwise (the {who} paper does not say how its "
                     "answers were batched)", source="this project's setting")
    _retriever_and_dataset(add, WRITEBACK, WRITEBACK_RETRIEVER, WRITEBACK_DATASETS, config.embedder.model, evaluated)
    if wb.train and dataset_name(wb.train) not in WRITEBACK_DATASETS:
        add(WRITEBACK, f"written back from {dataset_name(wb.train)}, whose gate metric the paper did not choose: acc "
                       f"(the WriteBack-RAG paper: {', '.join(WRITEBACK_DATASETS)})", "wb.metrics")
    if z.enabled:
        _zero_rag_methods(add, config, made)
        _retriever_and_dataset(add, ZERO_RAG, ZERO_RAG_RETRIEVER, ZERO_RAG_DATASETS, config.embedder.model, evaluated)
    return [d for d in out if paper in (None, d.paper)]


def _zero_rag_methods(add, config: WbragConfig, made: MadeBy) -> None:
    """Zero-RAG's method departures, each given to `add(paper, what, cites)`."""
    z, t = config.zerorag, config.zerorag.tune
    add = functools.partial(add, ZERO_RAG)
    add("sentences are split by nupunkt (the Zero-RAG paper: NLTK's sentence tokenizer)", "zr.segmentation")
    add("the pruner drops the sentences of highest predicted mastery, as the paper's Appendix A.1 (the Zero-RAG "
        "paper disagrees with itself: its Section 3.1 prunes a sentence whose score is below the threshold)",
        "zr.direction")
    others = [r for r in z.ratios if r not in ZERO_RAG_RATIOS]
    if others:
        add(f"zerorag.ratios prunes at {', '.join(f'{r:g}' for r in others)} too, a ratio the Zero-RAG paper does not "
            "report (the Zero-RAG paper: 0, 30 and 70% pruning)", "zr.ratios")
    if config.index.unit == "sentence":
        add(f"the retrieval candidates are sentences: {config.retrieval.top_k} retrieved sentences per query (the "
            "Zero-RAG paper: 20 document candidates per query)", "zr.retrieval")
    if z.qa_mode == "llm" and z.qa_generator is None:
        add("the target model writes its own mastery QA pairs, zerorag.qa_generator unset (the Zero-RAG paper: "
            "GPT-4o-mini writes them, the target model answers)", "zr.qa_writer")
    elif z.qa_mode == "llm" and ZERO_RAG_QA_WRITER not in z.qa_generator.model.lower():
        add(f"{model_name(z.qa_generator.model)} writes the mastery QA pairs (the Zero-RAG paper: GPT-4o-mini writes "
            "them)", "zr.qa_writer")
    if z.pruner == "lm" or "lm" in z.train_pruners:
        size = parameters_b(z.lm_pruner.backbone)
        if size != PRUNER_PARAMETERS_B:
            said = f"a {size:g}B model" if size is not None else "a model of a size its name does not say"
            add(f"the LM pruner's backbone is {model_name(z.lm_pruner.backbone)}, {said} (the Zero-RAG paper: a 7B "
                "model trained to predict a 70B model's mastery)", "zr.pruner")
    if z.router:  # zerorag/router.py, models/router.py
        labeller = "the tuned adapter" if t.enabled else "the untuned generator (zerorag.tune.enabled: false)"
        add(f"the query router's labels are closed-book {z.router_metric} > 0 (zerorag.router_metric) of {labeller} "
            "on zerorag.train (the Zero-RAG paper: the noise-tolerant model's performance labels each query)",
            "zr.router")
        add("the query router is a class-balanced logistic regression on the query embedding, retrieval skipped at "
            f"P(mastered) >= zerorag.router_threshold = {z.router_threshold:g} (the Zero-RAG paper: a binary "
            "classifier trained with cross-entropy, its input and threshold not stated)", "zr.router")
    if t.enabled:  # training/noise_tolerant.build_examples, zerorag/tune.py
        k, wide = t.docs_per_format or config.retrieval.top_k, max(config.retrieval.top_k, t.retrieve_k)
        add(f"noise-tolerant tuning builds its three formats from max(retrieval.top_k, zerorag.tune.retrieve_k) = "
            f"{wide} documents retrieved per question, {k} in a prompt (zerorag.tune.docs_per_format, unset: "
            f"retrieval.top_k): relevant = the top {k} where one of them holds a gold answer, else the top {k - 1} and "
            "the best-ranked deeper one that does, injected last; distracting = the best-ranked retrieved without a gold answer, topped up "
            "with documents retrieved for other questions; none = the closed-book prompt; a question whose retrieved "
            "documents hold no gold answer gets no relevant row, one without a gold answer no rows (the Zero-RAG "
            "paper: query with relevant documents, query with distracting documents, and query without retrieval)",
            "zr.tuning")
        if t.targets == "own":
            counted = (f": {made.tune_rows_dropped} of {made.tune_rows} rows dropped"
                       if made.tune_rows is not None and made.tune_rows_dropped is not None else "")
            add("noise-tolerant tuning keeps only the rows whose own answer holds a gold answer (targets: "
                f"own){counted}: the model is tuned only on questions it already answers (the Zero-RAG "
                "paper: every training query, in three formats)", "zr.tuning")


def _retriever_and_dataset(add, who: str, retriever: str, datasets, embedder: str, evaluated: str | None) -> None:
    """Where the run's retriever (`embedder`) and evaluated dataset are not the paper's, given to `add`."""
    if retriever.lower() not in embedder.lower():
        add(who, f"the retriever is {model_name(embedder)} (the {who} paper: {retriever})",
            "wb.k" if who == WRITEBACK else "zr.retrieval")
    if evaluated and evaluated not in datasets:
        add(who, f"evaluated on {evaluated} (the {who} paper: {', '.join(datasets)})",
            "wb.datasets" if who == WRITEBACK else "zr.datasets")


def run_departures(config: WbragConfig, papers: tuple[str, ...] | None = None, train: str | None = None,
                   dataset: str | None = None, made: MadeBy | None = None) -> list[Departure]:
    """The departures from the papers a run follows (`papers`, else made.papers, else `papers_followed`), both
    kinds. `config` and `made` are what made the result (`evaluation.made_by.made_config` for an evaluation)."""
    made = made or MadeBy()
    papers = papers or made.papers or papers_followed(config)
    train = train or made.train
    return [d for p in papers for d in (*_setting_departures(config, p, train),
                                        *_method_departures(config, p, dataset, made))]


def print_departures(config: WbragConfig, papers: str | tuple[str, ...] | None = None, train: str | None = None,
                     dataset: str | None = None, made: MadeBy | None = None) -> list[Departure]:
    """Print `run_departures` as a command starts: one line each for a config that runs one of the papers'
    generators (`claims_to_follow`), else one line with their count and where they are listed. Returns them."""
    papers = (papers,) if isinstance(papers, str) else papers or (made and made.papers) or papers_followed(config)
    found = run_departures(config, papers, train, dataset, made)
    followed = " and ".join(papers)
    if not found:
        print(f"this run departs from {followed} in none of the recorded choices", flush=True)
    elif claims_to_follow(config, papers):
        print(f"this run departs from {followed} in:", flush=True)
        for d in found:
            print(f"  [{d.paper}] {d.what}", flush=True)
    else:
        print(f"this run departs from {followed} in {len(found)} choices (its generator is none the papers ran; listed "
              "in every evaluation's metrics.json ('departures') and the report's Configuration section)", flush=True)
    return found


def recorded_departures(results: dict[str, dict[str, Any]]) -> list[tuple[dict[str, str], list[str]]]:
    """Each departure the evaluations recorded (metrics.json's `departures`), once, with the results that
    recorded it, in the order first seen."""
    seen: dict[tuple[str, str, str], tuple[dict[str, str], list[str]]] = {}
    for name, result in results.items():
        for d in result.get("departures") or []:
            seen.setdefault((d["paper"], d["kind"], d["what"]), (d, []))[1].append(name)
    return list(seen.values())


# --- the papers' numbers beside a run's results ------------------------------------------------------------------
PERCENT_METRICS = ("em", "f1", "acc")  # 0-1 in metrics.json, in % in the papers: the numbers a result is set beside


def paper_settings_differ(n: PaperNumber, made: dict[str, Any]) -> list[str]:
    """Each setting that changes a number in which the run's result (`made`: its metrics.json's `made_by`) differs
    from what made the paper's number `n`, a setting the text does not state named as such. 'K 5 (the paper: 20)'."""
    out = []
    gen = made.get("generator")
    if n.generator is None or not same_model(gen, n.generator):
        out.append(f"generator {model_name(gen) if gen else 'unknown'} (the paper: {n.generator or NOT_STATED})")
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
        out += _version_differs(n, made)
    return out


def _version_differs(n: PaperNumber, made: dict[str, Any]) -> list[str]:
    out = []
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
    if n.dataset and train and dataset_name(str(train)) != n.dataset:
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
    """Whether a result measures what `n` measures: the same paper's dataset, RAG method, write-back or not, pruning
    ratio, router, adapter and Table 4 row, whatever the models."""
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
    """Of the numbers in `n`'s place differing only in the gates, the row whose changed gates `version` has, else
    the defaults' row."""
    same_place = [m for m in NUMBERS if (m.where, m.dataset, m.method, m.metric, m.knowledge_base) ==
                  (n.where, n.dataset, n.method, n.metric, n.knowledge_base) and m.gates is not None]
    defaults = dict(WRITEBACK_GATES)
    for m in same_place:
        changed = [(k, v) for k, v in m.gates if defaults[k] != v]
        if changed and all(version.get(k) == v for k, v in changed):
            return m
    return next((m for m in same_place if dict(m.gates) == defaults), None)


def paper_vs_run(results: dict[str, dict[str, Any]], zero_rag_rows: list[dict[str, Any]] | None = None,
                 config: WbragConfig | None = None, grid_dataset: str | None = None) -> list[dict[str, Any]]:
    """Each paper number a result (`results`: metrics.json by name) measures, beside it, with every setting that
    differs (`paper_settings_differ`); then Zero-RAG's retrieval speedup beside the run's grid (`zero_rag_rows`)."""
    out = []
    for name, result in results.items():
        made = result.get("made_by") or {}  # what made the result (`evaluation.made_by`)
        measured = [n for n in NUMBERS if result.get(n.metric) is not None and _matches(n, made)]
        for n in _one_generator_each(measured, made.get("generator")):  # acc, em or f1 (`_matches`): in %
            out.append(_row(n, 100 * result[n.metric], made, name, paper_settings_differ(n, made)))
    out += _speedup_rows(zero_rag_rows or [], config, grid_dataset)
    return out


def _one_generator_each(numbers: list[PaperNumber], generator: str | None) -> list[PaperNumber]:
    """Of numbers that differ only in the generator, the run's generator's where the paper ran it, else the first."""
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
    """The grid's retrieval speedup at 30% pruning (its naive cell) beside the paper's 22% and Table 4's, computed
    from its latencies for the grid's dataset (`grid_dataset`; their average for another dataset)."""
    cells = [r for r in rows if r.get("ratio") == 0.3 and r.get("method") == "naive" and not r.get("writeback")
             and not r.get("router") and not r.get("adapter") and r.get("retrieval_speedup_pct") is not None]
    if not cells:
        return []
    cell = cells[0]
    made = {"generator": config.generator.model if config else None,
            "retriever": config.embedder.model if config else None, "top_k": config.retrieval.top_k if config else None}
    # a search's speed: the retriever (its vector size) and K change it, the generator does not
    differs = [] if config is None else [d for d in paper_settings_differ(_SEARCH, made) if not d.startswith("generator")]
    headline = next(n for n in NUMBERS if n.metric == "speedup")
    latency = {(n.dataset, n.pruning_ratio): n for n in NUMBERS if n.metric == "seconds" and n.paper == ZERO_RAG}
    # the grid's dataset's row; Table 4's average (dataset None) where the grid evaluated another dataset
    dataset = dataset_name(grid_dataset) if grid_dataset else None
    dataset = dataset if (dataset, 0.0) in latency else None
    full, pruned = latency[(dataset, 0.0)], latency[(dataset, 0.3)]
    value = round(100 * (1 - pruned.value / full.value), 2)
    return [_row(headline, cell["retrieval_speedup_pct"], made, "grid naive at ratio 0.3", differs),
            _row(pruned, cell["retrieval_speedup_pct"], made, "grid naive at ratio 0.3", differs, paper_value=value,
                 shown=f"{value:g} (100 x (1 - {pruned.shown} / {full.shown}))")
            | {"metric": "speedup", "column": f"{pruned.column} retrieval speedup"}]


def format_paper_vs_run(rows: list[dict[str, Any]]) -> str:
    """The paper-vs-run table as `wbrag eval` prints it as it ends."""
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
