"""What each stage of `wbrag run` asks of the cluster: the Ray bundles of its actors, tasks and training workers,
the memory per actor, and the work it does (rows, generator calls, training steps), with its time where a
measured rate applies.

The bundles follow the stages' own resource settings: an embedder pool is `embedder.concurrency` actors of
`embedder.num_cpus` / `num_gpus`; a generator service `generator.concurrency` actors, a vLLM replica larger than
one GPU as `generation.parallel` places it (tp x pp one-GPU bundles, each tensor-parallel group on one node,
beside the service's actor); search actors as the retrieval service groups the index's shards; training workers
as `<section>.trainer` says. The index's factory, shards and search groups come from `index.sizing` and
`retrieval.service`, the rules the build and the service apply.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from wbrag_ray.config import EmbedderConfig, GeneratorConfig, IndexConfig, RetrievalConfig, TrainerConfig
from wbrag_ray.plan.models import ModelSize, model_size, serving_gb, training_gb
from wbrag_ray.plan.placement import Bundle, Cluster
from wbrag_ray.plan.rates import RATES

GiB = 1 << 30


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
    # what would use more of the cluster's GPUs (the setting), or why nothing would: said where GPUs stay idle
    more_gpus: str = ""
    fits: bool = True  # set by the plan: its bundles place on the cluster and no rule refused it
    task_gpu_seconds: float = 0.0  # GPU-seconds of its tasks (the index's k-means on one GPU), where estimated
    # seconds its actors' GPUs are held, where that is less than the stage (mastery's answer pass after an API
    # wrote the QA pairs); None: all of it
    held_seconds: float | None = None
    measured_by: str = ""  # a pattern of the run stage names whose stats measure it ("": none, a part of a stage)

    @property
    def gpus(self) -> float:
        """GPUs the stage holds at once: its actors' and training workers' together (they live side by side), and
        one task's (tasks queue: the index's k-means is one task on one GPU)."""
        resident = sum(b.gpus * b.count for b in self.bundles if b.kind != "task")
        return float(resident + max((b.gpus for b in self.bundles if b.kind == "task"), default=0.0))

    @property
    def gpu_hours(self) -> float | None:
        """GPU-hours of the stage: its actors' and workers' GPUs for the time they are held (`held_seconds`, else
        its time), and its GPU tasks' own time (the index's k-means); None where it has no time, or where its GPUs
        are a task's it has no time for."""
        resident = sum(b.gpus * b.count for b in self.bundles if b.kind != "task")
        if self.seconds is None or (self.gpus and not resident and not self.task_gpu_seconds):
            return None
        held = self.seconds if self.held_seconds is None else self.held_seconds
        return (resident * held + self.task_gpu_seconds) / 3600

    # seconds of the stage's time by where their rate came from (calibrated, benchmark, estimate)
    sources: dict[str, float] = field(default_factory=dict)

    @property
    def rate_source(self) -> str | None:
        """Where most of the stage's time comes from: "calibrated" (rates `wbrag plan --calibrate` measured on
        this hardware), "benchmark" (rates the project's benchmarks measured, scaled to the model and threads),
        "estimate" (FLOPs and bytes against an accelerator's peaks, or a time without a measured rate); None where
        it has no time."""
        if self.seconds is None:
            return None
        if self.sources:
            return max(self.sources.items(), key=lambda kv: kv[1])[0]
        return "benchmark" if self.rates else "estimate"

    def add_source(self, source: str | None, seconds: float | None) -> None:
        if source and seconds is not None:
            self.sources[source] = self.sources.get(source, 0.0) + seconds


def threads_of(num_cpus: float, threads: int | None) -> int:
    return threads or max(1, math.ceil(num_cpus))


