"""The clock sampler: a background thread that reads every clock backend at a fixed rate
(default 20 Hz, at most 200) on the spans' time base (``time.perf_counter_ns``).

Life cycle (STYLE.md 5):
- ``install()`` opens the backends, starts a daemon thread named ``tpkit-clocks`` and waits
  (with a timeout) until its first sample is taken, so the trace starts with the slice.
- ``remove()`` sets the stop event, joins with a timeout, copies the thread's buffer into the
  Recorder and closes the backends. It runs from the slice's teardown, which runs for a full
  slice, an error and Ctrl-C alike; it is safe to call twice. A ``weakref.finalize`` stops the
  thread too if the probe is dropped without ``remove()``.
- The buffer is bounded (``MAX_ROWS``): past it, samples are not kept and a note says when.
- The thread never touches the Recorder while it runs: it writes to its own list, so a thread
  stuck in a slow driver call after the join timed out cannot change a Run being built.

The thread owns no reference to the probe (only to its state object), so the finalizer can
fire. The probe never draws and never imports pandas.
"""

from __future__ import annotations

import math
import threading
import time
import weakref
from time import perf_counter_ns
from typing import Any

from ..recorder import Recorder
from .clock_backends import Backend, open_backends

THREAD_NAME = "tpkit-clocks"
MAX_HZ = 200.0
#: About 3.5 hours at 20 Hz with a 2-core host and one GPU; ~40 MB of tuples at worst.
MAX_ROWS = 1_000_000
MAX_ERRORS = 20
START_TIMEOUT_S = 2.0
STOP_TIMEOUT_S = 2.0


class _SamplerState:
    """What the thread and the finalizer share (never the probe itself)."""

    def __init__(self, backends: list[Backend], period_s: float) -> None:
        self.backends = backends
        self.period_ns = int(period_s * 1e9)
        self.rows: list[tuple[int, str, str, float]] = []
        self.started = threading.Event()
        self.stop = threading.Event()
        self.ticks = 0
        self.late_ticks = 0  # ticks skipped because a read overran the period
        self.full_at_ns: int | None = None
        self.cpu_ns = 0  # the sampler's own CPU time, to show what sampling costs
        self.wall_ns = 0
        self.errors: list[str] = []


def _sample_once(state: _SamplerState) -> None:
    for backend in state.backends:
        t = perf_counter_ns()
        try:
            readings = backend.read()
        except Exception as e:  # a backend bug must not kill the sampler; keep the others
            if len(state.errors) < MAX_ERRORS:  # a backend failing every tick must not grow memory
                state.errors.append(f"{backend.name}: {type(e).__name__}: {e}")
            continue
        if len(state.rows) + len(readings) > MAX_ROWS:
            if state.full_at_ns is None:
                state.full_at_ns = t
            continue
        state.rows.extend((t, dev, metric, float(value)) for dev, metric, value in readings)
    state.ticks += 1


def _sampler_loop(state: _SamplerState) -> None:
    cpu0 = time.thread_time_ns()
    start_ns = perf_counter_ns()
    try:
        _sample_once(state)
        state.started.set()
        next_ns = perf_counter_ns() + state.period_ns
        while not state.stop.wait(max(0.0, (next_ns - perf_counter_ns()) / 1e9)):
            _sample_once(state)
            next_ns += state.period_ns
            now = perf_counter_ns()
            if now > next_ns:  # fell behind (a slow read, a busy machine): skip, do not burst
                missed = (now - next_ns) // state.period_ns + 1
                state.late_ticks += int(missed)
                next_ns += missed * state.period_ns
        _sample_once(state)  # one last sample at the stop, so the trace covers the last step
    finally:
        state.wall_ns = perf_counter_ns() - start_ns
        state.cpu_ns = time.thread_time_ns() - cpu0
        state.started.set()


def _stop(state: _SamplerState, thread: threading.Thread) -> bool:
    """Stop and join the thread, then close the backends. True if the thread ended."""
    state.stop.set()
    if thread.is_alive() and thread is not threading.current_thread():
        thread.join(STOP_TIMEOUT_S)
    ended = not thread.is_alive()
    if ended:  # a backend still in use by a stuck thread is left open rather than pulled away
        for backend in state.backends:
            try:
                backend.close()
            except Exception as e:
                state.errors.append(f"{backend.name} close: {type(e).__name__}: {e}")
    return ended


