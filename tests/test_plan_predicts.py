"""A plan that predicts (issue 58): a time, a rate source, GPUs and GPU-hours for every stage of the paper configs
on 4 x 8 H100, from the accelerator table where nothing was measured; calibration recorded with its hardware and
found again by a later plan; `wbrag run` storing its plan and refusing, before any work, a config that cannot be
placed; the report's planned against measured times."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.conftest import DEMO_CORPUS, DEMO_QA
from wbrag_ray.cli import main
from wbrag_ray.config import load_config
from wbrag_ray.models.accelerators import ACCELERATORS, accelerator
from wbrag_ray.plan import Cluster, duration, make_plan
from wbrag_ray.plan.accelerators import generation_seconds
from wbrag_ray.plan.timing import SOURCES

ROOT = Path(__file__).resolve().parents[1]
PAPERS = [ROOT / "jobs" / "configs" / "paper_zero_rag.yaml", ROOT / "jobs" / "configs" / "paper_writeback.yaml"]
BIG = ["--nodes", "4", "--gpus-per-node", "8", "--cpus-per-node", "96", "--memory-per-node", "1024",
       "--passages", "21000000", "--gpu", "H100"]


@pytest.fixture
def no_cache(tmp_path, monkeypatch):
    """An empty calibration cache: what this machine calibrated before stays out of the test."""
    path = tmp_path / "rates.json"
    monkeypatch.setenv("WBRAG_RATES_CACHE", str(path))
    return path


@pytest.mark.parametrize("config", PAPERS, ids=lambda p: p.stem)
def test_every_stage_of_the_paper_configs_on_4x8_h100_has_a_time_source_gpus_and_gpu_hours(config, no_cache, capsys):
    main(["plan", str(config), *BIG, "--json", "--gpu-hour-price", "2"])
    data = json.loads(capsys.readouterr().out)
    assert data["gpus_total"] == 32 and data["gpu"] == "H100"
    for s in data["stages"]:
        assert s["seconds"] is not None and s["seconds"] > 0, s
        assert s["rate_source"] in SOURCES, s
        assert s["gpu_hours"] is not None, s
        assert (s["gpu_hours"] > 0) == (s["gpus"] > 0), s
    assert data["total_seconds"] == pytest.approx(sum(s["seconds"] for s in data["stages"]))
    assert data["cost"] == pytest.approx(2 * data["gpu_hours_total"])
    # the text says the same: each stage's duration, its rate source, its GPUs and GPU-hours
    main(["plan", str(config), *BIG, "--gpu-hour-price", "2"])
    text = capsys.readouterr().out
    blocks = text.split("\n\n")
    for s in data["stages"]:
        [block] = [b for b in blocks if re.match(rf" ?\d+\. {re.escape(s['name'])}: ", b)]
        assert block.splitlines()[0].endswith(f": {duration(s['seconds'])}"), block
        assert f"      time ({s['rate_source']}): " in block, block
        hours = f", {s['gpu_hours']:,.1f} GPU-hours" if s["gpu_hours"] else ""
        assert f"      GPUs: {s['gpus']:g} of 32{hours}" in block, block
    assert f"({data['gpu_hours_total']:,.1f} GPU-hours, {2 * data['gpu_hours_total']:,.2f} at the stated" in text
    assert "GPU: H100: 989 TFLOP/s bf16 dense" in text and "NVIDIA H100 Tensor Core GPU datasheet" in text


def test_the_accelerator_table_and_the_first_principles_estimates(no_cache, capsys):
    assert set(ACCELERATORS) == {"A100-40GB", "A100-80GB", "H100", "H100-PCIe", "H100-NVL", "H200", "H200-NVL", "L4",
                                 "L40S", "A10G"}
    assert all(a.source and a.bf16_tflops and a.bandwidth_tbs and a.memory_gb and a.link_gbs
               for a in ACCELERATORS.values())
    assert accelerator("h100") is ACCELERATORS["H100"] and accelerator("a100-80gb").memory_gb == 80
    with pytest.raises(ValueError, match="choose one of A100-40GB, A100-80GB, H100, H100-PCIe, H100-NVL, H200"):
        accelerator("TPU")
    # 8B on one H100: prefill 2 x 8e9 x 500 tokens per call at 50% of 989 TFLOP/s; decode 256 sequences a step
    # (4 batches for 1,000 calls), each step the longer of reading 16 GB at 70% of 3.35 TB/s and 256 x 2 x 8e9
    # FLOPs (no KV cache given: the model's layout unknown)
    h100 = ACCELERATORS["H100"]
    seconds, _ = generation_seconds(h100, 8e9, 1000, 500, 32, 1, 1)
    prefill = 1000 * 2 * 8e9 * 500 / (989e12 * 0.5)
    step = max(16e9 / (3.35e12 * 0.7), 256 * 2 * 8e9 / (989e12 * 0.5))
    assert seconds == pytest.approx(prefill + 4 * 32 * step)
    # on an L4 the decode step is bound by reading the weights (0.3 TB/s), not by its FLOPs
    l4 = ACCELERATORS["L4"]
    seconds, _ = generation_seconds(l4, 8e9, 1000, 500, 32, 1, 1)
    assert seconds == pytest.approx(1000 * 2 * 8e9 * 500 / (121e12 * 0.5) + 4 * 32 * 16e9 / (0.3e12 * 0.7))
    # --gpu picks the accelerator: the same paper stage on an L4 takes longer, on an H200 no longer
    config = load_config(PAPERS[1])
    cluster = Cluster.uniform(4, 96, 8, 1024, 80, "stated")
    times = {g: next(s.seconds for s in make_plan(config, cluster, passages=21_000_000, gpu=g).stages
                     if s.name == "embed") for g in ("L4", "H100", "H200")}
    assert times["L4"] > times["H100"] >= times["H200"]
    assert main(["plan", str(PAPERS[1]), *BIG[:-1], "B300"]) == 2
    assert "--gpu: unknown GPU 'B300'; choose one of A100-40GB" in capsys.readouterr().err


def _tiny_config(tiny, tmp_path):
    overrides = [*tiny.overrides(), "generator.max_new_tokens=4", "generator.batch_size=4", "embedder.num_cpus=0.5",
                 "generator.num_cpus=0.5", "eval.methods=[no-retrieval,naive]"]
    return load_config(overrides=overrides, extra={"ingest": {"corpus": str(DEMO_CORPUS)},
                                                   "eval": {"dataset": str(DEMO_QA)}})


def test_calibration_is_recorded_with_its_hardware_and_found_again(tiny, ray_cluster, tmp_path, no_cache):
    from wbrag_ray.plan.calibrate import calibrate, load_records

    config = _tiny_config(tiny, tmp_path)
    run = str(tmp_path / "run")
    records = calibrate(config, seconds=2.0, run=run)
    assert [r["role"] for r in records] == ["embedder", "generator"]  # joined the session's cluster: no start record
    gen = records[1]
    assert {p["shape"] for p in gen["points"]} == {"closed-book", "5 documents"}
    assert all(p["calls"] >= 1 and p["seconds"] > 0 and "first_use_seconds" in p for p in gen["points"])
    assert gen["service_start_seconds"] > 0  # the run's own generator service, to a first answer
    assert gen["hardware"]["device"] == "cpu" and gen["hardware"]["dtype"] == "float32"
    assert gen["hardware"]["cpu_flags"] and gen["hardware"]["threads"] == 1
    # the embedder's texts: tokens a text as the plan counts them and as the model's tokenizer does
    assert records[0]["tokens_per_text"] > 0 and records[0]["tokenizer_tokens_per_text"] > 0
    # the run folder's copy and the cache's
    assert json.loads((tmp_path / "run" / "plan" / "calibration.json").read_text()) == records
    assert len(json.loads(no_cache.read_text())) == 2
    assert load_records(run)[:2] == records and load_records()[:2] == records
    # a later plan on the same hardware takes them: the embed and evaluation times are calibrated
    cluster = Cluster.uniform(1, 2, 0, 8, 80, "stated")
    plan = make_plan(config, cluster, records=load_records())
    sources = {s.name: s.rate_source for s in plan.stages}
    assert sources["embed"] == "calibrated" and sources["evaluation"] == "calibrated", sources
    assert "[calibrated]" in next(s for s in plan.stages if s.name == "evaluation").how
    # measured on another CPU kind, or with another dtype: not taken
    # (the evaluation then: benchmark rates, and its services' start assumed, an estimate)
    # (flags this CPU does not have: "avx2" alone is this machine's on an AVX2-only host)
    other = [{**r, "hardware": {**r["hardware"], "cpu_flags": r["hardware"]["cpu_flags"] + " amx"}} for r in records]
    assert "calibrated" not in make_plan(config, cluster, records=other).stages[-1].sources
    bf16 = [{**r, "hardware": {**r["hardware"], "dtype": "bfloat16"}} for r in records]
    assert set(make_plan(config, cluster, records=bf16).stages[-1].sources) == {"benchmark", "estimate"}


class _FirstWork(Exception):
    """Raised where the run's first stage would start its work."""


