"""The nodes a Ray cluster may place work on, as the checks that refuse an unplaceable pass or training read
them before anything waits for resources (a generator's replicas, `generation.parallel`; Ray Train's workers,
`training.workers`): one reading, one way out for a cluster that adds nodes without announcing them; and the rule
that sizes every `auto` count. The waits that end (a service's actors, a Ray Data pool, Ray Train's workers) are
`wbrag_ray.waits`'."""

from __future__ import annotations

import logging
import os

from wbrag_ray.config import AUTO_SETTINGS, ConfigError

# Set to 1 on a cluster that adds nodes on demand but publishes no node groups (Ray's v1 autoscaler, which the
# cluster launcher runs): the nodes up now say nothing about what it can add, so the checks check nothing.
AUTOSCALING_ENV = "WBRAG_AUTOSCALING"

log = logging.getLogger(__name__)

# How long a service's actors may wait for resources (`ray.pending_timeout_s`; `init_ray` sets it for the
# driver). As long as vLLM waits for its own placement group: an autoscaler may be adding nodes meanwhile.
PENDING_TIMEOUT_S = {"seconds": 1800.0}


def autoscaling() -> bool:
    """Whether WBRAG_AUTOSCALING says nodes come on demand unannounced (the placement checks step aside)."""
    return os.environ.get(AUTOSCALING_ENV, "").strip().lower() in ("1", "true", "yes")


def cluster_nodes() -> tuple[list[dict[str, float]], bool]:
    """The nodes a pass may be placed on, and whether they are every node the cluster may run: where Ray's
    autoscaler published its node groups (autoscaler v2, KubeRay), each group's node max_count times (unbounded
    groups: as many as any pass here asks for), as Ray Train checks its workers; otherwise the nodes alive now
    (False: an autoscaler of the cluster launcher may add more)."""
    import ray

    groups = _published_groups()
    if groups:
        nodes = []
        for group in groups:
            count = 1024 if group.max_count < 0 else group.max_count
            nodes.extend(dict(group.resources) for _ in range(count))
        return nodes, True
    return [dict(n.get("Resources", {})) for n in ray.nodes() if n.get("Alive")], False


def _published_groups() -> list:
    """The node groups Ray's autoscaler published (autoscaler v2, KubeRay: each with `resources` and `max_count`,
    negative where unbounded), or [] where it published none."""
    try:  # Ray's own checks read it so (ray.train v2's worker group, ray.data's hash shuffle)
        from ray._private.state import state

        published = state.get_cluster_config()
    except Exception:  # noqa: BLE001 - a private API: where it moved or fails, the alive nodes are what is known
        published = None
    return list(published.node_group_configs) if published is not None else []


def room_for(need: dict[str, float], nodes: list[dict[str, float]]) -> int:
    """How many whole units asking for `need` (resource -> amount, e.g. {"CPU": 1, "GPU": 1}) the nodes hold,
    each unit on one node; the epsilon keeps 3 x 0.333... GPUs from flooring to 2."""
    need = {r: amount for r, amount in need.items() if amount > 0}
    if not need:
        return 1 << 30
    return sum(min(_units(r, node.get(r, 0.0), amount) for r, amount in need.items()) for node in nodes)


def _units(resource: str, free: float, amount: float) -> int:
    """Units of `amount` in `free` of `resource`. A share of a GPU lies on one GPU (Ray packs shares onto the
    GPUs it has started filling): 7.8 free GPUs (0.2 held by search actors on one of them) hold 7 shares of 0.9
    and 8 of 0.8."""
    if resource == "GPU" and amount < 1:
        whole = int(free + 1e-9)
        return whole * int(1 / amount + 1e-9) + int((free - whole) / amount + 1e-9)
    return int(free / amount + 1e-9)


