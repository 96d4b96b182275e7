"""What the two papers ran, as config values, and where a run departs from them.

The defaults serve the demo (small CPU models, minutes): cloze QA pairs instead of LLM-written ones, the
embedding head instead of the LLM regressor, write-back deduplication, FlashRAG-shorter FLARE budgets. The union
of the base and write-back indices (retrieval.union) is the gate by default, the setting chosen on a validation
half of held-out questions (benchmarks/writeback_union.py); it and every other union but the paper's merge by score
are named as departures, as is the default hold-out of training questions (writeback.validation 'auto'). A run says which of its choices differ from the papers it follows (`run_departures`: resolved
values, the papers the run or evaluation follows): printed when `wbrag eval` and `wbrag run` start and when a Zero-RAG
or write-back stage starts, recorded in every evaluation's metrics.json, and listed in the report.
`jobs/configs/paper_zero_rag.yaml` and `jobs/configs/paper_writeback.yaml` hold the papers' settings. The papers'
numbers (`HEADLINES`) carry their source and the settings that made them; `paper_vs_run` sets a run's beside them.

Sources: Zero-RAG (Luo et al. 2025), WriteBack-RAG (its paper's setup section), and FlashRAG's defaults for
the methods WriteBack-RAG runs (FLARE's look-ahead and rounds).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from wbrag_ray.config import WbragConfig

ZERO_RAG, WRITEBACK = "Zero-RAG", "WriteBack-RAG"


@dataclass(frozen=True)
class PaperChoice:
    paper: str  # which paper made the choice
    path: str  # the config path
    value: Any  # the paper's value
    says: str  # the choice in the paper's words


CHOICES = (
    PaperChoice(ZERO_RAG, "zerorag.qa_mode", "llm", "mastery from QA pairs the LLM writes for each sentence"),
    PaperChoice(ZERO_RAG, "zerorag.mastery_metric", "em", "mastery = mean exact match of the closed-book answers"),
    PaperChoice(ZERO_RAG, "zerorag.pruner", "lm", "an LLM regressor predicts every sentence's mastery"),
    # compared where the run trains the LM regressor; the paper config's values (the paper's own backbone and
    # training length are not recorded in this repository)
    PaperChoice(ZERO_RAG, "zerorag.lm_pruner.backbone", "meta-llama/Llama-3.2-1B",
                "the LM regressor's backbone as jobs/configs/paper_zero_rag.yaml sets it"),
    PaperChoice(ZERO_RAG, "zerorag.lm_pruner.epochs", 2.0,
                "the LM regressor trained 2 epochs over the scored sample (jobs/configs/paper_zero_rag.yaml)"),
    PaperChoice(ZERO_RAG, "zerorag.lm_pruner.max_steps", None, "the LM regressor's training not cut short"),
    PaperChoice(ZERO_RAG, "zerorag.tune.learning_rate", 3e-4, "noise-tolerant tuning at learning rate 3e-4"),
    PaperChoice(ZERO_RAG, "zerorag.tune.targets", "gold", "noise-tolerant tuning trained to the gold answers"),
    PaperChoice(ZERO_RAG, "retrieval.top_k", 20, "20 retrieved candidates per query"),
    PaperChoice(ZERO_RAG, "eval.answer_form", None, "answers scored as generated"),
    PaperChoice(WRITEBACK, "eval.answer_form", None, "answers scored as generated"),
    PaperChoice(WRITEBACK, "retrieval.top_k", 5, "K = 5 retrieved documents"),
    PaperChoice(WRITEBACK, "retrieval.union", "score",
                "the base and write-back indices' hits merged by score and cut to the top K"),
    PaperChoice(WRITEBACK, "writeback.metric", "auto",
                "the gates' metric per dataset: acc (NQ, BoolQ, zsRE, HotpotQA), F1 (FEVER), EM (SQuAD)"),
    PaperChoice(WRITEBACK, "writeback.dedupe_threshold", None, "no deduplication of the written-back units"),
    PaperChoice(WRITEBACK, "writeback.validation", None, "every training question trained on (none held out)"),
    PaperChoice(WRITEBACK, "rag.flare.look_ahead_tokens", 64, "FLARE looks 64 tokens ahead (FlashRAG)"),
    PaperChoice(WRITEBACK, "rag.flare.max_rounds", 5, "FLARE writes at most 5 sentences (FlashRAG)"),
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
# The generators each paper ran (a run's model matches where its name holds one of these, case aside), its
# retriever, and Zero-RAG's QA writer
PAPER_GENERATORS = {WRITEBACK: ("Llama-3.1-8B", "Gemma-3-12B"), ZERO_RAG: ("Llama-3.3-70B",)}
WRITEBACK_RETRIEVER = "e5-base-v2"
ZERO_RAG_QA_WRITER = "gpt-4o-mini"
# WriteBack-RAG's six datasets (its gate metrics name them)
WRITEBACK_DATASETS = tuple(GATE_METRICS)


def model_name(spec: str) -> str:
    """A model as a departure names it: a bundled default with the model it resolves to."""
    return f"{spec} ({BUNDLED_MODELS[spec]})" if spec in BUNDLED_MODELS else spec


def papers_followed(config: WbragConfig, writeback: bool | None = None, zero_rag: bool | None = None
                    ) -> tuple[str, ...]:
    """The papers a run (or one evaluation of it) follows: WriteBack-RAG where it trains or searches a write-back
    version (default: writeback.train is set), Zero-RAG where it prunes, routes or tunes (default:
    zerorag.enabled); both where both, and both where neither (a plain base evaluation is either paper's
    baseline)."""
    wb = bool(config.writeback.train) if writeback is None else writeback
    z = config.zerorag.enabled if zero_rag is None else zero_rag
    return tuple(p for p, on in ((WRITEBACK, wb), (ZERO_RAG, z)) if on) or (WRITEBACK, ZERO_RAG)


def _applies(config: WbragConfig, choice: PaperChoice) -> bool:
    """Whether a choice says anything about this run: the LM regressor's settings only where it trains one."""
    if choice.path.startswith("zerorag.lm_pruner."):
        return config.zerorag.pruner == "lm" or "lm" in config.zerorag.train_pruners
    return True