def test_wbrag_run_stores_its_plan_and_refuses_what_cannot_fit_before_any_work(ray_cluster, tmp_path, no_cache,
                                                                                monkeypatch, capsys):
    import wbrag_ray.api as api

    ran = []

    def first_work(*args, **kwargs):
        ran.append(args)
        raise _FirstWork

    monkeypatch.setattr(api, "execute", first_work)  # the registry's executor, as `wbrag run` calls it
    config = ROOT / "jobs" / "configs" / "writeback_demo.yaml"
    data = ROOT / "wbrag_ray" / "data"
    files = ["--set", f"ingest.corpus={data / 'demo_corpus.jsonl'}", "--set", f"writeback.train={data / 'demo_train.jsonl'}",
             "--set", f"eval.dataset={data / 'demo_qa.jsonl'}"]
    run = tmp_path / "run"
    # the generator on a GPU: the session's cluster has none
    assert main(["run", str(config), "--run", str(run), *files, "--set", "generator.num_gpus=1"]) == 2
    err = capsys.readouterr().err
    assert re.search(r"cannot be placed on this cluster \(.*write-back training.*\), so nothing ran: .*pass --force "
                     "to run anyway", err), err
    assert ran == []  # refused before any work
    stored = json.loads((run / "plan" / "plan.json").read_text())
    assert stored["places"] is False and not stored["forced"] and stored["config"] == str(config)
    assert [s["fits"] for s in stored["stages"]][:3] == [True, True, True]
    assert stored["stages"][3] == {**stored["stages"][3], "name": "write-back training", "fits": False}
    with pytest.raises(_FirstWork):  # --force: the run goes on to its first stage
        main(["run", str(config), "--run", str(run), *files, "--set", "generator.num_gpus=1", "--force"])
    assert len(ran) == 1 and json.loads((run / "plan" / "plan.json").read_text())["forced"] is True