def pool_refusal(what: str, count: int, need: dict[str, float], nodes: list[dict[str, float]],
                 groups: int = 1) -> str | None:
    """Why `count` actors asking for `need` each (one node per actor) do not fit `nodes`, or None where they
    do. Ray starts those that fit and leaves the rest pending: a driver that sends work to every actor (a stage
    service, a search pool) then waits forever. `what`: the pool, as the message names it; `groups`: the pool
    is that many groups of `concurrency` replicas (a search pool's shard groups), so the concurrency that fits
    is the room over the groups."""
    fits = room_for(need, nodes)
    if fits >= count:
        return None

    each = _amounts(need, need)
    largest = {r: max((n.get(r, 0.0) for n in nodes), default=0.0) for r in need if need[r] > 0}
    short = [r for r in largest if largest[r] + 1e-9 < need[r]]
    fix = (f"lower its concurrency to {fits // groups}" if fits >= groups else
           "ask less: the largest node has " + _amounts(largest, {r: 1.0 for r in short}) if short else
           "lower its concurrency")
    return (f"{what}: {count} actor{'s' * (count != 1)} of {each} each do not fit the cluster's {len(nodes)} "
            f"node{'s' * (len(nodes) != 1)} (room for {fits}); {fix}, or add nodes")


def refuse_unplaceable(refusal) -> None:
    """A `ConfigError` with what `refusal(nodes)` says (None: it places) about the connected cluster's nodes;
    where those are only the nodes up now, the message says how to skip the check on a cluster that adds nodes
    on demand. Nothing is checked where WBRAG_AUTOSCALING=1."""
    if autoscaling():
        return
    nodes, every_node = cluster_nodes()
    why = refusal(nodes)
    if why is not None:
        where = ("" if every_node else f". (The nodes up now; on a cluster that adds nodes on demand, set "
                 f"{AUTOSCALING_ENV}=1 to skip this check.)")
        raise ConfigError(why + where)


def beside_generator(gpus: float) -> dict:
    """The Ray options of a retrieval actor asking for `gpus` (a search actor, a query embedder) on a cluster of
    several GPU nodes: started on the node `gpu_layout.best_fit_node` picks from the free GPUs now (soft: where that
    node is gone, anywhere), so retrieval's GPUs break no more tensor-parallel groups than the plan counted.
    Nothing where it asks for no GPU or the cluster has one GPU node."""
    if gpus <= 0:
        return {}
    try:
        from ray._private.state import state

        free = {node: float(res.get("GPU", 0.0)) for node, res in state.available_resources_per_node().items()}
    except Exception:  # noqa: BLE001 - a private API: where it moved, Ray's own placement
        return {}
    if sum(1 for gpus_free in free.values() if gpus_free > 0) < 2:
        return {}
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from wbrag_ray.gpu_layout import best_fit_node

    node = best_fit_node(free, gpus)
    return {} if node is None else {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=True)}


def free_nodes() -> list[dict[str, float]]:
    """Each alive node's resources free now (Ray's per-node availability, a private API its own `ray status`
    reads; where it moved, the cluster's free total as one node)."""
    import ray

    try:
        from ray._private.state import state

        return [dict(free) for free in state.available_resources_per_node().values()]
    except Exception:  # noqa: BLE001 - a private API: the total is what is known
        return [dict(ray.available_resources())]


# The settings that may be "auto" (`config.AUTO_SETTINGS`): one pass or training at a time uses each.
AUTO_SECTIONS = tuple(AUTO_SETTINGS)
# With WBRAG_AUTOSCALING=1 on a cluster of Ray's cluster launcher, the launcher config whose node types declare the
# most nodes the cluster may run (`ray up` copies it to the head as this file; `ray job submit` runs drivers there).
LAUNCHER_CONFIG_ENV = "WBRAG_CLUSTER_CONFIG"
LAUNCHER_CONFIG = "~/ray_bootstrap_config.yaml"


def section(config, key: str):
    """`config`'s section at a dotted key ("zerorag.lm_pruner")."""
    for part in key.split("."):
        config = getattr(config, part)
    return config


def _auto_now(config) -> list[str]:
    return [key for key, count in AUTO_SETTINGS.items() if getattr(section(config, key), count) == "auto"]


def auto_keys(config) -> list[str]:
    """The sections of `config` whose count is "auto", or was before a command decided it (remembered by
    `resolve_auto_concurrency`, so that the next command decides it again)."""
    was = getattr(config, "_auto_sections", None) or ()
    return [key for key in AUTO_SETTINGS if key in was or key in _auto_now(config)]


