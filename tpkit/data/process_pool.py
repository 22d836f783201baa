"""Worker processes seen from the main process: dispatch, receive, reorder, recover.

One duplex pipe per worker carries tasks one way and small result tuples the other way
(see ``worker_loop``); the main process waits on all pipes *and* all process sentinels at
once, so a worker that dies is noticed at the moment it dies, not after a timeout.

Flow control, per worker: at most ``prefetch`` batches dispatched and not yet answered,
within ``prefetch + hold`` slots. A handed-out batch keeps its slot until the training loop
drops every view of it; when the loop already holds ``hold`` of a worker's slots, the next
batch from that worker is handed out as a private copy instead. So a dispatch never waits on
the user, and no slot is overwritten while a view of it is alive.

``hold`` is 1 with two or more workers: a plain ``for batch in loader`` keeps the previous
batch alive while asking for the next, and with round-robin order those come from different
workers. With one worker both come from the same ring, so ``hold`` is 2. A loop that keeps
more batches alive still works; it gets copies for the extra ones.
"""

from __future__ import annotations

import collections
import gc
import itertools
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import signal
import warnings
import weakref
from dataclasses import dataclass, field
from time import perf_counter, perf_counter_ns
from typing import Any, Iterator

from .errors import LoaderTimeoutError, WorkerDiedError, WorkerError
from .collate import merge_parts
from .slots import map_segment, read_slot, remove_segments, segment_path, segment_prefix
from .worker_loop import WorkerSpec, worker_main

def hold_slots(num_workers: int) -> int:
    """Batches of one worker the training loop may keep alive before we copy (see above)."""
    return 1 if num_workers >= 2 else 2
_END = object()  # an iterable worker's stream ended
_loader_ids = itertools.count()


@dataclass
class _Worker:
    id: int
    life: int = 0  # bumped on every restart; slot releases from an older life are ignored
    proc: Any = None
    conn: Any = None
    free: list = field(default_factory=list)  # free slot numbers
    held: int = 0  # slots whose views the training loop still holds
    inflight: dict = field(default_factory=dict)  # batch_id -> task message (not yet answered)
    buffered: int = 0  # answered, waiting in the reorder buffer
    delivered: int = 0  # batches answered this epoch (iterables: where a restart resumes)
    exhausted: bool = False
    maps: dict = field(default_factory=dict)  # (life, gen) -> mmap


