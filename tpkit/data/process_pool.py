"""Worker processes seen from the main process: dispatch, receive, reorder, recover.

One duplex pipe per worker carries tasks one way and small result tuples the other way
(see ``worker_loop``); the main process waits on all pipes *and* all process sentinels at
once, so a worker that dies is noticed at the moment it dies, not after a timeout.

Flow control, per worker: at most ``prefetch`` batches dispatched and not yet answered,
within ``prefetch + hold`` slots. With the default prefetch (``deep_small=True``), a worker
whose batches are small (a slot of at most ``SMALL_SLOT_BYTES``) gets ``DEEP_PREFETCH``
batches in flight: for batches that cost little to make, the hand-over round trip (a wake-up
of each side) is what limits the rate, and a deeper queue hides it; a slot that is never
needed is never written, so it costs no memory (tmpfs pages come on first write). Such a
worker's queue is refilled ``REFILL_TASKS`` at a time, its tasks in one message
(``ProcessPool._may_refill``). A handed-out batch keeps its slot until the training loop
drops every view of it; when the loop already holds ``hold`` of a worker's slots, the next
batch from that worker is handed out as a private copy instead. So a dispatch never waits on
the user, and no slot is overwritten while a view of it is alive.

``hold`` is 1 with two or more workers: a plain ``for batch in loader`` keeps the previous
batch alive while asking for the next, and with round-robin order those come from different
workers. With one worker both come from the same ring, so ``hold`` is 2. A loop that keeps
more batches alive still works; it gets copies for the extra ones.

First batch in-process: when the workers are about to be started (first epoch, or every epoch
without persistent workers) of a map-style dataset without ``worker_init_fn``, in order and
without ``timeout`` (a hang here could not be timed out), the main
process makes the epoch's first batch itself, before forking: it costs one batch of work,
where forking the workers and their first hand-over cost tens of milliseconds (the sampler's
order is drawn either way). It is made as worker 0 would make it: with worker 0's seeds, and
worker 0 starts from the random state that batch left behind (handed over at the fork), so
the batches and their random transforms are the same as torch's. Worker 1 is forked just before
it and makes batch 1 meanwhile; worker 0 and any others are forked by the second ``next()``, so
the first batch costs one batch of work and one fork (``next(iter(loader))`` forks one worker).

The main process helps: while the batch it must hand out next is not there, it makes the next
unassigned one itself (tpkit/data/main_help.py says when and what that changes). Such a batch
is reported as made by worker -1.
"""

from __future__ import annotations

import collections
import gc
import itertools
import multiprocessing as mp
import os
import pickle
import select
import signal
import warnings
import weakref
from dataclasses import dataclass, field
from time import perf_counter, perf_counter_ns
from typing import Any, Iterator, NamedTuple

from ..capture.host import usable_cores
from ..capture.interrupts import held_sigint
from .collate import merge_parts
from .errors import LoaderTimeoutError, WorkerDiedError, worker_error
from .main_help import PARK_WINDOW, MainHelper, same_rng_states
from .slots import flatten, map_segment, read_slot, remove_segments, segment_path, segment_prefix
from .worker_loop import (
    BatchDone,
    BatchFailed,
    BatchMaker,
    LoadedBatch,
    Reset,
    RngStates,
    StreamEnded,
    Task,
    WorkerSpec,
    done_from_wire,
    failed,
    get_rng_states,
    seed_worker,
    set_rng_states,
    worker_main,
)

SMALL_SLOT_BYTES = 256 * 1024
#: The in-process first batch forks worker 1 while it is made (so that worker makes batch 1
#: meanwhile) only when the batch looks at least this long to make (its second sample's time
#: times the batch size). Forking then costs the first batch more than the fork (5-12 ms here):
#: the main process also takes a copy-on-write fault on every page it writes afterwards (~800
#: more faults, ~10 ms more CPU while a 32 ms batch was made). 32 samples of ~1 ms came 61 ms
#: after the loader was made with the fork and 42 ms without, and batch 12 came no later without
#: it (benchmarks/first_batches.py). A cheaper batch is handed out at once and every worker
#: forks at the next ``next()`` (docs/DESIGN_CHANGES.md, "The first batch").
FORK_AHEAD_MIN_S = 0.050
DEEP_PREFETCH = 8
#: Tasks a small-batch worker is sent at once, in one message (``ProcessPool._may_refill``).
REFILL_TASKS = 4
#: Waiting for a batch, the main process polls the workers' pipes for up to SPIN_S (yielding
#: its core between polls) before it sleeps: a worker that writes to a sleeping process pays
#: for waking it on the other core, ~70 us of the worker's CPU per batch in this VM, and the
#: main process sleeps on most batches of a fast loader (docs/MEASURED.md). It spins only
#: when the last wait was short (under SPIN_AFTER_WAIT_S): on slow batches a sleep's wake-up
#: is a negligible share of the batch, and the poll loop would only burn CPU.
SPIN_S = 100e-6
SPIN_AFTER_WAIT_S = 1e-3


