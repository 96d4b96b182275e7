"""A command's run folder and tuned adapter on a two-node local Ray cluster (run as a script by
test_multinode_run_dir.py: a Cluster needs its own driver process). Prints a JSON summary.

The head node has no CPUs, so every task and actor runs on the worker node, whose processes see a cache folder
(WBRAG_CACHE) of their own: what the worker fetched lands there, what the driver fetched in the driver's.

    python -m tests.cluster.multinode_run_dir TMP GENERATOR S3_RUN   (S3_RUN holds a complete tune stage)
"""

import json
import os
import sys
from pathlib import Path

import pandas as pd
import ray
from ray.cluster_utils import Cluster

from wbrag_ray import api, prompts, storage
from wbrag_ray.config import ConfigError, load_config
from wbrag_ray.generation.passes import GeneratorPasses
from wbrag_ray.zerorag.tune import with_adapter


def _cached(folder: Path) -> list[str]:
    """The adapter copies in a node cache (storage.Location.local_dir's layout: <cache>/remote/<key>/)."""
    return sorted(str(p.parent.relative_to(folder)) for p in folder.glob("remote/*/adapter_config.json"))


def main(tmp: str, generator: str, s3_run: str) -> None:
    tmp_dir = Path(tmp)
    driver_cache, worker_cache = tmp_dir / "driver-cache", tmp_dir / "worker-cache"
    os.environ["WBRAG_CACHE"] = str(driver_cache)  # the driver and the head node's processes
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    cluster.add_node(num_cpus=2, env_vars={"WBRAG_CACHE": str(worker_cache)})
    cluster.wait_for_nodes()
    config = load_config(overrides=[
        f"ray.address={cluster.address}", f"generator.model={generator}", "generator.dtype=float32",
        "generator.max_new_tokens=4", "generator.num_cpus=1", "generator.threads=1",
    ])
    out: dict = {"alive_nodes": None}

    local_run = str(tmp_dir / "local-run")
    try:
        api.start(local_run, config)
        out["local_refused"] = None
    except ConfigError as exc:
        out["local_refused"] = str(exc)
    out["alive_nodes"] = sum(1 for node in ray.nodes() if node["Alive"])
    # on a network filesystem (this machine's mount table, with the test folder shown as an NFS export)
    mount_of = storage.mount_of
    storage.mount_of = lambda path: mount_of(path, f"/dev/sda1 / ext4 rw 0 0\nnas:/runs {os.path.realpath(tmp)} nfs4 rw 0 0\n"
                                                   f"nas:/models {os.path.realpath(generator)} nfs4 rw 0 0\n")
    api.start(str(tmp_dir / "nfs-run"), config)
    out["nfs_allowed"] = True
    storage.mount_of = mount_of
    os.environ["WBRAG_SHARED_RUN_DIR"] = "1"  # the documented opt-in for a shared mount the check cannot see
    api.start(local_run, config)
    out["opt_in_allowed"] = True
    del os.environ["WBRAG_SHARED_RUN_DIR"]

    # a run folder on object storage, which every node reaches, but the generator a local folder: refused up
    # front, naming the key, not when a worker on the other node fails to load it
    try:
        api.start(s3_run, config)
        out["local_model_refused"] = None
    except ConfigError as exc:
        out["local_model_refused"] = str(exc)
    os.environ["WBRAG_SHARED_RUN_DIR"] = "1"  # true here: the two nodes are processes of one machine
    run = api.start(s3_run, config)
    generator_config = with_adapter(run, config.generator)
    out["lora_adapter"] = generator_config.lora_adapter
    questions = pd.DataFrame({"id": [1, 2], "question": ["What is the capital of France?", "Who wrote Hamlet?"]})
    questions["prompt"] = [prompts.dumps(prompts.no_retrieval_messages(q)) for q in questions["question"]]
    with GeneratorPasses(generator_config) as passes:
        answered = passes.generate("closed_book", questions, "prompt", "answer")
    out["answers"] = len(answered)
    out["driver_cache"] = _cached(driver_cache)
    out["worker_cache"] = _cached(worker_cache)
    print(json.dumps(out))
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:4])
