"""The sharded index build: plan, train once, add per embedding shard, merge per index shard; each task declares
its CPUs and memory, and records its result so a rerun runs only the others (docs/architecture.md, Design notes)."""

from __future__ import annotations

import hashlib
import logging
import os
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from wbrag_ray.checkpoints import active
from wbrag_ray.config import IndexConfig
from wbrag_ray.index.files import (
    FORMAT,
    MANIFEST,
    PARTS_DIR,
    TRAINED_FILE,
    IndexError_,
    can_merge,
    embedding_files,
    from_bytes,
    new_index,
    read_embedding_shard,
    sample_vectors,
    shard_dim,
    shards_rows,
    to_bytes,
    vector_field,
    write_index_file,
)
from wbrag_ray.index.gpu_clone import cluster_faiss_gpu, faiss_has_gpu
from wbrag_ray.index.parts import (
    CODES_SUFFIX,
    INDEX_SUFFIX,
    code_part_ivf,
    merge_parts,
    write_code_part,
)
from wbrag_ray.index.recall import measure_search, parameter_of
from wbrag_ray.index.sizing import (
    balanced_groups,
    bytes_per_vector,
    choose_factory,
    is_auto,
    merge_memory,
    plan_training,
    shard_count,
    shards_for,
    train_resources,
)
from wbrag_ray.index.tasks import (
    assigned_resources,
    cluster_gpus,
    largest_node,
    recorded,
    reserved_gpu,
    run_recorded,
    run_tasks,
    set_threads,
)
from wbrag_ray.models.hardware import usable_cpus
from wbrag_ray.ray_runtime import in_sorted, is_object_ref, peak_rss_mb, reset_peak_rss, shared_value
from wbrag_ray.storage import Location, resolve

if TYPE_CHECKING:
    from ray import ObjectRef

log = logging.getLogger(__name__)


# --- tasks ----------------------------------------------------------------------------------------------


def _train_task(shared: dict[str, Any], _item: None) -> tuple[bytes, float, bool, dict[str, float]]:
    """(trained empty index, peak MiB, whether k-means ran on a GPU, the resources Ray granted the task)."""
    # Training runs alone (the add tasks wait for it): it uses the cores it asked for, a whole node's for k-means.
    set_threads(shared["threads"])
    reset_peak_rss()
    files = [resolve(u) for u in shared["files"]]
    index = new_index(shared["factory"], shared["dim"])
    on_gpu = False
    if not index.is_trained:
        sample = sample_vectors(files, shared["counts"], shared["train_sample"], shared["dim"])[1]
        on_gpu = shared["gpu"] and reserved_gpu()
        if on_gpu:
            _train_on_gpu(index, sample)
        else:
            index.train(sample)
        del sample
    return to_bytes(index), peak_rss_mb(), on_gpu, assigned_resources(shared["parallel"])


def _train_on_gpu(index, sample: np.ndarray) -> None:
    """An IVF's k-means on this task's GPUs (faiss-gpu assigns the points); codebooks train on the CPU."""
    import faiss

    ivf = faiss.extract_index_ivf(index)
    alone = ivf.quantizer_trains_alone
    alone = ord(alone) if isinstance(alone, str) else int(alone)
    # the index k-means assigns with on the CPU: the quantizer itself (mode 0), else a flat L2 index
    metric = ivf.quantizer.metric_type if alone == 0 else faiss.METRIC_L2
    assigner = faiss.index_cpu_to_all_gpus(faiss.IndexFlat(ivf.d, metric))
    ivf.clustering_index = assigner  # faiss keeps no reference: `assigner` lives until training ends
    try:
        index.train(sample)
    finally:
        ivf.clustering_index = None