def departures(config: WbragConfig, paper: str | None = None, train: str | None = None) -> list[str]:
    """'path: value (the paper: its value, what it says)' for each choice of `config` that differs from the
    papers (or from one of them). Settings resolved from the data are compared resolved: with the write-back
    training file `train` (default: writeback.train), writeback.metric is the metric the gates use (auto resolved
    by the dataset's name, FlashRAG's layout) and the paper's is its metric for that dataset, so a resolution the
    paper did not make shows, and an explicit value the paper used does not; with no training set, the gates
    run on nothing and their metric is not compared. A bundled default is named with the model it is."""
    from wbrag_ray.formats import dataset_name

    train = train or config.writeback.train
    out = []
    for choice in CHOICES:
        if (paper and choice.paper != paper) or not _applies(config, choice):
            continue
        value, wanted = _value(config, choice.path), choice.value
        if choice.path == "writeback.metric":
            if not train:
                continue
            name = dataset_name(train)
            wanted = gate_metric(name)
            value = wanted if value == "auto" else value
            if value != wanted:
                out.append(f"{choice.path}: {value!r} for {name} (the {choice.paper} paper: {wanted!r}, {choice.says})")
            continue
        if value != wanted:
            shown = f"{value!r} ({BUNDLED_MODELS[value]})" if isinstance(value, str) and value in BUNDLED_MODELS \
                else repr(value)
            out.append(f"{choice.path}: {shown} (the {choice.paper} paper: {wanted!r}, {choice.says})")
    return out


# Zero-RAG's evaluation datasets, by FlashRAG's names, and its retriever
ZERO_RAG_DATASETS = ("triviaqa", "popqa", "hotpotqa", "entityquestions")
ZERO_RAG_RETRIEVER = "stella_en_400M_v5"


