"""Generators larger than one GPU: where an engine replica's shards go, and whether the cluster can hold them.

A vLLM engine replica of tensor_parallel_size x pipeline_parallel_size shards (`GeneratorConfig.parallel_sizes`)
runs one worker per shard, each on one GPU. A standalone pass (`generate_pass` without services) goes through
Ray Data LLM, which places the workers itself from the engine arguments and the placement group config built
here. A generator service's actor does what Ray Data LLM's engine stage does
(`ray/llm/_internal/batch/stages/vllm_engine_stage.py`): it reserves a placement group of one-GPU bundles and
runs the engine in a process scheduled inside it with its child tasks captured, so vLLM's ray executor finds
the group as its current one and starts a worker in each GPU bundle (`RemoteEngine`); the service's actor
itself then asks Ray for no GPU.

On CPUs (generator.num_gpus: 0, vLLM's CPU build) a tensor-parallel replica's ranks are processes of vLLM's
multiprocessing executor on one node, each with its own OpenMP threads: the placement group holds one CPU bundle
per rank (the replica's num_cpus split between them), so Ray's accounting counts the ranks' CPUs, and the engine's
process runs in it as on GPUs (`cpu_rank_env` binds each rank's threads).

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

# Ray removes a placement group once both its creator and the creator's job have ended: a killed service actor's
# group stayed held until the driver exited (Ray 2.60, measured 2026-12-05). So a replica's group is named after the
# actor that made it, and the service that ends its actors removes their groups (`release_engine_groups`).
ENGINE_GROUP = "wbrag-engine:"


def sharded(config: GeneratorConfig) -> bool:
    """Whether an engine replica has more than one shard: more than one GPU (vLLM's ray executor), or on CPUs
    more than one tensor-parallel rank (its multiprocessing executor); either way in a placement group of its own."""
    tp, pp = config.parallel_sizes()
    return tp * pp > 1


def cpu_rank_bundle(config: GeneratorConfig) -> dict[str, float]:
    """One tensor-parallel rank's bundle on CPUs (vLLM's CPU build): its share of the replica's num_cpus."""
    tp, _ = config.parallel_sizes()
    return {"CPU": round(config.num_cpus / tp, 4)}


def replica_placement(config: GeneratorConfig) -> dict[str, Any] | None:
    """The placement group of one engine replica of more than one shard, as Ray Data LLM's
    `placement_group_config` and `ray.util.placement_group` both take it: tp x pp bundles of `GPU_BUNDLE` (on
    CPUs, tp bundles of `cpu_rank_bundle`). STRICT_PACK, the whole replica on one node, by default: tensor-parallel
    shards exchange activations at every layer, at NVLink speed (shared memory on CPUs) on one node and far slower
    between nodes. PACK only where generator.pipeline_across_nodes asks for it: a stage hands its activations to
    the next once per step, so stages may sit on different nodes, and PACK still puts the bundles on as few nodes
    as fit; but Ray has no strategy for "groups of tp on one node each", so PACK may also split a tensor-parallel
    group (vLLM orders its workers by node, and `check_placement` asks for nodes that hold whole groups). None for
    a replica of one GPU or less."""
    if not sharded(config):
        return None
    tp, pp = config.parallel_sizes()
    if not config.num_gpus:
        return {"bundles": [cpu_rank_bundle(config) for _ in range(tp)], "strategy": "STRICT_PACK"}
    across = pp > 1 and config.pipeline_across_nodes
    bundle = {**GPU_BUNDLE, "GPU": config.gpu_share}  # less than a GPU where retrieval's shares sit beside it
    return {"bundles": [dict(bundle) for _ in range(tp * pp)], "strategy": "PACK" if across else "STRICT_PACK"}


def replica_env(config: GeneratorConfig) -> dict[str, str]:
    """The environment of a replica of several GPUs whose bundles ask for less than a GPU each (generator.gpu_share,
    set where retrieval's actors share its GPUs): vLLM's ray executor asks Ray for VLLM_RAY_PER_WORKER_GPUS of a
    bundle for each worker (1 by default, which such a bundle cannot give), and each worker still uses its whole
    GPU, its memory bounded by gpu_memory_utilization. Nothing otherwise."""
    if config.num_gpus <= 0 or not sharded(config) or config.gpu_share >= 1:
        return {}
    return {"VLLM_RAY_PER_WORKER_GPUS": f"{config.gpu_share:g}"}


