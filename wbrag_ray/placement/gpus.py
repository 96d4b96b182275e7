"""GPU shares and "auto" settings: what a config's "auto" GPU settings and counts become on a node inventory, as
pure functions (tested without a GPU); the commands apply them on Ray's nodes (`resolve_auto_concurrency`), the
plan on its stated cluster. Retrieval takes whole GPUs where that costs the generator at most `WHOLE_GPU_COST` of
its replicas, else shares of the replicas' GPUs, vLLM's memory lowered to leave them room. Over 400 lines: one
set of rules on the same inventory, each calling the others.
"""

from __future__ import annotations

import copy
import logging
import math
import operator
from dataclasses import dataclass

from wbrag_ray.config import AUTO_SETTINGS, ConfigError
from wbrag_ray.index.gpu_clone import GPU_TEMP_MEMORY_BYTES
from wbrag_ray.models.accelerators import DEFAULT_GPU_MEMORY_GB, accelerator
from wbrag_ray.models.size import model_size, serving_gb
from wbrag_ray.placement import auto_nodes, free_nodes, room_for

log = logging.getLogger(__name__)

# Retrieval on whole GPUs while that costs the generator at most this share of its replicas; beyond it, shares
# beside the replicas (a search actor uses a few GB and little compute)
WHOLE_GPU_COST = 1 / 8
CUDA_CONTEXT_GB = 1.0  # what a process's CUDA context and caching allocator hold on a GPU before any data
MIN_SHARE = 0.02
MAX_SHARE = 0.3  # retrieval needing more of a GPU than this beside an engine runs on CPUs (or is refused)
SHARE_STEP = 0.01
# vLLM's gpu_memory_utilization unless a config sets it (the rest holds CUDA graphs and other processes' contexts)
ENGINE_MEMORY_UTILIZATION = 0.85
ENGINE_MARGIN = 0.05  # of a GPU's memory between vLLM's budget and the shares beside it (fragmentation)
# Tokens of a prompt the KV budget counts when no longer context is set: an instruction and a question, and each
# retrieved document (a 100-word passage is about 140 tokens of Llama's tokenizer; a sentence 40)
PROMPT_BASE_TOKENS = 200
DOC_TOKENS = {"passage": 140, "sentence": 40}


def memory_share(g) -> float:
    """The share of a GPU's memory a vLLM engine of `g` fills (weights, then KV cache): its gpu_memory_utilization."""
    return g.vllm_engine_kwargs.get("gpu_memory_utilization", ENGINE_MEMORY_UTILIZATION)


def engine_utilization(configured: float, share: float) -> float:
    """vLLM's gpu_memory_utilization on GPUs a replica holds `share` of: at most the share less `ENGINE_MARGIN`."""
    if share >= 1:
        return configured
    return min(configured, round(max(share / 2, share - ENGINE_MARGIN), 4))


def prompt_tokens(top_k: int, unit: str) -> int:
    """A RAG prompt's tokens, as the KV budget of `tensor_parallel_auto` counts them."""
    return PROMPT_BASE_TOKENS + top_k * DOC_TOKENS.get(unit, DOC_TOKENS["passage"])


def tensor_parallel_auto(size, gpus_per_node: list[float], gpu_memory_gb: float, utilization: float, batch: int,
                         tokens: int, key: str = "generator") -> int:
    """The fewest GPUs of one node whose memory, at `utilization` of each, holds the model's bf16 weights and the KV
    cache of `batch` sequences of `tokens` (`size`: a `ModelSize`), and that vLLM can shard the model over."""
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
    """Retrieval's GPU actors beside the generator: `count` actors needing `memory_gb` of GPU memory each."""

    what: str
    count: int
    memory_gb: float


