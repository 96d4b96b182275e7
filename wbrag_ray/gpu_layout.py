"""How a config's GPU work shares the GPUs people have, from one GPU to nodes of eight: the rules that pick a
generator's tensor-parallel size, whether retrieval (search actors, query embedders) takes whole GPUs or shares
of the generator's, and the node retrieval's whole GPUs go on. Pure functions of a node inventory (each node's GPU
count) and a GPU's memory, so every shape is tested without a GPU; `cluster_nodes.resolve_auto_concurrency` (the
commands, on Ray's nodes) and the plan (on the stated cluster) apply the same ones.

- `tensor_parallel_auto`: the fewest GPUs of one node that hold the weights plus a KV cache for the configured
  batch, within what vLLM may fill of each (gpu_memory_utilization), and that vLLM can shard the model over
  (`ModelSize.tensor_parallel_sizes`: the attention heads split evenly; the key-value heads split evenly or are
  repeated).
- `gpu_layout`: retrieval takes whole GPUs where that costs the generator at most one replica in eight
  (`WHOLE_GPU_COST`: its own GPU keeps a search actor's memory and kernels off the engine's); otherwise each
  retrieval actor takes a share of a GPU sized from its model or index (`share_of`), every GPU of a replica asks
  Ray for what the shares leave, and vLLM's gpu_memory_utilization is lowered so the engine leaves them their memory.
- `retrieval_node`: whole GPUs for retrieval all on the one node where taking them costs the fewest replicas
  (Ray's default scheduler would spread them over nodes and break more tensor-parallel groups than were counted).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from wbrag_ray.config import ConfigError

# Retrieval on whole GPUs while that costs the generator at most this share of its replicas (1 of 8 on 4 x 8 with
# 4-GPU replicas); beyond it, shares beside the replicas: a search actor uses a few GB and little compute.
WHOLE_GPU_COST = 1 / 8
CUDA_CONTEXT_GB = 1.0  # what a process's CUDA context and caching allocator hold on a GPU before any data
MIN_SHARE = 0.02
MAX_SHARE = 0.3  # retrieval needing more of a GPU than this beside an engine runs on CPUs (or is refused)
SHARE_STEP = 0.01
# vLLM's gpu_memory_utilization unless a config sets it (`generation.vllm.VLLM_THROUGHPUT_DEFAULTS` takes it from
# here): the rest of a GPU holds the CUDA graphs, the sampler's buffers and other processes' contexts
ENGINE_MEMORY_UTILIZATION = 0.85
ENGINE_MARGIN = 0.05  # of a GPU's memory between vLLM's budget and the shares beside it (fragmentation)
# Tokens of a prompt the KV budget counts when no longer context is set: an instruction and a question (about 200
# tokens) and each retrieved document (a 100-word passage is about 140 tokens of Llama's tokenizer; a sentence 40)
PROMPT_BASE_TOKENS = 200
DOC_TOKENS = {"passage": 140, "sentence": 40}


def engine_utilization(configured: float, share: float) -> float:
    """vLLM's gpu_memory_utilization on GPUs a replica holds `share` of (retrieval's actors in the rest): the
    configured value, at most the share less `ENGINE_MARGIN` (at least half the share)."""
    if share >= 1:
        return configured
    return min(configured, round(max(share / 2, share - ENGINE_MARGIN), 4))


def prompt_tokens(top_k: int, unit: str) -> int:
    """A RAG prompt's tokens, as the KV budget of `tensor_parallel_auto` counts them."""
    return PROMPT_BASE_TOKENS + top_k * DOC_TOKENS.get(unit, DOC_TOKENS["passage"])


def tensor_parallel_auto(size, gpus_per_node: list[float], gpu_memory_gb: float, utilization: float, batch: int,
                         tokens: int, key: str = "generator") -> int:
    """The fewest GPUs of one node (`gpus_per_node`: each node's GPU count) whose memory, at `utilization` of each,
    holds the model's bf16 weights and the KV cache of `batch` sequences of `tokens` (`size`: a
    `plan.models.ModelSize`). Raises ConfigError naming why where no node holds it."""
    if size.params is None:
        raise ConfigError(f"{key}.tensor_parallel_size auto: the size of {size.name} is unknown (no config.json, "
                          "not a known model); set tensor_parallel_size and num_gpus")
    weights = size.params * 2 / 1e9
    per_token = size.kv_bytes_per_token(2)
    # unknown layout: a KV cache of a fifth of the weights (the plan's serving headroom)
    kv = batch * tokens * per_token / 1e9 if per_token else 0.2 * weights
    most = int(max(gpus_per_node, default=0) + 1e-9)
    for tp in size.tensor_parallel_sizes(most):  # the sizes vLLM can shard its heads over
        if tp * gpu_memory_gb * utilization >= weights + kv:
            return tp
    fits = [tp for tp in size.tensor_parallel_sizes(64) if tp * gpu_memory_gb * utilization >= weights + kv]
    need = (f"{fits[0]} GPUs of one node" if fits else "more GPUs than a node has")
    raise ConfigError(
        f"{key}.tensor_parallel_size auto: {size.name} needs {weights:,.0f} GB of bf16 weights and {kv:,.1f} GB of KV "
        f"cache ({batch} sequences of {tokens} tokens), {need} of {gpu_memory_gb:g} GB at "
        f"gpu_memory_utilization {utilization:g}; the largest node has {most} GPU{'s' * (most != 1)}: use nodes "
        f"with more or larger GPUs, a smaller model, or pipeline_parallel_size with pipeline_across_nodes: true")


