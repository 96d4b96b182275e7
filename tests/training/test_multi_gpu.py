"""Multi-GPU training by construction: the rule that gives each Ray Train worker its own GPUs, the device of the
collectives, and FSDP.

No GPU is here, so the device rule, the placement and FSDP's device mesh are tested as the pure functions they
are, for the shapes people run (1 x 1, 1 x 2, 1 x 8 and 4 x 8 GPUs), with the GPU inventory simulated (the GPU ids
Ray assigns and the CUDA_VISIBLE_DEVICES Ray Train sets: every training GPU of the node, in Ray's order; the node
of each rank). FSDP runs for real: torch's FSDP2 on two CPU workers of Ray Train (gloo), the noise-tolerant tuning
of the tiny SmolLM2-shaped generator, against the same training under DDP; and hybrid sharding's 2-D mesh on four
CPU ranks (two simulated nodes of two: the node is only the mesh's row), against the same step sharded over all.
"""

from __future__ import annotations

import os
import socket

import numpy as np
import pytest

from wbrag_ray.config import ConfigError, GeneratorConfig, TrainerConfig, TuneConfig, load_config
from wbrag_ray.training.placement import (
    DeviceRule,
    collective_device,
    device_rule,
    fsdp_mesh_shape,
    own_gpus,
    placement_of,
    process_group_timeout_s,
)

GIB = 1 << 30
H100 = 80 * GIB  # bytes of one GPU
NODE = "0,1,2,3,4,5,6,7"  # a worker's CUDA_VISIBLE_DEVICES on an 8-GPU node: all the training's GPUs there


def rules(assigned_per_worker: list[list[int]], model_gib: float, strategy: str = "ddp"):
    """Each worker's rule on one simulated 8-GPU node, from the GPU ids Ray assigned it."""
    world = len(assigned_per_worker)
    return [device_rule(own_gpus(ids, NODE), 8, H100, model_gib * GIB, strategy, world, "zerorag.tune")
            for ids in assigned_per_worker]


def test_eight_one_gpu_workers_on_a_node_each_use_their_own_gpu_and_spread_nothing():
    """The Zero-RAG config's LM pruner: 8 workers x 1 GPU on one node, each seeing all 8 (simulated inventory)."""
    got = rules([[g] for g in range(8)], model_gib=2.5)  # Llama-3.2-1B in bf16
    assert [r.device for r in got] == list(range(8))  # one rank per GPU, none shared
    assert all(r.spread == () and r.max_memory is None for r in got)


def test_two_workers_of_four_gpus_spread_only_over_their_own_with_a_memory_cap_on_each():
    got = rules([[4, 5, 6, 7], [0, 1, 2, 3]], model_gib=140)  # a 70B in bf16 as a layer split (ddp)
    assert got[0].device == 4 and got[0].spread == (4, 5, 6, 7)
    assert got[1].device == 0 and got[1].spread == (0, 1, 2, 3)
    assert set(got[0].max_memory) == {4, 5, 6, 7} and set(got[1].max_memory) == {0, 1, 2, 3}
    assert all(v == int(H100 * 0.85) for r in got for v in r.max_memory.values())


def test_ray_order_of_visible_devices_maps_ids_to_local_indices():
    # Ray lists the node's training GPUs in its own order: the local index is the position there, not the id
    assert own_gpus(["6"], "6,7,2,3") == [0] and own_gpus([3, 2], "6,7,2,3") == [2, 3]
    assert own_gpus([1], None) == [1]  # nothing hidden
    with pytest.raises(RuntimeError, match="not in CUDA_VISIBLE_DEVICES"):
        own_gpus(["5"], "6,7")


def test_one_worker_of_eight_gpus_and_models_that_do_not_fit_are_refused_with_the_setting():
    (one,) = rules([list(range(8))], model_gib=140)
    assert one.device == 0 and one.spread == tuple(range(8))
    with pytest.raises(ConfigError, match=r"does not fit .* 1 GPU of 80 GiB.*strategy: fsdp"):
        rules([[0]], model_gib=140)
    # FSDP: each of 8 ranks holds an eighth of the 70B; one GPU per rank, never several
    assert [r.device for r in rules([[g] for g in range(8)], 140, "fsdp")] == list(range(8))
    with pytest.raises(ConfigError, match="raise zerorag.tune.trainer.num_workers"):
        rules([[0], [1]], model_gib=140, strategy="fsdp")
    with pytest.raises(ConfigError, match="one worker per GPU"):
        rules([[0, 1]], model_gib=1, strategy="fsdp")
    with pytest.raises(ValueError, match="num_workers: 8 and num_gpus: 1"):
        TrainerConfig(num_workers=2, num_gpus=4, strategy="fsdp")