@dataclass(frozen=True)
class GpuLayout:
    """How a generation stage's GPUs are shared. `replica_gpu`: what each GPU of an engine replica asks Ray for;
    `shares`: each retrieval actor kind's ask (1: a whole GPU, 0: on CPUs); `utilization`: vLLM's where lowered;
    `replicas`: the engine replicas the cluster holds so; `whole`: retrieval on GPUs of its own; `why`: the rule's
    reason, for the log and the plan."""

    replica_gpu: float
    shares: tuple[float, ...]
    utilization: float | None
    replicas: int
    whole: bool
    why: str


def share_of(memory_gb: float, gpu_memory_gb: float) -> float:
    """The share of a GPU an actor needing `memory_gb` asks for: with a CUDA context, rounded up, at least MIN_SHARE."""
    share = math.ceil((memory_gb + CUDA_CONTEXT_GB) / gpu_memory_gb / SHARE_STEP - 1e-9) * SHARE_STEP
    return round(max(MIN_SHARE, share), 4)


def share_capacity(asks: list[float], gpus: int) -> float:
    """What each of `gpus` GPUs must leave beside its replica so that `asks` (shares of a GPU) fit in whatever order
    Ray places them: it puts a fractional ask on any GPU with room (best-fit), so an ask finds none only where every
    GPU holds another ask and more than the capacity less that ask: fewer asks than GPUs, or the other asks' sum
    within gpus x (capacity - the largest), rule that out. (First fit decreasing fits more than Ray may.)"""
    largest = max(asks)
    if len(asks) <= gpus:
        return largest
    return round(math.ceil(((sum(asks) - largest) / gpus + largest) / SHARE_STEP - 1e-9) * SHARE_STEP, 4)


def _groups(node_gpus: list[float], group: int) -> int:
    return room_for({"GPU": group}, [{"GPU": g} for g in node_gpus])


def retrieval_node(node_gpus: list[float], group: int, need: int) -> int | None:
    """The node (an index of `node_gpus`) where retrieval's `need` whole GPUs cost the fewest replica groups of
    `group` GPUs (ties: the most GPUs left), or None where no node has `need`."""
    best, best_key = None, None
    for i, gpus in enumerate(node_gpus):
        if gpus + 1e-9 < need:
            continue
        lost = _groups([gpus], group) - _groups([gpus - need], group)
        key = (lost, -(gpus - need))
        if best_key is None or key < best_key:
            best, best_key = i, key
    return best


def gpu_layout(node_gpus: list[float], gpu_memory_gb: float, group: int, concurrency: int | None,
               retrieval: list[RetrievalActors], utilization: float, on_cpus_ok: bool = True) -> GpuLayout:
    """The layout of `concurrency` engine replicas (None: as many as fit) of `group` whole GPUs beside `retrieval`'s
    actors. Where retrieval fits neither whole GPUs nor shares of at most `MAX_SHARE`, it runs on CPUs where
    `on_cpus_ok`, else ConfigError."""
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
    capacity = share_capacity(asks, gpus)
    if capacity > MAX_SHARE + 1e-9:
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
    and faiss GPU support; true only there (refused elsewhere); false never."""
    if setting is False:
        return False
    usable = cluster_gpus > 0 and faiss_gpu
    if setting is True and not usable:
        why = "the cluster has no GPU" if cluster_gpus <= 0 else "this faiss has no GPU support (faiss-cpu)"
        raise ConfigError(f"index.gpu: true, but {why}; set index.gpu: auto (GPUs where present, else CPUs) or "
                          "false, or install faiss-gpu (the project's image has it)")
    return usable


def gpu_memory_of(nodes: list[dict[str, float]], stated: float | None) -> tuple[float, str]:
    """One GPU's memory (GB), and where it came from: `ray.gpu_memory_gb`, else the smallest GPU model Ray labels
    the nodes with (`accelerator_type:H100`), else a default."""
    if stated:
        return stated, "ray.gpu_memory_gb"
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
    """Decide `config`'s 'auto' GPU settings in place on `nodes` (tensor_parallel_size, retrieval.search_gpus and
    embed_gpus, and with shares the replica's GPU ask). `search`: the GPU search actors and the bytes of the
    largest. Returns lines for the log and the plan, and retrieval's layout (None where nothing was "auto")."""
    g, r, e = config.generator, config.retrieval, config.embedder
    node_gpus = [float(n.get("GPU", 0.0)) for n in nodes]
    said = []
    util = memory_share(g)
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
        actors.append(RetrievalActors("search actor", search[0], (search[1] + GPU_TEMP_MEMORY_BYTES) / 1e9))
    if auto_embed and e.num_gpus > 0:
        actors.append(RetrievalActors("query embedder", r.concurrency, serving_gb(model_size(e.model), e.dtype, True) or 1.0))
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
            # a placement setting (`engine_utilization` applies it where vLLM starts): a run resumed on another
            # cluster's layout is not "made with other settings"
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


