"""What the two papers ran, as config values, and where a run departs from them.

The defaults serve the demo (small CPU models, minutes): cloze QA pairs instead of LLM-written ones, the
embedding head instead of the LLM regressor, write-back deduplication, FlashRAG-shorter FLARE budgets. The union
of the base and write-back indices (retrieval.union) is the gate by default, the setting that measured best on
held-out questions (the only one that lost none); it and every other union but the paper's merge by score are
named as departures. A run says which of its choices differ from the papers: printed when a Zero-RAG or
write-back stage starts, recorded in every evaluation's metrics.json, and listed in the report. `jobs/configs/paper_zero_rag.yaml` and
`jobs/configs/paper_writeback.yaml` hold the papers' settings.

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
    PaperChoice(ZERO_RAG, "zerorag.tune.learning_rate", 3e-4, "noise-tolerant tuning at learning rate 3e-4"),
    PaperChoice(ZERO_RAG, "retrieval.top_k", 20, "20 retrieved candidates per query"),
    PaperChoice(ZERO_RAG, "eval.answer_form", None, "answers scored as generated"),
    PaperChoice(WRITEBACK, "eval.answer_form", None, "answers scored as generated"),
    PaperChoice(WRITEBACK, "retrieval.top_k", 5, "K = 5 retrieved documents"),
    PaperChoice(WRITEBACK, "retrieval.union", "score",
                "the base and write-back indices' hits merged by score and cut to the top K"),
    PaperChoice(WRITEBACK, "writeback.metric", "auto",
                "the gates' metric per dataset: acc (NQ, BoolQ, zsRE, HotpotQA), F1 (FEVER), EM (SQuAD)"),
    PaperChoice(WRITEBACK, "writeback.dedupe_threshold", None, "no deduplication of the written-back units"),
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


def departures(config: WbragConfig, paper: str | None = None, train: str | None = None) -> list[str]:
    """'path: value (the paper: its value, what it says)' for each choice of `config` that differs from the
    papers (or from one of them). Settings resolved from the data are compared resolved: with the write-back
    training file `train`, writeback.metric is the metric the gates use (auto resolved by the dataset's name) and
    the paper's is its metric for that dataset, so a resolution the paper did not make shows, and an explicit
    value the paper used does not."""
    out = []
    for choice in CHOICES:
        if paper and choice.paper != paper:
            continue
        value, wanted = _value(config, choice.path), choice.value
        if choice.path == "writeback.metric" and train:
            from wbrag_ray.formats import dataset_name

            name = dataset_name(train)
            wanted = gate_metric(name)
            value = wanted if value == "auto" else value
            if value != wanted:
                out.append(f"{choice.path}: {value!r} for {name} (the {choice.paper} paper: {wanted!r}, {choice.says})")
            continue
        if value != wanted:
            out.append(f"{choice.path}: {value!r} (the {choice.paper} paper: {wanted!r}, {choice.says})")
    return out


# Zero-RAG's evaluation datasets, by FlashRAG's names, and its retriever
ZERO_RAG_DATASETS = ("triviaqa", "popqa", "hotpotqa", "entityquestions")
ZERO_RAG_RETRIEVER = "stella_en_400M_v5"


def method_departures(config: WbragConfig, paper: str | None = None) -> list[str]:
    """Where this run's *method* differs from the paper's, beyond the config values `departures` compares: what
    the implementation does differently (whatever the config), and the choices of model and data the paper made
    that a config value cannot state as one. 'what the run does (the <paper> paper: what it did)'."""
    from wbrag_ray.formats import dataset_name

    methods = set(config.eval.methods)
    out: list[tuple[str, str]] = []
    wb, z = config.writeback, config.zerorag
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
    if z.enabled:
        out.append((ZERO_RAG, "sentences are split by nupunkt (the Zero-RAG paper's segmentation is its own)"))
        if z.qa_mode == "llm" and z.qa_generator is None:
            out.append((ZERO_RAG, "the target model writes its own mastery QA pairs, zerorag.qa_generator unset (the "
                                  "Zero-RAG paper: GPT-4o-mini writes them, the target model answers)"))
        if ZERO_RAG_RETRIEVER not in config.embedder.model:
            out.append((ZERO_RAG, f"the retriever is {config.embedder.model} (the Zero-RAG paper: "
                                  f"{ZERO_RAG_RETRIEVER})"))
        if config.eval.dataset and dataset_name(config.eval.dataset) not in ZERO_RAG_DATASETS:
            out.append((ZERO_RAG, f"evaluated on {dataset_name(config.eval.dataset)} (the Zero-RAG paper: "
                                  f"{', '.join(ZERO_RAG_DATASETS)})"))
    return [what for who, what in out if paper in (None, who)]


def print_departures(config: WbragConfig, paper: str, train: str | None = None) -> list[str]:
    found = departures(config, paper, train)
    if found:
        print(f"{paper}: this run departs from the paper in " + "; ".join(found), flush=True)
    method = method_departures(config, paper)
    if method:
        print(f"{paper}: and in its method: " + "; ".join(method), flush=True)
    return found + method


@dataclass(frozen=True)
class Headline:
    """A number a paper reports, and what a run must have evaluated to set its own number beside it."""

    paper: str
    dataset: str  # FlashRAG's dataset name (`formats.dataset_name`); "*" for a figure over the corpus itself
    method: str  # the RAG method
    knowledge_base: str  # "base", "write-back" or "pruned 30%"
    metric: str  # a key of an evaluation's metrics.json, or of a Zero-RAG grid row
    value: float  # as the paper prints it (acc in %, speedup in %)
    model: str  # the paper's generator
    says: str


HEADLINES = (
    Headline(WRITEBACK, "nq", "naive", "base", "acc", 31.44, "Llama-3.1-8B", "naive RAG on NQ"),
    Headline(WRITEBACK, "nq", "naive", "write-back", "acc", 34.82, "Llama-3.1-8B",
             "naive RAG on NQ with the written-back knowledge beside the corpus"),
    Headline(ZERO_RAG, "*", "naive", "pruned 30%", "retrieval_speedup_pct", 22.0, "Llama-3.3-70B",
             "30% of Wikipedia pruned: the retrieval stage 22% faster, RAG's answers not worse"),
)

PERCENT_METRICS = ("em", "f1", "acc")  # 0-1 in metrics.json, in % in the papers


def paper_vs_run(results: dict[str, dict[str, Any]], zero_rag_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each headline row a run can be set beside: `results` are its evaluations' metrics.json by name (an
    evaluation of the base index or beside a write-back version, no router, no pruned index), `zero_rag_rows`
    its Zero-RAG grid's rows. The run's model may differ from the paper's: both are named."""
    from wbrag_ray.formats import dataset_name

    out = []
    for h in HEADLINES:
        if h.knowledge_base == "pruned 30%":
            matches = [(f"grid {r.get('method')} at ratio 0.3", r.get(h.metric), None) for r in zero_rag_rows
                       if r.get("ratio") == 0.3 and r.get("method") == h.method and not r.get("writeback")
                       and not r.get("router") and not r.get("adapter")]
        else:
            matches = [(name, r.get(h.metric), r.get("generator")) for name, r in results.items()
                       if r.get("method") == h.method and r.get("router") is None and "prune" not in name
                       and dataset_name(str(r.get("dataset", ""))) == h.dataset
                       and bool(r.get("writeback_version")) == (h.knowledge_base == "write-back")]
        for name, value, generator in matches:
            if value is None:
                continue
            run_value = 100 * value if h.metric in PERCENT_METRICS else value
            model = generator.get("model") if isinstance(generator, dict) else None
            out.append({"paper": h.paper, "dataset": h.dataset, "method": h.method, "knowledge_base": h.knowledge_base,
                        "metric": h.metric, "paper_value": h.value, "run_value": round(run_value, 2),
                        "paper_model": h.model, "run_model": model, "run_result": name, "says": h.says})
    return out
