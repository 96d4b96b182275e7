"""The GPU check's CPU dry run (`benchmarks/gpu/check.py --quick` where no GPU is), in a Python as bare as the GPU
machine the check is for (torch, transformers, peft, sentence-transformers, pyarrow; no Ray, no vLLM, no pydantic,
no network):
- with pydantic's wheels carried (as `make gpu-wheels` brings them), the check installs them into its scratch
  folder, the project's torch-level sections (the placement rules, an FSDP2 step under a one-rank process group,
  the one-worker fsdp case, batched hf generation) run and pass and say what they proved, those that need Ray or
  vLLM say so and are skipped, and no Ray module was loaded;
- without them it fails at once, naming what is missing: a check that cannot run the project's code proves
  nothing, so it never passes by skipping it.

Ray and vLLM are blocked by `sys.modules[name] = None` (an import raises ImportError, `importlib.util.find_spec`
returns None); pydantic is hidden from the environment's site-packages by a path finder that looks for it only in
the check's scratch folder. Both are set before the check starts, in a subprocess of the project's Python: a
second virtual environment would spend minutes installing torch for the same proof. The model is the tests'
tiny generator (`--model`), on gloo where the GPU run has NCCL.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.gpu.check import PROJECT_SECTIONS

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "benchmarks" / "gpu" / "check.py"
BLOCKED = ("ray", "vllm")
HIDDEN = ("pydantic", "pydantic_core")
BARE_PYTHON = f"""
import importlib.machinery, runpy, sys
blocked = {BLOCKED!r} + (sys.argv.pop(1) == "block-pydantic") * {HIDDEN!r}
for name in blocked:
    sys.modules[name] = None  # `import ray` raises ImportError from here on

class Bare(importlib.machinery.PathFinder):  # pydantic only where the check installed it
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if path is None and name in {HIDDEN!r}:
            path = [p for p in sys.path if "gpu-check-" in p]
        return importlib.machinery.PathFinder.find_spec(name, path, target)

sys.meta_path[sys.meta_path.index(importlib.machinery.PathFinder)] = Bare
sys.argv = ["check.py", *sys.argv[1:]]
try:
    runpy.run_path({str(CHECK)!r}, run_name="__main__")
finally:
    loaded = sorted(m for m, module in sys.modules.items() if module is not None and m.split(".")[0] in {BLOCKED!r})
    print("blocked modules loaded:", loaded or "none", flush=True)
"""


def bare_check(mode: str, wheels: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BARE_PYTHON, mode, "--quick", *args], capture_output=True, text=True,
                          timeout=540, cwd=cwd, env={**__import__("os").environ, "WBRAG_GPU_WHEELS": str(wheels)})


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> Path:
    """pydantic and its dependencies as wheels, the versions this environment runs (what `make gpu-wheels` brings,
    for this Python only)."""
    from importlib.metadata import version

    folder = tmp_path_factory.mktemp("wheels")
    names = ("pydantic", "pydantic-core", "annotated-types", "typing-inspection", "typing-extensions")
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(folder),
                    *(f"{n}=={version(n)}" for n in names)], check=True, capture_output=True, timeout=300)
    return folder


@pytest.mark.slow  # about 60 s on 2 CPUs: the whole --quick check, section 5 about 7 s of it
def test_gpu_check_dry_run_brings_pydantic_and_runs_the_project_where_import_ray_fails(tiny, wheels, tmp_path):
    done = bare_check("hide-pydantic", wheels, "--model", tiny.generator, cwd=tmp_path)
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-3000:]
    assert "failures: none" in out and "cpu dry run" in out
    lines = out.splitlines()
    assert "project needs brought from benchmarks/gpu/wheels: pydantic" in lines
    for title in PROJECT_SECTIONS:  # ran, each with its figures and what it proved, none skipped
        assert f"# {title}" in lines and f"{title} seconds:" in out, title
        assert any(line.startswith(f"{title}: proved: ") for line in lines), title
        assert not any(line.startswith(f"{title}: skipped") for line in lines), title
    # the torch-level code on the project's own rules
    assert "one-worker fsdp: runs as / model on / batch on: ddp / {'cpu'} / cpu" in lines
    assert "fsdp step: process group / frozen / trained dtypes: gloo / {'float32'} / {'float32'}" in lines
    assert "fsdp step: inference_mode forward of the sharded model, finite: yes" in lines
    assert "rules: fsdp mesh on 4 x 8 GPUs (replicas x shards): 4 x 8" in lines
    assert "hf generation: device / dtype asked / weights' dtype: cpu / float32 / {'float32'}" in lines
    # what needs Ray or vLLM says so, and proves nothing
    for needs in ("vllm tensor parallel", "ray train", "ray train multi-gpu", "vllm engine feed"):
        assert any(line.startswith(f"{needs}: skipped (") and "not installed" in line for line in lines), needs
        assert not any(line.startswith(f"{needs}: proved") for line in lines), needs
    assert lines[-1] == "blocked modules loaded: none"


def test_gpu_check_fails_at_once_naming_what_the_project_needs_where_pydantic_cannot_be_had(tmp_path):
    done = bare_check("block-pydantic", tmp_path / "no-wheels", cwd=tmp_path)
    lines = done.stdout.splitlines()
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert any(line.startswith("project code: cannot run: pydantic not importable") for line in lines), lines
    assert "failures: project code" in lines
    assert not any(line.startswith("# ") and line != "# gpu check (quick, cpu dry run)" for line in lines), lines
