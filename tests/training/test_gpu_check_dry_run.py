"""The GPU check's CPU dry run (`benchmarks/gpu/check.py --quick` where no GPU is), in a Python where `import ray`
and `import vllm` fail, as on the bare GPU machine the check is for (torch, transformers, peft and
sentence-transformers; no Ray, no vLLM, no network): the project's torch-level sections (the placement rules, an
FSDP2 step under a one-rank process group, the one-worker fsdp case, batched hf generation) run and pass, those
that need Ray or vLLM say so and are skipped, and no Ray module was loaded.

The blocker is `sys.modules[name] = None`, set before the check starts in a subprocess of the project's Python
(an import of the name raises ImportError, `importlib.util.find_spec` returns None): a second virtual environment
without Ray would spend minutes installing torch for the same proof. The model is the tests' tiny generator
(`--model`), on gloo where the GPU run has NCCL.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BLOCKED = ("ray", "vllm")
RUN_WITHOUT_RAY = f"""
import runpy, sys
for name in {BLOCKED!r}:
    sys.modules[name] = None  # `import ray` raises ImportError from here on
sys.argv = ["check.py", *sys.argv[1:]]
try:
    runpy.run_path({str(ROOT / "benchmarks" / "gpu" / "check.py")!r}, run_name="__main__")
finally:
    loaded = sorted(m for m, module in sys.modules.items() if module is not None and m.split(".")[0] in {BLOCKED!r})
    print("blocked modules loaded:", loaded or "none", flush=True)
"""
PROJECT_SECTIONS = ("placement rules", "fsdp step", "one-worker fsdp", "hf generation")


@pytest.mark.slow  # about 60 s on 2 CPUs: the whole --quick check, section 5 about 7 s of it
def test_gpu_check_dry_run_passes_where_import_ray_fails(tiny, tmp_path):
    done = subprocess.run([sys.executable, "-c", RUN_WITHOUT_RAY, "--quick", "--model", tiny.generator],
                          capture_output=True, text=True, timeout=540, cwd=tmp_path)
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-3000:]
    assert "failures: none" in out and "cpu dry run" in out
    lines = out.splitlines()
    for title in PROJECT_SECTIONS:  # ran, each with its figures, none skipped
        assert f"# {title}" in lines and f"{title} seconds:" in out, title
        assert not any(line.startswith(f"{title}: skipped") for line in lines), title
    # the torch-level code on the project's own rules
    assert "one-worker fsdp: runs as / model on / batch on: ddp / {'cpu'} / cpu" in lines
    assert "fsdp step: process group / frozen / trained dtypes: gloo / {'float32'} / {'float32'}" in lines
    assert "fsdp step: inference_mode forward of the sharded model, finite: yes" in lines
    assert "rules: fsdp mesh on 4 x 8 GPUs (replicas x shards): 4 x 8" in lines
    # what needs Ray or vLLM says so
    for needs in ("vllm tensor parallel", "ray train", "ray train multi-gpu", "vllm engine feed"):
        assert any(line.startswith(f"{needs}: skipped (") and "not installed" in line for line in lines), needs
    assert lines[-1] == "blocked modules loaded: none"