def poll_spinning(poller: Any, timeout_s: float | None, spin_s: float) -> list:
    """``poller.poll`` that looks without sleeping for up to ``spin_s`` (yielding the core
    between looks) before it sleeps for up to ``timeout_s`` (None: no limit); the spin's
    ~100 us over a caller's timeout of seconds is left uncounted."""
    ready = poller.poll(0)
    if not ready and spin_s > 0:
        end = perf_counter() + spin_s
        while not ready and perf_counter() < end:
            os.sched_yield()  # a worker on this core runs now, if one is ready to
            ready = poller.poll(0)
    if not ready:
        ready = poller.poll(None if timeout_s is None else 1000 * timeout_s)
    return ready


def hold_slots(num_workers: int) -> int:
    """Batches of one worker the training loop may keep alive before we copy (see above)."""
    return 1 if num_workers >= 2 else 2


_loader_ids = itertools.count()


@dataclass
class _Worker:
    id: int
    life: int = 0  # bumped on every restart; slot releases from an older life are ignored
    proc: Any = None
    conn: Any = None
    free: list = field(default_factory=list)  # free slot numbers
    held: int = 0  # slots whose views the training loop still holds
    inflight: dict[int, Task] = field(default_factory=dict)  # batch_id -> task (not yet answered)
    buffered: int = 0  # answered, waiting in the reorder buffer
    delivered: int = 0  # batches answered this epoch (iterables: where a restart resumes)
    exhausted: bool = False
    maps: dict = field(default_factory=dict)  # (life, gen) -> mmap
    slot_bytes: int = -1  # of its ring, once a batch told (-1: not known yet)


class _Answer(NamedTuple):
    """A worker's answer waiting in the reorder buffer (or one part of a split batch)."""

    worker: _Worker | None  # None: a joined split batch (``msg`` is the _Split), or a batch made
    # in the main process (``msg`` is its LoadedBatch, or its BatchFailed)
    life: int  # the worker's life when it answered: a slot of an older life is not reused
    mm: Any  # the ring's mapping (None when the batch holds no tensor, or for errors)
    msg: Any  # BatchDone, BatchFailed, StreamEnded, or a _Split
    recv_ns: int = 0


@dataclass
class _Split:
    """The first batch of an epoch, made in parts by all workers (``fast_start``)."""

    parts: list  # index list per worker
    sent: set = field(default_factory=set)
    got: dict[int, _Answer | None] = field(default_factory=dict)  # per worker; None if it failed
    err: tuple[int, BatchFailed] | None = None  # (worker, answer) of the first failed part


def _signal_name(code: int | None) -> str:
    if code is None:
        return "stopped responding"
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _shutdown(workers: list[_Worker], prefix: str) -> None:
    """Stop every worker and remove every segment file; safe to call twice. Ctrl-C waits until
    it is done (``held_sigint``): a shutdown cut short would never run again."""
    with held_sigint():
        _stop_workers(workers, prefix)


def _stop_workers(workers: list[_Worker], prefix: str) -> None:
    for w in workers:
        if w.conn is not None:
            try:
                w.conn.send(None)
            except Exception:
                pass
    deadline = perf_counter() + 0.5
    for w in workers:
        p = w.proc
        if p is None:
            continue
        p.join(max(0.0, deadline - perf_counter()))
        if p.is_alive():
            p.terminate()
            p.join(0.5)
        if p.is_alive():
            p.kill()
            p.join(0.5)
        w.proc = None
    for w in workers:
        if w.conn is not None:
            try:
                w.conn.close()
            except Exception:
                pass
            w.conn = None
    remove_segments(prefix)


