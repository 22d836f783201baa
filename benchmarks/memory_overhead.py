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
        [--loop tiny|gpt2-2|gpt2-12] [--before REV]

``--loop gpt2-2`` / ``gpt2-12``: a GPT-2 built from ``transformers.GPT2Config`` (2 or 12 layers,
n_embd 64, vocab 1024, batch 8 x 64 tokens, AdamW, a DataLoader) in a plain loop: the layer count
is the knob that showed the probe's per-boundary cost growing with the model (issue 14). Every
mode also reports tpkit's own time per step (the Run's ``tpkit_s``) and the collections the
Python gc ran inside the measured steps. ``--before REV`` adds the memory probe as it was at git
revision REV (``git show REV:tpkit/capture/probes/memory.py``), for a before/after in one run.

Measured 2026-12-01 on the shared 2-core dev VM (load average 5-7), ``--cpu-time --threads 1
--rounds 6 --steps 16 --before 26f2255`` (26f2255: the probe that walked the known sets at every
boundary), ratio of main-thread CPU time per step vs memory off (median of per-round ratios),
tpkit_s per step, gc collections inside the 96 measured steps (memory off: 4 / 8):

    GPT-2 2 layers     now 0.98x, tpkit_s 0.26 ms, gc 5      before 1.09x, 2.38 ms, gc 172
    GPT-2 12 layers    now 1.02x, tpkit_s 0.47 ms, gc 16     before 1.08x, 15.3 ms, gc 922

(the ratios move by +-5% from run to run on that machine; tpkit_s is the steadier figure).
Earlier, on the tiny transformer (1 torch thread): tpkit +4.5% wall, +0.5% to
+4.6% main-thread CPU time; torch.profiler with memory +3% to +8%; the dispatch tracker +20% to
+26%. With torch's 2 default threads on a shared 2-core VM the wall times are dominated by the
thread pool waking late (docs/MEASURED.md): p20 37 ms against p80 440 ms, no usable ratio.

