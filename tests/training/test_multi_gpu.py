"""Multi-GPU training by construction: the rule that gives each Ray Train worker its own GPUs, the device of the
collectives, and FSDP.

No GPU is here, so the device rule is tested as the pure function it is, for the paper configs' shapes, with
the GPU inventory simulated (the GPU ids Ray assigns and the CUDA_VISIBLE_DEVICES Ray Train sets: every training
GPU of the node, in Ray's order). FSDP runs for real: torch's FSDP2 on two CPU workers of Ray Train (gloo), the
noise-tolerant tuning of the tiny SmolLM2-shaped generator, against the same training under DDP.
"""

from __future__ import annotations

import numpy as np
import pytest

from wbrag_ray.config import ConfigError, GeneratorConfig, TrainerConfig, TuneConfig
from wbrag_ray.training.placement import collective_device, device_rule, own_gpus

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


def test_each_worker_holds_a_contiguous_shard_and_draws_its_part_of_every_batch():
    from wbrag_ray.training.shards import local_batch, shard_bounds

    assert shard_bounds(10, 3) == [3, 6] and shard_bounds(16, 1) == []
    sizes = np.diff([0, *shard_bounds(100_003, 8), 100_003])
    assert sizes.sum() == 100_003 and sizes.max() - sizes.min() <= 1  # every example in one shard, none dropped
    assert [local_batch(64, 8, r) for r in range(8)] == [8] * 8
    assert [local_batch(10, 4, r) for r in range(4)] == [3, 3, 2, 2]