@dataclass(frozen=True)
class RetrievalActors:
    """Retrieval's GPU actors beside the generator: `count` actors needing `memory_gb` of GPU memory each (a search
    actor's shard group, a query embedder's model), and what they are called."""

    what: str
    count: int
    memory_gb: float


@dataclass(frozen=True)
class GpuLayout:
    """How a generation stage's GPUs are shared. `replica_gpu`: what each GPU of an engine replica asks Ray for (1,
    or what retrieval's shares leave of it); `shares`: each retrieval actor kind's ask (1 for a whole GPU, a
    share, or 0: on CPUs), in the order given; `utilization`: vLLM's gpu_memory_utilization where it must be
    lowered (None: its default); `replicas`: the engine replicas the cluster holds so (auto concurrency);
    `whole`: retrieval on GPUs of its own; `why`: the rule's reason, for the log and the plan."""

    replica_gpu: float
    shares: tuple[float, ...]
    utilization: float | None
    replicas: int
    whole: bool
    why: str


def share_of(memory_gb: float, gpu_memory_gb: float) -> float:
    """The share of a GPU an actor needing `memory_gb` of it asks for: its data and a CUDA context, rounded up to a
    hundredth, at least `MIN_SHARE`."""
    share = math.ceil((memory_gb + CUDA_CONTEXT_GB) / gpu_memory_gb / SHARE_STEP - 1e-9) * SHARE_STEP
    return round(max(MIN_SHARE, share), 4)


def _packs(shares: list[float], bins: int, capacity: float) -> bool:
    """Whether `shares` fit `bins` GPUs of `capacity` each, first fit decreasing (as Ray fills partly used GPUs)."""
    free = [capacity] * bins
    for s in sorted(shares, reverse=True):
        i = next((i for i, f in enumerate(free) if f + 1e-9 >= s), None)
        if i is None:
            return False
        free[i] -= s
    return True


def _groups(node_gpus: list[float], group: int) -> int:
    return sum(int(g / group + 1e-9) for g in node_gpus)


def retrieval_node(node_gpus: list[float], group: int, need: int) -> int | None:
    """The node (an index of `node_gpus`) whose GPUs retrieval's `need` whole GPUs take at the least cost in whole
    replica groups of `group` GPUs (ties: the node with the most GPUs left), or None where no node has `need`."""
    best, best_key = None, None
    for i, gpus in enumerate(node_gpus):
        if gpus + 1e-9 < need:
            continue
        lost = int(gpus / group + 1e-9) - int((gpus - need) / group + 1e-9)
        key = (lost, -(gpus - need))
        if best_key is None or key < best_key:
            best, best_key = i, key
    return best


