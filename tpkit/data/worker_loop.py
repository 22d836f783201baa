"""What runs inside a worker process: fetch samples, collate, write into the ring, report.

Messages on the worker's pipe (small named tuples, never tensor data):

main -> worker  ``Task(batch_id, indices, slot)``   make this batch (``indices`` is None for an
                                                  iterable dataset: the next of this worker's stream);
                                                  on the pipe a plain tuple of the three
                a list of them                    make these batches, in order
                ``Reset(skip_batches)``           new epoch of an iterable dataset
                ``None``                          exit
worker -> main  ``BatchDone(batch_id, slot, gen, slot_bytes, skeleton, fetch_s, collate_s,
                  write_s, done_ns, n_samples, cpu_s)``  (``gen`` -1: the batch held no tensor, the
                                                  skeleton is all of it, the slot is unused);
                                                  on the pipe a plain tuple with the skeleton
                                                  pickled (``done_to_wire`` / ``done_from_wire``)
                ``StreamEnded(batch_id)``         the iterable stream is exhausted
                ``BatchFailed(batch_id, index, exc_type, message, traceback)`` (``batch_id`` -1:
                                                  worker_init_fn or the dataset's __iter__ failed)

Times are ``time.perf_counter`` (CLOCK_MONOTONIC on Linux: one clock for all processes),
so the main process can compute how long a finished batch waited (``done_ns``).
"""

from __future__ import annotations

import os
import pickle
import random
import select
import signal
import traceback
from dataclasses import dataclass
from time import perf_counter, perf_counter_ns, process_time, thread_time
from typing import Any, Callable, Iterator, NamedTuple

import numpy as np
import numpy.random  # noqa: F401 - seeding needs it; numpy loads it lazily, ~10 ms at the first batch
import torch
from torch.utils.data._utils.collate import default_collate

from .collate import deferred_collate, fast_default_collate
from .slots import WorkerRing

#: glibc malloc settings of a worker process (see ``steady_malloc``): blocks below this come from
#: the heap and are reused; the heap's free top is given back to the OS only past the second.
WORKER_MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024
WORKER_TRIM_THRESHOLD_BYTES = 64 * 1024 * 1024
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
_MALLOC_ENV = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")


def steady_malloc() -> str:
    """Fix glibc's mmap and trim thresholds in a worker process; returns what was done.

    A worker makes the same batch shape over and over. glibc adapts both thresholds as blocks
    are freed, and in some worker histories (measured: the worker forked after the in-process
    first batch, on 3x224x224 uint8 images) it ends up giving every batch's sample memory back
    to the OS when the batch is freed and taking it again, zero-filled, for the next: 848 page
    faults per batch in that worker and none in its sibling, which then idled waiting for it
    (15.5k samples/s; with fixed thresholds 21.0k, both workers busy, no faults). Fixed
    thresholds keep a worker's transient blocks below 32 MB on its heap for reuse, keeping at
    most 64 MB of free heap. Left alone where the user tuned malloc (``MALLOC_*_`` or
    ``GLIBC_TUNABLES`` in the environment) and where the C library is not glibc."""
    import ctypes
    import platform

    if any(k in os.environ for k in _MALLOC_ENV) or "malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return "left alone: malloc tuned in the environment"
    if platform.libc_ver()[0] != "glibc":
        return "left alone: not glibc"
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return "left alone: no mallopt"
    ok = mallopt(_M_MMAP_THRESHOLD, WORKER_MMAP_THRESHOLD_BYTES) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, WORKER_TRIM_THRESHOLD_BYTES) == 1 and ok
    return "fixed" if ok else "left alone: mallopt refused"


class Made(NamedTuple):
    """One batch as a ``BatchMaker`` made it."""

    batch: Any
    fetch_s: float
    collate_s: float
    n_samples: int
    cpu_s: float = 0.0  # the making thread's CPU time for it (fetch and collate): waiting is not CPU


class LoadedBatch(NamedTuple):
    """What every engine's ``next()`` hands to the loader: the batch, who made it and where its
    time went (the columns of ``run.loader``)."""

    batch: Any
    worker: int
    fetch_s: float
    collate_s: float
    queue_wait_s: float
    transfer_s: float
    n_samples: int
    cpu_s: float = 0.0  # CPU time the batch's making took (``Made.cpu_s``)


