"""What sending a small-batch worker its tasks several to a message is worth: tpkit's loader with
``REFILL_TASKS`` tasks a message against the same loader with one task a message (as before
session 27), switched block by block inside one loader, on the tiny workload of
``benchmarks/loader.py`` (64 samples of 8 floats and an int a batch, 2 workers).

``tpkit.data.process_pool.REFILL_TASKS`` is read at every dispatch, so one loader runs both
variants: 20 batches to let the queues settle, then ``--block`` timed batches, the variants
taking turns (the order alternating each cycle). Each cycle's ratio is one-task time over
refilled time (> 1: refilling is faster); the host's speed changes over seconds, so only the
two blocks of a cycle, ~50 ms apart, are compared. Printed: the median ratio with its 95%
bootstrap interval, with the main process helping (the default) and waiting.

    python benchmarks/loader_refill.py [--cycles 300] [--block 150]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import load_avg, machine, versions, write_rows  # noqa: E402
from interleave import estimate  # noqa: E402

SETTLE_BATCHES = 20


def measure(main_helps: bool | str, cycles: int, block: int) -> tuple[list[float], list[float]]:
    """Seconds a timed block took with one task a message and with REFILL_TASKS, per cycle."""
    import tpkit.data.process_pool as pool
    from tpkit.data import Loader
    from tpkit.datasets import TinySamples

    refill = pool.REFILL_TASKS
    n_batches = 300 + cycles * 2 * (SETTLE_BATCHES + block)
    loader = Loader(TinySamples(n_batches * 64), batch_size=64, shuffle=True, num_workers=2,
                    main_helps=main_helps)
    it = iter(loader)
    one: list[float] = []
    refilled: list[float] = []
    try:
        for _ in range(300):  # workers started, rings made, queues deep
            next(it)
        for cyc in range(cycles):
            for k in ((1, refill) if cyc % 2 else (refill, 1)):
                pool.REFILL_TASKS = k
                for _ in range(SETTLE_BATCHES):
                    next(it)
                t0 = time.perf_counter()
                for _ in range(block):
                    next(it)
                (one if k == 1 else refilled).append(time.perf_counter() - t0)
    finally:
        pool.REFILL_TASKS = refill
        loader.close()
    return one, refilled


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cycles", type=int, default=300)
    ap.add_argument("--block", type=int, default=150, help="timed batches a block")
    args = ap.parse_args()
    import tpkit.data.process_pool as pool

    print(f"{machine()};", f"load average at start {' / '.join(f'{x:.2f}' for x in load_avg())};", versions())
    print(f"tiny workload, 2 workers, {args.cycles} cycles of {args.block} timed batches a variant; "
          f"REFILL_TASKS = {pool.REFILL_TASKS} against 1")
    rows = []
    for label, helps in (("main process helps (default)", "auto"), ("main process waits", False)):
        one, refilled = measure(helps, args.cycles, args.block)
        est = estimate([a / b for a, b in zip(one, refilled)])
        assert est is not None
        rate = lambda ts: args.block * 64 / sorted(ts)[len(ts) // 2]  # noqa: E731
        print(f"  {label:30s} refilled over one task a message: {est.text()}  "
              f"({rate(one):,.0f} -> {rate(refilled):,.0f} samples/s, block medians)")
        rows += [{"variant": label, "cycle": i, "one_task_s": a, "refilled_s": b}
                 for i, (a, b) in enumerate(zip(one, refilled))]
    path = write_rows("loader_refill", rows)
    print(f"wrote {len(rows)} rows to {path}")


if __name__ == "__main__":
    main()