def test_the_report_puts_planned_and_measured_side_by_side(tmp_path):
    from wbrag_ray.plan.against_run import planned_vs_measured
    from wbrag_ray.report.sections import plan_section
    from wbrag_ray.run import RunFolder

    plan = {"stages": [{"name": "ingest", "seconds": 10.0, "rate_source": "benchmark", "measured_by": "ingest"},
                       {"name": "embed", "seconds": 20.0, "rate_source": "calibrated", "measured_by": "embed"},
                       {"name": "evaluation", "seconds": 50.0, "rate_source": "calibrated",
                        "measured_by": "eval\\-demo_qa"},
                       {"name": "evaluation with write-back", "seconds": 40.0, "rate_source": "calibrated",
                        "measured_by": "eval\\-demo_qa\\-writeback"},
                       {"name": "pruning at 0.3", "seconds": 5.0, "rate_source": "benchmark",
                        "measured_by": "prune\\-0\\.3"}],
            "total_seconds": 130.0, "start_seconds": 5.0, "made": "now", "gpus_total": 0}
    stats = {"ingest": {"seconds": 12.0}, "embed": {"seconds": 10.0}, "eval-demo_qa": {"seconds": 60.0},
             "eval-demo_qa-writeback": {"seconds": 40.0}, "prune-0.3": {"seconds": 1.0}}
    rows = {r["stage"]: r for r in planned_vs_measured(plan, stats, wall=143.0)}
    assert rows["ingest"]["ratio"] == pytest.approx(1.2) and rows["embed"]["ratio"] == pytest.approx(0.5)
    assert rows["evaluation"]["run_stages"] == ["eval-demo_qa"]
    assert rows["evaluation with write-back"]["run_stages"] == ["eval-demo_qa-writeback"]
    assert rows["pruning at 0.3"]["run_stages"] == ["prune-0.3"]
    assert rows["the stages together"]["measured_s"] == 123.0 and rows["the stages together"]["planned_s"] == 125.0
    assert rows["the run, start to last stage (wall)"]["ratio"] == pytest.approx(1.1)
    run = RunFolder(str(tmp_path / "run"))
    assert plan_section(run, stats) is None  # no plan stored: no section
    run.layout.plan.write_json(plan)
    from wbrag_ray.report.sections import collect

    assert [s.title for s in collect(run, tmp_path)][:2] == ["Stages", "Planned against measured"]  # in the report
    table = plan_section(run, stats).tables[0]
    assert table.header[:5] == ["stage", "planned s", "rate source", "measured s", "measured / planned"]
    assert table.rows[0][:5] == ["ingest", 10.0, "benchmark", 12.0, pytest.approx(1.2)]


