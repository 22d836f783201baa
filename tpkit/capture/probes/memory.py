"""The memory probe: bytes per category per device at every phase boundary, and each phase's
peak.

Categories (DESIGN.md): ``parameters, gradients, optimizer_state, data`` are the *known sets*,
counted exactly from the tensors themselves at each boundary (unique storages, so tied weights
and views count once); ``activations`` (during forward/backward) or ``other`` (elsewhere) is
what the allocator holds beyond them, plus the model's buffers.

How the allocator is read:

- CUDA: ``torch.cuda.memory_allocated`` at each boundary and ``max_memory_allocated`` with the
  peak reset at each boundary, so every stretch between two boundaries has its own peak. No
  sync. ``--memory-detail`` also records the allocator's history and keeps the largest
  allocations alive at the slice's peak, with their Python stacks.
- CPU: torch's CPU allocator tells the profiler about every allocation and free when memory
  profiling is on. We switch on *only that*: the profiler runs with ``profile_memory=True`` and
  its op callbacks restricted to a record scope that no op uses, so no op events are kept (cost
  on the tiny transformer: ~5% of step CPU time, benchmarks/memory_overhead.py). At each boundary
  a marker allocation of an odd size is made and freed at once; after the slice the stream of
  allocations is replayed and cut at the markers, which gives the bytes alive at every boundary
  and the peak between any two of them, exactly. Only blocks allocated *during* the slice are
  in that stream; known storages found in it are not counted twice (matched by address and size),
  and known storages from before the slice are counted from the tensors.

Limits, said plainly: allocations made in other threads are not reported by the profiler (a
loader thread's batches are counted as ``data`` from the tensors, not from the stream); the
category mix *at a peak* takes the known sets from the phase boundary (enter or exit) with more
memory, and the rest is activations/other. The stream is a profiler session: with a
``torch.profiler`` already running, only the known sets are counted (the user's session is left
alone); one started inside the slice runs, ends the stream, and is noted. Parameters are known
from the model's first forward or its optimizer's first step (earlier boundaries are backfilled),
gradients and optimizer state from then on.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from dataclasses import dataclass, field
from time import perf_counter_ns
from typing import Any, Iterable, Iterator

import torch
import torch.optim.optimizer as _optim

from ...schema import KNOWN_MEMORY_CATEGORIES, MEMORY_CATEGORIES
from ..recorder import Recorder

#: Phases during which what the allocator holds beyond the known sets is called activations.
ACTIVATION_PHASES: frozenset[str] = frozenset({"forward", "backward"})

#: Marker allocations are uint8 tensors of an odd size in [MARKER_BASE_BYTES, +1022]: no float,
#: half or int64 tensor has an odd byte size, and the marker's address is checked too.
MARKER_BASE_BYTES = 4099
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
    return "activations" if phase in ACTIVATION_PHASES else "other"


# -- allocator backends ----------------------------------------------------------------------
class CpuAllocatorStream:
    """CPU allocations and frees as torch's profiler sees them, with no op events."""

    def __init__(self) -> None:
        self.active = False

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
            _enable_profiler(cfg, activities, scopes)
        self._disable = _disable_profiler
        self.active = True

    def stop(self) -> list[tuple[int, int]]:
        """``(ptr, bytes)`` of every CPU allocation (bytes > 0) and free (< 0), in time order."""
        if not self.active:
            return []
        self.active = False
        if not torch._C._autograd._profiler_enabled():
            raise RuntimeError("another profiler started and stopped during the slice and ended "
                               "tpkit's allocator stream with it")
        with quiet_stderr():
            result = self._disable()
        out = []
        for ev in sorted(result.experimental_event_tree(), key=lambda e: e.start_time_ns):
            f = ev.extra_fields
            size = getattr(f, "alloc_size", None)
            if size is None or getattr(f.device, "type", "cpu") != "cpu":
                continue
            out.append((int(f.ptr), int(size)))
        return out


