"""Zero-RAG on a local Ray cluster of a head and three worker nodes, the run folder on object storage: the
passages embedded again losing a worker node (a replacement joins), the index rebuilt by a driver killed inside its
commit's swap and again, then losing a worker node during pruner prediction and again during an evaluation pass, then an
evaluation whose driver (a `wbrag eval` process joined to the cluster) is SIGKILLed right after half its answers
are committed to the stage's checkpoint on object storage, and resumed (run as a script by
tests/pipelines/test_multinode_zero_rag.py: a Cluster needs its own driver process). Prints a JSON summary.

    python -m tests.cluster.multinode_zero_rag S3_RUN DATASET QUESTIONS

The head node has no CPUs (the driver's node), each worker node two; a worker node's raylet is killed without
warning as soon as a task of the stage (prediction: the read-and-predict tasks; evaluation: the generator
service's calls) runs on it, so the stage loses the node's workers, actors and the objects it held.
"""

import json
import os
import subprocess
import sys
import threading
import time

import pyarrow.fs as pafs
import ray
from ray.cluster_utils import Cluster

from tests.cluster.local import local_cluster
from wbrag_ray import api, build_kb
from wbrag_ray.run import RunFolder
from wbrag_ray.zerorag.grid import eval_label
from wbrag_ray.zerorag.prune import predict, prune

RATIO = 0.3


def kill_node(node) -> None:
    """The node's raylet killed without warning (its workers die with it), as when a machine is lost.
    (`Cluster.remove_node` installs signal handlers, which only the main thread may do.)"""
    import os
    import signal

    from ray._private import ray_constants

    for info in node.all_processes.get(ray_constants.PROCESS_TYPE_RAYLET, []):
        os.kill(info.process.pid, signal.SIGKILL)


class NodeKiller:
    """Kills the worker node that first runs a task whose name contains `marker` (running, or done with its
    output still held there) or, with `actor_class`, that first holds a live actor of that class (a service's
    actor lives only while its command runs, however fast its calls are: a tiny model's call can start and
    end between two looks at the task list); afterwards, reports every 15 s what waits, for a stage that
    does not recover."""

    def __init__(self, cluster: Cluster, workers: list, marker: str, actor_class: str | None = None):
        self.cluster, self.workers, self.marker, self.actor_class = cluster, workers, marker, actor_class
        self.killed: dict = {}
        self._stop = threading.Event()
        self.stage_done = threading.Event()  # set by the caller when the stage has returned
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        from ray.util.state import list_tasks

        by_id = {w.node_id: w for w in self.workers}
        before = {actor.actor_id for actor in self._live_actors()}  # an earlier command's, not yet reaped
        while not self._stop.is_set():
            try:  # any task of the stage placed on a worker node: running, or done with its output held there
                named = [("name", "=", self.marker)] if "." in self.marker else None
                tasks = list_tasks(address=self.cluster.address, filters=named, limit=10_000,
                                   raise_on_missing_output=False)
            except Exception:  # the state API may time out on a loaded machine: look again
                tasks = []
            seen = [(task.node_id, task.name, task.state) for task in tasks
                    if self.marker in task.name and task.state in ("RUNNING", "FINISHED")]
            seen += [(actor.node_id, f"{actor.class_name} actor", actor.state) for actor in self._live_actors()
                     if actor.actor_id not in before]
            for node_id, name, state in seen:
                node = by_id.get(node_id)
                if node is not None:
                    step(f"killing node {node.node_id[:8]}, which ran {name} ({state})")
                    kill_node(node)
                    self.workers.remove(node)
                    self.killed = {"task": name, "state": state, "during": not self.stage_done.is_set(),
                                   "at": time.time()}
                    while not self._stop.wait(15):
                        self._report()
                    return
            self._stop.wait(0.25)  # each look asks the state API for every task: not 10 times a second

    def _live_actors(self) -> list:
        from ray.util.state import list_actors

        if self.actor_class is None:
            return []
        try:
            return list_actors(address=self.cluster.address,
                               filters=[("class_name", "=", self.actor_class), ("state", "=", "ALIVE")],
                               raise_on_missing_output=False)
        except Exception:  # as for the tasks: look again
            return []

    def _report(self) -> None:
        from ray.util.state import list_actors

        try:
            waiting = [(a.class_name, a.state) for a in list_actors(address=self.cluster.address,
                                                                     raise_on_missing_output=False)
                       if a.state != "ALIVE" and a.state != "DEAD"]
            step(f"after the kill: available {ray.available_resources()}; actors not alive: {waiting}")
        except Exception as exc:  # diagnostics only
            step(f"after the kill: no state ({exc})")

    def __enter__(self) -> "NodeKiller":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stage_done.set()
        self._stop.set()
        self._thread.join(timeout=10)


