"""The build's tasks: Ray tasks when Ray is up, plain calls otherwise; each measures its peak memory, and inside
a stage records its result so a rerun runs only the unrecorded ones."""

from __future__ import annotations

import posixpath
from functools import partial
from typing import TYPE_CHECKING, Any

from wbrag_ray.index.files import IndexError_
from wbrag_ray.index.gpu_clone import faiss_has_gpu
from wbrag_ray.models.hardware import gpus_usable, usable_cpus
from wbrag_ray.ray_runtime import run_tasks as _run_tasks
from wbrag_ray.storage import resolve

if TYPE_CHECKING:
    from wbrag_ray.checkpoints import TaskRecords

# The build's errors (a file named, a bad setting) come back from a task as themselves.
run_tasks = partial(_run_tasks, own_errors=(IndexError_, ValueError))


def recorded(record: list[str], result: dict[str, Any]) -> dict[str, Any]:
    """A task's result, recorded first where its item names a record (`TaskRecords`): its file is written."""
    if record:
        resolve(record[0]).write_json(result)
    return result


def run_recorded(fn, shared: Any, items: list[tuple], kind: str, records: TaskRecords | None,
                 **kwargs: Any) -> tuple[list[dict[str, Any]], list[bool]]:
    """`run_tasks` over the items no earlier attempt recorded: results in order, and whether each was recorded."""
    if records is None:
        return run_tasks(fn, shared, items, **kwargs), [False] * len(items)
    names = [f"{kind}-{posixpath.basename(item[0])}" for item in items]
    done = records.done()
    reused = {n: done[n] for n in names if n in done and resolve(done[n]["file"]).exists()}
    todo = [(*item, records.uri(n)) for item, n in zip(items, names, strict=True) if n not in reused]
    if reused:
        print(f"[index] resumed {len(reused)} of {len(names)} {kind} tasks from the checkpoint in {records.folder.uri}",
              flush=True)
    fresh = iter(run_tasks(fn, shared, todo, **kwargs))
    return [reused[n] if n in reused else next(fresh) for n in names], [n in reused for n in names]


def set_threads(threads: int | None) -> None:
    """Ray tasks share the node: each uses the threads it asked Ray for, not every core."""
    if threads:
        import faiss

        faiss.omp_set_num_threads(threads)


def cluster_gpus(parallel: bool) -> float:
    """GPUs the tasks could get: the Ray cluster's (parallel), else this machine's as faiss sees them."""
    if parallel:
        import ray

        return float(ray.cluster_resources().get("GPU", 0))
    import faiss

    return float(faiss.get_num_gpus()) if faiss_has_gpu() else 0.0


def reserved_gpu() -> bool:
    """Whether this task holds a GPU faiss can use (in a Ray worker: one Ray reserved for it)."""
    import faiss

    return faiss_has_gpu() and gpus_usable() and faiss.get_num_gpus() > 0


def largest_node(parallel: bool) -> dict[str, float]:
    """{"CPU", "memory"} of the largest alive node and the cluster's free CPUs ("free_CPU")."""
    if not parallel:
        import psutil

        cpus = float(usable_cpus())
        return {"CPU": cpus, "memory": float(psutil.virtual_memory().total), "free_CPU": cpus}
    import ray

    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive") and n["Resources"].get("CPU", 0) > 0]
    biggest = max(nodes, key=lambda r: (r.get("CPU", 0), r.get("memory", 0)), default={})
    return {"CPU": float(biggest.get("CPU", 1)), "memory": float(biggest.get("memory", 0)),
            "free_CPU": float(ray.available_resources().get("CPU", 0))}


def assigned_resources(parallel: bool) -> dict[str, float]:
    """What Ray granted the running task (CPU, memory in bytes, GPU), as its scheduler accounts them; {} in process."""
    if not parallel:
        return {}
    import ray

    return {k: float(v) for k, v in ray.get_runtime_context().get_assigned_resources().items()}
