"""The bundled generator (SmolLM2-135M-Instruct) on RAG prompts: hf fp32 (and bf16 where native), Ray Data, vLLM.

Generated tokens count every row of a batch for every decoding step the batch ran (greedy decoding keeps a
batch going until its longest answer ends): that is the work done. Answer tokens count only the tokens of
the answers returned. Prompts are long next to the answers, so prefill dominates the time.

Utilization: matmul FLOPs per token are 2 x the parameters a token passes through (every layer, and the tied
LM head for each generated token and once per prompt for its first), counted for every prompt token and every
generated token (rows x steps), over the dtype's matmul peak measured here; attention's own products are left
out, so it is a slight underestimate.

Prompts go in two generate batches (batch size n / 2). With `--rounds N` every direct batch and the whole Ray
pipeline run N times and keep their best time (a shared machine only ever slows a run down). The Ray
overhead is the Ray time minus the direct bf16 time: plan, actor start, model load from the cache. The Ray
figure "excluding warm-up" is differential, as in benchmarks.embed: each round also runs the pipeline on the
first WARM prompts alone (plan, actor start, load, one small batch), and the rate of the rest is
(n - WARM) / (full - warm-up): what a long job sees once its actors are up.

vLLM on CPU beside hf (when vLLM's CPU build is installed: `make setup-vllm`): the same prompts, fp32, the same
2 torch threads, greedy, the same token budget and stop string. "vllm direct" is the engine a command's generator
service holds (in-process engine core, `VLLMGenerator.setup`), timed on the whole list at once (its scheduler
batches). The ratio vllm/hf compares prompts/s of the direct runs.

    python -m benchmarks.generate [--quick]
"""

from __future__ import annotations

import importlib.util
import tempfile
from collections.abc import Sequence
from typing import Any

from benchmarks.common import (
    Stopwatch,
    demo_rag_prompts,
    header,
    local_ray,
    matmul_peak_gflops,
    parse_args,
    report,
    report_pressure,
    report_ratio,
    run_module_main,
    set_torch_threads,
    set_up,
    timed,
)

THREADS = 2
MAX_NEW_TOKENS = 32
WARM = 2


class DecodeCounter:
    """Wraps a loaded model's `generate` to add up batch rows x decoding steps (the library returns text only)."""

    def __init__(self, model: Any):
        self.inner = model.generate
        self.tokens = 0
        model.generate = self

    def __call__(self, **kwargs: Any) -> Any:
        out = self.inner(**kwargs)
        seq = getattr(out, "sequences", out)  # a tensor, or the output object of return_dict_in_generate
        self.tokens += seq.shape[0] * (seq.shape[1] - kwargs["input_ids"].shape[1])
        return out


class DirectRun:
    """One generator over numbered batches of prompts: each batch's best time over the rounds, its work and
    its answers by prompt index."""

    def __init__(self, label: str, generator: Any, n: int):
        self.label, self.generator = label, generator
        self.counter = DecodeCounter(generator.model)
        self.best: dict[int, float] = {}
        self.tokens: dict[int, int] = {}
        self.answers: list[str] = [""] * n

    def run(self, prompts: list, batch: int, indices: list[int]) -> None:
        before = self.counter.tokens
        answers, seconds = timed(self.generator.generate, [prompts[i] for i in indices])
        self.best[batch] = min(self.best.get(batch, seconds), seconds)
        self.tokens[batch] = self.counter.tokens - before
        for i, answer in zip(indices, answers, strict=True):
            self.answers[i] = answer

    @property
    def seconds(self) -> float:
        return sum(self.best.values())

    def report(self) -> None:
        tokenizer = self.generator.tokenizer
        answer_tokens = sum(len(tokenizer(a, add_special_tokens=False)["input_ids"]) for a in self.answers)
        report(f"{self.label} time", self.seconds, "s", 2)
        report(f"{self.label} generated tokens/s (batch rows x steps)", sum(self.tokens.values()) / self.seconds, "tokens/s")
        report(f"{self.label} answer tokens/s", answer_tokens / self.seconds, "tokens/s")
        report(f"{self.label} prompts/s", len(self.answers) / self.seconds, "prompts/s", 2)


