"""`wbrag export`: each format is loaded with its own library (FlashRAG's documented reader: faiss.read_index and
corpus[row]; LangChain's FAISS.load_local; LlamaIndex's load_index_from_storage over a FaissVectorStore), the same
five questions go through it with the run's embedder, and the top 5 must be what the run's Retriever (and so
`wbrag search`) returns: Flat exactly, IVF at the run's nprobe. Pruned exports hold exactly the kept ids;
write-back exports hold the active version's units with their provenance.

Two runs: a copy of the session's passage run (Flat, the bundled MiniLM) with a small write-back version made
from its own passages, and a small sentence run of this module's own (IVF with 4 lists searched at nprobe 2, pruned
at 0.3). What the export reads (embedding shards, documents, indices, keep mask) is made by the project's own
stages, except two inputs that only feed them: the sentence run's embedding shards (embedded here, in this
process, with the same embedder) and its mastery predictions (drawn at random)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import faiss
import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
import yaml

from tests.conftest import demo_questions, demo_records, write_jsonl
from tests.index.conftest import index_config
from wbrag_ray import api
from wbrag_ray.build_kb import EMBED
from wbrag_ray.cli import main
from wbrag_ray.config import load_config
from wbrag_ray.formats import embeddings_table
from wbrag_ray.index.build import build_index
from wbrag_ray.index.files import load_manifest
from wbrag_ray.models.embedder import Embedder
from wbrag_ray.retrieval.local import IndexUnion, Retriever
from wbrag_ray.retrieval.union import UnionRule
from wbrag_ray.run import RunFolder
from wbrag_ray.writeback.distill import UNITS, WRITEBACK_ID_BASE
from wbrag_ray.writeback.versions import WRITEBACK, activate, active_index
from wbrag_ray.zerorag.prune import PREDICT, prune

pytest.importorskip("langchain_community")
pytest.importorskip("llama_index.vector_stores.faiss")

from langchain_community.vectorstores import FAISS  # noqa: E402
from langchain_community.vectorstores.utils import DistanceStrategy  # noqa: E402
from llama_index.core import StorageContext, load_index_from_storage  # noqa: E402
from llama_index.vector_stores.faiss import FaissVectorStore  # noqa: E402

from wbrag_ray.export import langchain as lc_export  # noqa: E402
from wbrag_ray.export import llamaindex as li_export  # noqa: E402

FORMATS = ("flashrag", "langchain", "llamaindex")
QUESTIONS = [q["question"] for q in demo_questions(5)]
ROOT = Path(__file__).resolve().parents[2]
N_UNITS = 4


# --- the runs -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def embedder(built_run):
    """The runs' embedder, loaded once: the queries of every reader and of every reference search."""
    config = RunFolder(str(built_run[0])).load_config()
    e = Embedder(config.embedder)
    e.setup()
    return e


def _write_back_version(run: RunFolder, config, embedder, version: str, passages: pd.DataFrame) -> None:
    """A trained write-back version made as the pipeline makes one, with units distilled by hand: each unit
    restates one passage (its source) and cites the passage's question as its example."""
    units = pd.DataFrame({
        "id": [WRITEBACK_ID_BASE + i for i in range(len(passages))],
        "unit_id": [f"wb:{version}:{i}" for i in range(len(passages))],
        "title": [f"{t} (knowledge unit)" for t in passages["title"]],
        "text": passages["text"].tolist(),
        "version": version,
        "source_example_id": [f"demo-q-{i}" for i in range(len(passages))],
        "question": "",
        "source_doc_ids": [[int(p)] for p in passages["pid"]],
        "source_doc_ranks": [[0]] * len(passages),
        "fallback": False,
        "source_tokens": 0,
        "distilled_tokens": 0,
        "merged_from": [[] for _ in range(len(passages))],
    })
    folder = run.layout.writeback_version(version)

    def work():
        folder.units.write_table(pa.Table.from_pandas(units, UNITS, preserve_index=False))
        vectors = embedder.encode_passages((units["title"] + "\n" + units["text"]).tolist())
        folder.embed_file.write_table(embeddings_table(units["id"].to_numpy(np.int64), vectors))
        build_index(folder.embed, folder.index, config.embedder.model, "writeback",
                    index_config("Flat"), docs=folder.corpus.uri, parallel=False)
        folder.stats.write_json({"version": version, "units_written": len(units)})
        return {"rows_in": len(units), "rows_out": len(units), "rows_rejected": 0}

    run.execute(WRITEBACK, config, work, params={"version": version, "train": "hand-made", "method": None})
    activate(run, version)


