import pytest

from wbrag_ray.config import ConfigError, load_config, parse_overrides


def test_defaults_validate():
    c = load_config()
    assert c.generator.backend == "hf" and c.retrieval.top_k == 5 and c.index.factory == "auto"


def test_yaml_then_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("generator:\n  batch_size: 8\nretrieval:\n  top_k: 3\n")
    c = load_config(f, ["generator.batch_size=16", "index.factory=IVF16,Flat", "eval.limit=5"])
    assert c.generator.batch_size == 16 and c.retrieval.top_k == 3
    assert c.index.factory == "IVF16,Flat" and c.eval.limit == 5


def test_override_values_are_yaml_scalars():
    assert parse_overrides(["a.b=1", "a.c=true", "a.d=x y", "a.e=[1, 2]"]) == {"a": {"b": 1, "c": True, "d": "x y", "e": [1, 2]}}


def test_unknown_key_names_the_key_and_suggests_the_fix():
    with pytest.raises(ConfigError) as e:
        load_config(overrides=["generator.bath_size=4"])
    msg = str(e.value)
    assert "generator.bath_size" in msg and "generator.batch_size" in msg


def test_a_removed_key_says_it_was_removed_and_what_to_do(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("ray:\n  keep_services_s: 10\n")
    with pytest.raises(ConfigError, match="'ray.keep_services_s' was removed: .*delete the key"):
        load_config(f)


def test_bad_value_names_the_key_and_the_rule():
    with pytest.raises(ConfigError) as e:
        load_config(overrides=["retrieval.top_k=0"])
    assert "retrieval.top_k" in str(e.value) and "greater than or equal to 1" in str(e.value)
    with pytest.raises(ConfigError, match="generator.backend"):
        load_config(overrides=["generator.backend=tgi"])


def test_malformed_override_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="key=value"):
        load_config(overrides=["generator.batch_size"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(bad)


def test_a_set_list_value_is_read_as_yaml_and_a_text_setting_stays_text():
    """`--set` of a list setting (generator.stop: list[str]) is parsed as YAML, not kept as one string; a text
    setting keeps its text (a name such as 2024)."""
    from wbrag_ray.config import load_config

    config = load_config(overrides=['generator.stop=["\\n", "Question:"]', "eval.name=2024"])
    assert config.generator.stop == ["\n", "Question:"] and config.eval.name == "2024"


def test_batch_invariant_auto_is_on_for_one_gpu_and_off_for_a_tensor_parallel_replica():
    """generator.batch_invariant auto: on unless a replica is tensor-parallel (vLLM's batch invariance pins NCCL
    to one channel there); true and false as given; undecided (None) while tensor_parallel_size auto is."""
    from wbrag_ray.config import GeneratorConfig
    from wbrag_ray.run import settings_value

    assert GeneratorConfig().batch_invariant == "auto" and GeneratorConfig().batch_invariance() is True
    one = GeneratorConfig(backend="vllm", num_gpus=1)
    tp4 = GeneratorConfig(backend="vllm", num_gpus=4, tensor_parallel_size=4)
    pp2 = GeneratorConfig(backend="vllm", num_gpus=2, tensor_parallel_size=1, pipeline_parallel_size=2)
    assert one.batch_invariance() is True and pp2.batch_invariance() is True and tp4.batch_invariance() is False
    assert GeneratorConfig(backend="vllm", num_gpus=4).batch_invariance() is False  # tp = num_gpus / pp
    assert GeneratorConfig(backend="vllm", num_gpus=1, tensor_parallel_size="auto").batch_invariance() is None
    for value in (True, False):
        assert tp4.model_copy(update={"batch_invariant": value}).batch_invariance() is value
        assert one.model_copy(update={"batch_invariant": value}).batch_invariance() is value
    config = load_config(overrides=["generator.batch_invariant=false"])
    assert config.generator.batch_invariant is False
    # a stage's settings record the value in effect: a run made before the default was auto (true) is unchanged
    assert settings_value(one)["batch_invariant"] is True and settings_value(tp4)["batch_invariant"] is False
    with pytest.raises(ConfigError, match="batch_invariant"):
        load_config(overrides=["generator.batch_invariant=sometimes"])
