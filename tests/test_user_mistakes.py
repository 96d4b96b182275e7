"""The mistakes a new user makes, each on a built run (the demo's 100 passages, the tiny models): every one gets a
clear error (exit code 2, one line naming the problem and the fix, no traceback) before any work, or a correct
result, and the run folder is left exactly as it was. Mistakes that need no Ray run the real `wbrag` command in a
fresh process, which must neither import Ray nor torch nor start a Ray cluster before its error: the user waits on
imports, not on a cluster, whatever the CPU (a CPU-seconds bound measured the machine's kind as much as the work)."""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from tests.conftest import DEMO_CORPUS, demo_questions, write_jsonl
from wbrag_ray.cli import main
from wbrag_ray.run import RunFolder

WBRAG = str(Path(sys.executable).parent / "wbrag")
HEAVY_MODULES = {"ray", "torch", "vllm", "transformers", "sentence_transformers"}  # faiss checks factories


def snapshot(folder: Path) -> dict[str, str]:
    """Every file below `folder` with a digest of its bytes: 'nothing changed' means equal snapshots."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def wbrag(*args: str) -> tuple[subprocess.CompletedProcess, set[str], list[str]]:
    """The installed `wbrag` command in a fresh process; the top-level modules it imported (Python's own import log,
    taken out of its stderr); and what a Ray cluster it started would have left in its temp folder (empty before;
    RAY_ADDRESS removed so any `ray.init` would start one there rather than join the tests' cluster)."""
    with tempfile.TemporaryDirectory() as ray_tmp:
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env.update(PYTHONPROFILEIMPORTTIME="1", RAY_TMPDIR=ray_tmp)
        out = subprocess.run([WBRAG, *args], capture_output=True, text=True, timeout=120, env=env)
        ray_left = sorted(p.name for p in Path(ray_tmp).iterdir())
    lines = out.stderr.splitlines(keepends=True)
    log = [line for line in lines if line.startswith("import time:")]
    out.stderr = "".join(line for line in lines if line not in log)
    return out, {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in log}, ray_left


def assert_one_line_error(stderr: str, command: str, *words: str) -> str:
    """Exit-2 errors: the message is the last line, says `wbrag COMMAND:`, names `words`; no traceback anywhere."""
    assert "Traceback" not in stderr, stderr[-3000:]
    line = stderr.strip().splitlines()[-1]
    assert line.startswith(f"wbrag {command}: "), stderr[-3000:]
    for word in words:
        assert word in line, line
    return line


def assert_refused_fast(args: list[str], *words: str) -> str:
    out, modules, ray_left = wbrag(*args)
    assert out.returncode == 2, (out.stdout[-2000:], out.stderr[-2000:])
    line = assert_one_line_error(out.stderr, args[0], *words)
    assert "wbrag_ray" in modules, "the import log is empty: the check below would pass for nothing"
    assert not modules & HEAVY_MODULES, f"imported {sorted(modules & HEAVY_MODULES)} before the error: {line}"
    assert not ray_left, f"started a Ray cluster before the error ({ray_left}): {line}"
    return line


# --- 1. another corpus on a built run ----------------------------------------------------------------------


def test_another_corpus_on_a_built_run_is_refused_and_provenance_kept(demo_run, tmp_path):
    run, _ = demo_run
    other = write_jsonl(tmp_path / "other.jsonl", [{"id": "x1", "contents": "Other\nAnother corpus entirely."}])
    before = snapshot(run)
    assert_refused_fast(["ingest", str(run), "--corpus", str(other)], "params.corpus", "another corpus", "--force")
    assert snapshot(run) == before  # run.json still names the corpus the passages came from
    assert json.loads((run / "run.json").read_text())["config"]["ingest"]["corpus"] == str(DEMO_CORPUS)


def test_the_same_corpus_from_a_moved_copy_is_the_same_corpus(demo_run, tmp_path, capsys):
    run, _ = demo_run
    moved = tmp_path / "moved" / DEMO_CORPUS.name
    moved.parent.mkdir()
    moved.write_bytes(DEMO_CORPUS.read_bytes())
    before = snapshot(run)
    assert main(["ingest", str(run), "--corpus", str(moved)]) == 0
    assert "[ingest] complete, skipped" in capsys.readouterr().out
    assert snapshot(run) == before  # skipped: run.json is not rewritten with the moved path


def test_a_corpus_gone_after_ingest_does_not_stop_the_run_but_cannot_be_ingested_again(tmp_path, ray_cluster, capsys):
    corpus = write_jsonl(tmp_path / "corpus.jsonl", [{"id": f"d{i}", "contents": f"T{i}\nText {i}."} for i in range(4)])
    run = tmp_path / "run"
    assert main(["ingest", str(run), "--corpus", str(corpus)]) == 0
    corpus.unlink()  # moved or deleted after ingest: the built stages still stand for it
    capsys.readouterr()
    assert main(["ingest", str(run), "--corpus", str(corpus)]) == 0
    out = capsys.readouterr().out
    assert "is not there any more" in out and "[ingest] complete, skipped" in out
    before = snapshot(run)
    assert main(["ingest", str(run), "--corpus", str(corpus), "--force"]) == 2  # ingesting again needs it
    assert_one_line_error(capsys.readouterr().err, "ingest", "does not exist")
    assert snapshot(run) == before  # refused before anything was deleted


def test_prune_before_train_pruner_names_the_command_before_ray(demo_run, capsys):
    run, _ = demo_run
    before = snapshot(run)
    assert main(["prune", str(run), "--ratio", "0.3"]) == 2
    assert_one_line_error(capsys.readouterr().err, "prune", "pruner-embedding", "wbrag train-pruner RUN")
    assert snapshot(run) == before


# --- 2. a corpus with no usable rows ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["utf16", "json-array", "qa-file"])
def test_a_corpus_with_no_usable_rows_fails_with_its_reasons_and_leaves_no_stage(kind, tmp_path, ray_cluster, capsys):
    records = [{"id": f"d{i}", "contents": f"Title {i}\nSome text {i}."} for i in range(5)]
    corpus = tmp_path / "corpus.jsonl"
    if kind == "utf16":
        corpus.write_bytes("\n".join(json.dumps(r) for r in records).encode("utf-16"))
        reason = "invalid UTF-8"
    elif kind == "json-array":
        corpus.write_text(json.dumps(records, indent=1))
        reason = "malformed JSON"
    else:
        write_jsonl(corpus, demo_questions(5))
        reason = "missing 'contents'"
    run = tmp_path / "run"
    assert main(["ingest", str(run), "--corpus", str(corpus)]) == 2
    line = assert_one_line_error(capsys.readouterr().err, "ingest", "no usable passages", reason, "FlashRAG")
    assert "rejected" in line
    folder = RunFolder(str(run))
    assert not folder.is_complete("ingest") and not folder.layout.ingest.root.exists()
    # the way out: the right corpus, same folder, no --force
    good = write_jsonl(tmp_path / "good.jsonl", records)
    assert main(["ingest", str(run), "--corpus", str(good)]) == 0
    assert folder.stats("ingest")["rows_out"] == 5


# --- 3. an evaluation rerun with settings that change answers ------------------------------------------------


def test_an_evaluation_is_never_silently_replaced(demo_run, capsys):
    run, qa = demo_run
    folder = RunFolder(str(run))
    result = folder.layout.eval_result("qa", "naive")
    before = snapshot(run)
    args = ["eval", str(run), "--dataset", str(qa), "--name", "qa", "--methods", "naive"]
    assert_refused_fast([*args, "--set", "generator.max_new_tokens=8"], "other settings", "max_new_tokens: 16 -> 8",
                        "--force", "--name")
    assert snapshot(run) == before
    # the same settings: the stored results, printed again
    assert main(args) == 0
    assert "[eval-qa] complete, skipped" in capsys.readouterr().out
    assert snapshot(run) == before
    # --force replaces them, and the stage's record then describes the new files
    assert main([*args, "--set", "generator.max_new_tokens=8", "--force"]) == 0
    stats = folder.stats("eval-qa")
    assert stats["settings"]["config"]["generator"]["max_new_tokens"] == 8
    assert result.metrics.read_json()["generator"]["max_new_tokens"] == 8
    assert stats["methods"]["naive"] == result.metrics.read_json()


# --- 4. names stay inside the run ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["../../x", "/tmp/x", "a/b", ".hidden", ""])
def test_names_never_become_paths_outside_the_run(demo_run, name):
    run, qa = demo_run
    before = snapshot(run.parent)
    assert_refused_fast(["eval", str(run), "--dataset", str(qa), "--name", name], "not a plain name")
    assert snapshot(run.parent) == before


def test_a_write_back_version_name_is_a_plain_name_too(demo_run):
    run, qa = demo_run
    before = snapshot(run.parent)
    assert_refused_fast(["writeback", str(run), "--train", str(qa), "--version", "../x"], "not a plain name")
    assert_refused_fast(["writeback", str(run), "--sweep", "../../x"], "not a plain name")
    assert snapshot(run.parent) == before


# --- 5. the dashboard's address instead of the cluster's ------------------------------------------------------


class _StandInDashboard(http.server.BaseHTTPRequestHandler):
    """Answers /api/version as Ray's dashboard does (a stand-in: a real dashboard needs a second Ray cluster)."""

    def do_GET(self):  # noqa: N802 - http.server's name
        body = json.dumps({"version": "4", "ray_version": "2.60.0", "ray_commit": "x"}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_the_dashboard_port_as_address_fails_fast_with_a_hint_stand_in_dashboard(demo_run):
    run, _ = demo_run
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _StandInDashboard)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        address = f"127.0.0.1:{server.server_address[1]}"
        line = assert_refused_fast(["search", str(run), "--query", "highest mountain", "--address", address],
                                   "dashboard", "6379")
        assert address in line
    finally:
        server.shutdown()


# --- 6. search's K and query ----------------------------------------------------------------------------------


@pytest.mark.parametrize("args, words", [
    (["-k", "0", "--query", "mountain"], ["-k 0", "at least 1"]),
    (["-k", "-1", "--query", "mountain"], ["-k -1", "at least 1"]),
    (["--query", ""], ["empty query"]),
    (["--query", "   "], ["empty query"]),
])
def test_search_refuses_a_k_below_one_and_an_empty_query(demo_run, args, words):
    run, _ = demo_run
    assert_refused_fast(["search", str(run), *args], *words)


# --- 7. --limit 0 ---------------------------------------------------------------------------------------------


def test_eval_limit_zero_is_refused_not_read_as_no_limit(demo_run):
    run, qa = demo_run
    before = snapshot(run)
    assert_refused_fast(["eval", str(run), "--dataset", str(qa), "--name", "lim", "--limit", "0"], "eval.limit")
    assert snapshot(run) == before


# --- 8. more documents than the index holds, and a prompt past the generator's context ----------------------


def test_top_k_past_the_index_is_capped_and_a_prompt_past_the_context_refused_with_numbers(demo_run, capsys):
    run, qa = demo_run
    before = snapshot(run)
    assert main(["eval", str(run), "--dataset", str(qa), "--name", "bigk", "--methods", "naive", "--limit", "1",
                 "--set", "retrieval.top_k=1000"]) == 2
    captured = capsys.readouterr()
    assert "retrieval.top_k=1000 is more than the 100 documents the index holds: K = 100" in captured.out
    line = assert_one_line_error(captured.err, "eval", "tokens plus 16 new tokens is longer than the context",
                                 "(8,192 tokens)", "retrieval.top_k")
    prompt_tokens = int(line.split("a prompt of ")[1].split(" tokens")[0].replace(",", ""))
    assert prompt_tokens > 8192 - 16  # 100 passages of about 350 characters
    assert not RunFolder(str(run)).is_complete("eval-bigk")
    assert snapshot(run) == before


# --- 9. report and inspect on a folder that is not a run -------------------------------------------------------


@pytest.mark.parametrize("command", ["report", "inspect"])
def test_report_and_inspect_refuse_a_folder_that_is_not_a_run_and_create_nothing(command, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    for folder in (empty, tmp_path / "missing"):
        assert_refused_fast([command, str(folder)], "not a run folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"] and not any(empty.iterdir())


# --- and the noisy ones -------------------------------------------------------------------------------------------


def test_a_missing_dataset_is_one_line(demo_run, tmp_path):
    run, _ = demo_run
    assert_refused_fast(["eval", str(run), "--dataset", str(tmp_path / "nope.jsonl")], "dataset", "does not exist")


def test_a_dataset_without_usable_questions_says_why(demo_run, tmp_path, capsys):
    run, _ = demo_run
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"id": i, "question": f"q{i}?"} for i in range(3)] + [b"{oops"])
    before = snapshot(run)
    assert main(["eval", str(run), "--dataset", str(bad), "--name", "bad", "--methods", "naive"]) == 2
    assert_one_line_error(capsys.readouterr().err, "eval", "no usable questions", "4 rejected",
                          "3 x missing or empty 'golden_answers'", "unreadable line")
    assert snapshot(run) == before


