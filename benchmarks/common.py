"""Helpers shared by the benchmark scripts: timing, machine facts, long-format rows."""

from __future__ import annotations

import csv
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

RESULTS = Path(__file__).parent / "results"


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores"


def versions() -> str:
    import torch

    import tpkit

    return f"python {sys.version.split()[0]}, torch {torch.__version__}, tpkit {tpkit.__version__}"


def step_times(fn: Callable[[], object], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


#: Iterations of the host canary's loop: ~60 us of CPU on this VM's fast state.
CANARY_ITERATIONS = 2000


def host_canary_us() -> float:
    """CPU time (us) of a fixed pure-Python loop, run between two steps: a reading of how fast
    the host lets this core run right now.

    The 2-core VM's host runs a guest core at one of two speeds by turns (docs/MEASURED.md,
    "Timing ground truth"): the same work takes ~1.9x longer in the slow state, with no figure
    in the guest changing. This loop's bytecode and its few objects stay in the caches, so the
    step before it barely moves its time (63 us after flushing 8 MB, 61 us warm), while the
    host's slow state moves it 1.35-1.45x: two clusters a threshold tells apart. Thread CPU
    time, so a canary that was descheduled is not read as a slow one."""
    t0 = time.thread_time_ns()
    s = 0
    for i in range(CANARY_ITERATIONS):
        s += i
    return (time.thread_time_ns() - t0) / 1e3


#: A canary this much slower than the run's fast level (its 5th percentile) reads as the slow state.
SLOW_HOST_FACTOR = 1.15


def fast_host(canaries: list[float]) -> tuple[float, Callable[[float], bool]]:
    """The threshold (us) and a test "was the host in its fast state" for canary readings of
    one run (pooled over every mode, so each is judged by the same bar)."""
    xs = sorted(canaries)
    bar = SLOW_HOST_FACTOR * xs[len(xs) // 20]
    return bar, lambda c: c <= bar


def quantiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=10)
    return q[1], statistics.median(xs), q[7]


def write_rows(name: str, rows: list[dict]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.csv"
    with path.open("w", newline="") as f:
        fields = list(dict.fromkeys(k for row in rows for k in row))  # every row's keys, first seen first
        w = csv.DictWriter(f, fieldnames=fields, restval="")
        w.writeheader()
        w.writerows(rows)
    return path


def training_step(model: Any, loader: Any, opt: Any, loss_fn: Callable[[Any, Any], Any]) -> Callable[[], None]:
    """One optimizer step per call over ``loader``, restarting it when an epoch ends."""
    it = iter(loader)

    def step() -> None:
        nonlocal it
        try:
            batch = next(it)
        except StopIteration:
            it = iter(loader)
            batch = next(it)
        loss_fn(model, batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def transformer_step() -> Callable[[], None]:
    """A training step of tpkit's built-in slice (the tiny transformer on synthetic tokens)."""
    from tpkit.demo import make_training

    return training_step(*make_training(), lambda m, b: m(b["x"], b["y"]))


def load_avg() -> tuple[float, float, float]:
    """The machine's 1, 5 and 15 minute load averages (printed next to every timing)."""
    try:
        return os.getloadavg()
    except OSError:
        return (float("nan"),) * 3


def peer_versions(*packages: str) -> str:
    """``versions()`` plus the installed version of each peer package that is present."""
    from importlib import metadata

    names = packages or ("transformers", "accelerate", "traceml-ai", "torchdata", "spdl-core")
    found = []
    for name in names:
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            pass
    return ", ".join([versions(), *found])
