"""A replaced output's commit (wbrag_ray.storage: `next_version`, `commit`, `committed`, `sweep`), local and on the
S3-compatible server on loopback: a writer killed (SIGKILL) at every step of a swap leaves readers the old output or
the new one, whole; a later command removes what the kill left and finishes the swap."""

from __future__ import annotations

import os
import subprocess
import sys

import pyarrow.fs as pafs
import pytest

from wbrag_ray.layout import RunLayout
from wbrag_ray.storage import COMMIT, commit, committed, next_version, resolve, sweep

PARTS = 3
# a writer of a new output: its files in the next version, then the commit; WBRAG_CRASH_AT kills it at one step
SWAP = ("import sys\nfrom wbrag_ray.storage import commit, crash_point, next_version, resolve\n"
        "new = next_version(resolve(sys.argv[1]))\nfor i in range(3):\n"
        "    new.join(f'part-{i}.txt').write_bytes(f'new {i}'.encode())\n    crash_point('version-half')\n"
        "commit(new)\n")
# each step a kill can stop a swap at, and the output readers see after it
STEPS = {"version-half": "old", "commit-begin": "old", "put-written": "old", "commit-pointer-written": "new",
         "commit-swept-one": "new"}


def swap_in_process(folder) -> None:
    new = next_version(folder)
    for i in range(PARTS):
        new.join(f"part-{i}.txt").write_bytes(f"new {i}".encode())
    commit(new)


def read_whole(folder) -> str:
    """'old' or 'new': what a reader of the output finds, asserting it is one of them whole."""
    got = {f.name: f.read_bytes().decode() for f in committed(folder).list_files()}
    for which in ("old", "new"):
        if got == {f"part-{i}.txt": f"{which} {i}" for i in range(PARTS)}:
            return which
    raise AssertionError(f"a reader found half a swap: {got}")


@pytest.mark.parametrize("where", ["local", "s3"])
@pytest.mark.parametrize("start", ["plain", "versioned"])
def test_a_swap_killed_at_any_step_leaves_the_old_output_or_the_new_and_a_later_command_cleans_up(where, start,
                                                                                                 tmp_path, request):
    """`start`: the old output is a plain folder (as earlier versions wrote it) or itself a committed version."""
    if where == "s3":
        request.getfixturevalue("s3_env")
    steps = [s for s in STEPS if where == "local" or s != "put-written"]  # a PUT is one request: no step inside
    for step in steps:
        base = f"s3://wbrag/commit-{tmp_path.name}-{start}-{step}" if where == "s3" else str(tmp_path / step)
        root = resolve(base)
        folder = root.join("index")  # the run's index folder, `RunLayout.index` as written
        old = next_version(folder) if start == "versioned" else folder
        for i in range(PARTS):
            old.join(f"part-{i}.txt").write_bytes(f"old {i}".encode())
        if start == "versioned":
            commit(old)
        proc = subprocess.run([sys.executable, "-c", SWAP, folder.uri], env={**os.environ, "WBRAG_CRASH_AT": step},
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == -9, (step, proc.stderr[-2000:])  # killed where named
        assert read_whole(RunLayout(root).index) == STEPS[step], step  # through the layout, as every reader reads
        # a later command: removes what the kill left, and its own swap (resuming into the same version) completes
        sweep(folder)
        assert read_whole(folder) == STEPS[step]
        if STEPS[step] == "old":
            swap_in_process(folder)
        assert read_whole(folder) == "new"
        current = committed(folder).uri.split("/")[-2]
        left = sorted(i.base_name for i in folder.fs.get_file_info(pafs.FileSelector(folder.path)))
        assert left == [COMMIT, current], (step, left)  # nothing of the old output, no half version


def test_a_writing_command_sweeps_what_a_killed_commit_left_in_any_declared_output(demo_run_copy):
    """A swap of an output no later command rewrites (a Zero-RAG pruned level here, `zero_rag/prune-{ratio:g}` in
    the registry), killed once its pointer names the new version: the old version stays on disk until any command
    that writes the run folder (an evaluation whose results are stored: nothing else to do) removes it, and readers
    still read the new one."""
    from wbrag_ray.cli import main

    run, qa = demo_run_copy
    folder = resolve(str(run)).join("zero_rag", "prune-0.3")
    grid = resolve(str(run)).join("zero_rag", "grid.json")  # an output that is a file: nothing below it to sweep
    grid.write_bytes(b"{}")
    old = next_version(folder)
    for i in range(PARTS):
        old.join(f"part-{i}.txt").write_bytes(f"old {i}".encode())
    commit(old)
    proc = subprocess.run([sys.executable, "-c", SWAP, folder.uri],
                          env={**os.environ, "WBRAG_CRASH_AT": "commit-pointer-written"}, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr[-2000:]

    def left() -> list[str]:
        return sorted(i.base_name for i in folder.fs.get_file_info(pafs.FileSelector(folder.path)))

    assert left() == [COMMIT, "_v1", "_v2"]  # the kill came before the old version went
    from wbrag_ray.run import RunFolder

    # the settings its results were made with (a test before may have replaced them with --force): nothing to redo
    made = RunFolder(str(run)).stats("eval-qa")["settings"]["config"]["generator"]["max_new_tokens"]
    assert main(["eval", str(run), "--dataset", str(qa), "--name", "qa", "--methods", "naive",
                 "--set", f"generator.max_new_tokens={made}"]) == 0
    assert left() == [COMMIT, "_v2"] and read_whole(folder) == "new"
    assert grid.read_bytes() == b"{}"
