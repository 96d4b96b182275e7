"""Generators larger than one GPU: the (tensor, pipeline) parallel sizes a config resolves to, the configs refused
and why, the engine arguments built with them, the cluster check before a pass, and the
placement group a generator service's replica takes (on a local cluster whose nodes declare GPUs: Ray schedules
by the declared count, so the bundles, the capture of child tasks and the removal run for real; what runs in the
group is a probe in place of vLLM's engine, which needs real GPUs: benchmarks/gpu/check.py runs that).

    python -m tests.generation.test_parallel_sizes   (the multi-node part, as a script: a Cluster needs its own
                                                      driver process; prints a JSON summary)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import last_json_line
from wbrag_ray.config import ConfigError, GeneratorConfig, load_config
from wbrag_ray.generation.stage import GenerateStage
from wbrag_ray.generation.vllm import VLLMGenerator
from wbrag_ray.placement import GPU_BUNDLE, placement_refusal, replica_placement

ROOT = Path(__file__).resolve().parents[2]


def vllm(**kwargs) -> GeneratorConfig:
    return GeneratorConfig(backend="vllm", **kwargs)


# --- the rule ---------------------------------------------------------------------------------------------


def test_tensor_parallel_size_defaults_to_the_replicas_gpus_over_its_pipeline_stages():
    assert vllm(num_gpus=4).parallel_sizes() == (4, 1)
    assert vllm(num_gpus=8, pipeline_parallel_size=2).parallel_sizes() == (4, 2)
    assert vllm(num_gpus=4, tensor_parallel_size=2, pipeline_parallel_size=2).parallel_sizes() == (2, 2)
    assert vllm(num_gpus=2, tensor_parallel_size=1, pipeline_parallel_size=2).parallel_sizes() == (1, 2)
    # one GPU, part of one, or none: unsharded
    assert vllm(num_gpus=1).parallel_sizes() == vllm(num_gpus=0.5).parallel_sizes() == vllm().parallel_sizes() == (1, 1)
    # the other backends run a model whole
    assert GeneratorConfig(backend="hf", num_gpus=1).parallel_sizes() == (1, 1)
    assert GeneratorConfig(backend="openai", model="m", num_gpus=2).parallel_sizes() == (1, 1)


def test_the_paper_configs_validate_and_the_70b_generator_is_sized_on_the_cluster():
    """The 70B's tensor-parallel size is decided where the GPUs are known (tests/test_placement_gpus.py: 2 on H200s, 4 on
    80 GB GPUs); before that, nothing may read a size from it."""
    zero_rag = load_config(ROOT / "jobs" / "configs" / "paper_zero_rag.yaml")
    assert zero_rag.generator.tensor_parallel_size == "auto"
    with pytest.raises(ConfigError, match="tensor_parallel_size auto is decided on the cluster"):
        zero_rag.generator.parallel_sizes()
    assert load_config(ROOT / "jobs" / "configs" / "paper_writeback.yaml").generator.parallel_sizes() == (1, 1)


# --- the refusals -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("overrides", "key", "says"), [
    (["generator.num_gpus=2"], "generator.num_gpus", "the hf backend runs a model on one GPU; set backend: vllm"),
    (["generator.tensor_parallel_size=2"], "generator.tensor_parallel_size",
     "only the vllm backend shards a model over GPUs (backend: hf)"),
    (["generator.backend=openai", "generator.model=m", "generator.pipeline_parallel_size=2"],
     "generator.pipeline_parallel_size", "only the vllm backend shards a model over GPUs (backend: openai)"),
    (["generator.backend=vllm", "generator.num_gpus=2.5"], "generator.num_gpus",
     "an engine replica larger than one GPU takes whole GPUs"),
    (["generator.backend=vllm", "generator.num_gpus=6", "generator.pipeline_parallel_size=4"], "generator.num_gpus",
     "6 GPUs do not split into pipeline_parallel_size=4 stages of equal size; set tensor_parallel_size too"),
    (["generator.backend=vllm", "generator.num_gpus=0.5", "generator.tensor_parallel_size=2"], "generator.num_gpus",
     "tensor_parallel_size x pipeline_parallel_size = 2 x 1 runs on GPUs, one per shard; set num_gpus: 2"),
    # on CPUs only tensor parallel: vLLM's CPU ranks are processes of one node
    (["generator.backend=vllm", "generator.pipeline_parallel_size=2"], "generator.num_gpus",
     "= 1 x 2 runs on GPUs, one per shard; set num_gpus: 2; on CPUs (num_gpus: 0) only tensor_parallel_size shards"),
    (["generator.backend=vllm", "generator.num_gpus=0.5", "generator.pipeline_parallel_size=2"], "generator.num_gpus",
     "= 1 x 2 runs on GPUs, one per shard; set num_gpus: 2"),
    (["generator.backend=vllm", "generator.num_gpus=4", "generator.tensor_parallel_size=2"], "generator.num_gpus",
     "tensor_parallel_size x pipeline_parallel_size = 2 x 1 shards holds 2 GPUs, one per shard; make num_gpus and"),
    (["generator.backend=vllm", "generator.num_gpus=1", "generator.pipeline_parallel_size=2"], "generator.num_gpus",
     "holds 2 GPUs, one per shard"),
    (["generator.backend=vllm", "generator.num_gpus=2", "generator.vllm_engine_kwargs={tensor_parallel_size: 2}"],
     "generator.vllm_engine_kwargs", "set tensor_parallel_size itself, not in vllm_engine_kwargs"),
    # the QA writer is a generator config of its own, checked the same way and named by its own key
    (["zerorag.qa_generator={backend: vllm, num_gpus: 1, pipeline_parallel_size: 2}"],
     "zerorag.qa_generator.num_gpus", "holds 2 GPUs, one per shard"),
])
def test_a_replica_whose_gpus_and_shards_disagree_is_refused_naming_the_key_and_the_fix(overrides, key, says):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=overrides)
    assert f"config key '{key}'" in str(err.value) and says in str(err.value)


def test_tensor_parallel_on_cpus_is_accepted_for_vllm_only():
    """vLLM's CPU build runs tensor-parallel ranks as processes (num_gpus: 0); the hf backend still refuses."""
    config = load_config(overrides=["generator.backend=vllm", "generator.tensor_parallel_size=2"])
    assert config.generator.parallel_sizes() == (2, 1)
    with pytest.raises(ConfigError, match="only the vllm backend shards a model"):
        load_config(overrides=["generator.backend=hf", "generator.tensor_parallel_size=2"])


