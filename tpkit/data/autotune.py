"""``workers="auto"``: choose the worker count from measured rates on this machine.

A short trial per candidate count (0, 1, 2, ... up to the cores) reads the first batches of
the dataset exactly as training will and measures batches/s; a count within 5% of a smaller
one is not worth its memory and CPU. The trial reads real data, so it also catches the
overhead-bound case where workers cost more than they bring (tiny samples: 0 wins).
Dataset order and the loader's randomness are untouched: the trial uses a sequential order
and its own seed.
"""

from __future__ import annotations

import itertools
from time import perf_counter
from typing import Any


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
