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