def gpu_layout(node_gpus: list[float], gpu_memory_gb: float, group: int, concurrency: int | None,
               retrieval: list[RetrievalActors], utilization: float, on_cpus_ok: bool = True) -> GpuLayout:
    """The layout of a generation stage: engine replicas of `group` whole GPUs (tensor x pipeline parallel; 1 for
    a one-GPU replica), `concurrency` of them (None: auto, as many as fit), beside `retrieval`'s actors, on nodes of
    `node_gpus` GPUs of `gpu_memory_gb`; `utilization`: vLLM's gpu_memory_utilization as configured. Where retrieval
    cannot take whole GPUs or shares (shares over `MAX_SHARE` of a GPU), it runs on CPUs where `on_cpus_ok`, else
    ConfigError."""
    need = sum(r.count for r in retrieval)
    total = _groups(node_gpus, group)
    if not need:
        return GpuLayout(1.0, (), None, total, False, "retrieval holds no GPU")
    if not total:
        raise ConfigError(f"generator: a replica of {group} GPUs of one node, and no node has {group}")
    node = retrieval_node(node_gpus, group, need)
    if node is not None:
        left = list(node_gpus)
        left[node] -= need
        whole = _groups(left, group)
        lost = total - whole
        fits = whole >= 1 and lost <= WHOLE_GPU_COST * total + 1e-9 if concurrency is None else whole >= concurrency
        if fits:
            return GpuLayout(1.0, tuple(1.0 for _ in retrieval), None, whole if concurrency is None else concurrency,
                             True, f"retrieval on {need} GPU{'s' * (need != 1)} of its own"
                             + (f" ({lost} of {total} replicas fewer)" if lost and concurrency is None else ""))
    shares = [share_of(r.memory_gb, gpu_memory_gb) for r in retrieval]
    asks = [s for r, s in zip(retrieval, shares, strict=True) for _ in range(r.count)]
    gpus = int(max(node_gpus) + 1e-9)  # the shares go to one node (`retrieval_node` of group 1)
    capacity = next((c / 100 for c in range(int(max(shares) * 100 + 1e-6), int(MAX_SHARE * 100) + 1)
                     if _packs(asks, gpus, c / 100)), None)
    if capacity is None:
        why = (f"retrieval's actors ({', '.join(f'{r.count} x {r.what} of {r.memory_gb:,.1f} GB' for r in retrieval)}) "
               f"need more than {MAX_SHARE:.0%} of a {gpu_memory_gb:g} GB GPU beside the generator")
        if not on_cpus_ok:
            raise ConfigError(f"{why}; set index.gpu: auto (search on CPUs where GPUs are full) or add GPUs")
        return GpuLayout(1.0, tuple(0.0 for _ in retrieval), None, total if concurrency is None else concurrency, False,
                         why + ": retrieval on CPUs")
    replica_gpu = round(1.0 - capacity, 4)
    util = engine_utilization(utilization, replica_gpu)
    return GpuLayout(replica_gpu, tuple(shares), util, total if concurrency is None else concurrency, False,
                     f"retrieval as shares of GPUs beside the replicas ({', '.join(f'{r.what} {s:g}' for r, s in zip(retrieval, shares, strict=True))}"
                     f" of a GPU); each replica GPU asks for {replica_gpu:g}, vLLM's gpu_memory_utilization {util:g}")


def index_on_gpu(setting: bool | str, cluster_gpus: float, faiss_gpu: bool) -> bool:
    """Whether the index searches (and trains k-means) on GPUs, by `index.gpu`: 'auto' where the cluster has GPUs
    and faiss GPU support; true only there, refused before any work elsewhere (a run that asked for GPU search
    must not run at CPU speed without a word); false never."""
    if setting is False:
        return False
    usable = cluster_gpus > 0 and faiss_gpu
    if setting is True and not usable:
        why = "the cluster has no GPU" if cluster_gpus <= 0 else "this faiss has no GPU support (faiss-cpu)"
        raise ConfigError(f"index.gpu: true, but {why}; set index.gpu: auto (GPUs where present, else CPUs) or "
                          "false, or install faiss-gpu (the project's image has it)")
    return usable


DEFAULT_GPU_MEMORY_GB = 80.0


def gpu_memory_of(nodes: list[dict[str, float]], stated: float | None) -> tuple[float, str]:
    """One GPU's memory (GB) for the rules, and where it came from: `ray.gpu_memory_gb` where stated, else the GPU
    model Ray labels the nodes with (resources `accelerator_type:H100`; the smallest where they differ), else
    `DEFAULT_GPU_MEMORY_GB`."""
    if stated:
        return stated, "ray.gpu_memory_gb"
    from wbrag_ray.plan.accelerators import accelerator

    found = []
    for node in nodes:
        for key in node:
            if key.startswith("accelerator_type:"):
                name = key.split(":", 1)[1]
                try:
                    found.append((accelerator(name).memory_gb, name))
                except ValueError:
                    continue
    if found:
        memory, name = min(found)
        return memory, f"the nodes' accelerator_type {name}"
    return DEFAULT_GPU_MEMORY_GB, "assumed (no GPU model Ray knows on the nodes; set ray.gpu_memory_gb)"


