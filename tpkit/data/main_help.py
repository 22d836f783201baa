"""The main process makes batches itself while it would otherwise wait for the workers.

Why: when a batch costs little to make (a few hundred microseconds), handing it from a worker
to the main process costs about as much as making it: the pipe message, the slot, and above
all the processes taking turns on the cores (docs/MEASURED.md: on 2 cores, 2 workers reached
0.46-0.55 of what two plain loops do with the same work). A main process that only waits
spends its core on wake-ups; one that makes the next unassigned batch itself adds a producer
that hands nothing over. It helps only when the batch it needs is not there yet, so a loop
that the workers keep up with never pays for it.

When (``main_helps``):
  "auto" (default): map-style dataset, no ``worker_init_fn``, no ``timeout`` (a batch made
    here cannot be timed out), batches that take at most ``HELP_MAX_S`` to make (so the loop
    is never kept longer than that from a batch that arrived meanwhile), and randomness left
    as torch's DataLoader has it: in order, the epoch's first batch (made in this process as
    worker 0 would make it) must have drawn nothing from torch's, numpy's or Python's global
    generators; the first ``VERIFY_BATCHES`` batches made here are checked again (states
    before and after: ~0.2 ms each), and one that drew puts this process's states back,
    goes to a worker instead and stops the helping for good (``off_reason`` says so).
    A batch made here is timed too: when it took longer than ``HELP_MAX_S`` of this thread's
    CPU time (a large batch is new memory here where a worker reuses its slot), or when the
    median of this process's last ``OWN_BATCHES_JUDGED`` batches took longer than that in all
    (it shares the cores with the workers), it stops helping and tries again ``RETRY_S``
    later. One batch long only in wall time is not enough: a main process descheduled for a
    timeslice in the middle of a tiny batch reads ~10 ms.
  True: always, whatever a batch costs; batches made here draw from their own stream (seeded
    as a worker ``num_workers`` would be), swapped in and out around each (~0.15 ms).
  False: never.

Where the workers and the main process outnumber the cores this process may run on (2 workers
on 2 cores), the last worker gets no new batches while the main process helps (it made a batch
within the last ``PARK_WINDOW`` handed out): it takes that worker's place, instead of three
processes taking turns on two cores (docs/MEASURED.md). A loop the workers keep up with never
waits, so the main process never helps and no worker rests; the worker resumes as soon as the
helping stops.

What it changes: the set and the order of batches stay the same. Which worker makes which
batch does not (worker ``b % W`` makes batch ``b`` unless this process made it), so a dataset
whose samples draw random numbers gets other draws than under torch: "auto" does not help
such a dataset, True does. A dataset with its own generator object (``np.random.default_rng``
in ``__init__``) is not seen by the check: each worker draws from its own copy, and so does
this process. A dataset that opens files in ``__getitem__`` opens them here too (the in-process
first batch already does); ``main_helps=False`` keeps every ``__getitem__`` in the workers.
"""

from __future__ import annotations

import collections
from time import perf_counter, thread_time
from typing import Any

import numpy as np
import torch

from .worker_loop import BatchMaker, Made, RngStates, WorkerSpec, get_rng_states, seed_worker, set_rng_states

#: "auto" helps only when a batch takes at most this long to make (fetch + collate, a moving
#: average of the workers' and this process's batches): at most this long, a batch that
#: arrives while the main process makes one waits for it.
HELP_MAX_S = 2e-3
#: "auto": batches made here whose random states are compared before and after.
VERIFY_BATCHES = 64
#: A worker rests (see above) while the main process made a batch within this many handed out.
PARK_WINDOW = 32
#: Weight of the newest batch in the moving average of make times.
MAKE_EMA = 0.2
#: "auto": this many of the main process's own latest batches are judged (their median) when
#: it decides its batches are too slow to make here.
OWN_BATCHES_JUDGED = 3
#: "auto": after batches made here were judged too slow (``MainHelper._timed``), the main
#: process tries again this many seconds later (the host's load, or the dataset's cost, may
#: have changed).
RETRY_S = 1.0


def _moving_average(average: float | None, seconds: float) -> float:
    """``average`` moved towards the newest ``seconds`` by ``MAKE_EMA`` (the first one: itself)."""
    return seconds if average is None else average + MAKE_EMA * (seconds - average)


