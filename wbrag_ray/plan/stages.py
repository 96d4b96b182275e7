"""What each stage of `wbrag run` asks of the cluster (the Ray bundles of its actors, tasks and training workers)
and its time where a measured CPU rate applies. The bundles follow the stages' own resource settings and rules
(`placement`, `index.sizing`, `retrieval.service`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import NamedTuple

from wbrag_ray.config import EmbedderConfig, GeneratorConfig, IndexConfig, RetrievalConfig, TrainerConfig
from wbrag_ray.generation.vllm import shape_refusal
from wbrag_ray.index.sizing import (
    bytes_per_vector,
    merge_memory,
    plan_training,
    shard_count,
    train_resources,
)
from wbrag_ray.models.accelerators import Accelerator
from wbrag_ray.models.size import ModelSize, model_size, param_count, serving_gb, training_gb
from wbrag_ray.placement import GPU_BUNDLE, Bundle, Cluster, placement_refusal, sharded
from wbrag_ray.placement.gpus import memory_share
from wbrag_ray.plan.accelerators import kmeans_seconds
from wbrag_ray.plan.rates import RATES
from wbrag_ray.retrieval.service import search_actor_memory, shard_groups
from wbrag_ray.training.placement import fsdp_mesh_shape

GiB = 1 << 30


class Time(NamedTuple):
    """A part of a stage's time (None: not known), how it was found, its source (calibrated, benchmark,
    estimate) and the benchmark rates it used."""

    seconds: float | None
    how: str
    source: str | None = None
    rates: tuple[str, ...] = ()


@dataclass
class Stage:
    name: str
    bundles: list[Bundle]
    work: str
    seconds: float | None = None
    how: str = ""  # how the time was estimated, or why there is none
    notes: list[str] = field(default_factory=list)
    refusals: list[str] = field(default_factory=list)  # config-level: placement is checked by the plan
    rates: tuple[str, ...] = ()
    left_out: str = ""  # a part of the stage `seconds` does not count (no measured rate for it)
    more_gpus: str = ""  # the setting that would use idle GPUs, or why none would
    fits: bool = True  # set by the plan: its bundles place on the cluster and no rule refused it
    task_gpu_seconds: float = 0.0  # GPU-seconds of its tasks (the index's k-means on one GPU), where estimated
    held_seconds: float | None = None  # seconds its GPUs are held, where less than the stage; None: all of it
    measured_by: str = ""  # a pattern of the run stage names whose stats measure it ("": none, a part of a stage)
    sources: dict[str, float] = field(default_factory=dict)  # seconds by where their rate came from

    @property
    def gpus(self) -> float:
        """GPUs the stage holds at once: its actors' and workers' together, plus one task's (tasks queue)."""
        resident = sum(b.gpus * b.count for b in self.bundles if b.kind != "task")
        return float(resident + max((b.gpus for b in self.bundles if b.kind == "task"), default=0.0))

    @property
    def gpu_hours(self) -> float | None:
        """GPU-hours of the stage's actors, workers and GPU tasks; None where it has no time for them."""
        resident = sum(b.gpus * b.count for b in self.bundles if b.kind != "task")
        if self.seconds is None or (self.gpus and not resident and not self.task_gpu_seconds):
            return None
        held = self.seconds if self.held_seconds is None else self.held_seconds
        return (resident * held + self.task_gpu_seconds) / 3600

    @property
    def rate_source(self) -> str | None:
        """Where most of the stage's time comes from ("calibrated", "benchmark", "estimate"); None without time."""
        if self.seconds is None:
            return None
        if self.sources:
            return max(self.sources.items(), key=lambda kv: kv[1])[0]
        return "benchmark" if self.rates else "estimate"

    def add_source(self, source: str | None, seconds: float | None) -> None:
        if source and seconds is not None:
            self.sources[source] = self.sources.get(source, 0.0) + seconds

    def add(self, time: Time, label: str = "") -> None:
        """Add a part's time (the stage's becomes unknown with it where it is unknown) and how."""
        self.seconds = None if time.seconds is None or self.seconds is None else self.seconds + time.seconds
        self.how = f"{self.how}; {label}{time.how}" if self.how else label + time.how
        self.add_source(time.source, time.seconds)
        self.rates += time.rates


