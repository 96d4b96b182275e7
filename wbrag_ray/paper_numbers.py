"""The two papers' numbers as data, each with the words of its text that state it (`../shared/papers/`:
`writeback-rag.txt`, the WriteBack-RAG paper without its tables' cells; `zero-rag-summary.txt`, a summary of
Zero-RAG), where it stands, and the settings that made it; a setting the text does not state is None (or
`NOT_STATED`). tests/test_papers.py checks each against its text: the quote, the number in it, and the table,
section, dataset, model, pruning ratio, row and column the text gives it. Not listed: Table 2's cells (not in the
text), Figure 1's exploratory figures, Table 8's base row, approximate restatements, the case study.
"""
from __future__ import annotations

from dataclasses import dataclass, field

ZERO_RAG, WRITEBACK = "Zero-RAG", "WriteBack-RAG"
TEXTS = {WRITEBACK: "writeback-rag.txt", ZERO_RAG: "zero-rag-summary.txt"}  # under ../shared/papers/
NOT_STATED = "not stated"

# The settings each paper states once for all its numbers
WRITEBACK_RETRIEVER, WRITEBACK_K = "e5-base-v2", 5  # §5.2: "E5-base-v2 ... as the retriever with K=5 documents"
ZERO_RAG_RETRIEVER, ZERO_RAG_K = "stella_en_400M_v5", 20  # "Retrieval uses stella_en_400M_v5 with 20 document candidates"
ZERO_RAG_LEARNING_RATE = 3e-4  # "Fine-tuning uses LoRA with a learning rate of 3×10⁻⁴"
GEMMA, LLAMA_31_8B = "Gemma-3-12B", "Llama-3.1-8B"
LLAMA_33_70B, LLAMA_3_70B, LLAMA_3_8B = "Llama3.3-70B", "Llama3-70B", "Llama3-8B"
# §6.2 names the LLM for Table 3 only: "Table 3 shows ... under Gemma-3-12B + Naive RAG (we use Naive RAG as the
# reference setting throughout the analysis"; §6.5: Table 4 is "on NQ (Naive RAG baseline: 31.44% Acc)"
REFERENCE = "Table 3 ... under Gemma-3-12B + Naive RAG (we use Naive RAG as the reference setting throughout the analysis"
TABLE_4 = "NQ with the Naive RAG baseline; the text names the LLM only for Table 3 (Gemma-3-12B)"
# WriteBack-RAG's defaults (§5.2), the settings of every write-back number that does not vary them
WRITEBACK_GATES = (("tau_s", 0.1), ("tau_delta", 0.01), ("tau_doc", 0.01), ("n_min", 2))


@dataclass(frozen=True)
class PaperNumber:
    paper: str
    where: str  # "Table 4", "§6.1", "Main Findings": the table, else the section, that states it
    row: str
    column: str
    metric: str  # acc / f1 / em (in %), gain (points), seconds, rate (%), docs, tokens, ratio, count, hours
    shown: str  # the number as the text prints it ("79,168", "34.80")
    quote: str  # the text's words that state it (whitespace as in the text, collapsed)
    generator: str | None = None  # None: the text does not say which
    retriever: str | None = None
    top_k: int | None = None
    dataset: str | None = None  # FlashRAG's name; None: over several datasets (`row` says which)
    pruning_ratio: float | None = None  # Zero-RAG: the share of the corpus pruned; None: not stated / no pruning
    method: str | None = None  # the project's RAG method name; None: averaged over methods, or not stated
    knowledge_base: str = "base"  # "base" or "write-back" (WriteBack-RAG); Zero-RAG: "corpus" (pruned or not)
    router: bool | None = None  # Zero-RAG's query router; None: not stated
    adapter: bool | None = None  # Zero-RAG's noise-tolerant tuning; None: not stated
    gates: tuple[tuple[str, float], ...] | None = None  # the write-back gates; None: not stated (or no write-back)
    note: str = ""  # what else the text says about the number's settings

    @property
    def value(self) -> float:
        return float(self.shown.replace(",", ""))


