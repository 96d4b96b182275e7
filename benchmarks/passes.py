"""Pass start-up: short generator passes on a pool of their own each, against passes on one stage service.

The RAG methods alternate short passes (Self-RAG: retrieval judgement, relevance judgements, answer; FLARE: a
look-ahead and a rewrite per round), and so do write-back training, mastery scoring and every evaluation grid.
A pass on a pool of its own starts a worker process, imports torch and transformers and loads the model; a
pass on the command's generator service (`wbrag_ray.stages.service`, what `GeneratorPasses` uses) sends its
rows to a model loaded once. Both run the same PASSES passes of ROWS closed-book prompts with the bundled
SmolLM2 in fp32 (whatever the CPU); answers must be identical. Figures: total time, the mean time of a pass
after the first, and the time of a one-row pass after the first (how long a pass waits before its first
answer), for each way, and their ratios.

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


def _passes(questions: list[str], n_passes: int, shared: bool) -> tuple[list[float], float, list[list[str]]]:
    """(seconds of each pass, seconds of a one-row pass after them, answers of each pass)."""
    import pandas as pd

    from wbrag_ray import prompts
    from wbrag_ray.config import GeneratorConfig
    from wbrag_ray.generation.passes import GeneratorPasses, from_pandas, generate_pass

    config = GeneratorConfig(dtype="float32", max_new_tokens=8, num_cpus=1, threads=2)
    frame = pd.DataFrame({"id": range(len(questions)),
                          "prompt": [prompts.dumps(prompts.no_retrieval_messages(q)) for q in questions]})
    seconds, answers = [], []
    with GeneratorPasses(config) as passes:
        def one(rows: pd.DataFrame) -> list[str]:
            if shared:
                out = passes.generate("p", from_pandas(rows), "prompt", "answer")
            else:  # a pool of its own, as every pass ran before stage services
                out = generate_pass(config, from_pandas(rows), "prompt", "answer").to_pandas()
            return out.sort_values("id")["answer"].tolist()

        for _ in range(n_passes):
            with Stopwatch() as sw:
                answers.append(one(frame))
            seconds.append(sw.seconds)
        with Stopwatch() as first_answer:
            one(frame.iloc[:1])
    return seconds, first_answer.seconds, answers


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(__doc__.splitlines()[0], argv)
    header("passes", args)
    n_passes, rows = (3, 4) if args.quick else (6, 8)
    report("passes", n_passes)
    report("rows per pass", rows)
    questions = [q["question"] for q in demo_questions()[:rows]]
    results = {}
    with local_ray():
        for shared in (False, True):
            runs = [_passes(questions, n_passes, shared) for _ in range(args.rounds)]
            best = min(runs, key=lambda r: sum(r[0]))  # a shared machine only ever slows a run down
            results[shared] = best
            name = "service" if shared else "own pool"
            report(f"{name}: total", sum(best[0]), "s", 2)
            report(f"{name}: first pass", best[0][0], "s", 2)
            report(f"{name}: mean pass after the first", statistics.mean(best[0][1:]), "s", 2)
            report(f"{name}: one-row pass after the first", best[1], "s", 2)
    own, service = results[False], results[True]
    report("identical answers, service vs own pool", own[2] == service[2])
    report_ratio("total time, own pool / service", sum(own[0]), sum(service[0]))
    report_ratio("pass after the first, own pool / service", statistics.mean(own[0][1:]),
                 statistics.mean(service[0][1:]))
    report_ratio("one-row pass after the first, own pool / service", own[1], service[1])
    report_pressure("after")
    return 0 if own[2] == service[2] else 1


if __name__ == "__main__":
    run_module_main(main)
