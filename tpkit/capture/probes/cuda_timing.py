"""GPU-side timing of phases with CUDA events, resolved after the slice (no sync per phase).

The host stamps every phase with ``perf_counter_ns``; on a GPU those stamps only say when
work was *queued*. Each phase boundary therefore also records a CUDA event on the current
stream, and the Run is built from the event times, put on the host time base through one
reference event recorded right after a synchronisation at slice start.

Precision: ``Event.elapsed_time`` is a 32-bit float in milliseconds, so one reference for a
whole slice would round boundaries to ~62 µs after 10 minutes and 0.25 ms after an hour.
Events are therefore timed against the nearest *anchor*: a fresh reference event recorded
every ``ANCHOR_EVERY_NS`` of host time (no sync), whose own time is chained from the previous
anchor. Each elapsed time then spans under a second, so a phase's duration is exact to well
under a microsecond however long the slice; where the step sits on the slice's axis can drift
by the float's relative precision (about 0.2 ms after an hour), which no duration sees.

CUDA graphs: an event recorded while the current stream is being captured into a graph never
completes on its own; such boundaries keep their host stamps and are counted in ``meta()``.
"""

from __future__ import annotations

from time import perf_counter_ns
from typing import Any

#: A new anchor event at most this often (host time).
ANCHOR_EVERY_NS = 500_000_000


class CudaTimer:
    """CUDA events stamped at phase boundaries, resolved to host seconds after the slice (no sync per phase)."""

    def __init__(self, torch_mod: Any) -> None:
        self.torch = torch_mod
        cuda = torch_mod.cuda
        cuda.synchronize()  # the one sync at start: an empty stream makes ref ~= host time
        self.ref_host_ns = perf_counter_ns()
        first = cuda.Event(enable_timing=True)
        first.record()
        cuda.synchronize()
        self.anchors: list[Any] = [first]
        self._anchor_host_ns = self.ref_host_ns
        self._anchor_ns: list[int] | None = None  # resolved anchor times, after finish()
        self.skipped_in_capture = 0
        self._drained = False

    def mark(self) -> tuple[int, Any] | None:
        """A CUDA event for a boundary, with the index of its anchor (None during graph capture)."""
        cuda = self.torch.cuda
        if cuda.is_current_stream_capturing():
            self.skipped_in_capture += 1
            return None
        now = perf_counter_ns()
        if now - self._anchor_host_ns >= ANCHOR_EVERY_NS:
            anchor = cuda.Event(enable_timing=True)
            anchor.record()
            self.anchors.append(anchor)
            self._anchor_host_ns = now
        ev = cuda.Event(enable_timing=True)
        ev.record()
        return len(self.anchors) - 1, ev

    def drain(self) -> None:
        """Wait for the GPU to run what the slice queued: the slice's teardown calls this before
        it stops the clock sampler. The host queues work ahead of the GPU (on a GPU-bound loop,
        up to the launch queue: 4 steps of 105 ms on an H200 in benchmarks/gpu_check.py), so a
        sampler stopped when the host's last step ends missed the GPU's last steps (12 of 15
        steps held a clock sample: docs/GPU_RUNS.md). This is the slice's end sync, moved
        earlier: ``finish`` then has nothing to wait for."""
        self.torch.cuda.synchronize()
        self._drained = True

    def finish(self) -> None:
        """The one sync at the end (unless ``drain`` made it); then the anchors' times are
        chained from the first."""
        if not self._drained:
            self.torch.cuda.synchronize()
        times = [self.ref_host_ns]
        for prev, cur in zip(self.anchors, self.anchors[1:]):
            times.append(times[-1] + round(prev.elapsed_time(cur) * 1e6))
        self._anchor_ns = times

    def resolve(self, mark: tuple[int, Any]) -> int:
        """Host-base ns of a boundary's event. Call after ``finish``."""
        if self._anchor_ns is None:
            raise RuntimeError("CudaTimer.resolve before finish(): the events are not complete yet")
        k, ev = mark
        return self._anchor_ns[k] + round(self.anchors[k].elapsed_time(ev) * 1e6)

    def meta(self) -> dict[str, Any]:
        """What the timer did: anchors used, boundaries left on host time during graph capture."""
        return {"cuda_timing": {"anchors": len(self.anchors), "host_stamped_in_graph_capture": self.skipped_in_capture}}


def maybe_cuda_timer() -> CudaTimer | None:
    """A timer when a CUDA context is already in use; None on the CPU (nothing to time)."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return CudaTimer(torch)
