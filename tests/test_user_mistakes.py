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
    result = folder.layout.eval_result("qa", "naive")  # the version the commit now names (a reader resolves again)
    assert result.metrics.read_json()["generator"]["max_new_tokens"] == 8
    assert stats["methods"]["naive"] == result.metrics.read_json()


def test_a_method_added_under_an_evaluations_name_computes_only_its_rows(demo_run_copy, capsys):
    """`--methods no-retrieval` after `--methods naive` under one name: the naive results stay as they are (the
    same files), only the closed-book rows are answered, and the stage then holds both; a setting that changes
    answers is still refused, and a rerun of either method prints the stored table."""
    run, qa = demo_run_copy
    folder = RunFolder(str(run))
    naive = folder.layout.eval_result("qa", "naive")
    naive_files = snapshot(Path(naive.root.path))
    # the settings its results were made with (a test before may have replaced them with --force)
    made = folder.stats("eval-qa")["settings"]["config"]["generator"]["max_new_tokens"]
    args = ["eval", str(run), "--dataset", str(qa), "--name", "qa", "--set", f"generator.max_new_tokens={made}"]
    assert_refused_fast([*args, "--methods", "no-retrieval", "--set", "generator.max_new_tokens=5"], "other settings",
                        "max_new_tokens: ", " -> 5")
    capsys.readouterr()
    assert main([*args, "--methods", "no-retrieval"]) == 0
    out = capsys.readouterr().out
    assert "[eval-qa] adding no-retrieval to the stored naive" in out and "results on qa, every method" in out
    assert snapshot(Path(naive.root.path)) == naive_files  # not answered again
    closed_book = folder.layout.eval_result("qa", "no-retrieval").metrics.read_json()
    assert closed_book["n"] == naive.metrics.read_json()["n"] and closed_book["method"] == "no-retrieval"
    assert set(folder.stats("eval-qa")["methods"]) == {"naive", "no-retrieval"}
    assert main([*args, "--methods", "naive,no-retrieval"]) == 0
    assert "[eval-qa] complete, skipped" in capsys.readouterr().out


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
                          "3 x missing or empty 'golden_answers'", "malformed JSON")
    assert snapshot(run) == before