def answers(run: RunFolder, label: str) -> dict:
    import pyarrow.parquet as pq

    out = {}
    for method in ("naive",):
        result = run.layout.eval_result(label, method)
        table = pq.read_table(result.predictions.path, filesystem=result.predictions.fs,
                              columns=["id", "prediction", "docs"])
        rows = table.to_pylist()
        out[method] = {"rows": len(rows), "unique": len({r["id"] for r in rows}),
                       "answers": {r["id"]: r["prediction"] for r in rows},
                       "docs": {r["id"]: [(d["source"], d["id"]) for d in json.loads(r["docs"])] for r in rows}}
    return out


def resume_after_a_killed_driver(address: str, run: RunFolder, config, dataset: str, reference: dict) -> dict:
    """The write-back evaluation just run (`reference`: its answers, decoded in the usual batches) again under
    another name, by a driver SIGKILLed right after the commit that brings its committed answers to half (decoding
    and committing 2 at a time: a batch size never changes an answer, generator.batch_invariant; tests.drivers says
    why this kill comes from inside), then that command again."""
    from tests.drivers import die_once_half_committed

    total = reference["naive"]["rows"]
    label = eval_label("killed", RATIO, True)
    args = ["eval", run.uri, "--dataset", dataset, "--name", "killed", "--prune-ratio", str(RATIO), "--writeback",
            "--methods", "naive", "--address", address,
            "--set", "generator.batch_size=1", "--set", "generator.checkpoint_rows=2"]
    folder = run.layout.checkpoint(f"eval-{label}")
    committed, status, log = die_once_half_committed(args, dict(os.environ), folder, total)
    step(f"the driver died (exit {status}) with {committed} of {total} answers committed")
    complete_at_kill = run.is_complete(f"eval-{label}")
    config = config.model_copy(update={"eval": config.eval.model_copy(update={"methods": ["naive"]})})
    api.evaluate(run, config, dataset, "killed", prune_ratio=RATIO, writeback=True)
    stats = run.stats(f"eval-{label}")
    return {"total": total, "committed": committed, "exit": status, "complete_at_kill": complete_at_kill,
            "rows_resumed": stats.get("rows_resumed"), "rows_computed": stats.get("rows_computed"),
            "checkpoint_left": folder.exists(), "same_answers": answers(run, label) == reference,
            "driver_log": log[-1500:]}


def embed_losing_a_node(cluster: Cluster, workers: list, run: RunFolder, config) -> dict:
    """The passages embedded again on the cluster, a worker node lost while its embed tasks run: every vector
    written once (rows in = rows out, no id twice)."""
    with NodeKiller(cluster, workers, "MapBatches") as killer:
        stats = build_kb.embed(run, config, force=True)
    id_column = run.layout.ingest.units(config.index.unit)[1]
    ids = run.layout.embed.read_table([id_column])[id_column].to_pylist()
    return {"killed": killer.killed, "rows_in": stats["rows_in"], "rows_out": stats["rows_out"], "rows": len(ids),
            "unique": len(set(ids)), "rows_resumed": stats["rows_resumed"], "rows_computed": stats["rows_computed"]}


def index_files(run: RunFolder) -> dict:
    """What a reader of the run's index finds (through the layout, as every reader): each shard its manifest names
    read whole, with the vectors the manifest says."""
    from wbrag_ray.index.files import load_manifest, load_shard, named_shards

    folder = run.layout.index
    manifest = load_manifest(folder)
    shards = named_shards(manifest)
    return {"vectors": sum(load_shard(folder, name, manifest["dim"], count).ntotal for name, count in shards),
            "files": len(shards)}


