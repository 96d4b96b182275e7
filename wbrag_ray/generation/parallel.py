"""Engine replicas larger than one GPU (or one CPU rank), run in their own placement group (`RemoteEngine`). On
CPUs a tensor-parallel replica's ranks are vLLM's worker processes on one node, threads bound by `cpu_rank_env`.
"""

from __future__ import annotations

import logging
import math
import os
import uuid
import weakref

from wbrag_ray.config import ConfigError, GeneratorConfig
from wbrag_ray.placement import PENDING_TIMEOUT_S, replica_placement, sharded
from wbrag_ray.placement.waits import placement_wait_message
from wbrag_ray.ray_runtime import CLOSE_S

log = logging.getLogger(__name__)

# Ray removes a placement group only once its creator's job has ended: a replica's group is named after the actor
# that made it, and the service that ends its actors removes their groups.
ENGINE_GROUP = "wbrag-engine:"


def replica_env(config: GeneratorConfig) -> dict[str, str]:
    """The environment of a replica whose bundles ask for less than a GPU each (generator.gpu_share): vLLM's ray
    executor asks each bundle for VLLM_RAY_PER_WORKER_GPUS (default 1)."""
    if config.num_gpus <= 0 or not sharded(config) or config.gpu_share >= 1:
        return {}
    return {"VLLM_RAY_PER_WORKER_GPUS": f"{config.gpu_share:g}"}


def cpu_rank_env(config: GeneratorConfig, cpus: list[int]) -> dict[str, str]:
    """VLLM_CPU_OMP_THREADS_BIND for a CPU replica's ranks in a process allowed `cpus`: each rank its own block of
    the threads, wrapping (vLLM's default wants a NUMA node per rank). Nothing for one rank, or where set."""
    tp, _ = config.parallel_sizes()
    if config.num_gpus or tp == 1 or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return {}
    cpus = sorted(cpus)
    per = max(1, min(len(cpus), (config.threads or math.ceil(config.num_cpus)) // tp))
    blocks = [[cpus[(i * per + j) % len(cpus)] for j in range(per)] for i in range(tp)]
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(",".join(map(str, b)) for b in blocks)}


def release_engine_groups(actor_ids: list[str]) -> int:
    """Remove the placement groups of the remote engines the actors `actor_ids` (hex ids) started (Ray would hold
    them until the job ends); how many."""
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
    """A vLLM generator larger than one GPU, in a process in its own placement group's first bundle (child tasks
    captured: vLLM's ray executor starts a worker in each bundle); `call` runs a generator method there. Both end
    with this object, or with the actor that made them (`release_engine_groups`). `timeout_s`: the wait for the
    group (default `ray.pending_timeout_s`)."""

    def __init__(self, config: GeneratorConfig, host_cls: type, timeout_s: float | None = None):
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        spec = replica_placement(config)
        if spec is None:
            raise ValueError("a remote engine is for a replica of more than one shard")
        timeout_s = PENDING_TIMEOUT_S["seconds"] if timeout_s is None else timeout_s
        actor = ray.get_runtime_context().get_actor_id() or "driver"  # the group is named after its maker
        self.pg = placement_group(**spec, name=f"{ENGINE_GROUP}{actor}:{uuid.uuid4().hex[:8]}")
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
        """End the engine in order (the host's `close`, up to `ray_runtime.CLOSE_S`), then its process and group."""
        import ray

        if self._finalizer.alive and ray.is_initialized() and self._host_closes:
            ray.wait([self.actor.close.options(concurrency_group="close").remote()], timeout=CLOSE_S)
        self._finalizer()