def scaled_rate(key: str, size: ModelSize, threads: int) -> tuple[float | None, str]:
    """A model-bound CPU rate for another model and thread count: x measured params / params x threads /
    measured threads (compute per token grows with the parameters; the benchmarks ran 2 torch threads)."""
    rate = RATES[key]
    if size.params is None:
        return None, f"{size.name}: size unknown, no rate"
    factor = rate.reference_params / size.params * threads / rate.threads
    return rate.value * factor, f"{rate.value:g}/s [{key}] x {factor:.3g} ({_m(rate.reference_params)}->" \
                                f"{_m(size.params)} params, {threads}/{rate.threads} threads)"


def _m(params: float) -> str:
    return f"{params / 1e9:.3g}B" if params >= 1e9 else f"{params / 1e6:.3g}M"


# --- model-bearing actors ----------------------------------------------------------------------------------------

def generator_bundles(g: GeneratorConfig, key: str, cluster: Cluster) -> tuple[list[Bundle], list[str], list[str]]:
    """(bundles, notes, refusals) of a generator service of `g` (`key`: its config section). A replica larger
    than one GPU is placed as `generation.parallel` places it, and refused by its `placement_refusal`."""
    from wbrag_ray.generation.parallel import GPU_BUNDLE, placement_refusal, sharded
    from wbrag_ray.generation.vllm import VLLM_THROUGHPUT_DEFAULTS

    size = model_size(g.model)
    if g.backend == "openai":
        return [], [f"{key}: an OpenAI-compatible endpoint ({g.base_url}): no Ray bundles"], []
    on_gpu = g.num_gpus > 0
    memory = serving_gb(size, g.dtype, on_gpu)
    notes = [f"{key}: {size.describe()}" + (f", about {memory:,.1f} GB with headroom" if memory else "")]
    why = placement_refusal(g, [{"CPU": n.cpus, "GPU": n.gpus} for n in cluster.nodes], key) if on_gpu else None
    refusals = [why] if why else []
    # the model's shape as the commands check it before any work (heads and key-value heads, context)
    from wbrag_ray.generation.vllm import shape_refusal

    if (shape := shape_refusal(g, key, size)) is not None:
        refusals.append(shape)
    tp, pp = g.parallel_sizes()
    util = {**VLLM_THROUGHPUT_DEFAULTS, **g.vllm_engine_kwargs}["gpu_memory_utilization"] if g.backend == "vllm" else 1.0
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
    """An actor holding the embedder (an embed actor, a retrieval pass's query embedder): `e`'s GPUs and model;
    `key`: the setting that counts these actors."""
    size = model_size(e.model)
    on_gpu = e.num_gpus > 0
    memory = serving_gb(size, e.dtype, on_gpu)
    return Bundle(what, count, num_cpus, e.num_gpus, None if on_gpu else memory, memory if on_gpu else None,
                  gpu_budget=min(1.0, e.num_gpus) if on_gpu else 1.0, detail=size.describe(),
                  fix=f"lower {key}" + (" or lower embedder.num_gpus (a fraction shares a GPU)" if on_gpu else ""),
                  fix_memory="raise embedder.num_gpus (a larger share of a GPU)", fix_node="lower embedder.num_gpus")