class Task(NamedTuple):
    """main -> worker: make batch ``batch_id`` into ``slot``."""

    batch_id: int
    indices: Any  # None for an iterable dataset
    slot: int


class Reset(NamedTuple):
    """main -> worker: a new epoch of an iterable dataset, skipping this many batches."""

    skip_batches: int


class BatchDone(NamedTuple):
    """worker -> main: a batch is in its slot; the skeleton says where each tensor lies."""

    batch_id: int
    slot: int
    gen: int  # ring generation; -1 when the batch held no tensor (nothing in the slot)
    slot_bytes: int
    skeleton: Any
    fetch_s: float
    collate_s: float
    write_s: float
    done_ns: int
    n_samples: int
    cpu_s: float = 0.0


#: A worker's skeletons already pickled, by identity: id -> (skeleton, its pickle bytes). A slot
#: that kept its layout (``slots.WorkerRing._plan``) sends the same skeleton object again.
_PICKLED_SKELETONS: dict[int, tuple[Any, bytes]] = {}
#: Skeletons kept at most (then the cache starts again), and the largest pickle kept (a skeleton
#: with large pickled objects in it is not worth holding on to).
PICKLED_SKELETONS_KEPT, PICKLED_SKELETON_MAX_BYTES = 64, 1024


def done_to_wire(done: BatchDone) -> bytes:
    """A finished batch's answer as the worker writes it: a plain tuple (no class to look up
    when it is read) whose skeleton is pickle bytes of its own, which the main process reads
    once per distinct layout (``done_from_wire``): a batch of fixed layout has the same
    skeleton every time, and unpickling it cost ~4 us of the ~6 us an answer took to read
    (when its placeholders were objects; slots.py's skeletons are plain tuples since). The
    worker pickles a skeleton object once (``_PICKLED_SKELETONS``)."""
    skel = done.skeleton
    kept = _PICKLED_SKELETONS.get(id(skel))  # each is held here: no other object has its id
    if kept is not None:
        raw = kept[1]
    else:
        raw = pickle.dumps(skel, pickle.HIGHEST_PROTOCOL)
        if len(raw) <= PICKLED_SKELETON_MAX_BYTES:
            if len(_PICKLED_SKELETONS) >= PICKLED_SKELETONS_KEPT:
                _PICKLED_SKELETONS.clear()
            _PICKLED_SKELETONS[id(skel)] = (skel, raw)
    return pickle.dumps((*done[:4], raw, *done[5:]), pickle.HIGHEST_PROTOCOL)


#: Distinct skeletons the main process keeps per pool (``done_from_wire``).
SKELETONS_KEPT = 64


def done_from_wire(msg: Any, skeletons: dict[bytes, Any]) -> Any:
    """What ``conn.recv()`` returned, with a finished batch's plain tuple made a ``BatchDone``
    again (other messages are returned as they are). ``skeletons``: pickle bytes -> skeleton,
    the caller's cache (a skeleton is only read: ``slots.unflatten`` builds new containers)."""
    if type(msg) is not tuple:
        return msg
    raw = msg[4]
    skel = skeletons.get(raw)
    if skel is None:
        if len(skeletons) >= SKELETONS_KEPT:
            skeletons.clear()
        skel = skeletons[raw] = pickle.loads(raw)
    return BatchDone(msg[0], msg[1], msg[2], msg[3], skel, msg[5], msg[6], msg[7], msg[8], msg[9], msg[10])


class BatchFailed(NamedTuple):
    """worker -> main: the dataset or collate_fn raised; the worker's traceback as text."""

    batch_id: int  # -1: the worker failed while starting
    index: Any
    exc_type: str
    message: str
    traceback: str


class StreamEnded(NamedTuple):
    """worker -> main: this worker's share of the iterable dataset is exhausted."""

    batch_id: int


def failed(batch_id: int, index: Any, e: BaseException) -> BatchFailed:
    """The message that reports ``e`` (call inside the ``except`` block: it reads the traceback)."""
    return BatchFailed(batch_id, index, type(e).__name__, str(e), traceback.format_exc())