def _wb(where: str, row: str, column: str, metric: str, shown: str, quote: str, **kw) -> PaperNumber:
    return PaperNumber(WRITEBACK, where, row, column, metric, shown, quote, retriever=WRITEBACK_RETRIEVER,
                       top_k=WRITEBACK_K, **kw)


def _zr(where: str, row: str, column: str, metric: str, shown: str, quote: str, **kw) -> PaperNumber:
    kw.setdefault("top_k", ZERO_RAG_K)
    return PaperNumber(ZERO_RAG, where, row, column, metric, shown, quote, retriever=ZERO_RAG_RETRIEVER,
                       knowledge_base="corpus", **kw)


def _gates(**changed: float) -> tuple[tuple[str, float], ...]:
    return tuple((k, changed.get(k, v)) for k, v in WRITEBACK_GATES)


# --- WriteBack-RAG ----------------------------------------------------------------------------------------------
_T4 = dict(dataset="nq", method="naive", note=TABLE_4)
_T4_WB = dict(_T4, knowledge_base="write-back")
_WB = dict(knowledge_base="write-back", gates=_gates())  # beside a write-back version made with the paper's gates
_T3 = dict(generator=GEMMA, method="naive", note=REFERENCE, **_WB)
_GAIN = "Table 2 reports results for all 48 settings"
WRITEBACK_NUMBERS = (
    # Table 4 (§6.5): the ablation on NQ, acc, Naive RAG
    _wb("Table 4", "Naive RAG baseline", "NQ acc", "acc", "31.44",
        "Table 4 ablates three controls of the write-back pipeline on NQ (Naive RAG baseline: 31.44% Acc)", **_T4),
    _wb("Table 4", "default (τs 0.1, τdoc 0.01, n_min 2)", "NQ acc", "acc", "34.82",
        "Performance peaks at the default $n_{\\min }=2$ (34.82%)", gates=_gates(), **_T4_WB),
    _wb("Table 4", "τdoc = 0", "NQ acc", "acc", "34.89", "${\\tau }_{\\text{doc}}=0$ yields 34.89%",
        gates=_gates(tau_doc=0.0), **_T4_WB),
    *(_wb("Table 4", f"τdoc = {tau:.2f}", "NQ acc", "acc", shown,
          "raising the threshold to 0.05 or 0.10 drops accuracy to 33.85 and 33.76", gates=_gates(tau_doc=tau), **_T4_WB)
      for tau, shown in ((0.05, "33.85"), (0.1, "33.76"))),
    _wb("Table 4", "n_min = 1", "NQ acc", "acc", "33.19", "A single fallback document (33.19%)",
        gates=_gates(n_min=1), **_T4_WB),
    *(_wb("Table 4", f"τs from 0 to 0.20, {row}", "NQ acc", metric, shown,
          "varying ${\\tau }_s$ from 0 to 0.20 changes accuracy by only 0.16 points (34.66%-34.82%)", **_T4_WB)
      for row, metric, shown in (("lowest", "acc", "34.66"), ("spread", "gain", "0.16"))),
    *(_wb("Table 4", f"every write-back row, {which} gain", "NQ acc", "gain", shown,
          "Every write-back configuration outperforms this baseline, with gains ranging from +1.75 to +3.45 points",
          **_T4_WB) for which, shown in (("smallest", "+1.75"), ("largest", "+3.45"))),
    # §6.1: FEVER, F1; the text does not say under which LLM
    *(_wb("§6.1", row, "FEVER F1", "f1", shown,
          "on FEVER, Naive RAG (32.77%) underperforms the no-retrieval baseline (34.24%)", dataset="fever", method=method)
      for row, method, shown in (("Naive RAG", "naive", "32.77"), ("no retrieval", "no-retrieval", "34.24"))),
    _wb("§6.1", "Naive RAG + write-back", "FEVER F1", "f1", "37.89", "yet adding write-back raises F1 to 37.89%",
        dataset="fever", method="naive", **_WB),
    # §6.1: the gains of write-back (Table 2's 48 settings), averaged as the text says
    _wb("§6.1", "all 48 settings", "mean gain", "gain", "+2.14", "with an average gain of +2.14%", note=_GAIN, **_WB),
    *(_wb("§6.1", name, "mean gain over datasets and LLMs", "gain", shown,
          "averaged over datasets and LLMs, Naive RAG gains +2.29%, RePlug +2.40%, Self-RAG +1.90%, and FLARE +1.99%",
          method=method, note=_GAIN, **_WB)
      for name, method, shown in (("Naive RAG", "naive", "+2.29"), ("RePlug", "replug", "+2.40"),
                                  ("Self-RAG", "self-rag", "+1.90"), ("FLARE", "flare", "+1.99"))),
    *(_wb("§6.1", name, "mean gain over methods and datasets", "gain", shown,
          "averaged over methods and datasets, Gemma-3-12B gains +1.92% and Llama-3.1-8B gains +2.36%",
          generator=name, note=_GAIN, **_WB)
      for name, shown in ((GEMMA, "+1.92"), (LLAMA_31_8B, "+2.36"))),
    *(_wb("§6.1", name, "gain (the text does not say how it is averaged)", "gain", shown, quote, dataset=dataset,
          note=_GAIN, **_WB)
      for name, dataset, shown, quote in (
          ("FEVER", "fever", "+4.79", "FEVER (+4.79%) and NQ (+3.01%) benefit most"),
          ("NQ", "nq", "+3.01", "FEVER (+4.79%) and NQ (+3.01%) benefit most"),
          ("BoolQ", "boolq", "+2.15", "BoolQ (+2.15%) also sees clear gains"),
          ("zsRE", "zsre", "+0.56", "Improvements on zsRE (+0.56%), HotpotQA (+1.01%), and SQuAD (+1.33%)"),
          ("HotpotQA", "hotpotqa", "+1.01", "Improvements on zsRE (+0.56%), HotpotQA (+1.01%), and SQuAD (+1.33%)"),
          ("SQuAD", "squad", "+1.33", "Improvements on zsRE (+0.56%), HotpotQA (+1.01%), and SQuAD (+1.33%)"))),
    *(_wb("§6.2", f"SQuAD, {which} gain across settings", "EM gain", "gain", shown,
          "the downstream gains on SQuAD (+0.35% to +1.87% across settings)", dataset="squad", **_WB)
      for which, shown in (("smallest", "+0.35"), ("largest", "+1.87"))),
    # Figure 4 (§6.4): Same-WB and Cross-WB between Naive RAG and RePlug
    *(_wb("Figure 4", row, "gain over the no-write-back baseline", "gain", shown, quote,
          note="four evaluation settings; the text does not name the LLM or dataset", **_WB)
      for row, shown, quote in (
          ("Same-WB, smallest", "+2.26", "Same-WB yields gains of +2.26% to +3.38%"),
          ("Same-WB, largest", "+3.38", "Same-WB yields gains of +2.26% to +3.38%"),
          ("Cross-WB, smallest", "+2.38", "while Cross-WB yields +2.38% to +3.82%"),
          ("Cross-WB, largest", "+3.82", "while Cross-WB yields +2.38% to +3.82%"),
          ("|Same-WB - Cross-WB|, largest", "0.44", "The gap between the two never exceeds 0.44% in either direction"))),
    # Table 3 (§6.2): write-back construction in the reference setting
    *(_wb("Table 3", row, "Selected Rate", "rate", shown, "nearly half for HotpotQA (49.3%) and SQuAD (48.1%)",
          dataset=row.lower(), **_T3) for row, shown in (("HotpotQA", "49.3"), ("SQuAD", "48.1"))),
    *(_wb("Table 3", "NQ, BoolQ, FEVER, zsRE", f"Selected Rate, {which}", "rate", shown,
          "only 6-14% for NQ, BoolQ, FEVER, and zsRE", **_T3) for which, shown in (("lowest", "6"), ("highest", "14"))),
    _wb("Table 3", "SQuAD", "Fallback Rate", "rate", "96.2", "its fallback rate of 96.2%", dataset="squad", **_T3),
    _wb("Table 3", "HotpotQA", "Retained Docs", "docs", "4.76", "roughly 2 documents on average for most tasks, and 4.76 "
        "for HotpotQA", dataset="hotpotqa", **_T3),
    *(_wb("Table 3", "HotpotQA", column, "tokens", shown,
          "multi-document bundles averaging 489 tokens are reduced to 80-token units", dataset="hotpotqa", **_T3)
      for column, shown in (("Source Tokens", "489"), ("Distilled Tokens", "80"))),
    *(_wb("Table 3", "every dataset", f"Compression, {which}", "ratio", shown,
          "The distiller compresses these bundles by 2.15-6.79$\\times$", **_T3)
      for which, shown in (("lowest", "2.15"), ("highest", "6.79"))),
    *(_wb("Table 3", "every dataset", f"Distilled Tokens, {which}", "tokens", shown,
          "producing write-back units of 72-93 tokens", **_T3) for which, shown in (("lowest", "72"), ("highest", "93"))),
    # §5.2: the training cost on NQ (the text does not name the LLM)
    *(_wb("§5.2", "NQ training", column, "count", shown,
          "For NQ ($N=79,168$, $|{\\mathcal{D}}_{\\text{util}}|=12,295$, $K=5$)", dataset="nq", **_WB)
      for column, shown in (("N (training questions)", "79,168"), ("|D_util| (kept by the utility gate)", "12,295"))),
    _wb("§5.2", "NQ training", "generator calls", "count", "220", "this totals approximately $220$K generator calls",
        dataset="nq", note="thousands: 2N baseline scoring + up to |D_util| x K document gating + |D_util| distillation",
        **_WB),
    _wb("§5.2", "NQ training", "hours on two H200 GPUs", "hours", "0.5", "completing in 0.5 hours on two H200 GPUs",
        dataset="nq", **_WB),
)