def method_departures(config: WbragConfig, paper: str | None = None, dataset: str | None = None) -> list[str]:
    """Where this run's *method* differs from the paper's, beyond the config values `departures` compares: what
    the implementation does differently (whatever the config), and the choices of model and data the paper made
    that a config value cannot state as one (the generator, the retriever, the QA writer, the evaluated dataset:
    `dataset`, default eval.dataset). 'what the run does (the <paper> paper: what it did)'."""
    from wbrag_ray.formats import dataset_name

    methods = set(config.eval.methods)
    out: list[tuple[str, str]] = []
    wb, z = config.writeback, config.zerorag
    dataset = dataset or config.eval.dataset
    evaluated = dataset_name(dataset) if dataset else None
    if "replug-vote" in methods or wb.rag_method == "replug-vote":
        out.append((WRITEBACK, "replug-vote stands in for REPLUG: one answer per document, then a vote (the "
                               "WriteBack-RAG paper: REPLUG mixes the documents' next-token distributions; the hf "
                               "backend's replug does)"))
    if "self-rag" in methods or wb.rag_method == "self-rag":
        out.append((WRITEBACK, "Self-RAG is prompted: the generator is asked each reflection question (the "
                               "WriteBack-RAG paper: Self-RAG's fine-tuned model emits reflection tokens)"))
    out += [(WRITEBACK, "distillation is two calls, extract then rewrite from the extract only (the WriteBack-RAG "
                        "paper: one distillation of the retained documents)"),
            (WRITEBACK, "Table 3's lengths are whitespace words (the WriteBack-RAG paper: tokens)")]
    for who in (WRITEBACK, ZERO_RAG):
        if who == ZERO_RAG and not z.enabled:
            continue
        models = PAPER_GENERATORS[who]
        if not any(m.lower() in config.generator.model.lower() for m in models):
            out.append((who, f"the generator is {model_name(config.generator.model)} (the {who} paper: "
                             f"{' and '.join(models)})"))
    out += _retriever_and_dataset(WRITEBACK, WRITEBACK_RETRIEVER, WRITEBACK_DATASETS, config, evaluated)
    if wb.train and dataset_name(wb.train) not in WRITEBACK_DATASETS:
        out.append((WRITEBACK, f"written back from {dataset_name(wb.train)}, whose gate metric the paper did not "
                               f"choose: acc (the WriteBack-RAG paper: {', '.join(WRITEBACK_DATASETS)})"))
    if z.enabled:
        out.append((ZERO_RAG, "sentences are split by nupunkt (the Zero-RAG paper's segmentation is its own)"))
        if z.qa_mode == "llm" and z.qa_generator is None:
            out.append((ZERO_RAG, "the target model writes its own mastery QA pairs, zerorag.qa_generator unset (the "
                                  "Zero-RAG paper: GPT-4o-mini writes them, the target model answers)"))
        elif z.qa_mode == "llm" and ZERO_RAG_QA_WRITER not in z.qa_generator.model.lower():
            out.append((ZERO_RAG, f"{model_name(z.qa_generator.model)} writes the mastery QA pairs (the Zero-RAG "
                                  "paper: GPT-4o-mini writes them)"))
        out += _retriever_and_dataset(ZERO_RAG, ZERO_RAG_RETRIEVER, ZERO_RAG_DATASETS, config, evaluated)
    return [what for who, what in out if paper in (None, who)]


def _retriever_and_dataset(who: str, retriever: str, datasets, config: WbragConfig,
                           evaluated: str | None) -> list[tuple[str, str]]:
    """`who`'s departures in the retriever and the evaluated dataset."""
    out = []
    if retriever not in config.embedder.model:
        out.append((who, f"the retriever is {model_name(config.embedder.model)} (the {who} paper: {retriever})"))
    if evaluated and evaluated not in datasets:
        out.append((who, f"evaluated on {evaluated} (the {who} paper: {', '.join(datasets)})"))
    return out


@dataclass(frozen=True)
class Departure:
    paper: str
    kind: str  # "setting" (a config value, `departures`) or "method" (`method_departures`)
    what: str