@pytest.fixture(scope="module")
def passage_run(built_run, embedder, tmp_path_factory):
    """A copy of the session's passage run (the original stays as the other tests expect it) with write-back
    version v1 active: one unit per gold passage of the first questions."""
    copy = tmp_path_factory.mktemp("export-passages") / "run"
    shutil.copytree(built_run[0], copy)
    run = RunFolder(str(copy))
    config = run.load_config()
    passages = run.layout.ingest.passages.read_table(["pid", "doc_id", "title", "text"]).to_pandas()
    gold = [q["metadata"]["source_doc"] for q in demo_questions(N_UNITS)]
    _write_back_version(run, config, embedder, "v1", passages.set_index("doc_id").loc[gold].reset_index())
    return run, config


@pytest.fixture(scope="module")
def sentence_run(embedder, tmp_path_factory, ray_cluster):
    """Sentences of 12 demo passages in an IVF index with 4 lists searched at nprobe 2, pruned at 0.3."""
    d = tmp_path_factory.mktemp("export-sentences")
    corpus = write_jsonl(d / "corpus.jsonl", demo_records(12))
    (d / "cfg.yaml").write_text(
        f"ingest:\n  corpus: {corpus}\n"
        "embedder:\n  dtype: float32\n  num_cpus: 1\n  threads: 2\n"
        "index:\n  unit: sentence\n  factory: IVF4,Flat\n  nprobe: 2\n"
    )
    config = load_config(str(d / "cfg.yaml"))
    run = RunFolder(str(d / "run"))
    api.build_kb(run, config, steps=("ingest",))

    def embed():  # two embedding shards, so the export reads documents shard by shard
        sentences = run.layout.ingest.sentences.read_table(["sid", "text"])
        sids, vectors = sentences["sid"].to_numpy(), embedder.encode_passages(sentences["text"].to_pylist())
        half = len(sids) // 2
        for i, part in enumerate((slice(0, half), slice(half, None))):
            run.layout.embed.join(f"emb-{i:06d}.parquet").write_table(embeddings_table(sids[part], vectors[part], "sid"))
        return {"rows_in": len(sids), "rows_out": len(sids), "rows_rejected": 0, "unit": "sentence"}

    def predict():
        sids = run.layout.ingest.sentences.read_table(["sid"])["sid"].to_numpy()
        scores = np.random.default_rng(0).random(len(sids))
        run.layout.zero_rag.predictions.join("pred-000000.parquet").write_table(
            pa.table({"sid": sids, "mastery_pred": scores}))
        return {"rows_in": len(sids), "rows_out": len(sids), "rows_rejected": 0}

    run.execute(EMBED, config, embed)
    api.build_kb(run, config, steps=("index",))
    run.execute(PREDICT, config, predict)
    prune(run, config, 0.3)
    return run, config


# --- reading each export with its own library ------------------------------------------------------------------


def _flashrag_top5(out, embedder) -> list[list[tuple[str, int]]]:
    """FlashRAG's dense retriever as documented: faiss.read_index(index_path), the corpus jsonl loaded in line
    order, queries embedded with the configured model and instruction, hit row r -> corpus[r]."""
    settings = yaml.safe_load((out / "flashrag_retriever.yaml").read_text())
    assert settings["retrieval_model_path"] == embedder.source and settings["use_sentence_transformer"]
    assert settings["instruction"] is None  # MiniLM has no query prefix, and FlashRAG adds none for its name
    corpus = [json.loads(line) for line in open(settings["corpus_path"], encoding="utf-8")]
    index = faiss.read_index(settings["index_path"])
    assert index.ntotal == len(corpus)
    _scores, rows = index.search(embedder.encode_queries(QUESTIONS), 5)
    return [[_key(corpus[r]["metadata"]) for r in row if r >= 0] for row in rows]


