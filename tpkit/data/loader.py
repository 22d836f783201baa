"""``Loader``: a drop-in for torch's DataLoader with shared-memory slot rings, exact resume,
self-sizing workers and per-batch instrumentation.

Order and randomness follow torch's DataLoader for the same arguments: the same sampler
classes, the same draws from the same generator (``seed=s`` behaves like
``generator=torch.Generator().manual_seed(s)``), batch ``b`` made by worker ``b % W``, and
worker ``k`` seeded with ``base_seed + k``. So a deterministic dataset yields the same
batches in the same order, and so do random transforms that use torch's RNG.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterable
from time import perf_counter
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import BatchSampler, IterableDataset, RandomSampler, Sampler, SequentialSampler
from torch.utils.data._utils.collate import default_collate, default_convert

from tpkit.capture import recorder as _rec

from ..capture.interrupts import held_sigint
from ..capture.probes.batches import batch_identity
from .autotune import AutoProbe, choose_workers, initial_workers
from .engines import InlineEngine, ThreadEngine
from .errors import LoaderArgumentError, WorkerError
from .pinning import DevicePrefetcher, pin_batch, resolve_device
from .process_pool import ProcessPool
from .worker_loop import LoadedBatch, WorkerSpec

STATE_VERSION = 1


def _is_iterable_dataset(ds: Any) -> bool:
    if isinstance(ds, IterableDataset):
        return True
    return not hasattr(ds, "__getitem__") and isinstance(ds, Iterable)


def _sampler_rng(sampler: Any) -> torch.Generator | None:
    """The torch.Generator a sampler draws from, if it exposes one (RandomSampler does)."""
    for s in (sampler, getattr(sampler, "sampler", None)):
        g = getattr(s, "generator", None)
        if isinstance(g, torch.Generator):
            return g
    return None


#: Indices of a shuffled epoch turned into Python ints at a time (two torch calls per chunk
#: instead of per batch; ~300 KB of ints at most).
PERMUTATION_CHUNK = 8192


def permuted_batches(n: int, batch_size: int, drop_last: bool,
                     generator: torch.Generator | None) -> Iterator[list[int]]:
    """The batches ``BatchSampler(RandomSampler(range(n), generator=generator), batch_size,
    drop_last)`` yields, drawn from the generator as torch draws them: one ``randperm`` for the
    epoch and, when the sampler runs out, the second one torch's sampler draws and keeps none
    of (so the generator is where torch leaves it for the next epoch). Batches are sliced
    from the permutation tensor as they are asked for (``PERMUTATION_CHUNK`` indices made
    Python ints at a time), where torch's sampler turns the whole epoch into a Python list
    first: 36 bytes and ~20 ns an index (a 1.28M-sample epoch is a 46 MB list and ~25 ms
    before the first batch), here 8 bytes and one chunk up front."""
    if generator is None:  # as RandomSampler: a private generator seeded from the global RNG
        seed = int(torch.empty((), dtype=torch.int64).random_().item())
        generator = torch.Generator()
        generator.manual_seed(seed)
    perm = torch.randperm(n, generator=generator)
    full, rest = divmod(n, batch_size)
    per_chunk = max(1, PERMUTATION_CHUNK // batch_size)  # batches turned into Python ints at once
    for c in range(0, full, per_chunk):
        k = min(per_chunk, full - c)
        chunk = perm[c * batch_size:(c + k) * batch_size].tolist()
        for j in range(k):
            yield chunk[j * batch_size:(j + 1) * batch_size]
    torch.randperm(n, generator=generator)  # torch's sampler draws it when it runs out
    if rest and not drop_last:
        yield perm[full * batch_size:].tolist()


class Loader:
    """Batches from a map-style or iterable dataset, made by worker processes (or threads).

    Arguments are torch's DataLoader's, plus:
      prefetch: batches in flight per worker (torch's ``prefetch_factor``; default 2, and 8
        for batches of at most 256 KiB, whose rate the hand-over round trip limits).
      seed: shuffle/worker seeding from ``torch.Generator().manual_seed(seed)``; None draws
        from torch's global RNG like torch does.
      num_workers: an int, or "auto" (same as ``workers="auto"``): starts with
        ``initial_workers()`` (no trial delays the first batch), measures the first batches as
        the loop reads them and uses the count they call for from the next epoch on
        (``workers_reason`` says why); see tpkit/data/autotune.py.
      in_order: False hands out whichever batch is ready first (a slow sample does not block
        the batches behind it); the set of batches is the same.
      mode: "process" (default; shared-memory slots) or "thread".
      restart_workers: replace a worker that dies (signal, OOM kill) and re-send its batches.
      timeout: seconds to wait for one batch before raising LoaderTimeoutError (0: forever).
      device: with CUDA, copy batches to this device on a side stream, one batch ahead.
      main_helps: "auto" (default), True or False: with process workers, while the batch the
        loop needs next is not there, the main process makes the next unassigned batch itself
        (reported as worker -1). "auto" does so for cheap batches (<= 2 ms) of datasets that draw no random
        numbers from the global generators, so batches stay torch's; True always (batches made
        there draw from their own seeded stream); False never. See tpkit/data/main_help.py.
      fast_start: all workers make the epoch's first batch together (each a contiguous part,
        joined in the main process), so it arrives sooner when samples are expensive. Needs
        the default collate_fn and 2+ process workers. Samples are the same; random
        transforms in workers then draw from different worker RNG streams than torch's.
    """

    def __init__(self, dataset: Any, batch_size: int | None = 1, shuffle: bool | None = None,
                 sampler: Sampler | Iterable | None = None,
                 batch_sampler: Sampler | Iterable | None = None,
                 num_workers: int | str = 0, collate_fn: Callable | None = None,
                 pin_memory: bool = False, drop_last: bool = False, timeout: float = 0,
                 worker_init_fn: Callable[[int], None] | None = None,
                 multiprocessing_context: Any = None, generator: torch.Generator | None = None,
                 *, prefetch: int | None = None, prefetch_factor: int | None = None,
                 persistent_workers: bool = False, seed: int | None = None,
                 in_order: bool = True, mode: str = "process", restart_workers: bool = False,
                 workers: int | str | None = None, device: Any = None,
                 fast_start: bool = False, main_helps: bool | str = "auto") -> None:
        if workers is not None:
            num_workers = workers
        self._check_args(dataset, batch_size, shuffle, sampler, batch_sampler, num_workers,
                         drop_last, timeout, mode, prefetch, prefetch_factor, persistent_workers)
        self.dataset = dataset
        self.iterable = _is_iterable_dataset(dataset)
        self.auto_workers = num_workers == "auto"
        self.num_workers: int | str = initial_workers() if self.auto_workers else num_workers
        self.workers_reason = "workers='auto': starting count, not measured yet" if self.auto_workers else ""
        self._auto_probe: AutoProbe | None = None
        self.prefetch = prefetch or prefetch_factor or 2
        # default prefetch: small batches get a deeper queue (tpkit/data/process_pool.py)
        self.prefetch_default = prefetch is None and prefetch_factor is None
        self.drop_last, self.timeout = drop_last, float(timeout)
        self.worker_init_fn, self.multiprocessing_context = worker_init_fn, multiprocessing_context
        self.persistent_workers, self.in_order, self.mode = persistent_workers, in_order, mode
        self.restart_workers = restart_workers
        self.fast_start = fast_start
        if main_helps not in (True, False, "auto"):
            raise LoaderArgumentError(f"main_helps must be 'auto', True or False; got {main_helps!r}")
        self.main_helps = main_helps
        self.device, self.pin = resolve_device(device, pin_memory)
        self.pin_memory = pin_memory

        if seed is not None and generator is None:
            generator = torch.Generator().manual_seed(int(seed))
        self.generator = generator
        self.seed = seed

        self.sampler: Any
        self.batch_sampler: Any
        self.batch_size: int | None
        if batch_sampler is not None:
            self.batch_size, self.drop_last = None, False
            self.sampler = getattr(batch_sampler, "sampler", None)
            self.batch_sampler = batch_sampler
        elif self.iterable:
            self.batch_size, self.sampler, self.batch_sampler = batch_size, None, None
        else:
            if sampler is None:
                sampler = (RandomSampler(dataset, generator=generator) if shuffle
                           else SequentialSampler(dataset))
            self.sampler = sampler
            self.batch_size = batch_size
            self.batch_sampler = BatchSampler(sampler, batch_size, drop_last) if batch_size is not None else None
        self._shuffle_owned = bool(shuffle) and sampler is not None and isinstance(self.sampler, RandomSampler) \
            and self.sampler.generator is generator
        self.auto_collate = batch_sampler is not None or batch_size is not None
        self.collate_fn = collate_fn or (default_collate if self.auto_collate else default_convert)

        self._epoch = 0
        self._pool: ProcessPool | None = None
        self._resume: dict | None = None
        self._iter: weakref.ref | None = None
        self.base_seed: int | None = None

    # -- argument checks that say what to do ----------------------------------------------------
    @staticmethod
    def _check_args(dataset, batch_size, shuffle, sampler, batch_sampler, num_workers, drop_last,
                    timeout, mode, prefetch, prefetch_factor, persistent_workers) -> None:
        if batch_size is not None and (not isinstance(batch_size, int) or isinstance(batch_size, bool)
                                       or batch_size <= 0):
            raise LoaderArgumentError(f"batch_size must be a positive int (or None to hand out single samples); "
                             f"got {batch_size!r}")
        if isinstance(num_workers, str):
            if num_workers != "auto":
                raise LoaderArgumentError(f"num_workers must be an int >= 0 or 'auto'; got {num_workers!r}")
        elif not isinstance(num_workers, int) or num_workers < 0:
            raise LoaderArgumentError(f"num_workers must be an int >= 0 (0 loads in the main process) or "
                             f"'auto' to size it from measured rates; got {num_workers!r}")
        if mode not in ("process", "thread"):
            raise LoaderArgumentError(f"mode must be 'process' or 'thread'; got {mode!r}")
        for name, v in (("prefetch", prefetch), ("prefetch_factor", prefetch_factor)):
            if v is not None and (not isinstance(v, int) or v < 1):
                raise LoaderArgumentError(f"{name} must be an int >= 1 (batches in flight per worker); got {v!r}")
        if timeout < 0:
            raise LoaderArgumentError(f"timeout must be >= 0 seconds (0 waits forever); got {timeout!r}")
        if persistent_workers and num_workers == 0:
            raise LoaderArgumentError("persistent_workers=True needs num_workers > 0")
        if _is_iterable_dataset(dataset):
            if shuffle:
                raise LoaderArgumentError("shuffle=True does not apply to an iterable dataset: shuffle inside "
                                 "the dataset's __iter__ (or use a map-style dataset)")
            if sampler is not None or batch_sampler is not None:
                raise LoaderArgumentError("an iterable dataset takes no sampler or batch_sampler: it decides "
                                 "its own order; shard it with torch.utils.data.get_worker_info()")
        if batch_sampler is not None and (batch_size != 1 or shuffle or sampler is not None or drop_last):
            raise LoaderArgumentError("batch_sampler already decides batches: leave batch_size, shuffle, sampler "
                             "and drop_last at their defaults when you pass it")
        if sampler is not None and shuffle:
            raise LoaderArgumentError("pass either sampler= or shuffle=True, not both (the sampler decides order)")

    # -- sizes ----------------------------------------------------------------------------------
    def __len__(self) -> int:
        if self.iterable:
            n = len(self.dataset)  # TypeError if the dataset has no length, as with torch
            if self.batch_size is None:
                return n
            return n // self.batch_size if self.drop_last else -(-n // self.batch_size)
        return len(self.batch_sampler if self.batch_sampler is not None else self.sampler)

    @property
    def _index_sampler(self) -> Any:
        return self.batch_sampler if self.batch_sampler is not None else self.sampler

    def _index_batches(self) -> Iterator[Any]:
        """The epoch's batches of indices: ``permuted_batches`` where the sampler is torch's
        own shuffle of the whole dataset in torch's own batches (the same batches, drawn the
        same way), else the samplers themselves."""
        s, b = self.sampler, self.batch_sampler
        if (type(s) is RandomSampler and type(b) is BatchSampler and b.sampler is s
                and not s.replacement and s._num_samples is None and isinstance(b.batch_size, int)):
            return permuted_batches(len(s.data_source), b.batch_size, b.drop_last, s.generator)
        return iter(self._index_sampler)

    # -- epochs -----------------------------------------------------------------------------------
    def __iter__(self) -> "_LoaderIter":
        probe = self._auto_probe
        if self.auto_workers and probe is not None and probe.result is not None:
            n, self.workers_reason = probe.result
            if n != self.num_workers and self._pool is not None:
                self.close()  # persistent workers of the old count
            self.num_workers = n
            self._auto_probe = None  # measured once; the count stays
        old = self._iter() if self._iter is not None else None
        if old is not None:
            old._detach()
        resume, self._resume = self._resume, None
        try:
            it = _LoaderIter(self, resume)
        except BaseException:  # e.g. Ctrl-C while workers start: none may outlive it
            self.close()
            raise
        self._iter = weakref.ref(it)  # no cycle: dropping loader and iterator frees workers at once
        return it

    def _start_epoch(self, resume: dict | None) -> tuple[Iterator | None, int, dict]:
        """Fix this epoch's randomness; returns (task iterator, batches to skip, epoch plan)."""
        if resume is not None:
            self._epoch = resume["epoch"]
            base_seed = resume["base_seed"]
            rng_state = resume["sampler_rng_state"]
            skip = resume["batches_done"]
        else:
            self._epoch += 1
            fresh_workers = not self.persistent_workers or (self._pool is None and self._epoch == 1)
            base_seed = (int(torch.empty((), dtype=torch.int64).random_(generator=self.generator).item())
                         if fresh_workers or self.base_seed is None else self.base_seed)
            rng_state = None
            skip = 0
        self.base_seed = base_seed
        if self.iterable:
            return None, skip, {"epoch": self._epoch, "base_seed": base_seed, "sampler_rng_state": None}
        if self._shuffle_owned and self.generator is None:
            # What torch's RandomSampler does without a generator: seed a private one from the
            # global RNG. We own that generator so its state can be saved and restored.
            if rng_state is None:
                s = int(torch.empty((), dtype=torch.int64).random_().item())
                self.sampler.generator = torch.Generator().manual_seed(s)
            else:
                self.sampler.generator = torch.Generator()
        g = _sampler_rng(self._index_sampler)
        if g is not None:
            if rng_state is not None:
                g.set_state(rng_state)
            rng_state = g.get_state()
        tasks = self._index_batches()
        for _ in range(skip):
            next(tasks, None)
        return tasks, skip, {"epoch": self._epoch, "base_seed": base_seed, "sampler_rng_state": rng_state}

    def _spec_args(self, base_seed: int) -> dict:
        return dict(dataset=self.dataset, iterable=self.iterable, auto_collate=self.auto_collate,
                    batch_size=self.batch_size or 1, drop_last=self.drop_last,
                    collate_fn=self.collate_fn, base_seed=base_seed,
                    worker_init_fn=self.worker_init_fn)

    def _get_pool(self, base_seed: int) -> ProcessPool:
        if self._pool is None or self._pool.closed:
            ctx = self.multiprocessing_context
            if isinstance(ctx, str):
                import multiprocessing as mp
                ctx = mp.get_context(ctx)
            self._pool = ProcessPool(self._spec_args(base_seed), self._workers_int(), self.prefetch,
                                     self.in_order, self.restart_workers, self.timeout, ctx,
                                     deep_small=self.prefetch_default, main_helps=self.main_helps)
        return self._pool

    def close(self) -> None:
        """Stop the workers now (they also stop at the end of an epoch unless persistent,
        and when the loader is garbage-collected)."""
        with held_sigint():  # a Ctrl-C now would leave workers behind: it comes right after
            it = self._iter() if self._iter is not None else None
            if it is not None:
                it._detach()
            if self._pool is not None:
                self._pool.shutdown()
                self._pool = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # -- checkpointing ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Where the loader is: resuming from it yields exactly the batches not yet handed out."""
        it = self._iter() if self._iter is not None else None
        if it is None or it.finished:
            return {"version": STATE_VERSION, "epoch": self._epoch, "batches_done": 0,
                    "base_seed": self.base_seed, "sampler_rng_state": None, "fresh_epoch": True,
                    "generator_state": self.generator.get_state() if self.generator is not None else None,
                    "worker_batches": None, "next_worker": 0, "num_workers": self._workers_int()}
        return {"version": STATE_VERSION, **it.plan, "batches_done": it.batches_done,
                "fresh_epoch": False, "worker_batches": list(it.worker_batches),
                "next_worker": it.next_worker, "num_workers": self._workers_int()}

    def load_state_dict(self, state: dict) -> None:
        """Resume: the next ``iter(loader)`` continues the saved epoch at its next batch."""
        if state.get("version") != STATE_VERSION:
            raise LoaderArgumentError(f"loader state version {state.get('version')!r} is not {STATE_VERSION}")
        self.close()
        if state["fresh_epoch"]:  # between epochs: the next one draws what it would have drawn
            self._epoch = state["epoch"]
            self._resume = None
            if state.get("generator_state") is not None and self.generator is not None:
                self.generator.set_state(state["generator_state"])
            if self.persistent_workers:
                self.base_seed = state["base_seed"]
            return
        if self.iterable and state["num_workers"] != self._workers_int():
            raise LoaderArgumentError(f"this iterable-dataset state was saved with num_workers="
                             f"{state['num_workers']}; resume with the same worker count (each "
                             f"worker's stream is replayed to its position)")
        self._resume = dict(state)

    def _workers_int(self) -> int:
        return self.num_workers if isinstance(self.num_workers, int) else 0

    # -- autotune -------------------------------------------------------------------------------
    def autotune(self, max_workers: int | None = None, trial_batches: int = 24) -> int:
        """Measure batches/s with 0..max_workers workers on the first batches; keep the fastest
        (fewer workers when within 5%). Sets and returns ``num_workers``."""
        self.num_workers = choose_workers(self, max_workers or os.cpu_count() or 1, trial_batches)
        return self.num_workers


