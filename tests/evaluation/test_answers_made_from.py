"""Answers are keyed by what made them: an adapter retrained in place (`wbrag tune --force`: new weights at the same
path) is another input to the evaluation's fingerprint, its answer keys and the generator service that loads it,
so no answer of the old adapter is ever reused; a write-back index's provenance is cached by its files' identity."""

import pandas as pd
import pytest

from tests.conftest import demo_questions, write_jsonl
from wbrag_ray.config import ConfigError, load_config
from wbrag_ray.run import RunFolder


def _adapter(generator: str, path, seed: int) -> None:
    """A random LoRA adapter of the tiny generator (not the identity a fresh adapter is): trained anew, in place."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(generator)
    lora = LoraConfig(r=4, lora_alpha=256, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(model, lora).save_pretrained(str(path))


def test_an_adapter_retrained_in_place_never_has_the_old_ones_answers_reused(tmp_path, tiny, ray_cluster,
                                                                             monkeypatch, capsys):
    from wbrag_ray import api
    from wbrag_ray.checkpoints import progress
    from wbrag_ray.evaluation import evaluate as evaluate_module
    from wbrag_ray.generation.passes import AnswerMemo
    from wbrag_ray.generation.stage import GenerateStage

    adapter = tmp_path / "adapter"
    _adapter(tiny.generator, adapter, seed=0)
    config = load_config(overrides=[*tiny.overrides(), "eval.methods=[no-retrieval]", "generator.max_new_tokens=6",
                                    f"generator.lora_adapter={adapter}"])
    run = RunFolder(str(tmp_path / "run"))
    run.bind_config(config)
    qa = write_jsonl(tmp_path / "qa.jsonl", demo_questions(4))

    def predictions() -> list[str]:
        return run.layout.eval_result("qa", "no-retrieval").predictions.read_table()["prediction"].to_pylist()

    # the evaluation with the first adapter runs to the end (and is stopped after)
    api.evaluate(run, config, str(qa), "qa")
    first = predictions()
    # `wbrag eval` starts with the departures of the papers it follows and ends with the paper-vs-run table
    printed = capsys.readouterr().out
    # a generator neither paper ran: one line, the count and where they are listed (metrics.json holds them)
    assert "this run departs from WriteBack-RAG and Zero-RAG in " in printed and "listed in every evaluation's" in printed
    departures = run.layout.eval_result("qa", "no-retrieval").metrics.read_json()["departures"]
    assert any(d["what"].startswith("the generator is " + str(config.generator.model)) for d in departures)
    assert printed.rstrip().endswith("wbrag_ray/paper_numbers.py)")  # nothing here to set beside the papers' numbers
    stage = GenerateStage(config.generator)
    keys = AnswerMemo._keys(pd.DataFrame({"prompt": ["p"]}), stage)

    # the adapter retrained with --force: a rerun is refused, naming it, instead of showing the old results
    _adapter(tiny.generator, adapter, seed=1)
    with pytest.raises(ConfigError, match=r"made_from\.generator\.lora_adapter"):
        api.evaluate(run, config, str(qa), "qa")
    # and every answer key of the new adapter differs from the old one's (the same path, other weights)
    assert AnswerMemo._keys(pd.DataFrame({"prompt": ["p"]}), GenerateStage(config.generator)) != keys

    # killed part way: its answers are committed to the stage's checkpoint, no results written
    def killed(*args, **kwargs):
        raise RuntimeError("killed")

    monkeypatch.setattr(evaluate_module, "scored_answers", killed)
    with pytest.raises(RuntimeError, match="killed"):
        api.evaluate(run, config, str(qa), "qa", force=True)
    monkeypatch.undo()
    assert progress(run.layout.checkpoint("eval-qa"))["committed"] == 4

    # retrained again, then the rerun: nothing resumed from the checkpoint, every answer decoded by the new adapter
    # (not by a generator service a command before left up with the old one loaded)
    _adapter(tiny.generator, adapter, seed=2)
    api.evaluate(run, config, str(qa), "qa", force=True)
    stats = run.stats("eval-qa")
    assert stats.get("rows_resumed", 0) == 0 and stats["rows_computed"] == 4
    assert predictions() != first


def test_a_gpus_auto_dtype_resolves_by_its_kind_and_the_device_is_named(monkeypatch):
    from wbrag_ray import identity

    monkeypatch.setattr(identity, "gpu_kind", lambda: "H100")
    assert identity.decoding_device("auto", 1.0) == ("bfloat16", "gpu H100")
    monkeypatch.setattr(identity, "gpu_kind", lambda: "T4")
    assert identity.decoding_device("auto", 1.0) == ("float16", "gpu T4")  # no bf16 there: torch takes fp16
    assert identity.decoding_device("float32", 1.0) == ("float32", "gpu T4")
    assert identity.decoding_device("float32", 0.0) == ("float32", "cpu")


def test_a_write_back_index_trained_again_in_place_has_its_new_provenance_read(tmp_path):
    """A long-lived process (a notebook, a job server) searches a version, the version is trained again at the same
    place, and a new service reads the new units' sources, not the cached ones."""
    import os

    from wbrag_ray.retrieval.local import provenance as read_once
    from wbrag_ray.retrieval.union import write_provenance
    from wbrag_ray.storage import resolve

    index = resolve(str(tmp_path / "wb-index"))
    index.mkdir()
    write_provenance(index, [1, 2], [[10], [20]], "passage")

    def provenance():
        return read_once(index.uri, "passage")

    assert provenance() == {1: [10], 2: [20]}
    write_provenance(index, [1, 2], [[11], [21]], "passage")
    f = index.join("provenance.parquet").path
    os.utime(f, ns=(os.stat(f).st_atime_ns, os.stat(f).st_mtime_ns + 1_000_000_000))  # a later write, surely
    assert provenance() == {1: [11], 2: [21]}