def has_auto(config) -> bool:
    return bool(auto_keys(config))


def auto_concurrency(config, nodes: list[dict[str, float]], search_gpus: float = 0.0) -> dict[str, int]:
    """The count of each section of `config` whose count is "auto" ({"generator": 4, "zerorag.tune.trainer": 8,
    ...}) on `nodes` (each node's resources: the cluster's, or its declared maximum). The one rule of the plan and
    of the commands. A stage runs alone, so each pool may take the cluster, except the generator, which shares it
    with retrieval: `search_gpus` (what the search actors and query embedders hold beside it, taken from the nodes
    with the most GPUs first). An actor or worker with GPUs (an engine replica: its tensor-parallel GPUs on one node,
    times its pipeline stages; a training worker: its GPUs on one node): as many as the GPUs hold. On CPUs: as many
    as the CPUs hold, one CPU of the largest node left to the reads and writes that feed them. A training's workers
    at most its batch (`plan_steps` gives every worker an example a step). At least one: a pool the cluster cannot
    hold is refused by the placement checks, with why."""
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


def launcher_nodes(doc: dict) -> list[dict[str, float]]:
    """The most nodes a cluster launcher config (`ray up`'s YAML) may run: the head, and each worker node type's
    `resources` times its max_workers, the types with the most GPUs first within the cluster's max_workers."""
    types = doc.get("available_node_types") or {}
    head = doc.get("head_node_type")
    budget = doc.get("max_workers", 1 << 30)
    nodes = [{r: float(v) for r, v in (types[head].get("resources") or {}).items()}] if head in types else []
    workers = sorted((t for name, t in types.items() if name != head),
                     key=lambda t: -float((t.get("resources") or {}).get("GPU", 0)))
    for t in workers:
        count = min(int(t.get("max_workers", 0)), budget)
        budget -= count
        nodes += [{r: float(v) for r, v in (t.get("resources") or {}).items()} for _ in range(count)]
    return nodes


def auto_nodes() -> tuple[list[dict[str, float]], str]:
    """The nodes `auto` sizes for, and what they are: an autoscaling cluster's declared maximum (the node groups
    Ray's autoscaler publishes, where each is bounded; or, with WBRAG_AUTOSCALING=1, the node types of the cluster
    launcher's config, WBRAG_CLUSTER_CONFIG or the head's ~/ray_bootstrap_config.yaml), else every alive node's
    resources: the cluster's, not what is free this moment (what this run's finished commands still hold is given
    back when a stage needs it, `stages.kept.make_room`; another job's hold ends a pool's wait with a message,
    `waits.wait_placed`)."""
    import ray

    groups = _published_groups()
    if groups and all(g.max_count >= 0 for g in groups):
        return [dict(g.resources) for g in groups for _ in range(g.max_count)], "the autoscaler's declared maximum"
    if autoscaling():
        import yaml

        path = os.path.expanduser(os.environ.get(LAUNCHER_CONFIG_ENV, LAUNCHER_CONFIG))
        try:
            with open(path) as f:
                nodes = launcher_nodes(yaml.safe_load(f) or {})
        except (OSError, yaml.YAMLError, AttributeError, TypeError, ValueError) as exc:
            log.warning("concurrency auto: no declared maximum in %s (%s): the nodes up now", path, exc)
            nodes = []
        if nodes:
            return nodes, f"the launcher config's maximum ({path})"
    return [dict(n.get("Resources", {})) for n in ray.nodes() if n.get("Alive")], "the nodes up now"


# The settings `gpu_layout.apply_gpu_layout` decides where they are "auto" (dotted paths), and the ones it may set
# beside them: each command restores what the config said before deciding again (the index may exist by then).
LAYOUT_SETTINGS = ("generator.tensor_parallel_size", "generator.num_gpus", "generator.gpu_share",
                   "retrieval.search_gpus", "retrieval.embed_gpus", "index.gpu")


def needs_layout(config) -> bool:
    """Whether `config` has GPU placement for `gpu_layout.apply_gpu_layout` to decide (its "auto" GPU settings),
    now or before a command decided them."""
    g, r = config.generator, config.retrieval
    return (getattr(config, "_layout_said", None) is not None or g.tensor_parallel_size == "auto"
            or r.search_gpus == "auto" or r.embed_gpus == "auto")


