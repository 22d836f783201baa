"""When tpkit's loader should fork a worker during its first batch: the time to the first
batches with the fork ahead at several thresholds, against torch's DataLoader, in one run.

tpkit makes an epoch's first batch in the main process (no worker has started yet). While it
does, it may fork worker 1, so that worker makes batch 1 meanwhile: batch 1 comes sooner, batch 0
later (the fork itself, and the copy-on-write faults the main process then takes on every page
it writes). ``tpkit.data.process_pool.FORK_AHEAD_MIN_S`` decides: fork ahead only when the batch
looks at least that long to make. This script measures the trade on the workloads of
``benchmarks/loader.py`` (same datasets, batch sizes, calibrated work, 2 workers) and on one
whose batches take ~100 ms (``numpy_3ms``):

  torch                      torch.utils.data.DataLoader
  tpkit, fork ahead >= X ms  tpkit.data.Loader (its defaults) with FORK_AHEAD_MIN_S = X / 1000
  tpkit, no fork ahead       the same with the fork ahead off (every worker forks at batch 1)

Each measurement runs in a fresh process (the loader's imports done before the clock starts, as
in loader.py); the variants take turns, in a rotated order each round. Printed: the median time
from constructing the loader to batches 1, 2, 4, 12 and 24, and batch 1's time over torch's.

    python benchmarks/first_batches.py [--rounds 7] [--workloads tiny,numpy_1ms,numpy_3ms,images]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import loader as bench  # noqa: E402

#: loader.py's workloads, and one whose batch (32 x ~3 ms, ~100 ms) is over the 50 ms threshold
WORKLOADS = {**bench.WORKLOADS, "numpy_3ms": ("NumpyWork", {"n": 20_000, "cpu_ms": 3.0}, 32, 240)}
#: batches whose arrival is timed (1-based: batch 1 is the first)
AT = (1, 2, 4, 12, 24)
#: variant -> FORK_AHEAD_MIN_S it runs with (None: torch's DataLoader)
VARIANTS: dict[str, float | None] = {"torch": None, "tpkit, fork ahead >= 10 ms": 0.010,
                                     "tpkit, fork ahead >= 50 ms": 0.050, "tpkit, no fork ahead": float("inf")}


def measure(workload: str, variant: str) -> list[float]:
    """Runs in the child: seconds from constructing the loader to each batch of ``AT``."""
    import torch

    import tpkit.data.process_pool as pool
    import tpkit.datasets as tds

    torch.set_num_threads(1)
    threshold = VARIANTS[variant]
    peer = "torch" if threshold is None else "tpkit"
    if threshold is not None:
        pool.FORK_AHEAD_MIN_S = threshold
    cls, kw, bs, _ = WORKLOADS[workload]
    ds = getattr(tds, cls)(**kw)
    bench.import_peer(peer)
    t0 = time.perf_counter()
    loader, shutdown = bench.make_loader(peer, ds, bs, 2)
    out = []
    for k, b in enumerate(loader, start=1):
        bench._touch(b)
        if k in AT:
            out.append(time.perf_counter() - t0)
        if k >= AT[-1]:
            break
    shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--workloads", default="tiny,numpy_1ms,numpy_3ms,images")
    ap.add_argument("--child", nargs=2, metavar=("WORKLOAD", "VARIANT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(*args.child)))
        return

    from tpkit.datasets import cost

    iters = cost.calibrate(trials=40)
    env = {**os.environ, cost.ENV_VAR: f"{iters:.3f}"}
    names = list(VARIANTS)
    print(f"{common.machine()}; {common.versions()}; load average {common.load_avg()[0]:.2f}")
    print(f"2 workers, {args.rounds} rounds, the variants rotated each round; cpu_ms calibrated once: "
          f"{iters:.1f} iterations per ms")
    for wl in args.workloads.split(","):
        times: dict[str, list[list[float]]] = {v: [] for v in names}
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for v in order:
                rc, out, err = bench.run_child([sys.executable, __file__, "--child", wl, v], env, timeout=300)
                if rc != 0:
                    sys.exit(f"{wl} / {v} failed:\n{err[-2000:]}")
                times[v].append(json.loads(out.strip().splitlines()[-1]))
        print(f"\n== {wl} (batch {WORKLOADS[wl][2]}), ms from constructing the loader to batch k "
              f"(medians of {args.rounds}) ==")
        print(f"{'variant':28s}" + "".join(f"{'k=' + str(k):>8s}" for k in AT) + f"{'k=1 vs torch':>14s}")
        torch_first = statistics.median(t[0] for t in times["torch"])
        for v in names:
            med = [statistics.median(t[i] for t in times[v]) * 1e3 for i in range(len(AT))]
            print(f"{v:28s}" + "".join(f"{m:8.0f}" for m in med) + f"{med[0] / (torch_first * 1e3):13.2f}x")
    print(f"\nload average now {common.load_avg()[0]:.2f}")


if __name__ == "__main__":
    main()
