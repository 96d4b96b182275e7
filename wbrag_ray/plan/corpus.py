"""How much a run will process: the corpus's passages and sentences, and the questions of its QA files.

Corpus size from the first source that answers: `--passages`, the run's ingest stats, the corpus files (Parquet
row counts, jsonl bytes / bytes a passage). Each figure says where it came from.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from wbrag_ray.build_kb import INGEST
from wbrag_ray.config import WbragConfig
from wbrag_ray.formats import InputError, file_kind, input_files
from wbrag_ray.plan.rates import RATES
from wbrag_ray.run import RunFolder
from wbrag_ray.storage import resolve


@dataclass(frozen=True)
class CorpusSize:
    passages: int | None
    sentences: int | None
    source: str
    corpus_bytes: int | None = None  # the corpus files' bytes, when they were listed (ingest's shard count)
    rates: tuple[str, ...] = ()  # the figures of `rates.RATES` the counts were estimated with

    def units(self, unit: str) -> int | None:
        """Rows of the index unit (index.unit: passage or sentence)."""
        return self.passages if unit == "passage" else self.sentences


def _sentences(passages: int) -> int:
    return round(passages * RATES["sentences_per_passage"].value)


def corpus_size(config: WbragConfig, passages: int | None = None, run: str | None = None) -> CorpusSize:
    """The corpus size and its source; `run`: the run folder to read ingest stats from (default: the config's)."""
    per = RATES["sentences_per_passage"]
    if passages is not None:
        return CorpusSize(passages, _sentences(passages),
                          f"given (--passages); sentences = passages x {per.value} [sentences_per_passage]",
                          rates=("sentences_per_passage",))
    tried = []
    run = run or config.run
    if run:
        found = _from_run(run)
        if isinstance(found, CorpusSize):
            return found
        tried.append(found)
    if config.ingest.corpus:
        found = _from_corpus(config.ingest.corpus)
        if isinstance(found, CorpusSize):
            return found
        tried.append(found)
    else:
        tried.append("ingest.corpus is not set")
    return CorpusSize(None, None, "unknown (" + "; ".join(tried) + "): pass --passages N")


def _from_run(uri: str) -> CorpusSize | str:
    try:
        folder = RunFolder(uri)
        if not folder.is_complete(INGEST.name):
            return f"run folder {uri} has no complete ingest"
        stats = folder.stats(INGEST.name) or {}
        return CorpusSize(int(stats["rows_out"]), int(stats["sentences"]),
                          f"the ingest stats of run folder {uri} (exact)")
    except (OSError, KeyError, ValueError) as exc:
        return f"run folder {uri} not readable here ({_first_line(exc)})"


def _from_corpus(uri: str) -> CorpusSize | str:
    import pyarrow.parquet as pq

    per = RATES["bytes_per_passage"]
    try:
        files = input_files(resolve(uri), "ingest.corpus")
        rows, jsonl_bytes, total = 0, 0, 0
        for f in files:
            size = f.size()
            total += size
            if file_kind(f) == "parquet":
                rows += pq.ParquetFile(f.path, filesystem=f.fs).metadata.num_rows
            else:
                jsonl_bytes += size
    except (OSError, InputError, ValueError) as exc:
        return f"corpus {uri} not readable here ({_first_line(exc)})"
    passages = rows + round(jsonl_bytes / per.value)
    how = f"{len(files)} corpus files"
    if jsonl_bytes:
        how += f": {jsonl_bytes:,} bytes of jsonl / {per.value} bytes a passage [bytes_per_passage] (estimate)"
    if rows:
        how += f"; {rows:,} Parquet rows"
    sentences_per = RATES["sentences_per_passage"].value
    return CorpusSize(passages, _sentences(passages), f"{how}; sentences = passages x {sentences_per} "
                      "[sentences_per_passage]", total,
                      ("bytes_per_passage",) * bool(jsonl_bytes) + ("sentences_per_passage",))


def question_count(path: str | None, limit: int | None) -> tuple[int | None, str]:
    """(questions, how it was counted) of a FlashRAG QA file; only a local file is read."""
    if not path:
        return None, "no file"
    if "://" in path or not os.path.exists(path):
        known = _known_split(path)
        why = "is not local" if "://" in path else "is not here"
        if known is None:
            return None, f"{path} {why}: not counted"
        n = min(known, limit) if limit is not None else known
        return n, f"{n:,}: FlashRAG's {known:,} questions of this split ({path} {why}: not counted)"
    try:
        n = 0
        for f in input_files(resolve(path), path):
            if file_kind(f) == "parquet":
                n += f.num_rows()
            else:
                with open(f.path, "rb") as handle:
                    n += sum(1 for line in handle if line.strip())
    except (OSError, InputError) as exc:
        return None, f"{path} not readable ({_first_line(exc)})"
    if limit is not None and limit < n:
        return limit, f"the first {limit:,} of {n:,} in {path}"
    return n, f"{n:,} in {path}"


# questions of FlashRAG's benchmark splits (its dataset card), for a QA file a plan cannot count (remote)
FLASHRAG_SPLITS = {("nq", "train"): 79_168, ("nq", "dev"): 8_757, ("nq", "test"): 3_610,
                   ("triviaqa", "train"): 78_785, ("triviaqa", "dev"): 8_837, ("triviaqa", "test"): 11_313,
                   ("popqa", "test"): 14_267, ("hotpotqa", "train"): 90_447, ("hotpotqa", "dev"): 7_405}


def _known_split(path: str) -> int | None:
    parts = path.rstrip("/").split("/")
    if len(parts) < 2:
        return None
    return FLASHRAG_SPLITS.get((parts[-2].lower(), parts[-1].rsplit(".", 1)[0].lower()))


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
