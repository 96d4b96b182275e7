"""A run folder, a model and a tuned adapter on a real two-node local Ray cluster (ray.cluster_utils.Cluster): a
local run folder and a local model folder are refused up front (allowed on a shared mount), and the adapter travels
to the workers as its s3:// URI, fetched by the node that loads it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import last_json_line
from tests.tiny_models import save_random_adapter
from wbrag_ray.run import RunFolder
from wbrag_ray.zerorag.tune import TUNE

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_two_nodes_refuse_a_local_run_folder_and_fetch_the_s3_adapter_on_the_worker_node(tmp_path, s3_env, tiny,
                                                                                        ray_cluster):
    # an adapter (peft's files, untrained) where `wbrag tune` leaves one, in a run folder on object storage: how it
    # travels is tested, not what it learned (the training itself: tests/training/test_lora.py)
    run = RunFolder("s3://wbrag/runs/multinode")
    run.layout.zero_rag.adapter.upload_dir(save_random_adapter(tiny.generator, tmp_path / "adapter"))
    run.mark_complete(TUNE.name, {"rows_out": 0})

    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "WBRAG_SHARED_RUN_DIR")}
    out = subprocess.run([sys.executable, "-m", "tests.cluster.multinode_run_dir", str(tmp_path), tiny.generator,
                          run.uri], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = last_json_line(out.stdout)
    assert summary["alive_nodes"] == 2
    refused = summary["local_refused"]
    assert refused and str(tmp_path / "local-run") in refused and "2 nodes" in refused
    assert "s3://" in refused and "WBRAG_SHARED_RUN_DIR=1" in refused  # the fixes, named
    # allowed, with a warning, on a network filesystem or with the opt-in
    assert summary["nfs_allowed"] and "allowed, as it is on a nfs4 mount" in out.stderr
    assert summary["opt_in_allowed"] and "WBRAG_SHARED_RUN_DIR=1 says every node sees it" in out.stderr
    # a local model folder is refused up front on several nodes, allowed on a shared mount
    refused = summary["local_model_refused"]
    assert refused and f"generator.model {tiny.generator} is a local path" in refused and "2 nodes" in refused
    assert "s3://" in refused
    assert f"generator.model {tiny.generator} is a local path on a Ray cluster with 2 nodes: allowed, as it is on a nfs4" \
        in out.stderr
    # the workers got the adapter's URI, not a path in the driver's cache, and fetched it on their own node
    assert summary["lora_adapter"] == "s3://wbrag/runs/multinode/zero_rag/adapter"
    assert summary["answers"] == 2
    assert summary["driver_cache"] == [] and len(summary["worker_cache"]) == 1
