"""Phase probes: find data_wait, h2d, forward, backward and optimizer in an unchanged loop.

What is hooked, and why this way:
- forward: torch's global module forward hooks (``always_call=True`` so an exception inside
  forward still closes the span); only the outermost call opens a span.
- backward: ``torch.autograd.backward`` is wrapped (``Tensor.backward`` looks it up at call
  time, so one wrapper covers both).
- optimizer: torch's global optimizer step pre/post hooks, plus ``Optimizer.zero_grad`` and
  ``Module.zero_grad``. The post hook of the *lead* optimizer (the first one that steps)
  ends a step, unless the user marks steps with ``tp.step()``.
- data_wait: ``__next__`` of torch's DataLoader iterators; tpkit's loader and ``tp.watch``
  report themselves. The batch's leading dimension counts the step's samples.
- h2d: ``Tensor.to`` / ``Tensor.cuda`` when the tensor leaves the host.

Every hook ignores calls from threads other than the one that started the slice (a loader
thread running a transform module is not the model's forward). ``remove`` restores every
registry and attribute exactly and is safe to call twice.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from time import perf_counter_ns
from typing import Any

import torch
import torch.optim.optimizer as _optim
import torch.utils.data.dataloader as _dl

from ...errors import StopSlice
from ..recorder import Recorder
from .patching import Patches

#: Collections shorter than this are not recorded as ``gc`` spans (a young-generation pass
#: takes microseconds and happens every few hundred allocations).
GC_SPAN_MIN_NS = 1_000_000

#: Phases during which a module call is not "the forward pass" (a transform in data loading,
#: recomputation in backward, a module used inside an optimizer).
_NOT_FORWARD = ("data_wait", "backward", "optimizer", "offload")


def batch_size_of(batch: Any) -> int | None:
    """Leading dimension of the first tensor-like in a (nested) batch; None if none."""
    for _ in range(8):  # bounded descent into nested containers
        if isinstance(batch, torch.Tensor):
            return int(batch.shape[0]) if batch.dim() > 0 else 1
        if hasattr(batch, "shape") and hasattr(batch, "dtype"):  # numpy and friends
            return int(batch.shape[0]) if len(batch.shape) > 0 else 1
        if isinstance(batch, dict):
            if not batch:
                return None
            batch = next(iter(batch.values()))
        elif isinstance(batch, (list, tuple)):
            if not batch:
                return None
            first = batch[0]
            if isinstance(first, (str, bytes, int, float)):
                return len(batch)
            batch = first
        else:
            return None
    return None


def handed_out(rec: Recorder, batch: Any) -> None:
    """A loader gave ``batch`` to the loop: count its samples, tell the batch listeners."""
    n = batch_size_of(batch)
    if n:
        rec.add_samples(n)
    if rec.batch_listeners:
        rec.yielded(batch)


def _leaves_host(args: tuple, kwargs: dict) -> bool:
    """Whether ``Tensor.to(*args, **kwargs)`` targets a device other than the CPU."""
    dev = kwargs.get("device")
    if dev is None and args:
        a = args[0]
        if isinstance(a, (str, torch.device, int)) and not isinstance(a, bool):
            dev = a
        elif isinstance(a, torch.Tensor):
            dev = a.device
    if dev is None:
        return False
    if isinstance(dev, int):
        return True
    return torch.device(dev).type != "cpu"


class PhaseProbe:
    """Installs the phase hooks for one Recorder; ``remove()`` undoes all of it."""

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec
        self.tid = rec.thread_id
        self._handles: list[Any] = []
        self._patched = Patches()
        self._fwd_depth = 0
        self._fwd_token: int | None = None
        self._opt_tokens: list[int] = []
        self.lead_optimizer: int | None = None
        self.optimizers: dict[int, str] = {}
        self.models: dict[int, torch.nn.Module] = rec.models  # shared: the memory probe reads it
        self.installed = False
        self._gc_installed = False
        self._gc_start = 0

    # -- life cycle -------------------------------------------------------------------------
    def install(self) -> "PhaseProbe":
        if self.installed:
            return self
        self.installed = True
        try:
            mm = torch.nn.modules.module
            self._handles.append(mm.register_module_forward_pre_hook(self._fwd_pre))
            self._handles.append(mm.register_module_forward_hook(self._fwd_post, always_call=True))
            self._handles.append(_optim.register_optimizer_step_pre_hook(self._opt_pre))
            self._handles.append(_optim.register_optimizer_step_post_hook(self._opt_post))
            self._patched.set(torch.autograd, "backward", self._wrap_backward(torch.autograd.backward))
            self._patched.set(torch.optim.Optimizer, "zero_grad",
                        self._wrap_phase(torch.optim.Optimizer.zero_grad, "optimizer", "zero_grad"))
            self._patched.set(torch.nn.Module, "zero_grad",
                        self._wrap_phase(torch.nn.Module.zero_grad, "optimizer", "zero_grad"))
            self._patched.set(_dl._BaseDataLoaderIter, "__next__",
                        self._wrap_next(_dl._BaseDataLoaderIter.__next__, "DataLoader"))
            self._patched.set(torch.Tensor, "to", self._wrap_h2d(torch.Tensor.to, "Tensor.to", always=False))
            self._patched.set(torch.Tensor, "cuda", self._wrap_h2d(torch.Tensor.cuda, "Tensor.cuda", always=True))
            gc.callbacks.append(self._gc)
            self._gc_installed = True
        except BaseException:
            self.remove()
            raise
        return self

    def remove(self) -> None:
        """Undo every hook and patch, newest first. Idempotent."""
        if self._gc_installed:
            with contextlib.suppress(ValueError):
                gc.callbacks.remove(self._gc)
            self._gc_installed = False
        while self._handles:
            self._handles.pop().remove()
        self._patched.restore()
        self.installed = False

    # -- garbage collection -------------------------------------------------------------------
    def _gc(self, event: str, info: dict) -> None:
        """Python's collector pausing the loop: a ``gc`` span (nested in whatever phase it
        interrupted, so it also shows which phase paid for it). Recorded without phase
        listeners: nothing may allocate tensors inside a collection."""
        if threading.get_ident() != self.tid:
            return
        if event == "start":
            self._gc_start = perf_counter_ns()
        elif self._gc_start:
            end = perf_counter_ns()
            if end - self._gc_start >= GC_SPAN_MIN_NS:  # young collections are many and tiny
                rec = self.rec
                rec.add_span("gc", self._gc_start, end, f"gc gen{info.get('generation', '?')}",
                             depth=len(rec._stack))
            self._gc_start = 0

    # -- forward ----------------------------------------------------------------------------
    def _fwd_pre(self, module: torch.nn.Module, args: Any) -> None:
        if threading.get_ident() != self.tid:
            return
        if self._fwd_depth == 0:
            rec = self.rec
            if not any(rec.is_open(p) for p in _NOT_FORWARD):
                self._fwd_token = rec.enter("forward", type(module).__name__)
                if id(module) not in self.models:
                    self.models[id(module)] = module
        self._fwd_depth += 1

    def _fwd_post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if threading.get_ident() != self.tid:
            return
        self._fwd_depth = max(0, self._fwd_depth - 1)
        if self._fwd_depth == 0 and self._fwd_token is not None:
            token, self._fwd_token = self._fwd_token, None
            self.rec.exit(token)

    # -- optimizer --------------------------------------------------------------------------
    def _opt_pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if threading.get_ident() != self.tid:
            return
        key = id(opt)
        if key not in self.optimizers:
            self.optimizers[key] = type(opt).__name__
            if self.lead_optimizer is None:
                self.lead_optimizer = key
        self._opt_tokens.append(self.rec.enter("optimizer", type(opt).__name__))

    def _opt_post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if threading.get_ident() != self.tid or not self._opt_tokens:
            return
        self.rec.exit(self._opt_tokens.pop())
        rec = self.rec
        if id(opt) == self.lead_optimizer and not self._opt_tokens and not rec.explicit_steps:
            try:
                rec.end_step()  # may raise StopSlice: the step is complete, parameters updated
            except StopSlice:
                # The loop stops right after optimizer.step(), before its own zero_grad():
                # the update has consumed the gradients, so drop them as the loop would have,
                # or the next slice's first backward would add onto stale ones.
                zero_grad = type(opt).zero_grad
                getattr(zero_grad, "__wrapped__", zero_grad)(opt, set_to_none=True)
                raise

    # -- wrappers ---------------------------------------------------------------------------
    def _wrap_phase(self, fn: Any, phase: str, source: str) -> Any:
        rec, tid = self.rec, self.tid

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != tid:
                return fn(*args, **kwargs)
            token = rec.enter(phase, source)
            try:
                return fn(*args, **kwargs)
            finally:
                rec.exit(token)

        wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
        wrapper.__name__ = getattr(fn, "__name__", phase)
        wrapper.__doc__ = getattr(fn, "__doc__", None)
        return wrapper

    def _wrap_backward(self, fn: Any) -> Any:
        """backward phase; a scalar tensor being backpropagated is the step's loss (kept as a
        detached tensor and read after the slice, so no sync happens here)."""
        rec, tid = self.rec, self.tid

        def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != tid:
                return fn(tensors, *args, **kwargs)
            if isinstance(tensors, torch.Tensor) and tensors.numel() == 1:
                rec.losses.append((rec.step_index, tensors.detach()))
            token = rec.enter("backward", "autograd")
            try:
                return fn(tensors, *args, **kwargs)
            finally:
                rec.exit(token)

        backward.__wrapped__ = fn  # type: ignore[attr-defined]
        backward.__doc__ = fn.__doc__
        return backward

    def _wrap_next(self, fn: Any, source: str) -> Any:
        rec, tid = self.rec, self.tid

        def __next__(it: Any) -> Any:
            if threading.get_ident() != tid or rec.is_open("data_wait"):
                return fn(it)
            token = rec.enter("data_wait", source)
            try:
                batch = fn(it)
            finally:
                rec.exit(token)
            handed_out(rec, batch)
            return batch

        __next__.__wrapped__ = fn  # type: ignore[attr-defined]
        return __next__

    def _wrap_h2d(self, fn: Any, source: str, always: bool) -> Any:
        rec, tid = self.rec, self.tid

        def move(self_: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if (threading.get_ident() != tid or self_.device.type != "cpu"
                    or not (always or _leaves_host(args, kwargs)) or rec.is_open("h2d")):
                return fn(self_, *args, **kwargs)
            token = rec.enter("h2d", source)
            try:
                return fn(self_, *args, **kwargs)
            finally:
                rec.exit(token)

        move.__wrapped__ = fn  # type: ignore[attr-defined]
        move.__name__ = getattr(fn, "__name__", "to")
        move.__doc__ = getattr(fn, "__doc__", None)
        return move


def watch(iterable: Any, name: str = "watch") -> Any:
    """Time ``next()`` on any iterable as ``data_wait`` while a slice runs; free otherwise.

    >>> for batch in tp.watch(my_generator()): ...
    """
    return _timed_iter(iter(iterable), name)


def _timed_iter(it: Any, name: str) -> Any:
    from ..recorder import active

    while True:
        rec = active()
        if rec is None or threading.get_ident() != rec.thread_id or rec.is_open("data_wait"):
            try:
                item = next(it)
            except StopIteration:
                return
        else:
            token = rec.enter("data_wait", name)
            try:
                item = next(it)
            except StopIteration:
                return
            finally:
                rec.exit(token)
            handed_out(rec, item)
        yield item
