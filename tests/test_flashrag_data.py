"""`wbrag data`: FlashRAG's layout on a local folder laid out as the hub repository is (this machine cannot reach
the hub; the download itself is huggingface_hub's snapshot download with the patterns checked here), the
corpus unzipped, the folder checked, and a fetch to object storage (the S3-compatible server on loopback)."""

import shutil
import zipfile

import pytest

from tests.conftest import DATA, DEMO_CORPUS, DEMO_QA
from wbrag_ray.cli import main
from wbrag_ray.config import ConfigError
from wbrag_ray.flashrag_data import allow_patterns, check_layout, finish
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
    assert allow_patterns(["nq", "msmarco-qa"], "wiki18") == ["nq/*.jsonl", "ms_marco/*.jsonl",
                                                              "retrieval-corpus/wiki18_100w.zip"]
    assert allow_patterns(["TriviaQA"], None) == ["triviaqa/*.jsonl"]
    with pytest.raises(ConfigError, match="unknown corpus 'wiki21'"):
        allow_patterns(["nq"], "wiki21")


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
