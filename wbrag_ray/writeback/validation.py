"""A write-back version's own validation (`writeback.validation`): part of the training questions is held out of
training and answered with the base alone and with base + the version, so a version that hurts is seen before it
is activated.

The held-out questions are chosen by a hash of their ids (the same ones whatever the file's order), the version is
trained on the others, and both evaluations run in one command with the version's RAG method, so a question whose
top K the version leaves alone keeps its base answer; won and lost are counted where the top K changed
(`evaluation.effect`). The result is RUN/writeback/<version>/validation.json, and with whether the version was
activated it is also in the version's stats (`pipeline.train_writeback`); `versions.hurts` says why a version hurt.
Under 'auto' (the default) a training set of fewer than `config.AUTO_VALIDATION_MIN` questions holds nothing out,
and the stats say why (`skipped`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from wbrag_ray.config import AUTO_VALIDATION_MIN, WbragConfig, WritebackConfig
from wbrag_ray.run import RunFolder


def held_out(ids: Sequence[str], fraction: float | None) -> set[str]:
    """round(fraction x n) of the ids (at least one), the ones whose hash comes first: none without a fraction."""
    if not fraction or not ids:
        return set()
    n = max(1, round(fraction * len(ids)))
    return set(sorted(ids, key=lambda i: hashlib.blake2b(i.encode(), digest_size=8).digest())[:n])


def split(questions: pa.Table, fraction: float | None) -> tuple[pa.Table, pa.Table]:
    """(the questions to train on, the held-out ones)."""
    ids = [str(i) for i in questions["id"].to_pylist()]
    out = held_out(ids, fraction)
    mask = pa.array([i in out for i in ids], pa.bool_())
    return questions.filter(pc.invert(mask)), questions.filter(mask)


def skipped(wb: WritebackConfig, questions: int) -> str | None:
    """Why nothing is held out of `questions` training questions (None: a fraction is)."""
    if wb.validation is None:
        return "off (writeback.validation: null)"
    if wb.validation_fraction(questions) is None:
        return f"skipped, only {questions} training questions (auto needs {AUTO_VALIDATION_MIN})"
    return None


def validate(run: RunFolder, config: WbragConfig, train: str, version: str, metric: str,
             force: bool = False) -> dict[str, Any] | str:
    """Base vs base + `version` on the held-out training questions, by `metric` (the gates' metric); or why nothing
    was held out (`skipped`)."""
    from wbrag_ray.evaluation.effect import writeback_effect
    from wbrag_ray.evaluation.evaluate import evaluate_stage
    from wbrag_ray.evaluation.stage import union_settings
    from wbrag_ray.formats import read_questions
    from wbrag_ray.generation.passes import GeneratorPasses

    wb = config.writeback
    if wb.validation is None:  # off: the training file is not read again
        return skipped(wb, 0) or ""
    questions, _ = read_questions(train, "writeback.train", limit=wb.limit)
    why = skipped(wb, questions.num_rows)
    if why:
        print(f"write-back {version}: validation {why}", flush=True)
        return why
    folder = run.layout.writeback_version(version)
    folder.validation_questions.write_table(split(questions, wb.validation_fraction(questions.num_rows))[1])
    method = wb.rag_method
    cfg = config.model_copy(update={"eval": config.eval.model_copy(update={"methods": [method], "limit": None})})
    label, dataset = f"writeback-{version}-validation", folder.validation_questions.uri
    with GeneratorPasses(config.generator) as passes:  # one command: an unchanged top K keeps its answer
        evaluate_stage(run, cfg, dataset, label, f"{label}-base", force=force, passes=passes)
        evaluate_stage(run, cfg, dataset, label, label, force=force, passes=passes, writeback_version=version,
                       setting=f"base+writeback:{version}")
    base, union = (run.layout.eval_result(name, method).predictions.read_table().to_pandas()
                   for name in (f"{label}-base", label))
    result = {"version": version, "method": method, "metric": metric, "base": round(float(base[metric].mean()), 4),
              "with_version": round(float(union[metric].mean()), 4), **union_settings(config),
              **writeback_effect(base, union, metric)}
    folder.validation.write_json(result)
    print(format_validation(result), flush=True)
    return result


def format_validation(r: dict[str, Any]) -> str:
    return (f"write-back {r['version']} on {r['questions']} held-out training questions ({r['method']}, union "
            f"{r['union']}): {r['metric']} base {r['base']:.3f}, base + version {r['with_version']:.3f}; a unit in the "
            f"top K of {r['unit_in_top_k']}, won {r['won']}, lost {r['lost']}")
