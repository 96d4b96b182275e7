"""FlashRAG's datasets and retrieval corpus into a folder a run reads (local or s3://): `wbrag data fetch` and
`wbrag data check`.

Both papers evaluate on FlashRAG's preprocessed data: its QA datasets (`nq/train.jsonl`, `triviaqa/test.jsonl`,
... one folder per dataset, a JSON line per question with `id`, `question`, `golden_answers`) and its wiki-18
corpus (21M 100-word passages, `retrieval-corpus/wiki18_100w.zip`, one JSON line per passage with `id` and
`contents`), all in one dataset repository on the Hugging Face hub. `fetch` downloads only the files the named
datasets and corpus need (huggingface_hub's snapshot download with file patterns: the repository holds tens of
GB), unzips the corpus, checks the layout and, for an s3:// destination, uploads the folder. `check` reads a
folder downloaded by hand the same way: which splits each dataset has, and whether the first records of each
file parse as the run will read them (`formats.dataset_record`, `formats.corpus_record`).

After either, `ingest.corpus: OUT/retrieval-corpus/wiki18_100w.jsonl` and `eval.dataset: OUT/nq/test.jsonl`
(`writeback.train: OUT/nq/train.jsonl`) point a run at them; the dataset's name (`nq`) comes from its folder.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from wbrag_ray.config import ConfigError
from wbrag_ray.formats import SPLITS, corpus_record, dataset_record
from wbrag_ray.storage import resolve

REPO = "RUC-NLPIR/FlashRAG_datasets"  # a dataset repository
CORPORA = {"wiki18": "retrieval-corpus/wiki18_100w.zip"}  # the corpus both papers retrieve from
# the hub's folder where it differs from the dataset's usual name (its README's config names)
FOLDERS = {"msmarco-qa": "ms_marco", "wikiqa": "wiki_qa"}
CHECKED_RECORDS = 5  # the first records of each file that must parse: enough to catch another format


def _remote(uri: str) -> bool:
    return "://" in uri and not uri.startswith("file://")


def folder_of(dataset: str) -> str:
    return FOLDERS.get(dataset.lower(), dataset.lower())


def allow_patterns(datasets: list[str], corpus: str | None) -> list[str]:
    """The repository's files that `datasets` (every split) and `corpus` need, as snapshot-download patterns."""
    if corpus is not None and corpus not in CORPORA:
        raise ConfigError(f"unknown corpus {corpus!r}: one of {', '.join(sorted(CORPORA))}")
    patterns = [f"{folder_of(d)}/*.jsonl" for d in datasets]
    return patterns + ([CORPORA[corpus]] if corpus else [])


@dataclass
class Layout:
    """What a data folder holds: per dataset, its split files and their records checked; the corpus file."""

    splits: dict[str, list[str]] = field(default_factory=dict)
    corpus: str | None = None
    problems: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"splits": self.splits, "corpus": self.corpus, "problems": self.problems}


def _first_records(path: Path, n: int = CHECKED_RECORDS) -> list[Any]:
    out = []
    with path.open("rb") as f:
        for line in f:
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    out.append(f"malformed JSON: {exc.msg}")
            if len(out) == n:
                break
    return out


def _unreadable(path: Path, read) -> str | None:
    """Why the first records of `path` are not what `read` (a `formats` record reader: the row, or the reason
    it is rejected) takes; None where every one parses."""
    records = _first_records(path)
    if not records:
        return "empty file"
    reasons = [r if isinstance(r, str) else read(r) for r in records]
    return next((r for r in reasons if isinstance(r, str)), None)


def check_layout(folder: str | Path, datasets: list[str], corpus: str | None) -> Layout:
    """`folder` read as FlashRAG's layout: each of `datasets` a folder of split files whose first records are
    questions the run can read, and `corpus` (unzipped) a JSON-lines file of passages. Problems are listed,
    not raised: the caller decides."""
    root = Path(folder)
    layout = Layout()
    for dataset in datasets:
        where = root / folder_of(dataset)
        files = sorted(p for p in where.glob("*.jsonl") if p.stem in SPLITS) if where.is_dir() else []
        layout.splits[dataset] = [p.stem for p in files]
        if not files:
            layout.problems.append(f"{dataset}: no split files ({', '.join(s + '.jsonl' for s in SPLITS[:3])}) "
                                   f"in {where}")
        for path in files:
            if (why := _unreadable(path, dataset_record)) is not None:
                layout.problems.append(f"{dataset}/{path.name}: not FlashRAG QA records ({why})")
    if corpus is not None:
        path = (root / CORPORA[corpus]).with_suffix(".jsonl")
        if not path.exists():
            layout.problems.append(f"corpus {corpus}: {path} is missing (unzip {CORPORA[corpus]} there)")
        else:
            if (why := _unreadable(path, corpus_record)) is not None:
                layout.problems.append(f"corpus {corpus}: {path.name} is not FlashRAG corpus lines ({why})")
            layout.corpus = str(path)
    return layout


def unzip_corpus(folder: Path, corpus: str) -> Path:
    """The corpus zip unzipped beside itself (its JSON-lines file) and removed; a corpus already unzipped stays."""
    archive = folder / CORPORA[corpus]
    target = archive.with_suffix(".jsonl")
    if archive.exists():
        with zipfile.ZipFile(archive) as zf:
            members = [m for m in zf.namelist() if m.endswith(".jsonl")]
            if len(members) != 1:
                raise ConfigError(f"{archive} holds {len(members)} .jsonl files, expected 1")
            with zf.open(members[0]) as src, target.open("wb") as dst:
                shutil.copyfileobj(src, dst, 16 << 20)
        archive.unlink()
    return target


def finish(staging: Path, datasets: list[str], corpus: str | None, out: str) -> Layout:
    """What `fetch` does once the files are on local disk in `staging`: unzip the corpus, check the layout
    (a ConfigError on any problem), then copy the folder to `out` where it is on object storage."""
    if corpus is not None:
        unzip_corpus(staging, corpus)
    layout = check_layout(staging, datasets, corpus)
    if layout.problems:
        raise ConfigError("the downloaded data is not FlashRAG's layout:\n  " + "\n  ".join(layout.problems))
    if _remote(out):
        import pyarrow.fs as pafs

        dest = resolve(out)
        pafs.copy_files(str(staging), dest.path, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=dest.fs)
        if layout.corpus is not None:
            layout.corpus = dest.join(str(Path(layout.corpus).relative_to(staging))).uri
    return layout


def fetch(datasets: list[str], out: str, corpus: str | None = None, revision: str | None = None) -> Layout:
    """Download `datasets` (every split) and `corpus` from FlashRAG's repository on the hub into `out` (a local
    folder, or s3:// through a local staging folder); a local `out` keeps what is there and adds the rest."""
    from huggingface_hub import snapshot_download

    patterns = allow_patterns(datasets, corpus)
    with tempfile.TemporaryDirectory(prefix="wbrag-flashrag-") as tmp:
        staging = Path(tmp) if _remote(out) else Path(out)
        staging.mkdir(parents=True, exist_ok=True)
        snapshot_download(repo_id=REPO, repo_type="dataset", revision=revision, allow_patterns=patterns,
                          local_dir=str(staging))
        return finish(staging, datasets, corpus, out)
