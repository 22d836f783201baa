"""The ops probe (``--ops`` / ``tp.profile(ops=3)``): operator-level time for a few measured
steps, from torch's own profiler, on tpkit's time base.

torch.profiler (CPU activity, and CUDA when a GPU is there, ``record_shapes=True``) traces the
*last* ``n`` measured steps of a slice that stops by itself: it starts at the end of the step
before them (its start cost is a ``tpkit`` span of the first traced step, tpkit's own time, as
every probe's) and stops after the slice, when the loop is no longer timed. Its overhead
touches only the traced steps; the steps before them are measured as without ``--ops``. A
slice that does not stop (``--no-stop``) traces the first ``n`` measured steps instead, and
stops the profiler at the end of the last one (that cost is a ``tpkit`` span of the next). The events are read after the slice: one row per operator
event (name, self CPU time, self device time, input shapes, start and end on the slice's
clock) in the Run's ``ops`` table; ``analysis.ops`` assigns each to the tpkit phase it ran in.

torch has one profiler session per process. Where the memory probe counts CPU memory from
torch's allocator stream (a machine with an accelerator, or ``TPKIT_CPU_ALLOCATIONS=stream``),
the stream is such a session (``probes/memory.py``): when the ops steps start, it ends, and CPU
memory beyond the known sets (activations, temporaries) is not measured in that run. Both are
said in ``run.meta["notes"]``; ``run.meta["ops"]`` names the traced steps. tpkit's CPU
allocation counter (the default elsewhere) is not a profiler session: it records on through the
traced steps, which record no memory (``allocator_counter.py``).
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from ..recorder import Recorder
from .allocator_counter import own_profiler_start
from .memory import quiet_stderr

#: Names that are the profiler's own bookkeeping, not operators.
SKIP_PREFIXES: tuple[str, ...] = ("ProfilerStep", "[memory]", "[OutOfMemory]")


class OpsProbe:
    """Traces ``n_steps`` measured steps with torch.profiler (see the module docstring):
    the last ones of a slice of ``steps`` measured steps, or the first ones when
    ``steps`` is None (a slice that does not stop by itself)."""

    def __init__(self, rec: Recorder, n_steps: int, warmup: int | None, steps: int | None = None,
                 profiler_factory: Callable[..., Any] | None = None) -> None:
        self.rec = rec
        self.n_steps = int(n_steps)
        self.steps = steps
        self._warmup = warmup  # None (warmup 'auto'): told by the slice once it is known
        self._warmup_of: Callable[[], int | None] = lambda: self._warmup
        self._factory = profiler_factory or _torch_profiler
        self._prof: Any = None
        self._first_raw: int | None = None  # the first traced raw step
        self._end_raw: int | None = None  # raw steps completed when the profiler stopped
        self._displaced = False  # another profiler session (the memory stream) was running
        self._wall_minus_perf_ns = 0
        self.rows: list[tuple] = []
        self.error: str | None = None
        self.installed = False

    # -- life cycle -------------------------------------------------------------------------
    def follow(self, warmup_of: Callable[[], int | None]) -> None:
        """Read the warmup count from the slice (``--warmup auto`` decides it on the way)."""
        self._warmup_of = warmup_of

    def install(self) -> "OpsProbe":
        if not self.installed:
            self.installed = True
            self.rec.step_listeners.append(self._on_step)
            if self._first_traced(self._warmup_of()) == 0:  # the first traced step starts now
                self._start(0)
        return self

    def remove(self) -> None:
        if not self.installed:
            return
        self.installed = False
        try:
            self.rec.step_listeners.remove(self._on_step)
        except ValueError:
            pass
        self._stop(partial=True)

    # -- steps ------------------------------------------------------------------------------
    def _first_traced(self, warmup: int | None) -> int | None:
        """The raw step the profiler starts with, once the warmup is known."""
        if warmup is None:
            return None
        return warmup + (self.steps - self.n_steps if self.steps is not None else 0)

    def _on_step(self, raw_step: int, end_ns: int) -> None:
        first = self._first_traced(self._warmup_of())
        if first is None:
            return
        if self._prof is None and self._first_raw is None and raw_step + 1 == first:
            self._start(raw_step + 1)
        elif self._prof is not None and self._first_raw is not None and self.steps is None:
            if raw_step + 1 >= self._first_raw + self.n_steps:  # a slice that runs on: stop here
                self._stop(partial=False)

    def _start(self, first_raw: int) -> None:
        t = time.perf_counter_ns()
        self._first_raw = first_raw
        try:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            prof = self._factory(activities)
            self._displaced = bool(torch._C._autograd._profiler_enabled())
            # kineto announces its start on fd 2; tpkit's CPU allocation counter records on
            with quiet_stderr(), own_profiler_start():
                prof.start()
            self._prof = prof
            self._wall_minus_perf_ns = time.time_ns() - time.perf_counter_ns()
        except Exception as e:  # noqa: BLE001 - a profiler that cannot start costs the ops table only
            self.error = f"torch.profiler could not start: {e!r}"
        self.rec.add_span("tpkit", t, time.perf_counter_ns(), "ops profiler")

    def _stop(self, partial: bool) -> None:
        prof, self._prof = self._prof, None
        if prof is None:
            return
        t = time.perf_counter_ns()
        self._end_raw = len(self.rec.step_ends)
        try:
            with quiet_stderr():
                prof.stop()
            self._read(prof)
        except Exception as e:  # noqa: BLE001 - never costs the run
            self.error = f"torch.profiler failed to stop or report: {e!r}"
        if not partial:
            self.rec.add_span("tpkit", t, time.perf_counter_ns(), "ops profiler")

    def _read(self, prof: Any) -> None:
        """Operator events as ``(raw start ns, raw end ns, name, self cpu s, self device s, shapes)``
        on the slice's clock (torch's trace times are wall-clock ns)."""
        base = int(prof.profiler.kineto_results.trace_start_ns()) - self._wall_minus_perf_ns
        for e in prof.events():
            name = str(e.name)
            if name.startswith(SKIP_PREFIXES) or getattr(e, "is_user_annotation", False) and name.startswith("##"):
                continue
            if str(getattr(e, "device_type", "")).endswith("CUDA"):
                continue  # a kernel: its time is the self device time of the op that launched it
            start = base + int(e.time_range.start * 1000)
            end = base + int(e.time_range.end * 1000)
            device_us = getattr(e, "self_device_time_total", None)
            if device_us is None:
                device_us = getattr(e, "self_cuda_time_total", 0.0)
            shapes = [list(s) for s in (e.input_shapes or [])]
            self.rows.append((start, end, name, float(e.self_cpu_time_total) / 1e6, float(device_us or 0.0) / 1e6,
                              str(shapes) if any(shapes) else ""))

    # -- results ----------------------------------------------------------------------------
    def table_rows(self, warmup: int) -> list[tuple]:
        """``ops`` table rows (``schema.SCHEMAS["ops"]`` order): each event numbered by the step
        whose end comes first after its start (raw steps renumbered from 0 after warmup)."""
        ends = [e for e, _ in self.rec.step_ends]
        last = min(len(ends), self._end_raw or len(ends)) - 1  # the last step that ended while traced
        out = []
        t0 = self.rec.t0_ns
        for start, end, name, cpu_s, dev_s, shapes in self.rows:
            if last < 0 or start > ends[last]:
                continue  # after the traced steps (a trainer's end hooks): not a step's work
            if end > ends[last]:  # open when the slice stopped (torch's "Optimizer.step" annotation while
                # the stop unwinds): only its part inside the step counts
                cpu_s = max(0.0, cpu_s - (end - ends[last]) / 1e9)
                end = ends[last]
            raw = next(i for i, e in enumerate(ends) if start <= e)
            out.append((raw - warmup, name, (start - t0) / 1e9, (end - t0) / 1e9, cpu_s, dev_s, shapes))
        return out

    def meta(self) -> dict[str, Any]:
        warmup = self._warmup_of() or 0
        first, end = self._first_raw, self._end_raw
        steps = list(range(first - warmup, min(end, first + self.n_steps) - warmup)) \
            if first is not None and end is not None else []
        if self.error:
            self.rec.note(f"--ops: {self.error}")
        if self._displaced:
            self.rec.note("--ops: torch has one profiler session per process, and the memory probe's CPU allocator "
                          "stream was it: from the first traced step on, CPU memory beyond parameters, gradients, "
                          "optimizer state and data (activations, temporaries) was not measured; profile again "
                          "without --ops for the full memory picture")
        if not steps and not self.error:
            self.rec.note("--ops: no step was traced (the loop ended before the steps to trace)")
        if steps:
            self.rec.note(f"--ops: torch.profiler traced measured steps {steps[0]}-{steps[-1]} (operator time "
                          "with shapes); those steps ran slower under it")
        return {"ops": {"requested_steps": self.n_steps, "steps": steps, "events": len(self.rows),
                        "activities": ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"],
                        "error": self.error}}


def _torch_profiler(activities: list[Any]) -> Any:
    return torch.profiler.profile(activities=activities, record_shapes=True)
