"""The plan, second pass (issue 67): what it assumes of the data measured on the config's own data (the utility
gate's keep rate with its Wilson interval, the distiller's prompt kinds timed), and on GPUs what a GPU run pays:
training tokens at the rows' padded lengths, collectives over the links they cross, engine starts and model loads,
the KV cache a decode step reads, GPU-hours only while GPUs are held, no k-means where none runs, the pruner's
own input, FLARE's look-ahead, the embedder's dimension, the GPU's memory from --gpu."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from wbrag_ray.cli import main
from wbrag_ray.config import load_config
from wbrag_ray.models.accelerators import ACCELERATORS
from wbrag_ray.plan import Cluster, make_plan
from wbrag_ray.plan.accelerators import (
    INTERCONNECTS,
    collective_seconds,
    generation_seconds,
    training_communication,
)
from wbrag_ray.plan.calibrate import wilson

ROOT = Path(__file__).resolve().parents[1]
ZERO_RAG = ROOT / "jobs" / "configs" / "paper_zero_rag.yaml"
WRITEBACK = ROOT / "jobs" / "configs" / "paper_writeback.yaml"
WB_DEMO = ROOT / "jobs" / "configs" / "writeback_demo.yaml"
WIKI = 21_000_000


@pytest.fixture(autouse=True)
def no_cache(tmp_path, monkeypatch):
    """An empty calibration cache: what this machine calibrated before stays out of the test."""
    monkeypatch.setenv("WBRAG_RATES_CACHE", str(tmp_path / "rates.json"))


def stage(plan, name):
    return next(s for s in plan.stages if s.name == name)


def four_by_eight():
    return Cluster.uniform(4, 96, 8, 1024, 80, "stated")


# --- what the plan assumes of the data -------------------------------------------------------------------------

def test_the_wilson_interval_of_a_keep_rate():
    # the textbook values: 0 of 10 -> [0, 0.2775], 5 of 10 -> [0.2366, 0.7634]
    assert wilson(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert wilson(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    lo, hi = wilson(14, 80)
    assert lo < 14 / 80 < hi and 0 < lo and hi < 1


def _writeback_record(config, keep=(14, 80)):
    """A write-back calibration record of the demo config's training set, on the hardware its generator would use
    (the shape `calibrate.writeback_record` writes; its figures stated here)."""
    from wbrag_ray.models.hardware import resolved_dtype_name, threads_of
    from wbrag_ray.plan.calibrate import hardware

    g = config.generator
    point = {"calls": 14, "seconds": 21.0, "seconds_per_call": 1.5, "prompt_tokens": 300.0, "generated_tokens": 40.0,
             "new_tokens": 96}
    return {"role": "writeback", "model": g.model, "backend": g.backend, "train": config.writeback.train,
            "top_k": config.retrieval.top_k, "metric": "acc", "rag_method": "naive", "questions": keep[1],
            "kept": keep[0], "keep_rate": keep[0] / keep[1], "keep_interval": list(wilson(*keep)),
            "retained_docs": 2.0, "passages_searched": 100, "corpus_passages": 100,
            "points": [{**point, "shape": "document gate", "seconds_per_call": 0.4},
                       {**point, "shape": "extract"}, {**point, "shape": "rewrite", "seconds_per_call": 1.0}],
            "hardware": hardware("cpu", resolved_dtype_name(g.dtype, 0), threads_of(g.num_cpus, g.threads))}


def test_the_write_back_plan_takes_the_keep_rate_and_distiller_calls_measured_on_its_own_data():
    config = load_config(WB_DEMO)
    cluster = Cluster.uniform(1, 2, 0, 8, 80, "stated")
    assumed = make_plan(config, cluster)
    wb = stage(assumed, "write-back training")
    assert "23.3%" in wb.work and "the demo's [writeback_selection], assumed" in wb.work
    assert any("keep rate is the demo's 23.3%" in w and "--calibrate" in w for w in assumed.warnings)
    from wbrag_ray.plan import format_plan

    assert "generated tokens: not measured for this config" in format_plan(assumed)
    measured = make_plan(config, cluster, records=[_writeback_record(config)])
    wb = stage(measured, "write-back training")
    lo, hi = wilson(14, 80)
    assert f"17.5% the utility gate keeps (14 of 80 sampled, 95% interval {lo:.0%}-{hi:.0%} [calibrated])" in wb.work
    assert "extract from 2 retained documents" in wb.work
    # 30 questions x 17.5% = 5 kept: the distiller's calls at their measured seconds, not an answer call scaled
    assert "extract: 5 calls x 1.5 s (300 prompt + 40 generated tokens a call, measured)" in wb.how
    assert "rewrite: 5 calls x 1 s" in wb.how
    assert "document gate: 26 calls x 0.4 s" in wb.how  # 5 documents of each of the 5.25 kept, each alone
    assert not any("keep rate is the demo's" in w for w in measured.warnings)
    assert any("kept 14 of 80 sampled training questions (17.5%, 95% Wilson interval" in c for c in measured.calibrated)
    # a record of another training set is not this config's
    other = {**_writeback_record(config), "train": "elsewhere/train.jsonl"}
    assert "the demo's" in stage(make_plan(config, cluster, records=[other]), "write-back training").work


def test_the_paper_write_back_plan_uses_the_papers_keep_rate_and_lands_near_its_half_hour():
    config = load_config(WRITEBACK)
    plan = make_plan(config, Cluster.uniform(1, 64, 2, 512, 141, "stated"), passages=WIKI, gpu="H200")
    assert plan.places, plan.problems
    wb = stage(plan, "write-back training")
    assert "15.5% the utility gate keeps (the paper's NQ figure [writeback_selection_nq]" in wb.work
    assert any("the paper states about 220,000 generator calls" in n for n in wb.notes)
    assert 0.35 * 3600 <= wb.seconds <= 0.65 * 3600, wb.seconds  # the paper: 0.5 h on two H200 GPUs


# --- what a GPU run pays --------------------------------------------------------------------------------------

def test_the_70b_tuning_counts_padded_tokens_communication_and_load_apart():
    config = load_config(ZERO_RAG)
    plan = make_plan(config, four_by_eight(), passages=WIKI)
    tune = stage(plan, "tuning: LoRA training")
    t = config.zerorag.tune
    steps = math.ceil(3 * 78_785 / t.batch_size)
    tokens = int(tune.work.rsplit(": ", 1)[1].split(" tokens")[0].replace(",", ""))
    assert tokens < 0.6 * steps * t.batch_size * t.max_length  # not max_length a row
    assert "rows of " in tune.work and "(20 documents)" in tune.work and "a step at its longest" in tune.work
    assert "communication " in tune.how and "load " in tune.how and "compute " in tune.how
    assert "over 8 ranks' NVLink 4" in tune.how and "hybrid" in tune.how
    [parts] = [n for n in tune.notes if n.startswith("time by part: ")]
    assert "compute" in parts and "communication" in parts and "load" in parts


def test_collectives_cross_nvlink_within_a_node_and_the_network_across_nodes():
    h100, ndr = ACCELERATORS["H100"], INTERCONNECTS["ib-ndr-400"]
    # an all-gather of 141.2 GB over 8 ranks of a node: 7/8 of it through each rank's NVLink at 70% of 450 GB/s
    assert collective_seconds("all-gather", 141.2e9, 8, 450) == pytest.approx(141.2e9 * 7 / 8 / 315e9 + 20e-6)
    assert collective_seconds("all-reduce", 1e9, 4, 450) == pytest.approx(2 * 1e9 * 3 / 4 / 315e9 + 20e-6)
    hybrid, _ = training_communication(h100, ndr, 70.6e9, 1e7, 32, 8, "fsdp", 80, hybrid=True)
    flat, how = training_communication(h100, ndr, 70.6e9, 1e7, 32, 8, "fsdp", 80, hybrid=False)
    assert "ib-ndr-400 (the group spans 4 nodes)" in how
    assert flat > 5 * hybrid  # 50 GB/s a GPU across nodes against NVLink's 450
    slow, _ = training_communication(h100, INTERCONNECTS["efa-400"], 70.6e9, 1e7, 32, 8, "fsdp", 80, hybrid=False)
    assert slow > 7 * flat
    ddp, how = training_communication(h100, ndr, 70.6e9, 1e7, 32, 8, "ddp", 80)
    assert ddp < 0.01 and "LoRA gradients" in how


def test_interconnect_is_a_flag_with_its_table(capsys):
    assert main(["plan", str(ZERO_RAG), "--nodes", "4", "--gpus-per-node", "8", "--cpus-per-node", "96",
                 "--memory-per-node", "1024", "--passages", str(WIKI), "--interconnect", "ib-hdr-200"]) == 0
    assert "network between nodes (--interconnect): ib-hdr-200: 25 GB/s each way a GPU" in capsys.readouterr().out
    assert main(["plan", str(ZERO_RAG), "--interconnect", "smoke-signals"]) == 2
    assert "--interconnect: unknown interconnect 'smoke-signals'; choose one of ib-ndr-400" in capsys.readouterr().err


def test_engine_starts_and_model_loads_are_planned_without_calibration():
    plan = make_plan(load_config(ZERO_RAG), four_by_eight(), passages=WIKI)
    mastery = stage(plan, "mastery")
    # 7 replicas of 4 GPUs over 4 nodes: 2 a node read the 141 GB each at 2 GB/s a node
    assert "vLLM engine start (compile, CUDA graphs, memory profiling) 60 s (assumed) + load 141.2 GB x 2" in mastery.how
    assert "a node 141 s (estimate)" in mastery.how
    assert "Ray Train start 30 s [train_start]" in stage(plan, "tuning: LoRA training").how
    slower = make_plan(load_config(ZERO_RAG), four_by_eight(), passages=WIKI, storage_gbs=0.5)
    assert stage(slower, "mastery").seconds - mastery.seconds == pytest.approx(141.2e9 * 2 / 0.5e9 - 141.2e9 * 2 / 2e9,
                                                                               rel=1e-3)


def test_decode_reads_the_kv_cache_as_well_as_the_weights():
    h100 = ACCELERATORS["H100"]
    without, _ = generation_seconds(h100, 8e9, 10_000, 730, 32, 1, 1)
    with_cache, how = generation_seconds(h100, 8e9, 10_000, 730, 32, 1, 1, kv_bytes_per_token=131_072)
    # 256 sequences of 746 tokens on average at 128 KB a token: 25 GB a step beside the 16 GB of weights, read at
    # 70% of 3.35 TB/s, where the 256 x 2 x 8e9 FLOPs of the step alone took less
    assert "weights 16.0 GB + KV cache 25.0 GB a step" in how
    steps = math.ceil(10_000 / 256) * 32
    flops = 256 * 2 * 8e9 / (989e12 * 0.5)
    read = (16e9 + 256 * 746 * 131_072) / (3.35e12 * 0.7)
    assert with_cache - without == pytest.approx(steps * (read - max(flops, 16e9 / (3.35e12 * 0.7))))


def test_the_decode_batch_is_what_the_engines_memory_share_leaves_the_kv_cache():
    """vLLM fills gpu_memory_utilization of a GPU (the package's default, or the config's vllm_engine_kwargs): the
    decode batch is the sequences whose KV cache fits what the weights leave of it."""
    from wbrag_ray.placement.gpus import ENGINE_MEMORY_UTILIZATION, memory_share

    assert memory_share(load_config().generator) == ENGINE_MEMORY_UTILIZATION == 0.85
    custom = load_config(overrides=["generator.vllm_engine_kwargs={gpu_memory_utilization: 0.5}"]).generator
    assert memory_share(custom) == 0.5
    h100 = ACCELERATORS["H100"]
    kv = 131_072 * (4000 + 32 / 2)  # a sequence's cache at its mean length
    for share, given in ((ENGINE_MEMORY_UTILIZATION, {}), (0.5, {"memory_share": 0.5})):
        _, how = generation_seconds(h100, 8e9, 10_000, 4000, 32, 1, 1, kv_bytes_per_token=131_072, **given)
        assert f"32 new tokens decoded {int((80e9 * share - 16e9) / kv)} at once" in how, how


def test_gpu_hours_count_only_the_time_gpus_are_held():
    plan = make_plan(load_config(ZERO_RAG), four_by_eight(), passages=WIKI)
    mastery = stage(plan, "mastery")
    assert mastery.held_seconds is not None and mastery.held_seconds < 0.7 * mastery.seconds
    assert mastery.gpu_hours == pytest.approx(28 * mastery.held_seconds / 3600 + mastery.task_gpu_seconds / 3600)
    for ratio in ("0.3", "0.5", "0.7"):  # the pruned index reuses the trained quantizer: no k-means, no GPU
        pruning = stage(plan, f"pruning at {ratio}")
        assert not any(b.what == "index train task" for b in pruning.bundles)
        assert pruning.task_gpu_seconds == 0 and not pruning.gpus and "k-means" not in pruning.how


def test_the_pruner_reads_title_and_sentence_and_flare_decodes_its_look_ahead():
    plan = make_plan(load_config(ZERO_RAG), four_by_eight(), passages=WIKI)
    # wiki-18's shapes: a 4-token title, ': ', a 19.8-token sentence; no chat template
    assert "137,970,000 texts x 25 tokens" in stage(plan, "prediction (LM pruner)").how
    wb = make_plan(load_config(WRITEBACK), four_by_eight(), passages=WIKI)
    assert "64 new tokens decoded" in stage(wb, "evaluation").how  # rag.flare.look_ahead_tokens: 64


def test_an_embedders_dimension_comes_from_its_files_where_readable(tmp_path):
    """A sentence-transformers folder whose Dense layer projects the hidden size (stella's 2_Dense_1024 does
    1024 -> 1024; others project down): the vectors are the Dense layer's width, not the hidden size."""
    import json

    from wbrag_ray.models.size import embedding_dim, model_size

    folder = tmp_path / "encoder"
    (folder / "2_Dense_256").mkdir(parents=True)
    (folder / "1_Pooling").mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 1024, "num_hidden_layers": 2,
                                                    "num_attention_heads": 16, "vocab_size": 100}))
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Dense_256", "type": "sentence_transformers.models.Dense"}]))
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 1024}))
    (folder / "2_Dense_256" / "config.json").write_text(json.dumps({"in_features": 1024, "out_features": 256}))
    assert embedding_dim(str(folder), model_size(str(folder))) == (256, "its 2_Dense_256 layer")
    stella = model_size("NovaSearch/stella_en_400M_v5")
    assert stella.hidden == 1024 and embedding_dim("NovaSearch/stella_en_400M_v5", stella)[0] == 1024
    plan = make_plan(load_config(ZERO_RAG), four_by_eight(), passages=WIKI)
    assert not any("dimension unknown" in w for w in plan.warnings)


