"""tpkit's CPU allocation counter: every CPU allocation and free of the loop's thread, in order,
for less than torch's profiler stream costs per event.

Why: exact CPU memory needs every allocation and free of the step. torch's CPU allocator tells
its profiler about each one when memory profiling is on (``memory.CpuAllocatorStream``), and that
report costs ~150-200 ns an event inside a real step: a lock and a hash map in torch's
reporter, the profiler's thread-local lookups. A 2-layer GPT-2 step under Lightning makes ~1,200
such events in ~10 ms, so the report alone was ~2.3% of the step, most of what the default
profile cost there (docs/OVERHEAD.md). The only other place that sees every CPU allocation is
the allocator itself, and torch lets C++ replace it (``c10::SetCPUAllocator``).

How (``allocator_counter.cpp``): a C++ allocator is put in front of the CPU allocator installed
(torch's default, with its alignment, zero-fill and NUMA settings, still does the allocating).
While the thread that started a slice records, each block it allocates gets a 64-byte header in
front of the bytes handed out, which holds the block's size, so a free finds it without a
lookup, and ``(address, bytes)`` of each allocation and free goes on a list. Every other call
(other threads, or no slice) passes straight through: one virtual call and one atomic read.
The counter stays in front for the rest of the process once it went in: a block made through
``raw_allocate`` (oneDNN's) is freed by looking the CPU allocator up again, so taking it out
could hand the allocator underneath an address it never gave out. Its raw free tells its own
blocks from others by two check words in the header, which a free wipes.

It is built from source with torch's C++ extension builder the first time a slice needs it (a
C++ compiler and ninja; ~6 s on a 2-core VM, then loaded from torch's extension cache in ~10 ms
on later runs and in later processes, per machine and torch version). When it cannot be built or
installed the probe uses the profiler stream and the run says why.

What it sees is what the profiler stream sees. Operators allocate through the CPU allocator in
use; storages made from Python (``torch.UntypedStorage(n)``: a tensor's deep copy, a storage's
``clone()``) go to torch's default allocator directly, so while recording a CPU storage made
from Python is given the counter as its allocator (``torch.UntypedStorage.__new__``, put back at
the end). Two ways past it remain, said plainly: a storage made from a buffer
(``UntypedStorage.from_buffer``), and one made before the counter first went in and grown
during a slice (``resize_``), come from the default allocator, which the counter does not see
(the stream does: that allocator reports them).

A torch profiler run by the user inside the slice would see each block 64 bytes larger, so the
counter stops, and its events are dropped, when one starts (as the stream's are: the run falls
back to the known sets and says so). tpkit's own operator trace (``--ops``: ``ops.py``) records
no memory, so the counter records on through it: with the counter a run can have both.

Only the CPU: on a machine with an accelerator the probe keeps the profiler stream, which also
carries the CUDA caching allocator's reports.

The counter also keeps the memory probe's phase boundaries while it records. At each boundary
the probe notes ``(phase, event, raw step, time)`` and writes a marker into the list. Written
in Python that listener cost 4-6 us a boundary inside real steps, ~13 boundaries a Lightning
step, about half of what the memory probe cost the step (docs/OVERHEAD.md, "Boundaries noted in
C++"). ``boundary`` does both in one C call (~0.8 us there) and calls the probe's Python only
where it has more to do; the probe reads the notes back when the slice ends.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from pathlib import Path
from threading import Lock
from typing import Any, Callable, Iterator

import torch
from torch.autograd import profiler as _autograd_profiler
from torch.autograd import profiler_legacy as _autograd_profiler_legacy

from .native import failure_text
from .patching import Patches

SOURCE = Path(__file__).with_name("allocator_counter.cpp")
#: The extension's name in torch's extension cache (``TORCH_EXTENSIONS_DIR``), with a hash of its
#: source and of where that lies: two tpkit versions or checkouts on one machine each keep their
#: own build. Under one name each rebuilt the other's in turn (its build file names the source's
#: path), 6-16 s at every first slice of a process, and a process could load the other's build.
EXTENSION_NAME = "tpkit_cpu_allocation_counter_" + hashlib.sha256(
    SOURCE.read_bytes() + str(SOURCE.resolve()).encode()).hexdigest()[:12]
#: A load slower than this compiled the extension (a cached load takes ~10 ms): the run says so.
BUILT_AFTER_S = 1.0

_lock = Lock()
_module: Any = None
_failure: str | None = None  # why it could not be built, once per process (no second compile)
_own_profiler_starting = False  # see own_profiler_start


def before_profiler_starts(patches: Patches, first: Callable[[], None]) -> None:
    """Run ``first`` before any torch profiler started from Python starts (each looks one of
    these names up in its module at its start); undone by ``patches``."""
    def wrap(enable: Any) -> Any:
        def enable_profiler(*args: Any, **kwargs: Any) -> Any:
            first()
            return enable(*args, **kwargs)
        return enable_profiler

    for module, name in ((_autograd_profiler, "_enable_profiler"),
                         (_autograd_profiler_legacy, "_enable_profiler_legacy")):
        patches.set(module, name, wrap(getattr(module, name)))


@contextlib.contextmanager
def own_profiler_start() -> Iterator[None]:
    """Around the start of tpkit's own torch.profiler (the ops probe's): it records no memory,
    so it never sees the counter's headers, and the counter records on through it."""
    global _own_profiler_starting
    _own_profiler_starting = True
    try:
        yield
    finally:
        _own_profiler_starting = False