def index_swap_killed(address: str, run: RunFolder) -> dict:
    """`wbrag index --force` (a driver joined to the cluster) SIGKILLed as its commit has moved the pointer to the
    new index and not yet removed the old one; readers then find one whole index; the command again completes it
    and leaves no other version behind."""
    args = [sys.executable, "-m", "wbrag_ray.cli", "index", run.uri, "--force", "--address", address]
    before = index_files(run)
    # a short lease, so the rerun takes the dead driver's lease seconds later instead of a minute
    env = {**os.environ, "WBRAG_CRASH_AT": "commit-pointer-written", "WBRAG_LEASE_TTL": "4"}
    killed = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    after_kill = index_files(run)
    time.sleep(5)
    again = subprocess.run(args, env=dict(os.environ), capture_output=True, text=True, timeout=300)
    folder = run.root.join("index")  # the output's own folder: its pointer and its versions
    left = sorted(i.base_name for i in folder.fs.get_file_info(pafs.FileSelector(folder.path)))
    return {"exit": killed.returncode, "before": before, "after_kill": after_kill, "rerun_exit": again.returncode,
            "after_rerun": index_files(run), "left": left, "log": (killed.stderr + again.stderr)[-1500:]}


def step(message: str) -> None:
    print(f"[multinode {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def main(s3_run: str, dataset: str) -> None:
    # The nodes are processes of this one machine: the tiny models' local folders are on a disk every node sees.
    os.environ["WBRAG_SHARED_RUN_DIR"] = "1"
    cluster = local_cluster(head_cpus=0)  # all work on the worker nodes
    workers = [cluster.add_node(num_cpus=2) for _ in range(3)]  # one is lost in each stage: one stays in reserve
    cluster.wait_for_nodes()
    run = RunFolder(s3_run)
    config = run.load_config()
    config = config.model_copy(update={"ray": config.ray.model_copy(update={"address": cluster.address})})
    api.start(run, config)
    ray.data.DataContext.get_current().enable_progress_bars = False
    summary: dict = {}

    step("embed, losing a worker node")
    summary["embed"] = embed_losing_a_node(cluster, workers, run, config)
    workers.append(cluster.add_node(num_cpus=2))  # a replacement, as an autoscaler would start one (waits for it)

    step("the index rebuilt, its driver killed in the swap, rebuilt again")
    summary["index"] = index_swap_killed(cluster.address, run)

    step("predict")
    with NodeKiller(cluster, workers, "MapBatches") as killer:
        predict(run, config, force=True)
    summary["predict_killed"] = killer.killed
    predictions = run.layout.zero_rag.predictions.read_table(["sid"])["sid"].to_pylist()
    summary["predictions"] = {"rows": len(predictions), "unique": len(set(predictions))}

    step(f"prune (predict lost a node: {killer.killed})")
    prune(run, config, RATIO, force=True)
    keep = run.layout.zero_rag.pruned(RATIO).keep.read_table(["id", "keep"]).to_pylist()
    summary["dropped"] = sorted(r["id"] for r in keep if not r["keep"])
    summary["keep_rows"] = len(keep)

    step("evaluate with the router and the adapter")
    with NodeKiller(cluster, workers, "_ServiceWorker.run", actor_class="_ServiceWorker") as killer:
        api.evaluate(run, config, dataset, "t", prune_ratio=RATIO, router=True, adapter=True, force=True)
    summary["eval_killed"] = killer.killed
    summary["zero_rag"] = answers(run, eval_label("t", RATIO, False, True, True))

    step(f"evaluate beside the write-back index (the last evaluation lost a node: {killer.killed})")
    api.evaluate(run, config, dataset, "t", prune_ratio=RATIO, writeback=True, force=True)
    summary["writeback"] = answers(run, eval_label("t", RATIO, True))

    step("the write-back evaluation again, its driver killed part way, resumed")
    summary["resume"] = resume_after_a_killed_driver(cluster.address, run, config, dataset, summary["writeback"])
    summary["alive_nodes"] = sum(1 for node in ray.nodes() if node["Alive"])
    print(json.dumps(summary))
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