``--cpu-time`` (with ``--threads 1``) times each step by the main thread's CPU time instead of
the wall clock: on a shared machine whose neighbours come and go, that is the figure that
stays put (with one torch thread, all of the step's work runs on that thread).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any

import torch
from common import machine, quantiles, step_times, transformer_step, versions, write_rows
from torch.utils._python_dispatch import TorchDispatchMode

import tpkit as tp

OFF, ON = "memory off", "memory on (tpkit)"
PROFILER, DISPATCH = "torch.profiler profile_memory", "dispatch-mode tracker"
BEFORE = "memory on (before)"
#: GPT-2 shapes for the --loop gpt2-N loops (the same as benchmarks/overhead.py's Trainer loops).
GPT2 = {"n_embd": 64, "n_head": 4, "n_positions": 64, "vocab_size": 1024}
SEQ_LEN, GPT2_BATCH = 64, 8


def gpt2_step(n_layer: int):
    """A training step of a GPT-2 of ``n_layer`` layers on synthetic tokens (a DataLoader of
    dict batches, AdamW), as a Trainer runs it minus the Trainer."""
    import transformers
    from common import training_step
    from transformers import GPT2Config, GPT2LMHeadModel

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=n_layer, **GPT2))
    tokens = torch.randint(0, GPT2["vocab_size"], (4096, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": t, "labels": t} for t in tokens]
    loader = torch.utils.data.DataLoader(data, batch_size=GPT2_BATCH)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return training_step(model, loader, opt, lambda m, b: m(**b).loss)


def make_step(loop: str = "tiny"):
    if loop == "tiny":
        return transformer_step()
    return gpt2_step(int(loop.split("-")[1]))


def probe_at(rev: str) -> Any:
    """The ``MemoryProbe`` class of ``tpkit/capture/probes/memory.py`` at git revision ``rev``,
    loaded as a module of the installed package (its relative imports resolve as they did)."""
    root = Path(__file__).resolve().parents[1]
    src = subprocess.run(["git", "show", f"{rev}:tpkit/capture/probes/memory.py"], cwd=root,
                         capture_output=True, text=True, check=True).stdout
    path = Path(tempfile.mkdtemp(prefix="tpkit-probe-")) / "memory_before.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("tpkit.capture.probes.memory_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module.MemoryProbe


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


class GcCount:
    """Collections the Python gc ran while installed."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.n += 1


def run_mode(mode: str, step, steps: int, cpu_time: bool = False, before: Any = None) -> tuple[list[float], dict]:
    """Step times of one run in ``mode``, and ``{"tpkit_s": [...], "gc": n}`` of that run."""
    import tpkit.capture.probes.memory as probe_module

    peer: contextlib.AbstractContextManager = contextlib.nullcontext()
    if mode == PROFILER:
        peer = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
    elif mode == DISPATCH:
        peer = DispatchTracker()
    current = probe_module.MemoryProbe
    if mode == BEFORE:
        probe_module.MemoryProbe = before
    watch = GcCount()
    try:
        prof = tp.profile(steps=steps, warmup=0, stop=False, progress=False, clocks=False,
                          memory=mode in (ON, BEFORE))
        with prof:
            with peer:
                gc.callbacks.append(watch)
                try:
                    ts = (cpu_step_times if cpu_time else step_times)(step, steps)
                finally:
                    gc.callbacks.remove(watch)
    finally:
        probe_module.MemoryProbe = current
    run = prof.run
    st = run.steps if run is not None else None
    own = [float(v) for v in st["tpkit_s"]] if st is not None and not st.empty else []
    share = [float(a / b) for a, b in zip(st["tpkit_s"], st["duration_s"]) if b > 0] if own else []
    return ts, {"tpkit_s": own, "share": share, "gc": watch.n}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--peers", action="store_true", help="also time torch.profiler and a dispatch-mode tracker")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    ap.add_argument("--cpu-time", action="store_true", help="time steps by the main thread's CPU time")
    ap.add_argument("--loop", default="tiny", choices=["tiny", "gpt2-2", "gpt2-12"])
    ap.add_argument("--before", default=None, help="git revision whose memory probe is timed too")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    before = probe_at(args.before) if args.before else None
    modes = [OFF, ON] + ([BEFORE] if before is not None else []) + ([PROFILER, DISPATCH] if args.peers else [])
    step = make_step(args.loop)
    step_times(step, 10)  # warm caches and the allocator
    times: dict[str, list[float]] = {m: [] for m in modes}
    per_round: dict[str, list[float]] = {m: [] for m in modes}
    own: dict[str, list[float]] = {m: [] for m in modes}
    share: dict[str, list[float]] = {m: [] for m in modes}
    gcs: dict[str, int] = dict.fromkeys(modes, 0)
    for r in range(args.rounds):
        order = modes[r % len(modes):] + modes[:r % len(modes)]
        if r % 2:
            order = order[::-1]
        medians = {}
        for mode in order:
            ts, extra = run_mode(mode, step, args.steps, args.cpu_time, before)
            times[mode] += ts
            own[mode] += extra["tpkit_s"]
            share[mode] += extra["share"]
            gcs[mode] += extra["gc"]
            medians[mode] = statistics.median(ts)
        for mode in modes:
            per_round[mode].append(medians[mode] / medians[OFF])
    base = statistics.median(times[OFF])
    clock = "main-thread CPU time" if args.cpu_time else "wall time"
    workload = {"tiny": "tiny transformer", "gpt2-2": "GPT-2 2 layers", "gpt2-12": "GPT-2 12 layers"}[args.loop]
    print(f"{workload}, {args.rounds} rounds x {args.steps} steps, torch threads {torch.get_num_threads()}, "
          f"{clock}, {machine()}")
    rows = []
    for mode, ts in times.items():
        p20, p50, p80 = quantiles(ts)
        ratio = p50 / base
        tk = statistics.median(own[mode]) if own[mode] else float("nan")
        tk_share = statistics.median(share[mode]) if share[mode] else float("nan")
        print(f"  {mode:30s} step p50 {p50 * 1e3:7.2f} ms (p20 {p20 * 1e3:.2f}, p80 {p80 * 1e3:.2f})  "
              f"ratio vs off {ratio:.3f}x, median of per-round ratios {statistics.median(per_round[mode]):.3f}x  "
              f"tpkit_s p50 {tk * 1e3:.3f} ms ({100 * tk_share:.2f}% of the Run's step), gc runs {gcs[mode]}")
        rows.append({"op": "train_step", "workload": workload, "peer": mode, "clock": clock,
                     "tpkit_s_p50_ms": tk * 1e3, "tpkit_share_p50": tk_share, "gc_runs": gcs[mode],
                     "threads": torch.get_num_threads(), "p20_ms": p20 * 1e3,
                     "p50_ms": p50 * 1e3, "p80_ms": p80 * 1e3, "ratio_vs_off": ratio,
                     "ratio_round_median": statistics.median(per_round[mode]),
                     "machine": machine(), "versions": versions()})
    on = statistics.median(per_round[ON])
    print(f"memory tracking costs {(on - 1) * 100:+.1f}% of step time (goal: at most +10%)")
    name = "memory_overhead" if args.loop == "tiny" else f"memory_overhead_{args.loop}"
    print(f"rows written to {write_rows(name, rows)}")


if __name__ == "__main__":
    main()