@pytest.mark.parametrize("args, words", [
    (["prune", "{run}", "--ratio", "1.5"], ["--ratio 1.5", "below 1"]),
    (["eval", "{run}", "--dataset", "{qa}", "--prune-ratio", "1.5"], ["--prune-ratio 1.5", "below 1"]),
    (["index", "{run}", "--factory", "IVF12,NoSuchCodec"], ["index.factory 'IVF12,NoSuchCodec'", "Flat"]),
    (["index", "{run}", "--factory", "PQ7"], ["index.factory 'PQ7'", "32-dimensional"]),  # the built vectors' dim
    (["train-router", "{run}", "--train", "{missing}"], ["zerorag.train", "does not exist"]),
])
def test_ratios_factories_and_inputs_are_checked_before_ray(demo_run, tmp_path, args, words):
    run, qa = demo_run
    before = snapshot(run)
    args = [a.format(run=run, qa=qa, missing=tmp_path / "nope.jsonl") for a in args]
    line = assert_refused_fast(args, *words)
    assert "wbrag prune RUN --ratio 1.5" not in line  # a ratio out of range is not a stage to run first
    assert snapshot(run) == before


def test_a_missing_faiss_names_the_extra_that_installs_it(monkeypatch):
    """Plain `pip install wbrag-ray` has no faiss (it comes with the `cpu` or `gpu` extra): the import error, in
    the driver or in a Ray worker, is one line that names the extras; any other missing module stays a bug."""
    import ray

    from wbrag_ray.cli import user_error

    monkeypatch.setitem(sys.modules, "faiss", None)  # what an environment without faiss-cpu / faiss-gpu raises
    with pytest.raises(ModuleNotFoundError) as missing:
        import faiss  # noqa: F401
    expected = ("faiss is not installed: pip install 'wbrag-ray[cpu]' (faiss-cpu) on a CPU machine, or "
                "'wbrag-ray[gpu]' (faiss-gpu and vLLM) on a GPU one")
    assert user_error(missing.value) == expected
    assert user_error(ray.exceptions.RayTaskError("build_part", "traceback", missing.value)) == expected
    assert user_error(ModuleNotFoundError("No module named 'torchvision'", name="torchvision")) is None
