"""What a result was made from, by content rather than by name: a model, an adapter, a router or an index given
by path is identified by its files (their names, sizes and modification times), so a folder rewritten in place
(an adapter retrained with --force, a write-back version trained again) is another input, and the answers and
caches of the old one are never taken for it. Generators also differ by the dtype and device they decode on.
"""

from __future__ import annotations

import hashlib
import os
from typing import TYPE_CHECKING, Any

from wbrag_ray.config import ConfigError

if TYPE_CHECKING:
    from wbrag_ray.config import GeneratorConfig

# GPUs without bf16 (compute capability below 8.0), by the name Ray gives a node's accelerator_type: where a
# generator's dtype is auto, torch takes fp16 on them and bf16 on every later GPU (`hardware.pick_dtype`).
GPUS_WITHOUT_BF16 = ("V100", "P100", "P40", "P4", "T4", "K80", "K40", "M60", "M40")


def local_or_remote_path(spec: str) -> str | None:
    """The path or URI `spec` names (a model, adapter or index by path; a bundled model's file), or None where it
    names none (a hub id, an API model name)."""
    if spec.startswith("bundled:"):
        from wbrag_ray.models.bundled import bundled_path

        try:
            return str(bundled_path(spec.split(":", 1)[1]))
        except ConfigError:
            return None
    if "://" in spec or spec.startswith(("/", "./", "../", "~")) or os.path.exists(spec):
        return os.path.expanduser(spec)
    return None


def content_identity(spec: str | None) -> str | None:
    """A 16-hex digest of the files at `spec` (a file, or a folder's files, recursively): their names relative to
    it, their sizes and modification times. None where `spec` names no path that exists (a hub id: its name is its
    identity). Reading no file's content, it costs one listing, also on object storage."""
    import pyarrow.fs as pafs

    from wbrag_ray.storage import resolve

    path = local_or_remote_path(spec) if spec else None
    if path is None:
        return None
    loc = resolve(path)
    info = loc.fs.get_file_info(loc.path)
    if info.type == pafs.FileType.NotFound:
        return None
    if info.type == pafs.FileType.File:
        listing = [(info.base_name, info.size, info.mtime_ns)]
    else:
        infos = loc.fs.get_file_info(pafs.FileSelector(loc.path, recursive=True))
        listing = sorted((i.path[len(loc.path):], i.size, i.mtime_ns) for i in infos if i.type == pafs.FileType.File)
    return hashlib.blake2b(repr(listing).encode(), digest_size=8).hexdigest()


def index_identity(index_uri: str | None) -> str | None:
    """An index folder's identity: its manifest's (written last by every build, so a rebuilt index has another);
    the folder's other files (documents, caches beside it) do not count."""
    from wbrag_ray.index.files import MANIFEST

    return content_identity(f"{index_uri.rstrip('/')}/{MANIFEST}") if index_uri else None


def gpu_kind() -> str | None:
    """The GPU model the generator decodes on: the accelerator type Ray reports for the cluster's GPU nodes ('H100';
    several joined by '+'), else this process's own GPU's name; None where neither is known."""
    try:
        import ray

        if ray.is_initialized():
            kinds = sorted(k.split(":", 1)[1] for k in ray.cluster_resources() if k.startswith("accelerator_type:"))
            if kinds:
                return "+".join(kinds)
    except Exception:  # noqa: BLE001 - no Ray, or no cluster to ask: fall back to this process's GPU
        pass
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001 - torch without CUDA: nothing more to know
        pass
    return None


def decoding_device(dtype: str, num_gpus: float) -> tuple[str, str]:
    """(resolved dtype, device kind) of a model configured with `dtype` and `num_gpus`: 'auto' on a GPU is bf16, or
    fp16 on a GPU without bf16, by the GPU's kind ('auto (gpu of unknown kind)' only where no GPU kind is known);
    on CPU what `hardware.resolved_dtype_name` says."""
    from wbrag_ray.models.hardware import resolved_dtype_name

    if num_gpus <= 0:
        return resolved_dtype_name(dtype, 0.0), "cpu"
    kind = gpu_kind()
    if dtype == "auto":
        if kind is None:
            dtype = "auto (gpu of unknown kind)"
        else:
            dtype = "float16" if any(k in GPUS_WITHOUT_BF16 for k in kind.replace("+", " ").split()) else "bfloat16"
    return dtype, f"gpu {kind or 'of unknown kind'}"


def generator_identity(config: GeneratorConfig) -> dict[str, Any]:
    """What, besides its settings, decides a generator's greedy answers: its model's and adapter's content (where
    given by path), the dtype it resolves to and the device it decodes on."""
    dtype, device = decoding_device(config.dtype, config.num_gpus)
    return {"model": content_identity(config.model),
            "lora_adapter": content_identity(config.lora_adapter) if config.lora_adapter else None,
            "dtype": dtype, "device": device}