def test_fsdp_with_one_worker_on_a_gpu_trains_as_ddp_with_the_model_on_that_gpu():
    """`num_workers: auto` gives 1 on a one-GPU node (simulated inventory: Ray assigned GPU 0 of 1): under fsdp the
    model stayed where it loaded (the CPU) while the batch went to cuda:0. One worker has nothing to shard over:
    it is ddp, the model placed on its GPU; two workers still shard."""
    import torch

    rule = device_rule(own_gpus(["0"], "0"), 1, H100, 16 * GIB, "fsdp", 1, "zerorag.tune")  # an 8B in bf16
    one = placement_of(rule, torch.bfloat16, "fsdp", 0, (1, 1))
    assert one == placement_of(rule, torch.bfloat16, "ddp", 0, (1, 1))
    assert not one.fsdp and not one.meta and one.strategy == "ddp"
    assert one.model_device == torch.device("cuda", 0)  # where place() moves the model: the batch's device
    two = placement_of(DeviceRule(1), torch.bfloat16, "fsdp", 1, (1, 2))
    assert two.fsdp and two.meta and two.model_device is None and two.strategy == "fsdp"


def test_a_fractional_trainer_gpu_is_refused_before_any_work_naming_the_key():
    """Two ranks Ray packs onto one GPU (num_gpus 0.5) make NCCL fail at the first collective."""
    for value, fix in (("0.5", "num_gpus: 1"), ("1.5", "num_gpus: 2")):
        with pytest.raises(ConfigError, match=rf"zerorag.tune.trainer.num_gpus' = {value} .*whole GPUs.*{fix}"):
            load_config(None, [f"zerorag.tune.trainer.num_gpus={value}"])
    assert TrainerConfig(num_gpus=2).num_gpus == 2 and TrainerConfig(num_gpus=0).num_gpus == 0


def test_fsdp_is_hybrid_on_several_nodes_sharded_within_a_node():
    """FSDP's device mesh (replicas, shards) from each rank's node (simulated: Ray Train numbers ranks node by
    node) for 1 x 1, 1 x 2, 1 x 8 and 4 x 8 GPUs; uneven nodes, or nodes too small for the model, shard over all."""
    assert fsdp_mesh_shape([0]) == (1, 1)
    assert fsdp_mesh_shape([0, 0]) == (1, 2)
    assert fsdp_mesh_shape([0] * 8) == (1, 8)
    four_by_eight = [n for n in range(4) for _ in range(8)]
    assert fsdp_mesh_shape(four_by_eight) == (4, 8)
    assert fsdp_mesh_shape([0] * 8 + [1] * 4) == (1, 12)  # no grid
    assert fsdp_mesh_shape([0, 1, 0, 1]) == (1, 4)  # a node's ranks not contiguous
    assert fsdp_mesh_shape(four_by_eight, min_shards=16) == (1, 32)  # a node's 8 GPUs cannot hold the shards


def test_under_hybrid_fsdp_a_gpu_holds_a_nodes_share_of_the_model_not_the_worlds():
    """4 x 8 simulated H100s: a 70B (140 GiB in bf16) is 17.5 GiB a GPU over a node's 8, fits; a 600 GiB model
    fits 32 shards (19 GiB) but not 8 (75 GiB of 68): refused under hybrid, naming the nodes."""
    rank_rule = [device_rule(own_gpus([g], NODE), 8, H100, 140 * GIB, "fsdp", 8, "zerorag.tune", replicas=4)
                 for g in range(8)]
    assert [r.device for r in rank_rule] == list(range(8))
    with pytest.raises(ConfigError, match=r"does not fit .*use nodes of more GPUs .*8 workers of a node .*4 nodes"):
        device_rule([0], 8, H100, 600 * GIB, "fsdp", 8, "zerorag.tune", replicas=4)
    assert device_rule([0], 8, H100, 600 * GIB, "fsdp", 32, "zerorag.tune").device == 0  # flat over 32