class ProcessPool:
    """Worker processes, their rings, and the reorder buffer of one loader."""

    def __init__(self, spec_args: dict, num_workers: int, prefetch: int, in_order: bool,
                 restart_workers: bool, timeout_s: float, context: Any = None,
                 deep_small: bool = False, main_helps: bool | str = "auto") -> None:
        self.loader_id = next(_loader_ids)
        self.prefix = segment_prefix(os.getpid(), self.loader_id)
        self.hold = hold_slots(num_workers)
        self.deep_small = deep_small and prefetch < DEEP_PREFETCH
        self.n_slots = (DEEP_PREFETCH if self.deep_small else prefetch) + self.hold
        self.spec = WorkerSpec(**spec_args, num_workers=num_workers, seg_prefix=self.prefix,
                               n_slots=self.n_slots, parent_pid=os.getpid())
        self.num_workers, self.prefetch, self.in_order = num_workers, prefetch, in_order
        self.restart_workers, self.timeout_s = restart_workers, timeout_s
        self.ctx = context if context is not None else mp.get_context()
        self.workers = [_Worker(i) for i in range(num_workers)]
        self.restarts = 0
        # Slot leases: a weak reference per handed-out batch, whose callback is the deque's own
        # (C) append, so no Python code runs when the last view dies (a Ctrl-C landing in a
        # Python callback there would be lost, and the slot with it); drained at dispatch.
        self._released: collections.deque = collections.deque()
        self._leases: dict[int, tuple[weakref.ref, tuple[int, int, int]]] = {}
        self._next_id = 0  # batch ids never repeat across epochs: stale answers are recognisable
        self._started = False
        self._local: tuple[int, Any] | None = None  # (batch id, indices): made in this process
        self._unstarted: list[int] | None = None  # skip counts of workers to fork after that batch
        self._rng0: RngStates | None = None  # worker 0's random state after the local batch
        self.closed = False
        self._finalizer = weakref.finalize(self, _shutdown, self.workers, self.prefix)
        self._skeletons: dict[bytes, Any] = {}  # see worker_loop.done_from_wire
        self._poll_key = -1
        self._forks = 0  # workers forked over the pool's life (``_poller``)
        self._polling: tuple[Any, dict[int, tuple[bool, _Worker]]] = (None, {})
        self._last_wait_s = 0.0  # how long the last _wait took (see SPIN_S)
        # batches this process makes while it would wait (main_help.py): map-style datasets
        # without worker_init_fn or timeout only
        self.helper: MainHelper | None = None
        if (main_helps and not self.spec.iterable and self.spec.worker_init_fn is None
                and not timeout_s):
            self.helper = MainHelper(self.spec, main_helps, in_order)
        self._helped_waiting = 0  # batches made here, not handed out yet
        self._handed = 0  # batches handed out over the pool's life
        self._helped_at = -PARK_WINDOW - 1  # ``_handed`` when this process last made a batch
        # the worker that gets no new batches while this process helps, when the workers
        # and this process outnumber the cores (main_help.py); None: no worker is parked
        cores = usable_cores()
        self._parkable = num_workers - 1 if self.helper is not None and 2 <= num_workers >= cores else None
        self._pending: collections.deque = collections.deque()  # (bid, indices) for any worker

    # -- life cycle ---------------------------------------------------------------------------
    def _start_worker(self, w: _Worker, skip_batches: int) -> None:
        parent, child = self.ctx.Pipe(duplex=True)
        rng = self._rng0 if w.id == 0 and w.life == 0 else None
        self._rng0 = None if w.id == 0 else self._rng0
        w.proc = self.ctx.Process(target=worker_main, args=(w.id, w.life, child, self.spec, skip_batches, rng),
                                  name=f"tpkit-data-{w.id}", daemon=True)
        # Objects that exist now are left out of the child's garbage collections, so they are
        # not written to (copied page by page) in every worker; the parent unfreezes at once.
        # Ctrl-C waits for the fork: in an at-fork hook it would be lost, and between freeze
        # and unfreeze it would leave the parent's gc frozen.
        with held_sigint():
            gc.freeze()
            try:
                w.proc.start()
            finally:
                gc.unfreeze()
        child.close()
        w.conn = parent
        self._forks += 1
        w.free = list(range(self.n_slots))
        w.held = 0
        w.inflight = {}

    def begin_epoch(self, tasks: Iterator | None, skip_per_worker: list[int] | None = None,
                    first_worker: int = 0, split_first: bool = False) -> None:
        """Start an epoch: ``tasks`` yields index lists (map-style) or is None (iterable).

        split_first: the epoch's first batch is made by all workers at once, each fetching
        and collating a contiguous part; the parts are joined in the main process (only valid
        with torch's default_collate, which the caller checks)."""
        skips = skip_per_worker or [0] * self.num_workers
        # Batches of an abandoned epoch that were never handed out: free their slots.
        old = [a for a in getattr(self, "results", {}).values() if a.worker is not None]
        old += [a for sp in getattr(self, "splits", {}).values() for a in sp.got.values() if a is not None]
        for a in old:
            if isinstance(a.msg, BatchDone) and a.life == a.worker.life:
                a.worker.free.append(a.msg.slot)
        self.epoch_first_id = self._next_id
        self.next_yield = self._next_id
        self.splits: dict[int, _Split] = {}
        if split_first and tasks is not None and self.num_workers >= 2:
            first = next(tasks, None)
            if first is not None and len(first) >= self.num_workers:
                n, W = len(first), self.num_workers
                parts = [list(first[k * n // W:(k + 1) * n // W]) for k in range(W)]
                self.splits[self._next_id] = _Split(parts)
                self._next_id += 1
            elif first is not None:
                tasks = itertools.chain([first], tasks)
        self._local = None
        if (not self._started and tasks is not None and not self.splits and self.in_order
                and not self.timeout_s and self.spec.worker_init_fn is None):
            first = next(tasks, None)
            if first is not None:  # made here by the first next(); the workers start after it
                self._local = (self._next_id, first)
                self._next_id += 1
                self._unstarted = list(skips)
        self.tasks = tasks
        self.tasks_done = False
        self.results: dict[int, _Answer] = {}
        self._helped_waiting = 0
        self._pending.clear()
        self.rr = first_worker  # iterables: whose turn the next batch is (resume keeps it)
        if self._unstarted is not None:
            for w in self.workers:
                w.buffered, w.delivered, w.exhausted = 0, skips[w.id], False
            return
        for w in self.workers:
            w.buffered = 0
            w.delivered = skips[w.id]
            w.exhausted = False
            if not self._started:
                self._start_worker(w, skips[w.id] if tasks is None else 0)
                # Hand this worker its first batches before forking the next one: it starts
                # working while we fork (the first batch comes sooner).
                self._dispatch()
            elif tasks is None:
                w.conn.send(Reset(skips[w.id]))
        self._started = True

    def _make_local(self, bid: int, indices: Any) -> LoadedBatch:
        """The epoch's first batch, made in this process as worker 0 would make it (its seeds;
        the random state it leaves is worker 0's start); this process's own random state is
        restored. A failure is reported as worker 0's, and the epoch goes on."""
        self._local = None
        self.next_yield = bid + 1
        mine = get_rng_states()
        seed_worker(self.spec.base_seed, 0, in_main=True)
        seeded = get_rng_states() if self.helper is not None else None
        maker = BatchMaker(self.spec)
        fork_error: list[BaseException] = []

        def sized(sample_s: float, n: int) -> None:
            if sample_s * n >= FORK_AHEAD_MIN_S:
                try:
                    self._start_ahead()
                except BaseException as e:  # not the dataset's failure: raised as itself below
                    fork_error.append(e)
                    raise

        try:
            made = maker.make(indices, sized=sized)
            assert made is not None  # map-style: never exhausted
            flatten(made.batch, [])  # what a worker could not hand over fails here too
        except Exception as e:
            if fork_error:
                raise
            err = failed(bid, maker.current_index, e)
            raise worker_error(0, bid - self.epoch_first_id, err.index, err.exc_type, err.message,
                              err.traceback) from None
        finally:
            self._rng0 = get_rng_states()
            set_rng_states(mine)
        if seeded is not None and self.helper is not None:
            self.helper.first_drew = not same_rng_states(seeded, self._rng0)
            self.helper.note_make(made.fetch_s + made.collate_s)
        # the other workers (worker 0, which goes on from this batch's random state, and any
        # beyond worker 1) are forked by the next next(): this one is not kept waiting for them
        return LoadedBatch(made.batch, 0, made.fetch_s, made.collate_s, 0.0, 0.0, made.n_samples, made.cpu_s)

    def _start_ahead(self) -> None:
        """While a slow first batch is made here: fork worker 1 (its batches do not depend on
        this one's random state; it seeds itself) and hand it batch 1, so that batch is made
        meanwhile. The others wait for the next ``next()``: a first batch costs at most one
        fork, not one per worker."""
        if self._unstarted is not None and len(self.workers) >= 2 and self.workers[1].proc is None:
            self._start_worker(self.workers[1], self._unstarted[1])
            self._dispatch()

    def _start_deferred(self) -> None:
        """Fork the workers held back by the in-process first batch (those not forked yet), each
        handed its first tasks before the next is forked."""
        skips, self._unstarted = self._unstarted, None
        assert skips is not None
        for w in self.workers:
            if w.proc is None:
                self._start_worker(w, skips[w.id])
                self._dispatch()
        self._started = True

    def shutdown(self) -> None:
        self.closed = True
        with held_sigint():  # the finalizer runs once: a Ctrl-C must not cut it short
            self._finalizer()

    # -- dispatch -----------------------------------------------------------------------------
    def _drain_released(self) -> None:
        rel = self._released
        while rel:
            entry = self._leases.pop(id(rel.popleft()), None)
            if entry is None:
                continue
            wid, life, slot = entry[1]
            w = self.workers[wid]
            if w.life == life:
                w.free.append(slot)
                w.held -= 1

    def _depth(self, w: _Worker) -> int:
        """Batches in flight this worker may have (see the module docstring)."""
        return DEEP_PREFETCH if self.deep_small and 0 <= w.slot_bytes <= SMALL_SLOT_BYTES else self.prefetch

    def _room(self, w: _Worker) -> int:
        """Tasks ``w`` may be sent now. Like torch, count batches the worker still owes; a
        finished batch waiting in the reorder buffer holds a slot (the hard limit) but must not
        idle its worker."""
        depth = self._depth(w)
        in_use = self.n_slots - len(w.free)  # in flight, answered and waiting, or held by the loop
        return min(depth - len(w.inflight), depth + self.hold - in_use)

    def _has_room(self, w: _Worker) -> bool:
        return w.proc is not None and not w.exhausted and self._room(w) > 0

    def _parked(self) -> int | None:
        """The worker id that gets no new batches now (main_help.py), or None."""
        if (self._parkable is None or self.tasks is None or self._unstarted is not None
                or self._handed - self._helped_at > PARK_WINDOW):
            return None
        assert self.helper is not None
        return self._parkable if self.helper.wanted() else None

    def _pick(self) -> _Worker | None:
        ws = self.workers
        parked = self._parked()
        if parked is not None:  # the main process makes that worker's share: the least loaded other
            return self._least_loaded(parked)
        if not self.in_order:
            if self.tasks is None and all(w.exhausted for w in ws):
                self.tasks_done = True
                return None
            return self._least_loaded(None)
        if self.tasks is not None:  # map-style: batch b goes to worker b % W, like torch
            w = ws[(self._next_id - self.epoch_first_id) % len(ws)]
            return w if self._has_room(w) else None
        for k in range(len(ws)):  # iterable: round robin over workers whose stream is not over
            w = ws[(self.rr + k) % len(ws)]
            if not w.exhausted:
                if self._has_room(w):
                    self.rr = (w.id + 1) % len(ws)
                    return w
                return None
        self.tasks_done = True
        return None

    def _least_loaded(self, skip: int | None) -> _Worker | None:
        """The worker with room and the fewest batches owed or waiting, other than ``skip``
        (a plain loop: ``_dispatch`` asks at every pass, twice a batch of a fast loader)."""
        best, fewest = None, 0
        for w in self.workers:
            if w.id != skip and self._has_room(w):
                owed = len(w.inflight) + w.buffered
                if best is None or owed < fewest:
                    best, fewest = w, owed
        return best

    def _dispatch(self) -> None:
        self._drain_released()
        for bid, split in self.splits.items():  # parts of a split first batch go first
            for k, part in enumerate(split.parts):
                w = self.workers[k]
                if k not in split.sent and w.proc is not None and w.free:
                    msg = Task(bid, part, w.free.pop())
                    w.inflight[bid] = msg
                    split.sent.add(k)
                    self._send(w, msg)
        while self._pending:  # a batch the main process gave back: to any worker with room
            room = [w for w in self.workers if self._has_room(w)]
            if not room:
                return
            bid, idx = self._pending.popleft()
            w = room[0]
            msg = Task(bid, idx, w.free.pop())
            w.inflight[bid] = msg
            self._send(w, msg)
        out: dict[int, tuple[_Worker, list[Task]]] = {}  # worker id -> its tasks of this pass
        try:
            while not self.tasks_done:
                rr = self.rr  # _pick moves an iterable dataset's round robin on
                picked = self._pick()
                if picked is None:
                    return
                w = picked
                if not out and not self._may_refill(w):  # once begun, a pass fills every queue
                    self.rr = rr  # the next batch is still w's to make
                    return
                bid = self._next_id
                idx = None  # an iterable dataset's task: the next of the worker's stream
                if self.tasks is not None:
                    idx = next(self.tasks, None)  # map-style: an index list, never None
                    if idx is None:
                        self.tasks_done = True
                        return
                msg = Task(bid, idx, w.free.pop())
                w.inflight[bid] = msg
                self._next_id += 1
                out.setdefault(w.id, (w, []))[1].append(msg)
        finally:
            for w, tasks in out.values():
                self._send(w, tasks[0] if len(tasks) == 1 else tasks)

    def _may_refill(self, w: _Worker) -> bool:
        """Whether a pass of ``_dispatch`` may begin with a task for ``w``. A worker whose
        batches are small (``DEEP_PREFETCH`` in flight) waits until ``REFILL_TASKS`` of its
        queue are free, and the pass then fills every worker's queue with each worker's tasks
        in one message: the worker still has the rest of its queue to make meanwhile, and a
        message a batch cost both processes a pipe round (the main process ~10 us to send, the
        worker ~15 us to wake on and read it), a tenth of a ~150 us batch."""
        return self._depth(w) < DEEP_PREFETCH or self._room(w) >= REFILL_TASKS

    @staticmethod
    def _send(w: "_Worker", msg: Task | list[Task]) -> None:
        """Send a task, or several as one message (a list: the worker makes them in order); a
        worker that already died (e.g. its worker_init_fn raised) closed its pipe. The tasks stay
        in ``inflight``, and the receive loop reports the death (with the worker's own error
        when it sent one) or, with restart_workers, re-sends them one by one."""
        try:
            # plain pickle of plain tuples: a task is ints and a list of ints (the pipe's
            # ForkingPickler, with its per-call reducer table, costs ~5 us more; a Task would
            # cost a class lookup and a Python call each way); the worker's recv() reads it
            wire = tuple(msg) if type(msg) is not list else [tuple(t) for t in msg]
            w.conn.send_bytes(pickle.dumps(wire, pickle.HIGHEST_PROTOCOL))
        except (BrokenPipeError, ConnectionResetError):
            pass

    # -- receive --------------------------------------------------------------------------------
    def _receive(self, w: _Worker, msg: BatchDone | BatchFailed | StreamEnded) -> None:
        bid = msg.batch_id
        task = w.inflight.pop(bid, None)
        if isinstance(msg, BatchFailed) and bid == -1:
            raise worker_error(w.id, -1, None, msg.exc_type, msg.message, msg.traceback)
        if isinstance(msg, BatchDone):
            w.slot_bytes = max(w.slot_bytes, msg.slot_bytes)
            if self.helper is not None:
                self.helper.note_make(msg.fetch_s + msg.collate_s)
            mm = None
            if msg.gen >= 0:  # the batch has tensors in the ring (else the skeleton is all of it)
                mm = w.maps.get((w.life, msg.gen))
                if mm is None:
                    mm = map_segment(segment_path(self.prefix, w.id, w.life, msg.gen))
                    w.maps = {(w.life, msg.gen): mm}  # older generations live on in their views
            if bid < self.epoch_first_id:  # an answer from an abandoned epoch
                w.free.append(msg.slot)
                return
            w.delivered += 1
            w.buffered += 1
            split = self.splits.get(bid)
            if split is not None:
                split.got[w.id] = _Answer(w, w.life, mm, msg)
                self._maybe_complete(bid, split)
                return
            self.results[bid] = _Answer(w, w.life, mm, msg, perf_counter_ns())
            return
        if task is not None:  # ended or failed: the slot given with the task was not used
            w.free.append(task.slot)
        if bid < self.epoch_first_id:
            return
        split = self.splits.get(bid)
        if split is not None and isinstance(msg, BatchFailed):  # one part of a split batch failed
            split.err = split.err or (w.id, msg)
            split.got[w.id] = None
            self._maybe_complete(bid, split)
            return
        w.buffered += 1
        if isinstance(msg, StreamEnded):
            w.exhausted = True
        self.results[bid] = _Answer(w, w.life, None, msg)

    def _maybe_complete(self, bid: int, split: "_Split") -> None:
        if len(split.got) == len(split.parts):
            del self.splits[bid]
            self.results[bid] = _Answer(None, 0, None, split)

    def _on_death(self, w: _Worker) -> None:
        try:
            while w.conn.poll(0):  # what it sent before dying still counts
                self._receive(w, done_from_wire(w.conn.recv(), self._skeletons))
        except (EOFError, OSError):
            pass
        w.proc.join(0.5)
        if w.proc.is_alive():  # its pipe broke but it lives on: make sure it is gone
            w.proc.kill()
            w.proc.join(0.5)
        code, pid = w.proc.exitcode, w.proc.pid
        lost = sorted(w.inflight)
        remove_segments(f"{self.prefix}w{w.id}.{w.life}-")
        if not self.restart_workers or self.closed:
            raise WorkerDiedError(
                f"loader worker {w.id} (pid {pid}) {_signal_name(code)} while making batches "
                f"{lost or 'none'}. Pass restart_workers=True to replace dead workers without "
                f"losing or repeating a batch; if it was the OOM killer (see dmesg), use fewer "
                f"workers, a smaller prefetch or smaller batches.")
        warnings.warn(f"tpkit.data: loader worker {w.id} (pid {pid}) {_signal_name(code)}; "
                      f"restarted it and re-sent batches {lost}", RuntimeWarning, stacklevel=4)
        try:
            w.conn.close()
        except Exception:
            pass
        w.life += 1
        self.restarts += 1
        old = [w.inflight[b] for b in lost]
        self._start_worker(w, w.delivered if self.tasks is None else 0)
        for task in old:  # same batches, same order, into the new worker's ring
            task = task._replace(slot=w.free.pop())
            w.inflight[task.batch_id] = task
            self._send(w, task)

    def _poller(self) -> tuple[Any, dict[int, tuple[bool, _Worker]]]:
        """One ``select.poll`` over every live worker's pipe and process sentinel, kept while
        the workers stay the same (``multiprocessing.connection.wait`` and ``Connection.poll``
        build a new selector at each call: ~10 us each, three per batch)."""
        key = self._forks  # the workers change only when one is forked (or all stop: a new pool)
        if key != self._poll_key:
            poller, where = select.poll(), {}
            for w in self.workers:
                if w.proc is not None:
                    for fd, dead in ((w.conn.fileno(), False), (w.proc.sentinel, True)):
                        poller.register(fd, select.POLLIN)
                        where[fd] = (dead, w)
            self._poll_key, self._polling = key, (poller, where)
        return self._polling

    def _wait(self, timeout_s: float | None, look: bool = False) -> bool:
        """Wait up to ``timeout_s`` for the workers (``look``: do not wait); receive every
        answer that is there."""
        poller, where = self._poller()
        if look:
            ready = poller.poll(0)
        else:
            t0 = perf_counter()
            spin_s = SPIN_S if self._last_wait_s < SPIN_AFTER_WAIT_S else 0.0
            ready = poll_spinning(poller, timeout_s, spin_s)
            self._last_wait_s = perf_counter() - t0
        got = bool(ready)
        dead: dict[int, _Worker] = {}
        while ready:
            for fd, _ in ready:
                is_sentinel, w = where[fd]
                if w.id in dead:
                    continue
                if is_sentinel:
                    dead[w.id] = w
                    continue
                try:
                    self._receive(w, done_from_wire(w.conn.recv(), self._skeletons))
                except (EOFError, OSError):
                    dead[w.id] = w
            # what else is there now (a dead worker's fds stay ready: left out)
            ready = [r for r in poller.poll(0) if where[r[0]][1].id not in dead]
        for w in dead.values():
            self._on_death(w)
        return got

    # -- hand out ---------------------------------------------------------------------------------
    def _take_split(self, bid: int, split: "_Split") -> LoadedBatch:
        """Join the parts of a split batch (private copies; their slots are freed at once)."""
        t0 = perf_counter_ns()
        parts, fetch_s, collate_s, write_s, done_ns, n, cpu_s = [], 0.0, 0.0, 0.0, 0, 0, 0.0
        for k in sorted(split.got):
            got = split.got[k]
            if got is None:
                continue
            w, msg = got.worker, got.msg
            assert w is not None
            w.buffered -= 1
            parts.append(read_slot(got.mm, msg.slot, msg.slot_bytes, msg.skeleton, True, None))
            if got.life == w.life:
                w.free.append(msg.slot)
            fetch_s, collate_s = max(fetch_s, msg.fetch_s), max(collate_s, msg.collate_s)
            write_s, done_ns, n = max(write_s, msg.write_s), max(done_ns, msg.done_ns), n + msg.n_samples
            cpu_s = max(cpu_s, msg.cpu_s)  # the parts were made side by side: as fetch_s, the longest
        if split.err is not None:
            wid, err = split.err
            raise worker_error(wid, bid - self.epoch_first_id, err.index, err.exc_type, err.message, err.traceback)
        batch = merge_parts(parts)
        t1 = perf_counter_ns()
        return LoadedBatch(batch, 0, fetch_s, collate_s, max(0.0, (t0 - done_ns) / 1e9),
                           write_s + (t1 - t0) / 1e9, n, cpu_s)

    def _may_help(self) -> bool:
        """Whether this process makes a batch now (the caller would wait otherwise)."""
        h = self.helper
        return (h is not None and self.tasks is not None and not self.tasks_done
                and self._helped_waiting < self._help_ahead() and self._unstarted is None and h.wanted())

    def _help_ahead(self) -> int:
        """Batches made here and not handed out yet, at most: as many as the workers may have
        in flight (a helped batch waits for the in-flight ones before it, in order; more would
        only hold memory)."""
        # the deepest worker's depth for every worker: a resting one may never have told its size
        depth = self.prefetch
        for w in self.workers:  # (asked before each batch made here: no generator)
            depth = max(depth, self._depth(w))
        return depth * self.num_workers

    def _help(self) -> None:
        """Make the next unassigned batch here, into the reorder buffer; or, when it drew
        random numbers it must not draw here, give it to a worker (main_help.py)."""
        assert self.helper is not None and self.tasks is not None
        idx = next(self.tasks, None)
        if idx is None:
            self.tasks_done = True
            return
        bid = self._next_id
        self._next_id += 1
        self._helped_at = self._handed
        try:
            made = self.helper.make(idx)
        except Exception as e:
            self.results[bid] = _Answer(None, 0, None, failed(bid, self.helper.maker.current_index, e))
            self.helper.maker.current_index = None
            self._helped_waiting += 1
            return
        if made is None:
            self._pending.append((bid, idx))
            return
        self.results[bid] = _Answer(None, 0, None, LoadedBatch(
            made.batch, -1, made.fetch_s, made.collate_s, 0.0, 0.0, made.n_samples, made.cpu_s))
        self._helped_waiting += 1

    def _take(self, bid: int) -> LoadedBatch | None:
        a = self.results.pop(bid)
        w, msg = a.worker, a.msg
        self._handed += 1
        if w is None:
            if isinstance(msg, _Split):
                return self._take_split(bid, msg)
            self._helped_waiting -= 1
            if isinstance(msg, BatchFailed):
                raise worker_error(-1, bid - self.epoch_first_id, msg.index, msg.exc_type, msg.message,
                                  msg.traceback)
            return msg
        w.buffered -= 1
        if isinstance(msg, StreamEnded):
            return None
        if isinstance(msg, BatchFailed):
            raise worker_error(w.id, bid - self.epoch_first_id, msg.index, msg.exc_type, msg.message,
                              msg.traceback)
        t0 = perf_counter_ns()
        current = a.life == w.life
        # a batch without tensors (mm None) never used its slot; an old life's slot is not ours
        copy = (not current) or w.held >= self.hold or a.mm is None
        key = (w.id, a.life, msg.slot)

        def lease(array: Any) -> None:
            ref = weakref.ref(array, self._released.append)
            self._leases[id(ref)] = (ref, key)

        batch = read_slot(a.mm, msg.slot, msg.slot_bytes, msg.skeleton, copy, None if copy else lease)
        if copy and current:
            w.free.append(msg.slot)
        elif not copy:
            w.held += 1
        t1 = perf_counter_ns()
        queue_wait_s = max(0.0, (t0 - msg.done_ns) / 1e9)
        transfer_s = msg.write_s + (t1 - t0) / 1e9
        return LoadedBatch(batch, w.id, msg.fetch_s, msg.collate_s, queue_wait_s, transfer_s, msg.n_samples,
                           msg.cpu_s)

    def next(self) -> LoadedBatch:
        """The next batch; raises StopIteration at the end of the epoch."""
        waited_s = 0.0
        if self._local is not None and self._local[0] == self.next_yield:
            return self._make_local(*self._local)
        if self._unstarted is not None:
            self._start_deferred()
        # True after a batch made here while nothing came: the workers' queues are as the last
        # dispatch left them, so the next pass skips it (~8 us); it dispatches before any sleep
        made_here = False
        while True:
            if not made_here:
                self._dispatch()
            if self.in_order:
                while self.next_yield in self.results:
                    bid = self.next_yield
                    self.next_yield += 1
                    out = self._take(bid)
                    if out is not None:
                        if out.worker >= 0:  # refill now: the reorder slot it left is free
                            self._dispatch()
                        return out
                if self.tasks_done and self.next_yield >= self._next_id:
                    raise StopIteration
            else:
                while self.results:
                    bid = min(self.results)
                    out = self._take(bid)
                    if out is not None:
                        self._dispatch()  # refill now: the reorder slot it left is free
                        return out
                if self.tasks_done and not self._pending and not any(w.inflight for w in self.workers):
                    raise StopIteration
            if self.tasks_done and self.tasks is None and all(w.exhausted for w in self.workers) \
                    and not any(w.inflight for w in self.workers) and not self.results:
                raise StopIteration
            if self._may_help():
                if not self._wait(0, look=True):  # nothing came meanwhile: make the next batch here
                    self._help()
                    made_here = not self._pending
                else:
                    made_here = False
                continue
            if made_here:
                made_here = False
                continue
            t0 = perf_counter()
            step_s = 5.0 if not self.timeout_s else min(5.0, self.timeout_s - waited_s)
            got = self._wait(max(step_s, 0.0))
            waited_s = 0.0 if got else waited_s + perf_counter() - t0
            if self.timeout_s and waited_s >= self.timeout_s:
                pending = sorted(b for w in self.workers for b in w.inflight)
                raise LoaderTimeoutError(
                    f"no batch came from the loader workers for {self.timeout_s} s (waiting for "
                    f"batches {pending[:8]}). Raise timeout= if a batch legitimately takes longer, "
                    f"or look for a hang in the dataset's __getitem__ / collate_fn.")