def apply_gpu_layout(config, nodes: list[dict[str, float]], search: tuple[int, float],
                     gpu_memory_gb: float) -> tuple[list[str], GpuLayout | None]:
    """Decide, in place, what `config`'s 'auto' GPU settings are on `nodes` (each node's resources): the generator's
    tensor_parallel_size (num_gpus following it), retrieval.search_gpus and embed_gpus, and where retrieval takes
    shares, the replica's GPU ask (generator.num_gpus of a one-GPU replica, generator.gpu_share of a larger one)
    and vLLM's gpu_memory_utilization. `search`: the search actors that will search on GPUs and the bytes of the
    largest one's shards (0, 0 where none, or no index yet: the layout is decided again once it exists). What was
    decided, as lines for the log and the plan, and retrieval's layout (None where nothing was "auto")."""
    from wbrag_ray.plan.models import model_size, serving_gb

    g, r, e = config.generator, config.retrieval, config.embedder
    node_gpus = [float(n.get("GPU", 0.0)) for n in nodes]
    said = []
    util = g.vllm_engine_kwargs.get("gpu_memory_utilization", ENGINE_MEMORY_UTILIZATION)
    if g.tensor_parallel_size == "auto":
        tokens = int(g.vllm_engine_kwargs.get("max_model_len")
                     or prompt_tokens(r.top_k, config.index.unit) + g.max_new_tokens)
        tp = tensor_parallel_auto(model_size(g.model), node_gpus, gpu_memory_gb, util, g.batch_size, tokens)
        g.num_gpus = float(tp * g.pipeline_parallel_size)  # first: the config checks num_gpus = tp x pp on each
        g.tensor_parallel_size = tp
        said.append(f"generator.tensor_parallel_size auto: {tp} ({g.model} in bf16 with a KV cache for "
                    f"{g.batch_size} prompts of {tokens} tokens, on GPUs of {gpu_memory_gb:g} GB)")
    auto_search, auto_embed = r.search_gpus == "auto", r.embed_gpus == "auto"
    if not (auto_search or auto_embed):
        return said, None
    actors = []
    if auto_search and search[0]:
        actors.append(RetrievalActors("search actor", search[0], search[1] / 1e9))
    if auto_embed and e.num_gpus > 0:
        actors.append(RetrievalActors("query embedder", r.concurrency, serving_gb(model_size(e.model), e.dtype, True)
                                      or 1.0))
    whole = {"search actor": 1.0, "query embedder": e.num_gpus}
    if not actors or g.backend == "openai" or g.num_gpus <= 0:  # no generator beside them on GPUs: whole GPUs
        layout = GpuLayout(1.0, tuple(whole[a.what] for a in actors), None, 0, True, "no generator on GPUs beside them")
    elif g.num_gpus < 1:  # a replica's share set by hand: retrieval takes shares of what it leaves
        shares = tuple(share_of(a.memory_gb, gpu_memory_gb) for a in actors)
        layout = GpuLayout(g.num_gpus, shares, None, 0, False, f"shares beside replicas of {g.num_gpus:g} GPU")
    else:
        tp, pp = g.parallel_sizes()
        group = tp * pp if tp * pp > 1 else int(g.num_gpus)
        concurrency = None if g.concurrency == "auto" else int(g.concurrency)
        layout = gpu_layout(node_gpus, gpu_memory_gb, group, concurrency, actors, util,
                            on_cpus_ok=config.index.gpu is not True)  # True, not "auto"
        if not layout.whole and any(layout.shares):
            # the engine keeps its memory within the share (`engine_utilization`, applied where vLLM starts): a
            # placement setting, so a run resumed on another cluster's layout is not "made with other settings"
            if group > 1:
                g.gpu_share = layout.replica_gpu
            else:
                g.num_gpus = layout.replica_gpu
    for actor, share in zip(actors, layout.shares, strict=True):
        if actor.what == "search actor":
            if share > 0:
                r.search_gpus = share
            else:  # on CPUs: the search actors ask for no GPU
                config.index.gpu = False
        else:
            r.embed_gpus = share
    if auto_search and r.search_gpus == "auto":
        r.search_gpus = 1.0
    if auto_embed and r.embed_gpus == "auto":
        r.embed_gpus = None
    if actors:
        said.append(f"retrieval.search_gpus / embed_gpus auto: {layout.why}")
    return said, layout


def holds_whole_gpus(layout: GpuLayout | None) -> bool:
    """Whether retrieval's actors hold GPUs of their own (auto concurrency counts them off the generator's), not
    shares inside what each replica's GPUs leave."""
    return layout is None or layout.whole


def best_fit_node(free: dict[str, float], need: float) -> str | None:
    """The node (an id of `free`: each node's free GPUs) with the fewest free GPUs that still hold `need`: where a
    retrieval actor starts, so that the GPUs it takes come out of a node already broken into (the one the
    generator's whole groups left, or the one retrieval started on) and other nodes keep whole tensor-parallel
    groups free; Ray's default scheduler spreads them instead. None where no node holds it."""
    fits = [(gpus, node) for node, gpus in free.items() if gpus + 1e-9 >= need]
    return min(fits)[1] if fits else None
