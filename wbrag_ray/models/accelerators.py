"""The GPUs people run on, as their datasheets give them: peak bf16 and fp32 rates, memory bandwidth and size, and
the link to the other GPUs of a node. The plan prices work with them; the runtime reads a GPU's memory from the
model Ray labels a node with (`accelerator_type:H100`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Accelerator:
    """One GPU's peak figures: dense bf16 tensor TFLOP/s (no sparsity), fp32 TFLOP/s (no tensor cores), memory
    bandwidth (TB/s) and memory (GB), and its link to the other GPUs of its node (GB/s each way: NVLink, or PCIe
    where it has none), with the datasheet they come from."""

    name: str
    bf16_tflops: float
    fp32_tflops: float
    bandwidth_tbs: float
    memory_gb: float
    source: str
    link_gbs: float = 32.0  # GB/s each way to another GPU of the node
    link: str = "PCIe Gen4 x16"

    def describe(self) -> str:
        return (f"{self.name}: {self.bf16_tflops:g} TFLOP/s bf16 dense, {self.fp32_tflops:g} TFLOP/s fp32, "
                f"{self.bandwidth_tbs:g} TB/s, {self.memory_gb:g} GB, {self.link} {self.link_gbs:g} GB/s each way "
                f"({self.source})")


# NVLink figures are the datasheets' totals of both directions, halved; PCIe Gen5 x16: 64 GB/s each way, Gen4: 32
_ACCELERATORS = (
    Accelerator("A100-40GB", 312, 19.5, 1.555, 40, "NVIDIA A100 Tensor Core GPU datasheet (SXM)", 300, "NVLink 3"),
    Accelerator("A100-80GB", 312, 19.5, 2.039, 80, "NVIDIA A100 Tensor Core GPU datasheet (SXM)", 300, "NVLink 3"),
    Accelerator("H100", 989, 67, 3.35, 80, "NVIDIA H100 Tensor Core GPU datasheet (SXM; 1,979 bf16 is with sparsity; "
                "NVLink 900 GB/s)", 450, "NVLink 4"),
    Accelerator("H100-PCIe", 756, 51, 2.0, 80, "NVIDIA H100 Tensor Core GPU datasheet (PCIe; 1,513 bf16 is with "
                "sparsity; PCIe Gen5 128 GB/s, NVLink bridges only between pairs)", 64, "PCIe Gen5 x16"),
    Accelerator("H100-NVL", 835, 60, 3.9, 94, "NVIDIA H100 Tensor Core GPU datasheet (NVL; 1,671 bf16 is with "
                "sparsity; NVLink bridge 600 GB/s between a pair, PCIe Gen5 to the rest)", 64, "PCIe Gen5 x16"),
    Accelerator("H200", 989, 67, 4.8, 141, "NVIDIA H200 Tensor Core GPU datasheet (SXM; NVLink 900 GB/s)", 450,
                "NVLink 4"),
    Accelerator("H200-NVL", 835, 60, 4.8, 141, "NVIDIA H200 Tensor Core GPU datasheet (NVL; 1,671 bf16 is with "
                "sparsity; 2- or 4-way NVLink bridge 900 GB/s)", 450, "NVLink bridge"),
    Accelerator("L4", 121, 30.3, 0.3, 24, "NVIDIA L4 Tensor Core GPU datasheet (242 bf16 is with sparsity; PCIe Gen4 "
                "x16 64 GB/s)"),
    Accelerator("L40S", 362, 91.6, 0.864, 48, "NVIDIA L40S GPU datasheet (733 bf16 is with sparsity; PCIe Gen4 x16 "
                "64 GB/s)"),
    Accelerator("A10G", 70, 31.2, 0.6, 24, "AWS EC2 G5 instance specifications (A10G, an A10 variant NVIDIA publishes "
                "no datasheet for; the A10's is 125 TFLOP/s bf16)"),
)
ACCELERATORS: dict[str, Accelerator] = {a.name: a for a in _ACCELERATORS}
DEFAULT_GPU = "H100"

# what a GPU is taken to hold where neither ray.gpu_memory_gb nor Ray's accelerator_type says
DEFAULT_GPU_MEMORY_GB = 80.0


def accelerator(name: str) -> Accelerator:
    """The table's entry for `name` (case and dashes ignored: "h100", "a100-80gb"); ValueError naming the choices."""
    key = name.replace("-", "").replace("_", "").lower()
    for a in _ACCELERATORS:
        if a.name.replace("-", "").lower() == key:
            return a
    raise ValueError(f"unknown GPU {name!r}; choose one of {', '.join(ACCELERATORS)}")

