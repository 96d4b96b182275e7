"""The cluster a plan is for, the bundles a stage asks Ray for, and whether they can be placed.

A stage's actors and training workers live at the same time (a generator service beside the search actors, an
embedder pool, a Ray Train worker group), so their bundles are packed together onto the nodes, first fit from the
largest; a task (ingest, index add and merge) only has to fit one node, since tasks queue. A bundle's GPUs are
one node's (a vLLM replica's tensor-parallel group, a training worker's GPUs); a pipeline-parallel replica is one
bundle per stage, and those may sit on different nodes, as Ray places them.
"""

from __future__ import annotations

from dataclasses import dataclass

from wbrag_ray.config import ConfigError


@dataclass(frozen=True)
class Node:
    cpus: float
    gpus: float
    memory_gb: float
    gpu_memory_gb: float


@dataclass(frozen=True)
class Cluster:
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

    def describe(self) -> str:
        shapes: dict[Node, int] = {}
        for n in self.nodes:
            shapes[n] = shapes.get(n, 0) + 1
        parts = [f"{count} x ({n.cpus:g} CPUs, {n.gpus:g} GPUs" + (f" of {n.gpu_memory_gb:g} GB" if n.gpus else "")
                 + f", {n.memory_gb:,.0f} GB)" for n, count in shapes.items()]
        return f"{' + '.join(parts)}: {self.cpus:g} CPUs, {self.gpus:g} GPUs ({self.source})"


@dataclass
class Bundle:
    """`count` actors (or tasks, or training workers) of a stage, each asking Ray for this. `gpu_memory_gb` is
    what the model takes of each of its GPUs, checked against `gpu_budget` of a GPU. What to change when it does
    not fit: `fix` names the keys that lower the stage's total ask, `fix_node` what makes one bundle fit a node,
    `fix_memory` what makes the model fit its GPUs."""

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

    def describe(self) -> str:
        ask = [f"{self.cpus:g} CPU"] + ([f"{self.gpus:g} GPU"] if self.gpus else [])
        if self.memory_gb is not None:
            ask.append(f"{self.memory_gb:,.1f} GB")
        if self.gpu_memory_gb is not None:
            ask.append(f"{self.gpu_memory_gb:,.1f} GB per GPU")
        extra = f"; {self.detail}" if self.detail else ""
        return f"{self.count:,} x {self.what} {{{', '.join(ask)}}}{extra}"


@dataclass
class _Free:
    cpus: float
    gpus: float
    memory_gb: float


def _fits(b: Bundle, free: _Free) -> bool:
    return (b.cpus <= free.cpus + 1e-9 and b.gpus <= free.gpus + 1e-9
            and (b.memory_gb or 0.0) <= free.memory_gb + 1e-9)


def problems(bundles: list[Bundle], cluster: Cluster) -> list[str]:
    """Why a stage's `bundles` cannot be placed on `cluster` ([] when they can), each naming what to change."""
    out = []
    largest = max(cluster.nodes, key=lambda n: (n.gpus, n.cpus, n.memory_gb))
    for b in bundles:
        budget = cluster.gpu_memory_gb * b.gpu_budget
        if b.gpu_memory_gb is not None and b.gpus and b.gpu_memory_gb > budget:
            out.append(f"a {b.what} needs {b.gpu_memory_gb:,.1f} GB on each of its GPUs, more than the "
                       f"{budget:,.1f} GB it may use of a {cluster.gpu_memory_gb:g} GB GPU; {b.fix_memory or b.fix}")
        elif not any(_fits(b, _Free(n.cpus, n.gpus, n.memory_gb)) for n in cluster.nodes):
            need = [f"{b.cpus:g} CPUs"] + ([f"{b.gpus:g} GPUs"] if b.gpus else [])
            if b.memory_gb is not None:
                need.append(f"{b.memory_gb:,.1f} GB")
            out.append(f"a {b.what} needs {', '.join(need)} on one node; the largest node has "
                       f"{largest.cpus:g} CPUs, {largest.gpus:g} GPUs, {largest.memory_gb:,.0f} GB; {b.fix_node or b.fix}")
    if out:
        return out
    resident = sorted((b for b in bundles if b.kind != "task"), key=lambda b: (-b.gpus, -b.cpus, -(b.memory_gb or 0)))
    free = [_Free(n.cpus, n.gpus, n.memory_gb) for n in cluster.nodes]
    for b in resident:
        for _ in range(b.count):
            node = next((f for f in free if _fits(b, f)), None)
            if node is None:
                return [_too_much(resident, cluster)]
            node.cpus -= b.cpus
            node.gpus -= b.gpus
            node.memory_gb -= b.memory_gb or 0.0
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


def stated_cluster(nodes: int | None, gpus: float | None, cpus: float | None, memory_gb: float | None,
                   gpu_memory_gb: float) -> Cluster:
    """`nodes` alike nodes as `wbrag plan`'s flags state them; a value not given is this machine's (CPUs, memory),
    or 1 node and no GPUs. With no flag at all, the cluster is this machine (its GPUs are not looked for)."""
    import os

    import psutil

    given = [f"{v:g} {what}" for v, what in ((gpus, "GPUs"), (cpus, "CPUs"), (memory_gb, "GB")) if v is not None]
    if nodes is not None and nodes < 1:
        raise ConfigError(f"--nodes {nodes}: a cluster has at least one node")
    for flag, value in (("--gpus-per-node", gpus), ("--cpus-per-node", cpus), ("--memory-per-node", memory_gb)):
        if value is not None and value < 0:
            raise ConfigError(f"{flag} {value:g} is negative")
    source = ("stated" + (f": {', '.join(given)} a node" if given else "")
              + ("" if cpus is not None and memory_gb is not None else "; CPUs / memory per node: this machine's")
              if given or nodes is not None else "this machine: no --nodes / --gpus-per-node / --cpus-per-node / --memory-per-node given, GPUs "
              "not looked for")
    return Cluster.uniform(nodes or 1, cpus if cpus is not None else float(os.cpu_count() or 1),
                           gpus or 0.0, memory_gb if memory_gb is not None else psutil.virtual_memory().total / 1e9,
                           gpu_memory_gb, source)


def cluster_from_ray(gpu_memory_gb: float) -> Cluster | None:
    """The connected Ray cluster's alive nodes (CPUs, GPUs, memory Ray offers), or None when Ray is not connected
    in this process. Ray does not report a GPU's memory: `gpu_memory_gb` is assumed."""
    import sys

    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("CPU", 0) > 0]
    if not nodes:
        return None
    return Cluster(tuple(Node(float(r.get("CPU", 0)), float(r.get("GPU", 0)), float(r.get("memory", 0)) / 1e9,
                              gpu_memory_gb) for r in nodes),
                   f"the connected Ray cluster; GPUs assumed {gpu_memory_gb:g} GB")