# --- Zero-RAG -----------------------------------------------------------------------------------------------------
_DATASETS = ("popqa", "hotpotqa", "triviaqa", "entityquestions")  # the order the summary lists its scores in
_COLUMNS = dict(zip(_DATASETS, ("PopQA", "HotpotQA", "TriviaQA", "EntityQuestions"), strict=True))
_ZERO_RAG = dict(method="naive", router=True, adapter=True)  # Zero-RAG: pruned corpus, router, tuned generator


_EM = "EM: the summary names exact-match evaluation (for Llama3-8B: 'EM recall')"
_UNSTATED_RATIO = _EM + "; the pruning ratio is not stated"


def _four(where: str, row: str, shown: tuple[str, ...], quote: str, datasets=_DATASETS, **kw) -> tuple:
    """A row of EM scores, one per dataset; Llama3.3-70B's unless `generator` says otherwise."""
    kw = {"generator": LLAMA_33_70B, "note": _EM, **kw}
    return tuple(_zr(where, row, _COLUMNS[d], "em", s, quote, dataset=d, **kw)
                 for d, s in zip(datasets, shown, strict=True))


_ABLATIONS = ("Zero-RAG at 30% pruning scores 82.42 / 48.52. With the Corpus Pruner removed (0% pruning) it scores "
              "82.69 / 51.28; with the Query Router removed, 81.50 / 43.35; with Noise-Tolerant Tuning removed, 80.55 / "
              "42.82")
