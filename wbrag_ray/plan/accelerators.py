"""First-principles times for the model stages where no rate was measured on their hardware: the FLOPs and bytes of
generation, embedding, training and its collectives, k-means and model loads, against an accelerator's peaks
(`models.accelerators`, `--gpu`), the links between nodes (`--interconnect`) and the share of a peak a stage reaches
(`*_EFFICIENCY`); formula by formula: docs/architecture.md, "The plan's first-principles estimates".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from wbrag_ray.models.accelerators import Accelerator
from wbrag_ray.placement.gpus import ENGINE_MEMORY_UTILIZATION


@dataclass(frozen=True)
class Interconnect:
    """The network between nodes: GB/s each way a GPU has of it (a node's NICs shared by its GPUs), and its
    source."""

    name: str
    gbs_per_gpu: float
    source: str

    def describe(self) -> str:
        return f"{self.name}: {self.gbs_per_gpu:g} GB/s each way a GPU ({self.source})"


_INTERCONNECTS = (
    Interconnect("ib-ndr-400", 50, "InfiniBand NDR, a 400 Gb/s ConnectX-7 port a GPU (NVIDIA DGX H100 / H200 user "
                 "guide: 8 single-port ConnectX-7 for the compute fabric)"),
    Interconnect("ib-hdr-200", 25, "InfiniBand HDR, a 200 Gb/s ConnectX-6 port a GPU (NVIDIA DGX A100 user guide: "
                 "8 single-port ConnectX-6 for the compute fabric)"),
    Interconnect("efa-3200", 50, "AWS EFA, 3,200 Gb/s an 8-GPU instance (EC2 P5 specifications): 400 Gb/s a GPU"),
    Interconnect("efa-400", 6.25, "AWS EFA, 400 Gb/s an 8-GPU instance (EC2 P4d specifications): 50 Gb/s a GPU"),
    Interconnect("ethernet-100", 1.5625, "100 Gb/s Ethernet a node, shared by its 8 GPUs"),
)
INTERCONNECTS: dict[str, Interconnect] = {i.name: i for i in _INTERCONNECTS}
DEFAULT_INTERCONNECT = "ib-ndr-400"
# a node's read rate of model files: local NVMe, or an object store in the region (assumed; `--storage-read-gbs`)
STORAGE_READ_GBS = 2.0

# the share of a peak a stage reaches: stated, below what RESULTS.md's "GPU check on one H200" measured (which
# leaves out tokenizing, reading and writing); calibration replaces them with the cluster's own rates
COMPUTE_EFFICIENCY = 0.5  # prefill of a large model
TRAINING_EFFICIENCY = 0.3  # a LoRA step (forward, backward, recomputation, optimizer)
BANDWIDTH_EFFICIENCY = 0.7  # decode: reading the weights (and KV cache) once per step
ENCODER_EFFICIENCY = 0.25  # small encoders (e5-base, MiniLM) on short texts
KMEANS_EFFICIENCY = 0.5  # faiss GPU k-means: a matmul at fp32 plus the assignment
LINK_EFFICIENCY = 0.7  # collectives: NCCL's bus bandwidth of a link's peak (nccl-tests reach 70-85% on NVLink)
COLLECTIVE_LATENCY_S = 20e-6  # a collective's fixed cost (a layer's all-gather is one)
# generator.batch_invariant pins a tensor-parallel vLLM replica's NCCL to one channel (vllm/model_executor/
# determinism/batch_invariant.py) of the about 16 an NVLink all-reduce spreads over: assumed a sixteenth of its bandwidth
BATCH_INVARIANT_CHANNEL_SHARE = 1 / 16
DECODE_BATCH = 256  # sequences decoded together per replica (vLLM's max_num_seqs default)
KMEANS_ITERATIONS = 25  # faiss's Clustering default niter
EFFICIENCY_NOTE = (f"estimates assume {COMPUTE_EFFICIENCY:.0%} of the peak bf16 rate for prefill, "
                   f"{TRAINING_EFFICIENCY:.0%} for training, "
                   f"{BANDWIDTH_EFFICIENCY:.0%} of the memory bandwidth for decode (up to {DECODE_BATCH} sequences a "
                   f"step, weights and KV cache read once a step), {ENCODER_EFFICIENCY:.0%} for embedding, "
                   f"{KMEANS_EFFICIENCY:.0%} of fp32 for k-means ({KMEANS_ITERATIONS} iterations), "
                   f"{LINK_EFFICIENCY:.0%} of a link's peak for collectives (+ {COLLECTIVE_LATENCY_S * 1e6:g} us each)")


def interconnect(name: str) -> Interconnect:
    """The table's entry for `name`; ValueError naming the choices."""
    if name.lower() not in INTERCONNECTS:
        raise ValueError(f"unknown interconnect {name!r}; choose one of {', '.join(INTERCONNECTS)}")
    return INTERCONNECTS[name.lower()]


def collective_seconds(kind: str, size_bytes: float, ranks: int, link_gbs: float, count: int = 1) -> float:
    """Seconds of `count` collectives of `size_bytes` over `ranks` ranks whose slowest link is `link_gbs` GB/s
    each way: "all-gather" / "reduce-scatter" move size x (n - 1) / n through each rank's link, "all-reduce"
    twice that (NCCL's bus bandwidth), at `LINK_EFFICIENCY`, plus `COLLECTIVE_LATENCY_S` each."""
    if ranks <= 1 or size_bytes <= 0:
        return 0.0
    moved = size_bytes * (ranks - 1) / ranks * (2 if kind == "all-reduce" else 1)
    return count * (moved / (link_gbs * 1e9 * LINK_EFFICIENCY) + COLLECTIVE_LATENCY_S)


def generation_seconds(gpu: Accelerator, params: float, calls: int, prompt_tokens: float, new_tokens: int,
                       gpus: float, replicas: int, kv_bytes_per_token: float | None = None, tp: int = 1,
                       hidden: int | None = None, layers: int | None = None,
                       batch_invariant: bool = False,
                       memory_share: float = ENGINE_MEMORY_UTILIZATION) -> tuple[float, str]:
    """Seconds for `calls` generations of `prompt_tokens` + `new_tokens` on `replicas` replicas of `gpus` GPUs
    each (a tensor-parallel replica's GPUs add their FLOPs and bandwidth together), and how. A decode step reads
    the weights and its batch's KV cache (`kv_bytes_per_token` of every token so far; the batch is what the
    `memory_share` of the GPUs' memory the weights leave holds, at most `DECODE_BATCH`); a tensor-parallel group of `tp` adds two all-reduces
    of the activations (`hidden` wide) in each of `layers` layers, over NVLink (`batch_invariant`: NCCL's one
    channel, `BATCH_INVARIANT_CHANNEL_SHARE` of it)."""
    per_replica = max(1, replicas)
    flops = gpu.bf16_tflops * 1e12 * COMPUTE_EFFICIENCY * gpus
    bandwidth = gpu.bandwidth_tbs * 1e12 * BANDWIDTH_EFFICIENCY * gpus
    weights = params * 2
    context = prompt_tokens + new_tokens / 2  # the mean sequence a decode step reads the cache of
    kv = (kv_bytes_per_token or 0.0) * context  # a sequence's cache, on average over its decode
    fits = int((gpu.memory_gb * 1e9 * memory_share * gpus - weights) / kv) if kv else DECODE_BATCH
    batch = max(1, min(DECODE_BATCH, math.ceil(calls / per_replica), fits))
    step = max((weights + batch * kv) / bandwidth, batch * 2 * params / flops)
    prefill = calls * 2 * params * prompt_tokens / flops
    comm, comm_how = 0.0, ""
    if tp > 1 and hidden and layers:  # two all-reduces of a layer's activations (attention out, MLP out)
        link = gpu.link_gbs * (BATCH_INVARIANT_CHANNEL_SHARE if batch_invariant else 1)
        step += collective_seconds("all-reduce", batch * hidden * 2, tp, link, 2 * layers)
        comm = calls * collective_seconds("all-reduce", prompt_tokens * hidden * 2, tp, link, 2 * layers)
        comm_how = f", tensor-parallel all-reduces {2 * layers} a step over {gpu.link}" + (
            f" at {BATCH_INVARIANT_CHANNEL_SHARE:.3g} of its bandwidth (batch-invariant: NCCL's one channel)"
            if batch_invariant else " (not batch-invariant)")
    steps = math.ceil(calls / per_replica / batch) * new_tokens
    seconds = prefill / per_replica + comm / per_replica + steps * step
    cache = f" + KV cache {batch * kv / 1e9:,.1f} GB" if kv else " (KV cache not counted: the model's layout unknown)"
    return seconds, (f"estimate: {calls:,} calls x ({prompt_tokens:,.0f} prompt tokens prefilled at 2 x params, "
                     f"{new_tokens} new tokens decoded {batch} at once at {step * 1e3:.3g} ms a step: weights "
                     f"{weights / 1e9:,.1f} GB{cache} a step{comm_how}) on {gpu.name} x {gpus:g} a replica, "
                     f"{per_replica} replica(s)")


def encode_seconds(gpu: Accelerator, params: float, texts: int, tokens: float, gpus: float,
                   actors: int) -> tuple[float, str]:
    """Seconds to embed `texts` of `tokens` each on `actors` actors of `gpus` GPUs (a fraction shares one)."""
    flops = gpu.bf16_tflops * 1e12 * ENCODER_EFFICIENCY * min(1.0, gpus) * max(1, actors)
    seconds = texts * 2 * params * tokens / flops
    return seconds, (f"estimate: {texts:,} texts x {tokens:,.0f} tokens x 2 x params on {gpu.name} x "
                     f"{min(1.0, gpus):g} x {actors} actor(s)")


def training_seconds(gpu: Accelerator, params: float, tokens: float, gpus: float) -> tuple[float, str]:
    """Seconds to train on `tokens` tokens (steps x batch x the rows' padded length) over `gpus` GPUs in all."""
    flops = gpu.bf16_tflops * 1e12 * TRAINING_EFFICIENCY * max(gpus, 1e-9)
    seconds = tokens * 6 * params / flops
    return seconds, f"{tokens:,.0f} tokens x 6 x params on {gpu.name} x {gpus:g}"


def training_communication(gpu: Accelerator, net: Interconnect, params: float, trainable: float, workers: int,
                           per_node: int, strategy: str, layers: int | None, hybrid: bool = True) -> tuple[float, str]:
    """Seconds of one training step's collectives, and how: `workers` ranks, `per_node` of them a node.

    fsdp: each decoder layer's bf16 weights all-gathered in the forward and again in the backward (FSDP2
    reshards after the forward), and the trainable (LoRA) gradients reduce-scattered in fp32, over the shard
    group: with `hybrid`, a node's ranks (the weights replicated across nodes, the gradient shards then
    all-reduced across them), else every rank, over the network as soon as they span nodes. ddp: the trainable
    gradients all-reduced. Over NVLink (the GPU's link) within a node, the network across nodes."""
    nodes = max(1, math.ceil(workers / max(1, per_node)))
    n_layers = layers or 1
    grads = trainable * 4
    if strategy == "fsdp":
        group = min(workers, max(1, per_node)) if hybrid else workers
        link = gpu.link_gbs if group <= per_node else min(gpu.link_gbs, net.gbs_per_gpu)
        over = gpu.link if group <= per_node else f"{net.name} (the group spans {nodes} nodes)"
        # a layer's weights at a time (`shard_fsdp` wraps each decoder layer), twice a step; its gradients once
        gather = collective_seconds("all-gather", params * 2 / n_layers, group, link, 2 * n_layers)
        scatter = collective_seconds("reduce-scatter", grads / n_layers, group, link, n_layers)
        across = collective_seconds("all-reduce", grads / group, nodes, net.gbs_per_gpu) if hybrid and nodes > 1 else 0.0
        how = (f"all-gathers of {params * 2 / 1e9:,.1f} GB of bf16 weights x 2 a step over {group} ranks' {over} "
               f"({gather:.3g} s), LoRA gradients reduce-scattered ({scatter:.2g} s)"
               + (f" and all-reduced across {nodes} nodes over {net.name} ({across:.2g} s; hybrid: sharded within a "
                  "node, replicated across nodes)" if across else ""))
        return gather + scatter + across, how
    link = gpu.link_gbs if nodes == 1 else min(gpu.link_gbs, net.gbs_per_gpu)
    seconds = collective_seconds("all-reduce", grads, workers, link)
    return seconds, (f"LoRA gradients ({trainable / 1e6:,.3g}M) all-reduced over {workers} ranks "
                     f"({gpu.link if nodes == 1 else net.name}): {seconds:.2g} s")


def load_seconds(model_bytes: float, readers: int, storage_gbs: float) -> float:
    """Seconds for `readers` processes of a node to read `model_bytes` each at the node's `storage_gbs` GB/s."""
    return model_bytes * max(1, readers) / (storage_gbs * 1e9)


def kmeans_seconds(gpu: Accelerator, sample: int, lists: int, dim: int) -> tuple[float, str]:
    """Seconds of the index train task's k-means on one GPU."""
    work = 2 * sample * lists * dim * KMEANS_ITERATIONS
    seconds = work / (gpu.fp32_tflops * 1e12 * KMEANS_EFFICIENCY)
    return seconds, f"k-means estimate: {work:.3g} FLOPs at fp32 on one {gpu.name}"