def load() -> tuple[Any | None, str | None, float]:
    """The built extension, or None and why not; and the seconds this process's first load took
    (0.0 after it). Compiles it the first time on this machine and torch version."""
    global _module, _failure
    with _lock:
        if _module is not None or _failure is not None:
            return _module, _failure, 0.0
        t0 = time.perf_counter()
        try:
            from torch.utils.cpp_extension import load as load_extension

            _module = load_extension(EXTENSION_NAME, [str(SOURCE)], extra_cflags=["-O2"], verbose=False)
        except Exception as e:  # noqa: BLE001 - no compiler, no ninja, no headers: the stream instead
            _failure = failure_text(e)
            return None, _failure, 0.0
        return _module, None, time.perf_counter() - t0


class CpuAllocatorCounter:
    """CPU allocations and frees of the starting thread, as ``CpuAllocatorStream`` gives them:
    ``stop()`` returns ``(ptr, bytes)`` of each (bytes > 0 an allocation, < 0 a free) in order."""

    def __init__(self, ext: Any) -> None:
        self._ext = ext
        self.active = False
        self.events_seen = 0  # events in the last session
        self.cuda_levels: list[tuple[int, int, int]] = []  # the CPU only (same interface as the stream)
        self._patches = Patches()
        #: a torch profiler other than tpkit's own started: the counter stopped for it (the
        #: memory probe reads this at each boundary, in place)
        self.stopped_by_profiler = False
        #: ``write_marker(kind, index) -> bool``: the memory probe's next marker written into the
        #: list where it stands now, if this thread records (``allocator_counter.cpp``)
        self.write_marker = ext.write_marker
        #: ``boundary(phase, event, raw_step)``: the memory probe's phase listener while it
        #: ``listen``s: notes the boundary and writes its marker, calling the probe's Python only
        #: where that has more to do (``allocator_counter.cpp``, "the probe's phase boundaries")
        self.boundary = ext.boundary
        #: ``listen(models, cuda_in_use, at_boundary, look_after, look_at, boundary_kind,
        #: marker_base, marker_sizes)``: ``boundary`` notes from now on, markers and boundaries
        #: start anew; ``unlisten()`` lets the probe's objects go (the notes stay until ``forget``)
        self.listen = ext.listen
        self.unlisten = ext.unlisten
        #: ``skip_looks(count, sizes, optimizers, params, requires_grad)``: ``boundary`` answers the
        #: next ``count`` looks itself while nothing given changed (``MemoryProbe._let_counter_answer``)
        self.skip_looks = ext.skip_looks
        #: ``(phase, event, raw_step, t_ns)`` of each boundary noted since ``listen``
        self.boundaries = ext.boundaries
        #: ``(k, phase, event)`` of the last boundary noted, or None
        self.last_boundary = ext.last_boundary
        #: ``(address, bytes, kind, index)`` of each marker written since ``listen``
        self.markers = ext.markers
        #: ``forget()``: lets go of the notes (the probe calls it once it has read them back)
        self.forget = ext.forget

    def start(self) -> None:
        if torch._C._autograd._profiler_enabled():
            # the user's profiler would see each block 64 bytes larger (the header)
            raise RuntimeError("a torch profiler is already running")
        if not self._ext.install():  # in front from now on (see the module docstring)
            raise RuntimeError("another CPU allocator was installed with a higher priority than torch's "
                               "default, so tpkit's counter could not go in front of it")
        self.stopped_by_profiler = False
        base_new, counter = torch._C.StorageBase.__new__, self._ext.address()

        def storage_new(cls: Any, *args: Any, **kwargs: Any) -> Any:
            # a CPU storage made from Python goes through the counter (it passes through
            # when this is not the recording thread)
            if "allocator" not in kwargs:
                device = kwargs.get("device")
                if device is None or torch.device(device).type == "cpu":
                    kwargs.pop("device", None)  # torch takes an allocator or a device
                    kwargs["allocator"] = counter
            return base_new(cls, *args, **kwargs)

        self._patches.set(torch.UntypedStorage, "__new__", staticmethod(storage_new))
        self._ext.start()
        self.active = True

        before_profiler_starts(self._patches, self._give_way)

    def _give_way(self) -> None:
        """Before another profiler sees a block through the counter (tpkit's own ops trace excepted)."""
        if self.active and not self.stopped_by_profiler and not _own_profiler_starting:
            self.stopped_by_profiler = True
            self._ext.stop()  # what it recorded is dropped, as the stream's is (see the docstring)
            self.events_seen = 0

    def stop(self) -> list[tuple[int, int]]:
        """``(ptr, bytes)`` of every CPU allocation (bytes > 0) and free (< 0), in time order."""
        self._patches.restore()
        if not self.active:
            return []
        self.active = False
        if self.stopped_by_profiler:
            raise RuntimeError("another profiler started during the slice, and tpkit's CPU allocation "
                               "counter stopped for it")
        events: list[tuple[int, int]] = self._ext.stop()
        self.events_seen = len(events)
        return events