def _langchain_top5(out, embedder):
    store = FAISS.load_local(str(out), lc_export.embeddings(embedder), allow_dangerous_deserialization=True,
                             distance_strategy=DistanceStrategy.MAX_INNER_PRODUCT)
    return [[_key(doc.metadata) for doc, _score in store.similarity_search_with_score(q, k=5)] for q in QUESTIONS]


def _llamaindex_top5(out, embedder):
    context = StorageContext.from_defaults(vector_store=FaissVectorStore.from_persist_dir(str(out)), persist_dir=str(out))
    index = load_index_from_storage(context, embed_model=li_export.embed_model(embedder))
    retriever = index.as_retriever(similarity_top_k=5)
    return [[_key(hit.node.metadata) for hit in retriever.retrieve(q)] for q in QUESTIONS]


READERS = {"flashrag": _flashrag_top5, "langchain": _langchain_top5, "llamaindex": _llamaindex_top5}


def _key(metadata) -> tuple[str, int]:
    return metadata["source"], metadata["wbrag_id"]


def _run_retriever(index_dir, docs_dir, config) -> Retriever:
    """The base index searched in this process with the run config's search settings."""
    ic = config.index
    return Retriever(index_dir, docs_dir, config.embedder, ic.nprobe, ef_search=ic.ef_search, k_factor=ic.k_factor,
                     gpu=ic.gpu)


def _reference(retriever, embedder) -> list[list[tuple[str, int]]]:
    return [[h.key for h in hits] for hits in retriever.search_vectors(embedder.encode_queries(QUESTIONS), 5)]


def _export(run, config, fmt, out, **kwargs) -> dict:
    manifest = api.export(run, config, fmt, str(out), **kwargs)
    assert json.loads((out / "wbrag_export.json").read_text()) == manifest
    return manifest


def _exported_metadata(out) -> list[dict]:
    """Every exported document's metadata, in row order (from the FlashRAG corpus)."""
    return [json.loads(line)["metadata"] for line in open(out / "corpus.jsonl", encoding="utf-8")]


# --- tests ------------------------------------------------------------------------------------------------------


def test_base_export_in_each_format_returns_what_wbrag_search_returns(passage_run, embedder, tmp_path):
    run, config = passage_run
    expected = [[("base", h.id) for h in hits] for hits in api.search(run, config, QUESTIONS, 5)]  # `wbrag search`
    assert expected == _reference(_run_retriever(run.layout.index.uri, run.layout.ingest.root.uri, config),
                                  embedder)
    n = load_manifest(run.layout.index)["count"]
    for fmt in FORMATS:
        manifest = _export(run, config, fmt, tmp_path / fmt, writeback="none")
        assert manifest["counts"] == {"base": n} and manifest["writeback_version"] is None and manifest["union"] is None
        assert manifest["embedder"]["name"] == config.embedder.model and manifest["embedder"]["query_prefix"] == ""
        assert READERS[fmt](tmp_path / fmt, embedder) == expected, fmt