def _restore_layout(config) -> None:
    """The GPU settings as the config said them before a command decided its "auto" ones, remembered the first time."""
    import copy

    said = getattr(config, "_layout_said", None)
    if said is None:
        config._layout_said = {key: copy.deepcopy(_get(config, key)) for key in LAYOUT_SETTINGS}
        return
    for key, value in said.items():
        _set(config, key, copy.deepcopy(value))


def _get(config, key: str):
    parent, name = key.rsplit(".", 1)
    return getattr(section(config, parent), name)


def _set(config, key: str, value) -> None:
    parent, name = key.rsplit(".", 1)
    object.__setattr__(section(config, parent), name, value)


def resolve_auto_concurrency(config, search_gpus: float = 0.0, search: tuple[int, float] | None = None) -> None:
    """Each "auto" count of `config` set, in place, to what `auto_concurrency` finds on `auto_nodes`, the generator's
    GPUs less those retrieval holds beside it: `search_gpus` (the search actors of the run's index,
    `retrieval.service.search_gpus`) and the query embedders' (a retrieval pass's actors hold the embedder with its
    GPUs). First, the "auto" GPU settings (`gpu_layout.apply_gpu_layout`: the generator's tensor-parallel size,
    whether retrieval takes whole GPUs or shares beside the replicas), from `search`: the search actors that will
    search on GPUs and the bytes of the largest (`retrieval.service.search_actors`; where given, `search_gpus`
    follows from it). Said in the log. Called by every command as it joins Ray (`api.join_ray`), and decided again
    by each: the config remembers which settings were "auto", so a command that runs after the index exists
    (write-back, evaluation, Zero-RAG after `build_kb` in `wbrag run`) counts its search actors' GPUs. The stages
    record the numbers they ran with."""
    keys = auto_keys(config)
    layout = needs_layout(config)
    if not keys and not layout:
        return
    nodes, source = auto_nodes()
    shares = False
    if layout:
        from wbrag_ray.gpu_layout import apply_gpu_layout, gpu_memory_of, holds_whole_gpus

        _restore_layout(config)
        memory, where = gpu_memory_of(nodes, config.ray.gpu_memory_gb)
        found = search or (0, 0.0)
        said, decided = apply_gpu_layout(config, nodes, found, memory)
        for line in said:
            log.info("%s (GPU memory %g GB: %s)", line, memory, where)
        shares = not holds_whole_gpus(decided)
        if search is not None:
            search_gpus = found[0] * config.retrieval.search_share if config.index.gpu is not False else 0.0
    if not keys:
        return
    config._auto_sections = frozenset(keys)
    for key in keys:
        setattr(section(config, key), AUTO_SETTINGS[key], "auto")
    r = config.retrieval
    held = (search_gpus + r.concurrency * r.query_embedder(config.embedder).num_gpus) if config.generator.num_gpus else 0
    if shares:  # retrieval's shares sit in what the replicas' GPUs leave: no whole GPU is held
        held = 0.0
    for key, count in auto_concurrency(config, nodes, held).items():
        setattr(section(config, key), AUTO_SETTINGS[key], count)
        log.info(
            "%s.%s auto: %d (%s: %g CPU, %g GPU on %d node(s)%s)", key, AUTO_SETTINGS[key], count, source,
            sum(n.get("CPU", 0.0) for n in nodes), sum(n.get("GPU", 0.0) for n in nodes), len(nodes),
            f"; {held:g} GPU(s) left to retrieval" if held and key == "generator" else "")


def _amount(resource: str, amount: float) -> str:
    return f"{amount / (1 << 30):.3g} GiB memory" if resource == "memory" else f"{amount:g} {resource}"


def _amounts(resources: dict[str, float], need: dict[str, float]) -> str:
    """`resources`' amounts of the resources `need` asks for, as a message says them ("1 CPU and 1 GPU")."""
    return " and ".join(_amount(r, resources.get(r, 0.0)) for r, a in need.items() if a > 0)
