"""The nodes a Ray cluster may place work on, as the checks that refuse an unplaceable pass or training read
them before anything waits for resources (a generator's replicas, `generation.parallel`; Ray Train's workers,
`training.workers`): one reading, one way out for a cluster that adds nodes without announcing them."""

from __future__ import annotations

import os

from wbrag_ray.config import ConfigError

# Set to 1 on a cluster that adds nodes on demand but publishes no node groups (Ray's v1 autoscaler, which the
# cluster launcher runs): the nodes up now say nothing about what it can add, so the checks check nothing.
AUTOSCALING_ENV = "WBRAG_AUTOSCALING"


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
    return sum(min(int(node.get(r, 0.0) / amount + 1e-9) for r, amount in need.items()) for node in nodes)


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

    def amount(r: str, a: float) -> str:
        return f"{a / (1 << 30):.3g} GiB memory" if r == "memory" else f"{a:g} {r}"

    each = " and ".join(amount(r, a) for r, a in need.items() if a > 0)
    largest = {r: max((n.get(r, 0.0) for n in nodes), default=0.0) for r in need if need[r] > 0}
    short = [r for r in largest if largest[r] + 1e-9 < need[r]]
    fix = (f"lower its concurrency to {fits // groups}" if fits >= groups else
           "ask less: the largest node has " + " and ".join(amount(r, largest[r]) for r in short) if short else
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
