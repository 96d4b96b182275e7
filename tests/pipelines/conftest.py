"""A run built once per test session (ingest -> embed -> index -> eval on a slice of the demo data) with the
bundled models in fp32: the naive-RAG pipeline tests check its answer quality, and the tests that only need a
knowledge base to query (the adaptive methods, with the tiny generator) share it."""

import json
from pathlib import Path

import pytest

from tests.conftest import DATA, demo_questions, demo_records, write_jsonl
from wbrag_ray.cli import main
from wbrag_ray.run import RunFolder


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


ROOT = DATA.parents[1]
N_SAMPLE = 48


@pytest.fixture(scope="session")
def chain(tmp_path_factory, ray_cluster, tiny):
    d = tmp_path_factory.mktemp("zr")
    test = demo_questions(6)
    train = [json.loads(line) for line in (DATA / "demo_train.jsonl").read_text().splitlines()][:10]
    wanted = {q["metadata"]["source_doc"] for q in test + train}
    records = [r for r in demo_records() if r["id"] in wanted] + [r for r in demo_records() if r["id"] not in wanted][:8]
    corpus, test_file = write_jsonl(d / "corpus.jsonl", records), write_jsonl(d / "test.jsonl", test)
    train_file = write_jsonl(d / "train.jsonl", train)
    run = d / "run"
    args = ["run", str(ROOT / "jobs" / "configs" / "zero_rag_demo.yaml"), "--run", str(run),
            "--set", f"ingest.corpus={corpus}", "--set", f"eval.dataset={test_file}", "--set", "eval.name=t",
            "--set", f"zerorag.train={train_file}", "--set", f"zerorag.sample={N_SAMPLE}",
            "--set", "zerorag.ratios=[0.3]", "--set", "zerorag.lm_pruner.max_steps=3",
            "--set", "zerorag.tune.max_steps=2", "--set", "zerorag.tune.max_length=160",
            "--set", "zerorag.tune.targets=gold",  # a random-weight model answers no row right: no own targets
            "--set", "generator.max_new_tokens=8", "--set", "zerorag.mastery_metric=em",  # the paper's score
            # WriteBack-RAG on the same run (every example useful, units from the fallback documents), so the grid
            # also evaluates a pruned base + write-back: the two methods combined
            "--set", f"writeback.train={train_file}", "--set", "writeback.limit=3", "--set", "writeback.tau_s=-1",
            "--set", "writeback.tau_delta=-2", "--set", "writeback.tau_doc=2", "--set", "writeback.rag_method=replug",
            "--set", "writeback.extract_max_new_tokens=24", "--set", "writeback.rewrite_max_new_tokens=24",
            "--set", "writeback.evaluate=false", *tiny.set_args()]
    assert main(args) == 0
    return RunFolder(str(run)), test_file


def relocate(folder: Path, old: str, new: str) -> None:
    """Rewrite every path under `old` to `new` in the JSON files of a copied run folder (manifests, listings)."""
    for path in folder.rglob("*.json"):
        text = path.read_text()
        if old in text:
            path.write_text(text.replace(old, new))
