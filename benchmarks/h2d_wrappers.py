"""What do the phase probe's ``Tensor.to`` wrappers cost per call, and what does leaving them out
on a machine without an accelerator save? Per-call time of ``x.to(torch.float32)`` and
``x.to("cpu")`` with no profiler (the peer), under ``tp.profile`` as it installs itself here,
and under ``tp.profile`` with the wrappers forced on (as on a machine with a GPU), in
interleaved rounds.

    python benchmarks/h2d_wrappers.py [--rounds 7] [--calls 100000]
"""

from __future__ import annotations

import argparse
import statistics
import timeit
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterator

import torch
from common import machine, versions, write_rows

import tpkit as tp
from tpkit.capture.probes import phases

CALLS: dict[str, Callable[[torch.Tensor], Any]] = {
    "x.to(torch.float32)": lambda x: x.to(torch.float32),
    "x.to('cpu')": lambda x: x.to("cpu"),
}


@contextmanager
def _profile(force_wrappers: bool) -> Iterator[None]:
    """A phase-only slice; with ``force_wrappers`` installed as on a machine with a GPU."""
    real = phases.has_accelerator
    if force_wrappers:
        phases.has_accelerator = lambda: True
    try:
        prof = tp.profile(steps=10**9, warmup=0, progress=False, memory=False, clock_hz=0).__enter__()
    finally:
        phases.has_accelerator = real
    try:
        yield
    finally:
        prof.__exit__(None, None, None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=100_000)
    args = ap.parse_args()
    x = torch.ones(4)
    modes = ("no profiler", "tp.profile here", "tp.profile, wrappers forced on")
    us: dict[tuple[str, str], list[float]] = {(m, c): [] for m in modes for c in CALLS}
    for r in range(args.rounds):
        for mode in modes[r % 3:] + modes[:r % 3]:
            ctx = nullcontext() if mode == "no profiler" else _profile(force_wrappers=mode != "tp.profile here")
            with ctx:
                for name, fn in CALLS.items():
                    us[(mode, name)].append(timeit.timeit(lambda fn=fn: fn(x), number=args.calls) / args.calls * 1e6)
    print(f"{machine()}; accelerator seen by torch: {phases.has_accelerator()}; {args.rounds} rounds x {args.calls:,} calls")
    rows = []
    for name in CALLS:
        base = statistics.median(us[("no profiler", name)])
        for mode in modes:
            med = statistics.median(us[(mode, name)])
            print(f"  {name:22s} {mode:32s} {med:6.3f} us/call  {med / base:5.2f}x no profiler")
            rows.append({"call": name, "mode": mode, "us_per_call": med, "ratio_vs_no_profiler": med / base,
                         "machine": machine(), "versions": versions()})
    print(f"rows written to {write_rows('h2d_wrappers', rows)}")


if __name__ == "__main__":
    main()