def test_consistent_sharded_replicas_are_accepted_for_the_generator_and_the_qa_writer():
    config = load_config(overrides=["generator.backend=vllm", "generator.num_gpus=8",
                                    "generator.pipeline_parallel_size=2",
                                    "zerorag.qa_generator={backend: vllm, num_gpus: 2, tensor_parallel_size: 2}"])
    assert config.generator.parallel_sizes() == (4, 2)
    assert config.zerorag.qa_generator.parallel_sizes() == (2, 1)


# --- the engine -------------------------------------------------------------------------------------------


def test_engine_kwargs_carry_the_parallel_sizes_and_the_ray_executor_for_a_sharded_replica():
    kwargs = VLLMGenerator(vllm(num_gpus=8, pipeline_parallel_size=2)).engine_kwargs()
    assert (kwargs["tensor_parallel_size"], kwargs["pipeline_parallel_size"]) == (4, 2)
    assert kwargs["distributed_executor_backend"] == "ray"
    one = VLLMGenerator(vllm(num_gpus=1)).engine_kwargs()
    assert (one["tensor_parallel_size"], one["pipeline_parallel_size"]) == (1, 1)
    assert "distributed_executor_backend" not in one  # vLLM's own choice on one GPU (uni)
    cpu = VLLMGenerator(vllm()).engine_kwargs()  # the CPU build keeps its executor
    assert (cpu["tensor_parallel_size"], cpu["distributed_executor_backend"]) == (1, "mp")
    # tensor parallel on CPUs: vLLM's multiprocessing executor, a process per rank
    cpu_tp = VLLMGenerator(vllm(tensor_parallel_size=2)).engine_kwargs()
    assert (cpu_tp["tensor_parallel_size"], cpu_tp["distributed_executor_backend"]) == (2, "mp")


