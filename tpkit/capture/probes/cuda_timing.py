"""GPU-side timing of phases with CUDA events, resolved after the slice (no sync per phase).

The host stamps every phase with ``perf_counter_ns``; on a GPU those stamps only say when
work was *queued*. Each phase boundary therefore also records a CUDA event on the current
stream, and the Run is built from the event times, put on the host time base through one
reference event recorded right after a synchronisation at slice start.
"""

from __future__ import annotations

from time import perf_counter_ns
from typing import Any


class CudaTimer:
    """CUDA events stamped at phase boundaries, resolved to host seconds after the slice (no sync per phase)."""
    def __init__(self, torch_mod: Any) -> None:
        self.torch = torch_mod
        cuda = torch_mod.cuda
        cuda.synchronize()  # the one sync at start: an empty stream makes ref ~= host time
        self.ref = cuda.Event(enable_timing=True)
        self.ref_host_ns = perf_counter_ns()
        self.ref.record()
        cuda.synchronize()

    def mark(self) -> Any:
        ev = self.torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def resolve(self, ev: Any) -> int:
        """Host-base ns of a recorded event. Call after ``finish``."""
        return self.ref_host_ns + int(self.ref.elapsed_time(ev) * 1e6)

    def finish(self) -> None:
        self.torch.cuda.synchronize()  # the one sync at the end, before resolving


def maybe_cuda_timer() -> CudaTimer | None:
    """A timer when a CUDA context is already in use; None on the CPU (nothing to time)."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return CudaTimer(torch)