def test_the_process_group_waits_for_the_model_to_load():
    """Worker 0 reads the whole 70B before the first collective: Ray Train's 1800 s default ended the training
    first. 'auto': the weights' bytes at 50 MB/s, at least 1800 s; an explicit setting is kept."""
    from wbrag_ray.training.workers import torch_config

    assert process_group_timeout_s("auto", 70.6e9 * 2) == 2824
    assert process_group_timeout_s("auto", 3e6) == process_group_timeout_s("auto", None) == 1800
    assert process_group_timeout_s(600, 70.6e9 * 2) == 600
    gpu = TrainerConfig(num_gpus=1, num_workers=32, strategy="fsdp")
    assert torch_config(gpu, "meta-llama/Llama-3.1-70B-Instruct").timeout_s == 2824  # bf16 on GPUs
    assert torch_config(gpu.model_copy(update={"timeout_s": 7200}), "meta-llama/Llama-3.1-70B-Instruct").timeout_s \
        == 7200
    assert load_config(None, ["zerorag.tune.trainer.timeout_s=3600"]).zerorag.tune.trainer.timeout_s == 3600


def test_a_collective_runs_on_the_process_groups_device():
    import torch

    cuda = torch.device("cuda", 3)  # only the device object: no GPU needed to build it
    assert collective_device("nccl", cuda) == cuda  # NCCL refuses CPU tensors
    assert collective_device("gloo", cuda) == torch.device("cpu")


def test_a_training_asking_for_gpus_fails_before_loading_where_torch_sees_none():
    from wbrag_ray.training.placement import worker_placement

    with pytest.raises(ConfigError, match=r"zerorag.tune's training worker 0 asks for 1 GPU \(zerorag.tune.trainer"
                       r".num_gpus\) but .* none .* set zerorag.tune.trainer.num_gpus: 0"):
        worker_placement(TrainerConfig(num_gpus=1), 0, 1, "zerorag.tune")


@pytest.mark.slow
def test_fsdp_on_two_cpu_workers_trains_as_ddp_does(tmp_path, ray_cluster, tiny):
    """torch FSDP2 (`fully_shard` per decoder layer, gradient checkpointing, rank 0's weights broadcast to a rank
    that built the model on the meta device) on two gloo workers: the same loss curve and adapter as DDP."""
    from safetensors.numpy import load_file

    from tests.training.test_lora import QUESTIONS
    from wbrag_ray.training.noise_tolerant import build_examples, tune_generator

    examples = build_examples(QUESTIONS, docs_per_format=2, seed=0)
    runs = {}
    for strategy in ("ddp", "fsdp"):
        config = TuneConfig(epochs=1, batch_size=4, max_length=96, learning_rate=1e-3, lora_dropout=0.0, threads=1,
                            trainer={"num_workers": 2, "num_cpus": 0.5, "strategy": strategy})
        out = tmp_path / strategy
        runs[strategy] = (tune_generator(examples, GeneratorConfig(model=tiny.generator, dtype="float32"), config,
                                         str(out)), load_file(str(out / "adapter_model.safetensors")))
    (ddp, ddp_weights), (fsdp, fsdp_weights) = runs["ddp"], runs["fsdp"]
    assert fsdp["steps"] == ddp["steps"] == 3 and fsdp["workers"] == 2
    assert (ddp["strategy"], fsdp["strategy"]) == ("ddp", "fsdp")
    np.testing.assert_allclose(fsdp["losses"], ddp["losses"], rtol=1e-4)
    assert ddp_weights.keys() == fsdp_weights.keys() and any("lora_B" in k for k in ddp_weights)
    for name in ddp_weights:  # the adapter trained: lora_B starts at zero
        np.testing.assert_allclose(fsdp_weights[name], ddp_weights[name], rtol=1e-3, atol=1e-6, err_msg=name)
    assert any(np.abs(w).max() > 0 for k, w in fsdp_weights.items() if "lora_B" in k)


@pytest.mark.slow
def test_fsdp_with_one_worker_trains_on_a_ray_train_cpu_worker_as_ddp(tmp_path, ray_cluster, tiny):
    """The one-worker fsdp case for real on a CPU worker of Ray Train (gloo): it trains, as ddp, and says so in the
    stats (on a GPU the same placement puts the model on the worker's GPU: the simulated test above)."""
    from wbrag_ray.config import LMPrunerConfig
    from wbrag_ray.training.lm_pruner import train_lm_pruner

    config = LMPrunerConfig(backbone=tiny.generator, batch_size=2, max_steps=2, max_length=24, threads=1,
                            trainer={"num_workers": 1, "strategy": "fsdp"})
    stats = train_lm_pruner(["a sentence", "another one", "a third", "the fourth"], [1.0, 0.0, 1.0, 0.0], config,
                            str(tmp_path / "pruner"), ["a sentence"])
    assert stats["strategy"] == "ddp" and stats["workers"] == 1 and stats["steps"] == 2
    assert all(np.isfinite(stats["losses"])) and len(stats["validation"]) == 1