def test_the_engine_starts_batch_invariant_on_one_gpu_and_not_tensor_parallel_unless_asked():
    """generator.batch_invariant auto: VLLM_BATCH_INVARIANT for a replica of one GPU (or pipeline stages of one),
    not for a tensor-parallel one (it would pin NCCL to one channel); true and false as given; never on CPUs."""
    assert VLLMGenerator(vllm(num_gpus=1)).batch_invariant
    assert VLLMGenerator(vllm(num_gpus=2, tensor_parallel_size=1, pipeline_parallel_size=2)).batch_invariant
    assert not VLLMGenerator(vllm(num_gpus=4)).batch_invariant
    assert VLLMGenerator(vllm(num_gpus=4, batch_invariant=True)).batch_invariant
    assert not VLLMGenerator(vllm(num_gpus=1, batch_invariant=False)).batch_invariant
    assert not VLLMGenerator(vllm(batch_invariant=True)).batch_invariant  # vLLM's CPU build: no such kernels


def test_an_engine_on_a_share_of_a_gpu_keeps_its_memory_within_the_share():
    """generator.num_gpus below 1 (a GPU shared with search actors or query embedders): vLLM's memory share is
    kept below the replica's, and a larger one set by hand is refused (the actors beside it would run out)."""
    assert VLLMGenerator(vllm(num_gpus=1)).engine_kwargs()["gpu_memory_utilization"] == 0.85  # vLLM's whole GPU
    assert VLLMGenerator(vllm(num_gpus=0.8)).engine_kwargs()["gpu_memory_utilization"] == 0.75
    assert VLLMGenerator(vllm(num_gpus=0.9)).engine_kwargs()["gpu_memory_utilization"] == 0.85
    assert VLLMGenerator(vllm(num_gpus=0.8, vllm_engine_kwargs={"gpu_memory_utilization": 0.7})).engine_kwargs()[
        "gpu_memory_utilization"] == 0.7
    with pytest.raises(ConfigError, match=r"generator.vllm_engine_kwargs.*gpu_memory_utilization=0.9 is more of the "
                                          r"GPU than the replica's share \(num_gpus=0.8\)"):
        load_config(overrides=["generator.backend=vllm", "generator.num_gpus=0.8",
                               "generator.vllm_engine_kwargs={gpu_memory_utilization: 0.9}"])


def test_the_replica_placement_is_one_bundle_per_shard_strict_pack_unless_stages_may_cross_nodes():
    """The paper configs' shapes: the 70B generator as tp=4 x pp=1; tp=4 x pp=2 with and without
    pipeline_across_nodes; and vLLM's CPU ranks (tp=2, num_gpus: 0)."""
    assert replica_placement(vllm(num_gpus=4)) == {"bundles": [GPU_BUNDLE] * 4, "strategy": "STRICT_PACK"}
    # pipeline stages on one node (their tensor-parallel groups with them), unless the config lets them cross
    assert replica_placement(vllm(num_gpus=8, pipeline_parallel_size=2)) == {"bundles": [GPU_BUNDLE] * 8,
                                                                             "strategy": "STRICT_PACK"}
    assert replica_placement(vllm(num_gpus=8, pipeline_parallel_size=2, pipeline_across_nodes=True)) == {
        "bundles": [GPU_BUNDLE] * 8, "strategy": "PACK"}
    # nothing to cross without stages
    assert replica_placement(vllm(num_gpus=4, pipeline_across_nodes=True))["strategy"] == "STRICT_PACK"
    assert GPU_BUNDLE == {"GPU": 1.0, "CPU": 1.0}  # vLLM starts one worker per one-GPU bundle
    assert replica_placement(vllm(num_gpus=1)) is None and replica_placement(vllm()) is None
    # CPU ranks: a bundle each, the replica's num_cpus split between them, on one node
    assert replica_placement(vllm(tensor_parallel_size=2, num_cpus=1)) == {"bundles": [{"CPU": 0.5}, {"CPU": 0.5}],
                                                                           "strategy": "STRICT_PACK"}
    assert replica_placement(vllm(tensor_parallel_size=2, num_cpus=16)) == {"bundles": [{"CPU": 8.0}] * 2,
                                                                            "strategy": "STRICT_PACK"}


