"""`wbrag data`: FlashRAG's layout on a local folder laid out as the hub repository is, the corpus unzipped, the folder
checked, a fetch to object storage (the S3-compatible server on loopback), and `fetch()` itself against a
repository served on loopback (this machine cannot reach the hub): names checked against the listing, the
revision, the disk it needs, a partial download resumed."""

import http.server
import json
import shutil
import threading
import urllib.parse
import zipfile
from pathlib import Path

import pytest

from tests.conftest import DATA, DEMO_CORPUS, DEMO_QA
from wbrag_ray import flashrag_data
from wbrag_ray.cli import main
from wbrag_ray.config import ConfigError
from wbrag_ray.flashrag_data import REPO, check_layout, fetch, files_to_fetch, finish
from wbrag_ray.formats import dataset_name, read_dataset
from wbrag_ray.storage import resolve


def hub_layout(root):
    """A folder as the repository lays its files out: nq's splits, and the corpus zipped in retrieval-corpus/."""
    (root / "nq").mkdir(parents=True)
    shutil.copy(DATA / "demo_train.jsonl", root / "nq" / "train.jsonl")
    shutil.copy(DEMO_QA, root / "nq" / "test.jsonl")
    (root / "retrieval-corpus").mkdir()
    with zipfile.ZipFile(root / "retrieval-corpus" / "wiki18_100w.zip", "w") as zf:
        zf.write(DEMO_CORPUS, "wiki18_100w.jsonl")
    return root


def test_the_download_asks_only_for_the_named_datasets_and_corpus():
    listing = {"nq/train.jsonl": 1, "nq/test.jsonl": 2, "ms_marco/dev.jsonl": 3, "triviaqa/test.jsonl": 4,
               "triviaqa/extra/test.jsonl": 5, "popqa/test.jsonl": 6, "retrieval-corpus/wiki18_100w.zip": 7}
    assert files_to_fetch(listing, ["nq", "msmarco-qa"], "wiki18") == {
        "nq/train.jsonl": 1, "nq/test.jsonl": 2, "ms_marco/dev.jsonl": 3, "retrieval-corpus/wiki18_100w.zip": 7}
    assert files_to_fetch(listing, ["TriviaQA"], None) == {"triviaqa/test.jsonl": 4}
    with pytest.raises(ConfigError, match="unknown corpus 'wiki21'"):
        files_to_fetch(listing, ["nq"], "wiki21")


def test_a_fetch_to_object_storage_unzips_checks_and_uploads_what_a_run_reads(tmp_path, s3_env):
    staging = hub_layout(tmp_path / "staging")
    layout = finish(staging, ["nq"], "wiki18", "s3://wbrag/flashrag")
    assert layout.problems == [] and layout.splits == {"nq": ["test", "train"]}
    assert layout.corpus == "s3://wbrag/flashrag/retrieval-corpus/wiki18_100w.jsonl"
    assert not (staging / "retrieval-corpus" / "wiki18_100w.zip").exists()  # unzipped, the zip gone
    corpus = resolve(layout.corpus)
    with corpus.fs.open_input_stream(corpus.path) as f:
        assert f.read() == DEMO_CORPUS.read_bytes()
    # the questions as a run reads them from there, and the dataset's name from its folder
    questions, rejects = read_dataset(resolve("s3://wbrag/flashrag/nq/test.jsonl"))
    assert questions.num_rows == 40 and rejects.num_rows == 0
    assert dataset_name("s3://wbrag/flashrag/nq/test.jsonl") == "nq"


def test_check_reads_a_folder_downloaded_by_hand(tmp_path, capsys):
    root = hub_layout(tmp_path / "data")
    # the corpus still zipped: check says how to fix it
    assert main(["data", "check", "flashrag", "nq", "--out", str(root), "--corpus", "wiki18"]) == 2
    assert "wiki18_100w.jsonl is missing (unzip retrieval-corpus/wiki18_100w.zip there)" in capsys.readouterr().err
    with zipfile.ZipFile(root / "retrieval-corpus" / "wiki18_100w.zip") as zf:
        zf.extractall(root / "retrieval-corpus")
    assert main(["data", "check", "flashrag", "nq", "--out", str(root), "--corpus", "wiki18"]) == 0
    out = capsys.readouterr().out
    assert f"nq: test, train in {root}/nq/" in out and "wiki18_100w.jsonl (ingest.corpus)" in out

    # a dataset not downloaded, and a split in another format
    (root / "popqa").mkdir()
    (root / "popqa" / "test.jsonl").write_text('{"q": "Who?", "a": "Nobody"}\n')
    layout = check_layout(root, ["nq", "popqa", "hotpotqa"], None)
    assert layout.splits == {"nq": ["test", "train"], "popqa": ["test"], "hotpotqa": []}
    assert layout.problems == [
        "popqa/test.jsonl: not FlashRAG QA records (missing or empty 'question')",
        f"hotpotqa: no split files (train.jsonl, dev.jsonl, test.jsonl) in {root}/hotpotqa",
    ]
    assert main(["data", "check", "flashrag", "--out", str(root)]) == 2  # nothing named


# --- fetch() against a repository served on loopback (the hub cannot be reached from here) ------------------------