def best_fit_node(free: dict[str, float], need: float) -> str | None:
    """The node (an id of `free`: each node's free GPUs) with the fewest free GPUs that still hold `need`, so
    others keep whole tensor-parallel groups (Ray's scheduler would spread them). None where none holds it."""
    fits = [(gpus, node) for node, gpus in free.items() if gpus + 1e-9 >= need]
    return min(fits)[1] if fits else None


def retrieval_waits_for_engine(generator, retrieval_gpus: float) -> bool:
    """Whether GPU retrieval starts only once the engine is ready: vLLM takes any drop of free GPU memory during its
    memory profiling for its own, and aborts if memory is freed then (none with `kv_cache_memory_bytes`)."""
    return (generator.backend == "vllm" and generator.num_gpus > 0 and retrieval_gpus > 0
            and "kv_cache_memory_bytes" not in generator.vllm_engine_kwargs)


def beside_generator(gpus: float) -> dict:
    """The Ray options of a retrieval actor asking for `gpus` on several GPU nodes: a soft affinity to the node
    `best_fit_node` picks from the free GPUs now. Nothing where it asks for no GPU or there is one GPU node."""
    if gpus <= 0:
        return {}
    free = {node: float(res.get("GPU", 0.0)) for node, res in free_nodes().items()}
    if sum(1 for gpus_free in free.values() if gpus_free > 0) < 2:
        return {}
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = best_fit_node(free, gpus)
    return {} if node is None else {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=True)}


# --- "auto" counts ----------------------------------------------------------------------------------------


def section(config, key: str):
    """`config`'s section (or setting) at a dotted key ("zerorag.lm_pruner")."""
    return operator.attrgetter(key)(config)


def _auto_now(config) -> list[str]:
    return [key for key, count in AUTO_SETTINGS.items() if getattr(section(config, key), count) == "auto"]


def auto_keys(config) -> list[str]:
    """The sections of `config` whose count is "auto", or was before a command decided it."""
    was = getattr(config, "_auto_sections", None) or ()
    return [key for key in AUTO_SETTINGS if key in was or key in _auto_now(config)]


def auto_concurrency(config, nodes: list[dict[str, float]], search_gpus: float = 0.0) -> dict[str, int]:
    """The count of each section of `config` whose count is "auto" ({"generator": 4, ...}) on `nodes`. Each pool may
    take the cluster, except the generator, which leaves retrieval `search_gpus`. With GPUs: as many as the GPUs
    hold; on CPUs: as many as the CPUs hold, one CPU of the largest node left to reads and writes. A training's
    workers at most its batch. At least one (a pool the cluster cannot hold is refused by the checks)."""
    out = {}
    for key in _auto_now(config):
        pool = section(config, key)
        free = [dict(n) for n in nodes]
        if pool.num_gpus > 0:
            stages = getattr(pool, "pipeline_parallel_size", 1)
            left = search_gpus if key == "generator" else 0.0
            for node in sorted(free, key=lambda n: -n.get("GPU", 0.0)):
                taken = min(left, node.get("GPU", 0.0))
                node["GPU"] = node.get("GPU", 0.0) - taken
                left -= taken
            need = {"GPU": pool.num_gpus / stages, "CPU": pool.num_cpus if stages == 1 else 0.0}
            count = room_for(need, free) // stages
        else:
            if free:
                largest = max(free, key=lambda n: n.get("CPU", 0.0))
                largest["CPU"] = largest.get("CPU", 0.0) - 1.0
            count = room_for({"CPU": pool.num_cpus}, free)
        if AUTO_SETTINGS[key] == "num_workers":
            count = min(count, section(config, key.rsplit(".", 1)[0]).batch_size)
        out[key] = max(1, count)
    return out