def test_cpu_ranks_get_cores_of_their_own():
    """VLLM_CPU_OMP_THREADS_BIND for vLLM's CPU ranks: the replica's threads split between them (vLLM's own "auto"
    wants a NUMA node per rank, and this machine has one); wrapped where there are fewer cores than ranks."""
    from wbrag_ray.generation.parallel import cpu_rank_env

    assert cpu_rank_env(vllm(tensor_parallel_size=2, threads=2), [0, 1]) == {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    assert cpu_rank_env(vllm(tensor_parallel_size=3, threads=2), [0, 1]) == {"VLLM_CPU_OMP_THREADS_BIND": "0|1|0"}
    assert cpu_rank_env(vllm(tensor_parallel_size=2, num_cpus=8), list(range(4, 20))) == {
        "VLLM_CPU_OMP_THREADS_BIND": "4,5,6,7|8,9,10,11"}
    assert cpu_rank_env(vllm(), [0, 1]) == {} and cpu_rank_env(vllm(num_gpus=2), [0, 1]) == {}


def test_a_sharded_replicas_service_actor_asks_for_no_gpu_and_an_unsharded_one_for_its_own():
    from wbrag_ray.ray_runtime import LIGHT_CPUS

    assert GenerateStage(vllm(num_gpus=4, num_cpus=2)).resources.num_gpus == 0.0  # the placement group holds them
    # and the engine's CPU: the actor only forwards batches
    assert GenerateStage(vllm(num_gpus=4, num_cpus=2)).resources.num_cpus == LIGHT_CPUS
    assert GenerateStage(vllm(tensor_parallel_size=2, num_cpus=2)).resources.num_cpus == LIGHT_CPUS
    assert GenerateStage(vllm(num_gpus=1)).resources.num_gpus == 1.0
    assert GenerateStage(GeneratorConfig(num_gpus=0.5)).resources.num_gpus == 0.5


def test_a_service_actor_waits_for_its_replicas_placement_group_as_long_as_the_driver_says(monkeypatch):
    """ray.pending_timeout_s reaches the generator service's actor with its stage: `RemoteEngine` waits that long."""
    from wbrag_ray.placement import PENDING_TIMEOUT_S

    monkeypatch.setitem(PENDING_TIMEOUT_S, "seconds", 42.0)
    stage = GenerateStage(vllm(num_gpus=2))
    monkeypatch.setitem(PENDING_TIMEOUT_S, "seconds", 1800.0)  # the actor's own module, before setup
    monkeypatch.setattr("wbrag_ray.generation.stage.make_generator", lambda config: type(
        "Loaded", (), {"setup": lambda self: None})())
    stage.setup()
    assert PENDING_TIMEOUT_S["seconds"] == 42.0


def test_the_engine_gets_the_parallel_sizes_and_its_executor(tmp_path):
    """vLLM reads tp / pp from the engine arguments; a replica larger than one GPU runs its workers with the ray
    executor (one per bundle of its placement group), a tensor-parallel one on CPUs with the multiprocessing one."""
    gen = VLLMGenerator(vllm(model=str(tmp_path), num_gpus=4, pipeline_parallel_size=2, concurrency=3,
                             pipeline_across_nodes=True))
    kwargs = gen.engine_kwargs()
    assert (kwargs["tensor_parallel_size"], kwargs["pipeline_parallel_size"]) == (2, 2)
    assert kwargs["distributed_executor_backend"] == "ray"
    cpu = VLLMGenerator(vllm(model=str(tmp_path), tensor_parallel_size=2, num_cpus=1, threads=2))
    assert cpu.engine_kwargs()["distributed_executor_backend"] == "mp"


# --- the cluster check ------------------------------------------------------------------------------------


def nodes(*gpus: float) -> list[dict[str, float]]:
    return [{"CPU": 16.0, "GPU": g} if g else {"CPU": 16.0} for g in gpus]


def test_a_cluster_without_a_node_of_tensor_parallel_size_gpus_is_refused_saying_what_to_change():
    why = placement_refusal(vllm(num_gpus=4), nodes(0, 1, 1, 1, 1))
    assert why == ("generator: tensor_parallel_size=4 x pipeline_parallel_size=1 needs 4 GPUs on one node, and no "
                   "node of the cluster has that many (4 nodes x 1 GPU, 1 node x 0 GPUs); lower "
                   "tensor_parallel_size and raise pipeline_parallel_size with pipeline_across_nodes: true "
                   "(pipeline stages may then sit on different nodes), or add nodes with 4 GPUs")
    # the same GPUs as four pipeline stages of one GPU fit where the stages may cross nodes, and only then
    stages = {"num_gpus": 4, "tensor_parallel_size": 1, "pipeline_parallel_size": 4}
    assert placement_refusal(vllm(**stages, pipeline_across_nodes=True), nodes(0, 1, 1, 1, 1)) is None
    assert "set pipeline_across_nodes: true (its 4 stages on different nodes, 1 GPUs of one node each)" in \
        placement_refusal(vllm(**stages), nodes(0, 1, 1, 1, 1))
    one = placement_refusal(vllm(num_gpus=1), nodes(0), key="zerorag.qa_generator")
    assert one.startswith("zerorag.qa_generator: num_gpus=1 needs 1 GPU on one node") and "num_gpus: 0" in one


def test_a_cluster_with_fewer_gpus_than_the_replicas_need_is_refused_with_the_concurrency_that_fits():
    # tp=4 x pp=2 on one node each (the default): two 8-GPU nodes and a 4-GPU one hold 2 replicas
    assert placement_refusal(vllm(num_gpus=8, pipeline_parallel_size=2, concurrency=2), nodes(8, 8, 4)) is None
    why = placement_refusal(vllm(num_gpus=8, pipeline_parallel_size=2, concurrency=3), nodes(8, 8, 4))
    assert why.startswith("generator: concurrency=3 replicas of tensor_parallel_size=4 x pipeline_parallel_size=2 "
                          "need 3 groups of 8 GPUs on one node each (24 GPUs), and the cluster holds 2") and \
        why.endswith("; set concurrency: 2")
    assert "needs 8 GPUs on one node" in placement_refusal(vllm(num_gpus=8, pipeline_parallel_size=2), nodes(4, 4))
    # with pipeline_across_nodes, 2 replicas of 4 x 2: four groups of 4 GPUs; the same nodes hold 5
    across = {"num_gpus": 8, "pipeline_parallel_size": 2, "pipeline_across_nodes": True}
    assert placement_refusal(vllm(**across), nodes(4, 4)) is None
    assert placement_refusal(vllm(**across, concurrency=2), nodes(8, 8, 4)) is None
    why = placement_refusal(vllm(**across, concurrency=3), nodes(8, 8, 4))
    assert why == ("generator: concurrency=3 replicas of tensor_parallel_size=4 x pipeline_parallel_size=2 need 6 "
                   "groups of 4 GPUs on one node each (24 GPUs), and the cluster holds 5 (2 nodes x 8 GPUs, 1 node "
                   "x 4 GPUs); set concurrency: 2")
    # a group never straddles two nodes: two 6-GPU nodes hold two groups of 4, not three
    assert "holds 2" in placement_refusal(vllm(num_gpus=4, concurrency=3), nodes(6, 6))
    # nor does a group of tp=4 with pipeline_across_nodes: 3 x 2 GPUs hold no stage of 4
    assert "needs 4 GPUs on one node" in placement_refusal(vllm(**across), nodes(2, 2, 2, 2))
    # fractional replicas pack by whole counts per node
    assert placement_refusal(vllm(num_gpus=0.5, concurrency=4), nodes(1, 1)) is None
    assert "set concurrency: 4" in placement_refusal(vllm(num_gpus=0.5, concurrency=5), nodes(1, 1))


def test_the_cluster_check_asks_nothing_of_cpu_and_http_generators():
    assert placement_refusal(vllm(concurrency=64), nodes(0)) is None
    assert placement_refusal(vllm(tensor_parallel_size=2), nodes(0)) is None
    assert placement_refusal(GeneratorConfig(backend="openai", model="m", num_gpus=1), nodes(0)) is None


# --- the placement group, on a local cluster with declared GPUs -------------------------------------------


class PlacementProbe:
    """In place of vLLM's engine host (`vllm._EngineHost`): what the process sees of the placement group it was
    started in, and where workers land that are started the way vLLM's ray executor starts them (one per GPU
    bundle of the current group, by bundle index)."""

    def __init__(self, config: GeneratorConfig):
        self.config = config

    def ready(self) -> bool:
        return True

    def call(self, config: GeneratorConfig, method: str, *args):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pg = ray.util.get_current_placement_group()
        gpu_bundles = [i for i, b in enumerate(pg.bundle_specs) if b.get("GPU")]
        share = float(os.environ.get("VLLM_RAY_PER_WORKER_GPUS", "1"))  # what vLLM's ray executor asks a worker for

        @ray.remote(num_cpus=0, num_gpus=share)
        def worker():
            return ray.get_runtime_context().get_node_id()

        workers = [worker.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=i, placement_group_capture_child_tasks=True)).remote()
            for i in gpu_bundles]
        return {"method": method, "args": list(args), "max_new_tokens": config.max_new_tokens, "worker_share": share,
                "pg": pg.id.hex(), "own_gpus": ray.get_gpu_ids(), "node": ray.get_runtime_context().get_node_id(),
                "worker_nodes": ray.get(workers)}


