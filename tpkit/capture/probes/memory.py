"""The memory probe: bytes per category per device at every phase boundary, and each phase's
peak with the category mix at the peak's instant.

Categories (DESIGN.md, ``schema.MEMORY_CATEGORIES``): ``parameters, gradients, optimizer_state,
data`` are the *known sets*, identified from the tensors themselves (unique storages, so tied
weights and views count once); what the allocator holds beyond them is, at a forward/backward
boundary, ``activations`` (blocks allocated inside a forward, or between a forward and its
backward where the loss is made: what forward saved), ``temporaries`` (blocks allocated inside
backward: autograd buffers, gradients in flight before they reach ``.grad``) and ``other``
(blocks allocated anywhere else: an EMA copy of the weights, a state_dict copied for a
checkpoint, SAM's perturbation; and model buffers), and at any other boundary ``other``. On a
CUDA device, where blocks are not followed one by one, ``other`` is what was held when the
forward began. tpkit's own tensors (``Recorder.own_tensors``) count nowhere.

Off the hot path (issue 14). A phase boundary costs a timestamp and, on the CPU, one marker
that cuts the allocation stream there. With tpkit's counter it is an event written into the
counter's list (an odd address no block has, an odd size), and the counter itself is the phase
listener: one C call notes the boundary and writes its marker, and the probe's Python runs only
where it has more to do (``_at_boundary``: the look after a backward pass, a new model, a CUDA
device, a boundary the counter does not record). Between two looks at the gradients the counter
answers the looks after a backward pass itself while nothing they read changed (the registries'
sizes, each optimizer's states and groups, each CPU parameter's ``requires_grad``:
``_let_counter_answer``). With torch's stream the marker is the free
of a small storage allocated ahead of time (for the slice's steps when the stream starts, then
``MARKER_POOL`` at once when the last is used), whose address and odd size are known. No
Python loop over parameters runs there, and the hot path keeps only ints and strings in flat
lists (nothing the gc tracks). The known sets are *observed* now and then: gradients at the
first optimizer (or forward) boundary after the first ``GRAD_LOOKS_FIRST`` backward passes and
then after every ``GRAD_LOOK_EVERY``-th, parameters and buffers when the model set changes
(or, found at a look at the gradients, a parameter's ``.data`` was replaced: ``model.half()``),
optimizer state when its cheap fingerprint changes, each batch when a loader hands it out, and once at the end; each
observation is a marker too. After the slice the stream is replayed twice: pass 1 gives every
block allocated in the slice a category from the observations that found it alive (a known
storage counts from its allocation; a gradient of a CPU parameter of at least
``GRAD_HOOK_MIN_BYTES`` from its post-accumulate-grad hook, before which it is a temporary; the
gradients of a backward pass not looked after are the blocks alive at its end that follow the
last look's pattern of sizes), pass 2 keeps running totals per category and snapshots them at
every boundary and at the highest instant between two boundaries. Storages from before the
slice have no free event in the stream (torch's CPU allocator reports none): a gradient first
seen gets a weakref that puts a marker in the stream when it dies; any other such storage ends
when its address comes back in the stream (a batch made outside it: when the next batch comes).

How the allocator is read:

- CPU, by default: tpkit's allocation counter (``allocator_counter.py``), a C++ allocator in
  front of torch's CPU allocator that lists ``(address, bytes)`` of every allocation and free
  of the loop's thread while the slice runs, for less than the profiler's report below costs
  (on 2-layer GPT-2 Trainer and Lightning steps the default read 1.04x with it, 1.052x with the
  stream; docs/OVERHEAD.md). Built the first time it is needed; where it cannot be built, or on a
  machine with an accelerator, or with ``TPKIT_CPU_ALLOCATIONS=stream``, the stream below.
- CPU, the stream: torch's CPU allocator tells the profiler about every allocation and free when memory
  profiling is on. We switch on *only that*: the profiler runs with ``profile_memory=True`` and
  its op callbacks restricted to a record scope that no op uses, so no op events are kept.
  RecordFunction is switched off in the loop's thread while the stream runs: torch's autograd
  engine sets its thread-local state around every backward node, and with the session's
  callback registered each set rebuilt the callback cache of every scope (1.5% of a 2-layer
  GPT-2 Trainer's step, docs/OVERHEAD.md). Memory reports do not go through RecordFunction.
  Any torch profiler started while it is off (torch.profiler, tpkit's ops probe) switches it
  back on first, so that profiler sees every op; the stream's end switches it back on.
- CUDA: ``torch.cuda.memory_allocated`` / ``max_memory_allocated`` at each boundary, for the
  devices holding tensors the probe has seen only (not every visible device), and the known
  sets walked from the tensors there (the CUDA path still walks per boundary). A stretch's
  peak comes from the caching allocator's own reports in the stream above (it reports every
  allocation and free with the device's level, and the replay takes the highest in each
  stretch: ``_stream_cuda_peaks``); where they did not cover a stretch, from the peak counter,
  which is process-global and never reset: exact when it rose during the stretch (a new high
  for the process), otherwise the higher of the stretch's two boundary levels, said as a lower
  bound. The mix at a CUDA peak takes the known sets of the higher boundary (``approximate_mix`` in
  ``run.meta["memory"]``). ``--memory-detail`` records the allocator history and keeps the
  largest allocations alive at the peak, with their stacks; a history that was already
  recording is read and left on, and tpkit switches off only the one it started.

Limits, said plainly: allocations made in other threads are not in the CPU stream (a loader
thread's batch counts as ``data`` from when it is handed out; a training loop in another thread
gets the known sets walked at its boundaries, and no rest); a gradient of a CPU parameter
under ``GRAD_HOOK_MIN_BYTES`` counts as ``gradients`` from its allocation, a few microseconds
before it reaches ``.grad``. The stream is a profiler session: with a ``torch.profiler`` already
running, only the known sets are counted, walked at every boundary (the user's session is left
alone); one started inside the slice ends the stream, which is noted, and the known sets are
walked from then on.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import functools
import operator
import os
import sys
import weakref
from collections import UserDict
from collections.abc import Mapping
from dataclasses import dataclass
from threading import get_ident
from time import perf_counter_ns
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.optim.optimizer as _optim
from torch.autograd import profiler as _autograd_profiler

from ...schema import (
    CPU_SOURCE_COUNTER,
    CPU_SOURCE_KNOWN_SETS,
    CPU_SOURCE_STREAM,
    ENV_CPU_ALLOCATIONS,
    KNOWN_MEMORY_CATEGORIES,
    MEMORY_CATEGORIES,
    MIB,
)
from ..recorder import Recorder, WeakRegistry
from . import allocator_counter
from .allocator_counter import CpuAllocatorCounter
from .batches import held_values, stored_tensors
from .compiling import compiling
from .offload import deepspeed_gradient_tensors
from .patching import Patches
from .phases import has_accelerator

#: Phases during which what the allocator holds beyond the known sets is called activations.
ACTIVATION_PHASES: frozenset[str] = frozenset({"forward", "backward"})
#: Phases whose start ends the stretch after a forward in which the loss is made (on the CPU, a
#: block allocated in a forward or in that stretch is an activation; anywhere else, ``other``).
_ENDS_LOSS_GAP: frozenset[str] = frozenset({"backward", "optimizer", "data_wait", "save", "offload"})

#: Marker allocations are storages of an odd size in [MARKER_BASE_BYTES, +2 * (MARKER_SIZES - 1)]:
#: no float, half or int64 tensor has an odd byte size, and the marker's address and order are
#: checked too. Under 1024 bytes with torch's 64-byte alignment, so glibc serves a marker from
#: its small bins: a larger request first consolidates every small chunk freed so far, which
#: right after a backward pass cost 60-70 us (GPT-2, 12 layers) where a small one costs ~20.
MARKER_BASE_BYTES = 513
MARKER_SIZES = 192
#: Markers are allocated this many at a time and each freed at its boundary: a boundary costs
#: one free, not an allocation and a free. An allocation right after a backward pass took
#: ~21 us (GPT-2, 2 layers; cold caches, glibc's bins refilled from what the backward freed), the
#: free of a storage made earlier ~6 us (docs/OVERHEAD.md). The pool's storages are tpkit's: the
#: replay leaves their allocations out.
MARKER_POOL = 32
#: Markers made when the stream starts, before the slice's first step, for the steps the slice
#: was asked for: a 2-layer GPT-2 Trainer step has ~12 boundaries, and a pool of 32 made inside
#: the steps cost ~92 us every ~3 steps there (a third of the probe's own time). At most
#: ``MARKERS_AHEAD_MAX`` (~1.6 MB of small storages); a longer slice refills as above.
MARKERS_PER_STEP_AHEAD = 16
MARKERS_AHEAD_MAX = 2048
#: Allocator history entries kept with ``--memory-detail`` (CUDA ring buffer).
HISTORY_ENTRIES = 200_000
TOP_AT_PEAK = 10


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """Send C-level writes to fd 2 to /dev/null for the block: kineto announces every
    profiler start and stop there, and ipykernel forwards fd 2 into the notebook."""
    fd = 2  # C++ writes to fd 2 itself (ipykernel pipes fd 2 into the notebook; its
    # sys.stderr.fileno() is a copy of the terminal's, so silencing that would miss them)
    try:
        saved = os.dup(fd)
    except OSError:
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
        yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)
        os.close(devnull)


def rest_category(phase: str) -> str:
    """What the allocator holds beyond the known sets is called, at a boundary of ``phase``
    (blocks allocated inside backward are ``temporaries`` there instead)."""
    return "activations" if phase in ACTIVATION_PHASES else "other"


# -- allocator backends ----------------------------------------------------------------------

def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage holds ``t``'s bytes on this process: a DTensor's (FSDP2's) local
    shard, ``t`` itself otherwise. A DTensor's own storage is not real memory."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t

def _parts(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors whose storages hold ``t``'s bytes: ``t`` itself, or a sparse tensor's indices
    and values (a sparse tensor has no storage of its own: ``nn.Embedding(sparse=True)``'s
    gradients had read 0 bytes, their memory ``other``)."""
    layout = t.layout
    if layout is torch.strided:
        return (t,)
    if layout is torch.sparse_coo:
        return (t._indices(), t._values())
    if layout in (torch.sparse_csr, torch.sparse_bsr):
        return (t.crow_indices(), t.col_indices(), t.values())
    if layout in (torch.sparse_csc, torch.sparse_bsc):
        return (t.ccol_indices(), t.row_indices(), t.values())
    return (t,)


def _unsharded_flat(flat_param: Any) -> list[tuple[int, int]]:
    """(address, bytes) of an FSDP1 FlatParameter's padded unsharded copies whose storage is
    allocated now: the one forward and backward use, and the full-precision one
    ``summon_full_params`` gathers under parameter mixed precision. Freed, a storage has 0 bytes."""
    out = []
    for name in ("_full_param_padded", "_full_prec_full_param_padded"):
        t = getattr(flat_param, name, None)
        if isinstance(t, torch.Tensor) and t.is_cpu:
            s = t.untyped_storage()
            if s.nbytes():
                out.append((s.data_ptr(), s.nbytes()))
    return out


def _addresses(tensors: list[torch.Tensor]) -> list[int]:
    """``data_ptr()`` of each tensor (-1 where it has none to read: a sparse or fake one)."""
    try:
        return [t.data_ptr() for t in tensors]
    except Exception:
        out = []
        for t in tensors:
            try:
                out.append(t.data_ptr())
            except Exception:
                out.append(-1)
        return out


class CpuAllocatorStream:
    """CPU allocations and frees as torch's profiler sees them, with no op events, and
    RecordFunction off in the starting thread while it runs (see the module docstring)."""

    #: (the stream learns of another profiler from torch's flag; the counter's own attribute)
    stopped_by_profiler = False

    def __init__(self) -> None:
        self.active = False
        self._off_in: int | None = None  # the thread where tpkit switched RecordFunction off
        self._patches = Patches()
        #: events torch's profiler recorded in the last session (every device's allocations and
        #: frees): each one was paid for inside the loop's own phases (docs/OVERHEAD.md)
        self.events_seen = 0
        #: the CUDA allocator's reports in the last session (``allocations``' second list)
        self.cuda_levels: list[tuple[int, int, int]] = []

    def _record_functions_on(self) -> None:
        """RecordFunction back on, when called in the thread where it was switched off (the
        flag is per thread)."""
        if self._off_in is not None and self._off_in == get_ident():
            torch._C._autograd._enable_record_function(True)
            self._off_in = None

    def _switch_record_functions_off(self) -> None:
        # a profiler starting now sees every op
        allocator_counter.before_profiler_starts(self._patches, self._record_functions_on)
        torch._C._autograd._enable_record_function(False)
        self._off_in = get_ident()

    def start(self) -> None:
        from torch._C._profiler import ProfilerActivity, RecordScope
        from torch.autograd.profiler import (
            ProfilerConfig,
            ProfilerState,
            _disable_profiler,
            _enable_profiler,
            _ExperimentalConfig,
            _prepare_profiler,
        )

        if torch._C._autograd._profiler_enabled():
            # starting a second session would end the user's without a word
            raise RuntimeError("a torch profiler is already running")
        cfg = ProfilerConfig(ProfilerState.KINETO, False, True, False, False, False, _ExperimentalConfig())
        activities = {ProfilerActivity.CPU}
        scopes = {RecordScope.LITE_INTERPRETER}  # no aten op runs in this scope: no op events
        with quiet_stderr():  # kineto prints "USDT ... profiler_start" on fd 2
            _prepare_profiler(cfg, activities)
            _enable_profiler(cfg, activities, scopes)  # type: ignore[call-arg]  # torch's stub lacks scopes
        self._disable = _disable_profiler
        self.active = True
        self._switch_record_functions_off()

    def stop(self) -> list[tuple[int, int]]:
        """``(ptr, bytes)`` of every CPU allocation (bytes > 0) and free (< 0), in time order."""
        self._record_functions_on()
        self._patches.restore()
        if not self.active:
            return []
        self.active = False
        if not torch._C._autograd._profiler_enabled():
            raise RuntimeError("another profiler started and stopped during the slice and ended "
                               "tpkit's allocator stream with it")
        with quiet_stderr():
            result = self._disable()
        events = result.experimental_event_tree()
        self.events_seen = len(events)
        cpu, self.cuda_levels = allocations(events)
        return cpu


