"""Declared run stages: a fingerprint derived from the declared config paths (placement and runtime-only keys left
out, `dtype: auto` resolved), the call's parameters and the inputs' fingerprints; a complete stage with another
fingerprint is refused or redone, never silently reused."""

import typing

import pytest
from pydantic import BaseModel

from wbrag_ray import build_kb
from wbrag_ray.config import ConfigError, WbragConfig, load_config
from wbrag_ray.evaluation.evaluate import EVAL
from wbrag_ray.models import hardware
from wbrag_ray.run import PLACEMENT_KEYS, RunFolder, RunStage
from wbrag_ray.writeback.versions import WRITEBACK
from wbrag_ray.zerorag.mastery import MASTERY
from wbrag_ray.zerorag.prune import PREDICT, PRUNE
from wbrag_ray.zerorag.pruners import PRUNERS
from wbrag_ray.zerorag.router import ROUTER
from wbrag_ray.zerorag.tune import TUNE

DECLARED = [*build_kb.KB_STAGES, MASTERY, *PRUNERS.values(), PREDICT, PRUNE, TUNE, ROUTER, WRITEBACK, EVAL]
PARAMS = {"ratio": 0.3, "version": "v1", "method": "flare", "label": "t"}


def _leaves(model: BaseModel, prefix: str):
    """(dotted path, field name, owning model) of every scalar setting under `model`."""
    for name, field in type(model).model_fields.items():
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            yield from _leaves(value, f"{prefix}.{name}")
        else:
            yield f"{prefix}.{name}", name, model, field


def _other_values(value, field) -> list:
    """Valid values other than `value` for a field (a Literal's other choices, a number nudged, ...)."""
    choices = [a for arg in typing.get_args(field.annotation) for a in (typing.get_args(arg) or [arg])]
    literals = [c for c in typing.get_args(field.annotation) if not isinstance(c, type)]
    if literals and all(isinstance(c, str) for c in literals):
        return [c for c in literals if c != value]
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, int):
        return [value + 1]
    if isinstance(value, float):
        return [value / 2 if value else 0.5]
    if isinstance(value, str) and int in choices:  # 'auto' or a number (index.num_shards)
        return [2]
    if isinstance(value, str):
        return [value + "-other"]
    if isinstance(value, list):
        return [[*value, value[0] if value else 0.5]]
    if isinstance(value, dict):
        return [{**value, "other": 1}]
    if value is None and str in choices:
        return ["other"]
    return []


def _changed(config: WbragConfig, owner: BaseModel, name: str, new) -> WbragConfig:
    data = config.model_dump(mode="json")
    path = _path_of(config, owner)
    node = data
    for part in path:
        node = node[part]
    node[name] = new
    return WbragConfig.model_validate(data)


def _path_of(config: BaseModel, target: BaseModel, prefix=()):
    if config is target:
        return prefix
    for name in type(config).model_fields:
        value = getattr(config, name)
        if isinstance(value, BaseModel):
            found = _path_of(value, target, (*prefix, name))
            if found is not None:
                return found
    return None


@pytest.mark.parametrize("stage", DECLARED, ids=lambda s: s.name)
def test_every_declared_setting_changes_the_fingerprint_and_placement_does_not(stage: RunStage):
    # explicit dtypes: with `auto`, moving to a GPU does change the dtype (and so the fingerprint)
    config = load_config(overrides=["zerorag.qa_generator.model=bundled:smollm2", "generator.dtype=float32",
                                    "embedder.dtype=float32", "zerorag.qa_generator.dtype=float32"])
    before = stage.config_settings(config, PARAMS)
    assert before, f"{stage.name} declares no settings"
    changed, placement = 0, 0
    for declared in before:
        root = config
        for part in declared.split("."):
            root = getattr(root, part)
        leaves = list(_leaves(root, declared)) if isinstance(root, BaseModel) else [(declared, None, None, None)]
        for path, name, owner, field in leaves:
            if owner is None:  # a declared scalar: its owner is the section above it
                section, name = declared.rsplit(".", 1)
                owner = config
                for part in section.split("."):
                    owner = getattr(owner, part)
                field = type(owner).model_fields[name]
            afters = []
            for new in _other_values(getattr(owner, name), field):
                try:
                    afters.append(stage.config_settings(_changed(config, owner, name, new), PARAMS))
                except ValueError:  # a nudged value outside the field's range
                    continue
            if not afters:
                continue
            ignored = any(path == i or path.startswith(i + ".") for i in stage.ignore)
            if name in PLACEMENT_KEYS or name in type(owner).RUNTIME_KEYS or ignored:
                assert all(a == before for a in afters), f"{stage.name}: {path} is placement, yet changed the fingerprint"
                placement += 1
            else:  # 'auto' and 'float32' are one dtype on a CPU without bf16: some other value must differ
                assert any(a != before for a in afters), f"{stage.name}: changing {path} left the fingerprint unchanged"
                changed += 1
    assert changed >= len(before)


