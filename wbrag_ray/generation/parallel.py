"""Generators larger than one GPU: where an engine replica's shards go, and whether the cluster can hold them.

A vLLM engine replica of tensor_parallel_size x pipeline_parallel_size shards (`GeneratorConfig.parallel_sizes`)
runs one worker per shard, each on one GPU. A standalone pass (`generate_pass` without services) goes through
Ray Data LLM, which places the workers itself from the engine arguments and the placement group config built
here. A generator service's actor does what Ray Data LLM's engine stage does
(`ray/llm/_internal/batch/stages/vllm_engine_stage.py`): it reserves a placement group of one-GPU bundles and
runs the engine in a process scheduled inside it with its child tasks captured, so vLLM's ray executor finds
the group as its current one and starts a worker in each GPU bundle (`RemoteEngine`); the service's actor
itself then asks Ray for no GPU.

`check_placement` refuses, before a pass starts, a replica the cluster cannot place, with the numbers.
"""

from __future__ import annotations

import collections
import logging
import weakref
from typing import Any

from wbrag_ray.cluster_nodes import refuse_unplaceable
from wbrag_ray.config import ConfigError, GeneratorConfig

log = logging.getLogger(__name__)

# One worker's bundle, as Ray Data LLM's default: a GPU and a CPU beside it (vLLM refuses bundles of more than
# one GPU: it starts one worker per GPU bundle). The engine's own process takes the first bundle's CPU.
GPU_BUNDLE: dict[str, float] = {"GPU": 1.0, "CPU": 1.0}

# vLLM waits this long for a placement group of its own (its PG_WAIT_TIMEOUT): an autoscaler may be adding nodes
PLACEMENT_TIMEOUT_S = 1800.0

def sharded(config: GeneratorConfig) -> bool:
    """Whether an engine replica spans more than one GPU (and so runs vLLM's ray executor in a placement group)."""
    tp, pp = config.parallel_sizes()
    return tp * pp > 1


def replica_placement(config: GeneratorConfig) -> dict[str, Any] | None:
    """The placement group of one engine replica larger than one GPU, as Ray Data LLM's `placement_group_config`
    and `ray.util.placement_group` both take it: tp x pp bundles of `GPU_BUNDLE`. STRICT_PACK (one node) when
    the replica is tensor-parallel only: its shards exchange activations at every layer, at NVLink speed on one
    node and far slower between nodes. With pipeline stages, PACK: a stage hands its activations to the next
    once per step, so stages may sit on different nodes, and PACK still puts the bundles on as few nodes as fit.
    (Ray has no strategy for "groups of tp on one node each"; vLLM orders its workers by node, and
    `check_placement` asks for nodes that hold tp GPUs.) None for a replica of one GPU or less."""
    if not sharded(config):
        return None
    tp, pp = config.parallel_sizes()
    return {"bundles": [dict(GPU_BUNDLE) for _ in range(tp * pp)], "strategy": "STRICT_PACK" if pp == 1 else "PACK"}


def _describe_nodes(node_gpus: list[float]) -> str:
    counts = collections.Counter(node_gpus)
    return ", ".join(f"{n} node{'s' * (n > 1)} x {g:g} GPU{'s' * (g != 1)}"
                     for g, n in sorted(counts.items(), reverse=True))


