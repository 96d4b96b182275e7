"""A prepared GPU check: the production models' architectures and the project's torch-level code on one GPU,
random weights, one figure a line.

Run it by hand on a GPU machine (`python benchmarks/gpu/check.py > gpu.txt`); `python -m benchmarks` skips it,
and CI runs its CPU dry run (`--quick` without a GPU) where `import ray` fails
(tests/training/test_gpu_check_dry_run.py). The machine it is meant for has only torch, transformers,
sentence-transformers and peft, no network, and at most 64 MiB of files brought along (Ray's wheel alone is
75 MiB): so nothing here needs Ray or vLLM except the sections that say so and are skipped without them, and
nothing is downloaded: every model is built from a config with randomly initialised weights (or read from
`--model`, a local folder). Random weights cost exactly what trained ones do, which is all a throughput check
needs. The project's sections import wbrag_ray from the repository beside this file, which needs pydantic and
pyyaml besides (the config), and pyarrow for the hf generator: without them they say so and are skipped.

Sections, each reported and survived on failure, skipped once past the time budget (default 240 s, so a run
ends inside 5 minutes; `--budget 540` leaves the Ray and vLLM sections room where they are installed):
1. the GPU: name, memory, bf16 support, matmul peak TFLOP/s in fp32, tf32, bf16, fp16;
2. the generator: Llama-3.1-8B-Instruct's architecture in bf16, greedy `generate` of 32 new tokens on
   left-padded batches of ~600-token prompts at batch 1, 8, 32, 64; then SmolLM2-135M's architecture the
   same way, to compare with the 2-core CPU figures in DESIGN.md;
3. the embedder: e5-base-v2's architecture (BERT base) with mean pooling, fp32 / bf16 / fp16 at batch 256
   on ~32-token sentences, and the cosine of bf16 (and fp16) to fp32 embeddings;
4. LoRA training (peft, r=8 on q/v) on a 1B-class Llama in bf16, batch 8 x 512 tokens;
5. the project's torch-level code, without Ray or vLLM: the trainings' placement rules on this GPU and FSDP's
   device mesh for 1 x 1 to 4 x 8 GPUs (wbrag_ray/training/placement.py); one training step as a fsdp worker
   runs it (wbrag_ray/training/lora.py: FSDP2 under a one-rank NCCL group, bf16 weights and fp32 LoRA,
   gradient clipping, `get_state_dict`, then an `inference_mode` forward of the sharded model); the one-worker
   fsdp case (trains as ddp, the model on the GPU its batch goes to); batched generation by the project's hf
   generator (wbrag_ray/generation/hf.py);
6. a tensor-parallel vLLM engine, where 2 or more GPUs are visible (skipped with the reason otherwise): a
   1B-class Llama sharded over the GPUs the project's way (`generator.num_gpus` = tensor_parallel_size, the
   engine in its placement group: wbrag_ray/generation/parallel.py), greedy answers at batch 64, then the same
   prompts on one GPU (tensor_parallel_size=1) and how many answers are the same (as
   tests/generation/test_vllm_tp_cpu.py checks with vLLM's CPU ranks; --quick without a GPU runs those: 2 CPU
   ranks). It needs vllm, ray and wbrag_ray (`pip install '.[gpu]'`); without them it says so and is skipped;
7. the project's Ray Train path: the LM pruner's Ray Train job (wbrag_ray/training/workers.py) on one GPU
   worker, a 1B-class random Llama as the backbone, bf16 weights and fp32 LoRA, 24 steps of 64 sentences with
   a checkpoint every 8: its seconds per step are the GPU rate `wbrag plan` has not measured yet (ray and
   wbrag_ray needed, as in 6); then, where 2 GPUs are visible, the multi-GPU placements: 2 workers x 1 GPU under
   ddp and under fsdp (their loss curves compared), and 1 worker x 2 GPUs (a layer split over its own two);
8. the engine's feed (vllm and wbrag_ray needed): one vLLM engine on one GPU, a 1B-class random Llama, 8 calls
   of 32 prompts of mixed answer lengths sent one at a time and then 4 at once (`generator.calls_per_engine`),
   rows/s of both, their ratio, and whether the answers are the same;
9. faiss on the GPU, where faiss-gpu is installed (skipped otherwise): the index types `index.factory: auto`
   picks (IVF-PQ96, OPQ96 + an HNSW coarse quantizer + PQ96, IVF-Flat) cloned with faiss's default options and
   with the project's (wbrag_ray/index/gpu_clone.py, loaded by its path), queries/s on CPU and GPU, and the top-10
   ids both return.

`--quick` shrinks every shape to a tiny model: a smoke run of the code paths, on CPU when there is no GPU
("cpu dry run", gloo in place of NCCL), not a measurement. Figures print as `name: value unit`, like
benchmarks/common.py's `report`, which this file cannot import.
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import gc
import importlib.metadata
import math
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

# torch.OutOfMemoryError is new in torch 2.5; the GPU machine's torch may be older.
OutOfMemoryError = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
PAD = 0  # the pad token id of every generator prompt (random weights: any id would do)

# Llama 3.1's rope scaling; it changes no cost, but the check should build the architecture as shipped.
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
LLAMA_8B = {  # meta-llama/Llama-3.1-8B-Instruct, the production generator
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "rope_theta": 500000.0,
    "rope_scaling": LLAMA3_ROPE,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
}
SMOLLM2_135M = {  # HuggingFaceTB/SmolLM2-135M-Instruct, the bundled CPU generator
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "intermediate_size": 1536,
    "vocab_size": 49152,
    "rope_theta": 100000.0,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
}
LLAMA_1B = {  # a Llama-3.2-1B-shaped model: the 8B is too big to LoRA-train from random weights in budget
    "hidden_size": 2048,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 8192,
    "vocab_size": 128256,
    "rope_theta": 500000.0,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": True,  # as Llama-3.2-1B ships
}
E5_BASE = {  # intfloat/e5-base-v2, the production embedder (a BERT base encoder)
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "intermediate_size": 3072,
    "vocab_size": 30522,
    "max_position_embeddings": 512,
}
# --quick replaces the shape (and keeps the rest, such as tied embeddings) with these tiny ones.
TINY_LLAMA = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 1000,
}
TINY_BERT = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 1000,
}

# DESIGN.md, "Facts measured": SmolLM2-135M bf16 greedy generate on 2 CPU cores, batch 64-128.
CPU_SMOLLM2_BF16_TOKENS_S = 375.0


@dataclass(frozen=True)
class Sizes:
    """Every workload shape, full or --quick."""

    matmul_n: int
    matmul_windows: int
    matmul_window_s: float
    prompt_tokens: int
    new_tokens: int
    gen_batches: tuple[int, ...]
    gen_repeats: int
    embed_batch: int
    embed_tokens: int
    embed_cosine_n: int
    embed_windows: int
    embed_batches_per_window: int
    lora_batch: int
    lora_tokens: int
    lora_steps: int


FULL = Sizes(8192, 5, 0.5, 600, 32, (1, 8, 32, 64), 2, 256, 32, 1024, 3, 20, 8, 512, 5)
QUICK = Sizes(256, 2, 0.05, 32, 4, (1, 4), 1, 16, 8, 64, 1, 2, 2, 32, 2)


@dataclass
class Run:
    """What the whole check shares: where it runs, its shapes, its clock, and the matmul peaks measured."""

    device: torch.device
    quick: bool
    sizes: Sizes
    budget_s: float
    start: float = field(default_factory=time.perf_counter)
    peaks: dict[str, float] = field(default_factory=dict)  # TFLOP/s by "fp32", "tf32", "bf16", "fp16"
    failures: list[str] = field(default_factory=list)
    model: str | None = None  # --model: the project sections' causal LM (None: a random Llama in `scratch`)
    scratch: str = ""  # a temporary folder for the whole check

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def past_budget(self) -> bool:
        return self.elapsed() > self.budget_s


# --- output ---------------------------------------------------------------------------------------------


def report(name: str, value: Any, unit: str = "", digits: int = 1) -> Any:
    """Print one figure as `name: value unit` (floats with `digits` decimals), as benchmarks/common.py does."""
    if isinstance(value, bool):
        text = "yes" if value else "no"
    elif isinstance(value, float):
        text = f"{value:,.{digits}f}"
    else:
        text = str(value)
    print(f"{name}: {text}{' ' + unit if unit else ''}", flush=True)
    return value


def report_utilization(name: str, tflops: float, run: Run, peak: str) -> None:
    """`tflops` as a percentage of the matmul peak measured for `peak` (n/a when that peak failed)."""
    if run.peaks.get(peak):
        report(f"{name} (of {peak} peak)", 100.0 * tflops / run.peaks[peak], "%")
    else:
        report(f"{name} (of {peak} peak)", "n/a (no peak measured)")


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}"


# --- mechanics ------------------------------------------------------------------------------------------


def sync(run: Run) -> None:
    # CUDA calls return before the kernels finish: time only after the queue has drained.
    if run.cuda:
        torch.cuda.synchronize(run.device)


def timed(run: Run, fn: Callable[[], Any]) -> tuple[Any, float]:
    """(result, seconds) of fn(), with the device drained before and after."""
    sync(run)
    start = time.perf_counter()
    result = fn()
    sync(run)
    return result, time.perf_counter() - start


def free(run: Run) -> None:
    gc.collect()
    if run.cuda:
        torch.cuda.empty_cache()


def reset_peak_memory(run: Run) -> None:
    if run.cuda:
        torch.cuda.reset_peak_memory_stats(run.device)


def report_peak_memory(name: str, run: Run) -> None:
    if run.cuda:
        report(name, torch.cuda.max_memory_allocated(run.device) / 2**30, "GiB", 2)
    else:
        report(name, "n/a (cpu)")


@contextmanager
def built_as(run: Run, dtype: torch.dtype) -> Iterator[None]:
    """Create parameters directly on the device in `dtype`: an 8B model initialised on the CPU in fp32 would
    need 32 GB of host memory and minutes of CPU time before it ever reached the GPU."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(run.device):
            yield
    finally:
        torch.set_default_dtype(old)