def _add_task(shared: dict[str, Any], item: tuple[str, list[str]]) -> dict[str, Any]:
    """Encode embedding shards with the trained index into a codes-only part (IVFs) or a filled index copy."""
    set_threads(shared["threads"])
    out_uri, file_uris, *record = item
    base_rss = reset_peak_rss()
    t0 = time.perf_counter()
    index = from_bytes(shared["trained"], TRAINED_FILE)
    ivf = code_part_ivf(index) if shared["code_parts"] else None
    drop = shared_value(shared["drop_ids"])  # sorted: an array, or its reference in the object store
    count, dropped, ranges = 0, 0, []
    part_ids, part_codes = [], []
    for uri in file_uris:
        f = resolve(uri)
        ids, vecs = read_embedding_shard(f)
        if len(ids) == 0:
            continue
        if vecs.shape[1] != index.d:
            raise IndexError_(f"embedding shard {f.uri} has dimension {vecs.shape[1]}, the index {index.d}")
        if drop is not None:
            keep = ~in_sorted(ids, drop)
            dropped += int(len(ids) - keep.sum())
            ids, vecs = ids[keep], vecs[keep]
            if len(ids) == 0:
                continue
        if ivf is not None:
            part_ids.append(ids)
            part_codes.append(index.sa_encode(vecs))  # standalone codes (list number + code), as `add` stores them
        else:
            index.add_with_ids(vecs, ids)
        count += len(ids)
        ranges.append({"id_min": int(ids.min()), "id_max": int(ids.max())})
        del vecs  # one shard's vectors at a time
    if ivf is not None:
        codes = np.concatenate(part_codes) if part_codes else np.zeros((0, index.sa_code_size()), np.uint8)
        ids = np.concatenate(part_ids) if part_ids else np.zeros(0, np.int64)
        size = write_code_part(resolve(out_uri), ids, codes)
    else:
        size = write_index_file(index, resolve(out_uri))
    return recorded(record, {"file": out_uri, "count": count, "dropped": dropped, "rows": count + dropped,
                              **_id_range(ranges), "bytes": size, "peak_rss_mb": peak_rss_mb(),
                              "base_rss_mb": base_rss, "seconds": time.perf_counter() - t0, "pid": os.getpid()})


