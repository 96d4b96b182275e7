"""RePlug's probability mixture (`Generator.generate_mixture`) on the hf backend, checked against next-token
distributions computed by hand with the tiny random-weight model's own forward pass (one prompt alone, no
padding, no cache), and the backends that cannot decode it refusing it by name."""

import itertools
import json

import pytest

from wbrag_ray import rag
from wbrag_ray.config import ConfigError, GeneratorConfig, load_config
from wbrag_ray.generation.backends import check_backend_mode, make_generator
from wbrag_ray.generation.passes import GeneratorPasses
from wbrag_ray.generation.types import mixture_weights
from wbrag_ray.prompts import no_retrieval_messages, rag_messages
from wbrag_ray.retrieval.hits import Hit

QUESTION = "What is the capital of Iceland?"
# one-sentence documents that differ by a word or two: next-token distributions close enough that a token
# second under both can lead their mixture
DOCS = [f"{city} is the capital of {tail}" for city in ("Reykjavik", "Paris", "Berlin", "Madrid")
        for tail in ("Iceland", "Iceland, a big city.", "the country.", "the island.")]
WEIGHTS = [x / 20 for x in range(2, 19)]


@pytest.fixture(scope="module")
def gen(tiny):
    g = make_generator(GeneratorConfig(model=tiny.generator, dtype="float32", max_new_tokens=6, batch_size=8))
    g.setup()
    return g


def _prompt(doc: str):
    return rag_messages(QUESTION, [Hit(1, 0.9, 0, "Iceland", doc)])


def _ids(gen, prompt) -> list[int]:
    return gen.tokenizer(gen.render([prompt]), add_special_tokens=False)["input_ids"][0]


def _next_dist(gen, ids: list[int]):
    """p(next token | ids): one sequence alone, fp32 softmax of its last logits."""
    import torch

    with torch.inference_mode():
        logits = gen.model(input_ids=torch.tensor([ids])).logits[0, -1]
    return torch.softmax(logits.float(), -1)


def test_two_document_mixture_is_the_hand_computed_mixture_for_two_steps(gen):
    p1_prompt, p2_prompt = _prompt(DOCS[0]), _prompt(DOCS[5])
    w = 0.7
    (scored,) = gen.generate_mixture([[p1_prompt, p2_prompt]], [[w, 1 - w]])
    ids1, ids2 = _ids(gen, p1_prompt), _ids(gen, p2_prompt)
    for step in range(2):
        mixed = w * _next_dist(gen, ids1) + (1 - w) * _next_dist(gen, ids2)
        token = int(mixed.argmax())
        assert token not in gen.stop_token_ids  # the answer goes on past this step
        assert scored.tokens[step] == gen.tokenizer.decode([token])
        assert scored.probs[step] == pytest.approx(float(mixed[token]), abs=1e-4)
        ids1, ids2 = [*ids1, token], [*ids2, token]  # the chosen token extends both documents' sequences
    # weights are relative: (7, 3) is (0.7, 0.3)
    (again,) = gen.generate_mixture([[p1_prompt, p2_prompt]], [[7.0, 3.0]])
    assert again.tokens == scored.tokens and again.probs == pytest.approx(scored.probs, abs=1e-5)


def test_the_mixture_can_choose_a_token_neither_document_would(gen):
    """Not a vote: the mixture's argmax is a token that is neither document's own greedy token (found among a few
    near-identical documents and weights, by hand), and the generator picks it with the mixed probability."""
    import torch

    dists = {d: _next_dist(gen, _ids(gen, _prompt(d))) for d in DOCS}
    w = torch.tensor(WEIGHTS)[:, None]
    best = None
    for a, b in itertools.combinations(DOCS, 2):
        own = torch.tensor(sorted({int(dists[a].argmax()), int(dists[b].argmax())}))
        mixed = w * dists[a] + (1 - w) * dists[b]  # one row per weight
        lead = mixed.max(-1).values - mixed[:, own].max(-1).values  # > 0: a third token leads
        i = int(lead.argmax())
        if float(lead[i]) > 0 and (best is None or float(lead[i]) > best[0]):
            token = int(mixed[i].argmax())
            best = (float(lead[i]), a, b, WEIGHTS[i], token, float(mixed[i, token]), own.tolist())
    assert best is not None and best[0] > 1e-3, "no document pair whose mixture leads with a third token"
    _, a, b, weight, token, prob, own = best
    (scored,) = gen.generate_mixture([[_prompt(a), _prompt(b)]], [[weight, 1 - weight]])
    assert scored.tokens[0] == gen.tokenizer.decode([token]) and scored.probs[0] == pytest.approx(prob, abs=1e-4)
    firsts = [s.tokens[0] for s in gen.generate_scored([_prompt(a), _prompt(b)])]
    assert sorted(firsts) == sorted(gen.tokenizer.decode([t]) for t in own) and scored.tokens[0] not in firsts