def linear_weights(model: torch.nn.Module, exclude: torch.nn.Module | None = None) -> int:
    """Weights of the Linear layers, the ones a token's matmuls touch (an embedding lookup is no matmul)."""
    return sum(
        m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not exclude
    )


# --- 1. the GPU -----------------------------------------------------------------------------------------


def gpu_facts(run: Run) -> None:
    if not run.cuda:
        report("device", "cpu (cpu dry run)")
        report("torch threads", torch.get_num_threads())
        return
    props = torch.cuda.get_device_properties(run.device)
    report("device", props.name)
    report("device count", torch.cuda.device_count())
    report("compute capability", f"{props.major}.{props.minor}")
    report("multiprocessors", props.multi_processor_count)
    report("total memory", props.total_memory / 2**30, "GiB")
    report("bf16 supported", bool(torch.cuda.is_bf16_supported()))
    report("torch cuda", torch.version.cuda)


def matmul_tflops(run: Run, dtype: torch.dtype) -> float:
    """Best TFLOP/s of n x n matmuls over a few timed windows: the best window is the peak, since anything
    else sharing the device can only lower a window."""
    n = run.sizes.matmul_n
    a = torch.randn(n, n, device=run.device, dtype=dtype)
    b = torch.randn(n, n, device=run.device, dtype=dtype)
    c = torch.empty_like(a)

    def matmuls(k: int) -> None:
        for _ in range(k):
            torch.matmul(a, b, out=c)

    matmuls(3)  # the first calls pick the kernel and warm the clocks
    _, seconds = timed(run, lambda: matmuls(5))
    iters = max(1, round(run.sizes.matmul_window_s / max(seconds / 5, 1e-9)))
    best = 0.0
    for _ in range(run.sizes.matmul_windows):
        _, seconds = timed(run, lambda: matmuls(iters))
        best = max(best, 2.0 * n**3 * iters / seconds / 1e12)
    return best


def matmul_peaks(run: Run) -> None:
    n = run.sizes.matmul_n
    precision = torch.get_float32_matmul_precision()
    # fp32 proper ("highest") and fp32 inputs on tf32 tensor cores ("high")
    kinds = [("fp32", torch.float32, "highest"), ("tf32", torch.float32, "high")]
    kinds += [("bf16", torch.bfloat16, None), ("fp16", torch.float16, None)]
    for name, dtype, fp32_precision in kinds:
        if name == "tf32" and not run.cuda:
            report(f"matmul peak {name} {n}x{n}", "n/a (cpu)")
            continue
        if fp32_precision:
            torch.set_float32_matmul_precision(fp32_precision)
        try:
            run.peaks[name] = report(f"matmul peak {name} {n}x{n}", matmul_tflops(run, dtype), "TFLOP/s", 3)
        except Exception as exc:  # one dtype the device lacks should not lose the others
            report(f"matmul peak {name} {n}x{n}", f"failed ({one_line(exc)})")
            run.failures.append(f"matmul {name}")
        finally:
            torch.set_float32_matmul_precision(precision)  # later sections run at the default precision
        free(run)


# --- 2. the generator -----------------------------------------------------------------------------------


def build_llama(run: Run, spec: dict[str, Any], dtype: torch.dtype) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    # No eos: a random model may emit it at any step, and every prompt must get all its new tokens.
    config = LlamaConfig(
        **{**spec, **(TINY_LLAMA if run.quick else {})}, pad_token_id=PAD, bos_token_id=1, eos_token_id=None
    )
    with built_as(run, dtype):
        model = LlamaForCausalLM(config)
    return model.eval()