def test_each_worker_holds_a_contiguous_shard_and_draws_its_part_of_every_batch():
    from wbrag_ray.training.workers import local_batch, shard_bounds

    assert shard_bounds(10, 3) == [3, 6] and shard_bounds(16, 1) == []
    sizes = np.diff([0, *shard_bounds(100_003, 8), 100_003])
    assert sizes.sum() == 100_003 and sizes.max() - sizes.min() <= 1  # every example in one shard, none dropped
    assert [local_batch(64, 8, r) for r in range(8)] == [8] * 8
    assert [local_batch(10, 4, r) for r in range(4)] == [3, 3, 2, 2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sharded_steps(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    """One rank (a spawned process): the same two LoRA steps sharded over all 4 ranks, then hybrid (2 simulated
    nodes x 2: replicated over the mesh's rows, sharded within one), then hybrid with a GPU worker's dtypes (frozen
    weights in bf16 under autocast, LoRA's in fp32: one FSDP group of two dtypes); rank 0 saves the losses, the
    gathered adapters and the dtypes."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from wbrag_ray.training.lora import apply_gradients, optimizer_of, trainable_state, with_lora, wrap

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results = {}
        for mesh, dtype in (((1, world), torch.float32), ((2, world // 2), torch.float32),
                            ((2, world // 2), torch.bfloat16)):
            place = placement_of(DeviceRule(None), dtype, "fsdp", rank, mesh)
            torch.manual_seed(0)  # LoRA's A matrices: rank 0's are broadcast
            model = with_lora(place.load(AutoModelForCausalLM, model_dir), TuneConfig(lora_dropout=0.0), "CAUSAL_LM")
            module, model = wrap(model, place, world)
            params, optimizer, scaler = optimizer_of(model, place, 1e-2)
            ids = torch.randint(3, 1000, (2, 16), generator=torch.Generator().manual_seed(rank))  # this rank's part
            losses = []
            for _ in range(2):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                    loss = module(input_ids=ids, labels=ids).loss.float() / world  # this rank's share of the mean
                total = loss.detach().clone()
                dist.all_reduce(total)
                apply_gradients(loss, world, params, optimizer, scaler)
                losses.append(float(total))
            dtypes = {(p.requires_grad, str(p.dtype)) for p in model.parameters()}
            results[mesh, str(dtype)] = (losses, trainable_state(model, optimizer)[0], dtypes)
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_hybrid_fsdp_on_a_2d_mesh_trains_as_fsdp_over_all_ranks(tmp_path, tiny):
    """FSDP2's hybrid sharding (`fully_shard` on a 2-D DeviceMesh: replicate x shard) on four gloo CPU ranks
    spawned by torch (two simulated nodes of two ranks: the node is the mesh's row, no second machine): rank 0's
    weights broadcast into both meshes, two steps with gradient clipping, the adapter gathered whole; the same
    losses and adapter as sharding over all four; and with bf16 frozen weights beside fp32 LoRA ones."""
    import torch
    import torch.multiprocessing as mp

    out = tmp_path / "results.pt"
    mp.spawn(_sharded_steps, args=(4, _free_port(), tiny.generator, str(out)), nprocs=4, join=True)
    results = torch.load(out, weights_only=False)
    (flat_losses, flat, _), (hybrid_losses, hybrid, _) = results[(1, 4), "torch.float32"], results[(2, 2), "torch.float32"]
    np.testing.assert_allclose(hybrid_losses, flat_losses, rtol=1e-5)
    assert flat_losses[1] < flat_losses[0]  # the step trained
    assert flat.keys() == hybrid.keys() and any("lora_B" in k for k in flat)
    # Adam scales each weight's step by its gradient's size: where a gradient is near zero, the reductions' other
    # order moves a weight by a small part of one step (measured: 2.3e-5 at most, a step being lr = 1e-2)
    for name in flat:
        torch.testing.assert_close(hybrid[name], flat[name], rtol=0, atol=1e-4, msg=name)
    assert any(float(w.abs().max()) > 0 for k, w in hybrid.items() if "lora_B" in k)
    # a GPU worker's dtypes: frozen bf16 and trained fp32 weights sharded together, the step as in fp32 up to bf16
    bf16_losses, bf16, dtypes = results[(2, 2), "torch.bfloat16"]
    assert dtypes == {(False, "torch.bfloat16"), (True, "torch.float32")}
    np.testing.assert_allclose(bf16_losses, hybrid_losses, rtol=0.02)
    assert all(w.dtype == torch.float32 for k, w in bf16.items() if "lora_" in k)