class _LoaderIter:
    """One epoch of a Loader; records into the active tpkit profile when there is one."""

    def __init__(self, loader: Loader, resume: dict | None) -> None:
        self.loader = loader
        self.finished = False
        tasks, skip, self.plan = loader._start_epoch(resume)
        self.batches_done = skip
        W = loader._workers_int()
        saved = resume.get("worker_batches") if resume else None
        self.worker_batches = list(saved) if saved else [0] * W  # iterables: where each stream is
        self.next_worker = resume["next_worker"] if resume else 0
        spec_args = loader._spec_args(self.plan["base_seed"])
        if W == 0:
            self.engine: Any = InlineEngine(WorkerSpec(**spec_args, num_workers=0, seg_prefix="",
                                                       n_slots=0, parent_pid=os.getpid()),
                                            tasks, skip_batches=skip)
        elif loader.mode == "thread":
            self.engine = ThreadEngine(WorkerSpec(**spec_args, num_workers=W, seg_prefix="", n_slots=0,
                                                  parent_pid=os.getpid()),
                                       tasks, W, loader.prefetch, loader.in_order, skip_batches=skip,
                                       timeout_s=loader.timeout)
        else:
            if not loader.persistent_workers and loader._pool is not None:
                loader._pool.shutdown()
                loader._pool = None
            pool = loader._get_pool(self.plan["base_seed"])
            if tasks is None:
                pool.begin_epoch(None, self.worker_batches, self.next_worker)
            else:
                split = (loader.fast_start and loader.auto_collate
                         and loader.collate_fn is default_collate)
                pool.begin_epoch(tasks, split_first=split)
            self.engine = pool
        self._prefetcher = DevicePrefetcher(loader.device) if loader.device is not None else None
        self._ahead: Any = None
        # workers="auto": the first epoch's batches are measured (see tpkit/data/autotune.py)
        self.auto_probe: AutoProbe | None = None
        if loader.auto_workers and loader.workers_reason.startswith("workers='auto': starting"):
            self.auto_probe = loader._auto_probe = AutoProbe(os.cpu_count() or 1, skip=2 + W * loader.prefetch)
        self.last_make_s = 0.0
        self._told: weakref.ref | None = None  # the profile told how this loader runs

    def _config(self) -> dict[str, Any]:
        """How this epoch's batches are made, for the profile's ``meta["loader"]``."""
        loader, W = self.loader, self.loader._workers_int()
        mode = "main process" if W == 0 else loader.mode
        out: dict[str, Any] = {"num_workers": W, "mode": mode, "batch_size": loader.batch_size,
                               "prefetch": loader.prefetch}
        if mode == "process":
            out["main_helps"] = loader.main_helps
        return out

    def __iter__(self) -> "_LoaderIter":
        return self

    def __del__(self) -> None:
        """An epoch left unfinished (``break``, an exception or a Ctrl-C in the loop's body drops
        the iterator): its workers and threads stop now, as torch's do, unless they are
        persistent (they then serve the next epoch, and go with ``loader.close()``)."""
        try:
            if not self.finished:
                self._end()
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass

    def _handed_all(self) -> bool:
        """Whether the epoch has handed out its every batch (the next read ends it, reading
        nothing); False where that is not known ahead (an iterable dataset's stream)."""
        if self.finished:
            return self._ahead is None
        try:
            return not self.loader.iterable and self.batches_done >= len(self.loader)
        except TypeError:
            return False

    def _detach(self) -> None:
        if not self.finished:
            self.finished = True
            if not isinstance(self.engine, ProcessPool):
                self.engine.shutdown()

    def _end(self) -> None:
        self.finished = True
        eng = self.engine
        with held_sigint():
            if isinstance(eng, ProcessPool):
                if not self.loader.persistent_workers:
                    eng.shutdown()
                    if self.loader._pool is eng:
                        self.loader._pool = None
            else:
                eng.shutdown()

    def _next_raw(self) -> LoadedBatch:
        try:
            return self.engine.next()
        except StopIteration:
            self._end()
            raise
        except Exception as e:
            # A failed batch is skipped and the epoch goes on (as in torch); a worker that died,
            # timed out or failed to start (worker_init_fn) leaves nothing to continue.
            if not isinstance(e, WorkerError) or e.batch < 0:
                self.loader.close()
            raise

    def _next_item(self) -> LoadedBatch:
        """The next batch with the host-side post-processing (pinning, async device copy)
        applied; with a device, ``batch`` is the copy's handle, finished by ``__next__``."""
        pf = self._prefetcher
        if pf is None:
            if self.finished:
                raise StopIteration
            item = self._next_raw()
            if self.loader.pin:
                t0 = perf_counter()
                batch = pin_batch(item.batch)
                item = item._replace(batch=batch, transfer_s=item.transfer_s + perf_counter() - t0)
            return item
        if self._ahead is None:  # first batch: start its copy now
            if self.finished:
                raise StopIteration
            raw = self._next_raw()
            self._ahead = raw._replace(batch=pf.start(raw.batch))  # staged: drop the slot views
        item, self._ahead = self._ahead, None
        if not self.finished:
            try:
                nxt = self._next_raw()
                self._ahead = nxt._replace(batch=pf.start(nxt.batch))  # one ahead, side stream
            except StopIteration:
                pass  # hand out the batch in hand; the next call stops
        return item  # __next__ finishes the copy, outside the data_wait span

    def __next__(self) -> Any:
        try:
            probe = self.auto_probe
            if probe is None:
                return self._next_batch()
            t0 = perf_counter()
            batch = self._next_batch()
            probe.record(t0, perf_counter(), self.last_make_s)
            if probe.result is not None:
                self.auto_probe = None
            return batch
        except (KeyboardInterrupt, SystemExit):  # Ctrl-C anywhere in here: stop the workers now
            self.loader.close()
            raise

    def _next_batch(self) -> Any:
        rec = _rec.active()
        pf = self._prefetcher
        if rec is None:
            item = self._next_item()
            if pf is not None:
                item = item._replace(batch=pf.finish(item.batch)[0])
        else:
            if rec.batch_coming is not None and not rec.is_open("data_wait"):
                rec.batch_coming()  # an update no optimizer hook saw ends its step here
            if rec.stop_pending is not None and not self._handed_all():
                rec.stop_before_read(id(self), id(self.loader))  # the slice is full: the loop stops here
            tok = None if rec.is_open("data_wait") else rec.enter("data_wait", "tpkit.data")
            try:
                item = self._next_item()
            finally:
                if tok is not None:
                    rec.exit(tok)
            if pf is not None:
                # The compute stream waits here for the copy started one batch ago; with CUDA
                # event timing this span shows the part of the copy that did not overlap.
                tok = None if rec.is_open("h2d") else rec.enter("h2d", "tpkit.data")
                try:
                    dev, wait_s = pf.finish(item.batch)
                finally:
                    if tok is not None:
                        rec.exit(tok)
                item = item._replace(batch=dev, transfer_s=item.transfer_s + wait_s)
            if self._told is None or self._told() is not rec:
                self._told = weakref.ref(rec)
                rec.loader_used(self._config())
                rec.source_loaders[id(self)] = id(self.loader)  # its batches' source is this epoch
            rec.handed_out(item.n_samples, source=id(self), ident=batch_identity(item.batch))
            rec.add_loader_batch(self.batches_done, item.worker, item.fetch_s, item.collate_s,
                                 item.queue_wait_s, item.transfer_s, item.cpu_s)
            if rec.batch_listeners and tok is not None:
                rec.yielded(item.batch)  # the memory probe counts the batch's tensors as data
        self.batches_done += 1
        self.last_make_s = item.fetch_s + item.collate_s
        if self.worker_batches and item.worker >= 0:  # -1: made in the main process (map-style)
            self.worker_batches[item.worker] += 1
            self.next_worker = (item.worker + 1) % len(self.worker_batches)
        return item.batch
