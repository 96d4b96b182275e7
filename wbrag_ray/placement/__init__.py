"""Does it fit on the cluster? One answer for the commands (on Ray's nodes) and the plan (on a stated cluster).

A node is what Ray reports of it, a dict of resources ({"CPU": 32.0, "GPU": 8.0, "memory": bytes}); a `Cluster`
is the plan's list of them. `room_for` counts how many units of an ask the nodes hold; the refusals say what does
not fit and the setting that asks for less. GPU shares and "auto" counts: `placement.gpus`; waits: `placement.waits`.
Over 400 lines: the inventory and every fit check with its refusal, in one place so no check is written twice.
"""

from __future__ import annotations

import collections
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any

from wbrag_ray.config import ConfigError, GeneratorConfig, TrainerConfig

log = logging.getLogger(__name__)

# 1 on a cluster that adds nodes on demand but publishes no node groups (Ray's v1 autoscaler): nothing is checked
AUTOSCALING_ENV = "WBRAG_AUTOSCALING"
# with WBRAG_AUTOSCALING=1, the cluster launcher's config, whose node types declare the most nodes it may run
LAUNCHER_CONFIG_ENV = "WBRAG_CLUSTER_CONFIG"
LAUNCHER_CONFIG = "~/ray_bootstrap_config.yaml"
# How long a service's actors may wait for resources (`ray.pending_timeout_s`, which `init_ray` sets)
PENDING_TIMEOUT_S = {"seconds": 1800.0}
# One engine worker's bundle: a GPU and a CPU beside it (vLLM starts one worker per GPU bundle)
GPU_BUNDLE: dict[str, float] = {"GPU": 1.0, "CPU": 1.0}


# --- the inventory -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Node:
    cpus: float
    gpus: float
    memory_gb: float
    gpu_memory_gb: float

    def resources(self) -> dict[str, float]:
        """The node as Ray reports one (memory in bytes)."""
        return {"CPU": self.cpus, "GPU": self.gpus, "memory": self.memory_gb * 1e9}


@dataclass(frozen=True)
class Cluster:
    """The nodes a plan is for, and where they came from (stated, this machine, the connected Ray cluster)."""

    nodes: tuple[Node, ...]
    source: str

    @classmethod
    def uniform(cls, nodes: int, cpus: float, gpus: float, memory_gb: float, gpu_memory_gb: float,
                source: str = "stated") -> Cluster:
        return cls(tuple(Node(cpus, gpus, memory_gb, gpu_memory_gb) for _ in range(nodes)), source)

    @property
    def gpus(self) -> float:
        return sum(n.gpus for n in self.nodes)

    @property
    def cpus(self) -> float:
        return sum(n.cpus for n in self.nodes)

    @property
    def gpu_memory_gb(self) -> float:
        return max((n.gpu_memory_gb for n in self.nodes if n.gpus), default=0.0)

    def resources(self) -> list[dict[str, float]]:
        """Each node as Ray reports one: what the commands' rules read."""
        return [n.resources() for n in self.nodes]

    def describe(self) -> str:
        shapes = collections.Counter(self.nodes)
        parts = [f"{count} x ({n.cpus:g} CPUs, {n.gpus:g} GPUs" + (f" of {n.gpu_memory_gb:g} GB" if n.gpus else "")
                 + f", {n.memory_gb:,.0f} GB)" for n, count in shapes.items()]
        return f"{' + '.join(parts)}: {self.cpus:g} CPUs, {self.gpus:g} GPUs ({self.source})"