@dataclass
class WorkerSpec:
    """Everything a worker needs; handed over at fork (or pickled once under spawn)."""

    dataset: Any
    iterable: bool
    auto_collate: bool  # False when batch_size is None: one sample per "batch"
    batch_size: int
    drop_last: bool
    collate_fn: Callable
    num_workers: int
    base_seed: int
    worker_init_fn: Callable | None
    seg_prefix: str
    n_slots: int
    parent_pid: int


def seed_worker(base_seed: int, worker: int, in_main: bool = False) -> int:
    """Seed Python, torch and numpy in a worker as torch's DataLoader seeds its workers
    (numpy from torch's own seed-state generator where this torch has it); returns the torch
    seed (base + id).

    ``in_main``: the batch is made in the main process (the in-process first batch), whose
    random states are saved before and restored after (``get_rng_states``): only the CPU
    generator is seeded, since ``torch.manual_seed`` would also seed every GPU's generator
    (or queue that seed until CUDA starts), which no restore undoes: the training loop's
    dropout on the GPU would draw from the loader's seed."""
    seed = base_seed + worker
    random.seed(seed)
    if in_main:
        torch.default_generator.manual_seed(seed)
    else:
        torch.manual_seed(seed)
    try:
        from torch.utils.data._utils.worker import _generate_state
        np_seed = _generate_state(base_seed, worker)
    except (ImportError, AttributeError):  # a torch without it: still a per-worker stream
        np_seed = np.random.SeedSequence([base_seed & (2**63 - 1), worker]).generate_state(4)
    np.random.seed(np_seed)
    return seed


RngStates = tuple[Any, Any, Any]  # (torch, numpy, random) global random states


def get_rng_states() -> RngStates:
    """This process's global random states (torch CPU, numpy, Python's random)."""
    return torch.get_rng_state(), np.random.get_state(), random.getstate()


def set_rng_states(states: RngStates) -> None:
    """Restore what ``get_rng_states`` returned."""
    t, n, r = states
    torch.set_rng_state(t)
    np.random.set_state(n)
    random.setstate(r)


def set_worker_info(worker: int, num_workers: int, seed: int, dataset: Any, method: str) -> None:
    """Make ``torch.utils.data.get_worker_info()`` work in our workers (datasets shard by it)."""
    try:
        from torch.utils.data._utils import worker as _tw
        _tw._worker_info = _tw.WorkerInfo(id=worker, num_workers=num_workers, seed=seed,
                                          dataset=dataset)
    except Exception:  # a torch without this private hook: sharding datasets see None
        pass


class BatchMaker:
    """Fetch + collate one batch from a map-style or iterable dataset, timing both."""

    def __init__(self, spec: WorkerSpec, in_ring: bool = False) -> None:
        self.spec = spec
        # the CPU a batch's making takes: a worker process's every thread (a transform's own thread
        # pool: OpenCV, OpenMP), a thread's own elsewhere (the main process's other threads train)
        self._cpu_clock = process_time if in_ring else thread_time
        self._it: Iterator[Any] | None = None
        self.current_index: Any = None
        self.drawn = 0  # samples taken from this worker's stream (iterable datasets)
        # In a process worker the default collate stacks straight into the slot; elsewhere it
        # is torch's, with numbers collated faster (collate.py).
        self.collate = spec.collate_fn
        if spec.collate_fn is default_collate:
            self.collate = deferred_collate if in_ring else fast_default_collate

    def reset(self, skip_batches: int = 0) -> None:
        self._it = iter(self.spec.dataset)
        self.drawn = 0
        for _ in range(skip_batches):
            if self._next_samples() is None:
                break

    def _next_samples(self) -> list | None:
        if self._it is None:
            self.reset()
        assert self._it is not None
        if not self.spec.auto_collate:
            try:
                self.current_index = f"sample {self.drawn} of this worker's stream"
                sample = next(self._it)
                self.drawn += 1
                return [sample]
            except StopIteration:
                return None
        out = []
        for _ in range(self.spec.batch_size):
            try:
                self.current_index = f"sample {self.drawn} of this worker's stream"
                out.append(next(self._it))
                self.drawn += 1
            except StopIteration:
                break
        if not out or (self.spec.drop_last and len(out) < self.spec.batch_size):
            return None
        return out

    def make(self, indices: Any, sized: Callable[[float, int], None] | None = None) -> Made | None:
        """One batch, or None when an iterable is exhausted. ``sized(sample_s, n)`` is called
        once during a map-style batch: the time its second sample took (the first may pay
        one-off costs: a file opened, a cache filled; a batch of one: that sample's time) and
        how many samples the batch has. Its own time is not counted as fetching."""
        t0, cpu0 = perf_counter(), self._cpu_clock()
        if self.spec.iterable:
            samples = self._next_samples()
            if samples is None:
                return None
        elif self.spec.auto_collate:
            samples = []
            ds = self.spec.dataset
            n = len(indices) if sized is not None else 0
            t_sample = t0
            for i in indices:
                self.current_index = i
                samples.append(ds[i])
                if sized is None:
                    continue
                if len(samples) < min(2, n):
                    t_sample = perf_counter()  # the first of two: the second is timed from here
                    continue
                t_cb = perf_counter()
                sized(t_cb - t_sample, n)
                t0 += perf_counter() - t_cb
                sized = None
        else:
            self.current_index = indices
            samples = [self.spec.dataset[indices]]
        t1 = perf_counter()
        self.current_index = None
        if self.spec.auto_collate:
            batch = self.collate(samples)
        else:
            batch = self.spec.collate_fn(samples[0])
        return Made(batch, t1 - t0, perf_counter() - t1, len(samples), self._cpu_clock() - cpu0)


