"""First-principles times for the model stages where no rate was measured on the hardware they will run on: the
peak figures of common accelerators (vendor datasheets), the efficiency a stage reaches of them, and the FLOPs and
bytes of generation, embedding, training and k-means.

    generation  prefill: 2 x params x prompt tokens, at `COMPUTE_EFFICIENCY` of the peak bf16 rate;
                decode: a step per new token for a batch of `DECODE_BATCH` sequences, each step the longer of
                reading the weights once (at `BANDWIDTH_EFFICIENCY` of the memory bandwidth) and the batch's
                2 x params FLOPs per sequence
    embedding   2 x params x tokens per text (an encoder's forward), at `ENCODER_EFFICIENCY` of the peak
    training    6 x params x tokens: forward (2P) and backward of the frozen base (2P for the activations' gradients),
                and the forward again that gradient checkpointing recomputes (2P); the LoRA weights are negligible
    k-means     2 x sample x lists x dimensions per iteration, faiss's default `KMEANS_ITERATIONS` (the build sets
                none), at the fp32 rate

Every figure says where it came from; `--gpu NAME` picks the accelerator (`ACCELERATORS`), H100 by default.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Accelerator:
    """One GPU's peak figures: dense bf16 tensor TFLOP/s (no sparsity), fp32 TFLOP/s (no tensor cores), memory
    bandwidth (TB/s) and memory (GB), with the datasheet they come from."""

    name: str
    bf16_tflops: float
    fp32_tflops: float
    bandwidth_tbs: float
    memory_gb: float
    source: str

    def describe(self) -> str:
        return (f"{self.name}: {self.bf16_tflops:g} TFLOP/s bf16 dense, {self.fp32_tflops:g} TFLOP/s fp32, "
                f"{self.bandwidth_tbs:g} TB/s, {self.memory_gb:g} GB ({self.source})")


_ACCELERATORS = (
    Accelerator("A100-40GB", 312, 19.5, 1.555, 40, "NVIDIA A100 Tensor Core GPU datasheet (SXM)"),
    Accelerator("A100-80GB", 312, 19.5, 2.039, 80, "NVIDIA A100 Tensor Core GPU datasheet (SXM)"),
    Accelerator("H100", 989, 67, 3.35, 80, "NVIDIA H100 Tensor Core GPU datasheet (SXM; 1,979 bf16 is with sparsity)"),
    Accelerator("H200", 989, 67, 4.8, 141, "NVIDIA H200 Tensor Core GPU datasheet (SXM)"),
    Accelerator("L4", 121, 30.3, 0.3, 24, "NVIDIA L4 Tensor Core GPU datasheet (242 bf16 is with sparsity)"),
    Accelerator("L40S", 362, 91.6, 0.864, 48, "NVIDIA L40S GPU datasheet (733 bf16 is with sparsity)"),
    Accelerator("A10G", 70, 31.2, 0.6, 24, "AWS EC2 G5 instance specifications (A10G, an A10 variant NVIDIA publishes "
                "no datasheet for; the A10's is 125 TFLOP/s bf16)"),
)
ACCELERATORS: dict[str, Accelerator] = {a.name: a for a in _ACCELERATORS}
DEFAULT_GPU = "H100"

# the share of a peak a stage reaches: stated, not measured (calibration replaces them with the cluster's own rates)
# (benchmarks/RESULTS.md, "GPU check on one H200": Llama-3.1-8B prefill at 65-67% of the bf16 peak, e5-base-v2's
# encoder at 34% on 32-token sentences, a 1B LoRA step at 35%; the estimates stay below those, which leave out
# tokenizing, reading and writing)
COMPUTE_EFFICIENCY = 0.5  # prefill of a large model
TRAINING_EFFICIENCY = 0.3  # a LoRA step (forward, backward, recomputation, optimizer)
BANDWIDTH_EFFICIENCY = 0.7  # decode: reading the weights (and KV cache) once per step
ENCODER_EFFICIENCY = 0.25  # small encoders (e5-base, MiniLM) on short texts
KMEANS_EFFICIENCY = 0.5  # faiss GPU k-means: a matmul at fp32 plus the assignment
DECODE_BATCH = 256  # sequences decoded together per replica (vLLM's max_num_seqs default)
KMEANS_ITERATIONS = 25  # faiss's Clustering default niter
EFFICIENCY_NOTE = (f"estimates assume {COMPUTE_EFFICIENCY:.0%} of the peak bf16 rate for prefill, "
                   f"{TRAINING_EFFICIENCY:.0%} for training, "
                   f"{BANDWIDTH_EFFICIENCY:.0%} of the memory bandwidth for decode ({DECODE_BATCH} sequences a step), "
                   f"{ENCODER_EFFICIENCY:.0%} for embedding, {KMEANS_EFFICIENCY:.0%} of fp32 for k-means "
                   f"({KMEANS_ITERATIONS} iterations)")


def accelerator(name: str) -> Accelerator:
    """The table's entry for `name` (case and dashes ignored: "h100", "a100-80gb"); ValueError naming the choices."""
    key = name.replace("-", "").replace("_", "").lower()
    for a in _ACCELERATORS:
        if a.name.replace("-", "").lower() == key:
            return a
    raise ValueError(f"unknown GPU {name!r}; choose one of {', '.join(ACCELERATORS)}")


