"""What resumability costs (issue 26): the same pass with and without its row-level checkpoint, in one run.

- generation: closed-book answers to ROWS distinct prompts with the bundled SmolLM2 in fp32 through
  `GeneratorPasses` (a stage service), outside a stage (no checkpoint) and inside one (`stage_checkpoint`: every
  answer committed to the stage's answer store, in blocks of `generator.checkpoint_rows`, here also 16 to
  commit often); the answers must be identical.
- prediction: the embedding pruner's head over N synthetic sentence vectors (Ray Data: read, predict, write),
  written plainly and through `resumable_write` (Ray Data's CheckpointConfig on the sid column).

The ways alternate round by round and the best round of each counts (a shared machine only slows a run).

    python -m benchmarks.checkpoints [--quick] [--rounds N]
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path

from benchmarks.common import (
    Stopwatch,
    demo_questions,
    header,
    local_ray,
    parse_args,
    report,
    report_pressure,
    report_ratio,
    run_module_main,
)


def _generation(rows: int, rounds: int, root: Path) -> bool:
    import pandas as pd

    from wbrag_ray import prompts
    from wbrag_ray.checkpoints import stage_checkpoint
    from wbrag_ray.config import GeneratorConfig
    from wbrag_ray.generation.passes import GeneratorPasses
    from wbrag_ray.storage import resolve

    questions = [q["question"] for q in demo_questions()]
    asked = [f"{questions[i % len(questions)]} ({i // len(questions) + 1})" for i in range(rows)]
    frame = pd.DataFrame({"id": range(rows), "prompt": [prompts.dumps(prompts.no_retrieval_messages(q)) for q in asked]})
    config = GeneratorConfig(dtype="float32", max_new_tokens=8, num_cpus=1, threads=2)
    ways = {"no checkpoint": None, "checkpoint, blocks of 1024": 1024, "checkpoint, blocks of 16": 16}
    best: dict[str, float] = {}
    answers: dict[str, list[str]] = {}
    with GeneratorPasses(config) as passes:
        passes.generate("warm-up", frame.iloc[:2], "prompt", "answer")  # the model loads once, outside the timing
        for r in range(rounds):
            for way, block_rows in ways.items():
                passes._memo = type(passes._memo)()  # every round decodes every prompt
                cfg = config if block_rows is None else config.model_copy(update={"checkpoint_rows": block_rows})
                with Stopwatch() as sw:
                    if block_rows is None:
                        out = passes.generate("p", frame, "prompt", "answer", generator=cfg)
                    else:
                        folder = resolve(str(root / f"gen-{r}-{block_rows}"))
                        with stage_checkpoint(folder, None, "bench"):
                            out = passes.generate("p", frame, "prompt", "answer", generator=cfg)
                best[way] = min(best.get(way, float("inf")), sw.seconds)
                answers[way] = out.sort_values("id")["answer"].tolist()
    for way, seconds in best.items():
        report(f"generation, {way}: best of {rounds}", seconds, "s", 2)
    for way in list(ways)[1:]:
        report_ratio(f"generation, {way} / no checkpoint", best[way], best["no checkpoint"])
    same = all(a == answers["no checkpoint"] for a in answers.values())
    report("generation: identical answers every way", same)
    return same


def _prediction(n: int, rounds: int, root: Path) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import ray.data

    from wbrag_ray.checkpoints import resumable_write, stage_checkpoint
    from wbrag_ray.ray_runtime import LIGHT_CPUS, stable_names
    from wbrag_ray.stages.base import apply_stage
    from wbrag_ray.stages.pruner import EmbeddingPredictStage
    from wbrag_ray.storage import resolve

    dim, files, rng = 384, 8, np.random.default_rng(0)
    src = root / "vectors"
    src.mkdir()
    per = n // files
    for f in range(files):  # one file per ingest shard, as the embed stage writes them
        vectors = rng.standard_normal((per, dim), dtype=np.float32)
        pq.write_table(pa.table({"sid": np.arange(f * per, (f + 1) * per, dtype=np.int64),
                                 "vector": pa.FixedSizeListArray.from_arrays(vectors.ravel(), dim)}), src / f"{f}.parquet")
    weights = {"w0": rng.standard_normal((dim, 128), dtype=np.float32) * 0.05, "b0": np.zeros(128, np.float32),
               "w1": rng.standard_normal((128, 1), dtype=np.float32) * 0.05, "b1": np.zeros(1, np.float32)}

    stage = EmbeddingPredictStage(weights)

    def predicted(_placed=None):  # resumable_write passes the placement it runs with: this pass never resumes
        ds = ray.data.read_parquet(str(src), override_num_blocks=files, num_cpus=stage.resources.num_cpus)
        return apply_stage(ds.select_columns(["sid", "vector"]), stage)

    block_bytes = 100_000 * 16  # zerorag.checkpoint_rows' default: 100,000 scores per block
    best = {"plain write": float("inf"), "resumable write": float("inf")}
    for r in range(rounds):
        out = resolve(str(root / f"plain-{r}"))
        ctx = ray.data.DataContext.get_current()
        saved, ctx.target_max_block_size = ctx.target_max_block_size, max(64 << 10, block_bytes)
        with Stopwatch() as sw:
            predicted().write_parquet(out.path, filename_provider=stable_names("pred"),
                                      ray_remote_args={"num_cpus": LIGHT_CPUS})
        ctx.target_max_block_size = saved
        best["plain write"] = min(best["plain write"], sw.seconds)
        plain_rows = out.num_rows()
        with Stopwatch() as sw, stage_checkpoint(resolve(str(root / f"ckpt-{r}")), None, "bench"):
            written = resumable_write(predicted, resolve(str(root / f"resumable-{r}")), "sid", "pred", block_bytes,
                                      "bench", n, stage.resources, None)
        best["resumable write"] = min(best["resumable write"], sw.seconds)
        assert written["rows"] == plain_rows == per * files, (written, plain_rows)
    for way, seconds in best.items():
        report(f"prediction of {per * files:,} sentences, {way}: best of {rounds}", seconds, "s", 2)
    report_ratio("prediction, resumable / plain", best["resumable write"], best["plain write"])


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(__doc__.splitlines()[0], argv, rounds=(2, 1))
    header("checkpoints", args)
    rows, n = (24, 200_000) if args.quick else (120, 1_000_000)
    with tempfile.TemporaryDirectory() as tmp, local_ray():
        same = _generation(rows, args.rounds, Path(tmp))
        _prediction(n, args.rounds, Path(tmp))
    report_pressure("after")
    return 0 if same else 1


if __name__ == "__main__":
    run_module_main(main)