class ClockProbe:
    """Samples clocks, power and temperatures during a slice into ``Recorder.clocks``."""

    def __init__(self, rec: Recorder, hz: float = 20.0, backends: list[Backend] | None = None) -> None:
        if not 0 < hz <= MAX_HZ:
            raise ValueError(f"clock sampling rate must be in (0, {MAX_HZ}] Hz, got {hz!r}")
        self.rec = rec
        self.hz = float(hz)
        self._backends = backends
        self._state: _SamplerState | None = None
        self._thread: threading.Thread | None = None
        self._finalizer: weakref.finalize | None = None
        self._meta: dict[str, Any] = {}

    def install(self) -> "ClockProbe":
        backends = self._backends if self._backends is not None else open_backends()
        state = self._state = _SamplerState(backends, 1.0 / self.hz)
        thread = self._thread = threading.Thread(target=_sampler_loop, args=(state,), name=THREAD_NAME, daemon=True)
        self._finalizer = weakref.finalize(self, _stop, state, thread)
        thread.start()
        if not state.started.wait(START_TIMEOUT_S):
            self.rec.note(f"the clock sampler took over {START_TIMEOUT_S:.0f} s to take its first sample")
        return self

    def remove(self) -> None:
        """Stop the thread, hand its rows to the Recorder, close the backends. Idempotent."""
        state, thread, fin = self._state, self._thread, self._finalizer
        if state is None or thread is None or fin is None or not fin.alive:
            return
        fin.detach()
        ended = _stop(state, thread)
        rows = list(state.rows)  # a snapshot: a stuck thread may still append to its list
        for row in rows:
            self.rec.add_clock(*row)
        self._meta = self._describe(state, len(rows), ended)

    def _describe(self, state: _SamplerState, nrows: int, ended: bool) -> dict[str, Any]:
        sources: dict[str, str] = {}
        devices: list[str] = []
        dropped: list[str] = []
        periods: dict[str, float] = {}
        budgets: list[str] = []
        vm: bool | None = None
        for b in state.backends:
            m = b.meta()
            sources.update(m.get("sources", {}))
            devices += m.get("devices", [])
            dropped += m.get("dropped", [])
            # a backend may read some metrics less often than every sample (see HOST_CPU_BUDGET):
            # it reads at the first sample after its own period, so the period is whole samples
            periods.update({k: max(1, math.ceil(v * self.hz - 1e-9)) / self.hz
                            for k, v in m.get("periods_s", {}).items()})
            if "budget" in m:
                budgets.append(m["budget"])
            if m.get("virtual_machine") is not None:
                vm = m["virtual_machine"]
        wall_s = max(1e-9, state.wall_ns / 1e9)
        info: dict[str, Any] = {
            "hz": self.hz, "samples": state.ticks, "rows": nrows, "late_samples": state.late_ticks,
            "sources": sources, "devices": devices, "dropped": dropped,
            "periods_s": {k: round(v, 4) for k, v in periods.items()}, "budgets": budgets,
            "virtual_machine": vm,  # the host's hypervisor flag (None: not known)
            "sampler_cpu_s": state.cpu_ns / 1e9,
            "sampler_cpu_share": state.cpu_ns / 1e9 / wall_s,  # of one core, over the slice
        }
        if state.errors:
            info["errors"] = list(state.errors)
        if state.full_at_ns is not None:
            self.rec.note(f"clock buffer full ({MAX_ROWS:,} rows) at {(state.full_at_ns - self.rec.t0_ns) / 1e9:.1f} s; "
                          "later clock samples were not kept (lower --clock-hz for long slices)")
        if not ended:
            self.rec.note(f"the clock sampler did not stop within {STOP_TIMEOUT_S:.0f} s (a slow driver call?); "
                          "its rows up to the stop are kept")
        for d in dropped:
            if "mid-run" in d:
                self.rec.note(f"clock metric {d}")
        return {"clocks": info}

    def meta(self) -> dict[str, Any]:
        return dict(self._meta)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()


def clock_probe(rec: Recorder, config: Any) -> ClockProbe | None:
    """``PROBE_FACTORIES`` entry: a sampler when ``config.clock_hz > 0``."""
    hz = float(getattr(config, "clock_hz", 0) or 0)
    return ClockProbe(rec, hz) if hz > 0 else None