def run_departures(config: WbragConfig, papers: tuple[str, ...] | None = None, train: str | None = None,
                   dataset: str | None = None) -> list[Departure]:
    """A run's departures from the papers it follows (`papers`, default `papers_followed`), resolved: the dataset
    by FlashRAG's layout, the gate metric for the training set (`train`, default writeback.train), each bundled
    default by the model it is, the evaluated `dataset` (default eval.dataset) against the paper's. The one
    source of what metrics.json, the report and the block printed when `wbrag eval` and `wbrag run` start say."""
    papers = papers or papers_followed(config)
    return [Departure(p, kind, what) for p in papers
            for kind, found in (("setting", departures(config, p, train)),
                                ("method", method_departures(config, p, dataset))) for what in found]


def print_departures(config: WbragConfig, papers: str | tuple[str, ...] | None = None, train: str | None = None,
                     dataset: str | None = None) -> list[Departure]:
    """Print `run_departures` as a short block, one line each; returns them."""
    papers = (papers,) if isinstance(papers, str) else papers or papers_followed(config)
    found = run_departures(config, papers, train, dataset)
    if found:
        print(f"this run departs from {' and '.join(papers)} in:", flush=True)
        for d in found:
            print(f"  [{d.paper}] {d.what}", flush=True)
    else:
        print(f"this run departs from {' and '.join(papers)} in none of the recorded choices", flush=True)
    return found


NOT_RECORDED = "not recorded"


@dataclass(frozen=True)
class Headline:
    """A number a paper reports, where it reports it, the settings that made it, and what a run must have
    evaluated to set its own number beside it. Only numbers the repository already holds, each with the source
    it gives; a table, row or column the repository does not record says so."""

    paper: str
    dataset: str  # FlashRAG's dataset name (`formats.dataset_name`); "*" for a figure over the corpus itself
    method: str  # the RAG method
    knowledge_base: str  # "base", "write-back" or "pruned 30%"
    metric: str  # a key of an evaluation's metrics.json, or of a Zero-RAG grid row
    value: float  # as the paper prints it (acc in %, speedup in %)
    model: str  # the paper's generator
    says: str
    retriever: str = ""  # the paper's retriever
    top_k: int | None = None  # K, the documents in a prompt
    union: str | None = None  # how base and write-back hits were merged (retrieval.union); None: no write-back index
    answer_form: str = "as generated"  # what the metric scored (eval.answer_form)
    table: str = NOT_RECORDED
    row: str = NOT_RECORDED
    column: str = NOT_RECORDED
    source: str = NOT_RECORDED  # where in this repository the number comes from


_ISSUE_29 = "issue 29's summary of the paper (WriteBack-RAG's gain on NQ with naive RAG, 31.44 -> 34.82 acc)"
HEADLINES = (
    Headline(WRITEBACK, "nq", "naive", "base", "acc", 31.44, "Llama-3.1-8B", "naive RAG on NQ",
             retriever=WRITEBACK_RETRIEVER, top_k=5, source=_ISSUE_29),
    Headline(WRITEBACK, "nq", "naive", "write-back", "acc", 34.82, "Llama-3.1-8B",
             "naive RAG on NQ with the written-back knowledge beside the corpus",
             retriever=WRITEBACK_RETRIEVER, top_k=5, union="score", source=_ISSUE_29),
    Headline(ZERO_RAG, "*", "naive", "pruned 30%", "retrieval_speedup_pct", 22.0, "Llama-3.3-70B",
             "30% of Wikipedia pruned: the retrieval stage 22% faster, RAG's answers not worse",
             retriever=ZERO_RAG_RETRIEVER, top_k=20, table="7 (as the Zero-RAG section of docs/guide.md attributes "
             "the retrieval speedup)", row="30% pruning (issue 29)",
             source="issue 29 and benchmarks/RESULTS.md ('the paper reports 22% at 30% pruning')"),
)
# Zero-RAG's accuracy per dataset and ratio: no such number is recorded in this repository (DESIGN.md's summary of
# the paper gives none), so none is listed here; add each with its table, row and column when it is.

PERCENT_METRICS = ("em", "f1", "acc")  # 0-1 in metrics.json, in % in the papers


def _named(run: str | None, paper: str) -> bool:
    return bool(run) and paper.lower() in str(run).lower()