def scaled_rate(key: str, size: ModelSize, threads: int) -> tuple[float | None, str]:
    """A measured CPU rate scaled to another model's parameters and thread count."""
    rate = RATES[key]
    if size.params is None:
        return None, f"{size.name}: size unknown, no rate"
    factor = rate.reference_params / size.params * threads / rate.threads
    return rate.value * factor, f"{rate.value:g}/s [{key}] x {factor:.3g} ({param_count(rate.reference_params)}->" \
                                f"{param_count(size.params)} params, {threads}/{rate.threads} threads)"


# --- model-bearing actors ----------------------------------------------------------------------------------------

def generator_bundles(g: GeneratorConfig, key: str, cluster: Cluster) -> tuple[list[Bundle], list[str], list[str]]:
    """(bundles, notes, refusals) of a generator service of `g`, placed as `placement.replica_placement` places it."""
    size = model_size(g.model)
    if g.backend == "openai":
        return [], [f"{key}: an OpenAI-compatible endpoint ({g.base_url}): no Ray bundles"], []
    on_gpu = g.num_gpus > 0
    memory = serving_gb(size, g.dtype, on_gpu)
    notes = [f"{key}: {size.describe()}" + (f", about {memory:,.1f} GB with headroom" if memory else "")]
    why = placement_refusal(g, cluster.resources(), key) if on_gpu else None
    refusals = [why] if why else []

    if (shape := shape_refusal(g, key, size)) is not None:
        refusals.append(shape)
    tp, pp = g.parallel_sizes()
    util = memory_share(g) if g.backend == "vllm" else 1.0
    fixes = {"fix": f"lower {key}.concurrency", "fix_memory": _more_gpus_fix(key, memory, cluster.gpu_memory_gb * util, size)}
    if on_gpu and sharded(g):
        notes.append(f"{key}: each replica tensor_parallel_size {tp} x pipeline_parallel_size {pp} "
                     f"({tp * pp} one-GPU bundles; a tensor-parallel group of {tp} on one node)")
        return [Bundle(f"{key} service actor", g.concurrency, g.num_cpus, fix=f"lower {key}.concurrency"),
                Bundle(f"{key} tensor-parallel group", g.concurrency * pp, GPU_BUNDLE["CPU"] * tp,
                       GPU_BUNDLE["GPU"] * g.gpu_share * tp, gpu_memory_gb=memory / (tp * pp) if memory else None, gpu_budget=util,
                       fix_node=f"lower {key}.tensor_parallel_size and raise pipeline_parallel_size (stages may sit "
                       f"on different nodes), or use nodes of {tp} GPUs", **fixes)], notes, refusals
    what = f"{key} actor ({g.backend})"
    if on_gpu:
        return [Bundle(what, g.concurrency, g.num_cpus, g.num_gpus, gpu_budget=util * min(1.0, g.num_gpus),
                       gpu_memory_gb=memory / max(1.0, g.num_gpus) if memory else None, **fixes)], notes, refusals
    return [Bundle(what, g.concurrency, g.num_cpus, memory_gb=memory, fix=f"lower {key}.concurrency",
                   fix_node=f"give it GPUs ({key}.num_gpus), or use nodes with more memory")], notes, refusals


def _more_gpus_fix(key: str, memory: float | None, per_gpu: float, size: ModelSize) -> str:
    """What makes a model fit: enough GPUs that its share fits each (a power of two that divides its heads)."""
    if not memory or per_gpu <= 0:
        return f"shard it over more GPUs ({key}.num_gpus with backend: vllm)"
    need = 1
    while memory / need > per_gpu or (size.heads and size.heads % need):
        need *= 2
    return (f"shard it over {need} GPUs: {key}.backend: vllm, {key}.num_gpus: {need} (tensor_parallel_size {need}; "
            "or pipeline_parallel_size for stages on several nodes)")


def embedder_bundle(e: EmbedderConfig, what: str, count: int, num_cpus: float, key: str) -> Bundle:
    """An actor holding the embedder; `key`: the setting that counts these actors."""
    size = model_size(e.model)
    on_gpu = e.num_gpus > 0
    memory = serving_gb(size, e.dtype, on_gpu)
    return Bundle(what, count, num_cpus, e.num_gpus, None if on_gpu else memory, memory if on_gpu else None,
                  gpu_budget=min(1.0, e.num_gpus) if on_gpu else 1.0, detail=size.describe(),
                  fix=f"lower {key}" + (" or lower embedder.num_gpus (a fraction shares a GPU)" if on_gpu else ""),
                  fix_memory="raise embedder.num_gpus (a larger share of a GPU)", fix_node="lower embedder.num_gpus")


