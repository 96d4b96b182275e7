"""Where a run departs from the two papers.

The papers' own words are in `wbrag_ray.paper_numbers` (every number with its table or section, row, column and
the settings that made it, and the statements a departure cites), checked against the texts in
`../shared/papers/` by tests/test_papers.py. Nothing here states what the texts do not: where a default is
another source's (FLARE's budgets are FlashRAG's), the departure says whose.

A run's departures (`run_departures`) come from what made its results: an evaluation beside a write-back version
is compared with the version's recorded settings, one with the tuned adapter with the adapter's
(`wbrag_ray.evaluation.made_by` puts those in place of the evaluating config's). They are recorded in every
evaluation's metrics.json (`departures`), the report lists the ones its evaluations recorded, and `wbrag plan`,
`wbrag run`, `wbrag eval` and the training stages print them as they start: the whole block where the config runs a
paper's generator (it sets out to reproduce that paper), else one line with their count and where they are listed
(`print_departures`).

The papers' numbers beside a run's results: `wbrag_ray.paper_vs_run`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from wbrag_ray.config import WbragConfig
from wbrag_ray.paper_numbers import (
    GEMMA,
    LLAMA_3_8B,
    LLAMA_3_70B,
    LLAMA_31_8B,
    LLAMA_33_70B,
    SAYS,
    WRITEBACK,
    WRITEBACK_GATES,
    WRITEBACK_RETRIEVER,
    ZERO_RAG,
    ZERO_RAG_LEARNING_RATE,
    ZERO_RAG_RETRIEVER,
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
    PaperChoice(WRITEBACK, "rag.flare.look_ahead_tokens", 64, "FLARE looks 64 tokens ahead", source=FLASHRAG),
    PaperChoice(WRITEBACK, "rag.flare.max_rounds", 5, "FLARE writes at most 5 sentences", source=FLASHRAG),
)

# WriteBack-RAG's gate metric per dataset, by the dataset's name (`formats.dataset_name`: FlashRAG's layout).
GATE_METRICS = {"nq": "acc", "boolq": "acc", "zsre": "acc", "hotpotqa": "acc", "fever": "f1", "squad": "em"}


def gate_metric(dataset: str) -> str:
    """The paper's gate metric for a dataset name ('nq_train' -> acc, 'fever' -> f1); acc when it is unknown."""
    name = dataset.lower()
    for key, metric in GATE_METRICS.items():
        if name == key or name.startswith((key + "_", key + "-", key + ".")):
            return metric
    return "acc"


def _value(config: WbragConfig, path: str) -> Any:
    value: Any = config
    for part in path.split("."):
        value = getattr(value, part)
    return value


# What the bundled defaults are, by the model's own name
BUNDLED_MODELS = {"bundled:smollm2": "SmolLM2-135M-Instruct", "bundled:all-minilm-l6-v2": "all-MiniLM-L6-v2"}
# The generators each paper ran, as its text names them (a run's model matches where its name holds one of these,
# case and punctuation aside: `same_model`); WriteBack-RAG's main ones, and every one Zero-RAG reports
PAPER_GENERATORS = {WRITEBACK: (LLAMA_31_8B, GEMMA), ZERO_RAG: (LLAMA_33_70B, LLAMA_3_70B, LLAMA_3_8B)}
ZERO_RAG_QA_WRITER = "gpt-4o-mini"
# WriteBack-RAG's six datasets (its gate metrics name them), Zero-RAG's four (FlashRAG's names)
WRITEBACK_DATASETS = tuple(GATE_METRICS)
ZERO_RAG_DATASETS = ("triviaqa", "popqa", "hotpotqa", "entityquestions")
PRUNER_PARAMETERS_B = 7.0  # "a 7B model trained to predict the Mastery-Score of a 70B model"