def left_padded_prompts(
    run: Run, batch: int, length: int, vocab: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids, 90-100% of `length` long, left-padded (as a decoder generates) to `length`.

    The first row is full length, so batch 1 has no padding at all.
    """
    g = torch.Generator().manual_seed(seed)
    low = min(1000, vocab // 10)  # keep clear of the special ids at the bottom of the vocabulary
    lengths = torch.randint(int(0.9 * length), length + 1, (batch,), generator=g)
    lengths[0] = length
    ids = torch.full((batch, length), PAD, dtype=torch.long)
    mask = torch.zeros((batch, length), dtype=torch.long)
    for row, n in enumerate(lengths.tolist()):
        ids[row, length - n :] = torch.randint(low, vocab, (n,), generator=g)
        mask[row, length - n :] = 1
    return ids.to(run.device), mask.to(run.device)


def greedy(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int) -> torch.Tensor:
    out = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=PAD
    )
    if out.shape[1] != ids.shape[1] + new_tokens:  # a short output would inflate every rate below
        raise RuntimeError(f"generate returned {out.shape[1] - ids.shape[1]} new tokens, not {new_tokens}")
    return out


def generation_batch(run: Run, label: str, model: torch.nn.Module, batch: int, body: int, head: int) -> float:
    """One batch size: prefill alone (generate 1 token), then the full generate; best of a few repeats."""
    sizes = run.sizes
    n = sizes.new_tokens
    ids, mask = left_padded_prompts(run, batch, sizes.prompt_tokens, model.config.vocab_size, seed=batch)
    prompt_tokens = int(mask.sum())
    reset_peak_memory(run)
    with torch.inference_mode():
        greedy(model, ids, mask, 2)  # warm-up: the first call at a shape picks kernels and allocates
        prefill_s = min(timed(run, lambda: greedy(model, ids, mask, 1))[1] for _ in range(sizes.gen_repeats))
        total_s = min(timed(run, lambda: greedy(model, ids, mask, n))[1] for _ in range(sizes.gen_repeats))
    decode_s = max(total_s - prefill_s, 1e-9)
    name = f"{label} b{batch}"
    report(f"{name} prompt tokens", prompt_tokens)
    report(f"{name} prefill", prefill_s, "s", 3)
    report(f"{name} generate {n}", total_s, "s", 3)
    report(f"{name} prompt tokens/s", prompt_tokens / prefill_s, "tokens/s")
    generated = report(f"{name} generated tokens/s", batch * n / total_s, "tokens/s")
    report(f"{name} decode tokens/s", batch * (n - 1) / decode_s, "tokens/s")
    # FLOPs = 2 x weights x tokens, counting the real (unpadded) tokens: every prompt and fed-back token
    # passes the body; the head (lm_head) runs only where a next token is chosen, as generate computes the
    # logits of the last position alone. Attention's own matmuls (~2% at 600 tokens) are left out.
    prefill_flops = 2.0 * body * prompt_tokens + 2.0 * head * batch
    total_flops = 2.0 * body * (prompt_tokens + batch * (n - 1)) + 2.0 * head * batch * n
    prefill_tflops = report(f"{name} prefill compute", prefill_flops / prefill_s / 1e12, "TFLOP/s", 3)
    report_utilization(f"{name} prefill utilization", prefill_tflops, run, "bf16")
    total_tflops = report(f"{name} overall compute", total_flops / total_s / 1e12, "TFLOP/s", 3)
    report_utilization(f"{name} overall utilization", total_tflops, run, "bf16")
    report_peak_memory(f"{name} peak memory", run)
    return generated


def generator(run: Run, label: str, spec: dict[str, Any]) -> dict[int, float]:
    model, build_s = timed(run, lambda: build_llama(run, spec, torch.bfloat16))
    head_layer = model.get_output_embeddings()
    head = head_layer.weight.numel()
    body = linear_weights(model, exclude=head_layer)
    total = sum(p.numel() for p in model.parameters())  # tied weights are counted once by parameters()
    report(f"{label} parameters", total / 1e6, "M")
    report(f"{label} weights", total * 2 / 2**30, "GiB (bf16)", 2)
    report(f"{label} build (random init)", build_s, "s")
    generated = {}  # tokens/s by batch size
    for batch in run.sizes.gen_batches:
        if run.past_budget():
            report(f"{label} b{batch}", "skipped (past the time budget)")
            break
        out_of_memory = False
        try:
            generated[batch] = generation_batch(run, label, model, batch, body, head)
        except OutOfMemoryError:
            out_of_memory = True  # handled below, once the traceback no longer holds the batch's tensors
        if out_of_memory:
            free(run)
            report(f"{label} b{batch}", "out of memory (larger batches skipped)")
            break
        free(run)
    return generated


def generator_8b(run: Run) -> None:
    generator(run, "llama-3.1-8b", LLAMA_8B)


def generator_smollm2(run: Run) -> None:
    generated = generator(run, "smollm2-135m", SMOLLM2_135M)
    if 64 in generated and not run.quick:  # the tiny --quick model has nothing to compare
        report(
            "smollm2-135m on 2 CPU cores, bf16, b64-128 (DESIGN.md)", CPU_SMOLLM2_BF16_TOKENS_S, "tokens/s"
        )
        print(
            f"smollm2-135m b64 gpu vs 2-core cpu: {generated[64] / CPU_SMOLLM2_BF16_TOKENS_S:.1f}x",
            flush=True,
        )


# --- 3. the embedder ------------------------------------------------------------------------------------


def right_padded_sentences(
    run: Run, count: int, tokens: int, vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids 75-125% of `tokens` long (mean `tokens`), right-padded as an encoder's tokenizer pads."""
    g = torch.Generator().manual_seed(1)
    width = tokens + tokens // 4
    low = min(1000, vocab // 10)
    lengths = torch.randint(tokens - tokens // 4, width + 1, (count,), generator=g)
    ids = torch.randint(low, vocab, (count, width), generator=g)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    ids = ids * mask  # BERT's pad id is 0
    return ids.to(run.device), mask.to(run.device)


def mean_pooled(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """What sentence-transformers does for e5 (mean over the real tokens, then unit length), in plain torch;
    pooled in fp32 so that the cosine below measures the encoder's precision, not the pooling's."""
    hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
    weights = mask.unsqueeze(-1).float()
    pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1.0)
    return torch.nn.functional.normalize(pooled, dim=-1)


def encode_all(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, batch: int) -> torch.Tensor:
    return torch.cat(
        [mean_pooled(model, ids[i : i + batch], mask[i : i + batch]) for i in range(0, len(ids), batch)]
    )


def encode_cycling(
    model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], count: int
) -> None:
    """`count` batches, cycling through `batches`: one timed window of the throughput figure."""
    for k in range(count):
        mean_pooled(model, *batches[k % len(batches)])


def embedder(run: Run) -> None:
    from transformers import BertConfig, BertModel

    sizes = run.sizes
    config = BertConfig(**{**E5_BASE, **(TINY_BERT if run.quick else {})})
    with built_as(run, torch.float32):
        base = BertModel(config, add_pooling_layer=False).eval()  # e5 pools the tokens, not the [CLS] pooler
    weights = linear_weights(base)
    report("e5-base parameters", sum(p.numel() for p in base.parameters()) / 1e6, "M")
    # A few distinct batches to cycle through, and the sentences whose embeddings are compared.
    pool_ids, pool_mask = right_padded_sentences(
        run, 4 * sizes.embed_batch, sizes.embed_tokens, config.vocab_size
    )
    cos_ids, cos_mask = right_padded_sentences(
        run, sizes.embed_cosine_n, sizes.embed_tokens, config.vocab_size
    )
    batches = [
        (pool_ids[i : i + sizes.embed_batch], pool_mask[i : i + sizes.embed_batch])
        for i in range(0, len(pool_ids), sizes.embed_batch)
    ]
    # Counted once here: counting inside the timed loop would make the host wait for the device each batch.
    real_tokens = sum(int(batches[k % len(batches)][1].sum()) for k in range(sizes.embed_batches_per_window))
    reference = None
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        if run.past_budget():
            report(f"e5-base {name}", "skipped (past the time budget)")
            break
        # Each precision from the fp32 weights, as loading a checkpoint in that dtype would give.
        model = base if dtype == torch.float32 else copy.deepcopy(base).to(dtype)
        with torch.inference_mode():
            for ids, mask in batches[:2]:
                mean_pooled(model, ids, mask)  # warm-up

            seconds = min(
                timed(run, lambda m=model: encode_cycling(m, batches, sizes.embed_batches_per_window))[1]
                for _ in range(sizes.embed_windows)
            )
            sentences = sizes.embed_batches_per_window * sizes.embed_batch
            report(f"e5-base {name} b{sizes.embed_batch} sentences/s", sentences / seconds, "sentences/s")
            # 2 x weights x real tokens; attention's own matmuls (~1% at 32 tokens) are left out.
            tflops = report(
                f"e5-base {name} compute", 2.0 * weights * real_tokens / seconds / 1e12, "TFLOP/s", 3
            )
            report_utilization(f"e5-base {name} utilization", tflops, run, name)
            embeddings = encode_all(model, cos_ids, cos_mask, sizes.embed_batch)
        if reference is None:
            reference = embeddings
        else:
            cosine = (embeddings * reference).sum(-1)  # both are unit length
            report(f"e5-base {name} vs fp32 cosine min", float(cosine.min()), "", 5)
            report(f"e5-base {name} vs fp32 cosine mean", float(cosine.mean()), "", 5)
        if model is not base:
            del model
        free(run)


# --- 4. LoRA training -----------------------------------------------------------------------------------


def lora_training(run: Run) -> None:
    from peft import LoraConfig, get_peft_model

    sizes = run.sizes
    model = build_llama(run, LLAMA_1B, torch.bfloat16)
    frozen = sum(p.numel() for p in model.parameters())
    lora = LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"
    )
    model = get_peft_model(model, lora).to(run.device)  # the adapters, should peft have built them elsewhere
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    report("llama-1b parameters", frozen / 1e6, "M")
    report("llama-1b lora trainable parameters", sum(p.numel() for p in trainable) / 1e6, "M", 2)
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    g = torch.Generator().manual_seed(2)
    vocab = model.config.vocab_size
    ids = torch.randint(min(1000, vocab // 10), vocab, (sizes.lora_batch, sizes.lora_tokens), generator=g)
    ids = ids.to(run.device)

    def step() -> float:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())  # waits for the step, and shows it is finite

    timed(run, step)  # warm-up: kernel choice, optimizer state, the allocator's first growth
    reset_peak_memory(run)
    times, losses = [], []
    for _ in range(sizes.lora_steps):
        loss, seconds = timed(run, step)
        times.append(seconds)
        losses.append(loss)
    mean = sum(times) / len(times)
    tokens = sizes.lora_batch * sizes.lora_tokens
    name = f"llama-1b lora b{sizes.lora_batch}x{sizes.lora_tokens}"
    report(f"{name} step mean ({sizes.lora_steps} steps)", mean, "s", 3)
    report(f"{name} step best", min(times), "s", 3)
    report(f"{name} tokens/s", tokens / mean, "tokens/s")
    # ~4 x weights x tokens: forward 2x, backward 2x for the input gradients; frozen weights get no weight
    # gradients, so the usual 6x of full training would overstate the work.
    tflops = report(f"{name} approx compute", 4.0 * frozen * tokens / mean / 1e12, "TFLOP/s", 3)
    report_utilization(f"{name} approx utilization", tflops, run, "bf16")
    report(f"{name} last loss", losses[-1], "", 3)
    report_peak_memory(f"{name} peak memory", run)


# --- random-weight model folders and prompts (sections 5 to 8) ------------------------------------------

# --quick's model for sections 5 to 8: vLLM's attention kernels want a head size of 64 or more (TINY_LLAMA's is 16)
SMALL_LLAMA = {"hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "intermediate_size": 512, "vocab_size": 1000}


def tensor_parallel_degree(gpus: int, spec: dict[str, Any]) -> int:
    """The most GPUs (a power of two) that the model's attention heads and KV heads split over evenly."""
    tp = 1
    while tp * 2 <= gpus and spec["num_key_value_heads"] % (tp * 2) == 0:
        tp *= 2
    return tp


def save_random_llama(run: Run, spec: dict[str, Any], folder: str) -> None:
    """A random-weight Llama folder vLLM loads like a downloaded one: config, safetensors, and a word-level
    tokenizer over the whole vocabulary (`w<id>`, one word a token; no network for a real one)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    config = LlamaConfig(**spec, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    with built_as(run, torch.bfloat16):
        LlamaForCausalLM(config).save_pretrained(folder)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, spec["vocab_size"])}}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                            pad_token="<unk>").save_pretrained(folder)


def random_prompts(spec: dict[str, Any], tokens: int, count: int, seed: int = 3) -> list[list[dict[str, str]]]:
    """`count` one-message prompts of `tokens` random words of `save_random_llama`'s tokenizer (one token each)."""
    g = torch.Generator().manual_seed(seed)
    low = min(1000, spec["vocab_size"] // 10)  # clear of the special ids
    return [[{"role": "user", "content": " ".join(
        f"w{i}" for i in torch.randint(low, spec["vocab_size"], (tokens,), generator=g).tolist())}]
        for _ in range(count)]


# --- 5. the project's torch-level code, without Ray or vLLM ---------------------------------------------

# What wbrag_ray's training rules, steps and hf generator import besides torch, transformers and peft: its config
# (pydantic, pyyaml), numpy, and pyarrow (the model cache, wbrag_ray.storage). Nothing of Ray: these modules import
# it only inside the functions a Ray worker runs.
PROJECT_NEEDS = ("wbrag_ray", "pydantic", "yaml", "numpy", "pyarrow")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# pydantic and its small dependencies as wheels (`make gpu-wheels`, about 3 MB), carried to a machine without them
WHEELS = os.environ.get("WBRAG_GPU_WHEELS", os.path.join(os.path.dirname(os.path.abspath(__file__)), "wheels"))


def project_missing() -> list[str]:
    """The modules the project's sections need that this machine lacks (the repository beside this file is
    importable: `python benchmarks/gpu/check.py` puts only benchmarks/gpu on the path)."""
    import importlib.util

    if importlib.util.find_spec("wbrag_ray") is None and os.path.isdir(os.path.join(REPO, "wbrag_ray")):
        sys.path.append(REPO)
    return [m for m in PROJECT_NEEDS if importlib.util.find_spec(m) is None]


def bring_project_needs(scratch: str) -> list[str]:
    """Install the carried wheels (benchmarks/gpu/wheels) into the scratch folder where the project's needs are
    missing, without the network; return what is still missing."""
    missing = project_missing()
    if missing and os.path.isdir(WHEELS):
        import importlib
        import subprocess

        site = os.path.join(scratch, "site")
        done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--find-links", WHEELS,
                               "--target", site, "--no-compile", *(m for m in missing if m in CARRIED)],
                              capture_output=True, text=True)
        if done.returncode == 0:
            sys.path.insert(0, site)
            importlib.invalidate_caches()
            report("project needs brought from benchmarks/gpu/wheels", ", ".join(m for m in missing if m in CARRIED))
        else:
            report("project needs: installing the carried wheels failed", one_line(RuntimeError(done.stderr)))
        missing = project_missing()
    return missing


CARRIED = ("pydantic",)  # what `make gpu-wheels` brings (with its dependencies); the GPU image has the rest


def project_model(run: Run) -> str:
    """The causal LM the project sections train and generate with: `--model` (a local transformers folder), else
    a random-weight Llama saved once into the check's scratch folder (1B-class; --quick: a small one)."""
    if run.model:
        return run.model
    folder = os.path.join(run.scratch, "random-llama")
    if not os.path.isdir(folder):
        _, seconds = timed(run, lambda: save_random_llama(run, SMALL_LLAMA if run.quick else LLAMA_1B, folder))
        report("project model (random init, saved)", seconds, "s")
    return folder


def training_dtype(run: Run) -> torch.dtype:
    """The frozen weights' dtype a training worker loads (training.placement.worker_placement's rule)."""
    if not run.cuda:
        return torch.float32
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


@contextmanager
def one_rank_group(run: Run) -> Iterator[str]:
    """A process group of this process alone (NCCL on the GPU, gloo on the CPU), as a Ray Train worker has, on a
    free loopback port; destroyed after."""
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = "nccl" if run.cuda else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            **({"device_id": run.device} if run.cuda else {}))
    try:
        yield backend
    finally:
        dist.destroy_process_group()


def placement_rules(run: Run) -> None:
    """The trainings' placement rules (wbrag_ray.training.placement) on this machine's GPU (a simulated 80 GiB one
    on a CPU dry run): where one fsdp worker's model goes, how many GPUs a model's shards need, what is refused
    before any weight loads; and FSDP's device mesh for the shapes people run (1 x 1 to 4 x 8 GPUs)."""
    from wbrag_ray.config import ConfigError
    from wbrag_ray.training.placement import device_rule, fsdp_mesh_shape, own_gpus, placement_of

    memory = torch.cuda.get_device_properties(run.device).total_memory if run.cuda else 80 * 2**30
    where = f"{memory / 2**30:.0f} GiB GPU" + ("" if run.cuda else " (simulated)")
    visible = torch.cuda.device_count() if run.cuda else 1
    mine = own_gpus([run.device.index or 0], None)  # Ray's GPU of a one-GPU worker, nothing hidden
    for label, params in (("llama-3.1-8b", 8.03e9), ("llama-3.1-70b", 70.6e9)):
        weights = params * 2  # bf16
        try:
            rule = device_rule(mine, visible, memory, weights, "fsdp", 1, "zerorag.tune")
            one = placement_of(rule, torch.bfloat16, "fsdp", 0, (1, 1))
            report(f"rules: {label} fsdp, 1 worker on a {where}", f"{one.strategy} on {one.device}")
        except ConfigError as exc:
            report(f"rules: {label} fsdp, 1 worker on a {where}", f"refused ({one_line(exc)})")
        shards = next(n for n in range(1, 1025) if weights / n <= memory * 0.85)
        device_rule(mine, visible, memory, weights, "fsdp", shards, "zerorag.tune")  # refuses if the rule disagrees
        report(f"rules: {label} fsdp, workers of a {where} its shards need", shards)
    for nodes, per in ((1, 1), (1, 2), (1, 8), (4, 8)):
        mesh = fsdp_mesh_shape([n for n in range(nodes) for _ in range(per)])
        report(f"rules: fsdp mesh on {nodes} x {per} GPUs (replicas x shards)", f"{mesh[0]} x {mesh[1]}")


def fsdp_step(run: Run) -> None:
    """One training step as a Ray Train worker under fsdp runs it (wbrag_ray.training.lora), without Ray: FSDP2
    (`fully_shard`, gradient checkpointing, rank 0's weights broadcast) under a one-rank NCCL group (gloo on the
    CPU), frozen weights in bf16 and LoRA weights in fp32 under autocast, gradients clipped to a global norm, the
    trainable state gathered whole (`get_state_dict`), then an `inference_mode` forward of the sharded model (the
    LM pruner's validation runs one)."""
    from transformers import AutoModelForCausalLM

    from wbrag_ray.config import TuneConfig
    from wbrag_ray.training.lora import (
        MAX_GRAD_NORM,
        apply_gradients,
        optimizer_of,
        trainable_state,
        with_lora,
        wrap,
    )
    from wbrag_ray.training.placement import DeviceRule, Placement

    path, sizes = project_model(run), run.sizes
    with one_rank_group(run) as backend:
        # one rank of a sharded training: placement_of would make a world of 1 ddp, so the placement is built
        place = Placement(run.device, training_dtype(run), DeviceRule(run.device.index), fsdp=True, rank=0,
                          mesh=(1, 1))
        torch.manual_seed(0)
        model = with_lora(place.load(AutoModelForCausalLM, path), TuneConfig(lora_dropout=0.0), "CAUSAL_LM")
        module, model = wrap(model, place, 1)
        frozen = {str(p.dtype).split(".")[-1] for p in model.parameters() if not p.requires_grad}
        trained = {str(p.dtype).split(".")[-1] for p in model.parameters() if p.requires_grad}
        report("fsdp step: process group / frozen / trained dtypes", f"{backend} / {frozen} / {trained}")
        if trained != {"float32"}:
            raise RuntimeError(f"LoRA weights train in {trained}, not fp32")
        if frozen != {str(training_dtype(run)).split(".")[-1]}:  # the loader's `dtype=` honoured
            raise RuntimeError(f"frozen weights in {frozen}, not {training_dtype(run)}")
        params, optimizer, scaler = optimizer_of(model, place, 1e-3)
        vocab = model.config.vocab_size
        ids = torch.randint(min(1000, vocab // 10), vocab, (sizes.lora_batch, sizes.lora_tokens),
                            generator=torch.Generator().manual_seed(2)).to(run.device)
        reset_peak_memory(run)
        losses, norms, times = [], [], []
        for _ in range(sizes.lora_steps + 1):  # the first is the warm-up
            def step() -> float:
                with place.autocast:
                    loss = module(input_ids=ids, labels=ids).loss.float()
                norms.append(apply_gradients(loss, 1, params, optimizer, scaler))
                return float(loss.detach())
            loss, seconds = timed(run, step)
            losses.append(loss)
            times.append(seconds)
        name = f"fsdp step b{sizes.lora_batch}x{sizes.lora_tokens}"
        report(f"{name} seconds (mean of {sizes.lora_steps} after a warm-up)", sum(times[1:]) / len(times[1:]), "s", 3)
        report(f"{name} loss first -> last", f"{losses[0]:.4f} -> {losses[-1]:.4f}")
        report(f"{name} gradient norm before clipping to {MAX_GRAD_NORM:g} (last)", norms[-1], "", 4)
        report_peak_memory(f"{name} peak memory", run)
        if not all(map(math.isfinite, losses + norms)):
            raise FloatingPointError(f"losses {losses}, gradient norms {norms}")
        trainable, _ = trainable_state(model, optimizer)
        where = {str(t.device) for t in trainable.values()}
        report("fsdp step: trainable state gathered (tensors, device)", f"{len(trainable)}, {where}")
        if where != {"cpu"} or not any("lora_A" in k for k in trainable):
            raise RuntimeError(f"get_state_dict gave {len(trainable)} tensors on {where}")
        model.eval()
        with torch.inference_mode(), place.autocast:
            logits = module(input_ids=ids[:, : min(8, ids.shape[1])]).logits
        report("fsdp step: inference_mode forward of the sharded model, finite", bool(torch.isfinite(logits).all()))


def one_worker_fsdp(run: Run) -> None:
    """`strategy: fsdp` with one worker on this GPU (what `num_workers: auto` gives on a one-GPU node): the
    placement rule makes it ddp, the model on the worker's GPU where its batch goes; one step there."""
    from transformers import AutoModelForCausalLM

    from wbrag_ray.config import TuneConfig
    from wbrag_ray.training.lora import apply_gradients, optimizer_of, with_lora, wrap
    from wbrag_ray.training.placement import device_rule, placement_of

    path = project_model(run)
    assigned = [run.device.index or 0] if run.cuda else []
    memory = torch.cuda.get_device_properties(run.device).total_memory if run.cuda else 0
    rule = device_rule(assigned, torch.cuda.device_count() if run.cuda else 0, memory, None, "fsdp", 1,
                       "zerorag.tune")
    place = placement_of(rule, training_dtype(run), "fsdp", 0, (1, 1))
    torch.manual_seed(0)
    model = place.place(with_lora(place.load(AutoModelForCausalLM, path), TuneConfig(lora_dropout=0.0),
                                  "CAUSAL_LM"))
    module, model = wrap(model, place, 1)
    devices = {str(p.device) for p in model.parameters()}
    batch_on = place.inputs_device(model)
    report("one-worker fsdp: runs as / model on / batch on", f"{place.strategy} / {devices} / {batch_on}")
    if devices != {str(place.device)} or batch_on != place.device:
        raise RuntimeError(f"the model is on {devices}, its batch goes to {batch_on}")
    params, optimizer, scaler = optimizer_of(model, place, 1e-3)
    vocab = model.config.vocab_size
    ids = torch.randint(min(1000, vocab // 10), vocab, (2, 32), generator=torch.Generator().manual_seed(3))
    with place.autocast:
        loss = module(input_ids=ids.to(batch_on), labels=ids.to(batch_on)).loss.float()
    norm = apply_gradients(loss, 1, params, optimizer, scaler)
    report("one-worker fsdp: step loss, gradient norm", f"{float(loss.detach()):.4f}, {norm:.4f}")


def hf_generation(run: Run) -> None:
    """The project's transformers generator (wbrag_ray.generation.hf: left padding, length-bucketed batches sized
    to the memory budget, greedy decoding) on this GPU: batched answers to random prompts."""
    from wbrag_ray.config import GeneratorConfig
    from wbrag_ray.generation.hf import HFGenerator

    path, sizes = project_model(run), run.sizes
    spec = SMALL_LLAMA if run.quick else LLAMA_1B
    batch = 8 if run.quick else 64
    config = GeneratorConfig(backend="hf", model=path, num_gpus=1.0 if run.cuda else 0.0, chat_template=False,
                             stop=[], dtype="bfloat16" if run.cuda else "float32", batch_size=batch,
                             max_new_tokens=sizes.new_tokens)
    generator = HFGenerator(config)
    _, seconds = timed(run, generator.setup)
    report("hf generation: load", seconds, "s")
    loaded = {str(p.dtype).split(".")[-1] for p in generator.model.parameters()}
    report("hf generation: device / dtype asked / weights' dtype", f"{generator.device} / {config.dtype} / {loaded}")
    if loaded != {config.dtype}:  # transformers 5 reads `dtype=`; one that ignored it would load fp32 silently
        raise RuntimeError(f"from_pretrained(dtype={config.dtype}) loaded weights in {loaded}")
    prompts = random_prompts(spec, sizes.prompt_tokens, batch)
    generator.generate(prompts[:2], 2)  # warm-up
    answers, seconds = timed(run, lambda: generator.generate(prompts, sizes.new_tokens))
    report(f"hf generation b{batch} x {sizes.prompt_tokens} words, {sizes.new_tokens} new tokens", seconds, "s", 3)
    report("hf generation rows/s", len(answers) / seconds, "rows/s")
    if len(answers) != len(prompts):
        raise RuntimeError(f"{len(answers)} answers to {len(prompts)} prompts")


# --- 6. a tensor-parallel engine ------------------------------------------------------------------------

def tensor_parallel(run: Run) -> None:
    import importlib.util
    import tempfile

    gpus = torch.cuda.device_count() if run.cuda else 0
    spec = SMALL_LLAMA if run.quick else LLAMA_1B
    tp = tensor_parallel_degree(gpus, spec)
    if tp < 2 and not run.quick:
        skip("vllm tensor parallel", f"{gpus} GPU{'s' * (gpus != 1)} visible: it needs 2 or more")
    missing = [m for m in ("vllm", "ray", "wbrag_ray") if importlib.util.find_spec(m) is None]
    if missing:
        skip("vllm tensor parallel", f"{', '.join(missing)} not installed: pip install '.[gpu]'")
    cpu_ranks = tp < 2 and not run.cuda  # --quick without a GPU: vLLM's CPU build, 2 ranks as processes
    if cpu_ranks:
        tp = 2
        report("vllm tensor parallel", "no GPU visible: --quick runs 2 CPU ranks (vLLM's CPU build)")
    elif tp < 2:  # --quick on one GPU: the same path, unsharded, as a smoke run
        report("vllm tensor parallel", "1 GPU visible: --quick runs the path unsharded")
    import ray

    from wbrag_ray.config import GeneratorConfig, RayConfig
    from wbrag_ray.generation.vllm import VLLMGenerator
    from wbrag_ray.placement import check_placement, replica_placement
    from wbrag_ray.ray_runtime import init_ray

    sizes = run.sizes
    with tempfile.TemporaryDirectory() as folder:
        _, seconds = timed(run, lambda: save_random_llama(run, spec, folder))
        report("tp llama saved (random init)", seconds, "s")
        config = GeneratorConfig(
            backend="vllm", model=folder, num_gpus=0.0 if cpu_ranks else float(tp if tp > 1 else min(gpus, 1)),
            tensor_parallel_size=tp, num_cpus=1.0, threads=2, chat_template=False,
            stop=[], max_new_tokens=sizes.new_tokens, dtype="bfloat16" if run.cuda else "float32",
            vllm_engine_kwargs={"max_model_len": 2 * sizes.prompt_tokens, "enforce_eager": True})
        report("tp tensor_parallel_size x pipeline_parallel_size", "{} x {}".format(*config.parallel_sizes()))
        report("tp placement", replica_placement(config) or "one GPU or less: no placement group")
        init_ray(RayConfig(num_cpus=os.cpu_count()))
        try:
            check_placement(config)  # the refusal a pass would meet on this machine's cluster
            generator = VLLMGenerator(config)
            _, seconds = timed(run, generator.setup)
            report("tp engine start", seconds, "s")
            report("tp engine in its own placement group", generator.remote is not None)
            batch = 4 if run.quick else 64
            prompts = random_prompts(spec, sizes.prompt_tokens, batch)
            generator.generate_scored(prompts[:2])  # warm-up
            answers, seconds = timed(run, lambda: generator.generate_scored(prompts))
            tokens = sum(len(a.tokens) for a in answers)
            report(f"tp b{batch} generate {sizes.new_tokens}", seconds, "s", 3)
            report(f"tp b{batch} generated tokens/s", tokens / seconds, "tokens/s")
            if generator.remote is not None:
                generator.remote.close()  # its process ends and its GPUs are free for the one-GPU engine
            if tp > 1:
                # the same prompts on one shard, the engine in this process: greedy answers the same as the
                # sharded replica's (an all-reduce sums in another order: a near tie may flip, in bf16 more often)
                single = VLLMGenerator(config.model_copy(update={"tensor_parallel_size": 1,
                                                                 "num_gpus": 0.0 if cpu_ranks else 1.0}))
                _, seconds = timed(run, single.setup)
                report("tp=1 engine start", seconds, "s")
                ones = single.generate_scored(prompts)
                same = sum(a.tokens == b.tokens for a, b in zip(answers, ones, strict=True))
                report(f"tp={tp} answers the same as tp=1", f"{same} of {len(prompts)}")
                differ = [i for i, (a, b) in enumerate(zip(answers, ones, strict=True)) if a.tokens != b.tokens]
                if differ:  # where the first one parts: a late token is a near tie, token 0 a wiring fault
                    a, b = answers[differ[0]].tokens, ones[differ[0]].tokens
                    step = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
                    report("tp first differing answer", f"prompt {differ[0]}, token {step} of {len(a)}")
        finally:
            ray.shutdown()


def engine_feed(run: Run) -> None:
    """One vLLM engine on one GPU (a 1B-class random Llama) fed the project's way (wbrag_ray/generation/
    vllm_feed.py): 8 calls of 32 prompts, every other one asking 8 times the tokens, sent one after another (a
    one-call-at-a-time service actor: `generator.calls_per_engine: 1`) and then from 4 threads at once (the
    default 4: the engine adds a call's requests between its steps, so short calls run beside long ones and the
    GPU does not wait on the caller). Rows/s of both, their ratio, and whether the greedy answers are the same."""
    import importlib.util
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    missing = [m for m in ("vllm", "wbrag_ray") if importlib.util.find_spec(m) is None]
    if missing:
        skip("vllm engine feed", f"{', '.join(missing)} not installed: pip install '.[gpu]'")
    if not run.cuda and not run.quick:
        skip("vllm engine feed", "no GPU visible")
    from wbrag_ray.config import GeneratorConfig
    from wbrag_ray.generation.vllm import VLLMGenerator

    spec, sizes = (SMALL_LLAMA if run.quick else LLAMA_1B), run.sizes
    calls, rows = 8, (4 if run.quick else 32)
    short, long = max(2, sizes.new_tokens // 8), sizes.new_tokens
    with tempfile.TemporaryDirectory() as folder:
        save_random_llama(run, spec, folder)
        config = GeneratorConfig(
            backend="vllm", model=folder, num_gpus=1.0 if run.cuda else 0.0, chat_template=False, stop=[],
            dtype="bfloat16" if run.cuda else "float32",
            vllm_engine_kwargs={"max_model_len": sizes.prompt_tokens + long + 8, "enforce_eager": True})
        generator = VLLMGenerator(config)
        _, seconds = timed(run, generator.setup)
        report("feed engine start", seconds, "s")
        prompts = random_prompts(spec, sizes.prompt_tokens, calls * rows)
        work = [(prompts[i * rows:(i + 1) * rows], long if i % 2 else short) for i in range(calls)]
        generator.generate(prompts[:2], short)  # warm-up
        one, blocking = timed(run, lambda: [generator.generate(p, n) for p, n in work])
        with ThreadPoolExecutor(4) as pool:
            fed, shared = timed(run, lambda: list(pool.map(lambda call: generator.generate(*call), work)))
        report("feed one call at a time", calls * rows / blocking, "rows/s")
        report("feed 4 calls at once", calls * rows / shared, "rows/s")
        report("feed speedup (4 at once / 1)", blocking / shared, "x", 2)
        report("feed answers identical", f"{sum(a == b for a, b in zip(one, fed, strict=True))} of {calls} calls")


# --- 7. the project's training on a Ray Train worker ----------------------------------------------------


def _ray_train_modules() -> list[str]:
    import importlib.util

    return [m for m in ("ray", "wbrag_ray") if importlib.util.find_spec(m) is None]


def _pruner_sentences(spec: dict[str, Any], count: int, words: int) -> tuple[list[str], list[float]]:
    g = torch.Generator().manual_seed(5)
    texts = [" ".join(f"w{i}" for i in torch.randint(3, spec["vocab_size"], (words,), generator=g).tolist())
             for _ in range(count)]
    return texts, torch.rand(len(texts), generator=g).tolist()


def _fit_pruner(folder: str, label: str, texts: list[str], scores: list[float], **section: Any) -> dict[str, Any]:
    """The LM pruner's Ray Train job (wbrag_ray.training.workers.fit) on the random backbone in `folder`, with
    its checkpoints beside it; the stats worker 0 reported."""
    import pandas as pd

    from wbrag_ray.config import LMPrunerConfig
    from wbrag_ray.storage import resolve
    from wbrag_ray.training.lm_pruner import PrunerTraining
    from wbrag_ray.training.workers import fit

    config = LMPrunerConfig(backbone=f"{folder}/backbone", epochs=1, max_length=64, **section)
    training = PrunerTraining(pd.DataFrame({"text": texts, "score": scores}), config, texts[:64])
    return fit(training, config, f"{folder}/{label}-adapter", label, "zerorag.lm_pruner",
               storage=resolve(f"{folder}/{label}-train"))


def ray_train(run: Run) -> None:
    """The project's own training path (wbrag_ray.training.workers): the LM pruner's Ray Train job on one GPU
    worker (bf16 weights, fp32 LoRA, autocast), a 1B-class random Llama as the backbone, with its checkpoints in
    a local folder; its steps per second are the GPU rate `wbrag plan` has no measurement of yet."""
    import tempfile

    missing = _ray_train_modules()
    if missing:
        skip("ray train", f"{', '.join(missing)} not installed: pip install '.[gpu]'")
    import ray

    from wbrag_ray.config import RayConfig
    from wbrag_ray.ray_runtime import init_ray
    from wbrag_ray.training.workers import loss_stats

    spec = SMALL_LLAMA if run.quick else LLAMA_1B
    texts, scores = _pruner_sentences(spec, 64 if run.quick else 2048, 8 if run.quick else 48)  # ~ wiki sentences
    with tempfile.TemporaryDirectory() as folder:
        save_random_llama(run, spec, f"{folder}/backbone")
        batch = 8 if run.quick else 64
        init_ray(RayConfig(num_cpus=os.cpu_count()))
        try:
            raw, seconds = timed(run, lambda: _fit_pruner(
                folder, "lm-pruner", texts, scores, batch_size=batch, max_steps=4 if run.quick else 24,
                trainer={"num_workers": 1, "num_gpus": 1.0 if run.cuda else 0.0, "num_cpus": 1.0,
                         "checkpoint_steps": 8}))
            stats = loss_stats(raw)
            report("ray train job (worker start, load, steps, checkpoints)", seconds, "s")
            report("ray train worker device / dtype", f"{stats['device']} / {stats['dtype']}")
            report("ray train steps", stats["steps"])
            report(f"ray train seconds per step (batch of {batch} x up to 64 tokens)", stats["seconds_per_step"], "s", 3)
            report("ray train examples/s", stats["examples_per_s"], "examples/s")
            report("ray train loss first -> last", f"{stats['first_loss']:.4f} -> {stats['last_loss']:.4f}")
        finally:
            ray.shutdown()


def ray_train_multi_gpu(run: Run) -> None:
    """The trainings' multi-GPU placements, where 2 GPUs are visible (on a CPU dry run, the two CPU-worker cases):
    2 workers x 1 GPU under ddp (each on its own GPU: wbrag_ray.training.workers.device_rule, NCCL collectives on
    CUDA tensors), the same under fsdp (FSDP2, the frozen base sharded, its loss curve against ddp's), and 1 worker
    x 2 GPUs (a layer split over exactly its two). Each case: the device, the strategy, seconds and the losses."""
    import tempfile

    missing = _ray_train_modules()
    if missing:
        skip("ray train multi-gpu", f"{', '.join(missing)} not installed: pip install '.[gpu]'")
    gpus = torch.cuda.device_count() if run.cuda else 0
    if run.cuda and gpus < 2:
        skip("ray train multi-gpu", f"needs 2 GPUs, {gpus} visible")
    import ray

    from wbrag_ray.config import RayConfig
    from wbrag_ray.ray_runtime import init_ray

    spec = SMALL_LLAMA if run.quick else LLAMA_1B
    texts, scores = _pruner_sentences(spec, 64 if run.quick else 512, 8 if run.quick else 48)
    each = {"num_gpus": 1.0 if run.cuda else 0.0, "num_cpus": 1.0 if run.cuda else 0.5, "checkpoint_steps": 4}
    cases = {"2 workers x 1 ddp": {"num_workers": 2, **each}, "2 workers x 1 fsdp": {"num_workers": 2, "strategy": "fsdp",
                                                                                    **each}}
    if run.cuda:
        cases["1 worker x 2 layer split"] = {"num_workers": 1, "num_gpus": 2.0, "num_cpus": 1.0, "checkpoint_steps": 4}
    losses = {}
    with tempfile.TemporaryDirectory() as folder:
        save_random_llama(run, spec, f"{folder}/backbone")
        init_ray(RayConfig(num_cpus=os.cpu_count()))
        try:
            for i, (name, trainer) in enumerate(cases.items()):
                stats, seconds = timed(run, lambda t=trainer, i=i: _fit_pruner(
                    folder, f"case{i}", texts, scores, batch_size=8, max_steps=6, lora_dropout=0.0, trainer=t))
                losses[name] = stats["losses"]
                report(f"ray train {name}: device / strategy / workers",
                       f"{stats['device']} / {stats['strategy']} / {stats['workers']}")
                report(f"ray train {name}: seconds", seconds, "s")
                report(f"ray train {name}: losses", " ".join(f"{v:.4f}" for v in stats["losses"]))
        finally:
            ray.shutdown()
    ddp, fsdp = losses["2 workers x 1 ddp"], losses["2 workers x 1 fsdp"]
    gap = max(abs(a - b) / max(abs(a), 1e-9) for a, b in zip(ddp, fsdp, strict=True))
    report("ray train fsdp vs ddp largest relative loss gap", gap, "", 5)


def faiss_gpu_clone(run: Run) -> None:
    """The index types `index.factory: auto` picks, cloned to the GPU: once with faiss's default options (PQ96 and
    an HNSW coarse quantizer are expected to fail there) and once by the search actors' own `gpu_clone.to_gpu`
    (the options each index needs, faiss's scratch memory capped at GPU_TEMP_MEMORY_BYTES, no CPU fallback); then
    the same queries on the CPU index and the GPU one: queries/s of each, and how many top-10 ids they share."""
    import importlib.util

    if importlib.util.find_spec("faiss") is None:
        skip("faiss gpu clone", "faiss not installed: pip install faiss-gpu")
    import faiss
    import numpy as np

    if not hasattr(faiss, "GpuMultipleClonerOptions") or faiss.get_num_gpus() == 0:
        skip("faiss gpu clone", f"faiss {faiss.__version__}: no GPU support or no GPU visible")
    from wbrag_ray.index import gpu_clone

    report("faiss version", faiss.__version__)
    # small lists: the clone and search are what is checked, and PQ96's training alone takes minutes on few cores
    dim, nlist = (192, 64) if run.quick else (768, 256)
    rng = np.random.default_rng(0)
    # the sample k-means wants for the IVF (40 a list) and for PQ's 256 centroids per sub-quantizer (39 each)
    sample = max(40 * nlist, 10_000)
    vectors = rng.standard_normal((sample + (5_000 if run.quick else 100_000), dim), dtype=np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    train, base = vectors[:sample], vectors[sample:]
    queries = base[: 100 if run.quick else 1000] + 0.01 * rng.standard_normal((100 if run.quick else 1000, dim),
                                                                              dtype=np.float32)
    for factory in (f"IVF{nlist},PQ96", f"OPQ96,IVF{nlist}_HNSW32,PQ96", f"IVF{nlist},Flat"):
        cpu = faiss.index_factory(dim, factory, faiss.METRIC_INNER_PRODUCT)
        cpu.train(train)
        cpu.add(base)
        faiss.ParameterSpace().set_index_parameter(cpu, "nprobe", 32)
        report(f"{factory} options", ", ".join(k for k, v in gpu_clone.gpu_clone_settings(cpu).items() if v) or "none")
        try:
            faiss.index_cpu_to_all_gpus(cpu)
            report(f"{factory} clone with faiss's defaults", "ok")
        except RuntimeError as exc:
            report(f"{factory} clone with faiss's defaults", f"fails: {one_line(exc)}")
        missing = gpu_clone.cloner_options(cpu)[1]
        if missing:
            report(f"{factory} options this faiss lacks", ", ".join(missing))
        gpu = gpu_clone.to_gpu(cpu, factory, required=True)  # raises GpuCloneError where it cannot go
        faiss.GpuParameterSpace().set_index_parameter(gpu, "nprobe", 32)
        start = time.perf_counter()
        _, cpu_ids = cpu.search(queries, 10)
        cpu_s = time.perf_counter() - start
        gpu.search(queries[:8], 10)  # warm-up: the first call allocates the GPU's scratch memory
        start = time.perf_counter()
        _, gpu_ids = gpu.search(queries, 10)
        gpu_s = time.perf_counter() - start
        shared = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(cpu_ids, gpu_ids, strict=True)])
        report(f"{factory} cpu queries/s ({faiss.omp_get_max_threads()} threads)", len(queries) / cpu_s, "q/s", 0)
        report(f"{factory} gpu queries/s", len(queries) / gpu_s, "q/s", 0)
        report(f"{factory} top-10 ids shared by cpu and gpu", shared, "", 3)
        del gpu


# --- the check ------------------------------------------------------------------------------------------


# What a section proves when it passes, printed after its figures ("TITLE: proved: ...").
PROVES = {
    "gpu": "torch sees the GPU, its memory and its bf16 support",
    "placement rules": "wbrag_ray.training.placement's rules place and refuse models on this GPU's memory, and build "
                       "FSDP's mesh for 1 x 1 to 4 x 8 GPUs",
    "fsdp step": "wbrag_ray.training.lora trains under FSDP2 on this device's process group: frozen weights in the "
                 "loader's dtype, LoRA in fp32, finite losses, the state gathered, a sharded inference_mode forward",
    "one-worker fsdp": "one fsdp worker runs as ddp with the model and its batch on the same device",
    "hf generation": "wbrag_ray.generation.hf answers a batch on this device, the weights in the dtype asked for "
                     "(transformers honours dtype=)",
    "matmul peak": "the matmul peaks the plan's roofline is read against",
    "generator llama-3.1-8b": "the production generator's architecture decodes at these batches within memory",
    "generator smollm2-135m": "the bundled generator's architecture decodes at these batches",
    "embedder e5-base-v2": "the embedder's architecture in bf16 / fp16 embeds as fp32 does (the cosines above)",
    "lora llama-1b": "peft's LoRA trains a 1B-class Llama in bf16 at this rate",
    "vllm tensor parallel": "a tensor-parallel vLLM engine, placed the project's way, answers as one GPU does",
    "ray train lm pruner": "the LM pruner's Ray Train job trains and checkpoints on a GPU worker",
    "ray train multi-gpu": "the multi-GPU placements train, each worker on its own GPUs",
    "vllm engine feed": "calls fed to one engine at once answer as calls sent one at a time",
    "faiss gpu clone": "the search actors' own clone (gpu_clone.to_gpu: the options each index needs, capped scratch "
                       "memory) puts the auto factories on the GPU; their top-10 overlap with the CPU index is printed",
}
# The sections that run the project's own code: they come first, so no time budget ever skips them.
PROJECT_SECTIONS = ("placement rules", "fsdp step", "one-worker fsdp", "hf generation")


def section(run: Run, title: str, fn: Callable[[Run], None]) -> None:
    """Run one section: report its failure and go on, or skip it once past the time budget."""
    if run.past_budget():
        report(f"{title}", f"skipped (past the {run.budget_s:.0f} s budget)")
        return
    print(f"# {title}", flush=True)
    start = time.perf_counter()
    failure = None
    skipped = False
    try:
        fn(run)
    except Skipped:
        skipped = True
    except Exception as exc:  # one broken section must not cost the others' figures
        failure = one_line(exc)
        traceback.print_exc(file=sys.stderr)
    if failure:  # out of the except block: the traceback and its tensors are gone before free()
        report(f"{title} failed", failure)
        run.failures.append(title)
    elif not skipped:
        report(f"{title}: proved", PROVES[title] + ("" if run.cuda else " (cpu dry run: its code path, not the GPU)"))
    free(run)
    report(f"{title} seconds", time.perf_counter() - start, "s")


class Skipped(Exception):
    """A section that cannot run here (no second GPU, no vLLM, no faiss-gpu): reported as skipped, not failed.
    Never raised for the project's own sections: without what they need the check fails."""


def skip(name: str, why: str) -> None:
    report(name, f"skipped ({why})")
    raise Skipped(why)


def version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes: a smoke run (on CPU if no GPU)")
    parser.add_argument(
        "--budget", type=float, default=240.0, help="skip what is left after this many seconds (540: room for "
        "the vllm and ray sections where they are installed)"
    )
    parser.add_argument("--cpu-threads", type=int, default=1, help="torch threads for a CPU dry run")
    parser.add_argument("--model", help="a local transformers causal-LM folder for the project sections (default: "
                        "a random-weight 1B-class Llama; --quick: a small one)")
    args = parser.parse_args(argv)
    # Set before transformers is imported (in main, not at import: a test that reads this module's names must not
    # turn its own process offline): the GPU machine has no network, and a hub lookup would only stall.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    cuda = torch.cuda.is_available()
    if not cuda and not args.quick:
        print("no CUDA GPU here: the full check needs one; `--quick` dry-runs it on CPU", file=sys.stderr)
        return 2
    if not cuda:
        torch.set_num_threads(args.cpu_threads)  # a dry run stays light on a shared machine

    import transformers

    transformers.logging.set_verbosity_error()  # random configs draw warnings that are noise here
    import tempfile

    scratch = tempfile.TemporaryDirectory(prefix="gpu-check-")
    run = Run(
        torch.device("cuda", 0) if cuda else torch.device("cpu"),
        args.quick,
        QUICK if args.quick else FULL,
        args.budget,
        model=args.model,
        scratch=scratch.name,
    )
    torch.manual_seed(0)
    mode = ("quick" if args.quick else "full") + ("" if cuda else ", cpu dry run")
    print(f"# gpu check ({mode})", flush=True)
    report("date", dt.datetime.now().astimezone().isoformat(timespec="seconds"))
    for package in ("torch", "transformers", "sentence-transformers", "peft"):
        report(f"{package} version", version(package))
    report("time budget", args.budget, "s", 0)

    missing = bring_project_needs(scratch.name)
    if missing:  # the check exists to run the project's code: without it there is nothing to prove
        report("project code", f"cannot run: {', '.join(missing)} not importable (`make gpu-wheels` on a machine with "
               "network brings pydantic's wheels into benchmarks/gpu/wheels; carry that folder)")
        report("failures", "project code")
        return 1
    section(run, "gpu", gpu_facts)
    section(run, "placement rules", placement_rules)
    section(run, "fsdp step", fsdp_step)
    section(run, "one-worker fsdp", one_worker_fsdp)
    section(run, "hf generation", hf_generation)
    section(run, "matmul peak", matmul_peaks)
    section(run, "generator llama-3.1-8b", generator_8b)
    section(run, "generator smollm2-135m", generator_smollm2)
    section(run, "embedder e5-base-v2", embedder)
    section(run, "lora llama-1b", lora_training)
    section(run, "vllm tensor parallel", tensor_parallel)
    section(run, "ray train lm pruner", ray_train)
    section(run, "ray train multi-gpu", ray_train_multi_gpu)
    section(run, "vllm engine feed", engine_feed)
    section(run, "faiss gpu clone", faiss_gpu_clone)  # last: PQ96's training is the slowest step

    scratch.cleanup()
    report("total", run.elapsed(), "s")
    report("failures", ", ".join(run.failures) if run.failures else "none")
    return 1 if run.failures else 0


if __name__ == "__main__":
    sys.exit(main())