def generation_seconds(gpu: Accelerator, params: float, calls: int, prompt_tokens: float, new_tokens: int,
                       gpus: float, replicas: int) -> tuple[float, str]:
    """Seconds for `calls` generations of `prompt_tokens` + `new_tokens` on `replicas` replicas of `gpus` GPUs
    each (a tensor-parallel replica's GPUs add their FLOPs and bandwidth together), and how."""
    per_replica = max(1, replicas)
    flops = gpu.bf16_tflops * 1e12 * COMPUTE_EFFICIENCY * gpus
    prefill = calls * 2 * params * prompt_tokens / flops
    weights = params * 2 / (gpu.bandwidth_tbs * 1e12 * BANDWIDTH_EFFICIENCY * gpus)
    step = max(weights, DECODE_BATCH * 2 * params / flops)
    decode = calls / DECODE_BATCH * new_tokens * step
    seconds = (prefill + decode) / per_replica
    return seconds, (f"estimate: {calls:,} calls x ({prompt_tokens:,.0f} prompt tokens prefilled at 2 x params, "
                     f"{new_tokens} new tokens decoded {DECODE_BATCH} at once at {step * 1e3:.3g} ms a step) on "
                     f"{gpu.name} x {gpus:g} a replica, {per_replica} replica(s)")


def encode_seconds(gpu: Accelerator, params: float, texts: int, tokens: float, gpus: float,
                   actors: int) -> tuple[float, str]:
    """Seconds to embed `texts` of `tokens` each on `actors` actors of `gpus` GPUs (a fraction shares one)."""
    flops = gpu.bf16_tflops * 1e12 * ENCODER_EFFICIENCY * min(1.0, gpus) * max(1, actors)
    seconds = texts * 2 * params * tokens / flops
    return seconds, (f"estimate: {texts:,} texts x {tokens:,.0f} tokens x 2 x params on {gpu.name} x "
                     f"{min(1.0, gpus):g} x {actors} actor(s)")


def training_seconds(gpu: Accelerator, params: float, tokens: float, gpus: float) -> tuple[float, str]:
    """Seconds to train on `tokens` tokens (steps x batch x length) over `gpus` GPUs in all."""
    flops = gpu.bf16_tflops * 1e12 * TRAINING_EFFICIENCY * max(gpus, 1e-9)
    seconds = tokens * 6 * params / flops
    return seconds, f"estimate: {tokens:,.0f} tokens x 6 x params on {gpu.name} x {gpus:g}"


def kmeans_seconds(gpu: Accelerator, sample: int, lists: int, dim: int) -> tuple[float, str]:
    """Seconds of the index train task's k-means on one GPU."""
    work = 2 * sample * lists * dim * KMEANS_ITERATIONS
    seconds = work / (gpu.fp32_tflops * 1e12 * KMEANS_EFFICIENCY)
    return seconds, f"k-means estimate: {work:.3g} FLOPs at fp32 on one {gpu.name}"
