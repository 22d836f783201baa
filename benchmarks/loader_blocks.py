"""Two versions of tpkit's loader switched block by block inside one running loader: the tiny
workload of ``benchmarks/loader.py`` (64 samples of 8 floats and an int a batch, 2 workers),
20 batches to let the queues settle after each switch, then a timed block, the two versions
taking turns (the order alternating each cycle). The host's speed changes over seconds, so only
the two blocks of a cycle, ~50 ms apart, are compared: each cycle's ratio is the peer's time
over the current version's (> 1: the current one is faster). Used by ``loader_refill.py`` and
``loader_dispatch.py``."""

from __future__ import annotations

import argparse
import multiprocessing
import time
from typing import Any, Callable

from common import load_avg, machine, versions, write_rows
from interleave import estimate

SETTLE_BATCHES = 20
#: a version is switched on by calling its function (module globals or class attributes are
#: read at every call, so one loader runs both)
Switch = Callable[[], None]


def block_args(doc: str | None) -> argparse.Namespace:
    """The command line every block-by-block script takes: ``--cycles`` and ``--block``."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cycles", type=int, default=300)
    ap.add_argument("--block", type=int, default=150, help="timed batches a block")
    return ap.parse_args()


def best_us(fn: Callable[[], object], n: int) -> float:
    """``fn``'s time a call in microseconds in a warm loop of ``n`` calls, the best of 7."""
    runs = []
    for _ in range(7):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter_ns() - t0) / n / 1e3)
    return min(runs)


def worker_switch() -> tuple[Any, Switch, Switch]:
    """A flag in shared memory for a version that runs in the workers: made before the loader
    forks them, read by them at every batch (so one loader runs both, in turns), and the
    (peer, current) switches that set it from the main process."""
    flag = multiprocessing.RawValue("b", 0)

    def peer() -> None:
        flag.value = 1

    def current() -> None:
        flag.value = 0

    return flag, peer, current


def time_blocks(main_helps: bool | str, cycles: int, block: int, peer: Switch, current: Switch) -> tuple[list[float], list[float]]:
    """Seconds each timed block took with the peer and with the current version, per cycle.
    The current version is switched on again at the end, whatever happens."""
    from tpkit.data import Loader
    from tpkit.datasets import TinySamples

    n_batches = 300 + cycles * 2 * (SETTLE_BATCHES + block)
    loader = Loader(TinySamples(n_batches * 64), batch_size=64, shuffle=True, num_workers=2,
                    main_helps=main_helps)
    it = iter(loader)
    times: dict[bool, list[float]] = {True: [], False: []}
    try:
        for _ in range(300):  # workers started, rings made, queues deep
            next(it)
        for cyc in range(cycles):
            for is_peer in ((True, False) if cyc % 2 else (False, True)):
                (peer if is_peer else current)()
                for _ in range(SETTLE_BATCHES):
                    next(it)
                t0 = time.perf_counter()
                for _ in range(block):
                    next(it)
                times[is_peer].append(time.perf_counter() - t0)
    finally:
        current()
        loader.close()
    return times[True], times[False]


def compare(name: str, what: str, cycles: int, block: int, peer: Switch, current: Switch) -> None:
    """Print the paired ratio with the main process helping (the default) and waiting, and
    write the blocks' times to benchmarks/results/<name>.csv."""
    print(f"{machine()};", f"load average at start {' / '.join(f'{x:.2f}' for x in load_avg())};", versions())
    print(f"tiny workload, 2 workers, {cycles} cycles of {block} timed batches a version; {what}")
    rows = []
    for label, helps in (("main process helps (default)", "auto"), ("main process waits", False)):
        before, now = time_blocks(helps, cycles, block, peer, current)
        est = estimate([a / b for a, b in zip(before, now)])
        assert est is not None
        rate = lambda ts: block * 64 / sorted(ts)[len(ts) // 2]  # noqa: E731
        print(f"  {label:30s} current over peer: {est.text()}  "
              f"({rate(before):,.0f} -> {rate(now):,.0f} samples/s, block medians)")
        rows += [{"variant": label, "cycle": i, "peer_s": a, "current_s": b}
                 for i, (a, b) in enumerate(zip(before, now))]
    path = write_rows(name, rows)
    print(f"wrote {len(rows)} rows to {path}")
