"""What a result was made from, by content: models, adapters, routers and indexes given by path are identified by
their files, so a folder rewritten in place is another input; generators also by dtype and device."""

from __future__ import annotations

import hashlib
import os
from typing import Any

import pyarrow.fs as pafs

from wbrag_ray.config import ConfigError, GeneratorConfig
from wbrag_ray.index.files import MANIFEST
from wbrag_ray.models.bundled import bundled_path
from wbrag_ray.models.hardware import resolved_dtype_name
from wbrag_ray.storage import resolve

# GPUs without bf16 by Ray's accelerator_type: dtype auto takes fp16 on them.
GPUS_WITHOUT_BF16 = ("V100", "P100", "P40", "P4", "T4", "K80", "K40", "M60", "M40")


def local_or_remote_path(spec: str) -> str | None:
    """The path or URI `spec` names, or None (a hub id, an API model name)."""
    if spec.startswith("bundled:"):
        try:
            return str(bundled_path(spec.split(":", 1)[1]))
        except ConfigError:
            return None
    if "://" in spec or spec.startswith(("/", "./", "../", "~")) or os.path.exists(spec):
        return os.path.expanduser(spec)
    return None


def content_identity(spec: str | None) -> str | None:
    """A 16-hex digest of the names, sizes and times of the files at `spec`; None where no such path exists."""
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
    """An index folder's identity: its manifest's (written last by every build)."""
    return content_identity(f"{index_uri.rstrip('/')}/{MANIFEST}") if index_uri else None


def gpu_kind() -> str | None:
    """The GPU model the generator decodes on ('H100'; several joined by '+'), or None."""
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
    """(resolved dtype, device kind) of a model with `dtype` and `num_gpus`."""
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
    """What besides its settings decides a generator's answers: model and adapter content, dtype, device."""
    dtype, device = decoding_device(config.dtype, config.num_gpus)
    return {"model": content_identity(config.model),
            "lora_adapter": content_identity(config.lora_adapter) if config.lora_adapter else None,
            "dtype": dtype, "device": device}
