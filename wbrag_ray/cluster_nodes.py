"""The nodes a Ray cluster may place work on, as the checks that refuse an unplaceable pass or training read
them before anything waits for resources (a generator's replicas, `generation.parallel`; Ray Train's workers,
`training.workers`): one reading, one way out for a cluster that adds nodes without announcing them; and the
wait for a service's actors to be placed, which ends with what is missing instead of waiting forever."""

from __future__ import annotations

import logging
import os
import time

from wbrag_ray.config import ConfigError

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

    try:  # Ray's own checks read it so (ray.train v2's worker group, ray.data's hash shuffle)
        from ray._private.state import state

        published = state.get_cluster_config()
    except Exception:  # noqa: BLE001 - a private API: where it moved or fails, the alive nodes are what is known
        published = None
    if published is not None and published.node_group_configs:
        nodes = []
        for group in published.node_group_configs:
            count = 1024 if group.max_count < 0 else group.max_count
            nodes.extend(dict(group.resources) for _ in range(count))
        return nodes, True
    return [dict(n.get("Resources", {})) for n in ray.nodes() if n.get("Alive")], False


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


def free_nodes() -> list[dict[str, float]]:
    """Each alive node's resources free now (Ray's per-node availability, a private API its own `ray status`
    reads; where it moved, the cluster's free total as one node)."""
    import ray

    try:
        from ray._private.state import state

        return [dict(free) for free in state.available_resources_per_node().values()]
    except Exception:  # noqa: BLE001 - a private API: the total is what is known
        return [dict(ray.available_resources())]


# the sections whose concurrency may be "auto": the pools of model actors (one pass at a time uses each)
AUTO_SECTIONS = ("embedder", "generator", "zerorag.lm_pruner")


def section(config, key: str):
    """`config`'s section at a dotted key ("zerorag.lm_pruner")."""
    for part in key.split("."):
        config = getattr(config, part)
    return config


def has_auto(config) -> bool:
    return any(section(config, key).concurrency == "auto" for key in AUTO_SECTIONS)


def auto_concurrency(config, nodes: list[dict[str, float]], search_gpus: float = 0.0) -> dict[str, int]:
    """The actor count of each section of `config` whose `concurrency` is "auto" ({"generator": 4, ...}), on
    `nodes` (the resources free on each). An actor with GPUs (an engine replica: its tensor-parallel GPUs on one
    node, times its pipeline stages): as many as the free GPUs hold, the generator's less `search_gpus` (what the
    command's retrieval holds beside it, taken from the nodes with the most GPUs first). A CPU actor: as many as
    the free CPUs hold, one CPU of the largest node left to the reads and writes that feed it. At least one: a
    pool the cluster cannot hold is refused by the placement checks, with why."""
    out = {}
    for key in AUTO_SECTIONS:
        pool = section(config, key)
        if pool.concurrency != "auto":
            continue
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
        out[key] = max(1, count)
    return out


def resolve_auto_concurrency(config, search_gpus: float = 0.0) -> None:
    """Each `concurrency: auto` of `config` set, in place, to what `auto_concurrency` finds on the joined
    cluster's free resources now, the generator's GPUs less those retrieval holds beside it: `search_gpus` (the
    search actors of the run's index, `retrieval.service.search_gpus`) and the query embedders' (a retrieval
    pass's actors hold the embedder with its GPUs). Said in the log. Called once when a command joins Ray: the
    stages record the numbers they ran with."""
    r = config.retrieval
    held = (search_gpus + r.concurrency * r.query_embedder(config.embedder).num_gpus) if config.generator.num_gpus else 0
    nodes = free_nodes()
    for key, count in auto_concurrency(config, nodes, held).items():
        section(config, key).concurrency = count
        log.info(
            "%s.concurrency auto: %d (free now: %g CPU, %g GPU on %d node(s)%s)", key, count,
            sum(n.get("CPU", 0.0) for n in nodes), sum(n.get("GPU", 0.0) for n in nodes), len(nodes),
            f"; {held:g} GPU(s) left to retrieval" if held else "")


def _placed(actor) -> bool:
    """Whether Ray has given `actor` a node and a process (its constructor may still be loading a model), read
    from the GCS's actor table: the public state API asks the dashboard, which a local `wbrag` cluster does not
    run. Where the private table moved, True: nothing is known to be waiting."""
    try:
        from ray._private.state import actors

        entry = actors(actor._actor_id.hex())
        return entry["State"] not in ("DEPENDENCIES_UNREADY", "PENDING_CREATION") or bool(entry["Pid"])
    except Exception:  # noqa: BLE001 - a private API
        return True


def wait_placed(actors: list, what: str, need: dict[str, float], fix: str, timeout_s: float | None = None) -> None:
    """Return once every actor of `actors` (each asking for `need`) is placed; a `ConfigError` naming what is
    missing when some still wait for resources after `timeout_s` (default: `ray.pending_timeout_s`). The
    capacity checks (`pool_refusal`) refuse a pool the cluster can never hold; this ends the wait for one it
    could hold but whose resources others hold now (another job, a pass still running), where the driver would
    otherwise wait on the missing actors forever. Said in the log every minute of the wait. `fix`: the setting
    that asks for less ("lower generator.concurrency")."""
    import ray

    timeout_s = PENDING_TIMEOUT_S["seconds"] if timeout_s is None else timeout_s
    start = time.monotonic()
    said, pause = start, 0.02
    while True:
        waiting = sum(not _placed(a) for a in actors)
        if not waiting:
            return
        now = time.monotonic()
        if now - start >= timeout_s:
            break
        if now - said >= 60:
            said = now
            log.warning("%s: %d of %d actors still wait for resources after %.0f s (free now: %s); failing after "
                        "%g s (ray.pending_timeout_s)", what, waiting, len(actors), now - start,
                        _amounts(ray.available_resources(), need), timeout_s)
        time.sleep(pause)
        pause = min(pause * 2, 1.0)
    each = _amounts(need, need)
    free, total = ray.available_resources(), ray.cluster_resources()
    held = ", ".join(f"{_amount(r, free.get(r, 0.0))} of {_amount(r, total.get(r, 0.0))}" for r in need if need[r] > 0)
    raise ConfigError(
        f"{what}: {waiting} of {len(actors)} actors of {each} each still wait for resources after {timeout_s:g} s. "
        f"Free now: {held}; the rest is held by other jobs or this run's other actors (`ray status` shows whom). "
        f"{fix[:1].upper() + fix[1:]}, free the resources, or raise ray.pending_timeout_s where an autoscaler is still adding nodes")


def _amount(resource: str, amount: float) -> str:
    return f"{amount / (1 << 30):.3g} GiB memory" if resource == "memory" else f"{amount:g} {resource}"


def _amounts(resources: dict[str, float], need: dict[str, float]) -> str:
    """`resources`' amounts of the resources `need` asks for, as a message says them ("1 CPU and 1 GPU")."""
    return " and ".join(_amount(r, resources.get(r, 0.0)) for r, a in need.items() if a > 0)