class CudaAllocator:
    """The CUDA caching allocator's counters; every call here is free of syncs."""

    _available: bool | None = None

    def available(self) -> bool:
        if self._available is None:
            self._available = torch.cuda.is_available()
        return self._available

    def devices(self) -> list[int]:
        """Devices to read: none until CUDA is initialised (reading would initialise it)."""
        if not self.available() or not torch.cuda.is_initialized():
            return []
        return list(range(torch.cuda.device_count()))

    def read(self, index: int) -> tuple[int, int]:
        """(bytes allocated now, peak since the previous read); resets the peak."""
        now = int(torch.cuda.memory_allocated(index))
        peak = int(torch.cuda.max_memory_allocated(index))
        torch.cuda.reset_peak_memory_stats(index)
        return now, max(now, peak)

    def capacity(self, index: int) -> int:
        return int(torch.cuda.get_device_properties(index).total_memory)

    def start_history(self) -> None:
        torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                                 max_entries=HISTORY_ENTRIES)

    def stop_history(self) -> dict:
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
        action, addr = entry.get("action"), entry.get("addr")
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
@dataclass
class _Boundary:
    phase: str
    event: str  # enter / exit
    raw_step: int
    t_ns: int
    known: dict[tuple[str, str], int]  # (device, category) -> bytes
    cpu_storages: list[tuple[int, int]]  # (ptr, bytes) of known + buffer storages on the CPU
    cpu_buffer_bytes: int
    cuda: dict[str, tuple[int, int]] = field(default_factory=dict)  # device -> (allocated, peak since last)
    marker: tuple[int, int] | None = None  # (ptr, bytes)
    n_param_storages: int = 0  # the first entries of cpu_storages are the parameters'


