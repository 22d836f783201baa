"""The in-process and thread engines (the process engine is ``process_pool``).

Every engine's ``next()`` returns a ``LoadedBatch`` (the batch, its worker and where its time
went) and raises StopIteration at the end of the epoch.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import threading
import traceback
from time import perf_counter_ns
from typing import Any, Iterator

from .errors import LoaderTimeoutError, WorkerError, worker_error
from .worker_loop import BatchMaker, LoadedBatch, WorkerSpec


def _wrap_error(maker: BatchMaker, worker: int, batch: int, e: Exception) -> WorkerError:
    return worker_error(worker, batch, maker.current_index, type(e).__name__, str(e), traceback.format_exc(),
                        cls=type(e))


class InlineEngine:
    """num_workers=0: fetch and collate in the calling thread, like torch's single process."""

    def __init__(self, spec: WorkerSpec, tasks: Iterator | None, skip_batches: int = 0) -> None:
        self.maker = BatchMaker(spec)
        self.tasks = tasks
        self.batch = 0
        if tasks is None:
            self.maker.reset(skip_batches)

    def next(self) -> LoadedBatch:
        idx = next(self.tasks) if self.tasks is not None else None
        try:
            made = self.maker.make(idx)
        except Exception as e:
            self.batch += 1
            raise _wrap_error(self.maker, -1, self.batch - 1, e) from e  # made in the loader's own process
        if made is None:
            raise StopIteration
        self.batch += 1
        return LoadedBatch(made.batch, 0, made.fetch_s, made.collate_s, 0.0, 0.0, made.n_samples, made.cpu_s)

    def shutdown(self) -> None:
        pass


class ThreadEngine:
    """Worker threads: for transforms that release the GIL (decoders, numpy, torch ops).

    Map-style datasets use ``num_workers`` threads; an iterable dataset is read by one thread
    (its iterator cannot be shared), which still overlaps loading with training.
    """

    def __init__(self, spec: WorkerSpec, tasks: Iterator | None, num_workers: int, prefetch: int,
                 in_order: bool, skip_batches: int = 0, timeout_s: float = 0.0) -> None:
        self.spec, self.tasks, self.in_order, self.timeout_s = spec, tasks, in_order, timeout_s
        n = num_workers if tasks is not None else 1
        self.pool = cf.ThreadPoolExecutor(max_workers=n, thread_name_prefix="tpkit-data")
        self.depth = n * prefetch
        self.pending: collections.deque = collections.deque()
        self.hung = False  # a timed-out thread cannot be stopped; do not wait for it
        self.tasks_done = False
        self.batch = 0
        self._stream_maker = None
        self._lock = threading.Lock()
        self._ids: dict[int, int] = {}
        if tasks is None:
            self._stream_maker = BatchMaker(spec)
            self._stream_maker.reset(skip_batches)

    def _worker_id(self) -> int:
        ident = threading.get_ident()
        with self._lock:
            return self._ids.setdefault(ident, len(self._ids))

    def _make(self, bid: int, idx: Any) -> tuple:
        maker = self._stream_maker or BatchMaker(self.spec)
        w = self._worker_id()
        try:
            made = maker.make(idx)
        except Exception as e:
            raise _wrap_error(maker, w, bid, e) from e
        return made, w, perf_counter_ns()

    def _fill(self) -> None:
        while not self.tasks_done and len(self.pending) < self.depth:
            if self.tasks is not None:
                try:
                    idx = next(self.tasks)
                except StopIteration:
                    self.tasks_done = True
                    return
            else:
                idx = None
            self.pending.append(self.pool.submit(self._make, self.batch + len(self.pending), idx))

    def next(self) -> LoadedBatch:
        while True:
            self._fill()
            if not self.pending:
                raise StopIteration
            if self.in_order:
                fut = self.pending.popleft()
            else:
                done, _ = cf.wait(self.pending, timeout=self.timeout_s or None,
                                  return_when=cf.FIRST_COMPLETED)
                if not done:
                    self.hung = True
                    raise LoaderTimeoutError(f"no batch came from the loader threads for "
                                             f"{self.timeout_s} s; raise timeout= or look for a hang")
                fut = next(f for f in self.pending if f in done)
                self.pending.remove(fut)
            try:
                made, w, done_ns = fut.result(timeout=self.timeout_s or None)
            except cf.TimeoutError:
                self.hung = True
                raise LoaderTimeoutError(
                    f"no batch came from the loader threads for {self.timeout_s} s. Raise "
                    f"timeout= if a batch legitimately takes longer, or look for a hang in "
                    f"the dataset's __getitem__ / collate_fn.") from None
            self.batch += 1
            if made is None:  # the iterable stream ended
                self.tasks_done = True
                for f in self.pending:
                    f.cancel()
                self.pending.clear()
                raise StopIteration
            queue_wait_s = max(0.0, (perf_counter_ns() - done_ns) / 1e9)
            return LoadedBatch(made.batch, w, made.fetch_s, made.collate_s, queue_wait_s, 0.0, made.n_samples,
                               made.cpu_s)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=not self.hung, cancel_futures=True)