def fsdp_mesh(workers: int, per_node: int, min_shards: int = 1) -> tuple[int, int]:
    """(replicas, shards) of an fsdp training of `workers` one-GPU workers on nodes of `per_node` GPUs, filled in
    turn, as `training.placement.fsdp_mesh_shape` decides it: hybrid (sharded within a node, replicated across
    nodes) where whole nodes of at least `min_shards` workers hold them, else sharded over every worker."""
    from wbrag_ray.training.placement import fsdp_mesh_shape

    per = max(1, per_node)
    return fsdp_mesh_shape([i // per for i in range(max(1, workers))], min_shards)


def training_bundles(model: str, trainer: TrainerConfig, key: str, gpu_memory_gb: float,
                     per_node: int = 0) -> tuple[list[Bundle], str]:
    """The Ray Train workers of a training of `model` (`key`: its trainer section; `per_node`: GPUs a node, for
    fsdp's mesh), and a warning when a model over 1B parameters would train on CPUs."""
    size = model_size(model)
    on_gpu = trainer.num_gpus > 0
    memory = training_gb(size, on_gpu)
    if on_gpu:
        need = math.ceil(memory / gpu_memory_gb) if memory and gpu_memory_gb else None
        fix_node = (f"a worker's model spreads over the GPUs of its own node only and needs {need} of "
                    f"{gpu_memory_gb:g} GB: use nodes of {max(need, math.ceil(trainer.num_gpus))} GPUs"
                    + (f", or set {key}.num_gpus: {need}" if need < trainer.num_gpus else "")
                    if need else f"lower {key}.num_gpus")
        # fsdp: each worker holds 1 / shards of the model (the workers of a node under hybrid sharding, else all of
        # them); ddp: all of it, over its own GPUs
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


def generation_time(g: GeneratorConfig, calls: int | None, rate_key: str) -> tuple[float | None, str, tuple]:
    """Seconds for `calls` generator calls of the service of `g`: a CPU rate scaled to its model and threads, over
    its actors; None on GPUs (no GPU rate measured) and for an HTTP endpoint."""
    if calls is None:
        return None, "questions not counted: no time", ()
    if g.backend == "openai":
        return None, f"{calls:,} calls to the endpoint, at its own rate", ()
    if g.num_gpus > 0:
        return None, f"no measured rate: {calls:,} generator calls on GPUs", ()
    key = rate_key if rate_key == "closed_book" else f"rag_prompt_{g.backend}"
    per_actor, how = scaled_rate(key, model_size(g.model), threads_of(g.num_cpus, g.threads))
    if per_actor is None:
        return None, how, ()
    return calls / (per_actor * g.concurrency), f"{calls:,} calls / ({how} x {g.concurrency} actors)", (key,)


def training_time(model: str, trainer: TrainerConfig, steps: int, batch: int,
                  row_tokens: float) -> tuple[float | None, str, tuple]:
    """The CPU benchmark's LoRA step ([lora_step]: 4 examples x 128 tokens), scaled to the model, the rows a worker
    takes a step at their padded length, and its threads."""
    if trainer.num_gpus > 0:
        return None, f"no measured rate: {steps:,} steps of {batch} examples on GPUs", ()
    rate = RATES["lora_step"]
    size = model_size(model)
    if size.params is None:
        return None, f"{model}: size unknown, no rate", ()
    per_worker = batch / trainer.num_workers
    factor = (size.params / rate.reference_params * per_worker / 4 * row_tokens / 128
              * rate.threads / threads_of(trainer.num_cpus, None))
    return steps * rate.value * factor, (f"{steps:,} steps x {rate.value:g} s [lora_step] x {factor:.3g} (params, "
                                         f"{per_worker:g} examples x {row_tokens:,.0f} tokens per worker, threads)"), \
        ("lora_step",)


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
    """The build's own rules at `n` vectors of `dim`: `plan_training` (factory, sample), `bytes_per_vector` of
    the factory's empty index, `shards_for` (auto shards, at most one per embedding file), the train task's and
    merge tasks' resources, and `shard_groups` of the retrieval service (search actors). Raises ValueError with
    the fix when the sizing rules refuse."""
    import faiss

    from wbrag_ray.index.sizing import (
        bytes_per_vector,
        is_auto,
        merge_memory,
        plan_training,
        shards_for,
        train_resources,
    )
    from wbrag_ray.retrieval.service import shard_groups

    sizing_log = logging.getLogger("wbrag_ray.index.sizing")
    level = sizing_log.level
    sizing_log.setLevel(logging.WARNING)  # its INFO lines say what the plan's notes say (the sample it raised)
    try:
        tp = plan_training(n, dim, ic.factory, ic.train_sample, ic.memory_budget_gb, ic.train_memory_gb)
    finally:
        sizing_log.setLevel(level)
    per_vector = bytes_per_vector(faiss.index_factory(dim, tp.factory, faiss.METRIC_INNER_PRODUCT))
    fixed = (tp.nlist or 0) * dim * 4  # the coarse quantizer's centroids, in every shard (as the build estimates)
    files = max(1, math.ceil(n / checkpoint_rows))
    wanted = shards_for(n, per_vector, fixed, ic.shard_memory_gb) if is_auto(ic.num_shards) else int(ic.num_shards)
    shards = max(1, min(wanted, files))
    shard_bytes = n * per_vector / shards + fixed
    groups = shard_groups([{"bytes": shard_bytes}] * shards, retrieval.actor_memory_gb * GiB)
    biggest = max(len(g) for g in groups) * shard_bytes
    largest = max(cluster.nodes, key=lambda x: (x.cpus, x.memory_gb))
    node = {"CPU": largest.cpus, "memory": largest.memory_gb * 1e9, "free_CPU": largest.cpus}
    # faiss's GPU build is assumed where the cluster has GPUs (the GPU image installs it)
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


def index_time(sizing: IndexSizing, n: int, dim: int, cpus: float) -> tuple[float, str, tuple, str]:
    """Seconds of an index build: the train task's k-means (sample x lists x dimensions at the measured CPU rate,
    over the CPUs it asks for; left out, and said so, when it trains on a GPU), then the add and merge tasks over
    the cluster's CPUs (at most one per embedding file)."""
    add, kmeans = RATES["index_add"], RATES["kmeans"]
    at_once = max(1.0, min(cpus, sizing.files))
    seconds = n / (add.value * at_once)
    how = f"add + merge {n:,} / ({add.value:,g} per CPU-second [index_add] x {at_once:g} CPUs)"
    if not sizing.nlist:
        return seconds, how, ("index_add",), ""
    train = sizing.bundles[0]
    work = sizing.train_sample * sizing.nlist * dim
    if train.gpus:
        return seconds, how + "; k-means on a GPU: no measured rate", ("index_add",), "k-means on a GPU"
    return (seconds + work / (kmeans.value * train.cpus),
            how + f"; k-means {work:.3g} / ({kmeans.value:.4g} [kmeans] x {train.cpus:g} CPUs)", ("index_add", "kmeans"),
            "")


def retrieval_bundles(sizing: IndexSizing, ic: IndexConfig, retrieval: RetrievalConfig, embedder: EmbedderConfig,
                      cluster: Cluster) -> list[Bundle]:
    """The retrieval service's search actors (a group of shards each, `retrieval.concurrency` replicas; a GPU each
    where index.gpu is set and the cluster has GPUs, as `SearchPool.start` asks) and the pass actors that embed the
    queries."""
    from wbrag_ray.retrieval.service import search_actor_memory

    gpu = retrieval.search_share if ic.gpu is not False and cluster.gpus > 0 else 0.0
    memory = search_actor_memory(sizing.group_gb * 1e9) / 1e9  # what SearchPool.start declares
    return [Bundle("search actor", sizing.groups * retrieval.concurrency, retrieval.search_cpus, gpu, memory,
                   fix="lower retrieval.concurrency" + (" or set index.gpu: false (search on CPUs)" if gpu else ""),
                   fix_node="lower retrieval.actor_memory_gb (more, smaller search actors)",
                   detail=f"{sizing.groups} group(s) of shards x {retrieval.concurrency} replica(s)"),
            embedder_bundle(retrieval.query_embedder(embedder), "query embedder", retrieval.concurrency,
                            retrieval.num_cpus, "retrieval.concurrency")]


def search_time(queries: int | None, sizing: IndexSizing, retrieval: RetrievalConfig) -> float | None:
    """Seconds of searching `queries`: the CPU rate per search CPU (measured with every query sent to every
    group) times the search actors' CPUs (faiss threads: search_cpus rounded up)."""
    if queries is None:
        return None
    search_cpus = sizing.groups * retrieval.concurrency * max(1, math.ceil(retrieval.search_cpus))
    return queries / (RATES["search"].value * search_cpus)
