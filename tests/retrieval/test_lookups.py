"""Searches and evaluations read documents from the store the index build wrote (the manifest's `docs`): nothing
is built on a lookup. At 21M passages a store built from the corpus on the first lookup would read the whole
corpus and write about 14 GB into every node's cache."""

from __future__ import annotations

import json
import os

from wbrag_ray.cli import main
from wbrag_ray.run import RunFolder
from wbrag_ray.storage import cache_root


def _node_cache_stores() -> set[str]:
    root = os.path.join(cache_root(), "docstores")
    return set(os.listdir(root)) if os.path.isdir(root) else set()


def test_search_and_evaluation_read_the_built_store_and_build_none(demo_run, capsys):
    run, qa = demo_run
    manifest = json.loads((run / "index" / "manifest.json").read_text())
    assert manifest["docs"] == RunFolder(str(run)).layout.docs.join("passage").uri
    before = _node_cache_stores()
    assert main(["search", str(run), "--query", "highest mountain in the Alps", "-k", "3"]) == 0
    printed = capsys.readouterr().out
    assert printed.count("\n  ") >= 3 and "[" in printed  # three hits, each with its id, title and text
    assert main(["eval", str(run), "--dataset", str(qa), "--name", "lookups", "--methods", "naive", "--limit", "2"]) == 0
    preds = RunFolder(str(run)).layout.eval_result("lookups", "naive").predictions.read_table().to_pylist()
    docs = [d for p in preds for d in json.loads(p["docs"])]
    assert docs and all(d["text"] for d in docs)  # the documents' texts came from the store
    assert _node_cache_stores() == before