@pytest.mark.parametrize("args, words", [
    (["prune", "{run}", "--ratio", "1.5"], ["--ratio 1.5", "below 1"]),
    (["eval", "{run}", "--dataset", "{qa}", "--prune-ratio", "1.5"], ["--prune-ratio 1.5", "below 1"]),
    (["index", "{run}", "--factory", "IVF12,NoSuchCodec"], ["index.factory 'IVF12,NoSuchCodec'", "Flat"]),
    (["index", "{run}", "--factory", "PQ7"], ["index.factory 'PQ7'", "32-dimensional"]),  # the built vectors' dim
    # faiss builds IVF0 (it fails on the first vector added) and IVF4096 (k-means on 100 vectors): with --force
    # these once replaced a working index by a traceback
    (["index", "{run}", "--factory", "IVF0,Flat", "--force"], ["index.factory 'IVF0,Flat'", "no IVF lists", "Flat"]),
    (["index", "{run}", "--factory", "IVF4096,Flat", "--force"], ["index.factory 'IVF4096,Flat'", "4,096 IVF lists",
                                                                   "100 vectors"]),
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


# --- 10. --set values YAML would read as something else, and config files that are not YAML text ------------------


@pytest.mark.parametrize("override, words", [
    ("eval.name=@x", ["eval.name", "'@x' is not a plain name"]),  # YAML's reserved '@': the name as typed, refused
    ("eval.name=[a", ["'[a' is not a plain name"]),  # an unclosed YAML list
    ("eval.name=a: b", ["'a: b' is not a plain name"]),  # a YAML mapping
    ("retrieval.top_k=yes", ["retrieval.top_k=yes", "a number, not yes / no"]),  # was read as 1
    ("generator.max_new_tokens=[a", ["generator.max_new_tokens=[a", "not a YAML value", "quote"]),
])
def test_set_values_that_yaml_reads_otherwise_are_one_line(demo_run, override, words):
    run, qa = demo_run
    before = snapshot(run)
    assert_refused_fast(["eval", str(run), "--dataset", str(qa), "--set", override], *words)
    assert snapshot(run) == before


def test_a_number_given_as_a_name_stays_the_name_typed():
    from wbrag_ray.config import load_config

    assert load_config(overrides=["eval.name=2024", "writeback.version=007"]).eval.name == "2024"  # was refused
    assert load_config(overrides=["writeback.version=007"]).writeback.version == "007"  # not 7
    assert load_config(overrides=["retrieval.top_k=7", "eval.name=null"]).retrieval.top_k == 7


def test_a_utf16_config_and_a_folder_given_as_config_are_one_line(demo_run, tmp_path):
    run, qa = demo_run
    before = snapshot(run)
    utf16 = tmp_path / "utf16.yaml"
    utf16.write_bytes("retrieval:\n  top_k: 3\n".encode("utf-16"))
    assert_refused_fast(["eval", str(run), "--dataset", str(qa), "--config", str(utf16)], "utf16.yaml", "not UTF-8",
                        "save it as UTF-8")
    assert_refused_fast(["eval", str(run), "--dataset", str(qa), "--config", str(tmp_path)], "is a folder",
                        "a YAML file")
    assert snapshot(run) == before


def test_methods_naming_no_method_are_refused(demo_run):
    run, qa = demo_run
    before = snapshot(run)
    assert_refused_fast(["eval", str(run), "--dataset", str(qa), "--methods", ","], "--methods ','", "names no method")
    assert snapshot(run) == before


# --- 11. `wbrag run` checks every stage's inputs and names before the first --------------------------------------


@pytest.mark.parametrize("section, words", [
    ("eval:\n  dataset: {missing}\n", ["eval.dataset", "does not exist"]),
    ("eval:\n  dataset: {qa}\n  name: ../../x\n", ["eval.name", "'../../x' is not a plain name"]),
    ("writeback:\n  train: {missing}\n", ["writeback.train", "does not exist"]),
    ("writeback:\n  train: {qa}\n  version: ../x\n", ["writeback.version", "not a plain name"]),
    ("zerorag:\n  enabled: true\n  train: {missing}\n", ["zerorag.train", "does not exist"]),
])
def test_run_checks_every_stages_inputs_and_names_before_the_first(tmp_path, section, words):
    qa = write_jsonl(tmp_path / "qa.jsonl", demo_questions(2))
    config = tmp_path / "c.yaml"
    config.write_text(f"ingest:\n  corpus: {DEMO_CORPUS}\n" + section.format(missing=tmp_path / "nope.jsonl", qa=qa))
    run = tmp_path / "run"
    assert_refused_fast(["run", str(config), "--run", str(run)], *words)
    assert not run.exists()  # nothing ingested, and not even the folder made


# --- 12. flags that one action would drop silently -----------------------------------------------------------------


@pytest.mark.parametrize("args, words", [
    (["eval", "{run}", "--dataset", "{qa}", "--grid", "--name", "x"], ["--grid", "drop --name"]),
    (["eval", "{run}", "--dataset", "{qa}", "--grid", "--prune-ratio", "0.3", "--router"],
     ["drop --prune-ratio, --router"]),
    (["eval", "{run}", "--dataset", "{qa}", "--grid", "--adapter", "--writeback"], ["drop --adapter, --writeback"]),
    (["writeback", "{run}", "--list", "--activate", "v1"], ["--activate and --list are different actions"]),
    (["writeback", "{run}", "--sweep", "v1", "--train", "{qa}"], ["--train and --sweep are different actions"]),
    (["index", "{run}", "--factory", "HNSW32"], ["stage 'index'", "index.factory: 'auto' -> 'HNSW32'", "--force"]),
])
def test_flags_an_action_would_drop_and_a_built_index_replaced_without_force_are_refused(demo_run, args, words):
    run, qa = demo_run
    before = snapshot(run)
    assert_refused_fast([a.format(run=run, qa=qa) for a in args], *words)
    assert snapshot(run) == before


def test_the_grid_checks_its_inputs_before_ray(tmp_path, demo_run):
    _, qa = demo_run
    assert_refused_fast(["eval", str(tmp_path / "nope"), "--dataset", str(qa), "--grid"], "not a run folder")


# --- 13. names and grids of several datasets -----------------------------------------------------------------------


def test_flashrag_split_files_are_named_by_their_dataset_too():
    from wbrag_ray.config import load_config
    from wbrag_ray.evaluation.stage import dataset_name
    from wbrag_ray.writeback.versions import default_version

    config = load_config()
    assert dataset_name(config, "/data/flashrag/nq/test.jsonl") == "nq-test"
    assert dataset_name(config, "s3://b/flashrag/popqa/test.jsonl") == "popqa-test"  # not both 'test'
    assert default_version(config, "/data/flashrag/nq/train.jsonl") == "nq-train"
    assert default_version(config, "/data/flashrag/triviaqa/train.jsonl") == "triviaqa-train"  # not both 'train'
    assert dataset_name(config, "/data/my_questions.jsonl") == "my_questions"  # anything else: the stem


def test_a_second_datasets_grid_does_not_replace_the_first_without_force(demo_run, tmp_path):
    run, qa = demo_run
    folder = RunFolder(str(run))
    other = write_jsonl(tmp_path / "other.jsonl", demo_questions(2))
    grid = folder.layout.methods_grid()
    grid.write_json({"dataset": str(other), "rows": []})  # the grid an earlier `--methods-grid` wrote
    try:
        before = snapshot(run)
        assert_refused_fast(["eval", str(run), "--dataset", str(qa), "--name", "g", "--methods-grid"],
                            "methods_grid.json holds the grid of", str(other), "--force")
        assert snapshot(run) == before
    finally:
        grid.delete()
    zero_rag = RunFolder(str(tmp_path / "zr"))
    zero_rag.bind_config(RunFolder(str(run)).load_config())
    zero_rag.layout.zero_rag.grid.write_json({"dataset": str(other), "rows": []})
    before = snapshot(tmp_path / "zr")
    assert_refused_fast(["eval", str(tmp_path / "zr"), "--dataset", str(qa), "--grid"], "grid.json holds the grid of",
                        "--force")
    assert snapshot(tmp_path / "zr") == before


def test_a_dataset_edited_in_place_is_another_input_not_complete_and_skipped(demo_run):
    run, qa = demo_run
    before, original = snapshot(run), qa.read_bytes()
    questions = demo_questions(4)
    questions[0]["golden_answers"] = ["something else"]  # same file, same name, another answer key
    write_jsonl(qa, questions)
    try:
        assert_refused_fast(["eval", str(run), "--dataset", str(qa), "--name", "qa", "--methods", "naive"],
                            "stage 'eval-qa'", "made_from.dataset", "--force")
    finally:
        qa.write_bytes(original)
    assert snapshot(run) == before


# --- 14. the two front doors record one evaluation alike ------------------------------------------------------------


def test_eval_then_run_of_the_same_config_reuses_the_evaluation(demo_run, tmp_path, capsys):
    """`wbrag eval` passes no write-back flag and `wbrag run` passes writeback=False: the same evaluation, which the
    run finds complete and skips (it was refused as 'params.writeback: None -> False')."""
    import yaml

    run, qa = demo_run
    config = json.loads((run / "run.json").read_text())["config"]  # the built run's config, one evaluation added
    config["eval"].update(dataset=str(qa), name="front", methods=["naive"], limit=1)
    path = tmp_path / "same.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["eval", str(run), "--config", str(path)]) == 0
    before = snapshot(run)
    capsys.readouterr()
    assert main(["run", str(path), "--run", str(run)]) == 0, capsys.readouterr().err[-2000:]
    assert "[eval-front] complete, skipped" in capsys.readouterr().out
    after = {k: v for k, v in snapshot(run).items() if not k.startswith("plan/")}  # the run's plan, written first
    assert after == {k: v for k, v in before.items() if not k.startswith("plan/")}


# --- 15. Ctrl-C, and a replacing --force cut short --------------------------------------------------------------------


def test_ctrl_c_is_one_line_and_a_forced_evaluation_cut_short_leaves_the_old_results_and_config(demo_run, monkeypatch,
                                                                                              capsys):
    from wbrag_ray.evaluation import evaluate as evaluate_module

    run, qa = demo_run
    args = ["eval", str(run), "--dataset", str(qa), "--name", "cut", "--methods", "no-retrieval,naive", "--limit", "2"]
    assert main(args) == 0
    folder = RunFolder(str(run))
    old = {m: folder.layout.eval_result("cut", m).metrics.read_json() for m in ("no-retrieval", "naive")}
    before = snapshot(run)
    written = []
    plain_table = evaluate_module.plain_table

    def ctrl_c_at_the_second_method(table):
        written.append(1)
        if len(written) == 2:
            raise KeyboardInterrupt  # as Ctrl-C arrives in the driver
        return plain_table(table)

    monkeypatch.setattr(evaluate_module, "plain_table", ctrl_c_at_the_second_method)
    capsys.readouterr()
    assert main([*args, "--set", "generator.max_new_tokens=8", "--force"]) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("wbrag eval: interrupted"), err[-2000:]
    assert len(written) == 2  # the first method's new results were written (beside the old) before the interruption
    for method, metrics in old.items():
        assert folder.layout.eval_result("cut", method).metrics.read_json() == metrics  # old results, whole
    assert snapshot(run)["run.json"] == before["run.json"]  # not the interrupted command's --set
    assert not (run / "_lease.json").exists()  # the lease was given back
    monkeypatch.undo()
    assert main([*args, "--set", "generator.max_new_tokens=8", "--force"]) == 0  # the rerun replaces them, together
    for method in old:
        assert folder.layout.eval_result("cut", method).metrics.read_json()["generator"]["max_new_tokens"] == 8
    assert not [p for p in (run / "eval").iterdir() if p.name.startswith(".")]  # no staging folder left


def test_a_training_set_edited_in_place_is_another_input_for_a_write_back_version(tmp_path, monkeypatch, capsys):
    """The write-back version's stage records its training set's identity (so do tune's and the router's): the same
    file again is the version trained, the file edited in place is refused as another input (--force retrains)."""
    from wbrag_ray.build_kb import KB_STAGES
    from wbrag_ray.config import ConfigError, load_config
    from wbrag_ray.writeback import pipeline

    run = RunFolder(str(tmp_path / "run"))
    config = load_config()
    run.bind_config(config, guard=KB_STAGES)
    for stage in KB_STAGES:  # a built base (its work faked: only the records matter here)
        run.execute(stage, config, lambda: {"rows_out": 1})
    trained = []
    monkeypatch.setattr(pipeline, "_train", lambda run, config, train, params, *services: trained.append(train) or {})
    monkeypatch.setattr(pipeline, "validate", lambda *args: None)
    train = write_jsonl(tmp_path / "train.jsonl", demo_questions(4))
    pipeline.train_writeback(run, config, train=str(train), version="v")
    pipeline.train_writeback(run, config, train=str(train), version="v")
    assert len(trained) == 1 and "[writeback-v] complete, skipped" in capsys.readouterr().out
    questions = demo_questions(4)
    questions[0]["golden_answers"] = ["something else"]
    write_jsonl(train, questions)  # same path, same name: other labels
    with pytest.raises(ConfigError, match=r"stage 'writeback-v' .* other settings \(params\.made_from\.train: .*--force"):
        pipeline.train_writeback(run, config, train=str(train), version="v")
    assert len(trained) == 1


@pytest.mark.parametrize("after_s", [0.5, 4.0])
def test_a_real_ctrl_c_during_an_evaluation_is_one_line_and_exit_130(demo_run, ray_cluster, tmp_path, after_s):
    """SIGINT to a `wbrag eval` process joined to the session's cluster, early (starting) and later (answering):
    one line, exit code 130, no traceback; the lease is given back and run.json is as it was."""
    import signal
    import time

    from tests.conftest import joining_env

    run, _ = demo_run
    # questions no earlier test answered (answers are reused by prompt): the command is still answering when it
    # is interrupted, not finishing from the answer store
    qa = write_jsonl(tmp_path / "many.jsonl", [{**q, "question": f"{q['question']} (asked at {after_s} s)"}
                                                for q in demo_questions()])
    before = (run / "run.json").read_bytes()
    proc = subprocess.Popen([WBRAG, "eval", str(run), "--dataset", str(qa), "--name", f"sigint{int(after_s)}",
                             "--methods", "naive", "--set", "generator.max_new_tokens=24"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=joining_env(ray_cluster),
                            # as a terminal's foreground command gets it: a suite started in the background by a
                            # non-interactive shell ignores SIGINT, and Python keeps an ignored SIGINT ignored
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 60
    while not (run / "_lease.json").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(after_s)
    assert proc.poll() is None, "finished before the interrupt: nothing to test"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1].startswith("wbrag eval: interrupted"), err[-3000:]
    assert not (run / "_lease.json").exists()
    assert (run / "run.json").read_bytes() == before


# --- 16. a --force that fails or is stopped leaves what worked --------------------------------------------------------


def searched(run: Path, capsys) -> list[str]:
    """The hits `wbrag search` prints for one query (the index must load and answer)."""
    capsys.readouterr()
    assert main(["search", str(run), "--query", "mountain", "-k", "3"]) == 0
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("   ")]


@pytest.mark.parametrize("stage, module, function", [
    ("index", "wbrag_ray.index.build", "measure_search"),  # the shards built, the manifest not yet written
    ("embed", "wbrag_ray.checkpoints", "rows_by_file"),  # every vector written, the stage not yet complete
])
def test_a_forced_rebuild_stopped_part_way_leaves_the_old_output_complete_and_in_use(demo_run_copy, monkeypatch, capsys,
                                                                                    stage, module, function):
    """`--force` writes the new output beside the old (a hidden folder) and swaps them once the stage completes, as
    an evaluation's results are: Ctrl-C part way leaves the old output, its stats and its marker, and the index
    answers searches as before; the rerun of the same command finishes and replaces it, leaving no hidden folder."""
    import importlib

    run, _ = demo_run_copy
    folder = RunFolder(str(run))
    before = snapshot(run)
    hits = searched(run, capsys)
    assert hits
    target = importlib.import_module(module)
    real, calls = getattr(target, function), []

    def stopped(*args, **kwargs):
        calls.append(1)
        if stage == "index" or len(calls) == 2:  # embed: after the pass wrote every file
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(target, function, stopped)
    assert main([stage, str(run), "--force"]) == 130
    monkeypatch.undo()
    assert calls, "the stop was never reached: nothing tested"
    assert folder.is_complete(stage)
    after = snapshot(run)
    kept = [p for p in before if p.startswith((f"{stage}/", f"_stages/{stage}/", "docs/"))]
    assert kept and all(after.get(p) == before[p] for p in kept)  # the old output, whole
    assert searched(run, capsys) == hits
    assert main([stage, str(run), "--force"]) == 0
    swapped = list(run.rglob("_COMMIT"))  # committed: each folder holds its pointer and the version it names, no more
    assert swapped and all(sorted(p.name for p in c.parent.iterdir()) == ["_COMMIT", "_v1"] for c in swapped)
    if stage == "embed":  # the index was made from the old vectors: it needs its own --force now
        assert main(["index", str(run), "--force"]) == 0
    assert len(searched(run, capsys)) == len(hits)