def test_ray_train_start_is_calibrated_and_planned_in_place_of_the_benchmark(ray_cluster, no_cache):
    """A fit whose loop does nothing times Ray Train's own start and end on this cluster; a plan with that record
    adds the measured start to each training instead of the benchmark's 30 s."""
    from wbrag_ray.models.hardware import resolved_dtype_name, threads_of
    from wbrag_ray.plan.calibrate import _train_start, hardware, training_dtype

    config = load_config(ROOT / "jobs" / "configs" / "zero_rag_demo.yaml")
    measured = _train_start(config.zerorag.tune.trainer)
    assert 0 < measured < 120
    trainer, tune = config.zerorag.tune.trainer, config.zerorag.tune
    record = {"role": "training", "model": config.generator.model, "seconds_per_token": 1e-4, "load_seconds": 2.0,
              "train_start_seconds": measured,
              "hardware": hardware("cpu", resolved_dtype_name(training_dtype(0), 0), threads_of(trainer.num_cpus, tune.threads))}
    cluster = Cluster.uniform(1, 2, 0, 8, 80, "stated")
    tuning = next(s for s in make_plan(config, cluster, records=[record]).stages if s.name == "tuning: LoRA training")
    assert f"Ray Train start {measured:.0f} s [calibrated]" in tuning.how, tuning.how
    # the demo tunes on the generator's own answers (zerorag.tune.targets: own): that pass is in the stage's time
    assert config.zerorag.tune.targets == "own" and tuning.how.startswith("own answers: ")
    assert tuning.sources.get("calibrated", 0) >= measured
    without = next(s for s in make_plan(config, cluster, records=[{k: v for k, v in record.items()
                                                                   if k != "train_start_seconds"}]).stages
                   if s.name == "tuning: LoRA training")
    assert "[train_start]" in without.how
    assert without.seconds - tuning.seconds == pytest.approx(30.0 - measured, abs=0.01)


def test_the_plans_prompt_tokens_track_the_tokenizers_across_prompt_kinds():
    """A calibrated cost a token, measured on closed-book and five-document prompts, carries to the other prompts a
    run sends (Zero-RAG's few-shot cloze prompt of eight messages, QA writing) only where the plan counts each
    kind's tokens in the same proportion to the tokenizer's. Counted against the bundled SmolLM2's chat template."""
    from transformers import AutoTokenizer

    from wbrag_ray.config import GeneratorConfig
    from wbrag_ray.generation.hf_loading import hf_model_source
    from wbrag_ray.plan.tokens import messages_tokens
    from wbrag_ray.prompts import closed_book_messages, no_retrieval_messages, qa_write_messages, rag_messages
    from wbrag_ray.retrieval.hits import Hit

    tok = AutoTokenizer.from_pretrained(hf_model_source(GeneratorConfig(model="bundled:smollm2")))
    rows = [json.loads(line) for line in DEMO_CORPUS.read_text().splitlines()[:5]]
    docs = [Hit(i, 1.0, i, r["contents"].split("\n", 1)[0], r["contents"].split("\n", 1)[1]) for i, r in enumerate(rows)]
    question = json.loads(DEMO_QA.read_text().splitlines()[0])["question"]
    sentence = "Mount Everest: Edmund Hillary and Tenzing Norgay made the first confirmed ascent in ____."
    kinds = {"closed-book": no_retrieval_messages(question), "5 documents": rag_messages(question, docs),
             "cloze few-shot": closed_book_messages(sentence, cloze=True),
             "QA writing": qa_write_messages(sentence, 2, chat=True)}
    ratios = {}
    for kind, messages in kinds.items():
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ratios[kind] = messages_tokens(messages) / len(tok(text, add_special_tokens=False)["input_ids"])
    assert all(0.8 < r < 1.2 for r in ratios.values()), ratios
    assert max(ratios.values()) / min(ratios.values()) < 1.2, ratios  # the same proportion, whatever the kind