def test_gpu_sets_the_gpus_memory_and_the_table_holds_pcie_and_nvl(capsys):
    args = [str(WRITEBACK), "--nodes", "1", "--gpus-per-node", "2", "--cpus-per-node", "64", "--memory-per-node",
            "512", "--passages", str(WIKI)]
    main(["plan", *args, "--gpu", "L4"])
    assert "2 GPUs of 24 GB" in capsys.readouterr().out
    main(["plan", *args, "--gpu", "L4", "--gpu-memory-gb", "48"])
    assert "2 GPUs of 48 GB" in capsys.readouterr().out
    for name, memory in (("H100-PCIe", 80), ("H100-NVL", 94), ("H200-NVL", 141)):
        assert ACCELERATORS[name].memory_gb == memory and "datasheet" in ACCELERATORS[name].source
    assert ACCELERATORS["H100-PCIe"].link_gbs < ACCELERATORS["H100"].link_gbs


def test_the_plan_prices_tensor_parallel_decode_under_the_batch_invariance_in_effect():
    """paper_zero_rag.yaml on 1 x 8 H100: its 70B replicas are tensor-parallel (4 GPUs), so batch_invariant auto is
    off and priced as true false is; true prices NCCL's one channel (a sixteenth of NVLink's bandwidth) into every
    decode step. A replica of one GPU has no all-reduce: its price is the same either way."""
    one_node = Cluster.uniform(1, 96, 8, 1024, 80, "stated")

    def answers(*overrides):
        plan = make_plan(load_config(ZERO_RAG, list(overrides)), one_node, passages=WIKI)
        return stage(plan, "mastery")

    auto, off, on = (answers(), answers("generator.batch_invariant=false"), answers("generator.batch_invariant=true"))
    assert auto.seconds == off.seconds and on.held_seconds > 1.5 * off.held_seconds  # the answer pass
    assert "(not batch-invariant)" in auto.how and "NVLink 4 at 0.0625 of its bandwidth (batch-invariant" in on.how
    off_step, on_step = (float(re.search(r"decoded \d+ at once at ([\d.]+) ms a step", s.how).group(1))
                         for s in (off, on))
    assert on_step > 2 * off_step

    small = ("generator.model=meta-llama/Llama-3.1-8B-Instruct", "generator.tensor_parallel_size=1")
    small_on, small_auto = answers(*small, "generator.batch_invariant=true"), answers(*small)
    assert small_auto.seconds and small_on.seconds == small_auto.seconds and "all-reduce" not in small_auto.how
    h100 = ACCELERATORS["H100"]
    args = (h100, 8e9, 10_000, 730, 32, 1, 1, 131_072, 1, 4096, 32)
    assert generation_seconds(*args, batch_invariant=True) == generation_seconds(*args)