def test_dtype_auto_counts_as_the_dtype_this_cpu_uses(monkeypatch):
    config = load_config(overrides=["generator.dtype=auto"])
    monkeypatch.setattr(hardware, "cpu_supports_bf16", lambda: True)
    with_bf16 = MASTERY.config_settings(config, {})
    monkeypatch.setattr(hardware, "cpu_supports_bf16", lambda: False)
    without = MASTERY.config_settings(config, {})
    assert with_bf16["generator"]["dtype"] == "bfloat16" and without["generator"]["dtype"] == "float32"
    # explicit bf16 is the same on both CPU kinds
    explicit = load_config(overrides=["generator.dtype=bfloat16"])
    assert MASTERY.config_settings(explicit, {})["generator"]["dtype"] == "bfloat16"


A = RunStage("a", settings=("zerorag.sample",), command="make a")
B = RunStage("b-{n}", settings=("zerorag.seed",), requires=(A,), command="make b")
C = RunStage("c", settings=("eval.limit",), requires=(A,), on_change="redo")


def test_a_run_stage_is_refused_or_redone_when_its_settings_or_inputs_change(tmp_path, capsys):
    run = RunFolder(str(tmp_path / "run"))
    calls = []

    def work(name):
        return lambda: calls.append(name) or {"rows_out": 1}

    config = load_config()
    with pytest.raises(ConfigError, match="stage 'a' .* not complete; run `make a` first"):
        run.execute(B, config, work("b"), params={"n": 1})
    run.execute(A, config, work("a"))
    run.execute(B, config, work("b"), params={"n": 1})
    run.execute(C, config, work("c"))
    assert calls == ["a", "b", "c"]

    # the same settings, a wider placement: skipped
    wider = load_config(overrides=["generator.concurrency=4", "embedder.num_cpus=2"])
    run.execute(A, wider, work("a"))
    run.execute(B, wider, work("b"), params={"n": 1})
    assert calls == ["a", "b", "c"] and "[b-1] complete, skipped" in capsys.readouterr().out

    # a declared setting changed: refused (with the changed path), redone with force
    other = load_config(overrides=["zerorag.seed=7"])
    with pytest.raises(ConfigError, match=r"stage 'b-1' .*config\.zerorag\.seed: 0 -> 7.*--force"):
        run.execute(B, other, work("b"), params={"n": 1})
    run.execute(B, other, work("b"), params={"n": 1}, force=True)
    assert calls[-1] == "b"

    # another parameter is another stage
    run.execute(B, config, work("b2"), params={"n": 2})
    assert run.is_complete("b-2") and calls[-1] == "b2"

    # an input redone with other settings: the stages reading it are refused (b) or redone (c)
    resampled = load_config(overrides=["zerorag.sample=5"])
    run.execute(A, resampled, work("a"), force=True)
    with pytest.raises(ConfigError, match=r"inputs\.a\.config\.zerorag\.sample"):
        run.execute(B, resampled, work("b"), params={"n": 2})
    n = len(calls)
    run.execute(C, resampled, work("c"))
    assert calls[n:] == ["c"] and "settings changed" in capsys.readouterr().out


def test_bind_config_refuses_only_what_would_change_the_built_knowledge_base(tmp_path):
    run = RunFolder(str(tmp_path / "run"))
    config = load_config()
    run.bind_config(config, guard=build_kb.KB_STAGES)
    run.execute(build_kb.INGEST, config, lambda: {"rows_out": 1})
    run.bind_config(load_config(overrides=["generator.model=other"]), guard=build_kb.KB_STAGES)
    with pytest.raises(ConfigError, match="different config.*ingest.max_passage_chars"):
        run.bind_config(load_config(overrides=["ingest.max_passage_chars=99"]), guard=build_kb.KB_STAGES)
