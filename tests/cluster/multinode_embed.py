"""A model stage on a three-node local Ray cluster that loses a worker node part way (run as a script by
test_fault_tolerance.py: a Cluster needs its own driver process). Prints a JSON summary."""

import json
import sys
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import ray
import ray.data
from ray.cluster_utils import Cluster

from wbrag_ray.config import EmbedderConfig
from wbrag_ray.ray_runtime import stable_names
from wbrag_ray.stages.base import apply_stage
from wbrag_ray.stages.embed import EmbedStage


def main(out_dir: str, n: int) -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    workers = [cluster.add_node(num_cpus=1) for _ in range(2)]
    ray.init(address=cluster.address, logging_level="ERROR")
    ray.data.DataContext.get_current().enable_progress_bars = False

    words = "river mountain city planet metal music bridge forest island engine".split()
    rows = [{"id": i, "text": f"Sentence {i} about the {words[i % 10]} and the {words[(i * 7) % 10]}."} for i in range(n)]
    ds = ray.data.from_items(rows, override_num_blocks=60)
    ds = apply_stage(ds, EmbedStage(EmbedderConfig(num_cpus=1, concurrency=2, batch_size=8)))

    killed = {}

    def kill_worker_mid_stage():
        # wait until the stage has written some output, then take a worker node away without warning
        while len(list(Path(out_dir).glob("*.parquet"))) < 5:
            time.sleep(0.2)
        killed["files_before_kill"] = len(list(Path(out_dir).glob("*.parquet")))
        cluster.remove_node(workers[0], allow_graceful=False)
        killed["at"] = time.time()

    threading.Thread(target=kill_worker_mid_stage, daemon=True).start()
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    ds.write_parquet(out_dir, filename_provider=stable_names("emb"), mode="overwrite")
    ids = pq.read_table(out_dir, columns=["id"])["id"].to_pylist()
    print(json.dumps({"rows": len(ids), "unique": len(set(ids)), "expected": n,
                      "missing": len(set(range(n)) - set(ids)), "killed": killed,
                      "alive_nodes": sum(1 for node in ray.nodes() if node["Alive"])}))
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
