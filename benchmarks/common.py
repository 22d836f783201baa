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


def quantiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=10)
    return q[1], statistics.median(xs), q[7]


def write_rows(name: str, rows: list[dict]) -> Path:
    """Write ``rows`` to ``results/<name>.csv``; a ``name`` that is a path (it has a folder or
    ends in ``.csv``: what ``--out`` of loader.py takes) is used as it is."""
    path = Path(name) if "/" in name or name.endswith(".csv") else RESULTS / f"{name}.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
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
