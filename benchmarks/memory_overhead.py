"""What does memory tracking cost? Step time of the built-in tiny transformer under tpkit with
the memory probe on vs off, in one run (goal: at most 10% of step time; off costs nothing
because no probe is installed).

With ``--peers`` it also times the two other ways of seeing CPU allocations that tpkit could
have used, under the same tpkit slice with its own memory probe off:
- ``torch.profiler(profile_memory=True)``: the op profiler with memory events (what
  ``export_memory_timeline`` needs);
- a dispatch-mode tracker: a ``TorchDispatchMode`` that counts every op's output storages and
  watches them die with ``weakref.finalize`` (the smallest such tracker: a lower bound).

Rounds rotate the order of the modes so drift and a noisy neighbour hit all alike; the
figure is the median over every step of every round, plus the median of per-round ratios.

    python benchmarks/memory_overhead.py [--rounds 6] [--steps 30] [--peers] [--threads 1] [--cpu-time]

Measured on the 2-core dev VM (tiny transformer, 1 torch thread): tpkit +4.5% wall, +0.5% to
+4.6% main-thread CPU time; torch.profiler with memory +3% to +8%; the dispatch tracker +20% to
+26%. With torch's 2 default threads on a shared 2-core VM the wall times are dominated by the
thread pool waking late (shared/MEASURED.md): p20 37 ms against p80 440 ms, no usable ratio.

``--cpu-time`` (with ``--threads 1``) times each step by the main thread's CPU time instead of
the wall clock: on a shared machine whose neighbours come and go, that is the figure that
stays put (with one torch thread, all of the step's work runs on that thread).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
import weakref

import torch
from common import machine, quantiles, step_times, transformer_step, versions, write_rows
from torch.utils._python_dispatch import TorchDispatchMode

import tpkit as tp

OFF, ON = "memory off", "memory on (tpkit)"
PROFILER, DISPATCH = "torch.profiler profile_memory", "dispatch-mode tracker"


def make_step():
    return transformer_step()


class DispatchTracker(TorchDispatchMode):
    """Live bytes of op outputs, by storage; frees seen through ``weakref.finalize``."""

    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._seen: set[int] = set()

    def _gone(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live_bytes -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                s = t.untyped_storage()
                key = s.data_ptr()
                if key not in self._seen:
                    self._seen.add(key)
                    self.live_bytes += s.nbytes()
                    self.peak_bytes = max(self.peak_bytes, self.live_bytes)
                    weakref.finalize(t, self._gone, key, s.nbytes())
        return out


def cpu_step_times(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.thread_time()
        fn()
        out.append(time.thread_time() - t)
    return out


def run_mode(mode: str, step, steps: int, cpu_time: bool = False) -> list[float]:
    peer: contextlib.AbstractContextManager = contextlib.nullcontext()
    if mode == PROFILER:
        peer = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
    elif mode == DISPATCH:
        peer = DispatchTracker()
    with tp.profile(steps=steps, warmup=0, stop=False, progress=False, clocks=False, memory=mode == ON):
        with peer:
            return (cpu_step_times if cpu_time else step_times)(step, steps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--peers", action="store_true", help="also time torch.profiler and a dispatch-mode tracker")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    ap.add_argument("--cpu-time", action="store_true", help="time steps by the main thread's CPU time")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    modes = [OFF, ON] + ([PROFILER, DISPATCH] if args.peers else [])
    step = make_step()
    step_times(step, 10)  # warm caches and the allocator
    times: dict[str, list[float]] = {m: [] for m in modes}
    per_round: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(args.rounds):
        order = modes[r % len(modes):] + modes[:r % len(modes)]
        if r % 2:
            order = order[::-1]
        medians = {}
        for mode in order:
            ts = run_mode(mode, step, args.steps, args.cpu_time)
            times[mode] += ts
            medians[mode] = statistics.median(ts)
        for mode in modes:
            per_round[mode].append(medians[mode] / medians[OFF])
    base = statistics.median(times[OFF])
    clock = "main-thread CPU time" if args.cpu_time else "wall time"
    print(f"tiny transformer, {args.rounds} rounds x {args.steps} steps, torch threads {torch.get_num_threads()}, "
          f"{clock}, {machine()}")
    rows = []
    for mode, ts in times.items():
        p20, p50, p80 = quantiles(ts)
        ratio = p50 / base
        print(f"  {mode:30s} step p50 {p50 * 1e3:7.2f} ms (p20 {p20 * 1e3:.2f}, p80 {p80 * 1e3:.2f})  "
              f"ratio vs off {ratio:.3f}x, median of per-round ratios {statistics.median(per_round[mode]):.3f}x")
        rows.append({"op": "train_step", "workload": "tiny transformer", "peer": mode, "clock": clock,
                     "threads": torch.get_num_threads(), "p20_ms": p20 * 1e3,
                     "p50_ms": p50 * 1e3, "p80_ms": p80 * 1e3, "ratio_vs_off": ratio,
                     "ratio_round_median": statistics.median(per_round[mode]),
                     "machine": machine(), "versions": versions()})
    on = statistics.median(per_round[ON])
    print(f"memory tracking costs {(on - 1) * 100:+.1f}% of step time (goal: at most +10%)")
    print(f"rows written to {write_rows('memory_overhead', rows)}")


if __name__ == "__main__":
    main()