def fsdp_mesh(workers: int, per_node: int, min_shards: int = 1) -> tuple[int, int]:
    """(replicas, shards) of an fsdp training, as `training.placement.fsdp_mesh_shape` decides it."""
    per = max(1, per_node)
    return fsdp_mesh_shape([i // per for i in range(max(1, workers))], min_shards)


def training_bundles(model: str, trainer: TrainerConfig, key: str, gpu_memory_gb: float,
                     per_node: int = 0) -> tuple[list[Bundle], str]:
    """The Ray Train workers of a training of `model`, and a warning when over 1B parameters train on CPUs."""
    size = model_size(model)
    on_gpu = trainer.num_gpus > 0
    memory = training_gb(size, on_gpu)
    if on_gpu:
        need = math.ceil(memory / gpu_memory_gb) if memory and gpu_memory_gb else None
        fix_node = (f"a worker's model spreads over the GPUs of its own node only and needs {need} of "
                    f"{gpu_memory_gb:g} GB: use nodes of {max(need, math.ceil(trainer.num_gpus))} GPUs"
                    + (f", or set {key}.num_gpus: {need}" if need < trainer.num_gpus else "")
                    if need else f"lower {key}.num_gpus")
        # fsdp: a worker holds 1 / shards of the model; ddp: all of it
        fsdp = trainer.strategy == "fsdp" and isinstance(trainer.num_workers, int)
        replicas, shards = (fsdp_mesh(trainer.num_workers, per_node, need or 1) if fsdp and per_node
                            else (1, trainer.num_workers))
        share = shards if fsdp else max(1.0, trainer.num_gpus)
        sharded = (f", sharded over the {shards} workers of a node and replicated across {replicas} nodes (hybrid "
                   "fsdp)" if replicas > 1 else f", sharded over {share} workers (fsdp)")
        return [Bundle("Ray Train worker", trainer.num_workers, trainer.num_cpus, trainer.num_gpus,
                       gpu_memory_gb=memory / share if memory else None, kind="worker",
                       detail=size.describe() + (sharded if fsdp else ""),
                       fix=f"lower {key}.num_workers", fix_node=fix_node,
                       fix_memory=f"raise {key}.num_workers (fsdp shards the model over them)" if fsdp else
                       f"set {key}.strategy: fsdp (the model sharded over every worker), or spread each worker's "
                       f"model over {need or 'more'} GPUs of its node ({key}.num_gpus)")], ""
    warn = (f"{key}: {size.describe()} trains on CPUs (num_gpus 0): set {key}.num_gpus to train on GPUs"
            if size.params and size.params > 1e9 else "")
    return [Bundle("Ray Train worker", trainer.num_workers, trainer.num_cpus, memory_gb=memory, kind="worker",
                   detail=size.describe(), fix=f"lower {key}.num_workers",
                   fix_node=f"train on GPUs ({key}.num_gpus), or use nodes with more memory")], warn


# --- the index and the retrieval service -------------------------------------------------------------------------

@dataclass(frozen=True)
class IndexSizing:
    factory: str
    nlist: int | None
    train_sample: int
    shards: int
    per_vector: float
    shard_gb: float
    groups: int
    group_gb: float
    bundles: tuple[Bundle, ...]  # train task, add tasks, merge tasks
    files: int

    def describe(self) -> str:
        return (f"factory {self.factory}, {self.shards:,} shard(s) of about {self.shard_gb:,.3g} GB "
                f"({self.per_vector:.0f} bytes a vector + its copy of the trained quantizer), trained on "
                f"{self.train_sample:,} vectors")


def size_index(n: int, dim: int, ic: IndexConfig, retrieval: RetrievalConfig, checkpoint_rows: int,
               cluster: Cluster) -> IndexSizing:
    """The build's and the retrieval service's sizing rules at `n` vectors; ValueError with the fix."""
    import faiss

    sizing_log = logging.getLogger("wbrag_ray.index.sizing")
    level = sizing_log.level
    sizing_log.setLevel(logging.WARNING)  # its INFO lines repeat the plan's notes
    try:
        tp = plan_training(n, dim, ic.factory, ic.train_sample, ic.memory_budget_gb, ic.train_memory_gb)
    finally:
        sizing_log.setLevel(level)
    per_vector = bytes_per_vector(faiss.index_factory(dim, tp.factory, faiss.METRIC_INNER_PRODUCT))
    fixed = (tp.nlist or 0) * dim * 4  # the coarse quantizer's centroids, in every shard (as the build estimates)
    files = max(1, math.ceil(n / checkpoint_rows))
    shards = shard_count(ic.num_shards, n, per_vector, fixed, ic.shard_memory_gb, files)
    shard_bytes = n * per_vector / shards + fixed
    groups = shard_groups([{"bytes": shard_bytes}] * shards, retrieval.actor_memory_gb * GiB)
    biggest = max(len(g) for g in groups) * shard_bytes
    largest = max(cluster.nodes, key=lambda x: (x.cpus, x.memory_gb))
    node = {"CPU": largest.cpus, "memory": largest.memory_gb * 1e9, "free_CPU": largest.cpus}
    train = train_resources(ic.num_cpus, ic.gpu, cluster.gpus, cluster.gpus > 0, tp.nlist is not None, node,
                            min(tp.train_sample, n) * dim * 4, fixed)
    merge = merge_memory(math.ceil(n / shards), per_vector, fixed, node)
    bundles = (Bundle("index train task", 1, train["num_cpus"], train["num_gpus"], train["memory"] / 1e9, kind="task",
                      fix_node="lower index.train_memory_gb"),
               Bundle("index add task", files, ic.num_cpus, kind="task", fix_node="lower index.num_cpus"),
               Bundle("index merge task", shards, ic.num_cpus, memory_gb=merge / 1e9, kind="task",
                      fix_node="lower index.shard_memory_gb"))
    return IndexSizing(tp.factory, tp.nlist, tp.train_sample, shards, per_vector, shard_bytes / 1e9, len(groups),
                       biggest / 1e9, bundles, files)


def index_time(sizing: IndexSizing, n: int, dim: int, cpus: float, gpu: Accelerator) -> tuple[Time, Time | None]:
    """An index build's time on CPUs (its add and merge tasks, and k-means where it runs there), and its k-means on
    a GPU, estimated from its FLOPs, where it runs there."""
    add, kmeans = RATES["index_add"], RATES["kmeans"]
    at_once = max(1.0, min(cpus, sizing.files))
    seconds = n / (add.value * at_once)
    how = f"add + merge {n:,} / ({add.value:,g} per CPU-second [index_add] x {at_once:g} CPUs)"
    train = sizing.bundles[0]
    if sizing.nlist and train.gpus:
        return (Time(seconds, how, "benchmark", ("index_add",)),
                Time(*kmeans_seconds(gpu, sizing.train_sample, sizing.nlist, dim), "estimate"))
    if not sizing.nlist:
        return Time(seconds, how, "benchmark", ("index_add",)), None
    work = sizing.train_sample * sizing.nlist * dim
    return Time(seconds + work / (kmeans.value * train.cpus), how + f"; k-means {work:.3g} / ({kmeans.value:.4g} "
                f"[kmeans] x {train.cpus:g} CPUs)", "benchmark", ("index_add", "kmeans")), None


def retrieval_bundles(sizing: IndexSizing, ic: IndexConfig, retrieval: RetrievalConfig, embedder: EmbedderConfig,
                      cluster: Cluster) -> list[Bundle]:
    """The retrieval service's search actors, as `SearchPool.start` asks for them, and its query embedders."""
    gpu = retrieval.search_share if ic.gpu is not False and cluster.gpus > 0 else 0.0
    memory = search_actor_memory(sizing.group_gb * 1e9) / 1e9  # what SearchPool.start declares
    return [Bundle("search actor", sizing.groups * retrieval.concurrency, retrieval.search_cpus, gpu, memory,
                   fix="lower retrieval.concurrency" + (" or set index.gpu: false (search on CPUs)" if gpu else ""),
                   fix_node="lower retrieval.actor_memory_gb (more, smaller search actors)",
                   detail=f"{sizing.groups} group(s) of shards x {retrieval.concurrency} replica(s)"),
            embedder_bundle(retrieval.query_embedder(embedder), "query embedder", retrieval.concurrency,
                            retrieval.num_cpus, "retrieval.concurrency")]


def search_time(queries: int | None, sizing: IndexSizing, retrieval: RetrievalConfig) -> float | None:
    """Seconds of searching `queries` at the CPU rate times the search actors' CPUs."""
    if queries is None:
        return None
    search_cpus = sizing.groups * retrieval.concurrency * max(1, math.ceil(retrieval.search_cpus))
    return queries / (RATES["search"].value * search_cpus)
