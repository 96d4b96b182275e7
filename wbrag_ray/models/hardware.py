"""What the local hardware supports, decided once per process."""

from __future__ import annotations

import functools
import logging
import math
import os
import time
from collections.abc import Callable, Mapping

from wbrag_ray.config import ConfigError

log = logging.getLogger(__name__)


@functools.cache
def _cpuinfo(path: str = "/proc/cpuinfo") -> tuple[str, frozenset[str]]:
    """(model name, flags) of the first CPU in `path`; ("", {}) where there is none to read."""
    model, flags = "", frozenset()
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not model:
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = frozenset(value.split())
    except OSError:
        pass
    return model, flags


def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """True where the CPU has native bf16 matmul (AVX512-BF16 or AMX); elsewhere bf16 is emulated and slow."""
    flags = _cpuinfo(cpuinfo)[1]
    return "avx512_bf16" in flags or "amx_bf16" in flags


MATMUL_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def cpu_matmul_flags(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU flags that decide model speed: without avx512_bf16, bf16 is emulated and `dtype: auto` runs fp32."""
    flags = _cpuinfo(cpuinfo)[1]
    if not flags:
        return "unknown"
    return " ".join(w for w in MATMUL_FLAGS if w in flags) or "none of " + " ".join(MATMUL_FLAGS)


# Variables that hold math libraries below this CPU's instruction set, as `make test-avx2` sets them.
AVX2_ONLY_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
                 "OPENBLAS_CORETYPE": "Haswell"}
# oneDNN's instruction sets below AVX512_CORE_BF16: held to one of them, bf16 is emulated whatever the CPU has
ONEDNN_WITHOUT_BF16 = frozenset({"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"})


def held_kernels(environ: Mapping[str, str] | None = None) -> str:
    """The variables of AVX2_ONLY_ENV that `environ` (this process's) sets, "NAME=value ...": "" where none."""
    environ = os.environ if environ is None else environ
    return " ".join(f"{k}={environ[k]}" for k in AVX2_ONLY_ENV if environ.get(k))


def cpu_kind(cpuinfo: str = "/proc/cpuinfo", environ: Mapping[str, str] | None = None) -> str:
    """The CPU for a log line: model, matmul flags, timing kind, and the variables holding its kernels lower."""
    model, flags = _cpuinfo(cpuinfo)
    kind = "AVX512-BF16" if cpu_has_native_bf16(cpuinfo) else "AVX2 only" if "avx2" in flags else "no AVX2"
    line = f"{model or 'unknown model'}, flags {cpu_matmul_flags(cpuinfo)}: {kind}"
    held = held_kernels(environ)
    return f"{line}, kernels held by {held}" if held else line


def cpu_supports_bf16(environ: Mapping[str, str] | None = None) -> bool:
    """Whether `dtype: auto` takes bf16 on this CPU: where native and not held below (ONEDNN_MAX_CPU_ISA), unless
    WBRAG_CPU_BF16=0."""
    environ = os.environ if environ is None else environ
    held_below = environ.get("ONEDNN_MAX_CPU_ISA", "").upper() in ONEDNN_WITHOUT_BF16
    return cpu_has_native_bf16() and not held_below and environ.get("WBRAG_CPU_BF16", "1") != "0"


def pick_dtype(requested: str, device: str):
    """The torch dtype for 'auto' / 'float32' / 'bfloat16' on `device` (`resolved_dtype_name`'s on CPUs)."""
    import torch

    if requested == "auto" and device.startswith("cuda"):
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return getattr(torch, resolved_dtype_name(requested, 0))


def pick_device(num_gpus: float) -> str:
    """"cuda" where a stage asked for GPUs and torch sees one. A Ray GPU worker whose torch sees none is refused
    (a GPU stage on CPU would take days, silently); outside such a worker the stage runs on CPU and says so."""
    import torch

    if num_gpus <= 0:
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    granted = granted_gpus()
    if granted:
        raise ConfigError(
            f"Ray granted this worker GPU {', '.join(map(str, granted))}, but torch {torch.__version__} (CUDA build: "
            f"{torch.version.cuda or 'none, a CPU-only build'}) sees no CUDA device: install the torch build for "
            "the node's CUDA driver (the project's GPU image does), or set num_gpus: 0 for this stage")
    log.warning("num_gpus=%g asks for a GPU and this process has none (not a Ray worker granted one): on CPU",
                num_gpus)
    return "cpu"


def require_gpu(stage: str, key: str, num_gpus: float, setting: str | None = None) -> None:
    """Refuse, before any work, a stage configured for GPUs where this process has none visible to torch."""
    if num_gpus <= 0:
        return
    import torch

    if torch.cuda.is_available():
        return

    setting = setting or f"{key}.num_gpus"
    granted = granted_gpus()
    what = (f"; Ray granted it GPU {', '.join(map(str, granted))}: install the torch build for the node's CUDA "
            "driver (the project's GPU image does)" if granted else "")
    raise ConfigError(
        f"{stage} asks for {num_gpus:g} GPU{'s' * (num_gpus != 1)} ({setting}) but the node it runs on has none "
        f"visible to torch (torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none, a CPU-only build'}"
        f"{what}); set {setting}: 0 to run on CPU")


def granted_gpus() -> list:
    """The GPU ids Ray assigned to this worker process (none in a driver, or outside Ray)."""
    try:
        import ray

        return list(ray.get_gpu_ids()) if ray.is_initialized() else []
    except Exception:  # noqa: BLE001 - no Ray, or a driver it does not count as a worker: nothing granted
        return []


def in_ray_worker() -> bool:
    """Whether this process is a Ray task's or actor's worker (not a driver, not outside Ray)."""
    try:
        import ray

        return ray.is_initialized() and ray.get_runtime_context().worker.mode == ray.WORKER_MODE
    except (ImportError, AttributeError):
        return False


def gpus_usable() -> bool:
    """Whether this process may use a GPU: in a Ray worker only when Ray reserved one for it."""
    return bool(granted_gpus()) if in_ray_worker() else True


def usable_cpus(cgroup: str = "/sys/fs/cgroup") -> int:
    """The CPUs this process may run on: its affinity mask, capped by a cgroup CPU quota."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    for path in (f"{cgroup}/cpu.max", f"{cgroup}/cpu/cpu.cfs_quota_us"):
        try:
            with open(path) as f:
                fields = f.read().split()
            if path.endswith("cpu.max"):  # cgroup v2: "<quota> <period>" or "max <period>"
                quota, period = fields[0], fields[1] if len(fields) > 1 else "100000"
            else:  # cgroup v1: the quota here, the period beside it; -1 for none
                with open(f"{cgroup}/cpu/cpu.cfs_period_us") as f:
                    quota, period = fields[0], f.read().strip()
        except (OSError, IndexError):
            continue
        if quota not in ("max", "-1") and int(period) > 0:
            cpus = min(cpus, max(1, int(int(quota) / int(period))))
        break
    return max(1, cpus)


def threads_of(num_cpus: float, threads: int | None = None) -> int:
    """The torch threads of a process given `num_cpus` of Ray's CPUs: `threads` where set, else the CPUs rounded up."""
    return threads or max(1, math.ceil(num_cpus))


def set_threads(num_cpus: float, threads: int | None = None) -> int:
    """Match torch's intra-op threads to the actor's CPU allocation (no oversubscription)."""
    import torch

    threads = threads_of(num_cpus, threads)
    torch.set_num_threads(threads)
    return threads


def _node_busy_seconds(stat: str = "/proc/stat") -> float:
    """CPU-seconds the node's CPUs have spent on anything but idling (user, nice, system, irq, softirq, steal)."""
    with open(stat) as f:
        ticks = [int(x) for x in f.readline().split()[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


class FreeCpus:
    """Torch threads that follow what the node leaves free: the actor's own CPUs (`num_cpus`, rounded up) plus the
    node's CPUs nothing else computed on since the last reading (the node's busy time less this process's own).
    Measured, not read from Ray's reservations: an idle search actor holds CPUs it does not use, and a neighbour
    outside Ray uses CPUs it never reserved (two threads beside a busy core run at half the speed of one).
    `threads` (the setting) fixes them instead."""

    WINDOW_S = 0.1  # a first reading, or one after a long pause, measures this long before the call

    def __init__(self, num_cpus: float, threads: int | None = None, cpus: int | None = None,
                 busy: Callable[[], float] = _node_busy_seconds):
        self.own, self.fixed = threads_of(num_cpus), threads
        self.cpus = max(self.own, cpus or usable_cpus())
        self._busy = busy
        self._last: tuple[float, float, float] | None = None

    def _reading(self) -> tuple[float, float, float]:
        mine = os.times()
        return time.monotonic(), self._busy(), mine.user + mine.system

    def others(self) -> float:
        """CPUs the node's other processes kept busy since the last reading (at least WINDOW_S ago)."""
        now = self._reading()
        if self._last is None or now[0] - self._last[0] > 60:  # a pause: what others do now, not what they did
            self._last = now
            time.sleep(self.WINDOW_S)
            now = self._reading()
        (t0, busy0, mine0), (t1, busy1, mine1) = self._last, now
        self._last = now
        return max(0.0, (busy1 - busy0) - (mine1 - mine0)) / max(t1 - t0, 1e-3)

    def threads(self) -> int:
        if self.fixed:
            return self.fixed
        return max(self.own, min(self.cpus, math.floor(self.cpus - self.others() + 0.25)))

    def apply(self) -> int:
        """Set this thread's torch threads (OpenMP's count is per calling thread) to `threads()`."""
        import torch

        n = self.threads()
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
        return n


def resolved_dtype_name(requested: str, num_gpus: float) -> str:
    """The dtype 'auto' becomes, by name, without importing torch (CPU: bf16 where native; GPU: the worker's)."""
    if requested != "auto":
        return requested
    if num_gpus > 0:
        return "auto (gpu)"
    return "bfloat16" if cpu_supports_bf16() else "float32"


if __name__ == "__main__":  # `make test-avx2`: the variables to run under
    print(held_kernels(AVX2_ONLY_ENV))
