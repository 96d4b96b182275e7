"""Feeding a vLLM engine in a bulk pass: one blocking call at a time against several calls sharing the engine.

A bulk pass of a command (write-back scoring's answers, the document gate, distillation, mastery) sends its rows
to the generator service's actor in batches. `generator.calls_per_engine: 1` is the old way: the actor runs one
call at a time, `LLM.chat` steps the engine until that call's longest answer is done, and the engine idles while
the answers travel back and the next batch is templated and tokenized. The default (4) runs several calls at once
on the actor, their requests added to one running engine (`wbrag_ray.generation.vllm_feed`): the next batch
joins while the last one's tail decodes.

Both run the same pass on a command's generator service on a local Ray cluster (the real path: `GeneratorPasses`
over rows the driver holds), vLLM's CPU build, the bundled SmolLM2-135M in fp32, greedy, the RAG prompts of the
demo, answers of mixed lengths (every other question asks for an explanation). Figures:
the pass's time and rows/s each way (best of `--rounds`), the ratio, the engine start (once per service), and how
many answers are identical (greedy on CPU: a batch's composition may change float rounding, rarely an answer).

    python -m benchmarks.vllm_feeding [--quick] [--rounds N]
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

from benchmarks.common import (
    Stopwatch,
    demo_rag_prompts,
    header,
    local_ray,
    parse_args,
    report,
    report_pressure,
    report_ratio,
    run_module_main,
)

MAX_NEW_TOKENS = 48
BATCH = 2  # generator.batch_size: a service call holds 4 x this many rows


def run_pass(calls: int, frame, rounds: int) -> tuple[list[str], float, float]:
    """(answers, best seconds, engine start seconds) of the pass on a service whose engine takes `calls` calls."""
    import time

    from wbrag_ray.config import GeneratorConfig
    from wbrag_ray.generation.passes import GeneratorPasses

    config = GeneratorConfig(model="bundled:smollm2", backend="vllm", dtype="float32", max_new_tokens=MAX_NEW_TOKENS,
                             batch_size=BATCH, num_cpus=1, threads=2, calls_per_engine=calls)
    best, answers = float("inf"), []
    with GeneratorPasses(config) as passes:
        t0 = time.perf_counter()
        passes.generate("warm-up", frame.head(2), "prompt", "answer", max_new_tokens=2)  # starts the engine
        start = time.perf_counter() - t0
        for r in range(rounds):
            # its own memo each round: every prompt goes to the engine again
            rerun = GeneratorPasses(config, passes.services)
            with Stopwatch() as sw:
                out = rerun.generate(f"pass-{r}", frame, "prompt", "answer")
            best, answers = min(best, sw.seconds), list(out["answer"])
        at_once = max(passes.services.actor_stats("most_running")["generate"])
    report(f"calls_per_engine={calls}: most calls the actor ran at once", at_once)
    return answers, best, start


def ask_more(messages: list[dict]) -> list[dict]:
    """The chat prompt with its question asking for an explanation (a longer answer)."""
    *head, last = messages
    return [*head, {**last, "content": last["content"] + " Explain your answer in a few sentences."}]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(__doc__.splitlines()[0], argv, rounds=(2, 1))
    header("vllm_feeding", args)
    if importlib.util.find_spec("vllm") is None:
        report("vllm", "not installed (make setup-vllm): skipped")
        return 0
    import pandas as pd

    from wbrag_ray.prompts import dumps

    n = 32 if args.quick else 96
    # mixed answer lengths: every other prompt asks for more than a short answer
    prompts = [dumps(p if i % 2 == 0 else ask_more(p)) for i, p in enumerate(demo_rag_prompts(n))]
    frame = pd.DataFrame({"id": range(n), "prompt": prompts})
    report("rows", n)
    report("rows per call", 4 * BATCH)
    with local_ray(num_cpus=2):
        blocking, t_block, start_block = run_pass(1, frame, args.rounds)
        report_pressure("after the blocking pass")
        fed, t_fed, start_fed = run_pass(4, frame, args.rounds)
        report_pressure("after the fed pass")
    report("engine start (service, blocking | fed)", f"{start_block:.1f} | {start_fed:.1f}", "s")
    report("blocking calls (calls_per_engine=1) time", t_block, "s", 2)
    report("blocking calls rows/s", n / t_block, "rows/s", 2)
    report("fed engine (calls_per_engine=4) time", t_fed, "s", 2)
    report("fed engine rows/s", n / t_fed, "rows/s", 2)
    report_ratio("ratio fed/blocking rows/s", n / t_fed, n / t_block)
    same = sum(a == b for a, b in zip(blocking, fed, strict=True))
    report("identical greedy answers fed vs blocking", 100 * same / n, "%")
    return 0


if __name__ == "__main__":
    run_module_main(main)
