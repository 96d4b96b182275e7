"""The thin job scripts in jobs/ run as `python jobs/<name>.py CONFIG` (the same line `ray job submit` runs)."""

import subprocess
import sys
from pathlib import Path

from tests.conftest import demo_records, joining_env, write_jsonl
from wbrag_ray.run import RunFolder

ROOT = Path(__file__).resolve().parents[1]


def test_every_job_script_has_help():
    for script in ("build_index.py", "prune_corpus.py", "writeback.py", "evaluate.py", "evaluate_methods.py",
                   "naive_rag.py"):
        out = subprocess.run([sys.executable, str(ROOT / "jobs" / script), "--help"], capture_output=True, text=True)
        assert out.returncode == 0 and "CONFIG" in out.stdout.upper(), script


def test_build_index_job_on_a_small_corpus(tmp_path, ray_cluster, tiny):
    """The script joins the cluster named by RAY_ADDRESS, as the driver of a submitted job does (here the test
    session's cluster, already up: starting one more local cluster in the script costs 10-25 s and is not what a
    job does); the tiny embedder, since what is checked is that the script builds the index of the whole corpus."""
    corpus = write_jsonl(tmp_path / "c.jsonl", demo_records(12))
    run = tmp_path / "run"
    config = tmp_path / "job.yaml"
    config.write_text(f"run: {run}\ningest:\n  corpus: {corpus}\n" + tiny.yaml(embedder="  num_cpus: 0.5\n  threads: 2\n"))
    env = joining_env(ray_cluster)
    out = subprocess.run([sys.executable, str(ROOT / "jobs" / "build_index.py"), str(config)], capture_output=True,
                         text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert RunFolder(str(run)).layout.index.join("manifest.json").read_json()["count"] == 12
    out = subprocess.run([sys.executable, str(ROOT / "jobs" / "evaluate.py"), str(config)], capture_output=True,
                         text=True, env=env, timeout=120)
    assert out.returncode == 2 and "--dataset" in out.stderr
