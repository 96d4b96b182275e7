"""Batch invariance of greedy answers: the same prompts decoded in batches of 1, 7 and 20, by dtype and backend.

`python -m benchmarks.batch_invariance [--quick]`. The bundled SmolLM2-135M on the demo's RAG prompts (3 keyword-
retrieved passages each), greedy, MAX_NEW_TOKENS new tokens; each generator call holds exactly one batch (its
`batch_size` is the chunk size), so a prompt's neighbours change from one batching to the next. Prints, per
backend and dtype, how many answers differ from the answers decoded one prompt at a time. hf in fp32 always, in
bf16 where the CPU has native bf16 (skipped with the reason where it does not); vLLM's CPU build where installed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from benchmarks.common import demo_rag_prompts, header, parse_args, report, run_module_main, set_torch_threads

MAX_NEW_TOKENS = 24
BATCHES = (1, 7, 20)
THREADS = 2


def answers_by_batch(make: Any, prompts: list, batches: Sequence[int]) -> dict[int, list[str]]:
    """{batch size: the answers}, each call to the generator `make(batch)` builds holding one batch of prompts."""
    out = {}
    for b in batches:
        generator = make(b)
        out[b] = [a for start in range(0, len(prompts), b) for a in generator.generate(prompts[start:start + b])]
    return out


def report_differences(label: str, got: dict[int, list[str]]) -> None:
    alone = got[BATCHES[0]]
    for b, answers in got.items():
        if b == BATCHES[0]:
            continue
        differ = sum(x != y for x, y in zip(alone, answers, strict=True))
        report(f"{label}: answers in batches of {b} differing from batches of 1", f"{differ} of {len(alone)}")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(__doc__.splitlines()[0], argv)
    header("batch_invariance", args)
    import importlib.util

    from wbrag_ray.config import GeneratorConfig
    from wbrag_ray.generation.hf import HFGenerator
    from wbrag_ray.models.hardware import cpu_has_native_bf16

    report("torch threads", set_torch_threads(THREADS))
    n = 7 if args.quick else 20
    prompts = demo_rag_prompts(n)
    batches = tuple(b for b in BATCHES if b <= n)
    report("prompts", n)
    report("max new tokens", MAX_NEW_TOKENS)

    def config(dtype: str, batch: int, **kw: Any) -> GeneratorConfig:
        return GeneratorConfig(model="bundled:smollm2", max_new_tokens=MAX_NEW_TOKENS, dtype=dtype, batch_size=batch,
                               **kw)

    loaded: dict[str, HFGenerator] = {}

    def hf(dtype: str):
        def make(batch: int) -> HFGenerator:
            if dtype not in loaded:
                loaded[dtype] = HFGenerator(config(dtype, batch))
                loaded[dtype].setup()
            generator = loaded[dtype]
            generator.config = generator.config.model_copy(update={"batch_size": batch})
            return generator
        return make

    report_differences("hf fp32", answers_by_batch(hf("float32"), prompts, batches))
    if cpu_has_native_bf16():
        report_differences("hf bf16", answers_by_batch(hf("bfloat16"), prompts, batches))
    else:
        report("hf bf16", "skipped: bf16 is emulated on this CPU (no avx512_bf16 / amx_bf16)")
    if importlib.util.find_spec("vllm") is None:
        report("vllm", "skipped: vLLM is not installed (`make setup-vllm` installs its CPU build)")
        return 0
    from wbrag_ray.generation.vllm import VLLMGenerator

    engine = VLLMGenerator(config("float32", n, backend="vllm", num_cpus=1, threads=THREADS))
    engine.setup()

    def make_vllm(batch: int) -> VLLMGenerator:
        engine.config = engine.config.model_copy(update={"batch_size": batch})
        return engine

    report_differences("vllm cpu fp32", answers_by_batch(make_vllm, prompts, batches))
    return 0


if __name__ == "__main__":
    run_module_main(main)