def test_a_killed_actors_engine_group_stays_held_until_its_service_removes_it(ray_cluster):
    """Ray removes a placement group only once its creator and the creator's job have ended: a service actor killed
    with its sharded engine (here CPU ranks, a probe in place of vLLM) would hold the group's CPUs until the driver
    exits. `release_engine_groups`, which `StageService.close` calls, removes it."""
    import time

    import ray
    from ray.util import placement_group_table

    from wbrag_ray.generation.parallel import RemoteEngine, release_engine_groups

    @ray.remote(num_cpus=0)
    class Owner:
        def __init__(self):
            self.engine = RemoteEngine(vllm(tensor_parallel_size=2, num_cpus=0.5), PlacementProbe, timeout_s=60)

        def group(self) -> str:
            return self.engine.pg.id.hex()

    owner = Owner.remote()
    group = ray.get(owner.group.remote())
    assert placement_group_table()[group]["strategy"] == "STRICT_PACK"
    ray.kill(owner)
    time.sleep(1)
    assert placement_group_table()[group]["state"] == "CREATED"  # Ray's own lifetime: the job's
    assert release_engine_groups([owner._actor_id.hex()]) == 1
    assert placement_group_table()[group]["state"] == "REMOVED"


def main() -> None:
    """Two worker nodes of 2 declared GPUs and a GPU-less head: the cluster check on the alive nodes, and the
    placement group a service's sharded replica takes, for tensor parallel (STRICT_PACK) and pipeline parallel
    (PACK) replicas."""
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.placement_group import placement_group_table

    from wbrag_ray.generation.parallel import RemoteEngine
    from wbrag_ray.placement import check_placement

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    for _ in range(2):
        cluster.add_node(num_cpus=2, num_gpus=2)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    out: dict = {}
    refusals = {"tp4": vllm(num_gpus=4), "tp2pp2x2": vllm(num_gpus=4, tensor_parallel_size=2, pipeline_parallel_size=2,
                                                          concurrency=2, pipeline_across_nodes=True)}
    for name, config in refusals.items():
        try:
            check_placement(config)
            out[name] = None
        except ConfigError as exc:
            out[name] = str(exc)
    from wbrag_ray.config import TrainerConfig
    from wbrag_ray.placement import check_workers as check_training

    for name, check in {"qa_writer": lambda: check_placement(refusals["tp4"], "zerorag.qa_generator"),
                        "training": lambda: check_training(TrainerConfig(num_workers=3, num_gpus=2), "zerorag.tune")
                        }.items():
        try:
            check()
            out[name] = None
        except ConfigError as exc:
            out[name] = str(exc)
    # a GPU worker whose torch sees no CUDA device (here: every one) is refused; the driver, granted none, runs on CPU
    from wbrag_ray.models.hardware import pick_device

    @ray.remote(num_gpus=1, num_cpus=0)
    def device_in_a_gpu_worker():
        try:
            return pick_device(1)
        except ConfigError as exc:
            return str(exc)

    out["gpu_worker_device"] = ray.get(device_in_a_gpu_worker.remote())
    out["driver_device"] = pick_device(1)
    os.environ["WBRAG_AUTOSCALING"] = "1"
    check_placement(refusals["tp4"])
    check_training(TrainerConfig(num_workers=3, num_gpus=2), "zerorag.tune")
    out["autoscaling_skips"] = True
    del os.environ["WBRAG_AUTOSCALING"]
    for name, config in {"tp2": vllm(num_gpus=2, max_new_tokens=7),
                         "tp2pp2": vllm(num_gpus=4, tensor_parallel_size=2, pipeline_parallel_size=2,
                                        pipeline_across_nodes=True)}.items():
        check_placement(config)
        engine = RemoteEngine(config, PlacementProbe)
        seen = engine.call(config, "generate", ["prompt"])
        table = placement_group_table(engine.pg)
        seen.update(strategy=table["strategy"], bundle_nodes=sorted(table["bundles_to_node_id"].values()),
                    is_engine_pg=seen["pg"] == engine.pg.id.hex())
        engine.close()
        seen["state_after_close"] = placement_group_table(engine.pg)["state"]
        out[name] = seen
    # retrieval's shares beside a tensor-parallel replica whose GPUs ask for 0.9 each (gpu_layout): the workers get
    # their share through VLLM_RAY_PER_WORKER_GPUS, and a search actor's 0.05 starts on the replica's node (the
    # best fit), not on the idle node, whose two whole GPUs stay free for another replica
    from wbrag_ray.placement.gpus import beside_generator

    shared = vllm(num_gpus=2, gpu_share=0.9)
    engine = RemoteEngine(shared, PlacementProbe)
    seen = engine.call(shared, "generate", ["prompt"])

    @ray.remote(num_cpus=0, num_gpus=0.05)
    class Search:
        def node(self):
            return ray.get_runtime_context().get_node_id()

    search = Search.options(**beside_generator(0.05)).remote()
    seen.update(bundles=placement_group_table(engine.pg)["bundles"], search_node=ray.get(search.node.remote()))
    ray.kill(search)
    engine.close()
    out["tp2_shared"] = seen
    try:  # a replica no node can hold: refused once the wait for its placement group is over
        RemoteEngine(vllm(num_gpus=4), PlacementProbe, timeout_s=3)
        out["unplaceable"] = None
    except ConfigError as exc:
        out["unplaceable"] = str(exc)
    # by default the wait is ray.pending_timeout_s (the driver's, or the one a service's stage carries to its actor)
    from wbrag_ray.placement import PENDING_TIMEOUT_S

    PENDING_TIMEOUT_S["seconds"] = 2
    try:
        # 2 x 2 without pipeline_across_nodes: all 4 GPUs on one node (STRICT_PACK), and nodes hold 2
        RemoteEngine(vllm(num_gpus=4, tensor_parallel_size=2, pipeline_parallel_size=2), PlacementProbe)
        out["unplaceable_pp"] = None
    except ConfigError as exc:
        out["unplaceable_pp"] = str(exc)
    print(json.dumps(out))
    ray.shutdown()
    cluster.shutdown()