@dataclass
class _Split:
    """The first batch of an epoch, made in parts by all workers (``fast_start``)."""

    parts: list  # index list per worker
    sent: set = field(default_factory=set)
    got: dict = field(default_factory=dict)  # worker -> (worker, life, mmap, msg), None if it failed
    err: tuple | None = None  # (worker, "err" message) of the first failed part


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
    """Stop every worker and remove every segment file; safe to call twice."""
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
                 restart_workers: bool, timeout_s: float, context: Any = None) -> None:
        self.loader_id = next(_loader_ids)
        self.prefix = segment_prefix(os.getpid(), self.loader_id)
        self.hold = hold_slots(num_workers)
        self.n_slots = prefetch + self.hold
        self.spec = WorkerSpec(**spec_args, num_workers=num_workers, seg_prefix=self.prefix,
                               n_slots=self.n_slots, parent_pid=os.getpid())
        self.num_workers, self.prefetch, self.in_order = num_workers, prefetch, in_order
        self.restart_workers, self.timeout_s = restart_workers, timeout_s
        self.ctx = context if context is not None else mp.get_context()
        self.workers = [_Worker(i) for i in range(num_workers)]
        self.restarts = 0
        self._released: collections.deque = collections.deque()
        self._next_id = 0  # batch ids never repeat across epochs: stale answers are recognisable
        self._started = False
        self.closed = False
        self._finalizer = weakref.finalize(self, _shutdown, self.workers, self.prefix)

    # -- life cycle ---------------------------------------------------------------------------
    def _start_worker(self, w: _Worker, skip_batches: int) -> None:
        parent, child = self.ctx.Pipe(duplex=True)
        w.proc = self.ctx.Process(target=worker_main, args=(w.id, w.life, child, self.spec, skip_batches),
                                  name=f"tpkit-data-{w.id}", daemon=True)
        # Objects that exist now are left out of the child's garbage collections, so they are
        # not written to (copied page by page) in every worker; the parent unfreezes at once.
        gc.freeze()
        try:
            w.proc.start()
        finally:
            gc.unfreeze()
        child.close()
        w.conn = parent
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
        old = [(w, life, msg) for w, life, _, msg, _ in getattr(self, "results", {}).values()
               if w is not None]
        old += [r[0:2] + (r[3],) for sp in getattr(self, "splits", {}).values()
                for r in sp.got.values() if r is not None]
        for w, life, msg in old:
            if msg is not _END and msg[0] == "ok" and life == w.life:
                w.free.append(msg[2])
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
        self.tasks = tasks
        self.tasks_done = False
        self.results: dict[int, tuple] = {}
        self.rr = first_worker  # iterables: whose turn the next batch is (resume keeps it)
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
                w.conn.send(("reset", skips[w.id]))
        self._started = True

    def shutdown(self) -> None:
        self.closed = True
        self._finalizer()

    # -- dispatch -----------------------------------------------------------------------------
    def _drain_released(self) -> None:
        rel = self._released
        while rel:
            wid, life, slot = rel.popleft()
            w = self.workers[wid]
            if w.life == life:
                w.free.append(slot)
                w.held -= 1

    def _has_room(self, w: _Worker) -> bool:
        # Like torch, count batches the worker still owes; a finished batch waiting in the
        # reorder buffer holds a slot (the hard limit) but must not idle its worker.
        return (w.proc is not None and not w.exhausted and bool(w.free)
                and len(w.inflight) < self.prefetch)

    def _pick(self) -> _Worker | None:
        ws = self.workers
        if not self.in_order:
            if self.tasks is None and all(w.exhausted for w in ws):
                self.tasks_done = True
                return None
            ok = [w for w in ws if self._has_room(w)]
            return min(ok, key=lambda w: len(w.inflight) + w.buffered) if ok else None
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

    def _dispatch(self) -> None:
        self._drain_released()
        for bid, split in self.splits.items():  # parts of a split first batch go first
            for k, part in enumerate(split.parts):
                w = self.workers[k]
                if k not in split.sent and w.proc is not None and w.free:
                    msg = ("map", bid, part, w.free.pop())
                    w.inflight[bid] = msg
                    split.sent.add(k)
                    self._send(w, msg)
        while not self.tasks_done:
            w = self._pick()
            if w is None:
                return
            bid = self._next_id
            if self.tasks is not None:
                try:
                    idx = next(self.tasks)
                except StopIteration:
                    self.tasks_done = True
                    return
                msg = ("map", bid, idx, w.free.pop())
            else:
                msg = ("iter", bid, w.free.pop())
            w.inflight[bid] = msg
            self._next_id += 1
            self._send(w, msg)

    @staticmethod
    def _send(w: "_Worker", msg: tuple) -> None:
        """Send a task; a worker that already died (e.g. its worker_init_fn raised) closed its
        pipe. The task stays in ``inflight``, and the receive loop reports the death (with the
        worker's own error when it sent one) or, with restart_workers, re-sends it."""
        try:
            w.conn.send(msg)
        except (BrokenPipeError, ConnectionResetError):
            pass

    # -- receive --------------------------------------------------------------------------------
    def _receive(self, w: _Worker, msg: tuple) -> None:
        kind, bid = msg[0], msg[1]
        task = w.inflight.pop(bid, None)
        if kind == "err" and bid == -1:
            raise WorkerError(w.id, -1, None, msg[3], msg[4], msg[5])
        if kind == "ok":
            slot, gen = msg[2], msg[3]
            mm = w.maps.get((w.life, gen))
            if mm is None:
                mm = map_segment(segment_path(self.prefix, w.id, w.life, gen))
                w.maps = {(w.life, gen): mm}  # older generations live on in their views
            if bid < self.epoch_first_id:  # an answer from an abandoned epoch
                w.free.append(slot)
                return
            w.delivered += 1
            w.buffered += 1
            split = self.splits.get(bid)
            if split is not None:
                split.got[w.id] = (w, w.life, mm, msg)
                self._maybe_complete(bid, split)
                return
            self.results[bid] = (w, w.life, mm, msg, perf_counter_ns())
            return
        if task is not None:  # "end" or "err": the slot given with the task was not used
            w.free.append(task[-1])
        if bid < self.epoch_first_id:
            return
        split = self.splits.get(bid)
        if split is not None:  # an "err" for one part of a split batch
            split.err = split.err or (w.id, msg)
            split.got[w.id] = None
            self._maybe_complete(bid, split)
            return
        w.buffered += 1
        if kind == "end":
            w.exhausted = True
            self.results[bid] = (w, w.life, None, _END, 0)
        else:
            self.results[bid] = (w, w.life, None, msg, 0)

    def _maybe_complete(self, bid: int, split: "_Split") -> None:
        if len(split.got) == len(split.parts):
            del self.splits[bid]
            self.results[bid] = (None, 0, None, split, 0)

    def _on_death(self, w: _Worker) -> None:
        try:
            while w.conn.poll(0):  # what it sent before dying still counts
                self._receive(w, w.conn.recv())
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
        for m in old:  # same batches, same order, into the new worker's ring
            m = (*m[:-1], w.free.pop())
            w.inflight[m[1]] = m
            w.conn.send(m)

    def _wait(self, timeout_s: float | None) -> bool:
        live = [w for w in self.workers if w.proc is not None]
        objs = {}
        for w in live:
            objs[w.conn] = ("conn", w)
            objs[w.proc.sentinel] = ("dead", w)
        ready = mpc.wait(list(objs), timeout_s)
        dead: dict[int, _Worker] = {}
        for r in ready:
            what, w = objs[r]
            if what == "dead":
                dead[w.id] = w
                continue
            try:
                while w.conn.poll(0):
                    self._receive(w, w.conn.recv())
            except (EOFError, OSError):
                dead[w.id] = w
        for w in dead.values():
            self._on_death(w)
        return bool(ready)

    # -- hand out ---------------------------------------------------------------------------------
    def _take_split(self, bid: int, split: "_Split") -> tuple:
        """Join the parts of a split batch (private copies; their slots are freed at once)."""
        t0 = perf_counter_ns()
        parts, fetch_s, collate_s, write_s, done_ns, n = [], 0.0, 0.0, 0.0, 0, 0
        for k in sorted(split.got):
            got = split.got[k]
            if got is None:
                continue
            w, life, mm, msg = got
            w.buffered -= 1
            (_, _, slot, gen, slot_bytes, skel, f_s, c_s, wr_s, d_ns, m) = msg
            parts.append(read_slot(mm, slot, slot_bytes, skel, True, None))
            if life == w.life:
                w.free.append(slot)
            fetch_s, collate_s, write_s = max(fetch_s, f_s), max(collate_s, c_s), max(write_s, wr_s)
            done_ns, n = max(done_ns, d_ns), n + m
        if split.err is not None:
            wid, msg = split.err
            raise WorkerError(wid, bid - self.epoch_first_id, msg[2], msg[3], msg[4], msg[5])
        batch = merge_parts(parts)
        t1 = perf_counter_ns()
        return batch, 0, fetch_s, collate_s, max(0.0, (t0 - done_ns) / 1e9), write_s + (t1 - t0) / 1e9, n

    def _take(self, bid: int) -> tuple | None:
        w, life, mm, msg, recv_ns = self.results.pop(bid)
        if w is None:
            return self._take_split(bid, msg)
        w.buffered -= 1
        if msg is _END:
            return None
        if msg[0] == "err":
            raise WorkerError(w.id, bid - self.epoch_first_id, msg[2], msg[3], msg[4], msg[5])
        (_, _, slot, gen, slot_bytes, skel, fetch_s, collate_s, write_s, done_ns, n) = msg
        t0 = perf_counter_ns()
        current = life == w.life
        copy = (not current) or w.held >= self.hold
        release = None if copy else _Release(self._released.append, (w.id, life, slot))
        batch = read_slot(mm, slot, slot_bytes, skel, copy, release)
        if copy and current:
            w.free.append(slot)
        elif not copy:
            w.held += 1
        t1 = perf_counter_ns()
        queue_wait_s = max(0.0, (t0 - done_ns) / 1e9)
        transfer_s = write_s + (t1 - t0) / 1e9
        return batch, w.id, fetch_s, collate_s, queue_wait_s, transfer_s, n

    def next(self) -> tuple:
        """The next batch as (batch, worker, fetch_s, collate_s, queue_wait_s, transfer_s,
        n_samples); raises StopIteration at the end of the epoch."""
        waited_s = 0.0
        while True:
            self._dispatch()
            if self.in_order:
                while self.next_yield in self.results:
                    bid = self.next_yield
                    self.next_yield += 1
                    out = self._take(bid)
                    if out is not None:
                        self._dispatch()  # refill now: the reorder slot it left is free
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
                if self.tasks_done and not any(w.inflight for w in self.workers):
                    raise StopIteration
            if self.tasks_done and self.tasks is None and all(w.exhausted for w in self.workers) \
                    and not any(w.inflight for w in self.workers) and not self.results:
                raise StopIteration
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


class _Release:
    """Finalizer callback that returns a slot; a class, so it holds no frame or closure."""

    __slots__ = ("append", "key")

    def __init__(self, append: Any, key: tuple) -> None:
        self.append, self.key = append, key

    def __call__(self) -> None:
        self.append(self.key)
