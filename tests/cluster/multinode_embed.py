"""The project's checkpointed embed stage (`build_kb.embed`, what `wbrag embed` runs) on a three-node local Ray
cluster that loses a worker node holding an embed actor part way (run as a script by test_fault_tolerance.py: a
Cluster needs its own driver process). Prints a JSON summary.

    python -m tests.cluster.multinode_embed TMP N [EMBEDDER]   (N synthetic passages, ingested into TMP/run
    first; EMBEDDER: a local sentence-transformers folder in place of the bundled model, e.g. the tests' tiny one)

At the kill it records what the node held, from Ray's own actor table (the GCS's, not the actors' word), and how
many embedding files were on disk; then the stage finishes (or, if the loss fails it, is run again as a user
would, resuming from its checkpoint). The summary holds the ids of the embedding files and of the ingest output,
so the test compares the two itself."""

import json
import os
import sys
import threading
import time
from pathlib import Path

import ray
import ray.data

from tests.cluster.local import local_cluster
from tests.ray_actors import live_actors
from wbrag_ray import api, build_kb
from wbrag_ray.config import load_config


def embed_actors() -> dict[str, list[str]]:
    """Node id -> ids of the embed stage's live actors there (Ray Data names its pool actors after the map)."""
    out: dict[str, list[str]] = {}
    for a in live_actors("_StageWorker"):
        out.setdefault(a["Address"]["NodeID"], []).append(a["ActorID"])
    return out


def main(tmp: str, n: int, embedder: str | None = None) -> None:
    tmp_dir = Path(tmp)
    tmp_dir.mkdir(parents=True, exist_ok=True)
    words = "river mountain city planet metal music bridge forest island engine".split()
    corpus = tmp_dir / "corpus.jsonl"
    with open(corpus, "w") as f:
        for i in range(n):
            text = f"Sentence {i} about the {words[i % 10]} and the {words[(i * 7) % 10]}."
            f.write(json.dumps({"id": f"d{i}", "contents": f"Title {i}\n{text}"}) + "\n")

    cluster = local_cluster(head_cpus=1, dashboard=False)  # nothing asks the State API, nothing trains
    # Embed actors ask for 1.5 CPUs: none fits on the head (1 CPU, where the reads run) and one fits on each
    # 2-CPU worker, so every embedding is computed on a worker node and a kill always lands on a working actor
    # (with 1-CPU nodes, an actor on the head could embed everything while a worker's actor still loaded).
    nodes = {node.node_id: node for node in (cluster.add_node(num_cpus=2) for _ in range(2))}  # the workers
    cluster.wait_for_nodes()
    os.environ["WBRAG_SHARED_RUN_DIR"] = "1"  # true here: the three nodes are processes of one machine
    config = load_config(overrides=[
        f"ray.address={cluster.address}", f"ingest.corpus={corpus}", "ingest.shard_bytes=4096",
        "embedder.num_cpus=1.5", "embedder.threads=1", "embedder.concurrency=2", "embedder.batch_size=8",
        "embedder.checkpoint_rows=50",  # small blocks: a file (and a checkpoint commit) every 50 or so vectors
        *([f"embedder.model={embedder}", "embedder.dtype=float32"] if embedder else []),
    ])
    run = api.start(str(tmp_dir / "run"), config)
    ray.data.DataContext.get_current().enable_progress_bars = False
    build_kb.ingest(run, config)
    out = run.layout.embed

    killed: dict = {}

    def kill_a_node_with_an_embed_actor():
        # once some embeddings are written, take away a worker node that holds an embed actor, without warning;
        # what it saw is kept, so a miss (the stage done first) says why
        looks = killed.setdefault("looks", {"n": 0, "most_files": 0, "held_after_s": None, "files_3_after_s": None})
        begun = time.time()
        while True:
            try:
                held = {node: ids for node, ids in embed_actors().items() if node in nodes}
                files = list(Path(out.path).glob("*.parquet"))
            except Exception as exc:  # noqa: BLE001 - the folder made or cleared under us, a slow GCS: look again
                killed["retried"] = f"{type(exc).__name__}: {exc}"[:200]
                held, files = {}, []
            looks.update(n=looks["n"] + 1, most_files=max(looks["most_files"], len(files)))
            for key, seen in (("held_after_s", held), ("files_3_after_s", len(files) >= 3)):
                if seen and looks[key] is None:
                    looks[key] = round(time.time() - begun, 1)
            if held and len(files) >= 3:
                break
            time.sleep(0.1)
        victim = next(iter(held))
        killed.update(node=victim, embed_actors_on_node=held[victim], files_before_kill=len(files))
        cluster.remove_node(nodes[victim], allow_graceful=False)
        killed["at"] = time.time()

    threading.Thread(target=kill_a_node_with_an_embed_actor, daemon=True).start()
    attempts = []
    started = time.time()
    for _ in range(2):  # the stage as a user runs it: again if it fails, resuming from its checkpoint
        try:
            stats = build_kb.embed(run, config)
            attempts.append("ok")
            break
        except Exception as exc:  # noqa: BLE001 - recorded; the test says whether a second attempt was allowed
            attempts.append(f"{type(exc).__name__}: {str(exc)[:300]}")
    else:
        stats = None
    ids = out.read_table(["pid"])["pid"].to_pylist() if run.is_complete("embed") else []
    print(json.dumps({
        "killed": killed, "attempts": attempts, "embed_s": round(time.time() - started, 1), "stats": stats, "complete": run.is_complete("embed"),
        "files_after": len(out.list_files(".parquet")), "embedded_ids": ids,
        "ingested_ids": run.layout.ingest.passages.read_table(["pid"])["pid"].to_pylist(),
        "alive_nodes": sum(1 for node in ray.nodes() if node["Alive"]),
        "dead_nodes": [node["NodeID"] for node in ray.nodes() if not node["Alive"]],
    }))
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), *sys.argv[3:4])