def _tensors(obj: Any, depth: int = 0) -> Iterable[torch.Tensor]:
    """Tensors in a (nested) batch or optimizer-state value, bounded in depth."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 4:
        if isinstance(obj, dict):
            for v in obj.values():
                yield from _tensors(v, depth + 1)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                yield from _tensors(v, depth + 1)


class MemoryProbe:
    """Listens to phase boundaries; builds ``run.memory`` rows when removed."""

    def __init__(self, rec: Recorder, detail: bool = False, cpu: CpuAllocatorStream | None = None,
                 cuda: CudaAllocator | None = None) -> None:
        self.rec = rec
        self.detail = detail
        self.cpu = cpu if cpu is not None else CpuAllocatorStream()
        self.cuda = cuda if cuda is not None else CudaAllocator()
        self.bounds: list[_Boundary] = []
        self.optimizers: "weakref.WeakValueDictionary[int, torch.optim.Optimizer]" = weakref.WeakValueDictionary()
        self._batch: list[weakref.ref] = []
        self._params: list[torch.Tensor] = []
        self._buffers: list[torch.Tensor] = []
        self._seen_key: tuple[int, int] = (-1, -1)  # (models, optimizer parameters) last counted
        self._dev_names: dict[torch.device, str] = {}
        self._handle: Any = None
        self._history = False
        self._cpu_note: str | None = None
        self._detail: dict[str, Any] = {}
        self._cuda_seen: set[str] = set()
        self.installed = False
        self._finished = False

    # -- life cycle -------------------------------------------------------------------------
    def install(self) -> "MemoryProbe":
        if self.installed:
            return self
        self.installed = True
        try:
            self._handle = _optim.register_optimizer_step_pre_hook(self._see_optimizer)
            try:
                self.cpu.start()
            except Exception as e:  # e.g. a torch.profiler already running
                self._cpu_note = (f"CPU memory beyond parameters, gradients, optimizer state and data "
                                  f"was not measured: the allocator stream could not start ({e})")
            for i in self.cuda.devices():
                self._read_cuda(i)  # resets the peak: what came before the slice is not its peak
            if self.detail:
                if self.cuda.available():
                    try:
                        self.cuda.start_history()
                        self._history = True
                    except Exception as e:
                        self.rec.note(f"--memory-detail: the CUDA allocator history could not start ({e})")
                else:
                    self.rec.note("--memory-detail needs a CUDA device in use; on the CPU it records nothing more")
            self.rec.phase_listeners.append(self._on_phase)
            self.rec.batch_listeners.append(self._on_batch)
        except BaseException:
            self.remove()
            raise
        return self

    def remove(self) -> None:
        """Stop listening and turn the allocator stream into ``run.memory`` rows. Idempotent."""
        for lst, fn in ((self.rec.phase_listeners, self._on_phase), (self.rec.batch_listeners, self._on_batch)):
            while fn in lst:
                lst.remove(fn)
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        events: list[tuple[int, int]] = []
        if self.cpu.active:
            try:
                events = self.cpu.stop()
            except Exception as e:
                self._cpu_note = (f"CPU memory beyond parameters, gradients, optimizer state and data "
                                  f"was not measured: {e}")
        if self._history:
            self._history = False
            try:
                snap = self.cuda.stop_history()
                self._detail = {f"cuda:{i}": top_allocations_at_peak(trace)
                                for i, trace in enumerate(snap.get("device_traces", []))}
            except Exception as e:
                self.rec.note(f"--memory-detail: reading the CUDA allocator history failed ({e!r})")
        self.installed = False
        if not self._finished:
            self._finished = True
            if self._cpu_note:
                self.rec.note(self._cpu_note)
            self._emit(events)
            self._batch = []

    def meta(self) -> dict[str, Any]:
        cap: dict[str, int] = {}
        host = host_capacity_bytes()
        if host:
            cap["cpu"] = host
        for i in self.cuda.devices():
            try:
                cap[f"cuda:{i}"] = self.cuda.capacity(i)
            except Exception:
                pass
        out: dict[str, Any] = {"capacity_bytes": cap,
                               "cpu_source": "allocator stream (torch profiler memory events only)"
                               if self._cpu_note is None else "known sets only"}
        if self._detail:
            out["top_at_peak"] = self._detail
        return {"memory": out}

    # -- hooks ------------------------------------------------------------------------------
    def _see_optimizer(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.optimizers.setdefault(id(opt), opt)

    def _on_batch(self, batch: Any) -> None:
        refs = []
        for t in _tensors(batch):
            try:
                refs.append(weakref.ref(t))
            except TypeError:
                pass
        self._batch = refs
        # Loaders report the batch right after their data_wait span closed: count it as data
        # at that exit boundary too (the previous batch, still held by the loop, stays there).
        last = self.bounds[-1] if self.bounds else None
        if last is not None and last.phase == "data_wait" and last.event == "exit":
            have = {ptr for ptr, _ in last.cpu_storages}
            seen: set[tuple[str, int]] = set()
            for r in refs:
                t = r()
                try:
                    s = t.untyped_storage()
                    ptr, nbytes, dev = s.data_ptr(), s.nbytes(), self._device(t)
                except Exception:
                    continue
                if (dev, ptr) in seen or (dev == "cpu" and ptr in have):
                    continue
                seen.add((dev, ptr))
                last.known[(dev, "data")] = last.known.get((dev, "data"), 0) + nbytes
                if dev == "cpu":
                    last.cpu_storages.append((ptr, nbytes))

    def _on_phase(self, phase: str, event: str, raw_step: int) -> None:
        t_ns = perf_counter_ns()
        marker = None
        if self.cpu.active:
            # sync point: none. A marker allocation made and freed here cuts the CPU stream.
            size = MARKER_BASE_BYTES + 2 * (len(self.bounds) % 512)
            m = torch.empty(size, dtype=torch.uint8)
            marker = (m.data_ptr(), size)
            del m
        known, cpu_storages, buffer_bytes, n_param = self._known_sets()
        b = _Boundary(phase, event, raw_step, t_ns, known, cpu_storages, buffer_bytes, marker=marker,
                      n_param_storages=n_param)
        for i in self.cuda.devices():
            b.cuda[f"cuda:{i}"] = self._read_cuda(i)
        self.bounds.append(b)

    def _read_cuda(self, index: int) -> tuple[int, int]:
        """(allocated, peak since the previous read); a device first seen mid-slice (CUDA
        initialised by the loop) has no previous read, so its peak counter is not trusted."""
        name = f"cuda:{index}"
        now, peak = self.cuda.read(index)
        if name not in self._cuda_seen:
            self._cuda_seen.add(name)
            peak = now
        return now, peak

    # -- the known sets ---------------------------------------------------------------------
    def _refresh_params(self) -> None:
        opts = list(self.optimizers.values())
        key = (len(self.rec.models), sum(len(g["params"]) for o in opts for g in o.param_groups))
        if key == self._seen_key:
            return
        self._seen_key = key
        params: dict[int, torch.Tensor] = {}
        buffers: dict[int, torch.Tensor] = {}
        for model in list(self.rec.models.values()):
            for p in model.parameters():
                params.setdefault(id(p), p)
            for b in model.buffers():
                buffers.setdefault(id(b), b)
        for opt in opts:
            for group in opt.param_groups:
                for p in group["params"]:
                    params.setdefault(id(p), p)
        self._params = list(params.values())
        self._buffers = list(buffers.values())

    def _device(self, t: torch.Tensor) -> str:
        dev = t.device
        name = self._dev_names.get(dev)
        if name is None:
            name = self._dev_names[dev] = "cpu" if dev.type == "cpu" else str(dev)
        return name

    def _known_sets(self) -> tuple[dict[tuple[str, str], int], list[tuple[int, int]], int, int]:
        """Bytes per (device, category) of unique storages, the CPU storages' addresses (the
        parameters' first), the bytes of model buffers on the CPU, and how many CPU storages are
        parameters. One flat loop: this runs at every boundary (~1 us per tensor)."""
        self._refresh_params()
        params = self._params
        items: list[tuple[torch.Tensor, str | None]] = [(p, "parameters") for p in params]
        n_param_items = len(items)
        items += [(g, "gradients") for p in params if (g := p.grad) is not None]
        for opt in list(self.optimizers.values()):
            for state in list(opt.state.values()):
                for v in (state.values() if isinstance(state, dict) else (state,)):
                    if isinstance(v, torch.Tensor):
                        items.append((v, "optimizer_state"))
                    elif isinstance(v, (dict, list, tuple)):
                        items += [(t, "optimizer_state") for t in _tensors(v)]
        items += [(t, "data") for r in self._batch if (t := r()) is not None]
        items += [(b, None) for b in self._buffers]

        seen: set[tuple[str, int]] = set()
        known: dict[tuple[str, str], int] = {}
        cpu: list[tuple[int, int]] = []
        buffer_bytes = n_param = 0
        for i, (t, category) in enumerate(items):
            try:
                s = t.untyped_storage()
                ptr, on_cpu = s.data_ptr(), t.is_cpu
                dev = "cpu" if on_cpu else self._device(t)
            except Exception:  # meta, fake or exotic tensor subclasses: nothing allocated to count
                continue
            key = (dev, ptr)
            if key in seen:
                continue
            nbytes = s.nbytes()
            if nbytes == 0:
                continue
            seen.add(key)
            if on_cpu:
                cpu.append((ptr, nbytes))
                if i < n_param_items:
                    n_param = len(cpu)
            if category is None:
                buffer_bytes += nbytes if on_cpu else 0
            else:
                k = (dev, category)
                known[k] = known.get(k, 0) + nbytes
        return known, cpu, buffer_bytes, n_param

    # -- rows -------------------------------------------------------------------------------
    def _cpu_levels(self, events: list[tuple[int, int]]) -> tuple[list[int | None], list[int | None]]:
        """Replay the CPU stream: bytes allocated during the slice and still alive that are
        *not* known-set storages, at each boundary; and the peak of all slice-allocated bytes
        between each boundary and the next, minus that boundary's known slice-allocated bytes."""
        n = len(self.bounds)
        rest: list[int | None] = [None] * n
        seg_peak: list[int | None] = [None] * n  # peak rest-equivalent in the stretch after boundary k
        live: dict[int, int] = {}
        total = 0
        k = 0
        running_peak = 0
        in_known = 0
        skip: tuple[int, int] | None = None

        def cut(k: int) -> int:
            b = self.bounds[k]
            return sum(nb for ptr, nb in b.cpu_storages if live.get(ptr) == nb)

        for ptr, size in events:
            if k < n and self.bounds[k].marker == (ptr, size):
                if k > 0:
                    seg_peak[k - 1] = max(running_peak, total) - in_known
                in_known = cut(k)
                rest[k] = total - in_known
                running_peak = total
                skip = (ptr, -size)
                k += 1
                continue
            if skip is not None and (ptr, size) == skip:
                skip = None
                continue
            if size > 0:
                live[ptr] = size
                total += size
                if total > running_peak:
                    running_peak = total
            else:
                freed = live.pop(ptr, None)  # a block from before the slice: not in the stream
                if freed is not None:
                    total -= freed
        return rest, seg_peak

    def _backfill_parameters(self) -> None:
        """The model is known from its first forward (or its optimizer's first step); the
        boundaries before that (the first data wait) get the parameters seen then, which were
        alive already unless the model was built inside the loop after the slice began."""
        bounds = self.bounds
        first = next((k for k, b in enumerate(bounds) if any(c == "parameters" for _, c in b.known)), None)
        if not first:
            return
        params = {key: v for key, v in bounds[first].known.items() if key[1] == "parameters"}
        storages = bounds[first].cpu_storages[: bounds[first].n_param_storages]
        for b in bounds[:first]:
            b.known.update(params)
            b.cpu_storages = storages + b.cpu_storages

    def _emit(self, events: list[tuple[int, int]]) -> None:
        bounds = self.bounds
        if not bounds:
            return
        self._backfill_parameters()
        rest_cpu, seg_cpu = self._cpu_levels(events) if events else ([None] * len(bounds), [None] * len(bounds))
        devices = ["cpu"] + sorted({d for b in bounds for d in b.cuda})

        def level(k: int, dev: str) -> tuple[dict[str, int], int | None]:
            """Known bytes by category and the rest (None: not measured) at boundary k."""
            b = bounds[k]
            known = {c: b.known.get((dev, c), 0) for c in KNOWN_MEMORY_CATEGORIES}
            if dev == "cpu":
                r = rest_cpu[k]
                rest = None if r is None else max(0, r + b.cpu_buffer_bytes)
            else:
                alloc = b.cuda.get(dev, (None, None))[0]
                rest = None if alloc is None else max(0, alloc - sum(known.values()))
            return known, rest

        add = self.rec.add_memory

        def rows(k: int, event: str, dev: str, known: dict[str, int], rest: int | None, phase: str,
                 raw_step: int, t_ns: int) -> None:
            rc = rest_category(phase)
            for c in MEMORY_CATEGORIES:
                if c in known:
                    add(phase, event, dev, c, int(known[c]), t_ns=t_ns, raw_step=raw_step)
                elif rest is not None:
                    add(phase, event, dev, c, int(rest) if c == rc else 0, t_ns=t_ns, raw_step=raw_step)

        stack: list[int] = []
        for k, b in enumerate(bounds):
            for dev in devices:
                known, rest = level(k, dev)
                rows(k, b.event, dev, known, rest, b.phase, b.raw_step, b.t_ns)
            if b.event == "enter":
                stack.append(k)
                continue
            while stack and bounds[stack[-1]].phase != b.phase:
                stack.pop()  # an enter whose exit never came (cannot happen with Recorder.exit)
            if not stack:
                continue
            k0 = stack.pop()
            for dev in devices:
                self._peak_rows(k0, k, dev, level, seg_cpu, rows)

    def _peak_rows(self, k0: int, k1: int, dev: str, level: Any, seg_cpu: list[int | None], rows: Any) -> None:
        bounds = self.bounds
        known0, rest0 = level(k0, dev)
        known1, rest1 = level(k1, dev)
        if rest0 is None or rest1 is None:
            return
        total0, total1 = sum(known0.values()) + rest0, sum(known1.values()) + rest1
        peak = max(total0, total1)
        for j in range(k0, k1):
            if dev == "cpu":
                seg = seg_cpu[j]
                if seg is not None:
                    # level inside the stretch: the known sets and buffers as at its start, plus
                    # the slice-allocated bytes beyond the known ones at their highest
                    kj, _ = level(j, dev)
                    peak = max(peak, sum(kj.values()) + bounds[j].cpu_buffer_bytes + seg)
            else:
                seg_peak = bounds[j + 1].cuda.get(dev, (0, 0))[1]
                peak = max(peak, seg_peak)
        ref_known = known0 if total0 >= total1 else known1
        b0, b1 = bounds[k0], bounds[k1]
        rest = peak - sum(ref_known.values())
        rows(k1, "peak", dev, ref_known, rest, b1.phase, b0.raw_step, b1.t_ns)

