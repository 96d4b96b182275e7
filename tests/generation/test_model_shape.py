"""A model's shape checked against its engine's settings before any work (`generation.vllm.check_shape`), read
from the model itself without loading it (`models.size.model_size`: a folder's config.json, a GGUF file's
metadata, a hub id's config.json in this machine's cache, the known models' table): a tensor-parallel size that
vLLM cannot shard the attention or key-value heads over, a max_model_len past the model's context, a token budget
that leaves no room for a prompt. Each is one line, exit 2, from the real `wbrag run` in a fresh process that
neither imports Ray, torch or vLLM nor starts a cluster (`tests/test_user_mistakes.assert_refused_fast`). Before
this check, tensor_parallel_size=2 on the bundled SmolLM2 started a Ray cluster, the service actor and vLLM's
engine, failed inside it with a pydantic traceback, and sent the pass again to the dead actor for 45 s.

A refusal raised in a service actor's setup (what the driver cannot see: here a model without the chat template
the config asks for) ends the pass at once, as itself: the actor is not dead and the call is not sent again.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

import pytest

from tests.conftest import DEMO_CORPUS
from tests.test_user_mistakes import assert_refused_fast
from wbrag_ray.config import ConfigError, GeneratorConfig
from wbrag_ray.generation.vllm import VLLMGenerator, check_shape
from wbrag_ray.models.size import model_size

# SmolLM2-135M's own config.json values (its GGUF metadata, the bundled model, says the same)
SMOLLM2 = {"model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
           "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152, "max_position_embeddings": 8192,
           "tie_word_embeddings": True}


def config_folder(path: Path, **shape) -> str:
    """A model folder holding only a config.json (SmolLM2's, with `shape` over it): all the check reads."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**SMOLLM2, **shape}))
    return str(path)


def test_the_bundled_gguf_is_read_from_its_metadata_and_splits_over_1_3_or_9_ranks():
    size = model_size("bundled:smollm2")
    assert size.source == "from its GGUF metadata"
    assert (size.heads, size.kv_heads, size.head_dim, size.layers, size.context) == (9, 3, 64, 30, 8192)
    assert size.params == pytest.approx(134.5e6, rel=0.001)  # the known figure, now counted from the file
    # 9 heads over 3 ranks: 3 each, and the 3 key-value heads one each; over 9: each KV head on 3 ranks
    assert size.tensor_parallel_sizes(12) == [1, 3, 9]
    assert "9 attention heads do not split evenly over 2 ranks" in size.tensor_parallel_refusal(2)


def test_key_value_heads_split_over_the_ranks_or_repeat_on_them_as_vllm_shards_them(tmp_path):
    """vLLM's QKVParallelLinear: fewer ranks than KV heads split them (tp divides kv), more repeat each on
    tp / kv ranks (kv divides tp); 12 heads and 4 KV heads: 3 and 6 divide the heads but not the KV heads' way."""
    size = model_size(config_folder(tmp_path / "gqa", num_attention_heads=12, num_key_value_heads=4, head_dim=64))
    assert size.source == "from its config.json"
    assert size.tensor_parallel_sizes(12) == [1, 2, 4, 12]
    assert "4 key-value heads neither split evenly over 3 ranks" in size.tensor_parallel_refusal(3)
    assert "4 key-value heads neither split evenly over 6 ranks" in size.tensor_parallel_refusal(6)


def write_config(tmp_path: Path, generator: str) -> list[str]:
    config = tmp_path / "c.yaml"
    config.write_text(f"ingest:\n  corpus: {DEMO_CORPUS}\ngenerator:\n  backend: vllm\n{generator}")
    return ["run", str(config), "--run", str(tmp_path / "run")]


@pytest.mark.parametrize("generator, words", [
    ("  tensor_parallel_size: 2\n",
     ["generator.tensor_parallel_size=2", "'bundled:smollm2'", "9 attention heads do not split evenly over 2 ranks",
      "from its GGUF metadata", "choose one of 1, 3, 9"]),
    ("  tensor_parallel_size: 3\n  model: {gqa}\n",
     ["generator.tensor_parallel_size=3", "4 key-value heads neither split evenly over 3 ranks",
      "from its config.json", "choose one of 1, 2, 4, 12"]),
    ("  vllm_engine_kwargs:\n    max_model_len: 9000\n",
     ["generator.vllm_engine_kwargs.max_model_len=9,000 is longer than the context", "(8,192 tokens",
      "set it to 8192 or less"]),
    ("  max_new_tokens: 4096\n",
     ["generator.max_new_tokens=4096 leaves no room for a prompt", "context of 4,096 tokens"]),
])
def test_a_model_its_engine_settings_do_not_fit_is_one_line_before_ray(tmp_path, generator, words):
    gqa = config_folder(tmp_path / "gqa", num_attention_heads=12, num_key_value_heads=4, head_dim=64)
    args = write_config(tmp_path, generator.format(gqa=gqa))
    start = time.perf_counter()
    assert_refused_fast(args, *words)
    assert time.perf_counter() - start < 30  # seconds of imports, not a cluster and an engine (45 s before)
    assert not (tmp_path / "run").exists()  # refused with the run's inputs, before the plan is stored


def test_the_sizes_that_fit_pass_and_the_engine_keeps_within_a_short_context(tmp_path):
    check_shape(GeneratorConfig(backend="vllm", tensor_parallel_size=3))  # SmolLM2 over 3 ranks (run for real
    check_shape(GeneratorConfig(backend="vllm", tensor_parallel_size=9))  # in tests/generation/test_vllm_tp_cpu.py)
    check_shape(GeneratorConfig(backend="hf", max_new_tokens=5000))  # no engine context: hf checks each prompt
    # a model of 2,048 positions runs with max_model_len 2048, not the 4096 default vLLM would refuse
    short = config_folder(tmp_path / "short", max_position_embeddings=2048)
    assert VLLMGenerator(GeneratorConfig(backend="vllm", model=short)).engine_kwargs()["max_model_len"] == 2048
    with pytest.raises(ConfigError, match="zerorag.qa_generator.max_new_tokens=2048 leaves no room"):
        check_shape(GeneratorConfig(backend="vllm", model=short, max_new_tokens=2048), "zerorag.qa_generator")


def test_a_hub_id_whose_config_is_not_here_is_said_unchecked_not_refused(caplog):
    with caplog.at_level(logging.WARNING):
        check_shape(GeneratorConfig(backend="vllm", model="some-org/some-model-not-downloaded", num_gpus=2))
    assert model_size("some-org/some-model-not-downloaded").heads is None
    assert "its shape could not be read here" in caplog.text
    assert "generator.tensor_parallel_size=2 was not checked" in caplog.text
    # a known model needs no file: Llama 3.3 70B's 64 heads and 8 KV heads are in the table
    with pytest.raises(ConfigError, match="64 attention heads do not split evenly over 3 ranks"):
        check_shape(GeneratorConfig(backend="vllm", model="meta-llama/Llama-3.3-70B-Instruct", num_gpus=3))


@pytest.mark.usefixtures("one_command")
def test_a_refusal_in_a_service_actors_setup_ends_the_pass_at_once_as_itself(ray_cluster, tiny, tmp_path, caplog):
    """A model without a chat template, with generator.chat_template on: the hf backend refuses it once loaded,
    in the service's actor. Before, the actor died in its constructor and each call was sent again to it after
    back-offs (1 + 2 + 4 + 8 + 15 s) before the pass failed with ActorDiedError."""
    import pandas as pd

    from wbrag_ray import prompts
    from wbrag_ray.generation.passes import GeneratorPasses

    base = tmp_path / "no-template"
    shutil.copytree(tiny.generator, base)
    settings = json.loads((base / "tokenizer_config.json").read_text())
    settings.pop("chat_template", None)
    (base / "tokenizer_config.json").write_text(json.dumps(settings))
    (base / "chat_template.jinja").unlink(missing_ok=True)
    config = GeneratorConfig(model=str(base), dtype="float32", max_new_tokens=4, num_cpus=1, threads=2)
    frame = pd.DataFrame({"id": [0, 1], "prompt": [prompts.dumps(prompts.no_retrieval_messages(q))
                                                   for q in ("Who wrote Hamlet?", "Name a river.")]})
    with caplog.at_level(logging.WARNING), GeneratorPasses(config) as passes:
        with pytest.raises(ConfigError, match="has no chat template; set generator.chat_template=false"):
            passes.generate("answers", frame, "prompt", "answer")
        with pytest.raises(ConfigError, match="has no chat template"):  # again, from the same actor, no new setup
            passes.generate("again", frame.iloc[:1], "prompt", "answer")
        # the actor is up; its one setup failed
        assert passes.services.actor_stats("setups") == {"generate": [0]}
    assert "retrying" not in caplog.text  # no call sent again (`ray_runtime.call_actor`'s back-offs)


def test_a_model_folder_on_object_storage_is_checked_by_its_config_json(s3_env):
    """On a real S3 server (moto, loopback): the driver reads the folder's config.json, not its weights."""
    from wbrag_ray.storage import resolve

    folder = "s3://wbrag/models/gqa-12"
    resolve(folder).join("config.json").write_json({**SMOLLM2, "num_attention_heads": 12, "num_key_value_heads": 4,
                                                    "head_dim": 64})
    assert model_size(folder).source == "from its config.json"
    with pytest.raises(ConfigError, match=r"generator.tensor_parallel_size=6 cannot shard generator.model "
                                          r"'s3://wbrag/models/gqa-12': its 4 key-value heads"):
        check_shape(GeneratorConfig(backend="vllm", model=folder, num_gpus=6))