def worker_main(worker: int, life: int, conn: Any, spec: WorkerSpec, skip_batches: int,
                rng_states: RngStates | None = None) -> None:
    """Entry point of a worker process. ``rng_states``: where this worker's random state
    starts when the main process made a batch in its place (see process_pool)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process owns Ctrl-C and our exit
    torch.set_num_threads(1)
    steady_malloc()
    seed = seed_worker(spec.base_seed, worker)
    if rng_states is not None:
        set_rng_states(rng_states)
    set_worker_info(worker, spec.num_workers, seed, spec.dataset, "multiprocessing")
    ring = WorkerRing(spec.seg_prefix, worker, life, spec.n_slots)
    maker = BatchMaker(spec, in_ring=True)
    try:
        if spec.worker_init_fn is not None:
            spec.worker_init_fn(worker)
        if spec.iterable:
            maker.reset(skip_batches)
    except Exception as e:
        conn.send(failed(-1, None, e))
        return
    exhausted = False
    # One poll object for the worker's life (Connection.poll builds a selector at every call).
    poller = select.poll()
    poller.register(conn.fileno(), select.POLLIN)
    while True:
        # Wake up now and then to notice a dead parent (its pipe end may stay open in siblings).
        while not poller.poll(1000):
            if os.getppid() != spec.parent_pid:  # orphaned: clean up after ourselves
                ring.close()
                ring.unlink()
                return
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            break
        if msg is None:
            break
        if isinstance(msg, Reset):
            exhausted = False
            try:
                maker.reset(msg.skip_batches)
            except Exception as e:
                conn.send(failed(-1, None, e))
            continue
        for task in (msg if type(msg) is list else (msg,)):  # a list: several tasks, in order
            exhausted = _do_task(task, maker, ring, conn, exhausted)
    ring.close()


def _do_task(task: tuple, maker: BatchMaker, ring: WorkerRing, conn: Any, exhausted: bool) -> bool:
    """Make one batch into its slot and answer; returns whether the iterable stream is over.
    ``task``: a ``Task``'s fields, as the pipe carries them (a plain tuple)."""
    batch_id, indices, slot = task
    if exhausted:
        conn.send(StreamEnded(batch_id))
        return True
    try:
        made = maker.make(indices)
        if made is None:
            conn.send(StreamEnded(batch_id))
            return True
        t0 = perf_counter()
        skel, gen, slot_bytes = ring.write(slot, made.batch)
        write_s = perf_counter() - t0
        done = BatchDone(batch_id, slot, gen, slot_bytes, skel, made.fetch_s,
                         made.collate_s, write_s, perf_counter_ns(), made.n_samples, made.cpu_s)
        del made  # the samples go now, not at the next batch
        # plain pickle (the skeleton holds plain values, tuples and type references): the
        # pipe's ForkingPickler costs ~5 us more per call
        conn.send_bytes(done_to_wire(done))
    except Exception as e:
        conn.send(failed(batch_id, maker.current_index, e))
        maker.current_index = None
    return False
