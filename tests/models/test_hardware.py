"""The CPU kind read from /proc/cpuinfo: the two kinds the project's timings are given for, told apart by their
flags, on cpuinfo files written here (an AVX2-only EPYC, an AVX512-BF16 Xeon) and on this machine's own; and the
variables `make test-avx2` holds the kernels lower with, checked on torch in a process of their own."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from wbrag_ray.doctor import check_cpus
from wbrag_ray.models.hardware import (
    AVX2_ONLY_ENV,
    FreeCpus,
    cpu_has_native_bf16,
    cpu_kind,
    cpu_matmul_flags,
    cpu_supports_bf16,
    held_kernels,
    usable_cpus,
)

EPYC = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse sse2 avx avx2 fma bmi2
processor\t: 1
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse sse2 avx avx2 fma bmi2
"""
XEON = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8481C
flags\t\t: fpu sse2 avx avx2 avx512f avx512bw avx512_bf16 amx_bf16 amx_tile
"""


def test_the_two_cpu_kinds_are_told_apart_by_their_flags(tmp_path):
    (epyc := tmp_path / "epyc").write_text(EPYC)
    (xeon := tmp_path / "xeon").write_text(XEON)
    assert not cpu_has_native_bf16(str(epyc)) and cpu_has_native_bf16(str(xeon))
    assert cpu_matmul_flags(str(epyc)) == "avx2"
    assert cpu_matmul_flags(str(xeon)) == "avx2 avx512f avx512_bf16 amx_bf16"
    assert cpu_kind(str(epyc), {}) == "AMD EPYC 7B13, flags avx2: AVX2 only"
    assert cpu_kind(str(xeon), {}) == "Intel(R) Xeon(R) Platinum 8481C, flags avx2 avx512f avx512_bf16 amx_bf16: AVX512-BF16"
    assert cpu_kind(str(tmp_path / "absent"), {}) == "unknown model, flags unknown: no AVX2"
    held = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "PATH": "/bin"}
    assert cpu_kind(str(xeon), held).endswith(": AVX512-BF16, kernels held by ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2")


def test_the_doctor_names_this_machines_kind_and_the_dtype_auto_takes_here(monkeypatch):
    flags = next(line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags"))
    native = "avx512_bf16" in flags or "amx_bf16" in flags
    # the user's default: the suite's float32 pin (tests/conftest.py) off, and no kernels held (`make test-avx2`)
    for name in ("WBRAG_CPU_BF16", *AVX2_ONLY_ENV):
        monkeypatch.delenv(name, raising=False)
    detail = check_cpus().detail
    kind = "AVX512-BF16" if native else "AVX2 only" if "avx2" in flags else "no AVX2"
    assert f"{kind}, so dtype auto runs {'bfloat16' if native else 'float32'} on them" in detail
    monkeypatch.setenv("WBRAG_CPU_BF16", "0")
    assert "dtype auto runs float32" in check_cpus().detail


def test_the_avx2_variables_hold_torchs_kernels_to_avx2_and_dtype_auto_to_float32():
    """In a process started under `make test-avx2`'s variables, torch dispatches its AVX2 kernels whatever the CPU
    has; and `dtype: auto` takes float32 where oneDNN is held below bf16 (bf16 is emulated there)."""
    flags = next(line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags"))
    script = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    env = {k: v for k, v in os.environ.items() if k not in AVX2_ONLY_ENV}
    free = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    held = subprocess.run([sys.executable, "-c", script], env={**env, **AVX2_ONLY_ENV}, capture_output=True,
                          text=True, check=True)
    assert held.stdout.strip() == ("AVX2" if "avx2" in flags else free.stdout.strip())
    if "avx512f" in flags:  # the variables made the difference
        assert free.stdout.strip().startswith("AVX512")

    # the line `make test-avx2` puts before pytest, written out by hand; and only what an environment sets, at its value
    assert held_kernels({}) == "" and held_kernels(AVX2_ONLY_ENV) == (
        "ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 OPENBLAS_CORETYPE=Haswell")
    assert held_kernels({"PATH": "/bin", "OPENBLAS_CORETYPE": "Zen", "ATEN_CPU_CAPABILITY": "",
                         "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}) == "ONEDNN_MAX_CPU_ISA=AVX512_CORE OPENBLAS_CORETYPE=Zen"
    assert not cpu_supports_bf16({"ONEDNN_MAX_CPU_ISA": "AVX2"})
    assert not cpu_supports_bf16({"ONEDNN_MAX_CPU_ISA": "avx512_core"})
    assert cpu_supports_bf16({}) == cpu_has_native_bf16()
    assert cpu_supports_bf16({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}) == cpu_has_native_bf16()


def test_a_stage_configured_for_gpus_is_refused_where_torch_sees_none_naming_the_stage_and_the_setting():
    """This machine's torch sees no GPU: a stage asking for one is refused (a CPU run of a GPU stage would take days,
    silently), one asking for none passes; where a setting other than `<key>.num_gpus` decides, it is named."""
    import pytest
    import torch

    from wbrag_ray.config import ConfigError
    from wbrag_ray.models.hardware import require_gpu

    assert not torch.cuda.is_available()
    require_gpu("the LM pruner's training", "zerorag.lm_pruner.trainer", 0)
    with pytest.raises(ConfigError) as refused:
        require_gpu("the LM pruner's training", "zerorag.lm_pruner.trainer", 1)
    message = str(refused.value)
    assert message.startswith("the LM pruner's training asks for 1 GPU (zerorag.lm_pruner.trainer.num_gpus) but the "
                              f"node it runs on has none visible to torch (torch {torch.__version__}")
    assert message.endswith("; set zerorag.lm_pruner.trainer.num_gpus: 0 to run on CPU")
    with pytest.raises(ConfigError, match=r"^the retrieve stage asks for 0\.5 GPUs \(retrieval\.embed_gpus\) .*"
                                          r"set retrieval\.embed_gpus: 0 to run on CPU$"):
        require_gpu("the retrieve stage", "retrieval", 0.5, "retrieval.embed_gpus")


def _others_busy(cpus: float):
    """A node reading where processes other than this one keep `cpus` CPUs busy (this process's own time added, as
    /proc/stat counts it)."""
    return lambda: time.monotonic() * cpus + sum(os.times()[:2])


def test_threads_follow_the_cpus_the_node_leaves_free_and_a_setting_fixes_them():
    # a 4-CPU node, an actor of one CPU: nothing else computing gives it all four
    assert FreeCpus(1.0, cpus=4, busy=_others_busy(0.0)).threads() == 4
    # two CPUs kept busy by others (say a training worker): the two left
    assert FreeCpus(1.0, cpus=4, busy=_others_busy(2.0)).threads() == 2
    # a CPU three-quarters busy is not lent (an OpenMP team waits for its slowest thread at every barrier)
    assert FreeCpus(1.0, cpus=2, busy=_others_busy(0.75)).threads() == 1
    # never below the actor's own CPUs, however busy the node
    assert FreeCpus(2.0, cpus=4, busy=_others_busy(8.0)).threads() == 2
    # the setting wins
    assert FreeCpus(1.0, threads=3, cpus=4, busy=_others_busy(0.0)).threads() == 3
    # read on this machine, within the actor's own CPUs and the node's
    assert 1 <= FreeCpus(1.0).threads() <= usable_cpus()


def test_a_second_reading_measures_the_time_since_the_first_without_waiting():
    free = FreeCpus(1.0, cpus=2, busy=_others_busy(0.0))
    free.threads()
    start = time.monotonic()
    assert free.threads() == 2
    assert time.monotonic() - start < FreeCpus.WINDOW_S / 2
