"""The cost of making one sample, as knobs: CPU work and IO latency.

Every generator in ``tpkit.datasets`` takes ``cpu_ms`` (busy work that holds one core, like a
decode or an augmentation) and ``sleep_ms`` (idle wait that holds no core, like a disk or
network read), so a tutorial can make a loop data-starved in a controlled way.

``cpu_ms`` is a fixed amount of work, not a span of wall time: ``burn_cpu`` runs a number of
iterations calibrated once, when this module is imported, to take ``cpu_ms`` on an idle core.
Work that stops at a deadline would finish "on time" however many threads share a core, and
a thread-based loader would look as fast as a process-based one while doing less work.
``TPKIT_BURN_ITERS_PER_MS`` sets the calibration instead (a benchmark measures it once and
hands the same figure to every process it starts, so every peer does the same work).
"""

from __future__ import annotations

import os
import time

import numpy as np

#: Elements in the working array of one iteration (float64, 32 KiB: stays in L1/L2).
_WIDTH = 4096
ENV_VAR = "TPKIT_BURN_ITERS_PER_MS"


def _spin(iterations: int) -> None:
    """``iterations`` rounds of single-threaded numpy work (elementwise: no BLAS threads)."""
    a = np.arange(_WIDTH, dtype=np.float64)
    for _ in range(iterations):
        a = np.sqrt(a * a + 1.0)


def calibrate(trials: int = 7, iterations: int = 100) -> float:
    """Iterations of ``_spin`` per millisecond on an idle core.

    The fastest of a few short trials: time taken from this process by other processes
    only ever adds to a trial, so the minimum is the best estimate of an idle core. Takes
    about ``trials`` x 0.5 ms."""
    _spin(10)  # first call pays for page faults and numpy's dispatch caches
    best = float("inf")
    for _ in range(trials):
        t = time.perf_counter()
        _spin(iterations)
        best = min(best, time.perf_counter() - t)
    return iterations / (best * 1e3)


def _iters_per_ms() -> float:
    value = os.environ.get(ENV_VAR, "").strip()
    if value:
        try:
            parsed = float(value)
        except ValueError:
            parsed = 0.0
        if parsed > 0:
            return parsed
    return calibrate()


#: The calibration in force in this process (workers forked from it inherit it).
ITERS_PER_MS = _iters_per_ms()


def burn_cpu(seconds: float) -> None:
    """Do about ``seconds`` of one core's numpy work, as measured on an idle core.

    A fixed number of iterations: on a busy core it takes longer, as real decoding would."""
    n = round(seconds * 1e3 * ITERS_PER_MS)
    if n > 0:
        _spin(n)


def spend(cpu_ms: float = 0.0, sleep_ms: float = 0.0) -> None:
    """Pay one sample's cost: ``cpu_ms`` of busy work, then ``sleep_ms`` of idle wait."""
    if cpu_ms > 0:
        burn_cpu(cpu_ms / 1e3)
    if sleep_ms > 0:
        time.sleep(sleep_ms / 1e3)


def check_cost(cpu_ms: float, sleep_ms: float) -> None:
    """Refuse a negative cost, saying which knob is wrong."""
    if cpu_ms < 0 or sleep_ms < 0:
        raise ValueError(f"cpu_ms and sleep_ms are costs per sample and must be >= 0, got {cpu_ms}, {sleep_ms}")