_INSTRUCT = ("adding retrieval to the instruct model changes PopQA from 16.25 to 16.35, HotpotQA from 46.20 to 43.35, "
             "TriviaQA from 81.43 to 79.32, and EntityQuestions from 52.01 to 50.71")
ZERO_RAG_NUMBERS = (
    *_four("Main Findings", "Zero-RAG, no pruning", ("35.78", "51.28", "82.69", "63.70"),
           "With Llama3.3-70B, Zero-RAG scores 35.78 (PopQA), 51.28 (HotpotQA), 82.69 (TriviaQA), and 63.70 "
           "(EntityQuestions) with no pruning", pruning_ratio=0.0, **_ZERO_RAG),
    *_four("Main Findings", "Zero-RAG, 30% pruned", ("34.80", "48.52", "82.42", "60.43"),
           "versus 34.80, 48.52, 82.42, and 60.43 with a 30% pruned corpus", pruning_ratio=0.3, **_ZERO_RAG),
    *_four("Main Findings", "Zero-RAG, 70% pruned", ("32.91", "46.20", "82.07", "56.29"),
           "At 70% pruning the scores are 32.91, 46.20, 82.07, and 56.29", pruning_ratio=0.7, **_ZERO_RAG),
    *_four("Main Findings", "instruct model, no retrieval", ("16.25", "46.20", "81.43", "52.01"), _INSTRUCT,
           method="no-retrieval", router=False, adapter=False, top_k=None),
    *_four("Main Findings", "instruct model with retrieval", ("16.35", "43.35", "79.32", "50.71"), _INSTRUCT,
           method="naive", router=False, adapter=False, note=_UNSTATED_RATIO),
    *_four("Main Findings", "noise-tolerant tuned, with retrieval", ("38.94", "49.12", "81.50", "65.16"),
           "After Noise-Tolerant Tuning, the same model with retrieval reaches 38.94, 49.12, 81.50, and 65.16",
           method="naive", router=False, adapter=True, note=_UNSTATED_RATIO),
    # the ablations of Zero-RAG at 30% pruning, TriviaQA / HotpotQA
    *_four("Main Findings (ablations)", "without the Query Router", ("81.50", "43.35"), _ABLATIONS,
           ("triviaqa", "hotpotqa"), pruning_ratio=0.3, method="naive", router=False, adapter=True),
    *_four("Main Findings (ablations)", "without Noise-Tolerant Tuning", ("80.55", "42.82"), _ABLATIONS,
           ("triviaqa", "hotpotqa"), pruning_ratio=0.3, method="naive", router=True, adapter=False),
    # top-k robustness: Zero-RAG, no pruning, Llama3.3-70B (K 20 is the 'no pruning' row above)
    *(n for k, shown in ((5, ("35.17", "50.98", "82.46", "62.76")), (10, ("35.73", "51.16", "82.58", "63.28")))
      for n in _four("Main Findings (top-k)", f"Zero-RAG, no pruning, Top{k}", shown,
                     "Zero-RAG (no pruning, Llama3.3-70B) scores 35.17/35.73/35.78 on PopQA, 50.98/51.16/51.28 on "
                     "HotpotQA, 82.46/82.58/82.69 on TriviaQA, and 62.76/63.28/63.70 on EntityQuestions at "
                     "Top5/Top10/Top20", pruning_ratio=0.0, top_k=k, **_ZERO_RAG)),
    *_four("Main Findings", "Zero-RAG, no pruning", ("21.29", "35.21", "72.08", "48.71"),
           "Zero-RAG (no pruning) scores 21.29 (PopQA), 35.21 (HotpotQA), 72.08 (TriviaQA), 48.71 (EntityQuestions)",
           generator=LLAMA_3_8B, pruning_ratio=0.0, **_ZERO_RAG),
    *_four("Main Findings", "Zero-RAG, 30% pruned", ("18.91", "31.89", "67.93", "43.19"),
           "versus 18.91, 31.89, 67.93, and 43.19 at 30% pruning", generator=LLAMA_3_8B, pruning_ratio=0.3, **_ZERO_RAG),
    *_four("Main Findings", "Zero-RAG, 30% pruned", ("30.67", "43.30", "81.00", "57.82"),
           "For Llama3-70B at 30% pruning, scores are 30.67 (PopQA), 43.30 (HotpotQA), 81.00 (TriviaQA), and 57.82 "
           "(EntityQuestions)", generator=LLAMA_3_70B, pruning_ratio=0.3, **_ZERO_RAG),
    # Table 8: the generator is ambiguous in the table itself
    *(n for row, ratio, shown, quote in (
        ("Zero-RAG", 0.0, ("32.76", "49.18", "81.76"), "32.76/49.18/81.76 for Zero-RAG"),
        ("Zero-RAG, 30% pruned", 0.3, ("29.13", "45.17", "80.90"),
         "29.13/45.17/80.90 for Zero-RAG with a 30% pruned corpus"))
      for n in _four("Table 8", row, shown, quote, ("popqa", "hotpotqa", "triviaqa"),
                     generator="Qwen-2-72B (Table 8's column header; its row label says Llama3-70B-Instruct)",
                     pruning_ratio=ratio, **_ZERO_RAG)),
    # Table 4: retrieval latency, no pruning and 30% pruned (the ratio of the two is the run's retrieval speedup)
    *(_zr("Table 4", f"{int(100 * ratio)}% pruned", name, "seconds", shown,
          "Table 4 reports latencies of 14.65 s (HotpotQA), 10.96 s (EntityQuestions), and 11.24 s (TriviaQA) with no "
          "pruning, averaging 12.28 s. At 30% pruning these become 10.89 s, 9.09 s, and 9.00 s, averaging 9.66 s",
          dataset=dataset, pruning_ratio=ratio, top_k=None, note="retrieval latency")
      for ratio, values in ((0.0, ("14.65", "10.96", "11.24", "12.28")), (0.3, ("10.89", "9.09", "9.00", "9.66")))
      for (name, dataset), shown in zip((("HotpotQA", "hotpotqa"), ("EntityQuestions", "entityquestions"),
                                         ("TriviaQA", "triviaqa"), ("average", None)), values, strict=True)),
    _zr("What This Paper Is About", "30% pruned", "retrieval stage speedup", "speedup", "22",
        "They report that Zero-RAG removes 30% of the Wikipedia corpus and speeds up retrieval by 22%",
        pruning_ratio=0.3, top_k=None),
    # Table 7: total time, 0% -> 30% pruning
    *(_zr("Table 7", f"{int(100 * ratio)}% pruned", name, "total_seconds", shown,
          "Table 7 reports HotpotQA total time falling from 717.13 s to 531.94 s, EntityQuestion from 1924.47 s to "
          "1476.23 s, and TriviaQA from 1655.54 s to 441.80 s when moving from 0% to 30% pruning", dataset=dataset,
          pruning_ratio=ratio, top_k=None, note="total time")
      for ratio, values in ((0.0, ("717.13", "1924.47", "1655.54")), (0.3, ("531.94", "1476.23", "441.80")))
      for (name, dataset), shown in zip((("HotpotQA", "hotpotqa"), ("EntityQuestions", "entityquestions"),
                                         ("TriviaQA", "triviaqa")), values, strict=True)),
    _zr("Methodology", "Wikipedia", "sentences (NLTK's sentence tokenizer)", "count", "138,390,600",
        "the Wikipedia corpus is segmented into 138,390,600 sentences using NLTK's sentence tokenizer", top_k=None),
)