class LoopbackRepository(http.server.ThreadingHTTPServer):
    """A folder served as the hub serves a dataset repository: the tree listing (GET /api/datasets/REPO/tree/REV)
    and file downloads with byte ranges (GET /datasets/REPO/resolve/REV/PATH); every request is logged with its
    revision, range and the bytes sent."""

    def __init__(self, root: Path):
        self.root, self.log = root, []
        super().__init__(("127.0.0.1", 0), _RepositoryHandler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def downloads(self) -> list[dict]:
        return [e for e in self.log if e["kind"] == "resolve"]


class _RepositoryHandler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        root, path = self.server.root, urllib.parse.urlparse(self.path).path
        tree, resolve = f"/api/datasets/{REPO}/tree/", f"/datasets/{REPO}/resolve/"
        if path.startswith(tree):
            files = [p for p in sorted(root.rglob("*")) if p.is_file()]
            body = json.dumps([{"type": "file", "path": str(p.relative_to(root)), "size": p.stat().st_size,
                                "oid": "0" * 40} for p in files]).encode()
            self.server.log.append({"kind": "tree", "revision": urllib.parse.unquote(path[len(tree):])})
            return self._send(200, body, "application/json")
        if path.startswith(resolve):
            revision, name = urllib.parse.unquote(path[len(resolve):]).split("/", 1)
            data = (root / name).read_bytes()
            start = int(self.headers["Range"].split("=")[1].rstrip("-")) if self.headers["Range"] else 0
            self.server.log.append({"kind": "resolve", "revision": revision, "path": name, "start": start,
                                    "sent": len(data) - start})
            return self._send(206 if start else 200, data[start:], "application/octet-stream")
        self._send(404, b"{}", "application/json")

    def _send(self, status, body, kind):
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def repository(tmp_path, monkeypatch):
    served = hub_layout(tmp_path / "repository")
    (served / "popqa").mkdir()
    shutil.copy(DEMO_QA, served / "popqa" / "test.jsonl")
    server = LoopbackRepository(served)
    monkeypatch.setenv("HF_ENDPOINT", server.url)  # as a mirror is named
    yield server
    server.shutdown()


def test_fetch_refuses_a_name_the_repository_does_not_hold_before_any_download_loopback_repository(repository,
                                                                                                   tmp_path):
    out = tmp_path / "flashrag"
    with pytest.raises(ConfigError, match=r"holds no dataset 'entityquestions'; it holds: nq, popqa$"):
        fetch(["nq", "entityquestions"], str(out), "wiki18")
    assert [e["kind"] for e in repository.log] == ["tree"]  # listed, nothing downloaded
    assert not out.exists()


def test_fetch_downloads_at_the_revision_resumes_a_partial_file_and_checks_the_layout_loopback_repository(
        repository, tmp_path, capsys):
    out = tmp_path / "flashrag"
    train = (repository.root / "nq" / "train.jsonl").read_bytes()
    (out / "nq").mkdir(parents=True)
    (out / "nq" / "train.jsonl.incomplete").write_bytes(train[: len(train) // 2])  # a download cut short
    layout = fetch(["nq"], str(out), "wiki18", revision="0123abc")
    assert layout.problems == [] and layout.splits == {"nq": ["test", "train"]}
    assert layout.corpus == str(out / "retrieval-corpus" / "wiki18_100w.jsonl")
    assert (out / "nq" / "train.jsonl").read_bytes() == train and (out / "nq" / "test.jsonl").read_bytes() == \
        (repository.root / "nq" / "test.jsonl").read_bytes()
    assert Path(layout.corpus).read_bytes() == DEMO_CORPUS.read_bytes()  # unzipped
    assert not (out / "popqa").exists()  # only what was named
    downloads = {e["path"]: e for e in repository.downloads()}
    assert sorted(downloads) == ["nq/test.jsonl", "nq/train.jsonl", "retrieval-corpus/wiki18_100w.zip"]
    assert {e["revision"] for e in repository.log} == {"0123abc"}  # listing and files at the pinned revision
    assert downloads["nq/train.jsonl"]["start"] == len(train) // 2  # resumed, not fetched again
    assert downloads["nq/train.jsonl"]["sent"] == len(train) - len(train) // 2
    said = capsys.readouterr().out
    assert "3 files" in said and "to download" in said and "to unzip the corpus" in said and "free at" in said
    # again: everything is here, nothing is downloaded a second time
    repository.log.clear()
    fetch(["nq"], str(out), revision="0123abc")
    assert repository.downloads() == [] and "nq/train.jsonl: already here" in capsys.readouterr().out


def test_fetch_refuses_a_disk_too_small_before_any_download_loopback_repository(repository, tmp_path, monkeypatch):
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(flashrag_data.shutil, "disk_usage", lambda path: usage._replace(free=1000))
    with pytest.raises(ConfigError, match="has 0.0 MB free; the fetch needs about"):
        fetch(["nq"], str(tmp_path / "flashrag"), "wiki18")
    assert repository.downloads() == []


def test_fetch_to_object_storage_through_a_staging_folder_loopback_repository(repository, s3_env, tmp_path,
                                                                               monkeypatch):
    monkeypatch.setenv("WBRAG_CACHE", str(tmp_path / "cache"))
    layout = fetch(["popqa"], "s3://wbrag/fetched")
    assert layout.splits == {"popqa": ["test"]}
    questions, _ = read_dataset(resolve("s3://wbrag/fetched/popqa/test.jsonl"))
    assert questions.num_rows == 40
    assert not list((tmp_path / "cache" / "flashrag-staging").iterdir())  # uploaded: the staging copy is gone
