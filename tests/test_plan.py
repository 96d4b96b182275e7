"""`wbrag plan`: the paper configs on a stated GPU cluster, refusals with what to change, the corpus size's
sources, and the rates' provenance. Nothing here starts Ray or loads a model (a test checks that)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import DEMO_CORPUS, DEMO_QA, demo_records, write_jsonl
from wbrag_ray.cli import main
from wbrag_ray.config import load_config
from wbrag_ray.plan import Cluster, format_plan, format_summary, make_plan
from wbrag_ray.plan.corpus import corpus_size, question_count
from wbrag_ray.plan.models import model_size
from wbrag_ray.plan.rates import RATES
from wbrag_ray.run import RunFolder
from wbrag_ray.training.workers import plan_steps

ROOT = Path(__file__).resolve().parents[1]
ZERO_RAG = ROOT / "jobs" / "configs" / "paper_zero_rag.yaml"
WRITEBACK = ROOT / "jobs" / "configs" / "paper_writeback.yaml"
WIKI = 21_000_000  # wiki-18's passages
BIG = ["--nodes", "4", "--gpus-per-node", "8", "--cpus-per-node", "96", "--memory-per-node", "1024"]


def big_cluster(gpu_memory_gb: float = 80.0) -> Cluster:
    return Cluster.uniform(4, 96, 8, 1024, gpu_memory_gb, "stated")


def stage(plan, name):
    return next(s for s in plan.stages if s.name == name)


def bundle(s, what):
    return next(b for b in s.bundles if b.what == what)


def test_paper_zero_rag_places_on_four_nodes_of_eight_gpus():
    plan = make_plan(load_config(ZERO_RAG), big_cluster(), passages=WIKI)
    assert plan.places, plan.problems
    assert [s.name for s in plan.stages] == [
        "ingest", "embed", "index", "mastery", "pruner training (LM regressor)", "prediction (LM pruner)",
        "pruning at 0.3", "pruning at 0.5", "pruning at 0.7", "tuning: retrieval", "tuning: LoRA training", "router",
        "evaluation grid"]
    assert plan.corpus.sentences == 137_970_000  # 21M passages x 6.57 (wiki-18's sentences per passage)
    embed = bundle(stage(plan, "embed"), "embed actor")
    assert (embed.count, embed.gpus, embed.cpus) == (32, 1.0, 1.0)  # concurrency: auto, an actor per GPU
    # the 70B generator (concurrency: auto): 7 replicas, each one tensor-parallel group of 4 GPUs on one node, beside
    # its service actor; the eighth group's GPUs are the grid's search actors' and query embedder's
    mastery = stage(plan, "mastery")
    group = bundle(mastery, "generator tensor-parallel group")
    assert (group.count, group.gpus, group.cpus) == (7, 4.0, 4.0)
    assert group.gpu_memory_gb == pytest.approx(70.6e9 * 2 * 1.2 / 4 / 1e9)  # bf16 weights + 20%, over 4 GPUs
    assert bundle(mastery, "generator service actor").count == 7
    assert "70.6B parameters, known model" in " ".join(mastery.notes)
    assert mastery.work == "20,000 sentences: 20,000 QA-writing calls, 80,000 closed-book answers"
    # the index the sizing rules pick at 138M sentences of stella_en_400M_v5 (1024-d, as its config.json and its
    # 2_Dense_1024 layer say; 768 was assumed before) within the 16 GB budget
    index = stage(plan, "index")
    assert "137,970,000 vectors of 1024 dimensions" in index.work
    assert "factory IVF32768_HNSW32,PQ64, 3 shard(s)" in index.notes[0]
    assert "2 search actor group(s)" in index.notes[1]
    train = bundle(index, "index train task")
    assert train.gpus == 1.0  # k-means on a GPU: the cluster has GPUs and index.gpu is set
    grid = stage(plan, "evaluation grid")
    assert sum(b.gpus * b.count for b in grid.bundles) == 28 + 2 + 1  # generators, search actors, query embedder
    assert bundle(grid, "search actor").count == 2
    assert "16 settings" in grid.work  # 4 ratios (0 included) x router x adapter
    # the trainings: Ray Train workers as zerorag.<...>.trainer says, steps over the scored sample (80% of 20,000)
    lm = load_config(ZERO_RAG).zerorag.lm_pruner
    assert lm.trainer.num_workers == "auto"  # a worker per GPU: 32
    workers = bundle(stage(plan, "pruner training (LM regressor)"), "Ray Train worker")
    assert (workers.count, workers.gpus, workers.kind) == (32, lm.trainer.num_gpus, "worker")
    steps, batch = plan_steps(lm, 16_000, 32)
    assert stage(plan, "pruner training (LM regressor)").work.startswith(f"16,000 examples: {steps:,} steps of {batch}")
    # GPU stages without a measured rate: estimated from FLOPs against the H100's peak, and labeled so
    embed = stage(plan, "embed")
    assert embed.how.startswith("estimate: 137,970,000 texts x ") and "on H100" in embed.how
    assert embed.rate_source == "estimate" and stage(plan, "ingest").rate_source == "benchmark"


def test_a_large_model_training_on_cpus_is_planned_with_a_warning():
    config = load_config(ZERO_RAG, ["zerorag.tune.trainer.num_gpus=0", "zerorag.tune.trainer.num_workers=1",
                                    "zerorag.tune.trainer.num_cpus=1", "zerorag.tune.max_steps=1000"])
    plan = make_plan(config, big_cluster(), passages=WIKI)
    tune = stage(plan, "tuning: LoRA training")
    assert tune.bundles[0].memory_gb == pytest.approx(70.6e9 * 4 * 1.3 / 1e9 + 0.5 * 2**30 / 1e9)  # fp32 + 30%
    # the remote training set is not counted: TriviaQA train's questions as FlashRAG publishes them (3 rows each)
    assert tune.work.startswith("236,355 examples: 1,000 steps of 32, capped by zerorag.tune.max_steps")
    assert tune.seconds > 30 * 86400  # LoRA on a 70B model on one CPU worker: months, from the SmolLM2 step rate
    assert ("zerorag.tune.trainer: meta-llama/Llama-3.3-70B-Instruct (70.6B parameters, known model) trains on CPUs "
            "(num_gpus 0): set zerorag.tune.trainer.num_gpus to train on GPUs") in plan.warnings


def test_paper_writeback_places_on_four_nodes_of_eight_gpus():
    plan = make_plan(load_config(WRITEBACK), big_cluster(), passages=WIKI)
    assert plan.places, plan.problems
    assert [s.name for s in plan.stages] == ["ingest", "embed", "index", "write-back training", "evaluation",
                                             "evaluation with write-back"]
    gen = bundle(stage(plan, "write-back training"), "generator actor (vllm)")
    assert (gen.count, gen.gpus) == (30, 1.0)  # concurrency: auto, beside a search actor and a query embedder
    assert gen.gpu_memory_gb == pytest.approx(8.03e9 * 2 * 1.2 / 1e9)
    assert "factory IVF65536_HNSW32,PQ96, 1 shard(s)" in stage(plan, "index").notes[0]
    assert stage(plan, "ingest").bundles[0].count == 58  # 21M x 368.6 bytes over ingest.shard_bytes (128 MiB)
    assert "up to 24 calls a question" in stage(plan, "evaluation").work  # 1 + 1 + K + (K + 2) + 2 x 5 rounds


def test_auto_concurrency_is_planned_as_a_command_decides_it_on_the_cluster():
    """The paper's write-back config with `concurrency: auto`: every GPU of the 4 x 8 that retrieval does not hold
    (search actors, query embedders) becomes an engine (the command's rule, `cluster_nodes.auto_concurrency`), and
    the plan says the number."""
    auto = load_config(WRITEBACK)
    assert (auto.generator.concurrency, auto.embedder.concurrency) == ("auto", "auto")
    plan = make_plan(auto, big_cluster(), passages=WIKI)
    assert plan.places, plan.problems
    retrieval = [bundle(stage(plan, "evaluation"), what) for what in ("search actor", "query embedder")]
    held = int(sum(b.count * b.gpus for b in retrieval))
    gen = bundle(stage(plan, "write-back training"), "generator actor (vllm)")
    assert held >= 1 and (gen.count, gen.gpus) == (32 - held, 1.0)
    assert bundle(stage(plan, "embed"), "embed actor").count == 32  # embedding runs alone: every GPU
    assert f"generator.concurrency auto: {32 - held} on this cluster" in plan.warnings
    assert auto.generator.concurrency == "auto"  # the plan decided on a copy
    # retrieval on shares of the engines' GPUs (search actors and query embedders of 0.05): an engine on every GPU
    shared = load_config(WRITEBACK, overrides=["generator.concurrency=auto", "generator.num_gpus=0.8",
                                               "retrieval.search_gpus=0.05", "retrieval.embed_gpus=0.05"])
    plan = make_plan(shared, big_cluster(), passages=WIKI)
    assert plan.places, plan.problems
    assert bundle(stage(plan, "write-back training"), "generator actor (vllm)").count == 32
    assert bundle(stage(plan, "evaluation"), "search actor").gpus == 0.05
    assert bundle(stage(plan, "evaluation"), "query embedder").gpus == 0.05
    assert bundle(stage(plan, "embed"), "embed actor").gpus == 1.0  # the bulk embedding keeps whole GPUs
    # Zero-RAG's prediction pass runs alone: one LM pruner actor per GPU
    pruning = make_plan(load_config(ZERO_RAG), big_cluster(), passages=WIKI)
    assert bundle(stage(pruning, "prediction (LM pruner)"), "LM pruner actor").count == 32
    assert "zerorag.lm_pruner.concurrency auto: 32 on this cluster" in pruning.warnings


def test_wbrag_plan_prints_the_plan_and_its_provenance(capsys):
    assert main(["plan", str(ZERO_RAG), *BIG, "--passages", str(WIKI)]) == 0
    out = capsys.readouterr().out
    assert "cluster: 4 x (96 CPUs, 8 GPUs of 80 GB, 1,024 GB): 384 CPUs, 32 GPUs (stated" in out
    assert "7 x generator tensor-parallel group {4 CPU, 4 GPU, 42.4 GB per GPU}" in out
    assert "tensor_parallel_size 4 x pipeline_parallel_size 1" in out
    assert "placement: every stage's bundles fit this cluster" in out
    assert "[ingest] 35,368 records/s per ingest task (one core)" in out
    assert "`python -m benchmarks.segmentation`, 2026-11-29, CPU: 2-core AMD EPYC with AVX512-BF16" in out
    assert "memory: memory per actor = parameters x 2 bytes (bf16, GPU)" in out


def test_a_cluster_too_small_is_refused_with_what_to_change(capsys):
    small = ["--nodes", "1", "--gpus-per-node", "2", "--cpus-per-node", "16", "--memory-per-node", "128"]
    assert main(["plan", str(ZERO_RAG), *small, "--passages", str(WIKI), "--set", "embedder.concurrency=8"]) == 2
    captured = capsys.readouterr()
    assert "cannot be placed on this cluster:" in captured.err
    out = captured.out
    # tensor_parallel_size auto: two 80 GB GPUs do not hold a 70B (two H200s do: tests/test_gpu_layout.py)
    assert ("generator.tensor_parallel_size auto: meta-llama/Llama-3.3-70B-Instruct needs 141 GB of bf16 weights and "
            "21.6 GB of KV cache (64 sequences of 1032 tokens), 4 GPUs of one node of 80 GB at gpu_memory_utilization "
            "0.85; the largest node has 2 GPUs") in out
    assert ("embed: its actors ask for 8 GPUs at once (8 x embed actor), the cluster has 2; lower "
            "embedder.concurrency") in out
    assert "tuning: retrieval: its actors ask for 3 GPUs at once (2 x search actor, 1 x query embedder)" in out


def test_a_generator_over_its_gpus_memory_is_refused_with_the_gpus_it_needs():
    four = load_config(ZERO_RAG, ["generator.num_gpus=4", "generator.tensor_parallel_size=4"])
    plan = make_plan(four, big_cluster(gpu_memory_gb=40), passages=WIKI)
    assert ("mastery, router, evaluation grid: a generator tensor-parallel group needs 42.4 GB on each of its GPUs, "
            "more than the 34.0 GB it may use of a 40 GB GPU; shard it over 8 GPUs: generator.backend: vllm, "
            "generator.num_gpus: 8 (tensor_parallel_size 8; or pipeline_parallel_size for stages on several nodes)"
            ) in plan.problems
    # as shipped (tensor_parallel_size auto), the 70B takes the 8 GPUs of a node of 40 GB GPUs
    shipped = make_plan(load_config(ZERO_RAG), big_cluster(gpu_memory_gb=40), passages=WIKI)
    assert shipped.places and any("tensor_parallel_size auto: 8" in w for w in shipped.warnings)
    one_gpu = load_config(ZERO_RAG, ["generator.num_gpus=1", "generator.tensor_parallel_size=null"])
    assert "generator.num_gpus: 4 (tensor_parallel_size 4" in make_plan(one_gpu, big_cluster(), passages=WIKI).problems[0]


def test_the_cpu_demo_gets_a_time_for_every_stage_from_measured_rates():
    config = load_config(ROOT / "jobs" / "configs" / "demo.yaml",
                         extra={"ingest": {"corpus": str(DEMO_CORPUS)}, "eval": {"dataset": str(DEMO_QA)}})
    plan = make_plan(config, Cluster.uniform(1, 2, 0, 8, 80, "stated"))
    assert plan.places and all(s.seconds is not None for s in plan.stages)
    evaluation = stage(plan, "evaluation")
    # 40 questions, no-retrieval at the closed-book rate and naive RAG at the RAG-prompt rate, hf on CPU
    assert "; 40 calls / (11.5/s [closed_book]" in evaluation.how and "; 40 calls / (0.71/s [rag_prompt_hf]" \
        in evaluation.how
    # its services' start, assumed where no calibration measured it: the actor's start and the model's read
    assert evaluation.how.startswith("generator: actor start 10 s (assumed) + load 0.5 GB")
    text = format_plan(plan)
    assert "[rag_prompt_hf] 0.71 prompts/s per actor" in text and "`python -m benchmarks.generate`, 2026-12-01" in text


def test_the_additive_union_counts_its_appended_units_in_the_write_back_evaluations_prompts():
    """retrieval.union: additive puts the base's K and up to retrieval.max_units units (1 unset) in a prompt."""
    def evaluations(**retrieval):  # the paper's config on 4 x 8 GPUs: estimated from the prompts' tokens
        plan = make_plan(load_config(WRITEBACK, extra={"retrieval": retrieval}), big_cluster(), passages=WIKI)
        return stage(plan, "evaluation"), stage(plan, "evaluation with write-back")

    base, with_wb = evaluations(union="auto")  # auto (and every other rule): K documents in both
    assert base.seconds == with_wb.seconds and "additive" not in with_wb.work
    base, additive = evaluations(union="additive")
    assert base.seconds < additive.seconds and "up to 5 + 1 documents a prompt" in additive.work
    _, three = evaluations(union="additive", max_units=3)
    assert additive.seconds < three.seconds and "up to 5 + 3 documents a prompt" in three.work


def test_the_summary_wbrag_run_prints_is_a_few_lines():
    summary = format_summary(make_plan(load_config(ZERO_RAG), big_cluster(), passages=WIKI))
    lines = summary.splitlines()
    assert len(lines) <= 5
    assert lines[0].startswith("plan (13 stages on 4 x (96 CPUs, 8 GPUs of 80 GB, 1,024 GB)")
    assert "most GPUs at once: 32 of 32 (" in summary  # every GPU: embedding, trainings, prediction (auto)


def test_wbrag_run_prints_no_summary_without_a_cluster_to_read():
    # a fresh interpreter: this test process may already be connected to the session cluster by an earlier test
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    code = ("from wbrag_ray.cli import _print_plan_summary; from wbrag_ray.config import load_config; "
            f"_print_plan_summary(load_config({str(ZERO_RAG)!r}), 'unused')")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""


def test_corpus_size_sources_in_order(tmp_path):
    corpus = write_jsonl(tmp_path / "corpus.jsonl", demo_records() * 3)
    config = load_config(extra={"ingest": {"corpus": str(corpus)}})
    # the corpus files: jsonl bytes over the ingest benchmark's bytes per passage
    from_files = corpus_size(config, run=str(tmp_path / "no-run"))
    assert from_files.passages == round(corpus.stat().st_size / RATES["bytes_per_passage"].value)
    assert "bytes_per_passage" in from_files.source and "no complete ingest" not in from_files.source
    # a run folder whose ingest is complete: its exact counts win over the files
    run = RunFolder(str(tmp_path / "run"))
    run.mark_complete("ingest", {"rows_out": 300, "sentences": 1188})
    from_run = corpus_size(config, run=run.uri)
    assert (from_run.passages, from_run.sentences) == (300, 1188) and "(exact)" in from_run.source
    # --passages wins over both
    given = corpus_size(config, passages=1000, run=run.uri)
    assert (given.passages, given.sentences) == (1000, 6570) and given.source.startswith("given (--passages)")
    # Parquet: the footers' row counts
    pq.write_table(pa.table({"id": ["a", "b", "c"], "contents": ["t\nx", "t\ny", "t\nz"]}), tmp_path / "c.parquet")
    parquet = corpus_size(load_config(extra={"ingest": {"corpus": str(tmp_path / "c.parquet")}}))
    assert parquet.passages == 3 and "3 Parquet rows" in parquet.source
    unknown = corpus_size(load_config(extra={"ingest": {"corpus": str(tmp_path / "missing.jsonl")}}))
    assert unknown.passages is None and unknown.source.endswith("pass --passages N")


def test_questions_are_counted_in_local_files_only(tmp_path):
    assert question_count(str(DEMO_QA), None)[0] == 40
    assert question_count(str(DEMO_QA), 10) == (10, f"the first 10 of 40 in {DEMO_QA}")
    assert question_count("s3://bucket/mine/train.jsonl", None) == (None, "s3://bucket/mine/train.jsonl is not "
                                                                           "local: not counted")
    # a FlashRAG split a plan cannot read: its published size, and it says so
    assert question_count("s3://bucket/nq/train.jsonl", None) == (
        79_168, "79,168: FlashRAG's 79,168 questions of this split (s3://bucket/nq/train.jsonl is not local: not counted)")
    assert question_count("s3://bucket/nq/train.jsonl", 500)[0] == 500


def test_model_sizes_from_config_json_known_ids_and_names(tmp_path):
    llama8b = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
               "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
               "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(llama8b))
    local = model_size(str(tmp_path))
    assert local.params == pytest.approx(8.03e9, rel=0.002) and local.source == "from its config.json"
    assert model_size("s3://models/Llama-3.3-70B-Instruct").params == 70.6e9  # a known model by its folder's name
    named = model_size("org/Mystery-7B-chat")
    assert named.params == 7e9 and named.source == "estimated from '7B' in the name"
    assert model_size("org/mystery").params is None


def test_planning_starts_no_ray_and_loads_no_model():
    code = ("import sys; from wbrag_ray.config import load_config; from wbrag_ray.plan import Cluster, make_plan; "
            f"make_plan(load_config({str(ZERO_RAG)!r}), Cluster.uniform(4, 96, 8, 1024, 80), passages=21000000); "
            "print(sorted(m for m in ('ray', 'torch', 'transformers', 'vllm') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_the_summary_and_plan_read_the_connected_ray_cluster(ray_cluster, capsys):
    """With Ray connected (the session's 2-CPU cluster), `wbrag run`'s summary and `wbrag plan --address` take the
    cluster's shape from its nodes."""
    from wbrag_ray.cli import _print_plan_summary

    config = load_config(ROOT / "jobs" / "configs" / "demo.yaml",
                         extra={"ingest": {"corpus": str(DEMO_CORPUS)}, "eval": {"dataset": str(DEMO_QA)}})
    _print_plan_summary(config, "unused")
    out = capsys.readouterr().out
    assert out.startswith("plan (4 stages on 1 x (2 CPUs, 0 GPUs") and "the connected Ray cluster" in out
    address = ray_cluster.get_runtime_context().gcs_address
    assert main(["plan", str(ROOT / "jobs" / "configs" / "demo.yaml"), "--address", address,
                 "--set", f"ingest.corpus={DEMO_CORPUS}"]) == 0
    assert "cluster: 1 x (2 CPUs, 0 GPUs" in capsys.readouterr().out


# why a GPU stage of the paper configs may use fewer than 28 of the 32 GPUs: the plan names it
NAMED_WHY = ("k-means trains as one task on one GPU", "raise retrieval.concurrency")


@pytest.mark.parametrize("config", [ZERO_RAG, WRITEBACK], ids=["zero_rag", "writeback"])
def test_every_gpu_stage_of_the_paper_configs_uses_the_cluster_or_says_why_not(config, capsys):
    """`wbrag plan --json` on the 4 x 8 cluster the paper configs name: each GPU stage holds at least 28 of the 32
    GPUs (concurrency and training workers `auto`), or a warning names why it cannot; the text says the same."""
    assert main(["plan", str(config), *BIG, "--passages", str(WIKI), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["gpus_total"] == 32 and data["places"]
    for s in data["stages"]:
        assert set(s) == {"name", "seconds", "rate_source", "gpus", "gpu_hours", "fits", "measured_by"} and s["fits"], s
        assert s["rate_source"] in ("benchmark", "estimate", None) and (s["rate_source"] is None) == (s["seconds"] is None)
    gpu_stages = [s for s in data["stages"] if s["gpus"]]
    for name in (s["name"] for s in gpu_stages if s["gpus"] < 28):
        assert any(w.startswith(f"{name}: ") and any(why in w for why in NAMED_WHY) for w in data["warnings"]), name
    expected = ({"embed", "mastery", "pruner training (LM regressor)", "prediction (LM pruner)",
                 "tuning: LoRA training", "router", "evaluation grid"} if config == ZERO_RAG else
                {"embed", "write-back training", "evaluation", "evaluation with write-back"})
    assert {s["name"] for s in gpu_stages if s["gpus"] >= 28} == expected
    assert data["total_seconds"] == pytest.approx(sum(s["seconds"] for s in data["stages"] if s["seconds"]))
    # the text prints the same GPUs, stage by stage
    assert main(["plan", str(config), *BIG, "--passages", str(WIKI)]) == 0
    text = capsys.readouterr().out
    blocks = text.split("\n\n")
    for s in data["stages"]:
        [block] = [b for b in blocks if f". {s['name']}: " in b.splitlines()[0]]
        assert f"GPUs: {s['gpus']:g} of 32" in block, block


def test_a_gpu_stage_leaving_a_quarter_idle_is_warned_with_the_setting_that_uses_them():
    config = load_config(WRITEBACK, ["embedder.concurrency=8", "generator.concurrency=23"])
    plan = make_plan(config, big_cluster(), passages=WIKI)
    assert "embed: 8 of the cluster's 32 GPUs, 24 idle; set embedder.concurrency: auto (32 on this cluster)" \
        in plan.warnings
    [line] = [x for x in format_plan(plan).splitlines() if x.startswith("      GPUs: 8 of 32, ")]  # the embed stage's
    assert line.endswith(" GPU-hours (24 idle: set embedder.concurrency: auto (32 on this cluster))")
    # 23 engines beside a search actor and a query embedder: 25 of 32, 7 idle, no more than a quarter: no warning
    assert stage(plan, "write-back training").gpus == 25
    assert not [w for w in plan.warnings if w.startswith("write-back training:")]
    one_more = make_plan(load_config(WRITEBACK, ["generator.concurrency=21"]), big_cluster(), passages=WIKI)
    assert ("write-back training: 23 of the cluster's 32 GPUs, 9 idle; set generator.concurrency: auto (30 on this "
            "cluster)") in one_more.warnings


def test_gpu_hours_are_a_stages_gpus_for_its_time():
    from wbrag_ray.plan import plan_data
    from wbrag_ray.plan.placement import Bundle
    from wbrag_ray.plan.planner import Plan
    from wbrag_ray.plan.stages import Stage

    engines = Stage("generation", [Bundle("engine", 28, 1.0, 1.0)], "work", 1800.0, rates=("closed_book",))
    kmeans = Stage("index", [Bundle("index train task", 1, 8.0, 1.0, kind="task")], "work", 600.0,
                   rates=("index_add",))
    cpu = Stage("ingest", [Bundle("ingest task", 58, 1.0, kind="task")], "work", 60.0)
    assert (engines.gpus, engines.gpu_hours, engines.rate_source) == (28, 14.0, "benchmark")
    assert (kmeans.gpus, kmeans.gpu_hours) == (1.0, None)  # its time leaves the GPU task out: no GPU-hours
    assert (cpu.gpus, cpu.gpu_hours, cpu.rate_source) == (0, 0.0, "estimate")
    plan = Plan("", big_cluster(), corpus_size(load_config(), passages=10), [engines, kmeans, cpu])
    assert "      GPUs: 28 of 32, 14.0 GPU-hours" in format_plan(plan)
    data = plan_data(plan)
    assert data["total_seconds"] == 2460.0 and data["gpu_hours_total"] == 14.0