def setting_differences(h: Headline, generator: str | None, retriever: str | None, top_k: int | None,
                        union: str | None, answer_form: str | None) -> list[str]:
    """The run's settings beside a paper's number that differ from the ones that made it: 'K 5 (the paper: 20)'."""
    out = []
    if generator and not _named(generator, h.model):
        out.append(f"generator {model_name(generator)} (the paper: {h.model})")
    if h.retriever and retriever and not _named(retriever, h.retriever):
        out.append(f"retriever {model_name(retriever)} (the paper: {h.retriever})")
    if h.top_k is not None and top_k is not None and top_k != h.top_k:
        out.append(f"K {top_k} (the paper: {h.top_k})")
    if h.union is not None and union != h.union:
        out.append(f"union {union or 'unknown'} (the paper: {h.union})")
    if (answer_form or "as generated") != h.answer_form:
        out.append(f"answers scored {answer_form} (the paper: {h.answer_form})")
    return out


def paper_vs_run(results: dict[str, dict[str, Any]], zero_rag_rows: list[dict[str, Any]],
                 config: WbragConfig | None = None) -> list[dict[str, Any]]:
    """Each headline row a run can be set beside: `results` are its evaluations' metrics.json by name (an
    evaluation of the base index or beside a write-back version, no router, no pruned index), `zero_rag_rows`
    its Zero-RAG grid's rows (their settings: `config`'s). The run's model may differ from the paper's: both are
    named, and `differs` lists each setting of the run that differs from the ones that made the paper's number."""
    from wbrag_ray.formats import dataset_name

    out = []
    for h in HEADLINES:
        if h.knowledge_base == "pruned 30%":
            settings = (None, None, None, None, None) if config is None else (
                config.generator.model, config.embedder.model, config.retrieval.top_k, None,
                config.eval.answer_form or "as generated")
            matches = [(f"grid {r.get('method')} at ratio 0.3", r.get(h.metric), settings) for r in zero_rag_rows
                       if r.get("ratio") == 0.3 and r.get("method") == h.method and not r.get("writeback")
                       and not r.get("router") and not r.get("adapter")]
        else:
            matches = [(name, r.get(h.metric), (
                (r.get("generator") or {}).get("model") if isinstance(r.get("generator"), dict) else None,
                r.get("embedder"), r.get("top_k"), (r.get("union") or {}).get("union"), r.get("answer_form")))
                for name, r in results.items()
                if r.get("method") == h.method and r.get("router") is None and "prune" not in name
                and dataset_name(str(r.get("dataset", ""))) == h.dataset
                and bool(r.get("writeback_version")) == (h.knowledge_base == "write-back")]
        for name, value, settings in matches:
            if value is None:
                continue
            run_value = 100 * value if h.metric in PERCENT_METRICS else value
            out.append({"paper": h.paper, "dataset": h.dataset, "method": h.method, "knowledge_base": h.knowledge_base,
                        "metric": h.metric, "paper_value": h.value, "run_value": round(run_value, 2),
                        "paper_model": h.model, "run_model": settings[0], "run_result": name, "says": h.says,
                        "table": h.table, "row": h.row, "column": h.column, "source": h.source,
                        "differs": setting_differences(h, *settings)})
    return out


def format_paper_vs_run(rows: list[dict[str, Any]]) -> str:
    """The paper-vs-run table as `wbrag eval` prints it: each paper's number with its source, the run's beside it,
    and the run's settings that differ from the paper's."""
    if not rows:
        return ("paper vs this run: nothing this run evaluated matches a number the papers report (papers."
                "HEADLINES: naive RAG on NQ, base and with write-back; Zero-RAG's 30%-pruned retrieval speedup)")
    lines = ["paper vs this run (acc in %):"]
    for r in rows:
        lines.append(f"  {r['paper']} {r['dataset']} {r['method']} {r['knowledge_base']} {r['metric']}: paper "
                     f"{r['paper_value']:g}, this run {r['run_value']:g} ({r['run_result']})")
        lines.append(f"    source: table {r['table']}, row {r['row']}, column {r['column']}; {r['source']}")
        lines.append(f"    differs: {'; '.join(r['differs']) or 'none of generator, retriever, K, union, answer form'}")
    return "\n".join(lines)
