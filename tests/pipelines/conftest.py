"""A run built once per test session (ingest -> embed -> index -> eval on a slice of the demo data) with the
bundled models in fp32: the naive-RAG pipeline tests check its answer quality, and the tests that only need a
knowledge base to query (the adaptive methods, with the tiny generator) share it."""

import pytest

from tests.conftest import demo_questions, demo_records, write_jsonl
from wbrag_ray.cli import main


@pytest.fixture(scope="session")
def flashrag_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("flashrag")
    questions = demo_questions()[:8]
    wanted = {q["metadata"]["source_doc"] for q in questions}
    records = [r for r in demo_records() if r["id"] in wanted] + [r for r in demo_records() if r["id"] not in wanted][:16]
    corpus = write_jsonl(d / "wiki_slice.jsonl", records)
    # FlashRAG dataset files carry extra keys and numeric ids; one bad record must be rejected, not fatal.
    qs = [{"id": i, "question": q["question"], "golden_answers": q["golden_answers"], "metadata": q["metadata"]}
          for i, q in enumerate(questions)]
    qs.append({"id": "no-answers", "question": "What is missing?", "golden_answers": []})
    dataset = write_jsonl(d / "test.jsonl", qs)
    return corpus, dataset, len(records), len(questions)


@pytest.fixture(scope="session")
def built_run(tmp_path_factory, flashrag_files, ray_cluster):
    corpus, dataset, n_docs, n_q = flashrag_files
    run = tmp_path_factory.mktemp("runs") / "r1"
    config = run.parent / "cfg.yaml"
    config.write_text(
        f"run: {run}\n"
        f"ingest:\n  corpus: {corpus}\n"
        "embedder:\n  dtype: float32\n  num_cpus: 1\n  threads: 2\n"
        "generator:\n  dtype: float32\n  batch_size: 8\n  max_new_tokens: 16\n  num_cpus: 1\n  threads: 2\n"
        f"eval:\n  dataset: {dataset}\n  name: slice\n"
    )
    assert main(["run", str(config)]) == 0
    return run, config
