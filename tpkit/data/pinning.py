"""Getting batches to the accelerator: pinned memory and an asynchronous copy one batch ahead.

``pin_memory=True`` alone returns pinned CPU tensors, as torch's DataLoader does.
``device="cuda"`` (with or without pin_memory) goes further: each batch is copied into
reusable pinned staging buffers, then to the device on a side stream while the training loop
works on the previous batch; the loop gets device tensors whose copy its stream waits for.
Without CUDA both fall back to plain CPU tensors (with one warning), so the CPU path is real.
"""

from __future__ import annotations

import warnings
from time import perf_counter
from typing import Any, Callable

import torch


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``obj`` with ``fn`` applied to every tensor in it (dicts, lists, tuples, namedtuples)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(map_tensors(v, fn) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(v, fn) for v in obj)
    return obj


def cuda_usable() -> bool:
    """Whether a CUDA device can take the batches."""
    return torch.cuda.is_available()


def pin_batch(batch: Any) -> Any:
    """The batch with every tensor in pinned (page-locked) host memory."""
    return map_tensors(batch, lambda t: t.pin_memory())


class DevicePrefetcher:
    """Pinned staging + async host-to-device copy on a side stream (CUDA only).

    Two staging sets alternate: set ``i`` is written again only after the copy that read it
    has finished (its event), so a slow training step never sees a half-overwritten buffer.

    The copy is ``Tensor.copy_`` into a fresh device tensor, not ``Tensor.to``: tpkit's phase
    probe times ``Tensor.to`` on the loop's thread as exposed ``h2d``
    (tpkit/capture/probes/phases.py), and this copy runs beside the step; only its wait in
    ``finish`` is exposed, and the loader records that as ``h2d``. Staging buffers are pinned
    when CUDA is available (``pin_memory=None``).
    """

    def __init__(self, device: torch.device, pin_memory: bool | None = None) -> None:
        self.device = device
        self.pin_memory = cuda_usable() if pin_memory is None else bool(pin_memory)
        with torch.cuda.device(device):  # made on its device, whichever is current
            self.stream = torch.cuda.Stream(device=device)
        self._staging: list[dict] = [{}, {}]
        self._events: list[Any] = [None, None]
        self._turn = 0

    def _stage(self, t: torch.Tensor, buf: dict, key: int) -> torch.Tensor:
        s = buf.get(key)
        if s is None or s.shape != t.shape or s.dtype != t.dtype:
            s = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pin_memory)
            buf[key] = s
        s.copy_(t)
        return s

    def start(self, batch: Any) -> tuple[Any, Any]:
        """Stage ``batch`` and launch its copy; returns a handle for ``finish``."""
        i = self._turn
        self._turn ^= 1
        if self._events[i] is not None:
            self._events[i].synchronize()  # sync point: that set's previous copy must be done
        buf = self._staging[i]
        counter = iter(range(1 << 30))
        staged = map_tensors(batch, lambda t: self._stage(t, buf, next(counter)))
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            dev = map_tensors(staged, self._to_device)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        self._events[i] = ev
        return dev, ev

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        out = torch.empty(t.shape, dtype=t.dtype, device=self.device)  # on the side stream
        out.copy_(t, non_blocking=True)  # not Tensor.to: see the class doc
        return out

    def finish(self, handle: tuple[Any, Any]) -> tuple[Any, float]:
        """Make the current stream wait for the copy; returns (device batch, seconds spent)."""
        t0 = perf_counter()
        dev, ev = handle
        cur = torch.cuda.current_stream(self.device)
        cur.wait_event(ev)  # no host sync: the compute stream waits on the GPU
        map_tensors(dev, lambda t: t.record_stream(cur))
        return dev, perf_counter() - t0


def resolve_device(device: Any, pin_memory: bool) -> tuple[torch.device | None, bool]:
    """(device for async copies or None, whether to pin CPU batches), warning on CPU-only."""
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda" and dev.index is None and cuda_usable():
        dev = torch.device("cuda", torch.cuda.current_device())
    if (pin_memory or (dev is not None and dev.type == "cuda")) and not cuda_usable():
        warnings.warn("tpkit.data: pin_memory/device='cuda' asked for but CUDA is not available; "
                      "batches stay as plain CPU tensors.", RuntimeWarning, stacklevel=3)
        return None, False
    if dev is not None and dev.type != "cuda":
        return None, pin_memory
    return dev, pin_memory and dev is None