def stated_cluster(nodes: int | None, gpus: float | None, cpus: float | None, memory_gb: float | None,
                   gpu_memory_gb: float) -> Cluster:
    """`nodes` alike nodes as `wbrag plan`'s flags state them; a value not given is this machine's (CPUs, memory),
    or 1 node and no GPUs."""
    import psutil

    given = [f"{v:g} {what}" for v, what in ((gpus, "GPUs"), (cpus, "CPUs"), (memory_gb, "GB")) if v is not None]
    if nodes is not None and nodes < 1:
        raise ConfigError(f"--nodes {nodes}: a cluster has at least one node")
    for flag, value in (("--gpus-per-node", gpus), ("--cpus-per-node", cpus), ("--memory-per-node", memory_gb)):
        if value is not None and value < 0:
            raise ConfigError(f"{flag} {value:g} is negative")
    source = ("stated" + (f": {', '.join(given)} a node" if given else "")
              + ("" if cpus is not None and memory_gb is not None else "; CPUs / memory per node: this machine's")
              if given or nodes is not None else "this machine: no --nodes / --gpus-per-node / --cpus-per-node / "
              "--memory-per-node given, GPUs not looked for")
    return Cluster.uniform(nodes or 1, cpus if cpus is not None else float(os.cpu_count() or 1),
                           gpus or 0.0, memory_gb if memory_gb is not None else psutil.virtual_memory().total / 1e9,
                           gpu_memory_gb, source)


