"""``workers="auto"``: choose the worker count from measured rates on this machine.

What ``workers="auto"`` does (nothing delays the first batch): the loader starts with
``initial_workers()`` and measures the first batches of the epoch as training reads them (how
long a batch takes to make, how long the loop waits in ``next()``, how long its step takes
between two ``next()``); ``suggest_workers`` turns the medians into a count, used from the next
epoch on. Medians of real batches, not timed trials, so the choice is stable from run to run.

``Loader.autotune()`` (explicit) still runs timed trials:
a short trial per candidate count (0, 1, 2, ... up to the cores) reads the first batches of
the dataset exactly as training will and measures batches/s; a count within 5% of a smaller
one is not worth its memory and CPU. The trial reads real data, so it also catches the
overhead-bound case where workers cost more than they bring (tiny samples: 0 wins).
Dataset order and the loader's randomness are untouched: the trial uses a sequential order
and its own seed.
"""

from __future__ import annotations

import itertools
import math
import os
import statistics
from time import perf_counter
from typing import Any

#: batches measured under workers="auto", after the start-up ones (see AutoProbe)
AUTO_BATCHES = 24


def initial_workers(cpus: int | None = None) -> int:
    """Workers ``workers="auto"`` starts with: two, or one on a single core."""
    return max(1, min(2, cpus or os.cpu_count() or 1))


def suggest_workers(make_s: list[float], wait_s: list[float], step_s: list[float],
                    max_workers: int) -> tuple[int, str]:
    """Workers for a loop, from measured batches (medians): ``make_s`` the time a worker took
    to make a batch (fetch + collate), ``wait_s`` the time the loop spent in ``next()`` with
    the current workers, ``step_s`` the loop's own time between two ``next()``.

    0 when the loop waits at least 1.5x as long for a worker's batch as it would take to make
    it itself (hand-over costs more than it saves: tiny samples); else enough workers that
    together they make a batch per step: ceil(1.1 * make / (step + hand-over)), at least 1 and
    at most ``max_workers``. Returns (count, reason)."""
    make, wait, step = (statistics.median(x) for x in (make_s, wait_s, step_s))
    if wait >= 1.5 * make:
        return 0, (f"the loop waited {wait * 1e3:.2f} ms per batch for workers; making one in the "
                   f"training process takes {make * 1e3:.2f} ms")
    hand = min(wait_s)  # the wait when a batch was ready: the hand-over itself
    need = math.ceil(1.1 * make / max(step + hand, 1e-9))
    n = max(1, min(max_workers, need))
    return n, (f"a batch takes {make * 1e3:.2f} ms to make and the loop {(step + hand) * 1e3:.2f} ms "
               f"per step: {need} worker(s) keep up" + (f", capped at {max_workers}" if need > n else ""))


class AutoProbe:
    """Measures the first batches of an epoch for ``workers="auto"`` (see ``suggest_workers``)."""

    def __init__(self, max_workers: int, skip: int = 2) -> None:
        self.max_workers = max_workers
        self.skip = skip  # start-up: the first batches and those made ahead while the loop began
        self.make_s: list[float] = []
        self.wait_s: list[float] = []
        self.step_s: list[float] = []
        self.seen = 0
        self.last_return_s: float | None = None
        self.result: tuple[int, str] | None = None

    def record(self, called_s: float, returned_s: float, make_s: float) -> None:
        """One ``next()``: when it was called and returned (perf_counter), the batch's make time."""
        self.seen += 1
        if self.seen > self.skip and self.last_return_s is not None:
            self.make_s.append(make_s)
            self.wait_s.append(returned_s - called_s)
            self.step_s.append(called_s - self.last_return_s)
        self.last_return_s = returned_s
        if len(self.make_s) >= AUTO_BATCHES and self.result is None:
            self.result = suggest_workers(self.make_s, self.wait_s, self.step_s, self.max_workers)


def _trial_rate(loader: Any, workers: int, trial_batches: int) -> float:
    kw: dict = dict(batch_size=loader.batch_size, collate_fn=loader.collate_fn,
                    drop_last=loader.drop_last, num_workers=workers, mode=loader.mode,
                    prefetch=loader.prefetch, seed=0, worker_init_fn=loader.worker_init_fn)
    if loader.batch_size is None and loader.batch_sampler is not None:
        kw["batch_size"], kw["drop_last"] = 1, False
        kw["batch_sampler"] = loader.batch_sampler
    trial = type(loader)(loader.dataset, **kw)  # a Loader; its class, so no import cycle
    try:
        it = iter(trial)
        next(it)  # start-up is paid once per run; the rate is what matters
        t0 = perf_counter()
        n = sum(1 for _ in itertools.islice(it, trial_batches))
        dt = perf_counter() - t0
    finally:
        trial.close()
    return n / dt if n and dt > 0 else 0.0


def choose_workers(loader: Any, max_workers: int, trial_batches: int = 24) -> int:
    """Fewest workers within 5% of the best worker rate; 0 only when loading in the training
    process is so cheap (>= 1.5x the best worker rate, e.g. tiny samples) that workers would
    mostly add hand-over cost. (In-process loading also stalls the training step, so a
    merely equal in-process rate is not a reason to drop the workers.)"""
    rate_0 = _trial_rate(loader, 0, trial_batches)
    rates = {w: _trial_rate(loader, w, trial_batches) for w in range(1, max_workers + 1)}
    if not rates:
        return 0
    best = max(rates.values())
    if rate_0 >= 1.5 * best:
        return 0
    return min(w for w, r in rates.items() if r >= 0.95 * best)
