"""Pass start-up: short generator passes on a pool of their own each, against passes on one stage service.

The RAG methods alternate short passes (Self-RAG: retrieval judgement, relevance judgements, answer; FLARE: a
look-ahead and a rewrite per round), and so do write-back training, mastery scoring and every evaluation grid.
A pass on a pool of its own starts a worker process, imports torch and transformers and loads the model; a
pass on the command's generator service (`wbrag_ray.stages.service`, what `GeneratorPasses` uses) sends the
rows the driver holds straight to a model loaded once (`Services.run_frame`: what the RAG methods, gates and
grids send). Each way runs the same PASSES passes of ROWS closed-book prompts with the bundled SmolLM2 in
fp32 (whatever the CPU); answers must be identical. Figures: total time, the mean time of a pass after the
first, and the start-up of a pass after the first (a one-row pass that generates one token: the wait for a
pass's first token), for each way, and their ratios.

    python -m benchmarks.passes [--quick] [--rounds N]
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

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

WAYS = ("own pool", "service, driver rows")


def _passes(questions: list[str], n_passes: int, way: str) -> tuple[list[float], float, list[list[str]]]:
    """(seconds of each pass, seconds of a one-row one-token pass after them, answers of each pass)."""
    import pandas as pd

    from wbrag_ray import prompts
    from wbrag_ray.config import GeneratorConfig
    from wbrag_ray.generation.passes import GeneratorPasses
    from wbrag_ray.generation.stage import GenerateStage
    from wbrag_ray.ray_runtime import local_dataset
    from wbrag_ray.stages.base import apply_stage

    config = GeneratorConfig(dtype="float32", max_new_tokens=8, num_cpus=1, threads=2)
    # another slice of questions per pass (a command's passes ask new prompts: the answer memo would
    # otherwise answer a repeated pass without decoding), and one more question for the one-row pass
    rows = (len(questions) - 1) // n_passes
    frame = pd.DataFrame({"id": range(len(questions)),
                          "prompt": [prompts.dumps(prompts.no_retrieval_messages(q)) for q in questions]})
    seconds, answers = [], []
    with GeneratorPasses(config) as passes:
        def one(rows: pd.DataFrame, tokens: int | None = None) -> list[str]:
            if way == "service, driver rows":
                out = passes.generate("p", rows, "prompt", "answer", tokens)
            else:  # a Ray Dataset pass on a pool of its own, as every pass ran before services
                own = config.model_copy(update={"max_new_tokens": tokens or config.max_new_tokens})
                out = apply_stage(local_dataset(rows), GenerateStage(own, "prompt", "answer")).to_pandas()
            return out.sort_values("id")["answer"].tolist()

        for i in range(n_passes):
            with Stopwatch() as sw:
                answers.append(one(frame.iloc[i * rows:(i + 1) * rows]))
            seconds.append(sw.seconds)
        with Stopwatch() as first_token:
            one(frame.iloc[-1:], 1)
    return seconds, first_token.seconds, answers


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(__doc__.splitlines()[0], argv)
    header("passes", args)
    n_passes, rows = (3, 4) if args.quick else (6, 6)  # 37 of the 40 demo questions: each pass its own
    report("passes", n_passes)
    report("rows per pass", rows)
    questions = [q["question"] for q in demo_questions()[: rows * n_passes + 1]]
    results = {}
    with local_ray():
        for way in WAYS:
            runs = [_passes(questions, n_passes, way) for _ in range(args.rounds)]
            best = min(runs, key=lambda r: sum(r[0]))  # a shared machine only ever slows a run down
            results[way] = best
            report(f"{way}: total", sum(best[0]), "s", 2)
            report(f"{way}: first pass", best[0][0], "s", 2)
            report(f"{way}: mean pass after the first", statistics.mean(best[0][1:]), "s", 2)
            report(f"{way}: start-up of a pass after the first (1 row, 1 token)", best[1], "s", 3)
    own = results[WAYS[0]]
    same = all(results[way][2] == own[2] for way in WAYS)
    report("identical answers, every way", same)
    for way in WAYS[1:]:
        got = results[way]
        report_ratio(f"total time, own pool / {way}", sum(own[0]), sum(got[0]))
        report_ratio(f"pass after the first, own pool / {way}", statistics.mean(own[0][1:]),
                     statistics.mean(got[0][1:]))
        report_ratio(f"start-up after the first, own pool / {way}", own[1], got[1])
    report_pressure("after")
    return 0 if same else 1


if __name__ == "__main__":
    run_module_main(main)