def allocations(events: list[Any]) -> tuple[list[tuple[int, int]], list[tuple[int, int, int]]]:
    """What a profiler result's allocator events say, in time order: ``(ptr, bytes)`` of every
    CPU allocation (bytes > 0) and free (< 0); and for each report of the CUDA caching
    allocator, ``(position, device index, total_allocated)``: the report came after
    ``position`` of the CPU events, and ``total_allocated`` is the device's allocated bytes
    the allocator reported with it (its level at that event: ``MemoryProbe._stream_cuda_peaks``).

    The stream holds allocator events only (~800 a step of a 2-layer GPT-2), so a stream of
    CPU events alone is read with three C-level passes (1.3 s -> 0.6 s for 480k events here);
    one with another device's events, or an event of another kind (an out-of-memory report has
    no ``ptr``), is read event by event."""
    ts = [ev.start_time_ns for ev in events]
    if any(a > b for a, b in zip(ts, ts[1:])):  # one thread's events come in order: no sort
        events = [events[k] for k in sorted(range(len(events)), key=ts.__getitem__)]
    fields = [ev.extra_fields for ev in events]
    cpu = torch.device("cpu")
    try:
        out = [(p, n) for p, n, d in map(_ALLOC_FIELDS, fields) if d == cpu]
        if len(out) == len(fields):
            return out, []
    except AttributeError:
        pass
    out, cuda = [], []
    for f in fields:
        size = getattr(f, "alloc_size", None)
        dev = getattr(f, "device", None)
        if size is None or getattr(f, "ptr", None) is None or dev is None:
            continue
        if dev.type == "cpu":
            out.append((int(f.ptr), int(size)))
        elif dev.type == "cuda":
            cuda.append((len(out), dev.index or 0, int(f.total_allocated)))
    return out, cuda


_ALLOC_FIELDS = operator.attrgetter("ptr", "alloc_size", "device")


def cpu_allocation_source() -> tuple[CpuAllocatorStream | CpuAllocatorCounter, str | None]:
    """Where a slice's CPU allocations come from, and what the run should say about it (or
    None): tpkit's allocation counter, built the first time it is needed
    (``allocator_counter.py``); torch's profiler stream on a machine with an accelerator (its
    caching allocator reports only there), when ``TPKIT_CPU_ALLOCATIONS=stream`` asks for it,
    or when the counter cannot be built (the run then says why and what it costs)."""
    want = os.environ.get(ENV_CPU_ALLOCATIONS, "counter").strip().lower()
    if want not in ("counter", "stream"):
        raise ValueError(f"{ENV_CPU_ALLOCATIONS}={want!r}: use 'counter' (the default) or 'stream'")
    if want == "stream" or has_accelerator():
        return CpuAllocatorStream(), None
    ext, why, build_s = allocator_counter.load()
    if ext is None:
        return CpuAllocatorStream(), (
            f"CPU memory was counted from torch's profiler stream, which costs a short step more than "
            f"tpkit's CPU allocation counter (on a 2-layer GPT-2 Trainer step the default profile read "
            f"1.052x with the stream, 1.040x with the counter): the counter could not be built ({why}). "
            f"It needs a C++ compiler and ninja (pip install ninja); {ENV_CPU_ALLOCATIONS}=stream "
            f"uses the stream without trying")
    if build_s >= allocator_counter.BUILT_AFTER_S:
        return CpuAllocatorCounter(ext), (f"tpkit built its CPU allocation counter before the slice "
                                          f"({build_s:.1f} s, once per torch version and tpkit install)")
    return CpuAllocatorCounter(ext), None


class CudaAllocator:
    """The CUDA caching allocator's counters; every call here is free of syncs and leaves the
    process-global state as it was: the peak counter is never reset (a user's
    ``max_memory_allocated()`` reads the same as without tpkit) and a history the user started
    is never switched off."""

    _available: bool | None = None

    def available(self) -> bool:
        if self._available is None:
            self._available = torch.cuda.is_available()
        return self._available

    def read(self, index: int) -> tuple[int, int]:
        """(bytes allocated now, the process's peak so far); nothing is reset. One call to the
        allocator's nested stats: ``torch.cuda.memory_allocated`` and ``max_memory_allocated``
        each build that dict and then flatten and sort its ~150 entries in Python, and tpkit
        reads at every phase boundary (an H200's GPT-2-small slice spent 0.4-0.5 ms of tpkit's
        own time per boundary there: docs/GPU_RUNS.md)."""
        alloc = torch.cuda.memory_stats_as_nested_dict(index).get("allocated_bytes", {}).get("all", {})
        return int(alloc.get("current", 0)), int(alloc.get("peak", 0))

    def capacity(self, index: int) -> int:
        return int(torch.cuda.get_device_properties(index).total_memory)

    def history_running(self) -> bool:
        """Whether an allocator history is recording now (someone else's: tpkit's own is
        started only when none runs). Asked of the allocator where torch's CUDA build says
        (``_cuda_isHistoryEnabled``); else a recording history is seen by the entries it left
        in the snapshot's device traces, which misses one started since the last allocation
        (on an H200 that switched the user's history off: docs/GPU_RUNS.md)."""
        enabled = getattr(torch._C, "_cuda_isHistoryEnabled", None)
        if enabled is not None:
            try:
                return bool(enabled())
            except RuntimeError:  # no CUDA allocator to ask
                pass
        snap = torch.cuda.memory._snapshot()
        return any(snap.get("device_traces") or [])

    def start_history(self) -> None:
        torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                                 max_entries=HISTORY_ENTRIES)

    def snapshot(self) -> dict:
        return torch.cuda.memory._snapshot()

    def stop_history(self) -> dict:
        """The snapshot, then the history off: only for a history tpkit started."""
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        return snap


def top_allocations_at_peak(trace: Iterable[dict], n: int = TOP_AT_PEAK, frames: int = 6) -> dict:
    """Replay one device's allocator trace (``torch.cuda.memory._snapshot()['device_traces'][i]``)
    and return the largest allocations alive at its peak: ``{"peak_bytes", "allocations":
    [{"bytes", "stack"}, ...]}``. Only allocations made while the history was recorded count."""
    live: dict[int, tuple[int, list]] = {}
    total = peak = 0
    at_peak: dict[int, tuple[int, list]] = {}
    for entry in trace:
        action, addr = entry.get("action"), int(entry.get("addr") or 0)
        if action == "alloc":
            live[addr] = (int(entry.get("size", 0)), entry.get("frames") or [])
            total += live[addr][0]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif action in ("free_requested", "free_completed") and addr in live:
            total -= live.pop(addr)[0]
    top = sorted(at_peak.values(), key=lambda a: -a[0])[:n]
    return {"peak_bytes": peak, "allocations": [
        {"bytes": size, "stack": [f"{f.get('filename', '?')}:{f.get('line', '?')} {f.get('name', '?')}"
                                  for f in stack[:frames]]}
        for size, stack in top]}


def host_capacity_bytes() -> int | None:
    """The host's physical memory in bytes, or None when it cannot be read."""
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except Exception:  # psutil missing or unreadable: fall back to sysconf
        try:
            import os

            return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        except (ValueError, OSError, AttributeError):
            return None


# -- the probe -------------------------------------------------------------------------------
#: Marker kinds in the CPU stream: a phase boundary, an observation of the known sets, a
#: parameter's gradient being stored in ``.grad`` (its post-accumulate hook).
_BOUND, _OBS, _GRAD_SET, _GONE = 0, 1, 2, 3
#: The gradients are alive at the first enter of one of ``_LOOK_AT`` after an exit of ``_LOOK_AFTER``.
_LOOK_AFTER, _LOOK_AT = "backward", ("optimizer", "forward")
#: In an observation, the slot of a ``data`` storage watched from there on (a worker's batch in
#: shared memory: its end is a ``_GONE`` marker); others have -1. Said in the observation itself,
#: as of when the batch was seen: a watched batch dies, and its address comes back for the next.
_WATCHED = -2
#: With tpkit's counter, the counter is the phase listener (``allocator_counter.cpp``): a boundary
#: is one C call. False puts the probe's Python listener (``_on_phase``, as with torch's stream)
#: in its place: the peer ``benchmarks/overhead.py`` measures it against.
BOUNDARIES_IN_COUNTER = True
#: CPU parameters at least this large get a post-accumulate-grad hook, so that their gradient
#: counts as ``gradients`` from the instant it is stored in ``.grad`` (before that it is an
#: autograd temporary in flight). Smaller ones count from their allocation, microseconds
#: earlier: the mix is off by at most their bytes for that window. The hook and its marker cost
#: ~5-20 us per parameter per backward, negligible beside a 1 MiB gradient's own computation
#: (hooking every GPT-2 weight cost ~1 ms per step at 12 layers, twice the rest of the probe).
GRAD_HOOK_MIN_BYTES = MIB
#: Gradients are looked at after each of the first GRAD_LOOKS_FIRST backward passes, then after
#: every GRAD_LOOK_EVERY-th; in between, the replay finds them by the pattern of the last look.
#: A look at a 2-layer GPT-2's ~30 gradients took 106 us (median; 200 mean): every 8th step that
#: was a fifth of the probe's own time per step, every 16th a tenth.
GRAD_LOOKS_FIRST, GRAD_LOOK_EVERY = 3, 16
#: Every look after a backward pass reads whether the parameters frozen before are still frozen;
#: every TRAINABLE_FULL_EVERY-th reads every parameter's ``requires_grad`` (``_trainable_changed``).
#: Where the counter answers the looks between looks at the gradients, it reads every CPU
#: parameter's ``requires_grad`` at each look it answers, and hands the look to the probe where
#: one differs from the last full read (``_let_counter_answer``).
TRAINABLE_FULL_EVERY = 4


def _grads_due(n: int) -> bool:
    """Whether the ``n``-th look (from 0) looks at the gradients (``_at_boundary``)."""
    return n < GRAD_LOOKS_FIRST or n % GRAD_LOOK_EVERY == 0


#: Pseudo category of model buffers: counted with what the allocator holds beyond the known sets.
_BUFFER = "buffer"
#: Pseudo category of tpkit's own tensors (``Recorder.own_tensors``): counted nowhere.
_OWN = "tpkit"


#: Values with no tensor inside: skipped before the (slower) ``Mapping`` check.
_PLAIN = frozenset({str, bytes, int, float, bool, type(None)})
#: An optimizer's own attributes (``torch.optim.Optimizer.__init__``) that hold no state of its
#: own: its state and groups are walked apart, its defaults are the groups' settings.
_OPT_OWN_ATTRS = frozenset({"state", "param_groups", "defaults"})


