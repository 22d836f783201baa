"""The cost of making one sample, as knobs: CPU work and IO latency.

Every generator in ``tpkit.datasets`` takes ``cpu_ms`` (busy work that holds one core, like a
decode or an augmentation) and ``sleep_ms`` (idle wait that holds no core, like a disk or
network read), so a tutorial can make a loop data-starved in a controlled way.
"""

from __future__ import annotations

import time

import numpy as np


def burn_cpu(seconds: float) -> None:
    """Hold one core for about ``seconds`` with numpy work (no BLAS, so it stays one thread)."""
    end = time.perf_counter() + seconds
    a = np.arange(4096, dtype=np.float64)
    while time.perf_counter() < end:
        a = np.sqrt(a * a + 1.0)


def spend(cpu_ms: float = 0.0, sleep_ms: float = 0.0) -> None:
    """Pay one sample's cost: ``cpu_ms`` of busy work, then ``sleep_ms`` of idle wait."""
    if cpu_ms > 0:
        burn_cpu(cpu_ms / 1e3)
    if sleep_ms > 0:
        time.sleep(sleep_ms / 1e3)


def check_cost(cpu_ms: float, sleep_ms: float) -> None:
    if cpu_ms < 0 or sleep_ms < 0:
        raise ValueError(f"cpu_ms and sleep_ms are costs per sample and must be >= 0, got {cpu_ms}, {sleep_ms}")