def _merge_task(shared: dict[str, Any], item: tuple[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Fill one index shard with its parts (`parts.merge_parts`), one part in memory at a time besides it."""
    set_threads(shared["threads"])
    out_uri, parts, *record = item
    base_rss = reset_peak_rss()
    t0 = time.perf_counter()
    index = merge_parts(resolve(shared["trained_file"]), [resolve(p["file"]) for p in parts])
    size = write_index_file(index, resolve(out_uri))
    return recorded(record, {"file": out_uri, "count": int(index.ntotal), **_id_range(parts), "bytes": size,
                              "dropped": sum(p["dropped"] for p in parts), "peak_rss_mb": peak_rss_mb(),
                              "base_rss_mb": base_rss, "seconds": time.perf_counter() - t0, "pid": os.getpid(),
                              "assigned": assigned_resources(shared["parallel"])})


def _id_range(parts: list[dict[str, Any]]) -> dict[str, int | None]:
    lows = [p["id_min"] for p in parts if p["id_min"] is not None]
    highs = [p["id_max"] for p in parts if p["id_max"] is not None]
    return {"id_min": min(lows) if lows else None, "id_max": max(highs) if highs else None}


# --- the build ------------------------------------------------------------------------------------------


def shard_file(i: int) -> str:
    return f"index-{i:05d}.faiss"


def build_index(
    embeddings: Location,
    out: Location,
    embedder: str,
    unit: str,
    ic: IndexConfig,
    *,
    parallel: bool | None = None,
    trained: bytes | None = None,
    drop_ids: np.ndarray | ObjectRef | None = None,
    docs: str | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Build a sharded index from embedding shards into `out` (index shards, trained.faiss, manifest.json) under the
    index settings `ic` (its `unit` aside: `unit` names what the index holds). parallel: Ray tasks or in-process
    calls; trained: a trained empty index to reuse; drop_ids: ids left out (or their object-store reference); docs:
    where the documents live. Returns stage stats."""
    factory, num_shards, num_cpus, shard_memory_gb = ic.factory, ic.num_shards, ic.num_cpus, ic.shard_memory_gb
    t0 = time.perf_counter()
    if parallel is None:
        import ray

        parallel = ray.is_initialized()
    files = embedding_files(embeddings)
    counts = shards_rows(files)
    total = sum(counts)
    dim = shard_dim(files[0])
    requested = factory
    plan = None
    auto_shards = is_auto(num_shards)
    if trained is None:  # refused here, before any work, when the sample the factory needs does not fit
        plan = plan_training(total, dim, factory, ic.train_sample, ic.memory_budget_gb, ic.train_memory_gb)
        factory = plan.factory
        if auto_shards and plan.nlist:  # nor can a shard budget that the flat coarse quantizer alone overflows
            shards_for(total, 1, plan.nlist * dim * 4, shard_memory_gb)
    elif factory.strip().lower() == "auto":
        factory = choose_factory(total, dim, ic.memory_budget_gb, ic.train_memory_gb)
    if requested != factory:
        log.info("index.factory=auto chose %s for %d x %d vectors", factory, total, dim)
    # a Ray task uses the CPUs it asked for; in process, those this process may use (not the host's cores)
    threads = max(1, int(num_cpus)) if parallel else usable_cpus()
    manifest_loc = out.join(MANIFEST)
    manifest_loc.delete()  # a reader never pairs an old manifest with half-rewritten shards
    if drop_ids is not None and not is_object_ref(drop_ids):
        drop_ids = np.unique(np.asarray(drop_ids, dtype=np.int64))

    # what an earlier attempt of the running stage finished (its driver killed part way): resumed, not redone
    checkpoint = active()
    records = checkpoint.tasks(f"index-{hashlib.sha1(out.uri.encode()).hexdigest()[:10]}") if checkpoint else None
    if records is not None and not records.folder.exists():
        out.delete()  # a build that starts afresh: no file of an earlier build under other settings stays
    to_train = trained is None
    train_record = records.done().get("train") if records is not None and to_train else None
    train_resumed = train_record is not None and resolve(train_record["file"]).exists()
    if train_resumed:
        trained = resolve(train_record["file"]).read_bytes()
        print(f"[index] resumed the trained index {train_record['file']}", flush=True)
    if checkpoint is not None:
        checkpoint.begin_pass("index", total)
        checkpoint.record()  # the stage's fingerprint, before the first record

    # 1. train once
    train_rss: list[float] = []
    on_gpu = False
    train_assigned: dict[str, float] = {}
    node = largest_node(parallel)
    if trained is None:
        res = train_resources(num_cpus, ic.gpu, cluster_gpus(parallel) if ic.gpu else 0.0,
                              cluster_faiss_gpu() if parallel else faiss_has_gpu(),  # the GPU nodes' faiss
                              kmeans=plan.nlist is not None, node=node,
                              sample_bytes=min(plan.train_sample, total) * dim * 4,
                              quantizer_bytes=(plan.nlist or 0) * dim * 4)
        job = {"files": [f.uri for f in files], "counts": counts, "factory": factory, "dim": dim,
               "train_sample": plan.train_sample, "threads": max(1, int(res["num_cpus"])) if parallel else threads,
               "gpu": res["num_gpus"] > 0, "parallel": parallel}
        trained, rss, on_gpu, train_assigned = run_tasks(
            _train_task, job, [None], num_cpus=res["num_cpus"], num_gpus=res["num_gpus"], memory=res["memory"],
            parallel=parallel)[0]
        train_rss.append(rss)
    trained_index = from_bytes(trained, TRAINED_FILE)
    if trained_index.d != dim:
        raise IndexError_(f"the trained index has dimension {trained_index.d}, the embedding shards at {embeddings.uri} {dim}")
    out.join(TRAINED_FILE).write_bytes(trained)
    if records is not None and to_train and not train_resumed:  # what a rerun need not train again
        resolve(records.uri("train")).write_json({"file": out.join(TRAINED_FILE).uri})
    t_train = time.perf_counter()
    per_vector = bytes_per_vector(trained_index)
    wanted = shard_count(num_shards, total, per_vector, len(trained), shard_memory_gb, len(files))
    log.info("index %s: %d vectors in %s shards, about %.0f bytes each (%s)", factory, total, wanted, per_vector,
             f"auto: at most index.shard_memory_gb={shard_memory_gb}" if auto_shards else "index.num_shards")

    # 2. add per embedding shard (mergeable types) or per index shard (the others); an IVF with array lists merges
    # from codes-only parts, other types are asked by a trial merge of two copies
    code_parts = code_part_ivf(trained_index) is not None
    mergeable = code_parts or can_merge(trained_index)
    search_space = parameter_of(trained_index)  # what the search measurement tries, read while the index is here
    del trained_index
    # an array, not bytes: every add task on a node reads it from Ray's object store without a copy of its own
    shared = {"trained": np.frombuffer(trained, np.uint8), "drop_ids": drop_ids, "threads": threads,
              "code_parts": code_parts}
    parts_dir = out.join(PARTS_DIR)
    if mergeable:
        suffix = CODES_SUFFIX if code_parts else INDEX_SUFFIX
        items = [(parts_dir.join(f"part-{i:06d}{suffix}").uri, [f.uri]) for i, f in enumerate(files)]
    else:
        groups = balanced_groups(counts, wanted)
        items = [(out.join(shard_file(j)).uri, [files[i].uri for i in g]) for j, g in enumerate(groups)]
    added, add_resumed = run_recorded(_add_task, shared, items, "add", records, num_cpus=num_cpus, parallel=parallel)
    rows_resumed = sum(a["rows"] for a, was in zip(added, add_resumed, strict=True) if was)
    t_add = time.perf_counter()

    # 3. merge parts into index shards: one task per shard, all in flight together
    merged: list[dict[str, Any]] = []
    merge_resumed: list[bool] = []
    if mergeable:
        groups = balanced_groups([p["count"] for p in added], wanted)
        merges = [(out.join(shard_file(j)).uri, [added[i] for i in g]) for j, g in enumerate(groups)]
        largest = max(sum(added[i]["count"] for i in g) for g in groups)
        merge_bytes = merge_memory(largest, per_vector, len(trained), node)
        merged, merge_resumed = run_recorded(
            _merge_task, {"threads": threads, "trained_file": out.join(TRAINED_FILE).uri, "parallel": parallel},
            merges, "merge", records, num_cpus=num_cpus, memory=merge_bytes, parallel=parallel)
    shards = merged if mergeable else added
    t_merge = time.perf_counter()

    count = sum(s["count"] for s in shards)
    dropped = sum(s["dropped"] for s in shards)
    if count + dropped != total:
        raise IndexError_(f"index holds {count} vectors and dropped {dropped}, but the shards at {embeddings.uri} hold {total}")
    out_prefix = out.uri.rstrip("/") + "/"
    shard_entries = [
        {"file": s["file"][len(out_prefix):], "count": s["count"], "id_min": s["id_min"], "id_max": s["id_max"],
         "bytes": s["bytes"]}
        for s in shards
    ]
    t_merged = time.perf_counter()
    search = None
    if ic.target_recall is not None:  # before the manifest: a build killed while measuring measures again
        search = measure_search(
            files, counts, out, shard_entries, search_space, dim, target=ic.target_recall, queries=ic.recall_queries,
            nprobe=ic.nprobe, ef_search=ic.ef_search, threads=threads, num_cpus=num_cpus, parallel=parallel)
    manifest = {
        "format": FORMAT,
        "factory": factory,
        "factory_requested": requested,
        "dim": dim,
        "metric": "inner_product",
        "embedder": embedder,
        "unit": unit,
        "count": count,
        **_id_range(shards),
        "num_shards": len(shard_entries),
        "files": [s["file"] for s in shard_entries],
        "shards": shard_entries,
        "trained": TRAINED_FILE,
        "embeddings": embeddings.uri,
        "embedding_dtype": str(vector_field(files[0]).type.value_type),
        "docs": docs,
        "dropped": dropped,
        **(extra or {}),
        **({"search": search} if search else {}),
    }
    manifest_loc.write_json(manifest)  # last: its presence means every file it names is written
    if mergeable:  # after the manifest: a build killed before it resumes with its parts
        parts_dir.delete()
    # Memory of the tasks (in this process when not parallel): what one node must hold, whatever the corpus.
    add_peak = max(a["peak_rss_mb"] for a in added)
    merge_peaks = [round(m["peak_rss_mb"], 1) for m in merged]
    add_rate = sum(a["count"] + a["dropped"] for a in added) / max(sum(a["seconds"] for a in added), 1e-9)
    return {
        "rows_in": total,
        "rows_out": count,
        "rows_dropped": dropped,
        "rows_resumed": rows_resumed,  # read by add tasks an earlier attempt of the stage finished
        "rows_computed": total - rows_resumed,
        "dim": dim,
        "factory": factory,
        "train_sample": plan.train_sample if plan else 0,
        "train_on_gpu": on_gpu,
        "num_shards": len(shard_entries),
        "num_shards_requested": num_shards,
        "bytes_per_vector_estimate": round(per_vector, 1),
        "parallel": parallel,
        "add_tasks": len(items),
        "merge_tasks": len(merged),
        # what an earlier attempt of the stage (a killed driver) had finished
        "train_resumed": train_resumed,
        "add_tasks_resumed": sum(add_resumed),
        "merge_tasks_resumed": sum(merge_resumed),
        "part_format": ("codes" if code_parts else "index") if mergeable else None,
        "parts_bytes": sum(a["bytes"] for a in added) if mergeable else 0,
        "trained_bytes": len(trained),
        "train_s": round(t_train - t0, 3),
        "add_s": round(t_add - t_train, 3),
        "merge_s": round(t_merge - t_add, 3),
        "search_measure_s": round(time.perf_counter() - t_merged, 3) if search else 0.0,
        # the search setting measured against exact search (the manifest's `search`), without every step tried
        "search": {k: v for k, v in search.items() if k != "measured"} if search else None,
        "seconds": round(time.perf_counter() - t0, 3),
        "index_bytes": sum(s["bytes"] for s in shard_entries),
        "peak_rss_mb": round(max([*train_rss, add_peak, *merge_peaks]), 1),
        "train_peak_rss_mb": round(train_rss[0], 1) if train_rss else None,
        "add_peak_rss_mb": round(add_peak, 1),
        "merge_peak_rss_mb": max(merge_peaks) if merge_peaks else None,
        "merge_task_peak_rss_mb": merge_peaks,  # one per index shard, in shard order
        # what each merge's worker held when it began (a reused worker keeps earlier tasks' memory)
        "merge_task_start_rss_mb": [None if m.get("base_rss_mb") is None else round(m["base_rss_mb"], 1)
                                    for m in merged],
        # the processes that ran the tasks (Ray workers, or this one when not parallel): where the peaks were measured
        "add_task_pids": [a["pid"] for a in added],
        "merge_task_pids": [m["pid"] for m in merged],
        # what Ray's scheduler granted each kind of task (CPU, memory in bytes, GPU): its placement is true
        "train_task_resources": train_assigned,
        "merge_task_resources": merged[0]["assigned"] if merged else {},
        "task_base_rss_mb": round(min(a["base_rss_mb"] for a in added), 1),
        "add_vectors_per_task_s": round(add_rate, 1),
    }