def _generator_record(config, **extra):
    from wbrag_ray.models.hardware import resolved_dtype_name, threads_of
    from wbrag_ray.plan.calibrate import hardware
    from wbrag_ray.plan.tokens import TOKEN_UNITS

    g = config.generator
    # a line through (76 tokens, 0.05 s) and (524 tokens, 0.40 s) at 16 new tokens: the demo machine's shape
    points = [{"shape": "closed-book", "prompt_tokens": 76.0, "new_tokens": 16, "calls": 80, "seconds": 4.0,
               "seconds_per_call": 0.05},
              {"shape": "5 documents", "prompt_tokens": 524.0, "new_tokens": 16, "calls": 20, "seconds": 8.0,
               "seconds_per_call": 0.40}]
    return {"role": "generator", "model": g.model, "backend": g.backend, "batch_size": g.batch_size, "points": points,
            "token_units": TOKEN_UNITS, "load_seconds": 2.0, "start_seconds": 0.1, "date": "2026-12-05 23:00",
            "hardware": hardware("cpu", resolved_dtype_name(g.dtype, 0), threads_of(g.num_cpus, g.threads)), **extra}


def test_mastery_is_planned_at_its_few_shot_cloze_prompts_length(no_cache):
    """Zero-RAG's mastery answers cloze texts with a few-shot prompt (an instruction, three solved examples, the
    blanked sentence): planned at that prompt's tokens, about twice a closed-book question's, not at the
    closed-book prompt's (the demo's mastery ran 2.7x its plan when it was). A record counted in an earlier
    version's units is not used, and the plan says to calibrate again."""
    from wbrag_ray.plan.tokens import messages_tokens
    from wbrag_ray.prompts import closed_book_messages

    config = load_config(ROOT / "jobs" / "configs" / "zero_rag_demo.yaml")
    cluster = Cluster.uniform(1, 2, 0, 8, 80, "stated")
    plan = make_plan(config, cluster, records=[_generator_record(config)])
    mastery = next(s for s in plan.stages if s.name == "mastery")
    assert mastery.rate_source == "calibrated", mastery.how
    tokens = float(re.search(r"calls x \([\d.]+ s \+ ([\d,]+) prompt tokens", mastery.how).group(1).replace(",", ""))
    closed = plan.tokens.prompt(0)
    cloze = messages_tokens(closed_book_messages("", cloze=True)) + plan.tokens.sentence
    assert tokens == pytest.approx(cloze, abs=1) and tokens > 1.8 * closed, (tokens, closed)
    old = _generator_record(config)
    del old["token_units"]
    stale = make_plan(config, cluster, records=[old])
    assert next(s for s in stale.stages if s.name == "mastery").rate_source == "benchmark"
    assert any("calibrate" in w and "earlier version" in w for w in stale.warnings), stale.warnings


def test_retrieved_documents_are_planned_at_the_index_units_length(no_cache):
    """Zero-RAG's index holds sentences: the grid's RAG prompts carry K sentences, not K passages (planned at
    passages, the demo's grid ran at 0.56 of its plan)."""
    from wbrag_ray.plan.tokens import DOC_FORMAT_TOKENS, template_tokens

    config = load_config(ROOT / "jobs" / "configs" / "zero_rag_demo.yaml")
    assert config.index.unit == "sentence"
    plan = make_plan(config, Cluster.uniform(1, 2, 0, 8, 80, "stated"), records=[_generator_record(config)])
    grid = next(s for s in plan.stages if s.name == "evaluation grid")
    tokens = sorted(float(t.replace(",", "")) for t in re.findall(r"\+ ([\d,]+) prompt tokens", grid.how))
    k, shape = config.retrieval.top_k, plan.tokens
    assert tokens[-1] == pytest.approx(template_tokens(True) + shape.question + k * (shape.sentence + DOC_FORMAT_TOKENS),
                                       abs=1), grid.how
    assert tokens[-1] < template_tokens(True) + shape.question + k * shape.passage / 2


def test_training_is_calibrated_in_the_dtype_a_training_worker_has(no_cache):
    """A CPU training worker trains in fp32 whatever the CPU (`training.placement`): calibration times LoRA steps
    in fp32 too (in bf16 it measured 1.6x faster than the run trained on an AVX512-BF16 CPU), and the plan's
    tuning finds that record."""
    from wbrag_ray.plan.calibrate import calibrate_training

    config = load_config(ROOT / "jobs" / "configs" / "zero_rag_demo.yaml",
                         overrides=["zerorag.tune.max_length=32", "zerorag.tune.batch_size=2"])
    record = {**calibrate_training(config.zerorag.tune, config.generator, 0.5), "date": "now"}
    assert record["hardware"]["dtype"] == "float32" and record["steps"] >= 1 and record["seconds_per_token"] > 0
    cluster = Cluster.uniform(1, 2, 0, 8, 80, "stated")
    tuning = next(s for s in make_plan(config, cluster, records=[record]).stages if s.name == "tuning: LoRA training")
    assert "ms a token x 1 (params) [calibrated]" in tuning.how, tuning.how