def test_write_back_export_holds_the_active_units_with_provenance_and_returns_the_union_search(
        passage_run, embedder, tmp_path):
    run, config = passage_run
    version, wb_index, wb_corpus = active_index(run)
    # the export holds base and units in one index, which its reader searches as one: the paper's merge by score
    union = IndexUnion([_run_retriever(run.layout.index.uri, run.layout.ingest.root.uri, config),
                        Retriever(wb_index, wb_corpus, None, source="writeback")], UnionRule("score"))
    expected = _reference(union, embedder)
    assert any(source == "writeback" for hits in expected for source, _id in hits)  # the units are found
    for fmt in FORMATS:
        manifest = _export(run, config, fmt, tmp_path / fmt)  # default: the active version
        assert manifest["writeback_version"] == version == "v1" and manifest["counts"]["writeback"] == N_UNITS
        # the export says it is a score merge, and which rule the run searches the version with
        assert manifest["union"]["export"] == "score" and manifest["union"]["what"].startswith("base passages and")
        assert manifest["union"]["same_as_run"] == (manifest["union"]["run"]["union"] == "score")
        assert READERS[fmt](tmp_path / fmt, embedder) == expected, fmt
    units = [m for m in _exported_metadata(tmp_path / "flashrag") if m["source"] == "writeback"]
    passages = run.layout.ingest.passages.read_table(["pid", "doc_id"]).to_pandas().set_index("doc_id")["pid"]
    gold = [q["metadata"]["source_doc"] for q in demo_questions(N_UNITS)]
    assert [m["source_doc_ids"] for m in units] == [[int(passages[g])] for g in gold]
    assert {m["version"] for m in units} == {"v1"} and all(m["unit"] == "writeback" for m in units)
    store = FAISS.load_local(str(tmp_path / "langchain"), lc_export.embeddings(embedder),
                             allow_dangerous_deserialization=True)
    doc = store.docstore.search("wb:v1:0")
    assert doc.metadata["source_doc_ids"] == [int(passages[gold[0]])] and doc.metadata["version"] == "v1"
    assert doc.page_content.split("\n", 1)[0] == doc.metadata["title"]


def test_pruned_export_holds_exactly_the_kept_ids_and_ivf_matches_at_the_same_nprobe(sentence_run, embedder, tmp_path):
    run, config = sentence_run
    keep = run.layout.zero_rag.pruned(0.3).keep.read_table(["id", "keep"]).to_pandas()
    kept = set(keep.loc[keep["keep"], "id"])
    assert 0 < len(kept) < len(keep)
    passage_of = run.layout.ingest.sentences.read_table(["sid", "pid"]).to_pandas().set_index("sid")["pid"]
    assert config.index.nprobe == 2 and load_manifest(run.layout.index)["factory"] == "IVF4,Flat"
    # the pruned view in every format; the full one in FlashRAG's (its rows are every sentence)
    for ratio, index, formats in ((0.3, run.layout.zero_rag.pruned(0.3).index, FORMATS),
                                  (None, run.layout.index, ("flashrag",))):
        expected = _reference(_run_retriever(index.uri, None, config), embedder)
        for fmt in formats:
            _export(run, config, fmt, tmp_path / f"{fmt}-{ratio}", prune_ratio=ratio)
            assert READERS[fmt](tmp_path / f"{fmt}-{ratio}", embedder) == expected, (fmt, ratio)
        flashrag = tmp_path / f"flashrag-{ratio}"
        exported = _exported_metadata(flashrag)
        ids = [m["wbrag_id"] for m in exported]
        assert len(ids) == len(set(ids)) and set(ids) == (kept if ratio else set(keep["id"]))
        assert all(m["unit"] == "sentence" and m["passage_id"] == passage_of[m["wbrag_id"]] for m in exported)
        assert faiss.extract_index_ivf(faiss.read_index(str(flashrag / "index.faiss"))).nprobe == 2


@pytest.mark.parametrize("fmt", ["flashrag", "langchain"])
def test_shards_are_encoded_in_ray_tasks_and_the_export_equals_one_made_in_process(sentence_run, tmp_path, monkeypatch,
                                                                                   fmt):
    """The IVF export's shards are read, matched with their documents and encoded in Ray tasks, the codes appended
    in order here: the files are byte for byte those of an export that adds every vector in this process with
    faiss's own `add`."""
    import wbrag_ray.export as export_module
    import wbrag_ray.export.view as view_module

    run, config = sentence_run
    manifest = _export(run, config, fmt, tmp_path / "tasks", prune_ratio=0.3)
    assert manifest["shards_in_tasks"] == 2  # both embedding shards, none in the writer's own process
    # the reference: the writer in this process, faiss's own `add` of every vector
    monkeypatch.setattr(view_module, "codes_index", lambda index: None)
    view = view_module.open_view(run, config.embedder, 0.3)
    (tmp_path / "here").mkdir()
    files, described = export_module._write(fmt, view, str(tmp_path / "here"), config)
    assert described["shards_in_tasks"] == 0 and described["counts"] == manifest["counts"]
    names = sorted(files)
    assert names == sorted(manifest["files"])
    for name in names:  # (the FlashRAG settings name their own folder)
        tasks = (tmp_path / "tasks" / name).read_bytes().replace(str(tmp_path / "tasks").encode(), b"OUT")
        here = (tmp_path / "here" / name).read_bytes().replace(str(tmp_path / "here").encode(), b"OUT")
        if name.endswith(".pkl"):  # pickled pydantic Documents hold a set, whose order is the process's hash seed
            tasks, here = (_pickled_docstore(data) for data in (tasks, here))
        assert tasks == here, name