def same_fraction(a: list[str], b: list[str]) -> float:
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(__doc__.splitlines()[0], argv)
    header("generate", args)
    import ray.data
    import torch

    from wbrag_ray.config import GeneratorConfig
    from wbrag_ray.generation.hf import HFGenerator
    from wbrag_ray.generation.stage import GenerateStage
    from wbrag_ray.models.hardware import cpu_has_native_bf16
    from wbrag_ray.prompts import dumps
    from wbrag_ray.stages.base import apply_stage

    report("torch threads", set_torch_threads(THREADS))
    # Without AVX512-BF16 / AMX, bf16 is emulated (2 tokens/s, a 2048x2048 matmul takes a minute): only fp32 runs,
    # and the Ray pipeline runs the dtype `auto` picks there, fp32.
    bf16_native = cpu_has_native_bf16()
    dtypes = (torch.float32, torch.bfloat16) if bf16_native else (torch.float32,)
    if not bf16_native:
        report("bf16", "emulated on this CPU (no avx512_bf16 / amx_bf16): skipped")
    peak_seconds = 1.5 if args.quick else 3.0
    peaks = {d: matmul_peak_gflops(d, seconds=peak_seconds) for d in dtypes}
    n = 16 if args.quick else 64
    prompts = demo_rag_prompts(n)
    report("prompts", n)
    report("max new tokens", MAX_NEW_TOKENS)

    # Full runs convert the GGUF into an empty cache, so the first load is always the cold one; quick runs use
    # the default cache, where an earlier run has usually converted it already.
    tmp = None if args.quick else tempfile.TemporaryDirectory(prefix="wbrag-bench-gen-")
    cache_dir = tmp.name if tmp else None

    def config(dtype: str, **kw: Any) -> GeneratorConfig:
        return GeneratorConfig(
            model="bundled:smollm2",
            max_new_tokens=MAX_NEW_TOKENS,
            dtype=dtype,
            batch_size=n // 2,
            cache_dir=cache_dir,
            **kw,
        )

    try:
        first, seconds = set_up(HFGenerator(config("float32")))
        label = "empty cache: GGUF conversion" if tmp else "default cache: converts only if absent"
        report(f"generator load, first ({label})", seconds, "s", 2)
        del first
        generators = {}
        for d in dtypes:
            name = "fp32" if d == torch.float32 else "bf16"
            generators[d], seconds = set_up(HFGenerator(config(str(d).removeprefix("torch."))))
            report(f"generator load, cached, {name}", seconds, "s", 2)
        fp32 = generators[torch.float32]
        report("generate batch size", fp32.config.batch_size)
        lengths = [len(fp32.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in fp32.render(prompts)]
        report("prompt tokens (mean)", sum(lengths) / n)

        for generator in generators.values():
            generator.generate(prompts[:2], max_new_tokens=4)  # warm-up: first-call kernel selection

        # The generator sorts prompts by length and batches them in that order. Feeding it those same batches
        # one at a time, fp32 and bf16 alternating (and swapping who goes first), keeps the batches of one
        # whole call while a noisy neighbour slows both dtypes alike; each batch keeps its best round.
        by_length = sorted(range(n), key=lengths.__getitem__)
        bs = fp32.config.batch_size
        runs = {d: DirectRun(f"direct {'fp32' if d == torch.float32 else 'bf16'}", g, n) for d, g in generators.items()}
        for r in range(args.rounds):
            for k, start in enumerate(range(0, n, bs)):
                order = list(runs.values()) if (r + k) % 2 == 0 else list(runs.values())[::-1]
                for run in order:
                    run.run(prompts, k, by_length[start : start + bs])
        for run in runs.values():
            run.report()
        model = fp32.model
        params = sum(p.numel() for p in model.parameters())
        head = model.get_output_embeddings().weight.numel()
        body = params - head if model.config.tie_word_embeddings else params - 2 * head  # the input lookup is no matmul
        for d in dtypes:  # again after the load: a neighbour only ever lowers a peak
            peaks[d] = max(peaks[d], matmul_peak_gflops(d, seconds=peak_seconds))
        for dtype, run in runs.items():
            generated = sum(run.tokens.values())
            flops = 2 * (body * (sum(lengths) + generated) + head * (n + generated))
            name = "fp32" if dtype == torch.float32 else "bf16"
            report(f"matmul peak {name} (2048x2048, best of before and after)", peaks[dtype], "GFLOP/s")
            report(f"{run.label} achieved", flops / run.seconds / 1e9, "GFLOP/s")
            report(f"{run.label} utilization of the {name} peak", 100 * flops / run.seconds / 1e9 / peaks[dtype], "%")
        direct32 = runs[torch.float32]
        if bf16_native:
            direct16 = runs[torch.bfloat16]
            report_ratio("bf16 speedup vs fp32 (time, same prompts)", direct32.seconds, direct16.seconds)
            report("identical greedy answers bf16 vs fp32", 100 * same_fraction(direct16.answers, direct32.answers), "%")
            report("sample answer (fp32 | bf16)", f"{direct32.answers[0]!r} | {direct16.answers[0]!r}")
        # The dtype `auto` picks on this CPU, through Ray Data: one actor that asks for 1 of the 2 CPUs and runs
        # 2 torch threads.
        auto = torch.bfloat16 if bf16_native else torch.float32
        direct, name = runs[auto], "bf16" if bf16_native else "fp32"
        del fp32, generators
        stage = GenerateStage(config(str(auto).removeprefix("torch."), num_cpus=1, threads=THREADS))
        rows = [{"i": i, "prompt": dumps(p)} for i, p in enumerate(prompts)]

        def ray_run(items: list[dict]) -> tuple[list[str], float]:
            with Stopwatch() as sw:
                out = apply_stage(ray.data.from_items(items), stage).materialize()
            table = out.to_pandas().sort_values("i")
            return table["answer"].tolist(), sw.seconds

        with local_ray(num_cpus=2):
            answers_ray, full = ray_run(rows)
            warm = ray_run(rows[:WARM])[1]
            for _ in range(args.rounds - 1):
                full = min(full, ray_run(rows)[1])
                warm = min(warm, ray_run(rows[:WARM])[1])
    finally:
        if tmp:
            tmp.cleanup()

    report(f"ray {name} time, actor start included (best round)", full, "s", 2)
    report(f"ray {name} overhead over direct (plan, actor start, cached load)", full - direct.seconds, "s", 2)
    report(f"ray {name} prompts/s, actor start included", n / full, "prompts/s", 2)
    report(f"identical greedy answers ray vs direct {name}", 100 * same_fraction(answers_ray, direct.answers), "%")
    report_ratio(f"ratio ray/direct {name}, actor start included", direct.seconds, full)
    report(f"ray warm-up run ({WARM} prompts: plan, actor start, cached load, one batch)", warm, "s", 2)
    steady = (n - WARM) / (full - warm) if full > warm else float("nan")
    report(f"ray {name}, excluding warm-up (the {n - WARM} prompts after it)", steady, "prompts/s", 2)
    report_ratio(f"ratio ray/direct {name}, excluding warm-up (target >= 0.9)", steady, n / direct.seconds)
    if importlib.util.find_spec("vllm") is None:
        report("vllm", "not installed (make setup-vllm): skipped")
    else:
        vllm_beside_hf(args, prompts, direct32)
    report_pressure("at the end")
    return 0


def vllm_beside_hf(args: Any, prompts: list, hf32: DirectRun) -> None:
    """vLLM's CPU build on the prompts of the hf fp32 run, on the engine a generator service holds, with prompts/s, answer tokens/s and generated tokens/s (vLLM pads nothing: its
    generated tokens are the answers' plus each one's end token) and the ratio to hf fp32."""
    from wbrag_ray.config import GeneratorConfig
    from wbrag_ray.generation.vllm import VLLMGenerator

    n = len(prompts)
    config = GeneratorConfig(model="bundled:smollm2", max_new_tokens=MAX_NEW_TOKENS, dtype="float32",
                             batch_size=n, backend="vllm", num_cpus=1, threads=THREADS)
    tokenizer = hf32.generator.tokenizer

    def answer_tokens(answers: list[str]) -> int:
        return sum(len(tokenizer(a, add_special_tokens=False)["input_ids"]) for a in answers)

    engine, seconds = set_up(VLLMGenerator(config))
    report("vllm engine start, direct (in-process, cached converted model)", seconds, "s", 2)
    import torch

    report("vllm direct torch threads", torch.get_num_threads())
    engine.generate(prompts[:2], max_new_tokens=4)  # warm-up
    best, answers = float("inf"), []
    for _ in range(args.rounds):
        answers, t = timed(engine.generate, prompts)
        best = min(best, t)
    outs = engine._run(prompts, engine.sampling_params("text"))  # the same greedy answers, for token counts
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    report("vllm direct fp32 time", best, "s", 2)
    report("vllm direct fp32 generated tokens/s (answers + end token, no padding)", generated / best, "tokens/s")
    report("vllm direct fp32 answer tokens/s", answer_tokens(answers) / best, "tokens/s")
    report("vllm direct fp32 prompts/s", n / best, "prompts/s", 2)
    report_ratio("ratio vllm/hf fp32 prompts/s (direct, same prompts)", n / best, n / hf32.seconds)
    report_ratio("ratio vllm/hf fp32 answer tokens/s", answer_tokens(answers) / best,
                 answer_tokens(hf32.answers) / hf32.seconds)
    report("identical greedy answers vllm vs hf fp32", 100 * same_fraction(answers, hf32.answers), "%")
    report("sample answer (hf fp32 | vllm fp32)", f"{hf32.answers[0]!r} | {answers[0]!r}")


if __name__ == "__main__":
    run_module_main(main)