# The settings `apply_gpu_layout` decides or sets: each command restores what the config said before deciding again
LAYOUT_SETTINGS = ("generator.tensor_parallel_size", "generator.num_gpus", "generator.gpu_share",
                   "retrieval.search_gpus", "retrieval.embed_gpus", "index.gpu")


def needs_layout(config) -> bool:
    """Whether `config` has "auto" GPU settings for `apply_gpu_layout`, now or before a command decided them."""
    g, r = config.generator, config.retrieval
    return (getattr(config, "_layout_said", None) is not None or g.tensor_parallel_size == "auto"
            or r.search_gpus == "auto" or r.embed_gpus == "auto")


def _restore_layout(config) -> None:
    """The GPU settings as the config said them before a command decided its "auto" ones, remembered the first time."""
    said = getattr(config, "_layout_said", None)
    if said is None:
        config._layout_said = {key: copy.deepcopy(section(config, key)) for key in LAYOUT_SETTINGS}
        return
    for key, value in said.items():
        parent, name = key.rsplit(".", 1)
        object.__setattr__(section(config, parent), name, copy.deepcopy(value))


def decide_counts(config, nodes: list[dict[str, float]], search: tuple[int, float],
                  layout: GpuLayout | None) -> tuple[dict[str, int], float]:
    """Set each "auto" count of `config` on `nodes` (`auto_concurrency`), the generator's GPUs less what retrieval
    holds: `search`'s actors (as `apply_gpu_layout` takes them) at their share, and the query embedders; nothing
    where they take shares of the replicas' GPUs (`layout`). The runtime and the plan both call it. Returns the
    counts and the GPUs held."""
    r, held = config.retrieval, 0.0
    if config.generator.num_gpus and (layout is None or layout.whole):
        held = ((search[0] * r.search_share if config.index.gpu is not False else 0.0)
                + r.concurrency * r.query_embedder(config.embedder).num_gpus)
    counts = auto_concurrency(config, nodes, held)
    for key, count in counts.items():
        setattr(section(config, key), AUTO_SETTINGS[key], count)
    return counts, held


def resolve_auto_concurrency(config, search: tuple[int, float] = (0, 0.0)) -> None:
    """Decide `config`'s "auto" settings in place on `auto_nodes`, said in the log: first the GPU settings
    (`apply_gpu_layout`, from `search`), then each count (`decide_counts`). Every command calls it as it joins Ray;
    the config remembers what was "auto", so a command that runs after the index exists counts its search GPUs."""
    keys = auto_keys(config)
    layout = needs_layout(config)
    if not keys and not layout:
        return
    nodes, source = auto_nodes()
    decided = None
    if layout:
        _restore_layout(config)
        memory, where = gpu_memory_of(nodes, config.ray.gpu_memory_gb)
        said, decided = apply_gpu_layout(config, nodes, search, memory)
        for line in said:
            log.info("%s (GPU memory %g GB: %s)", line, memory, where)
    if not keys:
        return
    config._auto_sections = frozenset(keys)
    for key in keys:
        setattr(section(config, key), AUTO_SETTINGS[key], "auto")
    counts, held = decide_counts(config, nodes, search, decided)
    for key, count in counts.items():
        log.info(
            "%s.%s auto: %d (%s: %g CPU, %g GPU on %d node(s)%s)", key, AUTO_SETTINGS[key], count, source,
            sum(n.get("CPU", 0.0) for n in nodes), sum(n.get("GPU", 0.0) for n in nodes), len(nodes),
            f"; {held:g} GPU(s) left to retrieval" if held and key == "generator" else "")
