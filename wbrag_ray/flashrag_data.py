"""FlashRAG's datasets and wiki-18 corpus into a folder a run reads (local or s3://): `wbrag data fetch` lists
the hub repository once, refuses unknown names and a too-small disk before downloading, resumes partial downloads,
unzips and checks the layout; `wbrag data check` checks a folder downloaded by hand."""

from __future__ import annotations

import hashlib
import os
import shutil
import urllib.request
import zipfile
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from urllib.parse import quote

import pyarrow.fs as pafs

from wbrag_ray.config import ConfigError
from wbrag_ray.formats import SPLITS, corpus_record, dataset_record, json_object
from wbrag_ray.storage import cache_root, resolve

REPO = "RUC-NLPIR/FlashRAG_datasets"  # a dataset repository
CORPORA = {"wiki18": "retrieval-corpus/wiki18_100w.zip"}  # the corpus the paper configs retrieve from (neither text names its corpus's version)
# the hub's folder where it differs from the dataset's usual name (its README's config names)
FOLDERS = {"msmarco-qa": "ms_marco", "wikiqa": "wiki_qa"}
CHECKED_RECORDS = 5  # the first records of each file that must parse: enough to catch another format


def _remote(uri: str) -> bool:
    return "://" in uri and not uri.startswith("file://")


def folder_of(dataset: str) -> str:
    return FOLDERS.get(dataset.lower(), dataset.lower())


@dataclass
class Layout:
    """What a data folder holds: per dataset, its split files and their records checked; the corpus file."""

    splits: dict[str, list[str]] = field(default_factory=dict)
    corpus: str | None = None
    problems: list[str] = field(default_factory=list)


def _unreadable(path: Path, read) -> str | None:
    """Why the first records of `path` are not what `read` takes; None where every one parses."""
    with path.open("rb") as f:
        records = [json_object(line) for line in islice((line for line in f if line.strip()), CHECKED_RECORDS)]
    if not records:
        return "empty file"
    reasons = [r if isinstance(r, str) else read(r) for r in records]
    return next((r for r in reasons if isinstance(r, str)), None)


def check_layout(folder: str | Path, datasets: list[str], corpus: str | None) -> Layout:
    """Problems of `folder` read as FlashRAG's layout (dataset split files, unzipped corpus), listed not raised."""
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
    """Unzip the corpus in `staging`, check the layout (ConfigError), copy to `out` where it is on object storage."""
    if corpus is not None:
        unzip_corpus(staging, corpus)
    layout = check_layout(staging, datasets, corpus)
    if layout.problems:
        raise ConfigError("the downloaded data is not FlashRAG's layout:\n  " + "\n  ".join(layout.problems))
    if _remote(out):
        dest = resolve(out)
        pafs.copy_files(str(staging), dest.path, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=dest.fs)
        if layout.corpus is not None:
            layout.corpus = dest.join(str(Path(layout.corpus).relative_to(staging))).uri
    return layout


UNZIP_FACTOR = 3.0  # a zipped JSON-lines corpus unzips to about this many times its size (wiki18: 5.1 GB -> ~14 GB)
CHUNK = 8 << 20


def endpoint() -> str:
    """The hub's address: HF_ENDPOINT (a mirror), else huggingface.co."""
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def repository_listing(revision: str | None = None) -> dict[str, int]:
    """{path: size} of every file of FlashRAG's repository at `revision` (default main): one listing call."""
    from huggingface_hub import HfApi

    try:
        entries = HfApi(endpoint=endpoint()).list_repo_tree(REPO, recursive=True, repo_type="dataset", revision=revision)
        return {e.path: int(e.size) for e in entries if getattr(e, "size", None) is not None}
    except Exception as exc:  # noqa: BLE001 - the hub's HTTP errors and its HTTP client's connection errors alike
        raise ConfigError(f"cannot list {REPO} on {endpoint()} (revision {revision or 'main'}): "
                          f"{' '.join(str(exc).split())[:300]}; check the network, HF_ENDPOINT and HF_TOKEN") from None