def cluster_from_ray(gpu_memory_gb: float) -> Cluster | None:
    """The connected Ray cluster's alive nodes with CPUs (None without Ray); each GPU assumed `gpu_memory_gb`."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    nodes = [r for r in _alive_nodes() if r.get("CPU", 0) > 0]
    if not nodes:
        return None
    return Cluster(tuple(Node(float(r.get("CPU", 0)), float(r.get("GPU", 0)), float(r.get("memory", 0)) / 1e9,
                              gpu_memory_gb) for r in nodes),
                   f"the connected Ray cluster; GPUs assumed {gpu_memory_gb:g} GB")


def _alive_nodes() -> list[dict[str, float]]:
    import ray

    return [dict(n.get("Resources", {})) for n in ray.nodes() if n.get("Alive")]


def autoscaling() -> bool:
    """Whether WBRAG_AUTOSCALING says nodes come on demand unannounced (the placement checks step aside)."""
    return os.environ.get(AUTOSCALING_ENV, "").strip().lower() in ("1", "true", "yes")


def _published_groups() -> list:
    """The node groups Ray's autoscaler published (each with `resources` and `max_count`, negative where
    unbounded), or []."""
    try:  # Ray's own checks read it so (ray.train v2's worker group, ray.data's hash shuffle)
        from ray._private.state import state

        published = state.get_cluster_config()
    except Exception:  # noqa: BLE001 - a private API: where it moved or fails, the alive nodes are what is known
        published = None
    return list(published.node_group_configs) if published is not None else []


def cluster_nodes() -> tuple[list[dict[str, float]], bool]:
    """The nodes a pass may be placed on (each published node group's max_count, unbounded: 1024; else the alive
    nodes), and whether they are every node the cluster may run."""
    groups = _published_groups()
    if groups:
        return [dict(g.resources) for g in groups for _ in range(1024 if g.max_count < 0 else g.max_count)], True
    return _alive_nodes(), False


def launcher_nodes(doc: dict) -> list[dict[str, float]]:
    """The most nodes a cluster launcher config (`ray up`'s YAML) may run: the head, and each worker type's
    resources times its max_workers, most GPUs first, within the cluster's max_workers."""
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
    """The nodes `auto` sizes for, and what they are: an autoscaling cluster's declared maximum (bounded published
    node groups; with WBRAG_AUTOSCALING=1, the launcher's config), else the alive nodes."""
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
    return _alive_nodes(), "the nodes up now"


def free_nodes() -> dict[str, dict[str, float]]:
    """Each alive node's free resources by node id (where Ray's private API moved, the free total as node "")."""
    import ray

    try:
        from ray._private.state import state

        return {node: dict(free) for node, free in state.available_resources_per_node().items()}
    except Exception:  # noqa: BLE001 - a private API: the total is what is known
        return {"": dict(ray.available_resources())}


# --- fit checks and refusals ---------------------------------------------------------------------------------


def room_for(need: dict[str, float], nodes: list[dict[str, float]]) -> int:
    """How many whole units asking for `need` ({"CPU": 1, "GPU": 1}) the nodes hold, each unit on one node."""
    need = {r: amount for r, amount in need.items() if amount > 0}
    if not need:
        return 1 << 30
    return sum(min(_units(r, node.get(r, 0.0), amount) for r, amount in need.items()) for node in nodes)


def _units(resource: str, free: float, amount: float) -> int:
    """Units of `amount` in `free` of `resource` (the epsilon keeps 3 x 0.333 GPUs from flooring to 2). A share of
    a GPU lies on one GPU: 7.8 free GPUs hold 7 shares of 0.9 and 8 of 0.8."""
    if resource == "GPU" and amount < 1:
        whole = int(free + 1e-9)
        return whole * int(1 / amount + 1e-9) + int((free - whole) / amount + 1e-9)
    return int(free / amount + 1e-9)


def _amount(resource: str, amount: float) -> str:
    return f"{amount / (1 << 30):.3g} GiB memory" if resource == "memory" else f"{amount:g} {resource}"


def amounts(resources: dict[str, float], need: dict[str, float]) -> str:
    """`resources`' amounts of the resources `need` asks for, as a message says them ("1 CPU and 1 GPU")."""
    return " and ".join(_amount(r, resources.get(r, 0.0)) for r, a in need.items() if a > 0)


def pool_refusal(what: str, count: int, need: dict[str, float], nodes: list[dict[str, float]],
                 groups: int = 1, unit: str = "actor", fewer: str = "", smaller: str = "") -> str | None:
    """Why `count` actors (or other `unit`s) asking for `need` each do not fit `nodes`, or None where they do.
    `groups`: the pool is that many groups of replicas (a search pool's shard groups); `fewer` / `smaller`: the
    settings that ask for fewer units or less of each."""
    fits = room_for(need, nodes)
    if fits >= count:
        return None
    largest = {r: max((n.get(r, 0.0) for n in nodes), default=0.0) for r in need if need[r] > 0}
    short = [r for r in largest if largest[r] + 1e-9 < need[r]]
    if fewer:
        most = max((n.get("GPU" if need.get("GPU") else "CPU", 0.0) for n in nodes), default=0.0)
        fix = f"set {fewer}: {fits}" if fits else f"lower {smaller} (the largest node has {most:g})"
    else:
        fix = (f"lower its concurrency to {fits // groups}" if fits >= groups else
               "ask less: the largest node has " + amounts(largest, {r: 1.0 for r in short}) if short else
               "lower its concurrency")
    return (f"{what}: {count} {unit}{'s' * (count != 1)} of {amounts(need, need)} each do not fit the cluster's "
            f"{len(nodes)} node{'s' * (len(nodes) != 1)} (room for {fits}); {fix}, or add nodes")


def refuse_unplaceable(refusal) -> None:
    """A `ConfigError` with what `refusal(nodes)` says (None: it places) of the connected cluster's nodes; nothing
    is checked where WBRAG_AUTOSCALING=1."""
    if autoscaling():
        return
    nodes, every_node = cluster_nodes()
    why = refusal(nodes)
    if why is not None:
        where = ("" if every_node else f". (The nodes up now; on a cluster that adds nodes on demand, set "
                 f"{AUTOSCALING_ENV}=1 to skip this check.)")
        raise ConfigError(why + where)


# --- an engine replica's bundles -----------------------------------------------------------------------------


def sharded(config: GeneratorConfig) -> bool:
    """Whether an engine replica has more than one shard: it then runs in a placement group of its own."""
    tp, pp = config.parallel_sizes()
    return tp * pp > 1


def replica_placement(config: GeneratorConfig) -> dict[str, Any] | None:
    """The placement group of one engine replica of more than one shard (None otherwise): tp x pp bundles of
    `GPU_BUNDLE` (on CPUs, vLLM's CPU build: tp bundles of each rank's share of num_cpus). STRICT_PACK
    (tensor-parallel shards exchange activations every layer), PACK where generator.pipeline_across_nodes lets
    pipeline stages sit on different nodes."""
    if not sharded(config):
        return None
    tp, pp = config.parallel_sizes()
    if not config.num_gpus:
        return {"bundles": [{"CPU": round(config.num_cpus / tp, 4)} for _ in range(tp)], "strategy": "STRICT_PACK"}
    across = pp > 1 and config.pipeline_across_nodes
    bundle = {**GPU_BUNDLE, "GPU": config.gpu_share}  # less than a GPU where retrieval's shares sit beside it
    return {"bundles": [dict(bundle) for _ in range(tp * pp)], "strategy": "PACK" if across else "STRICT_PACK"}


def placement_refusal(config: GeneratorConfig, nodes: list[dict[str, float]], key: str = "generator") -> str | None:
    """Why `nodes` cannot place `config.concurrency` engine replicas, or None. A replica's tp x pp GPUs go on one
    node; with pipeline_across_nodes, pp groups of tp GPUs. `key`: the section the message names."""
    if config.backend == "openai" or config.num_gpus <= 0:
        return None
    tp, pp = config.parallel_sizes()
    across = pp > 1 and config.pipeline_across_nodes
    # GPUs that must share one node, and how many such groups the replicas need
    group = (tp if across else tp * pp) if tp * pp > 1 else config.num_gpus
    needed = (pp if across else 1) * config.concurrency
    node_gpus = [float(n.get("GPU", 0.0)) for n in nodes]
    shape = f"tensor_parallel_size={tp} x pipeline_parallel_size={pp}" if tp * pp > 1 else f"num_gpus={group:g}"
    have = ", ".join(f"{n} node{'s' * (n > 1)} x {g:g} GPU{'s' * (g != 1)}"
                     for g, n in sorted(collections.Counter(node_gpus).items(), reverse=True)) or "no nodes"
    if max(node_gpus, default=0.0) < group:
        if pp > 1 and not across:
            fix = f"set pipeline_across_nodes: true (its {pp} stages on different nodes, {tp:g} GPUs of one node each)"
        elif tp > 1:
            fix = ("lower tensor_parallel_size and raise pipeline_parallel_size with pipeline_across_nodes: true "
                   "(pipeline stages may then sit on different nodes)")
        else:
            fix = "run on CPUs (num_gpus: 0)"
        return (f"{key}: {shape} needs {group:g} GPU{'s' * (group != 1)} on one node, and no node of the cluster "
                f"has that many ({have}); {fix}, or add nodes with {group:g} GPUs")
    groups = room_for({"GPU": group}, nodes)
    if groups < needed:
        fits = groups // (pp if across else 1)
        return (f"{key}: concurrency={config.concurrency} replicas of {shape} need {needed} group"
                f"{'s' * (needed > 1)} of {group:g} GPUs on one node each ({needed * group:g} GPUs), and the "
                f"cluster holds {groups} ({have}); set concurrency: {fits}" if fits else
                f"{key}: concurrency={config.concurrency} replicas of {shape} need {needed} groups of {group:g} "
                f"GPUs on one node each, and the cluster holds {groups} ({have}); lower pipeline_parallel_size "
                "or add GPU nodes")
    return None


def check_placement(config: GeneratorConfig, key: str = "generator") -> None:
    """A `ConfigError` when the connected Ray cluster cannot place the generator's replicas (none without Ray)."""
    ray = sys.modules.get("ray")
    if config.backend == "openai" or config.num_gpus <= 0 or ray is None or not ray.is_initialized():
        return
    refuse_unplaceable(lambda nodes: placement_refusal(config, nodes, key))


def workers_refusal(trainer: TrainerConfig, nodes: list[dict[str, float]], key: str) -> str | None:
    """Why `nodes` cannot place a training's `trainer.num_workers` workers, or None. `key`: the config section."""
    need = {"CPU": trainer.num_cpus, **({"GPU": trainer.num_gpus} if trainer.num_gpus else {})}
    return pool_refusal(f"{key}.trainer", trainer.num_workers, need, nodes, unit="training worker",
                        fewer=f"{key}.trainer.num_workers",
                        smaller=f"{key}.trainer.num_{'gpus' if trainer.num_gpus else 'cpus'}")


def check_workers(trainer: TrainerConfig, key: str) -> None:
    """A ConfigError before any training worker starts where the connected cluster cannot place them."""
    refuse_unplaceable(lambda nodes: workers_refusal(trainer, nodes, key))


# --- a plan's bundles ----------------------------------------------------------------------------------------


@dataclass
class Bundle:
    """`count` actors (or tasks, or training workers) of a stage, each asking Ray for this; `gpu_memory_gb`: what
    the model takes of each of its GPUs. `fix` lowers the stage's total ask, `fix_node` makes one bundle fit a
    node, `fix_memory` makes the model fit its GPUs."""

    what: str
    count: int
    cpus: float
    gpus: float = 0.0
    memory_gb: float | None = None  # host memory of one bundle (None: not estimated)
    gpu_memory_gb: float | None = None
    gpu_budget: float = 1.0  # the share of a GPU's memory the bundle may fill (vLLM: gpu_memory_utilization)
    kind: str = "actor"  # actor | worker | task
    fix: str = ""
    fix_node: str = ""
    fix_memory: str = ""
    detail: str = ""

    @property
    def need(self) -> dict[str, float]:
        return {"CPU": self.cpus, "GPU": self.gpus, "memory": (self.memory_gb or 0.0) * 1e9}

    def describe(self) -> str:
        ask = [f"{self.cpus:g} CPU"] + ([f"{self.gpus:g} GPU"] if self.gpus else [])
        if self.memory_gb is not None:
            ask.append(f"{self.memory_gb:,.1f} GB")
        if self.gpu_memory_gb is not None:
            ask.append(f"{self.gpu_memory_gb:,.1f} GB per GPU")
        extra = f"; {self.detail}" if self.detail else ""
        return f"{self.count:,} x {self.what} {{{', '.join(ask)}}}{extra}"


def problems(bundles: list[Bundle], cluster: Cluster) -> list[str]:
    """Why a stage's `bundles` cannot be placed on `cluster` ([] when they can). Actors and workers live at once,
    packed together first fit from the largest; a task only has to fit one node, since tasks queue."""
    out = []
    nodes = cluster.resources()
    largest = max(cluster.nodes, key=lambda n: (n.gpus, n.cpus, n.memory_gb))
    for b in bundles:
        budget = cluster.gpu_memory_gb * b.gpu_budget
        if b.gpu_memory_gb is not None and b.gpus and b.gpu_memory_gb > budget:
            out.append(f"a {b.what} needs {b.gpu_memory_gb:,.1f} GB on each of its GPUs, more than the "
                       f"{budget:,.1f} GB it may use of a {cluster.gpu_memory_gb:g} GB GPU; {b.fix_memory or b.fix}")
        elif not any(room_for(b.need, [n]) for n in nodes):
            need = [f"{b.cpus:g} CPUs"] + ([f"{b.gpus:g} GPUs"] if b.gpus else [])
            if b.memory_gb is not None:
                need.append(f"{b.memory_gb:,.1f} GB")
            out.append(f"a {b.what} needs {', '.join(need)} on one node; the largest node has "
                       f"{largest.cpus:g} CPUs, {largest.gpus:g} GPUs, {largest.memory_gb:,.0f} GB; {b.fix_node or b.fix}")
    if out:
        return out
    resident = sorted((b for b in bundles if b.kind != "task"), key=lambda b: (-b.gpus, -b.cpus, -(b.memory_gb or 0)))
    for b in resident:
        for _ in range(b.count):
            node = next((n for n in nodes if room_for(b.need, [n])), None)
            if node is None:
                return [_too_much(resident, cluster)]
            for r, amount in b.need.items():
                node[r] -= amount
    return []


def _too_much(resident: list[Bundle], cluster: Cluster) -> str:
    gpus = sum(b.gpus * b.count for b in resident)
    asks = ", ".join(f"{b.count:,} x {b.what}" for b in resident)
    short = gpus > cluster.gpus
    fixes = " or ".join(dict.fromkeys(f for b in resident if b.fix and (b.gpus or not short) for f in b.fix.split(" or ")))
    if short:
        return f"its actors ask for {gpus:g} GPUs at once ({asks}), the cluster has {cluster.gpus:g}; {fixes}"
    cpus = sum(b.cpus * b.count for b in resident)
    memory = sum((b.memory_gb or 0.0) * b.count for b in resident)
    return (f"its actors ({asks}: {cpus:g} CPUs, {gpus:g} GPUs, {memory:,.0f} GB together) do not fit the "
            f"nodes at once, bundle by bundle ({cluster.describe()}); {fixes}")