def same_rng_states(a: RngStates, b: RngStates) -> bool:
    """Whether two ``get_rng_states()`` results are the same states (nothing drew between)."""
    (ta, na, ra), (tb, nb, rb) = a, b
    if not torch.equal(ta, tb) or ra != rb:
        return False
    return na[0] == nb[0] and np.array_equal(na[1], nb[1]) and tuple(na[2:]) == tuple(nb[2:])


class MainHelper:
    """Makes batches in the main process for a ``ProcessPool`` (see the module's docstring)."""

    def __init__(self, spec: WorkerSpec, mode: bool | str, in_order: bool) -> None:
        self.spec, self.mode, self.in_order = spec, mode, in_order
        self.maker = BatchMaker(spec)
        self.make_s: float | None = None  # moving average of a batch's fetch + collate
        # the times of the last batches made here alone: with the workers running beside it,
        # this process makes a batch slower than they do (images, 2 workers on 2 cores: 5-13 ms
        # here against ~1.9 ms in a worker), and that is how long a batch that arrived waits
        self.own_recent: collections.deque[float] = collections.deque(maxlen=OWN_BATCHES_JUDGED)
        self.slow_since: float | None = None  # when they were judged too slow (_timed)
        self.first_drew: bool | None = None  # whether the in-process first batch drew randomness
        self.verified = 0
        self.off_reason = ""
        self.own_rng: RngStates | None = None  # main_helps=True: the stream helped batches draw from

    def note_make(self, seconds: float) -> None:
        """A batch's fetch + collate time, from a worker's answer or from this process."""
        self.make_s = _moving_average(self.make_s, seconds)

    def wanted(self) -> bool:
        """Whether to make the next batch here now (the caller knows it would wait otherwise)."""
        if self.off_reason:
            return False
        if self.mode is True:
            return True
        if self.make_s is None or self.make_s > HELP_MAX_S:
            return False
        if self.slow_since is not None:
            if perf_counter() - self.slow_since < RETRY_S:
                return False
            self.slow_since = None  # try again, judged afresh
            self.own_recent.clear()
        return not self.in_order or self.first_drew is False

    def make(self, indices: Any) -> Made | None:
        """One batch made here; None when (in "auto") it drew random numbers: this process's
        random states are as before, helping is off, and the caller hands the task to a worker.
        A dataset's exception propagates (the caller reports it as this batch's failure)."""
        if self.mode is True:
            return self._make_own_stream(indices)
        if self.verified >= VERIFY_BATCHES:
            return self._timed(indices)
        before = get_rng_states()
        made = None
        try:
            made = self._timed(indices)
        finally:
            after = get_rng_states()
            drew = not same_rng_states(before, after)
            if drew:
                set_rng_states(before)
        if drew:
            self.off_reason = ("a batch made in the main process drew random numbers (torch, "
                               "numpy or Python's random): from then on the workers make every "
                               "batch, so random transforms draw as under torch's DataLoader")
            return None
        self.verified += 1
        return made

    def _make_own_stream(self, indices: Any) -> Made | None:
        mine = get_rng_states()
        try:
            if self.own_rng is None:
                seed_worker(self.spec.base_seed, self.spec.num_workers, in_main=True)
            else:
                set_rng_states(self.own_rng)
            return self._timed(indices)
        finally:
            self.own_rng = get_rng_states()
            set_rng_states(mine)

    def _timed(self, indices: Any) -> Made:
        cpu0 = thread_time()
        made = self.maker.make(indices)
        assert made is not None  # map-style: never exhausted
        seconds = made.fetch_s + made.collate_s
        self.note_make(seconds)
        recent = self.own_recent
        recent.append(seconds)
        # slow at once when the batch's own work was (this thread's CPU time: a large batch's
        # new memory, its copies), else when the median of the last few was (a stall)
        if seconds > HELP_MAX_S and thread_time() - cpu0 > HELP_MAX_S or (
                len(recent) == OWN_BATCHES_JUDGED and sorted(recent)[OWN_BATCHES_JUDGED // 2] > HELP_MAX_S):
            self.slow_since = perf_counter()  # wanted() then says no for RETRY_S ("auto" only)
        return made
