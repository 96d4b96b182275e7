"""What calibration's measurements share: the hardware a record is matched by, and batches timed cold then warm."""

from __future__ import annotations

import time
from typing import Any


def hardware(device: str, dtype: str, threads: int) -> dict[str, Any]:
    """The hardware a rate was measured on: what must match for a plan to use it."""
    from wbrag_ray.models.hardware import _cpuinfo, cpu_matmul_flags

    return {"device": device, "cpu": _cpuinfo()[0] or "unknown", "cpu_flags": cpu_matmul_flags(), "dtype": dtype,
            "threads": threads}


def timed_batches(run_batch, batches: list, budget: float) -> tuple[int, float, float]:
    """Run `batches` until half of `budget` passes (the cold pass, paying each shape's first use), then the same
    again (warm, a run's steady rate): (batches, cold seconds, warm seconds)."""
    t0, n = time.perf_counter(), 0
    while n == 0 or (time.perf_counter() - t0 < budget / 2 and n < len(batches)):
        run_batch(batches[n])
        n += 1
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    for b in batches[:n]:
        run_batch(b)
    return n, cold, time.perf_counter() - t0