def files_to_fetch(listing: dict[str, int], datasets: list[str], corpus: str | None) -> dict[str, int]:
    """{path: size} of the repository files the named datasets and corpus need; unknown names refused."""
    if corpus is not None and corpus not in CORPORA:
        raise ConfigError(f"unknown corpus {corpus!r}: one of {', '.join(sorted(CORPORA))}")
    folders = sorted({p.split("/", 1)[0] for p in listing if "/" in p and p.endswith(".jsonl")})
    missing = [d for d in datasets if folder_of(d) not in folders]
    if missing:
        raise ConfigError(f"{REPO} holds no dataset {', '.join(repr(m) for m in missing)}; it holds: "
                          f"{', '.join(f for f in folders if f != 'retrieval-corpus')}")
    wanted = {p: n for p, n in listing.items()
              if any(p.startswith(folder_of(d) + "/") and p.endswith(".jsonl") and p.count("/") == 1 for d in datasets)}
    if corpus is not None:
        if CORPORA[corpus] not in listing:
            raise ConfigError(f"{REPO} holds no {CORPORA[corpus]} at this revision")
        wanted[CORPORA[corpus]] = listing[CORPORA[corpus]]
    return wanted


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def download(url: str, dest: Path, size: int) -> int:
    """`url` into `dest`, resuming a partial download with a range request; returns the bytes transferred."""
    if dest.exists() and dest.stat().st_size == size:
        return 0
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + ".incomplete")
    have = partial.stat().st_size if partial.exists() else 0
    if have > size:  # not this file's beginning
        partial.unlink()
        have = 0
    moved = 0
    if have < size:
        request = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
        from huggingface_hub import get_token

        if (token := get_token()) is not None:
            request.add_header("Authorization", f"Bearer {token}")
        with urllib.request.urlopen(request, timeout=60) as response:
            if have and response.status != 206:  # the server ignored the range: start over
                have = 0
            with partial.open("ab" if have else "wb") as f:
                while chunk := response.read(CHUNK):
                    f.write(chunk)
                    moved += len(chunk)
    got = partial.stat().st_size
    if got != size:
        raise ConfigError(f"{url}: got {got} of {size} bytes; run the same command again to resume")
    os.replace(partial, dest)
    return moved


def fetch(datasets: list[str], out: str, corpus: str | None = None, revision: str | None = None) -> Layout:
    """Download `datasets` and `corpus` from FlashRAG's hub repository into `out`, after checking the names against
    the listing at `revision` and the disk needed against the free space."""
    wanted = files_to_fetch(repository_listing(revision), datasets, corpus)
    if _remote(out):
        staging = Path(cache_root()) / "flashrag-staging" / hashlib.sha1(out.encode()).hexdigest()[:16]
    else:
        staging = Path(out)
    staging.mkdir(parents=True, exist_ok=True)
    here = {p: (staging / p).stat().st_size if (staging / p).exists() else 0 for p in wanted}
    partial = {p: (staging / (p + ".incomplete")).stat().st_size if (staging / (p + ".incomplete")).exists() else 0
               for p in wanted}
    todo = sum(n - (n if here[p] == n else partial[p]) for p, n in wanted.items())
    unzip = UNZIP_FACTOR * wanted.get(CORPORA.get(corpus or "", ""), 0)
    free = shutil.disk_usage(staging).free
    print(f"{REPO}@{revision or 'main'}: {len(wanted)} files, {_gb(sum(wanted.values()))}; to download "
          f"{_gb(todo)}{f' and about {_gb(unzip)} to unzip the corpus' if unzip else ''}; {_gb(free)} free at "
          f"{staging}", flush=True)
    if todo + unzip > free:
        raise ConfigError(f"{staging} has {_gb(free)} free; the fetch needs about {_gb(todo + unzip)}: free some "
                          "space or fetch to another folder (--out)")
    base = f"{endpoint()}/datasets/{REPO}/resolve/{revision or 'main'}/"
    for path, size in sorted(wanted.items()):
        moved = download(base + quote(path), staging / path, size)
        resumed = f" (resumed at {_gb(partial[path])})" if partial[path] and moved < size else ""
        print(f"  {path}: {_gb(size)}{resumed}" if moved or resumed else f"  {path}: already here", flush=True)
    layout = finish(staging, datasets, corpus, out)
    if _remote(out):
        shutil.rmtree(staging, ignore_errors=True)  # uploaded: the staging copy goes
    return layout