def _tensors(obj: Any, depth: int = 0) -> Iterable[torch.Tensor]:
    """Tensors in a (nested) batch or optimizer-state value, bounded in depth. A ``Mapping``
    that is no dict is walked too, through the dict that holds its values (``held_values``):
    HF's ``BatchEncoding`` (a ``UserDict``, what ``DataCollatorWithPadding`` returns), whose
    bytes had read ``other``, ``data`` 0."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 4:
        if isinstance(obj, dict):
            for v in obj.values():
                yield from _tensors(v, depth + 1)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                yield from _tensors(v, depth + 1)
        elif type(obj) not in _PLAIN and isinstance(obj, Mapping):
            for v in held_values(obj):
                yield from _tensors(v, depth + 1)
        elif _is_dataclass_instance(obj):
            for f in dataclasses.fields(obj):
                yield from _tensors(getattr(obj, f.name, None), depth + 1)


def _is_dataclass_instance(obj: Any) -> bool:
    """A dataclass batch (``batch_size_of`` reads them): its tensors had read other, data 0 B."""
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def _batch_tensors(batch: Any) -> list[torch.Tensor]:
    """``list(_tensors(batch))``, without a generator for a tensor or a flat dict, list or
    tuple of tensors (what loaders hand out), or a flat ``UserDict`` of them (``_tensors``); any
    other ``Mapping`` through the dict that holds its values, never its ``__getitem__`` (a lazy
    one, a datasets ``LazyBatch``, would format or stack at each read). A batch that is an object
    (no container): the tensors in its mapping stores (``batches.stored_tensors``: a PyG ``Batch``
    keeps them in a ``MutableMapping``, whose bytes had read other, data 0 B). Objects inside a
    batch are not walked (a config with class weights beside the tensors is no data)."""
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, dict):
        values: Iterable[Any] = batch.values()
    elif isinstance(batch, (list, tuple)):
        values = batch
    elif isinstance(batch, UserDict):
        values = batch.data.values()
    elif _is_dataclass_instance(batch):
        values = [getattr(batch, f.name, None) for f in dataclasses.fields(batch)]
    elif isinstance(batch, Mapping):
        values = held_values(batch)
    else:
        return stored_tensors(batch)
    out: list[torch.Tensor] = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif type(v) not in _PLAIN:
            out += _tensors(v, 1) if _walked(v) else ()
    return out


def _walked(obj: Any) -> bool:
    """Whether ``_tensors`` walks ``obj``: a container, a mapping or a dataclass."""
    return isinstance(obj, (dict, list, tuple, Mapping)) or _is_dataclass_instance(obj)


@dataclass
class _Levels:
    """Bytes at one instant: known sets by category, the rest allocated outside backward (on the
    CPU: inside a forward, or between a forward and its backward, where the loss is made), the
    rest allocated inside backward (autograd temporaries), and on the CPU the rest allocated
    anywhere else (an EMA copy of the weights, a state_dict copied for a checkpoint: ``other``)."""

    known: dict[str, int]
    rest: int | None
    rest_backward: int = 0
    rest_elsewhere: int = 0

    @property
    def total(self) -> int:
        return sum(self.known.values()) + (self.rest or 0) + self.rest_backward + self.rest_elsewhere


class MemoryProbe:
    """Listens to phase boundaries; builds ``run.memory`` rows when removed.

    The hot path (every phase boundary) only stamps the time and writes one marker into the CPU
    stream (with tpkit's counter, both in one C call: the counter is the phase listener); the
    known sets are observed a few times per step (the first optimizer boundary after a backward,
    each batch, the slice's end) and the stream is replayed after the slice.
    """

    def __init__(self, rec: Recorder, detail: bool = False,
                 cpu: CpuAllocatorStream | CpuAllocatorCounter | None = None,
                 cuda: CudaAllocator | None = None, steps: int = 0) -> None:
        self.rec = rec
        self.detail = detail
        #: steps the slice expects (warm-up included): markers for them are made at install
        self.steps_ahead = steps
        self._source_note: str | None = None  # said in the run once the probe is installed
        if cpu is None:
            cpu, self._source_note = cpu_allocation_source()
        self.cpu = cpu
        self._counting = isinstance(cpu, CpuAllocatorCounter)
        #: how a marker is made, chosen once: written into the counter's list (its
        #: ``write_marker``: an odd address no block has, an odd size), or a storage freed
        self._marker: Callable[[int, int], Any] = (cpu.write_marker if isinstance(cpu, CpuAllocatorCounter)
                                                   else self._free_marker)
        #: the phase listener: the counter's ``boundary`` while it records (it notes each
        #: boundary and writes its marker, calling ``_at_boundary`` only where there is more to
        #: do), else ``_on_phase``
        self._listener: Callable[[str, str, int], None] = self._on_phase
        self._listening = False  # the counter numbers the markers and keeps them (read back at remove)
        self._bounds_noted = False  # the counter notes the boundaries too (read back at remove)
        self.cuda = cuda if cuda is not None else CudaAllocator()
        # The hot path appends plain ints and interned strings to flat lists (4 per entry), so
        # that nothing it keeps is tracked by the gc: no collection is triggered by tpkit.
        #: phase, event, raw_step, t_ns per boundary
        self._bounds_flat: list[Any] = []
        #: markers in the CPU stream (each a free), in order: ptr, bytes, kind, index, pool number
        self._marks_flat: list[int] = []
        #: storages made ahead for markers: (storage, ptr, bytes, pool number), used from the end
        self._pool: list[tuple[Any, int, int, int]] = []
        #: every marker storage allocated, in stream order: ptr, bytes
        self._pool_flat: list[int] = []
        #: CPU storages seen at each observation: ptr, bytes, category, parameter slot (or -1;
        #: ``_WATCHED`` for a watched batch storage), ...
        self.observations: list[list[Any]] = []
        #: boundary -> known sets walked there (no CPU stream, or CUDA devices in use)
        self.walks: dict[int, dict[tuple[str, str], int]] = {}
        #: boundary -> {device: (allocated, peak in the stretch before, peak exact)}
        self.cuda_reads: dict[int, dict[str, tuple[int, int, bool]]] = {}
        self._cuda_baseline: dict[str, tuple[int, int, bool]] = {}  # {device: read} at install
        self._bounded: dict[str, str] = {}  # devices whose stretch peaks are lower bounds (_emit)
        # the optimizers that stepped, held weakly (one made anew each iteration goes as the loop
        # lets it go: held here, it had read as a growing optimizer_state)
        self.optimizers = rec.optimizers  # the phase probe notes each before its step is entered
        self._batch: list[weakref.ref] = []
        # the model's parameters and buffers, held weakly (_refresh_params): a buffer registered
        # anew or a layer replaced goes when the loop lets it go
        self._params: list[weakref.ref[torch.Tensor]] = []
        self._buffers: list[weakref.ref[torch.Tensor]] = []
        self._known_ids: set[int] = set()  # id() of the parameters in _params
        self._died: list[int] = []  # id() of parameters and buffers of _params/_buffers that died since
        self._slots: dict[int, int] = {}  # id(parameter) -> slot
        self._slots_made = 0
        self._grad_hooks: list[Any] = []
        self._hooked: set[int] = set()  # slots whose parameter has tpkit's post-accumulate-grad hook
        # the CPU parameters of _params (weakly), and which of them required grad at the last look,
        # with the _params_version it was read at (_trainable_changed)
        self._cpu_params: list[weakref.ref[torch.Tensor]] = []
        self._trainable: tuple[int, list[bool]] | None = None
        # the CPU parameters frozen at the last full read (weakly): the looks between full reads
        # read these only (none where the loop trains everything)
        self._frozen: list[weakref.ref[torch.Tensor]] = []
        #: the counter's copy of the last full read (``_let_counter_answer``): made anew only when
        #: ``_trainable`` is another object
        self._watched_trainable: tuple[int, list[bool]] | None = None
        self._watched_params: tuple[tuple[Any, ...], tuple[bool, ...]] = ((), ())
        self._opts_counted: tuple[list[Any], int] = ([], 0)  # _known_sets_grew's last count
        # every (parameters' version, which require grad) looked at: a loop alternating between
        # sets (an encoder and a decoder by turns) has each set's pattern after its first look
        self._trainable_seen: set[tuple[int, tuple[bool, ...]]] = set()
        self._outside_key: tuple[int, ...] = ()  # storages of the optimizer tensors outside opt.state last observed
        self._outside_version = 0  # bumped when they changed (the walked known sets' key)
        self._seen_key: tuple[int, int] = (-1, -1)  # (models, optimizer parameters) last counted
        self._seen_opts = -1  # optimizers when last counted
        self._opt_key: tuple = ()
        self._state_replaced = False  # an optimizer makes its state tensors anew at its steps
        self._params_new = False  # parameters refreshed since the last observation
        self._param_addresses: list[int] = []  # data_ptr() of the parameters in _params when read
        self._own_seen = 0
        self._opt_states_seen = 0  # optimizer states counted at the last check (_known_sets_grew)
        self._groups_seen = 0  # optimizers' parameter groups counted then (add_param_group adds one)
        self._groups_grew = False  # until the parameters are read again (_refresh_params)
        self._grad_looks = 0  # chances to look at the gradients so far (one per backward)
        self._grads_seen_at: list[int] = []  # observations that looked at every gradient
        self._grads_watched: set[int] = set()  # parameter slots whose first gradient is watched
        self._finalizers: list[weakref.finalize] = []
        self.gone: list[tuple[int, int]] = []  # (ptr, bytes) of watched CPU tensors that died  # rec.own_tensors already observed
        self._grads_new = False  # a backward ended since the known sets were last observed
        self._dev_names: dict[torch.device, str] = {}
        self._handle: Any = None
        self._fsdp = Patches()  # FSDP2's unshard, while the probe is installed (_watch_fsdp_unshards)
        self.fsdp_unshards = 0  # unshards observed (their parameters counted as parameters)
        self.fsdp1_unshards = 0  # FSDP1's unshards observed (_watch_fsdp1_unshards)
        self._history = False
        self._cpu_note: str | None = None
        self._stream_lost_at: int | None = None
        self._detail: dict[str, Any] = {}
        self._cuda_in_use: set[int] = set()  # CUDA devices holding tensors the probe has seen
        self._cuda_last: dict[int, tuple[int, int]] = {}  # device -> (allocated, max allocated) at the last read
        self._stream_tid = -1  # the thread whose allocations the CPU stream sees
        self._params_version = 0  # how many times the parameter set was found anew
        self._static_key: tuple = ()  # what the walked parameters/optimizer state/buffers were
        self._static_seen: set[tuple[str, int]] = set()
        self._static_known: dict[tuple[str, str], int] = {}
        self._grads_key: tuple | None = ()  # which gradient tensors, at which addresses, were walked last
        self._grads_seen: set[tuple[str, int]] = set()
        self._grads_known: dict[tuple[str, str], int] = {}
        self._cpu_walked = False  # some CPU boundary was walked, not replayed
        self.installed = False
        self._finished = False

    # -- life cycle -------------------------------------------------------------------------
    def install(self) -> "MemoryProbe":
        if self.installed:
            return self
        self.installed = True
        try:
            if self._source_note:
                self.rec.note(self._source_note)
            self._handle = _optim.register_optimizer_step_pre_hook(self._see_optimizer)
            try:
                self._stream_tid = get_ident()
                self.cpu.start()
            except Exception as e:  # e.g. a torch.profiler already running
                self._cpu_note = (f"CPU memory beyond parameters, gradients, optimizer state and data "
                                  f"was not measured: the allocator stream could not start ({e})")
            if self.cpu.active and isinstance(self.cpu, CpuAllocatorCounter):
                # before any marker: the counter numbers them from here
                self.cpu.listen(self.rec.models.entries, self._cuda_in_use, self._at_boundary, _LOOK_AFTER,
                                _LOOK_AT, _BOUND, MARKER_BASE_BYTES, MARKER_SIZES)
                self._listening = True
                if BOUNDARIES_IN_COUNTER:
                    self._bounds_noted = True
                    self._listener = self.cpu.boundary
            elif self.cpu.active:  # the counter's markers are written, not freed
                self._refill(min(MARKERS_AHEAD_MAX, MARKERS_PER_STEP_AHEAD * self.steps_ahead))
            self._observe()  # what exists already (a model seen before, its optimizer's state)
            self._watch_fsdp_unshards()
            self._watch_fsdp1_unshards()
            for i in sorted(self._cuda_in_use):
                # the baseline: the first stretch's peak is measured from here
                self._cuda_baseline[f"cuda:{i}"] = self._read_cuda(i)
            if self.detail:
                if self.cuda.available():
                    try:
                        if self.cuda.history_running():
                            self.rec.note("--memory-detail: a CUDA allocator history was already recording; "
                                          "tpkit reads it at the end and leaves it on")
                            self._history = True
                            self._history_ours = False
                        else:
                            self.cuda.start_history()
                            self._history = self._history_ours = True
                    except Exception as e:
                        self.rec.note(f"--memory-detail: the CUDA allocator history could not start ({e})")
                else:
                    self.rec.note("--memory-detail needs a CUDA device in use; on the CPU it records nothing more")
            self.rec.phase_listeners.append(self._listener)
            self.rec.batch_listeners.append(self._on_batch)
        except BaseException:
            self.remove()
            raise
        return self

    def remove(self) -> None:
        """Stop listening and turn the allocator stream into ``run.memory`` rows. Idempotent."""
        pairs: tuple[tuple[list[Any], Any], ...] = ((self.rec.phase_listeners, self._listener),
                                                    (self.rec.batch_listeners, self._on_batch))
        for lst, fn in pairs:
            while fn in lst:
                lst.remove(fn)
        if self._listening:
            self.cpu.unlisten()  # type: ignore[union-attr]
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self._fsdp.restore()
        if self.installed and not self._finished:
            self._observe(final=True)
        for h in self._grad_hooks:
            h.remove()
        self._grad_hooks = []
        for f in self._finalizers:
            f.detach()
        self._finalizers = []
        events: list[tuple[int, int]] = []
        if self.cpu.active:
            try:
                events = self.cpu.stop()
            except Exception as e:
                self._cpu_note = (f"CPU memory beyond parameters, gradients, optimizer state and data "
                                  f"was not measured: {e}")
        if self._listening:  # what the counter noted, into the probe's own lists
            self._listening = False
            counter: Any = self.cpu
            if self._bounds_noted:
                self._bounds_noted = False
                for phase, event, raw_step, t_ns in counter.boundaries():
                    self._bounds_flat += (phase, event, raw_step, t_ns)
            for address, size, kind, index in counter.markers():
                self._marks_flat += (address, size, kind, index, -1)
            counter.forget()
        self._pool = []  # after the stream: these frees are in no stream
        if self._history:
            self._history = False
            try:
                snap = self.cuda.stop_history() if self._history_ours else self.cuda.snapshot()
                self._detail = {f"cuda:{i}": top_allocations_at_peak(trace)
                                for i, trace in enumerate(snap.get("device_traces", []))
                                if i in self._cuda_in_use or not self._cuda_in_use}
            except Exception as e:
                self.rec.note(f"--memory-detail: reading the CUDA allocator history failed ({e!r})")
        self.installed = False
        if not self._finished:
            self._finished = True
            if self._cpu_note:
                self.rec.note(self._cpu_note)
            if self.fsdp_unshards:
                self.rec.note(f"FSDP2's unsharded parameters (all-gathered before a block's forward and again before "
                              f"its backward, {self.fsdp_unshards} times in the slice) count as parameters from "
                              "their all-gather to their reshard; kept from forward to backward with "
                              "reshard_after_forward=False")
            if self.fsdp1_unshards:
                self.rec.note(f"FSDP's unsharded flat parameters (FullyShardedDataParallel's all-gathered "
                              f"FlatParameters, {self.fsdp1_unshards} unshards in the slice) count as parameters "
                              "from their all-gather to their reshard; kept from forward to backward with "
                              "SHARD_GRAD_OP, and the root's with FULL_SHARD")
            if self.walks and self._deepspeed_engines():
                self.rec.note("memory: a DeepSpeed engine's own gradient buffers (ZeRO's accumulators and "
                              "partitions) are counted as gradients from the CPU allocation stream only; where "
                              "the categories came from walks at the boundaries (CUDA devices, a loop in another "
                              "thread, a running torch profiler) they are not walked and read with the rest")
            self._emit(events)
            self._batch = []
            self.optimizers = WeakRegistry()
            self._params, self._buffers = [], []

    _history_ours = False

    def meta(self) -> dict[str, Any]:
        cap: dict[str, int] = {}
        host = host_capacity_bytes()
        if host:
            cap["cpu"] = host
        for i in sorted(self._cuda_in_use):
            try:
                cap[f"cuda:{i}"] = self.cuda.capacity(i)
            except Exception:
                pass
        exact_cpu = self._cpu_note is None and self._stream_lost_at is None and not self._cpu_walked
        out: dict[str, Any] = {
            "capacity_bytes": cap,
            "cpu_source": (CPU_SOURCE_KNOWN_SETS if self._cpu_note is not None
                           else CPU_SOURCE_COUNTER if self._counting
                           else CPU_SOURCE_STREAM),
            # devices whose category mix at a peak is not taken at the peak's instant
            "approximate_mix": ([] if exact_cpu else ["cpu"]) + [f"cuda:{i}" for i in sorted(self._cuda_in_use)],
        }
        if self._bounded:
            out["peak_lower_bound"] = self._bounded
        if self._detail:
            out["top_at_peak"] = self._detail
        events = getattr(self.cpu, "events_seen", 0)
        if events:  # what the stream cost the loop is estimated from these (analysis.memory)
            out["stream_events"] = int(events)
            out["stream_steps"] = len(self.rec.step_ends)  # the stream runs the whole slice
        return {"memory": out}

    def _cuda_peaks_bounded(self) -> dict[str, str]:
        """Devices with stretches whose peak could only be bounded from below: the allocator's
        reports did not cover them (``_stream_cuda_peaks``) and the process's peak counter
        (never reset, so the user's ``max_memory_allocated`` stays theirs) did not rise in
        them, so their peak is the higher of their two boundary levels; a transient inside (an
        optimizer's temporaries) is not seen."""
        out: dict[str, str] = {}
        for dev in sorted({d for reads in self.cuda_reads.values() for d in reads}):
            exact = [r[dev][2] for r in self.cuda_reads.values() if dev in r]
            missed = sum(1 for e in exact if not e)
            if missed:
                out[dev] = (f"{missed} of {len(exact)} stretches between phase boundaries (a stretch's peak is "
                            "exact where the CUDA allocator's own reports to the profiler covered it, or where "
                            "it set a new high for the process: tpkit never resets the peak counter, so the "
                            "user's max_memory_allocated stays theirs; elsewhere it is the higher of the "
                            "stretch's two boundary levels, and a transient inside it is not seen)")
        return out

    # -- hooks (the hot path) ---------------------------------------------------------------
    def _see_optimizer(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if compiling():
            return  # inlined into a compiled step: dynamo would guard on the registry (a recompile each new one)
        known = self.optimizers._keys.get(id(opt))  # (WeakRegistry.add's test, inlined: a frame less a step)
        if known is None or self.optimizers.entries[known]() is not opt:
            self.optimizers.add(opt)
        if self.rec._open.get("backward") and self._streaming():
            self._observe_stepped_gradients(opt)

    def _watch_fsdp_unshards(self) -> None:
        """FSDP2 all-gathers a block's parameters before its forward and again before its backward
        (``FSDPParamGroup.wait_for_unshard``), into storages it allocates then and frees at the
        reshard (with ``reshard_after_forward=False`` they are kept from forward to backward):
        those are parameters. Allocated inside forward they had read activations (126,976 B at
        a 2-rank forward's exit, exactly the unsharded parameters kept), inside backward
        temporaries. Each unshard in the loop's thread is an observation of them: they count as
        parameters from their allocation to their free. Only where the loop imported FSDP2."""
        group_mod = sys.modules.get("torch.distributed.fsdp._fully_shard._fsdp_param_group")
        group = getattr(group_mod, "FSDPParamGroup", None)
        wait = vars(group).get("wait_for_unshard") if isinstance(group, type) else None
        if not callable(wait):
            return
        probe = self

        def wait_for_unshard(self_: Any, *args: Any, **kwargs: Any) -> Any:
            out = wait(self_, *args, **kwargs)
            if not compiling() and probe._streaming():
                probe._observe_unsharded(getattr(self_, "fsdp_params", ()))
            return out

        self._fsdp.set(group, "wait_for_unshard", functools.update_wrapper(wait_for_unshard, wait))

    def _watch_fsdp1_unshards(self) -> None:
        """FSDP1 (``FullyShardedDataParallel``) all-gathers each FlatParameter into the padded
        unsharded flat parameter (``FlatParamHandle.unshard``: ``_full_param_padded``, its storage
        allocated there and resized to 0 at the reshard) before a unit's forward and, where it
        was resharded, before its backward. SHARD_GRAD_OP keeps every unit's from forward to
        backward, FULL_SHARD the root's: those had read activations (315,504 B of a 2-rank
        SHARD_GRAD_OP forward's exit, beside 27,488 B of real activations), inside backward
        temporaries. As for FSDP2 (``_watch_fsdp_unshards``), each unshard in the loop's thread
        is an observation of them. One observation per unit and unshard, none under NO_SHARD
        (its flat parameter is the model's own). Only where the loop imported FSDP1."""
        mod = sys.modules.get("torch.distributed.fsdp._flat_param")
        handle = getattr(mod, "FlatParamHandle", None)
        unshard = vars(handle).get("unshard") if isinstance(handle, type) else None
        if not callable(unshard):
            return
        probe = self

        def fsdp1_unshard(self_: Any, *args: Any, **kwargs: Any) -> Any:
            if compiling() or not probe._streaming() or not getattr(self_, "uses_sharded_strategy", False):
                return unshard(self_, *args, **kwargs)
            flat = getattr(self_, "flat_param", None)
            before = _unsharded_flat(flat)
            out = unshard(self_, *args, **kwargs)
            probe._observe_flat_unsharded([t for t in _unsharded_flat(flat) if t not in before])
            return out

        self._fsdp.set(handle, "unshard", functools.update_wrapper(fsdp1_unshard, unshard))

    def _observe_flat_unsharded(self, found: list[tuple[int, int]]) -> None:
        """Unsharded flat-parameter storages (address, bytes) an FSDP1 unshard allocated."""
        if found:
            self.fsdp1_unshards += 1
            self._add_observation([x for ptr, nbytes in found for x in (ptr, nbytes, "parameters", -1)])

    def _observe_unsharded(self, fsdp_params: Iterable[Any]) -> None:
        items: list[Any] = []
        for fp in fsdp_params:
            for t in getattr(fp, "all_gather_outputs", ()) or ():
                try:
                    s = t.untyped_storage()
                    ptr, nbytes = s.data_ptr(), s.nbytes()
                except Exception:  # noqa: BLE001 - a storage FSDP2 freed or swapped: nothing alive
                    continue
                if nbytes and t.is_cpu:
                    items.extend((ptr, nbytes, "parameters", -1))
        if items:
            self.fsdp_unshards += 1
            self._add_observation(items)

    def _observe_stepped_gradients(self, opt: torch.optim.Optimizer) -> None:
        """An optimizer stepped inside backward (one per parameter, stepped in a post-accumulate-grad
        hook that then drops the gradient: PyTorch's recipe): its parameters' gradients are
        observed at each such step, the only time they are alive. The look after the backward
        finds none of them, and tpkit's own grad-set hook runs after the loop's (registered
        later): they had read other at the step (4 MiB of a 1024 x 1024 weight's). Each counts as
        gradients from here at the latest (``_replay``)."""
        items: list[Any] = []
        slots = self._slots
        for group in opt.param_groups:
            for p in group["params"]:
                g = p.grad
                if g is None or not g.is_cpu or g.layout is not torch.strided:
                    continue
                s = _local(g).untyped_storage()
                if s.nbytes():
                    items.extend((s.data_ptr(), s.nbytes(), "gradients", slots.get(id(p), -1)))
        self._add_observation(items)

    def _streaming(self) -> bool:
        """Whether what happens now is in the CPU stream: it is on, no other profiler took it
        over, and this is the thread that started it (the profiler reports no other thread's
        allocations: a loop in another thread gets the known sets walked at its boundaries)."""
        return self.cpu.active and self._stream_lost_at is None and get_ident() == self._stream_tid

    def _mark(self, kind: int, index: int) -> None:
        """A marker, which cuts the CPU stream here: with tpkit's counter an event written into
        its list (an odd address no block has, an odd size; the replay matches it like a storage
        marker whose allocation came before: pool number -1); with torch's stream the free of a
        storage allocated ahead (its address and odd size are known)."""
        self._marker(kind, index)

    def _free_marker(self, kind: int, index: int) -> None:
        """The stream's marker: the free of the next storage of the pool made ahead."""
        pool = self._pool
        if not pool:
            self._refill()
        m, ptr, size, number = pool.pop()
        self._marks_flat += (ptr, size, kind, index, number)
        del m

    def _refill(self, count: int | None = None) -> None:
        """``count`` (default ``MARKER_POOL``) marker storages, of sizes that differ from one to
        the next, used after those already in the pool."""
        flat = self._pool_flat
        made = []
        for _ in range(MARKER_POOL if count is None else count):
            number = len(flat) >> 1
            size = MARKER_BASE_BYTES + 2 * (number % MARKER_SIZES)
            # through the CPU allocator in use (torch.UntypedStorage(size) would go to torch's
            # default one, which tpkit's allocation counter does not wrap)
            m = torch.empty(size, dtype=torch.uint8).untyped_storage()
            flat += (m.data_ptr(), size)
            made.append((m, flat[-2], size, number))
        made.reverse()  # used in the order made, after what is left in the pool
        self._pool[:0] = made

    def _last_bound(self) -> tuple[int, str, str] | None:
        """``(k, phase, event)`` of the last boundary, or None."""
        if self._bounds_noted:
            last: tuple[int, str, str] | None = self.cpu.last_boundary()  # type: ignore[union-attr]
            return last
        f = self._bounds_flat
        return ((len(f) >> 2) - 1, f[-4], f[-3]) if f else None

    @property
    def bounds(self) -> list[tuple[str, str, int, int]]:
        """``(phase, event, raw_step, t_ns)`` of every boundary so far."""
        f = self._bounds_flat
        return list(zip(f[0::4], f[1::4], f[2::4], f[3::4]))

    @property
    def marks(self) -> list[tuple[int, int, int, int, int]]:
        """``(ptr, bytes, kind, index, pool number)`` of every marker so far, in stream order."""
        f = self._marks_flat
        return list(zip(f[0::5], f[1::5], f[2::5], f[3::5], f[4::5]))

    def _on_phase(self, phase: str, event: str, raw_step: int) -> None:
        """The phase listener where the counter does not note the boundaries (torch's stream, or
        no stream): note the boundary, then ``_at_boundary``. The counter's ``boundary`` does
        the same in C++ (``allocator_counter.cpp``)."""
        t_ns = perf_counter_ns()
        flat = self._bounds_flat
        k = len(flat) >> 2
        flat += (phase, event, raw_step, t_ns)
        look = False
        if self._grads_new:
            if event == "enter" and phase in _LOOK_AT:
                self._grads_new = False
                look = True
        elif event == "exit" and phase == _LOOK_AFTER:
            self._grads_new = True
        self._at_boundary(phase, event, raw_step, k, look)

    def _at_boundary(self, phase: str, event: str, raw_step: int, k: int, looks: int) -> None:
        """Boundary ``k``, noted already: write its marker, and walk the known sets where the
        stream cannot be replayed (no stream, another thread, a torch profiler took it over) or a
        CUDA device is in use. ``looks`` (0 or False: none): this boundary is a look, the first
        optimizer or forward enter after a backward pass, where the new gradients are alive (at
        the optimizer's step or zero_grad, or, in a loop without optimizer, at the next forward),
        and ``looks - 1`` looks before it were answered by the counter (``_let_counter_answer``).
        The gradients are looked at after the first backward passes and then every
        GRAD_LOOK_EVERY-th, and the replay finds the others' gradients from those
        (``_template_gradients``). Each boundary comes right after work that left the caches
        cold: the usual branch calls no other method of tpkit's (each call cost 1-2 us there)."""
        if looks:
            n = self._grad_looks + looks - 1
            self._grad_looks = n + 1
            grads = _grads_due(n)
            if self._cpu_params and self._trainable_changed():
                # parameters frozen or unfrozen (requires_grad switched, a new optimizer over the
                # backbone): the gradients no longer follow the last look's pattern (an unfrozen
                # backbone's had read temporaries, no note): look now and after the next passes
                grads, self._grad_looks = True, 1
            # counted at every look, one at the gradients too: a layer added to the optimizer
            # (add_param_group) right before a look at the gradients had its gradients left out
            # of that look and the next (its parameters not read yet), then read as temporaries
            # until a look that counted (two steps of a 3-layer model's read 2 layers', no note)
            grown = self._known_sets_grew()
            if grads or grown or self._state_replaced:
                if self._groups_grew:
                    # parameters added (add_param_group, a layer grown, or a new optimizer's groups
                    # beside the ones counted: a second stage's head): so are gradients that no
                    # earlier look's pattern fits (they read as temporaries): look now and after
                    # the next passes, as at the start (not for new state alone, nor where the
                    # groups counted stay the same: an optimizer made anew after the last is gone)
                    grads, self._grad_looks = True, 1
                self._observe(grads=grads)
        if len(self.rec.models.entries) != self._seen_key[0]:  # (the registry's dict: no __len__ frame)
            self._refresh_params()  # a model seen for the first time (its devices are read from now on)
        if looks and self._bounds_noted:
            self._let_counter_answer()
        stream = self.cpu.active and self._stream_lost_at is None and get_ident() == self._stream_tid  # _streaming()
        # torch's flag of an open torch.profiler / autograd.profiler.profile session (tpkit's
        # own stream does not set it), read in place: a call per boundary cost more than the read;
        # the counter records on through tpkit's own operator trace, and says when it stopped
        if stream and (self.cpu.stopped_by_profiler if self._counting
                       else _autograd_profiler._is_profiler_enabled):
            # a torch.profiler started inside the slice takes the allocator stream over
            self._stream_lost_at = k
            stream = False
        if stream:  # the marker (``_mark``, inlined: one call fewer)
            self._marker(_BOUND, k)
            if not self._cuda_in_use:
                return
        # no CPU stream to replay, or CUDA devices in use: walk the known sets here
        self.walks[k] = self._known_sets()
        self._cpu_walked = self._cpu_walked or not stream
        if self._cuda_in_use:
            self.cuda_reads[k] = {f"cuda:{i}": self._read_cuda(i) for i in sorted(self._cuda_in_use)}

    def _let_counter_answer(self) -> None:
        """After a look at the gradients, where the counter notes the boundaries: let its
        ``boundary`` answer the looks up to the next one at the gradients itself, as long as
        nothing this probe's look reads changed: every container its checks count (the
        registries, tpkit's own tensors, the deaths noted), each optimizer's numbers of states
        and groups, each CPU parameter's ``requires_grad`` (as the last full read found it: an
        unfreezing or a freezing sends the next look here, where ``_trainable_changed`` decides
        as before). Granted only where the next look would find nothing to do now either (no
        flag set, no count grown since the last check). The look had cost 16-27 us a step inside
        a 2-layer GPT-2's steps, most of it cold caches; after the first looks the counter
        answers 15 in 16 (docs/OVERHEAD.md, "Looks the counter answers")."""
        n, skip = self._grad_looks, 0
        while skip < GRAD_LOOK_EVERY and not _grads_due(n + skip):
            skip += 1
        trainable, cpu_params = self._trainable, self._cpu_params
        # the optimizers as this look's _known_sets_grew counted them (flat: weakref, states,
        # groups, ...: objects the collector tracks, few); its groups are the seen ones now
        opts, states = self._opts_counted
        if (skip == 0 or self._state_replaced or self._groups_grew or self._registries_grew()
                or states != self._opt_states_seen  # (_known_sets_grew would act at the next look)
                or (cpu_params and (trainable is None or trainable[0] != self._params_version
                                    or len(trainable[1]) != len(cpu_params)))):
            self._look_next()
            return
        if self._watched_trainable is not trainable:  # made once a full read (a parameter dead
            # since: the counter finds its weakref dead)
            self._watched_trainable = trainable
            self._watched_params = ((tuple(cpu_params), tuple(trainable[1])) if cpu_params and trainable is not None
                                    else ((), ()))
        entries, models, own, died = self.optimizers.entries, self.rec.models.entries, self.rec.own_tensors, self._died
        self.cpu.skip_looks(skip, (entries, len(entries), models, len(models), own, len(own),  # type: ignore[union-attr]
                                   died, len(died)), tuple(opts), *self._watched_params)

    def _look_next(self) -> None:
        """The counter answers no look from now on: the next one is the probe's."""
        if self._bounds_noted:
            self.cpu.skip_looks(0, (), (), (), ())  # type: ignore[union-attr]

    def _on_batch(self, batch: Any) -> None:
        """Once a step, right after the loader's work: the batch's storages are ``data``.
        One pass over its tensors, no generator for the usual shapes (a tensor, or a dict,
        list or tuple of tensors): a 2-tensor batch cost 28 us here before, most of it calls."""
        tensors = _batch_tensors(batch)
        refs = []
        for t in tensors:
            try:
                refs.append(weakref.ref(t))
            except TypeError:
                pass
        self._batch = refs
        items = self._storages(tensors, "data", watch_shared=True)
        if self._streaming():
            flat: list[Any] = []
            for dev, ptr, nb, c, slot in items:
                if dev == "cpu":
                    flat += (ptr, nb, c, slot)
            self._add_observation(flat)
        # Loaders report the batch right after their data_wait span closed: count it as data
        # at that exit boundary too (the previous batch, still held by the loop, stays there).
        last = self._last_bound() if self.walks else None
        if last is not None and last[0] in self.walks and last[1] == "data_wait" and last[2] == "exit":
            known = self.walks[last[0]]
            for dev, _, nb, _, _ in items:
                known[(dev, "data")] = known.get((dev, "data"), 0) + nb

    def _on_grad_set(self, slot: int) -> None:
        if compiling():
            return  # traced by compiled autograd: nothing of tpkit's may enter the graph
        if self._streaming():
            self._mark(_GRAD_SET, slot)

    def _read_cuda(self, index: int) -> tuple[int, int, bool]:
        """(allocated, peak since the previous read, whether that peak is exact). The process's
        peak counter is never reset: a stretch's peak is exact when the counter rose during it
        (a new high for the process); otherwise it is the higher of the two boundary levels."""
        now, high = self.cuda.read(index)
        last = self._cuda_last.get(index)
        self._cuda_last[index] = (now, high)
        if last is None:
            return now, now, False
        if high > last[1]:
            return now, high, True
        return now, max(now, last[0]), False

    # -- the known sets ---------------------------------------------------------------------
    def _refresh_params(self, force: bool = False) -> bool:
        """Read the parameters and buffers anew where the model set, the optimizers or their
        groups changed, or one read before died; ``force`` (the slice's end): always. They are
        held weakly, each with a callback that notes its death: held here, a buffer registered
        again bigger (older HF rotary caches) or a head replaced by a fresh layer stayed alive
        to the slice's end (25 MB of buffers alive against 16 MB without tpkit)."""
        if (not force and not self._groups_grew and not self._died and len(self.rec.models) == self._seen_key[0]
                and len(self.optimizers) == self._seen_opts):
            return False  # the same model set, optimizers and groups (checked at every look: keep it cheap)
        self._groups_grew = False
        self._seen_opts = len(self.optimizers)  # (ever seen: a new one in a dead one's place counts)
        opts = self.optimizers.live()
        key = (len(self.rec.models), sum(len(g["params"]) for o in opts for g in o.param_groups))
        if (not force and not self._died and key == self._seen_key
                and all(id(p) in self._known_ids for o in opts for g in o.param_groups for p in g["params"])):
            return False  # a new optimizer over the same parameters
        self._seen_key = key
        for i in self._died:  # an id may be a new tensor's now: it gets a slot of its own
            self._slots.pop(i, None)
        self._died.clear()  # (in place: the callbacks append to this list)
        params: dict[int, torch.Tensor] = {}
        buffers: dict[int, torch.Tensor] = {}
        for model in self.rec.models.live():
            for p in model.parameters():
                # inside torch.func.functional_call the module holds the tensors it was given: an
                # adapted weight (MAML's) is no parameter, and holding it kept its graph alive
                if p.grad_fn is None:
                    params.setdefault(id(p), p)
            for b in model.buffers():
                buffers.setdefault(id(b), b)
        for opt in opts:
            for group in opt.param_groups:
                for p in group["params"]:
                    params.setdefault(id(p), p)
        holders: dict[int, int] = {}  # CPU storage address -> tensors here that hold it (_weak)
        self._params = [self._weak(p, holders) for p in params.values()]
        self._buffers = [self._weak(b, holders) for b in buffers.values()]
        self._known_ids = set(params)
        self._param_addresses = _addresses(self._live_params())
        self._params_new = True
        self._params_version += 1
        self._look_next()
        self._cpu_params = [r for r, p in zip(self._params, params.values()) if p.is_cpu]
        for p in params.values():
            if id(p) not in self._slots:
                self._slots[id(p)] = self._slots_made
                self._slots_made += 1
            self._hook_grad(p)
        for d in {t.device.index for t in [*params.values(), *buffers.values()] if t.device.type == "cuda"}:
            self._cuda_in_use.add(d or 0)
        return True

    def _hook_grad(self, p: torch.Tensor) -> None:
        """Give a CPU parameter of at least ``GRAD_HOOK_MIN_BYTES`` that requires grad tpkit's
        post-accumulate-grad hook, once (a frozen one cannot have it: it gets it when unfrozen,
        ``_trainable_changed``)."""
        slot = self._slots[id(p)]
        if slot in self._hooked or not self.cpu.active:
            return
        try:
            hookable = (p.is_cpu and p.requires_grad and p.is_leaf
                        and _local(p).untyped_storage().nbytes() >= GRAD_HOOK_MIN_BYTES)
        except Exception:
            hookable = False
        if hookable:
            self._hooked.add(slot)
            self._grad_hooks.append(p.register_post_accumulate_grad_hook(
                lambda _p, slot=slot: self._on_grad_set(slot)))

    def _trainable_changed(self) -> bool:
        """At each look after a backward pass (once a step): whether the CPU parameters that
        require grad are other ones than at the last look (a backbone unfrozen by
        ``requires_grad_(True)``, with or without a new optimizer; layers frozen). Between two
        looks at the gradients the replay finds them by the looks' patterns of sizes, as a
        subsequence: an unfrozen backbone's gradients were left out of them (570,408 B of
        gradients read 10,280 B for up to 16 steps, the rest temporaries, no note). Newly
        trainable parameters get their grad hook here.

        Incremental: every look reads the parameters frozen at the last full read (none where
        the loop trains everything), so an unfreezing is seen at once; every
        TRAINABLE_FULL_EVERY-th look (and where the parameters were read anew) reads them all,
        so a freezing is seen within that many passes. The look it sets off gives the replay
        the new set's pattern, which fits the passes since the freezing too (patterns serve
        the whole slice, longest first): their gradients stay exact. A read of every
        parameter at every look cost ~8 us a look on a 2-layer GPT-2's 28 parameters, ~3.5 us
        now (wrapped timing, medians; docs/DESIGN_CHANGES.md)."""
        if (self._groups_grew or self._died or len(self.optimizers.entries) != self._seen_opts
                or len(self.rec.models.entries) != self._seen_key[0]):
            self._refresh_params()  # a new optimizer over parameters not read yet
        last, frozen = self._trainable, self._frozen
        if (last is not None and last[0] == self._params_version and self._grad_looks % TRAINABLE_FULL_EVERY
                and (not frozen or not any(p.requires_grad for r in frozen if (p := r()) is not None))):
            return False  # nothing unfrozen, and no full read due
        live = [p for r in self._cpu_params if (p := r()) is not None]
        now = [p.requires_grad for p in live]
        self._trainable = (self._params_version, now)
        self._frozen = [weakref.ref(p) for p, grad in zip(live, now) if not grad]
        if last is None:
            self._trainable_seen.add((self._params_version, tuple(now)))
            return False  # the first look: a look at the gradients anyway
        if last[0] == self._params_version:
            changed = last[1] != now
        else:  # parameters read anew (one died, a layer replaced): as many trainable ones as before?
            changed = sum(last[1]) != sum(now)
        if changed:
            seen = (self._params_version, tuple(now))
            if seen in self._trainable_seen:
                # a set looked at before (sets trained by turns): the replay has its pattern
                # (``_template_gradients`` keeps every look's) and its parameters their grad
                # hooks; looking again at each switch had made every step a full look (tpkit_s
                # 0.25 ms a step for 0.033)
                return False
            self._trainable_seen.add(seen)
            for p in self._live_params():
                self._hook_grad(p)
        return changed

    def _params_moved(self) -> bool:
        """Whether a parameter read before holds other memory now: its ``.data`` was replaced
        (``model.half()``, ``.double()``), which no weakref tells (the Parameter lives on)."""
        return _addresses(self._live_params()) != self._param_addresses

    def _weak(self, t: torch.Tensor, holders: dict[int, int]) -> weakref.ref[torch.Tensor]:
        """A weak reference to a parameter or buffer whose death is noted in ``_died`` (a list
        append: the callback may run inside any of the probe's own calls) and, for a CPU one, in
        the stream (``_gone``, as a gradient's): a storage from before the slice has no free
        event there, and a replaced head's weights had still read parameters (9.4 MB for 5.3).
        ``holders`` counts the tensors read with ``t`` that hold each CPU storage: the storage
        ends with the last of them only. Parameters that are views of one flat buffer had ended
        it with the first replaced, and the buffer, found again at the next look, counted from
        the slice's start beside the ended one (1,050,624 B of parameters for 526,336)."""
        died, i = self._died, id(t)
        try:
            s = _local(t).untyped_storage()
            ptr, nbytes = (s.data_ptr(), s.nbytes()) if t.is_cpu else (0, 0)
        except Exception:  # a sparse, meta or fake tensor: nothing to end in the stream
            ptr = nbytes = 0
        if nbytes:
            holders[ptr] = holders.get(ptr, 0) + 1
        gone = self._gone

        def dead(_ref: Any) -> None:
            died.append(i)
            if nbytes:
                holders[ptr] -= 1
                if not holders[ptr]:
                    gone(ptr, nbytes)

        return weakref.ref(t, dead)

    def _live_params(self) -> list[torch.Tensor]:
        return [p for r in self._params if (p := r()) is not None]

    def _live_buffers(self) -> list[torch.Tensor]:
        return [b for r in self._buffers if (b := r()) is not None]

    def _device(self, t: torch.Tensor) -> str:
        dev = t.device
        name = self._dev_names.get(dev)
        if name is None:
            name = self._dev_names[dev] = "cpu" if dev.type == "cpu" else str(dev)
            if dev.type == "cuda":
                self._cuda_in_use.add(dev.index or 0)
        return name

    def _storages(self, tensors: Iterable[torch.Tensor], category: str,
                  watch: bool = False, watch_shared: bool = False) -> list[tuple[str, int, int, str, int]]:
        """``(device, ptr, bytes, category, slot)`` of the tensors' storages (slot ``_WATCHED``
        for a watched one, else -1). With
        ``watch``, each CPU tensor's death cuts the stream too: the stream has no free event
        for a block allocated before the slice (or in another thread), so that is how the
        replay learns when such a known storage ended. ``watch_shared``: watch the tensors in
        shared memory (a DataLoader worker's batch): a loop that keeps its batches keeps them
        alive, which the next batch's arrival had been taken to end (a real leak of 1 MiB a step
        read flat with 2 workers)."""
        out = []
        for t in tensors:
            if type(t) is not torch.Tensor:  # a subclass may be a DTensor
                t = _local(t)
            if t.layout is not torch.strided and len(parts := _parts(t)) > 1:  # sparse
                out += self._storages(parts, category, watch, watch_shared)
                continue
            try:
                s = t.untyped_storage()
                ptr, nbytes = s.data_ptr(), s.nbytes()
                dev = "cpu" if t.is_cpu else self._device(t)
            except Exception:  # meta, fake or exotic tensor subclasses: nothing allocated to count
                continue
            if nbytes:
                if dev == "cpu" and (watch or (watch_shared and s.is_shared())):  # (the tensor's: 3.6 us)
                    self._watch(t, ptr, nbytes)
                    out.append((dev, ptr, nbytes, category, _WATCHED))
                else:
                    out.append((dev, ptr, nbytes, category, -1))
        return out

    def _watch(self, t: torch.Tensor, ptr: int, nbytes: int) -> None:
        try:
            f = weakref.finalize(t, self._gone, ptr, nbytes)
        except TypeError:
            return
        f.atexit = False
        self._finalizers.append(f)

    def _gone(self, ptr: int, nbytes: int) -> None:
        if self._streaming():
            self.gone.append((ptr, nbytes))
            self._mark(_GONE, len(self.gone) - 1)

    def _known_sets_grew(self) -> bool:
        """Cheap (counts only): a new model, optimizer, optimizer state or tpkit tensor since
        the last observation. Between two looks at the gradients the known sets are observed
        only then: a storage that an observation finds alive counts as known from its
        allocation, so a state replaced in place (``load_state_dict``) is still exact when
        the next look finds it (at most GRAD_LOOK_EVERY steps later). Checking every
        optimizer's state fingerprint at every step cost 15-30 us there (cold caches)."""
        states = groups = 0
        counted: list[Any] = []  # flat: weakref, states, groups, ... (for _let_counter_answer)
        for ref in self.optimizers.entries.values():  # (WeakRegistry.live, inlined: three frames less a look)
            opt = ref()
            if opt is not None:
                n_states, n_groups = len(opt.state), len(opt.param_groups)
                states += n_states
                groups += n_groups
                counted += (ref, n_states, n_groups)
        self._opts_counted = (counted, states)
        if groups != self._groups_seen:
            self._groups_seen, self._groups_grew = groups, True
            return True
        if states != self._opt_states_seen:
            self._opt_states_seen = states
            return True
        return self._registries_grew()

    def _registries_grew(self) -> bool:
        """A parameter read anew or dead, or an optimizer, model or tpkit tensor noted since the
        last observation."""
        return (self._params_new or bool(self._died) or len(self.optimizers.entries) != self._seen_opts
                or len(self.rec.models.entries) != self._seen_key[0] or len(self.rec.own_tensors) > self._own_seen)

    def _opt_state_tensors(self) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for opt in self.optimizers.live():
            for state in list(opt.state.values()):
                for v in (state.values() if isinstance(state, dict) else (state,)):
                    if isinstance(v, torch.Tensor):
                        out.append(v)
                    elif isinstance(v, (dict, list, tuple)):
                        out += list(_tensors(v))
        return out

    def _opt_outside_tensors(self) -> list[torch.Tensor]:
        """Tensors an optimizer holds outside ``opt.state``: in its parameter groups (beside
        ``params``: momentum buffers some Muon/Shampoo ports keep there, a tensor learning rate)
        or in a public attribute of its own (a dict of buffers keyed by parameter), parameters
        left out. ``opt.state`` alone had left a momentum optimizer's buffers kept there read other
        (546,856 B), optimizer_state 0 B. Walked at the looks at the gradients only
        (``_scan_outside``), never per step."""
        out: list[torch.Tensor] = []
        params = self._known_ids
        for opt in self.optimizers.live():
            for group in opt.param_groups:
                for key, v in group.items():
                    if key != "params" and type(v) not in _PLAIN:
                        out += (t for t in _tensors(v) if id(t) not in params)
            for name, v in vars(opt).items():  # its public attributes: a private one is a scratch
                # or staging buffer (tpkit's offload optimizer's spent gradient copies had read as
                # 26,912 B of state; FusedAdam's 4-byte _dummy_overflow_buf)
                if name not in _OPT_OWN_ATTRS and not name.startswith("_") and type(v) not in _PLAIN:
                    out += (t for t in _tensors(v) if id(t) not in params)
        return out

    def _scan_outside(self) -> list[tuple[str, int, int, str, int]] | None:
        """The storages of ``_opt_outside_tensors`` where they changed since the last scan (a
        new version for the walked known sets), else None. The same number of them at new
        addresses: an optimizer that makes them anew at its steps; observed at every look from
        then on, as a state made anew (``_state_replaced``)."""
        found = self._storages(self._opt_outside_tensors(), "optimizer_state")
        key = tuple(ptr for _, ptr, _, _, _ in found)
        if key == self._outside_key:
            return None
        if self._outside_key and len(key) == len(self._outside_key):
            self._state_replaced = True
            self._look_next()
        self._outside_key = key
        self._outside_version += 1
        return found

    def _opt_fingerprint(self) -> tuple:
        """Cheap: how many states, and the storages of the first and last parameter's state
        (optimizers update their state in place; a new state object changes this)."""
        key: list[Any] = []
        for opt in self.optimizers.live():
            st = opt.state
            key.append((id(opt), len(st)))
            if st:
                for state in (next(iter(st.values())), next(reversed(st.values()))):
                    if isinstance(state, dict):
                        key += [v.data_ptr() for v in state.values() if isinstance(v, torch.Tensor)]
        return tuple(key)

    def _observe(self, final: bool = False, grads: bool = True) -> None:
        """Record the CPU known sets' storages at this point of the stream: parameters and
        buffers when the model set changed, every gradient, optimizer state when it changed.
        Runs at the first optimizer (or forward) boundary after a backward, never at every
        boundary."""
        if not self._streaming():
            self._refresh_params()
            if grads or final or self._state_replaced:
                self._scan_outside()  # for the walked known sets (_known_sets)
            return
        items: list[Any] = []  # flat: ptr, bytes, category, slot, ...

        def add(found: list[tuple[str, int, int, str, int]]) -> None:
            for dev, ptr, nb, c, _ in found:
                if dev == "cpu":
                    items.extend((ptr, nb, c, -1))

        # parameter groups added mid-slice are found at the end; a parameter whose .data was
        # replaced (model.half()) at a look at the gradients, which walks them anyway
        self._refresh_params(force=final or (grads and self._params_moved()))
        if self._params_new or final:
            self._params_new = False
            slots = self._slots
            for p in self._live_params():  # with its slot: the replay follows a slot's storage
                for dev, ptr, nb, c, _ in self._storages((p,), "parameters"):
                    if dev == "cpu":
                        items.extend((ptr, nb, c, slots.get(id(p), -1)))
            add(self._storages(self._live_buffers(), _BUFFER))
        if grads or final:
            slots, watched = self._slots, self._grads_watched
            for p in self._live_params():
                g = _local(p.grad) if p.grad is not None else None
                if g is not None and g.is_cpu:
                    for part in ((g,) if g.layout is torch.strided else _parts(g)):
                        try:
                            s = part.untyped_storage()
                            ptr, nbytes = s.data_ptr(), s.nbytes()
                        except RuntimeError:  # a storage a framework freed or swapped (FSDP2): nothing alive
                            continue
                        if nbytes:
                            slot = slots.get(id(p), -1)
                            items.extend((ptr, nbytes, "gradients", slot))
                            # a gradient first seen may predate the slice (not a sparse one's
                            # parts: its indices may be a view of the loop's input, which outlives it)
                            if slot not in watched and part is g:
                                watched.add(slot)
                                self._watch(g, ptr, nbytes)
            items += self._engine_gradients()
            if grads and not final:  # a look right after a backward: its result is that pass's pattern
                self._grads_seen_at.append(len(self.observations))
        fp = self._opt_fingerprint()
        if fp != self._opt_key or final:
            if (not final and self._opt_key and [k for k in fp if type(k) is tuple]
                    == [k for k in self._opt_key if type(k) is tuple]):
                # the same optimizers with as many states, new tensors: an optimizer that makes its
                # state anew at each step (LBFGS's history and direction); observed at every look
                # from now on, or the new tensors read as other (up to 23 of 25 MB)
                self._state_replaced = True
                self._look_next()
            self._opt_key = fp
            add(self._storages(self._opt_state_tensors(), "optimizer_state"))
        if grads or final or self._state_replaced:
            outside = self._scan_outside()
            if outside is None and final:
                outside = self._storages(self._opt_outside_tensors(), "optimizer_state")
            if outside:
                add(outside)
        own = self.rec.own_tensors
        if len(own) > self._own_seen:
            add(self._storages(own[self._own_seen:], _OWN))
            self._own_seen = len(own)
        if final:
            add(self._storages([t for r in self._batch if (t := r()) is not None], "data"))
        if grads and not final and not items:
            items.extend((0, 0, "gradients", -1))  # none alive: still a look at the gradients
        self._add_observation(items)

    def _deepspeed_engines(self) -> list[Any]:
        """The DeepSpeed engines among the loop's models (none where DeepSpeed is not imported)."""
        cls = getattr(sys.modules.get("deepspeed.runtime.engine"), "DeepSpeedEngine", None)
        return [m for m in self.rec.models.live() if isinstance(m, cls)] if isinstance(cls, type) else []

    def _engine_gradients(self) -> list[Any]:
        """Observation items (address, bytes, ``gradients``, -1) for the gradients a DeepSpeed
        engine among the loop's models holds outside ``.grad``: ZeRO-1/2 accumulate a micro-batch's
        into their own flat buffers (``offload.deepspeed_gradient_tensors``), which had read
        temporaries at a backward's exit and other at the step's enter (160,800 B of a 2-rank
        ZeRO-2 engine's, gradients 0). Walked at the looks at the gradients only; nothing where
        the loop imported no DeepSpeed."""
        items: list[Any] = []
        seen: set[int] = set()
        for m in self._deepspeed_engines():
            for t in deepspeed_gradient_tensors(m):
                if not t.is_cpu:
                    continue
                try:
                    s = t.untyped_storage()
                    ptr, nbytes = s.data_ptr(), s.nbytes()
                except RuntimeError:  # a storage freed or swapped: nothing alive
                    continue
                if nbytes and ptr not in seen:
                    seen.add(ptr)
                    items.extend((ptr, nbytes, "gradients", -1))
        return items

    def _add_observation(self, items: list[Any]) -> None:
        if items and self._streaming():
            self.observations.append(items)
            self._mark(_OBS, len(self.observations) - 1)

    def _known_sets(self) -> dict[tuple[str, str], int]:
        """Bytes per (device, category) of unique storages walked from the tensors. Used at every
        boundary only where no CPU stream can be replayed (a torch profiler owns it, a loop in
        another thread) or a CUDA device is in use. Parameters, buffers, optimizer state and
        tpkit's own tensors are walked again only when they changed (the model set, the
        optimizer state's fingerprint, new own tensors); gradients only when a gradient tensor
        or its address changed (they change at a backward pass and at ``zero_grad``, and a
        boundary comes ten or more times a step: walking GPT-2 small's 148 took ~120 us each
        time here); the batch every time."""
        self._refresh_params()
        key = (self._params_version, self._opt_fingerprint(), len(self.rec.own_tensors), self._outside_version)
        if self._static_key != key:
            self._static_key = key
            items: list[tuple[torch.Tensor, str | None]] = [(p, "parameters") for p in self._live_params()]
            items += [(t, "optimizer_state") for t in self._opt_state_tensors()]
            if self._outside_key:
                items += [(t, "optimizer_state") for t in self._opt_outside_tensors()]
            items += [(b, None) for b in self._live_buffers()]
            items += [(t, _OWN) for t in self.rec.own_tensors]
            self._static_seen = set()
            self._static_known = self._count(items, self._static_seen, {})
        grads = [g for r in self._params if (p := r()) is not None and (g := p.grad) is not None]
        try:  # the same tensors at the same addresses hold the same storages
            grads_key: tuple | None = (key, list(map(id, grads)),
                                       [(g if type(g) is torch.Tensor else _local(g)).data_ptr() for g in grads])
        except Exception:  # a tensor without an address to read (an exotic subclass): walk them
            grads_key = None
        if grads_key is None or grads_key != self._grads_key:
            self._grads_key = grads_key
            self._grads_seen = set(self._static_seen)
            self._grads_known = self._count([(g, "gradients") for g in grads], self._grads_seen,
                                            dict(self._static_known))
        items = [(t, "data") for r in self._batch if (t := r()) is not None]
        return self._count(items, set(self._grads_seen) if items else self._grads_seen,
                           dict(self._grads_known))

    def _count(self, items: list[tuple[torch.Tensor, str | None]], seen: set[tuple[str, int]],
               known: dict[tuple[str, str], int]) -> dict[tuple[str, str], int]:
        """Add the unique storages of ``items`` to ``known`` (``seen``: storages counted already)."""
        for t, category in items:
            t = _local(t)
            if t.layout is not torch.strided and len(parts := _parts(t)) > 1:  # sparse
                self._count([(part, category) for part in parts], seen, known)
                continue
            try:
                s = t.untyped_storage()
                ptr = s.data_ptr()
                dev = "cpu" if t.is_cpu else self._device(t)
            except Exception:  # meta, fake or exotic tensor subclasses: nothing allocated to count
                continue
            key = (dev, ptr)
            if key in seen:
                continue
            nbytes = s.nbytes()
            if nbytes == 0:
                continue
            seen.add(key)
            if category is not None:  # buffers: only so that a storage shared with them counts once
                k = (dev, category)
                known[k] = known.get(k, 0) + nbytes
        return known

    # -- after the slice: replay and rows ---------------------------------------------------
    def _replay(self, events: list[tuple[int, int]]) -> tuple[dict[int, _Levels], dict[int, _Levels], dict[int, int]]:
        """Replay the CPU stream. Returns the levels at each boundary whose marker was found, for
        each boundary the levels at the highest instant between it and the next boundary, and
        where each found boundary's marker is in the stream (position -> boundary).

        Pass 1 gives every block allocated in the slice an id and, from the observations, a
        category: a known storage found alive counts as known from its allocation (a gradient
        of a hooked parameter from the instant it was stored in ``.grad``); one not in the
        stream (made before the slice) counts from the slice's start (``data``: from when it
        was seen). Pass 2 walks the stream again with running totals per category."""
        marks, bounds, obs = self.marks, self.bounds, self.observations
        n_marks, n = len(marks), len(events)
        pool = self._pool_flat
        n_pool = len(pool) >> 1
        pk = 0  # marker storages whose allocation was passed
        live: dict[int, int] = {}
        size: list[int] = []
        made_in: list[int] = []  # where each block was allocated: 4 forward side, 5 backward, 6 elsewhere
        tag: list[str | None] = []
        alloc_at: list[int] = []
        known_at: list[int] = []
        ids = [-1] * n
        at_bound: dict[int, int] = {}  # event position -> boundary
        hooks: dict[int, list[int]] = {}  # parameter slot -> positions where its .grad was stored
        ends: dict[int, list[int]] = {}  # position -> blocks from before the slice that ended there
        came_back: dict[int, int] = {}  # block from before the slice -> where its address came back
        slot_of: dict[int, int] = {}  # gradient block -> its parameter's slot
        outside_data: dict[int, int] = {}  # batch blocks not in the stream -> their address
        freed_at: dict[int, int] = {}  # block -> position of its free
        freed_in_backward: set[int] = set()  # blocks a backward pass freed (what it consumed)
        # gradient block -> the last boundary before the observation that found it (or its allocation)
        grad_seen_at: dict[int, int] = {}
        # parameter slot -> (its storage's block, address, the observation's position) as last found
        param_at: dict[int, tuple[int, int, int]] = {}
        last_bound = -1  # position of the last boundary marker passed
        # backward passes: [enter, the look after it, blocks allocated], the look being the next
        # optimizer or forward enter: gradients made after the backward (an fp32 master copy's,
        # set by hand) are the pass's too
        spans: list[list[Any]] = []
        after_bwd = False  # from a backward's exit to the look after it
        merged_looked = False  # whether the pass a second backward joined was looked at
        looked: list[bool] = []  # whether the gradients were looked at after each backward pass
        span_ids: list[int] = []
        span_start = 0
        grads_seen = set(self._grads_seen_at)

        # gradient block -> the end of the backward pass it was made in (the look after it):
        # filled once the stream is read, for ``first_hook``
        pass_end: dict[int, int] = {}

        def first_hook(slot: int, after: int, block: int = -1) -> int:
            """The first grad-set marker of ``slot`` after ``after`` (a gradient's allocation);
            ``after`` where there is none, or (``block``: its index, once the stream is read)
            where that marker comes after the end of the backward pass the block was made in:
            it is a later pass's. A parameter unfrozen mid-slice gets its hook at the look after
            its first backward, and the gradient had read temporaries through that backward (its
            peak: 2,918,404 B of temporaries for 38,404), with ``set_to_none=False`` too (the
            block never freed). A marker inside the pass is the block's own, also after its free
            (an optimizer stepped in an earlier hook of the loop's dropped it)."""
            pos = hooks.get(slot)
            if not pos:
                return after
            h = bisect.bisect_right(pos, after)
            if h == len(pos) or (block >= 0 and pos[h] > pass_end.get(block, 1 << 62)):
                return after
            return pos[h]

        j = 0
        bwd_depth = fwd_depth = 0
        loss_gap = False  # from a forward's exit to the next backward (or another phase): the loss is made
        no_grad = self._no_grad_forward_enters(bounds)
        gap_at_no_grad: bool | None = None  # the gap as it was when the open forward (one without grad) began
        gap_paused = False  # an optimizer span (zero_grad) entered inside that gap
        wait_exit = -1  # the stream index of a data_wait exit when it is the last boundary passed
        for i, (ptr, sz) in enumerate(events):
            if j < n_marks and sz < 0 and ptr == marks[j][0] and -sz == marks[j][1] and marks[j][4] < pk:
                _, _, kind, idx, _ = marks[j]
                j += 1
                if kind == _BOUND:
                    last_bound = i
                    phase, event = bounds[idx][0], bounds[idx][1]
                    # the loaders report a batch right after their data_wait closes: one made
                    # outside the stream is data at that exit already (beside the one before it)
                    wait_exit = i if (phase == "data_wait" and event == "exit") else -1
                    if phase == "forward":
                        # a forward without grad (an evaluation, a teacher's targets) makes no loss:
                        # it neither opens the gap (the loop's batch copies after an evaluation had
                        # read activations) nor ends one (the loss made after a teacher's forward)
                        if event == "enter":
                            fwd_depth += 1
                            gap_at_no_grad = loss_gap if idx in no_grad else None
                            loss_gap = False
                        else:
                            fwd_depth -= 1
                            loss_gap = (gap_at_no_grad is None or gap_at_no_grad) and fwd_depth == 0
                            gap_at_no_grad = None
                    elif event == "enter" and phase in _ENDS_LOSS_GAP:
                        # a zero_grad() between the forward and the loss (Lightning's closure,
                        # loops that zero there) pauses the gap, never ends it: the loss made
                        # after it (a large vocabulary's log-softmax, saved for backward) had
                        # read other at the peak
                        gap_paused = loss_gap and phase == "optimizer"
                        loss_gap = False
                    elif event == "exit" and phase == "optimizer" and gap_paused:
                        loss_gap, gap_paused = True, False
                    if phase == "backward":
                        bwd_depth += 1 if event == "enter" else -1
                        if event == "enter" and bwd_depth == 1:
                            if after_bwd:
                                # another backward before any look (a second loss's, an input
                                # gradient's): one pass with the one before, whose gradients
                                # the look after both finds (a second backward making no
                                # parameter gradient had left the first's read 0 B between looks)
                                span_start, _, span_ids = spans.pop()
                                merged_looked, after_bwd = looked.pop(), False
                            else:
                                span_ids, span_start = [], i
                        elif event == "exit" and bwd_depth == 0:
                            spans.append([span_start, i, span_ids])
                            looked.append(merged_looked)
                            merged_looked = False
                            after_bwd = True
                    elif after_bwd and event == "enter" and phase in _LOOK_AT:
                        spans[-1][1], after_bwd = i, False  # where the gradients are looked at
                    at_bound[i] = idx
                elif kind == _GRAD_SET:
                    hooks.setdefault(idx, []).append(i)
                elif kind == _GONE:
                    gptr, gnb = self.gone[idx]
                    a = live.get(gptr)
                    if a is not None and alloc_at[a] < 0 and size[a] == gnb:
                        del live[gptr]  # a block from before the slice ended here
                        ends.setdefault(i, []).append(a)
                else:
                    if idx in grads_seen and looked:
                        looked[-1] = True  # the look right after that backward pass
                    items = obs[idx]
                    if "data" in items:
                        # a batch made outside the stream (another thread) has no free event:
                        # it counts until a batch that does not hold it is handed out (one in
                        # shared memory, a worker process's, is watched instead: see _storages)
                        batch = {items[q] for q in range(0, len(items), 4) if items[q + 2] == "data"}
                        for a, dptr in list(outside_data.items()):
                            if dptr not in batch:
                                del outside_data[a]
                                if live.get(dptr) == a:
                                    del live[dptr]
                                    ends.setdefault(i, []).append(a)
                    moved: list[tuple[int, int, int, int]] = []  # (the block before, its address, seen at, the new one)
                    for q in range(0, len(items), 4):
                        optr, onb, cat, slot = items[q:q + 4]
                        if not onb:
                            continue
                        a = live.get(optr)
                        if a is None:  # made before the slice (or in another thread)
                            a = len(size)
                            live[optr] = a
                            size.append(onb)
                            made_in.append(4)
                            tag.append(cat)
                            alloc_at.append(-1)
                            known_at.append((wait_exit if wait_exit >= 0 else i) if cat == "data" else -1)
                            # watched as of when it was seen (_storages): asked after the
                            # slice, a dead worker batch's address was no longer watched, and the
                            # batch had read ended at the next hand-out (720 B held read 432 B)
                            if cat == "data" and slot != _WATCHED:
                                outside_data[a] = optr
                        elif tag[a] is None and size[a] == onb:
                            tag[a] = cat
                            known_at[a] = alloc_at[a]
                            if cat == "gradients":
                                slot_of[a] = slot
                                known_at[a] = first_hook(slot, alloc_at[a])
                                grad_seen_at[a] = max(alloc_at[a], last_bound)
                        if cat == "parameters" and slot >= 0:
                            before = param_at.get(slot)
                            param_at[slot] = (a, optr, i)
                            if before is not None and before[0] != a:
                                moved.append((*before, a))
                    for was, optr, seen, now in moved:
                        # a parameter's .data replaced (model.half()): its storage from before the
                        # slice, which has no free event, ends where the new one was made (at the
                        # look that last found it, if later), unless a parameter still holds it
                        if not (alloc_at[was] < 0 <= alloc_at[now] and all(b[0] != was for b in param_at.values())):
                            continue
                        end = max(alloc_at[now], seen)
                        if live.get(optr) == was:
                            del live[optr]
                            ends.setdefault(end, []).append(was)
                        elif came_back.get(was, -1) > end:
                            # its address came back to a block of the loop's before this look
                            # found the move: ended there, it had read parameters beside the new
                            # storage from the cast to that block (2,048 B of an fp32 bias)
                            ends[came_back.pop(was)].remove(was)
                            ends.setdefault(end, []).append(was)
                continue
            if sz > 0:
                old = live.get(ptr)
                if old is not None:
                    # the block at this address ended before the address came back: one from
                    # before the slice, or one whose free no event shows (freed in a thread the
                    # stream does not follow)
                    del live[ptr]
                    ends.setdefault(i, []).append(old)
                    outside_data.pop(old, None)
                    if alloc_at[old] < 0:
                        came_back[old] = i
                if pk < n_pool and ptr == pool[2 * pk] and sz == pool[2 * pk + 1]:
                    pk += 1  # a marker storage made: tpkit's, counted nowhere
                    continue
                a = len(size)
                live[ptr] = a
                size.append(sz)
                made_in.append(5 if bwd_depth > 0 else 4 if (fwd_depth > 0 or loss_gap) else 6)
                tag.append(None)
                alloc_at.append(i)
                known_at.append(i)
                ids[i] = a
                if bwd_depth > 0 or after_bwd:
                    span_ids.append(a)
            else:
                a = live.pop(ptr, None)  # None: a block from before the slice, not in the stream
                if a is not None:
                    ids[i] = a
                    freed_at[a] = i
                    if bwd_depth > 0:
                        freed_in_backward.add(a)
        pass_end.update((a, end) for _, end, blocks in spans for a in blocks)
        for a, seen in grad_seen_at.items():
            # in .grad from the boundary before the observation that found it, at the latest (the
            # observation of an optimizer stepped in backward comes right after its enter): a
            # hook of the loop's that ran before tpkit's and dropped the gradient left tpkit's
            # grad-set marker after its free
            known_at[a] = min(first_hook(slot_of[a], alloc_at[a], a), seen)
        self._template_gradients(spans, looked, size, tag, known_at, alloc_at, slot_of, freed_at, first_hook)

        # pass 2: running totals in c = [parameters, gradients, optimizer_state, data, rest of the forward
        # side, rest made in backward, rest made elsewhere]
        index = {"parameters": 0, "gradients": 1, "optimizer_state": 2, "data": 3, _BUFFER: 6, _OWN: -2}
        c = [0] * 7
        where = [-1] * len(size)  # the counter each block is in now
        moves: dict[int, list[int]] = {}
        for a, t in enumerate(tag):
            if t is None:
                continue
            if known_at[a] < 0:
                where[a] = index[t]
                if where[a] >= 0:
                    c[where[a]] += size[a]
            elif known_at[a] != alloc_at[a]:
                moves.setdefault(known_at[a], []).append(a)
        total = sum(c)

        def snap() -> _Levels:
            return _Levels({"parameters": c[0], "gradients": c[1], "optimizer_state": c[2], "data": c[3]},
                           c[4], c[5], c[6])

        levels: dict[int, _Levels] = {}
        seg: dict[int, _Levels] = {}
        k_open: int | None = None
        best_total = -1
        best: _Levels | None = None
        # blocks of the forward side (c[4]) alive when a later step's first forward begins are
        # held across steps (a list of losses, outputs kept for a log, a retained graph): other
        # from there, not that step's activations (7 MiB of a leak read as activations at its
        # peak); not those a backward frees (a GAN's generator graph, made before the
        # discriminator's step ends the step and consumed by the generator's backward after it)
        forward_side: set[int] = set()
        step_of_forward = -1
        for i in range(n):
            a = ids[i]
            if i in ends:
                for b in ends[i]:
                    if where[b] >= 0:
                        c[where[b]] -= size[b]
                        total -= size[b]
                    where[b] = -1
            if a < 0:
                for b in moves.get(i, ()):
                    if where[b] >= 0:
                        c[where[b]] -= size[b]
                        total -= size[b]
                    where[b] = index[tag[b]]  # type: ignore[index]
                    if where[b] >= 0:
                        c[where[b]] += size[b]
                        total += size[b]
                k = at_bound.get(i)
                if k is not None:
                    phase, event, raw_step = bounds[k][0], bounds[k][1], bounds[k][2]
                    if phase == "forward" and event == "enter" and raw_step > step_of_forward:
                        step_of_forward = raw_step
                        kept = set()
                        for b in forward_side:
                            if where[b] == 4:
                                if b in freed_in_backward:
                                    kept.add(b)
                                    continue
                                where[b] = 6
                                c[4] -= size[b]
                                c[6] += size[b]
                        forward_side = kept
                    if k_open is not None and best is not None:
                        seg[k_open] = best
                    levels[k] = best = snap()
                    best_total, k_open = total, k
                continue
            if events[i][1] > 0:
                t = tag[a]
                w = where[a] = index[t] if (t is not None and known_at[a] == i) else made_in[a]
                if w < 0:
                    continue
                if w == 4:
                    forward_side.add(a)
                c[w] += size[a]
                total += size[a]
                if total > best_total:
                    best_total, best = total, snap()
            elif where[a] >= 0:
                c[where[a]] -= size[a]
                total -= size[a]
                where[a] = -1
        if k_open is not None and best is not None:
            seg[k_open] = best
        return levels, seg, at_bound

    def _no_grad_forward_enters(self, bounds: list[tuple[str, str, int, int]]) -> set[int]:
        """The boundaries that began a forward run without grad: each one's is the last forward
        enter noted before the phase probe's stamp (``Recorder.no_grad_forwards``, taken right
        after the enter; the counter's clock is perf_counter_ns's)."""
        stamps = self.rec.no_grad_forwards
        if not stamps:
            return set()
        enters = [k for k, b in enumerate(bounds) if b[0] == "forward" and b[1] == "enter"]
        times = [bounds[k][3] for k in enters]
        out = set()
        for t in stamps:
            f = bisect.bisect_right(times, t) - 1
            if f >= 0:
                out.add(enters[f])
        return out

    def _stream_cuda_peaks(self, at_bound: dict[int, int]) -> None:
        """Each stretch between two boundaries found one after the other in the stream gets its
        CUDA peak from the allocator's own reports in it (``CpuAllocatorStream.cuda_levels``):
        the caching allocator reports every allocation and free to the profiler with the
        device's allocated bytes, so the highest of those and of the stretch's two boundary
        levels is the stretch's peak, whether a report carries the level before its event or
        after it. The process's peak counter (never reset by tpkit) gives that only where a
        stretch set a new high; here every stretch is read (docs/GPU_RUNS.md).

        Only what the profiler heard: the loop's thread and the threads torch runs its work in
        (autograd's, intra-op) report; a CUDA allocation made in a thread of the user's own
        shows in the levels reported after it, but a transient there between two reports is
        missed. A stretch whose level changed with no report of that device inside it (an
        allocator that does not report, or a thread that was not heard) keeps the boundary
        reading and its lower-bound flag."""
        levels = getattr(self.cpu, "cuda_levels", None)
        if not levels or not self.cuda_reads:
            return  # no CUDA device in use, or its allocator was not heard
        found = sorted(at_bound.items())  # (position in the CPU stream, boundary)
        positions = [i for i, _ in found]
        highest: dict[tuple[int, str], int] = {}  # (boundary that ends the stretch, device) -> level
        for pos, index, total in levels:
            f = bisect.bisect_left(positions, pos)  # the first boundary after the report
            if f < len(found):
                key = (found[f][1], f"cuda:{index}")
                if total > highest.get(key, -1):
                    highest[key] = total
        reporting = {dev for _, dev in highest}  # devices whose allocator was heard at all
        for f, (_, k) in enumerate(found):
            if (found[f - 1][1] if f else -1) != k - 1:
                continue  # the boundary before was not found in the stream: not one stretch
            for dev, (now, peak, _) in self.cuda_reads.get(k, {}).items():
                before = self.cuda_reads.get(k - 1, {}).get(dev) if k else self._cuda_baseline.get(dev)
                heard = highest.get((k, dev))
                if dev not in reporting or before is None or (heard is None and before[0] != now):
                    continue
                self.cuda_reads[k][dev] = (now, max(peak, heard if heard is not None else 0), True)

    def _template_gradients(self, spans: list[list[Any]], looked: list[bool], size: list[int],
                            tag: list[str | None], known_at: list[int], alloc_at: list[int],
                            slot_of: dict[int, int], freed_at: dict[int, int], first_hook: Any) -> None:
        """Gradients of the backward passes after which they were not looked at: a looked-at
        pass gives a pattern, the sizes (and parameter slots) of the gradient blocks it
        allocated (up to the look after it), in order; a pass whose blocks alive at its end contain that sequence of sizes
        (in order) gets those blocks as its gradients. The longest pattern that fits is taken
        (with accumulation, the micro-batch that allocates the gradients fits the full one)."""
        patterns: dict[tuple[int, ...], list[int]] = {}
        for (_, _, blocks), seen in zip(spans, looked):
            if seen:
                grads = [a for a in blocks if tag[a] == "gradients"]
                patterns.setdefault(tuple(size[a] for a in grads), [slot_of.get(a, -1) for a in grads])
        ordered = sorted(patterns.items(), key=lambda kv: -len(kv[0]))
        # parameters frozen in the slice's last passes, before a full read of requires_grad
        # found it (_trainable_changed): no look gave their pattern. Each pattern cut down to
        # the parameters that require grad at the slice's end is tried after every real one
        # (a freezing 1-2 passes before the end had read as temporaries, with a note)
        trainable = {self._slots[id(p)] for p in self._live_params()
                     if p.is_cpu and p.requires_grad and id(p) in self._slots}
        cut: dict[tuple[int, ...], list[int]] = {}
        for sizes, slots in ordered:
            keep = [k for k, slot in enumerate(slots) if slot < 0 or slot in trainable]
            if 0 < len(keep) < len(sizes):
                cut.setdefault(tuple(sizes[k] for k in keep), [slots[k] for k in keep])
        ordered[len(ordered) - (() in patterns):len(ordered) - (() in patterns)] = sorted(
            (kv for kv in cut.items() if kv[0] not in patterns), key=lambda kv: -len(kv[0]))  # before the empty one
        missed = 0
        for (_, end, blocks), seen in zip(spans, looked):
            if seen or any(tag[a] == "gradients" for a in blocks):
                continue  # looked at, or its gradients observed inside it (_observe_stepped_gradients)
            alive = [a for a in blocks if tag[a] is None and freed_at.get(a, 1 << 62) > end]
            for sizes, slots in ordered:
                if not sizes:
                    break
                found: list[int] = []
                k = 0
                for a in alive:
                    if k < len(sizes) and size[a] == sizes[k]:
                        found.append(a)
                        k += 1
                if k == len(sizes):
                    for a, slot in zip(found, slots):
                        tag[a] = "gradients"
                        known_at[a] = first_hook(slot, alloc_at[a], a)
                    break
            else:
                missed += 1 if ordered else 0
        if missed:
            self.rec.note(f"memory: the gradients of {missed} backward pass(es) could not be told from autograd "
                          "temporaries (their allocations did not follow a pattern seen); counted as "
                          "temporaries/other there")

    def _backfill_walks(self) -> None:
        """Walked boundaries before the model was known get the parameters seen first (alive
        already unless the model was built inside the loop after the slice began)."""
        order = sorted(self.walks)
        first = next((k for k in order if any(c == "parameters" for _, c in self.walks[k])), None)
        if first is None:
            return
        params = {key: v for key, v in self.walks[first].items() if key[1] == "parameters"}
        for k in order:
            if k == first:
                break
            self.walks[k].update(params)

    def _emit(self, events: list[tuple[int, int]]) -> None:
        bounds = self.bounds
        if not bounds:
            return
        self._backfill_walks()
        levels, seg, found = self._replay(events) if events else ({}, {}, {})
        self._stream_cuda_peaks(found)  # before the CUDA peaks are judged (_cuda_peaks_bounded)
        devices = ["cpu"] + [f"cuda:{i}" for i in sorted(self._cuda_in_use)]

        def level(k: int, dev: str) -> _Levels | None:
            if dev == "cpu":
                if k in levels:
                    return levels[k]
                if k in self.walks:
                    return _Levels({c: self.walks[k].get(("cpu", c), 0) for c in KNOWN_MEMORY_CATEGORIES}, None)
                return None
            if k not in self.walks:
                return None
            known = {c: self.walks[k].get((dev, c), 0) for c in KNOWN_MEMORY_CATEGORIES}
            read = self.cuda_reads.get(k, {}).get(dev)
            own = self.walks[k].get((dev, _OWN), 0)
            rest = None if read is None else max(0, read[0] - sum(known.values()) - own)
            return _Levels(known, rest)

        add = self.rec.add_memory

        # CUDA: what the allocator holds beyond the known sets when a forward begins is held
        # across steps (cuBLAS's workspaces, 32 MiB per handle on an H200, made at the first
        # matmul of each thread; a user's caches), not the forward's: activations are what the
        # forward and backward hold beyond it (docs/GPU_RUNS.md)
        held: dict[str, int] = {}

        def rows(lv: _Levels, event: str, dev: str, phase: str, raw_step: int, t_ns: int, in_backward: bool) -> None:
            rest: dict[str, int] = {}
            if lv.rest is not None:
                if phase in ACTIVATION_PHASES or in_backward:
                    base = min(held.get(dev, 0), lv.rest)
                    rest = {"activations": lv.rest - base, "temporaries": lv.rest_backward,
                            "other": base + lv.rest_elsewhere}
                else:
                    rest = {"activations": 0, "temporaries": 0, "other": lv.rest + lv.rest_backward + lv.rest_elsewhere}
            for c in MEMORY_CATEGORIES:
                if c in lv.known:
                    add(phase, event, dev, c, int(lv.known[c]), t_ns=t_ns, raw_step=raw_step)
                elif c in rest:
                    add(phase, event, dev, c, max(0, int(rest[c])), t_ns=t_ns, raw_step=raw_step)

        self._bounded = self._cuda_peaks_bounded()
        for dev, how in self._bounded.items():
            self.rec.note(f"memory: {dev} peaks are lower bounds in {how}")
        stack: list[int] = []
        in_backward = 0  # backward spans open: a boundary inside one (an optimizer stepped in
        # backward) has backward's activations and temporaries alive
        for k, (phase, event, raw_step, t_ns) in enumerate(bounds):
            for dev in devices:
                lv = level(k, dev)
                if lv is not None:
                    if dev != "cpu" and phase == "forward" and event == "enter" and lv.rest is not None:
                        held[dev] = lv.rest
                    rows(lv, event, dev, phase, raw_step, t_ns, in_backward > 0)
            if phase == "backward":
                in_backward += 1 if event == "enter" else -1
            if event == "enter":
                stack.append(k)
                continue
            while stack and bounds[stack[-1]][0] != phase:
                stack.pop()  # an enter whose exit never came (cannot happen with Recorder.exit)
            if not stack:
                continue
            k0 = stack.pop()
            for dev in devices:
                pk = self._peak(k0, k, dev, level, seg)
                if pk is not None:
                    rows(pk, "peak", dev, phase, bounds[k0][2], t_ns, in_backward > 0)

    def _peak(self, k0: int, k1: int, dev: str, level: Any, seg: dict[int, _Levels]) -> _Levels | None:
        """The levels at the highest instant of the span from boundary k0 to k1. CPU: the
        replayed instant itself. CUDA: the highest per-stretch peak, its known sets taken from
        the span's higher boundary (an approximate mix, said in ``meta["memory"]``)."""
        lv0, lv1 = level(k0, dev), level(k1, dev)
        if lv0 is None or lv1 is None or lv0.rest is None or lv1.rest is None:
            return None
        best = lv0 if lv0.total >= lv1.total else lv1
        if dev == "cpu":
            for j in range(k0, k1):
                s = seg.get(j)
                if s is not None and s.total > best.total:
                    best = s
            return best
        ref = best
        peak = best.total
        for j in range(k0 + 1, k1 + 1):
            read = self.cuda_reads.get(j, {}).get(dev)
            if read is not None:
                peak = max(peak, read[1])
        return _Levels(dict(ref.known), peak - sum(ref.known.values()))