def placement_refusal(config: GeneratorConfig, nodes: list[dict[str, float]], key: str = "generator") -> str | None:
    """Why a cluster whose nodes hold `nodes` (each node's resources as Ray reports them, e.g. {"CPU": 32.0,
    "GPU": 8.0}) cannot place `config.concurrency` engine replicas of `config`, or None where it can (or where
    the generator asks for no GPU). A replica of tp x pp shards needs pp groups of tp GPUs, each group on one
    node; a replica of one GPU or less needs `num_gpus` of one node. `key`: the config section named in the
    message (generator, zerorag.qa_generator)."""
    if config.backend == "openai" or config.num_gpus <= 0:
        return None
    tp, pp = config.parallel_sizes()
    group = tp if tp * pp > 1 else config.num_gpus  # GPUs that must share one node
    needed = pp * config.concurrency
    node_gpus = [float(n.get("GPU", 0.0)) for n in nodes]
    shape = f"tensor_parallel_size={tp} x pipeline_parallel_size={pp}" if tp * pp > 1 else f"num_gpus={group:g}"
    have = _describe_nodes(node_gpus) if node_gpus else "no nodes"
    if max(node_gpus, default=0.0) < group:
        fix = ("lower tensor_parallel_size and raise pipeline_parallel_size (pipeline stages may sit on different "
               "nodes)" if tp > 1 else "run on CPUs (num_gpus: 0)")
        return (f"{key}: {shape} needs {group:g} GPU{'s' * (group != 1)} on one node, and no node of the cluster "
                f"has that many ({have}); {fix}, or add nodes with {group:g} GPUs")
    # whole groups per node; the small epsilon keeps 3 x 0.333... GPUs from flooring to 2
    groups = sum(int(g / group + 1e-9) for g in node_gpus)
    if groups < needed:
        fits = groups // pp
        return (f"{key}: concurrency={config.concurrency} replicas of {shape} need {needed} group"
                f"{'s' * (needed > 1)} of {group:g} GPUs on one node each ({needed * group:g} GPUs), and the "
                f"cluster holds {groups} ({have}); set concurrency: {fits}" if fits else
                f"{key}: concurrency={config.concurrency} replicas of {shape} need {needed} groups of {group:g} "
                f"GPUs on one node each, and the cluster holds {groups} ({have}); lower pipeline_parallel_size "
                "or add GPU nodes")
    return None


def check_placement(config: GeneratorConfig, key: str = "generator") -> None:
    """A `ConfigError` when the Ray cluster this process is connected to cannot place the generator's replicas
    (`placement_refusal`; `key`: the config section the message names); nothing to check when Ray is not up yet
    (the pass starts it) or where WBRAG_AUTOSCALING=1 says the cluster adds nodes that it does not publish."""
    import ray

    if config.backend == "openai" or config.num_gpus <= 0 or not ray.is_initialized():
        return
    refuse_unplaceable(lambda nodes: placement_refusal(config, nodes, key))


def _release(actor, pg) -> None:
    """End a remote engine's process and free its GPUs (the placement group would hold them for the job)."""
    import ray
    from ray.util.placement_group import remove_placement_group

    if not ray.is_initialized():
        return
    try:
        ray.kill(actor)
        remove_placement_group(pg)
    except Exception as exc:  # noqa: BLE001 - a finalizer: the cluster may be going down already
        log.debug("releasing a remote engine: %s", exc)


class RemoteEngine:
    """A vLLM generator larger than one GPU, hosted in a process inside its own placement group
    (`replica_placement`): the process is scheduled in the group's first bundle with child tasks captured, so
    vLLM's ray executor takes the group as its current one, starts a worker in each GPU bundle, and finds the
    engine's node among the group's. `call` runs a generator method there, under the calling pass's settings.
    The group and the process end with the last reference to this object (a service loading another model), or
    with the actor that made them (Ray ends an actor's placement groups and child actors with it)."""

    def __init__(self, config: GeneratorConfig, host_cls: type, timeout_s: float = PLACEMENT_TIMEOUT_S):
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        spec = replica_placement(config)
        if spec is None:
            raise ValueError("a remote engine is for a replica larger than one GPU")
        self.pg = placement_group(**spec)
        ready, _ = ray.wait([self.pg.ready()], timeout=timeout_s)
        if not ready:
            remove_placement_group(self.pg)
            tp, pp = config.parallel_sizes()
            raise ConfigError(
                f"generator: no room for an engine replica of tensor_parallel_size={tp} x pipeline_parallel_size="
                f"{pp} ({spec['strategy']} of {len(spec['bundles'])} one-GPU bundles) after {timeout_s:g} s: the "
                "cluster's GPUs are held by other work, or no node has the GPUs (`ray status`)")
        strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=0,
                                                    placement_group_capture_child_tasks=True)
        # the service actor's concurrent calls reach the engine's feed together (`generation.vllm_feed`)
        self.actor = ray.remote(num_cpus=GPU_BUNDLE["CPU"], num_gpus=0, max_concurrency=config.calls_per_engine)(
            host_cls).options(scheduling_strategy=strategy).remote(config)
        self._finalizer = weakref.finalize(self, _release, self.actor, self.pg)
        try:
            ray.get(self.actor.ready.remote())  # the engine's start, and its errors, here
        except BaseException:
            self._finalizer()
            raise

    def call(self, config: GeneratorConfig, method: str, *args, **kwargs):
        import ray

        return ray.get(self.actor.call.remote(config, method, *args, **kwargs))

    def close(self) -> None:
        self._finalizer()