def test_a_sharded_replica_runs_inside_its_placement_group_and_the_cluster_check_reads_the_alive_nodes():
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "WBRAG_AUTOSCALING")}
    out = subprocess.run([sys.executable, "-m", "tests.generation.test_parallel_sizes"], capture_output=True,
                         text=True, timeout=300, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = last_json_line(out.stdout)
    # the alive nodes: no node holds 4 GPUs; two replicas of 2 x 2 need 4 groups of 2, the nodes hold 2
    assert "no node of the cluster has that many (2 nodes x 2 GPUs, 1 node x 0 GPUs)" in seen["tp4"]
    assert "WBRAG_AUTOSCALING=1" in seen["tp4"]  # the way out on a cluster that adds nodes unannounced
    assert "the cluster holds 2" in seen["tp2pp2x2"] and "set concurrency: 1" in seen["tp2pp2x2"]
    # the same reading and the same way out for another generator role and for Ray Train's workers
    assert seen["qa_writer"].startswith("zerorag.qa_generator") and "WBRAG_AUTOSCALING=1" in seen["qa_writer"]
    assert seen["training"].startswith("zerorag.tune.trainer: 3 training workers") and "(room for 2)" in \
        seen["training"] and "WBRAG_AUTOSCALING=1" in seen["training"]
    assert seen["autoscaling_skips"]
    assert seen["gpu_worker_device"].startswith("Ray granted this worker GPU ") and "sees no CUDA device" in \
        seen["gpu_worker_device"] and seen["driver_device"] == "cpu"
    for name, nodes_used in (("tp2", 1), ("tp2pp2", 2)):
        replica = seen[name]
        # the engine's process runs in the replica's group, holds no GPU itself, on one of the group's nodes
        assert replica["is_engine_pg"] and replica["own_gpus"] == [] and replica["node"] in replica["bundle_nodes"]
        # one worker per GPU bundle, where the bundles are: tensor parallel on one node, stages on two
        assert sorted(replica["worker_nodes"]) == replica["bundle_nodes"]
        assert len(set(replica["bundle_nodes"])) == nodes_used
        assert replica["state_after_close"] == "REMOVED"  # the GPUs are free again
    assert seen["tp2"]["strategy"] == "STRICT_PACK" and seen["tp2pp2"]["strategy"] == "PACK"
    # issue 66: a replica of GPUs shared with retrieval, and retrieval placed where it breaks no free GPU group
    shared = seen["tp2_shared"]
    assert shared["worker_share"] == 0.9 and seen["tp2"]["worker_share"] == 1.0
    assert all(bundle.get("GPU") == 0.9 for bundle in shared["bundles"].values())
    assert set(shared["worker_nodes"]) == {shared["search_node"]}
    # the pass's call arrives with its own settings
    assert seen["tp2"]["method"] == "generate" and seen["tp2"]["args"] == [["prompt"]]
    assert seen["tp2"]["max_new_tokens"] == 7
    assert seen["unplaceable"].startswith(
        "generator: no room for an engine replica of tensor_parallel_size=4 x pipeline_parallel_size=1 after 3 s "
        "(ray.pending_timeout_s): its placement group needs 4 bundles of {'GPU': 1.0, 'CPU': 1.0} (4 GPU + 4 CPU) "
        "on one node (STRICT_PACK), and the cluster has free [")
    # pipeline stages stay on one node unless the config lets them cross; the wait is the setting's (2 s here)
    assert "tensor_parallel_size=2 x pipeline_parallel_size=2 after 2 s (ray.pending_timeout_s)" in \
        seen["unplaceable_pp"] and "(4 GPU + 4 CPU) on one node (STRICT_PACK)" in seen["unplaceable_pp"]
    assert "2 GPU" in seen["unplaceable_pp"].split("free [")[1]  # the free GPUs of a node, named


if __name__ == "__main__":
    main()