def _pickled_docstore(data: bytes):
    """LangChain's index.pkl as plain values: (each document's id, text and metadata, the row -> id map)."""
    import pickle

    docstore, rows = pickle.loads(data)
    return [(k, d.id, d.page_content, d.metadata) for k, d in docstore._dict.items()], rows


def test_export_from_a_run_on_s3_through_the_cli(passage_run, s3_env, tmp_path):
    run, _config = passage_run
    remote = "s3://wbrag/export-run"
    api.open_run(remote).layout.root.upload_dir(run.layout.root.path)
    local_out, remote_out = tmp_path / "local", tmp_path / "from-s3"
    assert main(["export", run.uri, "--format", "flashrag", "--out", str(local_out)]) == 0
    # as a user runs it: `wbrag` in a shell that holds the credentials, its own local Ray (whose workers read the
    # shards) inheriting them; this session's Ray workers started before the S3 server's variables were set
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = subprocess.run([str(Path(sys.executable).parent / "wbrag"), "export", remote, "--format", "flashrag",
                          "--out", str(remote_out)], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (remote_out / "corpus.jsonl").read_text() == (local_out / "corpus.jsonl").read_text()
    assert (remote_out / "index.faiss").read_bytes() == (local_out / "index.faiss").read_bytes()
    assert json.loads((remote_out / "wbrag_export.json").read_text())["run"] == remote


def test_export_errors_name_the_fix(passage_run, tmp_path, capsys):
    run, _config = passage_run
    out = tmp_path / "out"
    assert main(["export", run.uri, "--format", "langchain", "--out", str(out), "--writeback", "nosuch"]) == 2
    assert "not trained" in capsys.readouterr().err
    assert main(["export", run.uri, "--format", "langchain", "--out", str(out), "--prune-ratio", "0.5"]) == 2
    assert "wbrag prune RUN --ratio 0.5" in capsys.readouterr().err
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(["export", run.uri, "--format", "langchain", "--out", str(out)]) == 2
    assert "--force" in capsys.readouterr().err and (out / "notes.txt").exists()
    job = subprocess.run([sys.executable, str(ROOT / "jobs" / "export.py"), "--help"], capture_output=True, text=True)
    assert job.returncode == 0 and "--format" in job.stdout and "CONFIG" in job.stdout.upper()


def test_flashrag_reader_itself_when_installed(passage_run, embedder, tmp_path):
    """FlashRAG's own DenseRetriever, where FlashRAG is installed (it is not in CI: flashrag-dev's dependencies
    build from the network). flashrag-dev 0.1.2 drops the `instruction` argument of parse_query in its
    sentence-transformers encoder; the shim passes it."""
    retriever_module = pytest.importorskip("flashrag.retriever.retriever")
    import flashrag.retriever.encoder as encoder
    import flashrag.retriever.utils as utils

    run, config = passage_run
    _export(run, config, "flashrag", tmp_path, writeback="none")
    settings = yaml.safe_load((tmp_path / "flashrag_retriever.yaml").read_text())
    settings.update(save_retrieval_cache=False, use_retrieval_cache=False, retrieval_cache_path=None,
                    use_reranker=False, retrieval_batch_size=8)
    original = encoder.parse_query
    encoder.parse_query = lambda name, queries: utils.parse_query(name, queries, settings["instruction"])
    try:
        results = retriever_module.DenseRetriever(settings).batch_search(QUESTIONS, 5)
    finally:
        encoder.parse_query = original
    expected = [[h.id for h in hits] for hits in api.search(run, config, QUESTIONS, 5)]
    assert [[int(d["id"]) for d in docs] for docs in results] == expected