def test_one_prompt_groups_decode_as_greedy_answers_whatever_the_batching(gen):
    prompts = [_prompt(DOCS[0]), no_retrieval_messages("Name a fruit."), _prompt(DOCS[9])]
    greedy = gen.generate_scored(prompts)
    alone = gen.generate_mixture([[p] for p in prompts], [[1.0]] * 3)
    for g, m in zip(greedy, alone, strict=True):
        assert (m.text, m.tokens, m.finished) == (g.text, g.tokens, g.finished)
        assert m.probs == pytest.approx(g.probs, abs=1e-4)
    # groups of different sizes in one batch, or one group per batch: the same answers
    groups = [[prompts[0], prompts[2]], [prompts[1]], [_prompt(d) for d in DOCS[:4]]]
    weights = [[0.5, 0.5], [1.0], [0.4, 0.3, 0.2, 0.1]]
    together = gen.generate_mixture(groups, weights)
    budget = gen.memory_budget
    try:
        gen.memory_budget = 1  # nothing fits: one group at a time, never none
        apart = gen.generate_mixture(groups, weights)
    finally:
        gen.memory_budget = budget
    assert [s.tokens for s in together] == [s.tokens for s in apart]
    assert [s.text for s in together] == [s.text for s in apart]


def test_mixture_weights_are_normalized_and_checked():
    assert mixture_weights([[[]], [[], []]], [[3.0], [1.0, 3.0]]) == [[1.0], [0.25, 0.75]]
    assert mixture_weights([[[], []]], [[0.0, 0.0]]) == [[0.5, 0.5]]
    with pytest.raises(ValueError, match="2 prompts and 1 weights"):
        mixture_weights([[[], []]], [[1.0]])
    with pytest.raises(ValueError, match="0 prompts"):
        mixture_weights([[]], [[]])


def test_vllm_and_openai_refuse_the_mixture_naming_replug_vote():

    for backend in ("vllm", "openai"):
        config = GeneratorConfig(backend=backend, model="any" if backend == "openai" else "bundled:smollm2")
        with pytest.raises(ConfigError, match=f"generator.backend={backend} cannot decode .*replug-vote"):
            check_backend_mode(config, "mixture")
        with pytest.raises(ConfigError, match="replug-vote"):
            make_generator(config).generate_mixture([[no_retrieval_messages("Q?")]], [[1.0]])
        assert "replug" not in rag.available_methods(config) and "replug-vote" in rag.available_methods(config)
        # the RAG method refuses before it searches or loads anything
        wb_config = load_config(overrides=[f"generator.backend={backend}"])
        with pytest.raises(ConfigError, match="replug-vote"):
            rag.answer(None, ["naive", "replug"], wb_config, None, None)
    check_backend_mode(GeneratorConfig(), "mixture")  # hf decodes it
    assert rag.available_methods(GeneratorConfig()) == list(rag.METHODS)


def test_mixture_pass_in_a_ray_actor_pool_counts_every_prompt(ray_cluster, tiny, gen):
    import pandas as pd

    config = GeneratorConfig(model=tiny.generator, dtype="float32", max_new_tokens=6, batch_size=8, num_cpus=1,
                             threads=2)
    groups = [[_prompt(DOCS[0]), _prompt(DOCS[5])], [no_retrieval_messages("Name a fruit.")]]
    weights = [[0.7, 0.3], [1.0]]
    frame = pd.DataFrame({"id": [0, 1], "prompt": [json.dumps(g) for g in groups],
                          "weights": [json.dumps(w) for w in weights]})
    passes = GeneratorPasses(config)
    try:
        out = passes.generate("replug:mixture", frame, "prompt", "answer", mode="mixture")
    finally:
        passes.close()
    out = out.sort_values("id")
    expected = gen.generate_mixture(groups, weights)
    assert out["answer"].tolist() == [s.text for s in expected]
    assert [list(t) for t in out["answer_tokens"]] == [s.tokens for s in expected]
    assert out["answer_finished"].tolist() == [s.finished for s in expected]
    stats = passes.stats["replug:mixture"]
    assert stats["generator_calls"] == 3 and stats["mixture_groups"] == 2


def test_a_mixture_pass_on_vllm_is_refused_before_building_anything(ray_cluster):
    import pandas as pd

    frame = pd.DataFrame([{"prompt": "[]", "weights": "[]"}])
    with GeneratorPasses(GeneratorConfig(backend="vllm")) as passes, pytest.raises(ConfigError, match="replug-vote"):
        passes.generate("replug:mixture", frame, "prompt", "answer", mode="mixture")
    assert passes.services.started == {}