def cpu_rank_env(config: GeneratorConfig, cpus: list[int]) -> dict[str, str]:
    """The environment that binds a CPU replica's tensor-parallel ranks (vLLM's CPU build), for an engine started
    in a process allowed `cpus` (`os.sched_getaffinity`): VLLM_CPU_OMP_THREADS_BIND gives each rank its own
    consecutive block of the replica's threads (generator.threads, default ceil(num_cpus)) over tp, at least one
    core; blocks wrap to the first cores where the ranks need more cores than there are. vLLM's default ("auto")
    binds rank i to NUMA node i and refuses fewer NUMA nodes than ranks ("Not enough allowed NUMA nodes to bind
    threads of 2 local CPUWorkers": this machine has one). Nothing for a replica of one rank, or where the
    environment sets the binding already."""
    import math
    import os

    tp, _ = config.parallel_sizes()
    if config.num_gpus or tp == 1 or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return {}
    cpus = sorted(cpus)
    per = max(1, min(len(cpus), (config.threads or math.ceil(config.num_cpus)) // tp))
    blocks = [[cpus[(i * per + j) % len(cpus)] for j in range(per)] for i in range(tp)]
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(",".join(map(str, b)) for b in blocks)}


def _describe_nodes(node_gpus: list[float]) -> str:
    counts = collections.Counter(node_gpus)
    return ", ".join(f"{n} node{'s' * (n > 1)} x {g:g} GPU{'s' * (g != 1)}"
                     for g, n in sorted(counts.items(), reverse=True))


def placement_refusal(config: GeneratorConfig, nodes: list[dict[str, float]], key: str = "generator") -> str | None:
    """Why a cluster whose nodes hold `nodes` (each node's resources as Ray reports them, e.g. {"CPU": 32.0,
    "GPU": 8.0}) cannot place `config.concurrency` engine replicas of `config`, or None where it can (or where
    the generator asks for no GPU). A replica of tp x pp shards needs its tp x pp GPUs on one node
    (`replica_placement`: STRICT_PACK), or, where generator.pipeline_across_nodes lets its stages go to several
    nodes, pp groups of tp GPUs, each group on one node; a replica of one GPU or less needs `num_gpus` of one node.
    `key`: the config section named in the message (generator, zerorag.qa_generator)."""
    if config.backend == "openai" or config.num_gpus <= 0:
        return None
    tp, pp = config.parallel_sizes()
    across = pp > 1 and config.pipeline_across_nodes
    # GPUs that must share one node, and how many such groups the replicas need
    group = (tp if across else tp * pp) if tp * pp > 1 else config.num_gpus
    needed = (pp if across else 1) * config.concurrency
    node_gpus = [float(n.get("GPU", 0.0)) for n in nodes]
    shape = f"tensor_parallel_size={tp} x pipeline_parallel_size={pp}" if tp * pp > 1 else f"num_gpus={group:g}"
    have = _describe_nodes(node_gpus) if node_gpus else "no nodes"
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
    # whole groups per node; the small epsilon keeps 3 x 0.333... GPUs from flooring to 2
    groups = sum(int(g / group + 1e-9) for g in node_gpus)
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
    """A `ConfigError` when the Ray cluster this process is connected to cannot place the generator's replicas
    (`placement_refusal`; `key`: the config section the message names); nothing to check when Ray is not up yet
    (the pass starts it) or where WBRAG_AUTOSCALING=1 says the cluster adds nodes that it does not publish."""
    import ray

    if config.backend == "openai" or config.num_gpus <= 0 or not ray.is_initialized():
        return
    refuse_unplaceable(lambda nodes: placement_refusal(config, nodes, key))


def _engine_group_name() -> str:
    import uuid

    import ray

    return f"{ENGINE_GROUP}{ray.get_runtime_context().get_actor_id() or 'driver'}:{uuid.uuid4().hex[:8]}"


def release_engine_groups(actor_ids: list[str]) -> int:
    """Remove the placement groups of the remote engines that the actors `actor_ids` (hex ids, ended or ending)
    started; how many. Ray would hold them, and their GPUs or CPUs, until the job ends."""
    from ray.util import placement_group_table
    from ray.util.placement_group import get_placement_group, remove_placement_group

    prefixes = tuple(f"{ENGINE_GROUP}{actor}:" for actor in actor_ids)
    removed = 0
    for group in placement_group_table().values():
        if prefixes and group["name"].startswith(prefixes) and group["state"] != "REMOVED":
            try:
                remove_placement_group(get_placement_group(group["name"]))
                removed += 1
            except Exception as exc:  # noqa: BLE001 - removed meanwhile (the engine's own finalizer)
                log.debug("removing %s: %s", group["name"], exc)
    return removed


def placement_wait_message(config: GeneratorConfig, spec: dict[str, Any], timeout_s: float) -> str:
    """What a replica's placement group still waits for after `timeout_s`: its bundles, what they add up to, on how
    many nodes, and the free resources of the cluster now (`cluster_nodes.free_nodes`)."""
    from wbrag_ray.cluster_nodes import free_nodes

    tp, pp = config.parallel_sizes()
    total = collections.Counter()
    for bundle in spec["bundles"]:
        total.update(bundle)
    need = " + ".join(f"{v:g} {k}" for k, v in sorted(total.items(), key=lambda kv: kv[0] != "GPU"))
    where = "one node" if spec["strategy"] == "STRICT_PACK" else "as few nodes as fit"
    try:
        free = "; ".join(", ".join(f"{v:g} {k}" for k, v in sorted(n.items()) if k in ("CPU", "GPU")) or "nothing"
                         for n in free_nodes())
    except Exception:  # noqa: BLE001 - the message matters more than the detail
        free = "unknown"
    return (f"generator: no room for an engine replica of tensor_parallel_size={tp} x pipeline_parallel_size={pp} "
            f"after {timeout_s:g} s (ray.pending_timeout_s): its placement group needs {len(spec['bundles'])} "
            f"bundles of {spec['bundles'][0]} ({need}) on {where} ({spec['strategy']}), and the cluster has free "
            f"[{free}]: its resources are held by other work, or no node has that many (`ray status`); free them, "
            "add nodes, or raise ray.pending_timeout_s where an autoscaler is adding nodes")


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
    with the actor that made them: Ray ends its child actors with it, and the service that ends it removes the
    group (`release_engine_groups`; Ray itself would keep it until the job ends)."""

    def __init__(self, config: GeneratorConfig, host_cls: type, timeout_s: float | None = None):
        """`timeout_s`: how long to wait for the placement group (default `ray.pending_timeout_s`, as a service's
        actors wait: `cluster_nodes.PENDING_TIMEOUT_S`, which a service's actor gets from the driver)."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from wbrag_ray.cluster_nodes import PENDING_TIMEOUT_S

        spec = replica_placement(config)
        if spec is None:
            raise ValueError("a remote engine is for a replica of more than one shard")
        timeout_s = PENDING_TIMEOUT_S["seconds"] if timeout_s is None else timeout_s
        self.pg = placement_group(**spec, name=_engine_group_name())
        ready, _ = ray.wait([self.pg.ready()], timeout=timeout_s)
        if not ready:
            remove_placement_group(self.pg)
            raise ConfigError(placement_wait_message(config, spec, timeout_s))
        strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=0,
                                                    placement_group_capture_child_tasks=True)
        # the engine's process takes its bundle's CPUs (on CPUs: rank 0's, whose process it starts beside it)
        cpus = spec["bundles"][0]["CPU"]
        # the service actor's concurrent calls reach the engine's feed together (`generation.vllm_feed`)
        env = replica_env(config)
        self.actor = ray.remote(num_cpus=cpus, num_gpus=0, max_concurrency=config.calls_per_engine,
                                concurrency_groups={"close": 1})(
            host_cls).options(scheduling_strategy=strategy,
                              **({"runtime_env": {"env_vars": env}} if env else {})).remote(config)
        self._finalizer = weakref.finalize(self, _release, self.actor, self.pg)
        self._host_closes = callable(getattr(host_cls, "close", None))
        try:
            ray.get(self.actor.ready.remote())  # the engine's start, and its errors, here
        except BaseException:
            self._finalizer()
            raise

    def call(self, config: GeneratorConfig, method: str, *args, **kwargs):
        import ray

        return ray.get(self.actor.call.remote(config, method, *args, **kwargs))

    def close(self) -> None:
        """End the engine in order (the host's `close`, where its class has one: vLLM's shutdown, then any process
        it left, up to `ray_runtime.CLOSE_S`), then its process and placement group."""
        import ray

        from wbrag_ray.ray_runtime import CLOSE_S

        if self._finalizer.alive and ray.is_initialized() and self._host_closes:
            ray.wait([self.actor.close.options(concurrency_group="close").remote()], timeout=CLOSE_S)
        self._finalizer()