def _key(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def same_model(run_model: str | None, paper_model: str) -> bool:
    """Whether a run's model (a hub id or path) is the paper's (named as its text names it): 'meta-llama/Llama-3.3-
    70B-Instruct' is Llama3.3-70B."""
    return bool(run_model) and _key(paper_model) in _key(str(run_model))


def model_name(spec: str) -> str:
    """A model as a departure names it: a bundled default with the model it resolves to."""
    return f"{spec} ({BUNDLED_MODELS[spec]})" if spec in BUNDLED_MODELS else spec


def parameters_b(model: str) -> float | None:
    """A model's size in billions of parameters as its name says it ('Llama-3.2-1B' -> 1.0); None where it does not."""
    found = re.findall(r"(?<![a-z0-9.])(\d+(?:\.\d+)?)b(?![a-z0-9])", model.lower().replace("_", "-"))
    return float(found[-1]) if found else None


def papers_followed(config: WbragConfig, writeback: bool | None = None, zero_rag: bool | None = None
                    ) -> tuple[str, ...]:
    """The papers a run (or one evaluation of it) follows: WriteBack-RAG where it trains or searches a write-back
    version (default: writeback.train is set), Zero-RAG where it prunes, routes or tunes (default:
    zerorag.enabled); both where both, and both where neither (a plain base evaluation is either paper's
    baseline)."""
    wb = bool(config.writeback.train) if writeback is None else writeback
    z = config.zerorag.enabled if zero_rag is None else zero_rag
    return tuple(p for p, on in ((WRITEBACK, wb), (ZERO_RAG, z)) if on) or (WRITEBACK, ZERO_RAG)


def claims_to_follow(config: WbragConfig, papers: tuple[str, ...]) -> bool:
    """Whether a config sets out to reproduce one of `papers`: it runs a generator that paper ran (the paper
    configs do; the demo's SmolLM2 does not)."""
    return any(same_model(config.generator.model, m) for p in papers for m in PAPER_GENERATORS[p])


def _applies(config: WbragConfig, choice: PaperChoice) -> bool:
    """Whether a choice says anything about this run: the tuning's only where it tunes."""
    if choice.path.startswith("zerorag.tune."):
        return config.zerorag.tune.enabled
    return True


def _quote(key: str) -> str:
    return " ".join(SAYS[key].quote.split()) if key else ""


def departures(config: WbragConfig, paper: str | None = None, train: str | None = None) -> list[str]:
    """'path: value (the paper: its value, what it says)' for each choice of `config` that differs from the
    papers (or from one of them). Settings resolved from the data are compared resolved: with the write-back
    training file `train` (default: writeback.train), writeback.metric is the metric the gates use (auto resolved
    by the dataset's name, FlashRAG's layout) and the paper's is its metric for that dataset, so a resolution the
    paper did not make shows, and an explicit value the paper used does not; with no training set, the gates
    run on nothing and their metric is not compared. A bundled default is named with the model it is."""
    return [d.what for d in _setting_departures(config, paper, train)]


@dataclass(frozen=True)
class Departure:
    paper: str
    kind: str  # "setting" (a config value) or "method" (what the implementation, the models or the data do)
    what: str
    cites: str = ""  # the paper's words it departs from (paper_numbers.SAYS), or whose choice it is

    def record(self) -> dict[str, str]:
        return {"paper": self.paper, "kind": self.kind, "what": self.what, "cites": self.cites}


def _setting_departures(config: WbragConfig, paper: str | None, train: str | None) -> list[Departure]:
    from wbrag_ray.formats import dataset_name

    train = train or config.writeback.train
    out = []
    for choice in CHOICES:
        if (paper and choice.paper != paper) or not _applies(config, choice):
            continue
        value, wanted = _value(config, choice.path), choice.value
        whose = FLASHRAG if choice.source == FLASHRAG else f"the {choice.paper} paper"
        cites = _quote(choice.cites) or choice.source
        if choice.path == "writeback.metric":
            if not train:
                continue
            name = dataset_name(train)
            wanted = gate_metric(name)
            value = wanted if value == "auto" else value
            if value != wanted:
                out.append(Departure(choice.paper, "setting", f"{choice.path}: {value!r} for {name} ({whose}: "
                                                              f"{wanted!r}, {choice.says})", cites))
            continue
        if value != wanted:
            shown = f"{value!r} ({BUNDLED_MODELS[value]})" if isinstance(value, str) and value in BUNDLED_MODELS \
                else repr(value)
            out.append(Departure(choice.paper, "setting", f"{choice.path}: {shown} ({whose}: {wanted!r}, "
                                                          f"{choice.says})", cites))
    return out


@dataclass(frozen=True)
class MadeBy:
    """What made a result beyond the config values compared: what the run's stages recorded
    (`evaluation.made_by.made_config`). None: not made, or not recorded."""

    distiller: str | None = None  # the generator that distilled the write-back version searched
    tune_rows: int | None = None  # the tuning rows built (zerorag.tune.targets: own) ...
    tune_rows_dropped: int | None = None  # ... and dropped for want of an own right answer
    units_dropped: int | None = None  # distilled units the version's checks dropped (its stats' *_dropped counts)


def method_departures(config: WbragConfig, paper: str | None = None, dataset: str | None = None,
                      made: MadeBy | None = None) -> list[str]:
    """Where this run's *method* differs from the paper's, beyond the config values `departures` compares: what
    the implementation does differently (whatever the config), and the choices of model and data the paper made
    that a config value cannot state as one (the generator, the retriever, the QA writer, the pruner's size, the
    evaluated dataset: `dataset`, default eval.dataset). 'what the run does (the <paper> paper: what it did)'."""
    return [d.what for d in _method_departures(config, paper, dataset, made or MadeBy())]


def _method_departures(config: WbragConfig, paper: str | None, dataset: str | None,
                       made: MadeBy) -> list[Departure]:
    from wbrag_ray.formats import dataset_name

    methods = set(config.eval.methods)
    out: list[Departure] = []
    wb, z = config.writeback, config.zerorag
    dataset = dataset or config.eval.dataset
    evaluated = dataset_name(dataset) if dataset else None

    def add(who: str, what: str, cites: str = "") -> None:
        out.append(Departure(who, "method", what, _quote(cites)))

    if "replug-vote" in methods or wb.rag_method == "replug-vote":
        add(WRITEBACK, "replug-vote stands in for REPLUG: one answer per document, then a vote (the WriteBack-RAG "
                       "paper: REPLUG mixes the documents' next-token distributions; the hf backend's replug does)",
            "wb.methods")
    if "self-rag" in methods or wb.rag_method == "self-rag":
        add(WRITEBACK, "Self-RAG is prompted: the generator is asked each reflection question (the WriteBack-RAG "
                       "paper: Self-RAG's fine-tuned model emits reflection tokens)", "wb.methods")
    add(WRITEBACK, "distillation is two calls, extract then rewrite from the extract only (the WriteBack-RAG paper: "
                   "one distillation of the retained documents)", "wb.distiller")
    # ground_extraction's min_overlap and fallback, parse_unit's answer-lead rule (writeback/distill.py)
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
    out += _retriever_and_dataset(WRITEBACK, WRITEBACK_RETRIEVER, WRITEBACK_DATASETS, config, evaluated, "wb")
    if wb.train and dataset_name(wb.train) not in WRITEBACK_DATASETS:
        add(WRITEBACK, f"written back from {dataset_name(wb.train)}, whose gate metric the paper did not choose: acc "
                       f"(the WriteBack-RAG paper: {', '.join(WRITEBACK_DATASETS)})", "wb.metrics")
    if z.enabled:
        add(ZERO_RAG, "sentences are split by nupunkt (the Zero-RAG paper: NLTK's sentence tokenizer)",
            "zr.segmentation")
        add(ZERO_RAG, "the pruner drops the sentences of highest predicted mastery, as the paper's Appendix A.1 (the "
                      "Zero-RAG paper disagrees with itself: its Section 3.1 prunes a sentence whose score is below "
                      "the threshold)", "zr.direction")
        if config.index.unit == "sentence":
            add(ZERO_RAG, f"the retrieval candidates are sentences: {config.retrieval.top_k} retrieved sentences per "
                          "query (the Zero-RAG paper: 20 document candidates per query)", "zr.retrieval")
        if z.qa_mode == "llm" and z.qa_generator is None:
            add(ZERO_RAG, "the target model writes its own mastery QA pairs, zerorag.qa_generator unset (the Zero-RAG "
                          "paper: GPT-4o-mini writes them, the target model answers)", "zr.qa_writer")
        elif z.qa_mode == "llm" and ZERO_RAG_QA_WRITER not in z.qa_generator.model.lower():
            add(ZERO_RAG, f"{model_name(z.qa_generator.model)} writes the mastery QA pairs (the Zero-RAG paper: "
                          "GPT-4o-mini writes them)", "zr.qa_writer")
        if z.pruner == "lm" or "lm" in z.train_pruners:
            size = parameters_b(z.lm_pruner.backbone)
            if size != PRUNER_PARAMETERS_B:
                said = f"a {size:g}B model" if size is not None else "a model of a size its name does not say"
                add(ZERO_RAG, f"the LM pruner's backbone is {model_name(z.lm_pruner.backbone)}, {said} (the Zero-RAG "
                              "paper: a 7B model trained to predict a 70B model's mastery)", "zr.pruner")
        if z.tune.enabled and z.tune.targets == "own":
            counted = (f": {made.tune_rows_dropped} of {made.tune_rows} rows dropped"
                       if made.tune_rows is not None and made.tune_rows_dropped is not None else "")
            add(ZERO_RAG, "noise-tolerant tuning keeps only the rows whose own answer holds a gold answer (targets: "
                          f"own){counted}: the model is tuned only on questions it already answers (the Zero-RAG "
                          "paper: every training query, in three formats)", "zr.tuning")
        out += _retriever_and_dataset(ZERO_RAG, ZERO_RAG_RETRIEVER, ZERO_RAG_DATASETS, config, evaluated, "zr")
    return [d for d in out if paper in (None, d.paper)]


def _retriever_and_dataset(who: str, retriever: str, datasets, config: WbragConfig,
                           evaluated: str | None, prefix: str) -> list[Departure]:
    """`who`'s departures in the retriever and the evaluated dataset."""
    out = []
    if retriever.lower() not in config.embedder.model.lower():
        out.append(Departure(who, "method", f"the retriever is {model_name(config.embedder.model)} (the {who} paper: "
                                            f"{retriever})", _quote("wb.k" if prefix == "wb" else "zr.retrieval")))
    if evaluated and evaluated not in datasets:
        out.append(Departure(who, "method", f"evaluated on {evaluated} (the {who} paper: {', '.join(datasets)})",
                             _quote(f"{prefix}.datasets")))
    return out


def run_departures(config: WbragConfig, papers: tuple[str, ...] | None = None, train: str | None = None,
                   dataset: str | None = None, made: MadeBy | None = None) -> list[Departure]:
    """A run's departures from the papers it follows (`papers`, default `papers_followed`), resolved: the dataset
    by FlashRAG's layout, the gate metric for the training set (`train`, default writeback.train), each bundled
    default by the model it is, the evaluated `dataset` (default eval.dataset) against the paper's. `config` is
    what made the result: for an evaluation beside a version or with the adapter, their recorded settings
    (`evaluation.made_by.made_config`, which also gives `made`). The one source of what metrics.json, the report
    and the block printed as commands start say."""
    papers = papers or papers_followed(config)
    made = made or MadeBy()
    return [d for p in papers for d in (*_setting_departures(config, p, train),
                                        *_method_departures(config, p, dataset, made))]


WHERE_LISTED = "every evaluation's metrics.json ('departures') and the report's Configuration section"


def print_departures(config: WbragConfig, papers: str | tuple[str, ...] | None = None, train: str | None = None,
                     dataset: str | None = None, made: MadeBy | None = None) -> list[Departure]:
    """Print `run_departures`: a config that runs one of `papers`' generators (`claims_to_follow`) gets the block,
    one line each; any other one line with their count and where they are listed. Returns them."""
    papers = (papers,) if isinstance(papers, str) else papers or papers_followed(config)
    found = run_departures(config, papers, train, dataset, made)
    followed = " and ".join(papers)
    if not found:
        print(f"this run departs from {followed} in none of the recorded choices", flush=True)
    elif claims_to_follow(config, papers):
        print(f"this run departs from {followed} in:", flush=True)
        for d in found:
            print(f"  [{d.paper}] {d.what}", flush=True)
    else:
        print(f"this run departs from {followed} in {len(found)} choices (its generator is none the papers ran; "
              f"listed in {WHERE_LISTED})", flush=True)
    return found