NUMBERS: tuple[PaperNumber, ...] = (*WRITEBACK_NUMBERS, *ZERO_RAG_NUMBERS)


@dataclass(frozen=True)
class Statement:
    """A setting or a claim of a paper that a departure cites: its words in the text."""

    paper: str
    quote: str
    shown: tuple[str, ...] = field(default=())  # the numbers the quote must hold


# The words each departure of `papers` quotes (checked against the texts as the numbers are)
SAYS = {
    "wb.k": Statement(WRITEBACK, "We use E5-base-v2 (Wang et al., 2022) as the retriever with $K=5$ documents", ("5",)),
    "wb.gates": Statement(WRITEBACK, "For gating, we set ${\\tau }_s=0.1$ and ${\\tau }_{\\delta }=0.01$ (any strict "
                                     "improvement suffices, i.e., ${\\delta }_i>0$)", ("0.1", "0.01")),
    "wb.doc_gate": Statement(WRITEBACK, "The document gate uses ${\\tau }_{\\text{doc}}=0.01$ with $n_{\\min }=2$ "
                                        "fallback documents", ("0.01", "2")),
    "wb.metrics": Statement(WRITEBACK, "we report Accuracy on NQ, BoolQ, zsRE, and HotpotQA; F1 on FEVER, and Exact "
                                       "Match (EM) on SQuAD"),
    "wb.merge": Statement(WRITEBACK, "both indices are searched independently and results are merged into a single "
                                     "top-$K$ set"),
    "wb.additive": Statement(WRITEBACK, "currently studies only additive write-back, without deletion, deduplication, "
                                        "or contradiction resolution"),
    "wb.all_questions": Statement(WRITEBACK, "baseline scoring ($2N$ generator calls)"),
    "wb.same_llm": Statement(WRITEBACK, "The same LLM (Llama-3.1-8B (Grattafiori et al., 2024) and Gemma-3-12B (Team et "
                                        "al., 2024)) serves as both the generator $\\mathcal{G}$ and the distiller "
                                        "$\\mathcal{F}$"),
    "wb.distiller": Statement(WRITEBACK, "An LLM-based distiller then fuses and compresses the selected evidence into "
                                         "compact, self-contained knowledge units"),
    "wb.datasets": Statement(WRITEBACK, "six benchmarks (NQ, BoolQ, FEVER, zsRE, HotpotQA, SQuAD)"),
    "wb.tokens": Statement(WRITEBACK, "Source Tokens and Distilled Tokens denote the average source and distilled token "
                                      "counts for selected examples"),
    "wb.methods": Statement(WRITEBACK, "four RAG methods (Naive Retrieval, RePlug, Self-RAG, Flare)"),
    "zr.qa": Statement(ZERO_RAG, "A sentence-level score is computed by generating QA pairs from a sentence with an LLM "
                                 "and measuring the target model's Exact Match accuracy on them"),
    "zr.qa_writer": Statement(ZERO_RAG, "with QA pairs generated by GPT-4o-mini"),
    "zr.pruner": Statement(ZERO_RAG, "a smaller regression model (a 7B model trained to predict the Mastery-Score of a "
                                     "70B model)", ("7", "70")),
    "zr.direction": Statement(ZERO_RAG, "Section 3.1 says a sentence is pruned when the predicted score is below the "
                                        "threshold"),
    "zr.direction_a1": Statement(ZERO_RAG, "Appendix A.1 removes sentences whose scores exceed the threshold"),
    "zr.ratios": Statement(ZERO_RAG, "with no pruning, versus 34.80, 48.52, 82.42, and 60.43 with a 30% pruned corpus. "
                                     "At 70% pruning the scores are", ("30", "70")),
    "zr.router": Statement(ZERO_RAG, "the noise-tolerant model's performance is used to label each query as "
                                     "\"mastered\" or \"unmastered.\" A binary classifier trained with cross-entropy on "
                                     "these labels"),
    "zr.tuning": Statement(ZERO_RAG, "Fine-tuning uses three sample formats — query with relevant documents, query with "
                                     "distracting documents, and query without retrieval"),
    "zr.lr": Statement(ZERO_RAG, "Fine-tuning uses LoRA with a learning rate of 3×10⁻⁴", ("3",)),
    "zr.retrieval": Statement(ZERO_RAG, "Retrieval uses stella_en_400M_v5 with 20 document candidates per query", ("20",)),
    "zr.segmentation": Statement(ZERO_RAG, "segmented into 138,390,600 sentences using NLTK's sentence tokenizer"),
    "zr.target": Statement(ZERO_RAG, "With Llama3.3-70B, Zero-RAG scores"),
    "zr.datasets": Statement(ZERO_RAG, "report pruning, latency, and accuracy results on PopQA, HotpotQA, TriviaQA, and "
                                       "EntityQuestions"),
}
