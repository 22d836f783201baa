"""CPUOffloadAdamW: AdamW whose fp32 master weights and moments live in host memory.

Why it is built this way: a host AdamW step is memory-bound (28 B per fp32 parameter; torch's
fused CPU kernel already runs at the machine's streaming bandwidth,
benchmarks/results/offload_quiet_run.txt), so making the step faster wins little. What offload
can win is *hiding* it:

- streaming step (default): a post-accumulate-grad hook on every parameter hands its gradient
  to a host worker thread as soon as autograd has finished it; the worker copies it out,
  updates that parameter on the host and copies the new weights back, while backward goes on
  with the layers below. ``step()`` only waits for what is left.
- ``delayed_update=True`` (ZeRO-Offload's DPU): ``step()`` of step t starts the whole host
  update in the background and returns; forward/backward of step t+1 run on the weights of
  step t-1, and the update lands at the next ``step()``. One step stale, fully hidden.
- ``moments_dtype=torch.bfloat16``: moments kept in bf16, 20 B moved per parameter, not 28.

Gradient clipping: ``max_grad_norm`` (what ``torch.nn.utils.clip_grad_norm_`` does) needs the
global norm, so no update may run before the last gradient is in: each gradient's norm is
still computed on the worker as it arrives (overlapped), but the updates run at ``step()`` and
the whole host step is exposed. With ``delayed_update`` clipping costs nothing extra.
``max_grad_value`` (what ``clip_grad_value_`` does) is per element and keeps streaming.

The gradient is taken when backward finishes it, so the loop must not change ``p.grad``
between ``backward()`` and ``step()`` (``clip_grad_norm_``, ``clip_grad_value_``, a
GradScaler's ``unscale_``): the update would not see it. The first ``step()`` is a check step:
its gradients stay in ``p.grad`` until ``step()`` (nothing streamed, nothing offloaded yet),
which compares each with what its hook saw (tensor, data pointer, version counter) and raises
``GradientChangedError`` naming ``max_grad_norm=`` / ``max_grad_value=`` before any weight
changes. Later steps keep the comparison where ``p.grad`` stays (``offload_gradients=False``)
and check that an offloaded ``p.grad`` was not set again.

Gradient accumulation: ``accumulation_steps=n`` makes every n-th gradient of a parameter
final; before that, offloaded gradients are summed on the host (so the device never holds
them), or left in ``p.grad`` with ``offload_gradients=False``. A ``step()`` after fewer
micro-batches still consumes what arrived. More ``backward()`` calls than that before one
``step()`` are summed like AdamW would when updates wait for ``step()`` (clipping,
``streaming=False``, ``delayed_update``); a streamed update has already run, so ``step()``
raises ``ExtraBackwardError`` naming ``accumulation_steps`` and the next step starts clean.

On a CPU-only machine the "device" is the host: with fp32 parameters and no delayed update,
the master weights *are* the parameters (no copy is made or moved back). The CUDA path ran on
one H200 (docs/GPU_RUNS.md): the same update as torch's AdamW (8.9e-8 after 5 steps), and a
355M-parameter GPT under a GPU budget AdamW's state does not fit; its host step (560 ms on 16
threads with torch's kernel) overlapped the GPU step by 6% only. It is built so:

- host buffers the GPU copies to or from (fp32 masters, gradient buffers) are views into a few
  large pinned arenas (tpkit/offload/arena.py): the pinned allocator rounds each block up to a
  power of two, so one block per parameter could pin twice the bytes; ``pinned_bytes`` is what
  the arenas asked of the allocator, which is what it pinned.
- one copy stream per device of the parameters, made on that device; events record each
  gradient's readiness on its device's compute stream (tpkit/offload/streams.py).
- sync points: the worker thread waits for a gradient's copy to the host before reading it, and
  (delayed update) for the weights' copy back before overwriting the master they are read
  from. The training thread never synchronises: the compute streams wait on events.

The work is reported to a running tpkit slice: the part of ``step()`` that waits for or does
host work is the ``offload`` phase; the background work and its overlap go to
``run.meta["offload"]`` (see tpkit/capture/probes/offload.py).
"""

from __future__ import annotations

import functools
import math
import queue
import threading
import weakref
from dataclasses import dataclass
from time import perf_counter_ns
from typing import Any, Callable, Iterable

import torch

from ..capture import recorder as _rec
from ..capture.probes.patching import UNIT_RESCALE_SKIPPERS, skip_unit_rescale
from .arena import HostArena
from .errors import ExtraBackwardError, GradientChangedError, OffloadArgumentError, OffloadError, StateDictLayoutError
from .kernels import HostKernel, KernelName, select_kernel
from .streams import CopyStreams, wait_host

_LIVE: "weakref.WeakSet[CPUOffloadAdamW]" = weakref.WeakSet()

__all__ = ["CPUOffloadAdamW", "ParamState", "StateDictLayoutError", "live_optimizers"]


def live_optimizers() -> list["CPUOffloadAdamW"]:
    """Every CPUOffloadAdamW alive in this process (the offload probe reads their counters)."""
    return list(_LIVE)


Fingerprint = tuple[int, int, int] | None  # (id, data_ptr, _version) of p.grad; None: no gradient


def grad_fingerprint(grad: torch.Tensor | None) -> Fingerprint:
    """What changes when ``p.grad`` is replaced or written in place (every in-place op bumps
    ``_version``): cheap to take in the hook and to compare at ``step()``."""
    if grad is None:
        return None
    try:
        ptr = grad.data_ptr()
    except RuntimeError:  # no storage (a sparse gradient): the object and its version still tell
        ptr = 0
    return (id(grad), ptr, grad._version)


@dataclass(eq=False)
class ParamState:
    """One parameter's host-side bookkeeping (its moments live in ``optimizer.state[param]``)."""

    index: int  # position over all parameter groups (the state dict's key)
    param: torch.nn.Parameter
    group: dict[str, Any]
    master: torch.Tensor  # fp32 host weights; the parameter's own tensor when ``alias``
    alias: bool  # fp32 on the host without DPU: the master copy is the parameter itself
    swap: bool  # DPU on the host: weights are handed over by swapping storages (see _copy_back)
    refresh: bool = False  # master must first take the parameter's values (after a swap)
    host_grad: torch.Tensor | None = None  # on the host, summed over this step's micro-batches
    micro: int = 0  # gradients received since the last step()
    updated: bool = False  # host update done this step
    grad_norm: torch.Tensor | None = None  # L2 norm of the final host gradient (clipping)
    seen: Fingerprint = None  # p.grad as the hook left it, compared at step()
    grad_buf: torch.Tensor | None = None  # device parameters: the host buffer gradients are copied into


class _Worker:
    """One host thread running offload jobs in FIFO order.

    It holds no reference to the optimizer (so the optimizer can be collected, which stops it);
    ``stop`` is safe to call twice and from ``weakref.finalize``.
    """

    def __init__(self, name: str, threads: int) -> None:
        self.threads = threads
        self.jobs: "queue.Queue[Callable[[], None] | None]" = queue.Queue()
        self.error: BaseException | None = None
        self.busy_ns = 0
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        torch.set_num_threads(self.threads)  # OpenMP's team size is per thread: the main one keeps its own
        while True:
            job = self.jobs.get()
            try:
                if job is None:
                    return
                if self.error is None:  # after a failure, drain without running
                    t = perf_counter_ns()
                    job()
                    self.busy_ns += perf_counter_ns() - t
                job = None  # drop the closure (and the tensors it holds) now, not at the next job
            except BaseException as e:  # reported to the main thread at the next wait
                self.error = e
            finally:
                self.jobs.task_done()

    def submit(self, job: Callable[[], None]) -> None:
        self.jobs.put(job)

    def wait(self) -> None:
        """Block until every submitted job ran; re-raise a job's failure here."""
        self.jobs.join()
        if self.error is not None:
            err, self.error = self.error, None
            raise OffloadError(f"the offload worker failed: {err!r}") from err

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._thread.is_alive():
            self.jobs.put(None)
            self._thread.join(timeout_s)


class CPUOffloadAdamW(torch.optim.Optimizer):
    """Drop-in AdamW (decoupled weight decay, same defaults as ``torch.optim.AdamW``) whose
    master weights and moments are host tensors.

    >>> opt = tp.offload.CPUOffloadAdamW(model.parameters(), lr=3e-4, weight_decay=0.1)

    ``state`` holds the host tensors (``exp_avg``, ``exp_avg_sq``, ``step``, and
    ``master_param`` when the master copy is separate from the parameter), so memory probes
    count them as optimizer state. ``state_dict()`` is in ``torch.optim.AdamW``'s format.
    Clip with ``max_grad_norm`` / ``max_grad_value`` (same results as ``clip_grad_norm_`` /
    ``clip_grad_value_`` before AdamW's step), not on ``p.grad``: see the module doc.
    ``worker_threads``: the host worker's OpenMP team (default: every core when the parameters
    are on a GPU, half of them when the "device" is this CPU and backward needs the rest).
    Call ``close()`` (or use it as a context manager) to stop its worker thread early; it also
    stops when the optimizer is garbage-collected.
    """

    #: Parameters on this device type go through host buffers and copy streams (the CUDA path).
    accelerator_type: str = "cuda"

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, max_grad_norm: float | None = None,
                 max_grad_value: float | None = None,
                 accumulation_steps: int = 1, offload_gradients: bool = True, streaming: bool = True,
                 delayed_update: bool = False, moments_dtype: torch.dtype = torch.float32,
                 kernel: KernelName = "auto", pin_memory: bool | None = None,
                 worker_threads: int | None = None) -> None:
        if not lr >= 0 or not eps >= 0 or not weight_decay >= 0:
            raise OffloadArgumentError(f"lr, eps and weight_decay must be >= 0; got {lr}, {eps}, {weight_decay}")
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise OffloadArgumentError(f"betas must be in [0, 1), got {betas}")
        if accumulation_steps < 1:
            raise OffloadArgumentError(f"accumulation_steps must be >= 1, got {accumulation_steps}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise OffloadArgumentError(f"max_grad_norm must be > 0 or None, got {max_grad_norm}")
        if max_grad_value is not None and not max_grad_value > 0:
            raise OffloadArgumentError(f"max_grad_value must be > 0 or None, got {max_grad_value}")
        if moments_dtype not in (torch.float32, torch.bfloat16):
            raise OffloadArgumentError(f"moments_dtype must be torch.float32 or torch.bfloat16, got {moments_dtype}")
        # AdamW's own defaults, so param_groups and state_dict() carry exactly its keys
        defaults = dict(torch.optim.AdamW([torch.zeros(1)], lr=lr, betas=betas, eps=eps,
                                          weight_decay=weight_decay).defaults)
        super().__init__(params, defaults)
        UNIT_RESCALE_SKIPPERS.add(self)  # a Trainer's clip_grad_norm_(params, inf) is no change
        skip_unit_rescale()
        for g in self.param_groups:
            if g.get("amsgrad") or g.get("maximize"):
                raise OffloadArgumentError("CPUOffloadAdamW supports neither amsgrad nor maximize")
        self.max_grad_norm = max_grad_norm
        self.max_grad_value = max_grad_value
        self.accumulation_steps = int(accumulation_steps)
        self.offload_gradients = bool(offload_gradients)
        self.delayed_update = bool(delayed_update)
        self.streaming = bool(streaming) and max_grad_norm is None and not delayed_update
        self.moments_dtype = moments_dtype
        choice = select_kernel(kernel, moments_dtype)
        self.kernel: HostKernel = choice.kernel
        self.kernel_reason = choice.reason
        self.last_grad_norm: float | None = None

        params_flat = [(p, g) for g in self.param_groups for p in g["params"]]
        if len({id(p) for p, _ in params_flat}) != len(params_flat):
            raise OffloadArgumentError("a parameter appears more than once in the parameter groups")
        devices = [p.device for p, _ in params_flat if self._on_device(p)]
        cuda = bool(devices)
        self.pin_memory = (torch.cuda.is_available() and cuda) if pin_memory is None else bool(pin_memory)
        self._streams = CopyStreams(devices) if cuda else None
        self._slots: list[ParamState] = [self._init_host_state(i, p, g) for i, (p, g) in enumerate(params_flat)]
        self._arenas = self._make_arenas()
        #: bytes the pinned arenas asked of the allocator (= pinned: each arena buffer is a power of two)
        self.pinned_bytes = sum(a.pinned_bytes for a in self._arenas)
        # copies of weights back to the device that the host must see done before it writes
        # their master again (delayed update; see step())
        self._unlanded: list[Any] = []
        # tensors the worker is done with, freed by the main thread at the next step(): a tensor
        # allocated on the main thread is then also freed there, where memory trackers (torch's
        # profiler memory events) see it, as they would see p.grad freed by zero_grad
        self._spent: list[torch.Tensor] = []
        # Until a step() has compared the gradients its hooks saw with p.grad (the check step,
        # see the module doc), hooks leave gradients in p.grad and nothing streams.
        self._checked = False
        self._extra_backward = 0  # most backward() calls one streamed parameter got this step
        # accounting (nanoseconds, totals since construction; the slice probe takes deltas)
        self.counters: dict[str, int] = dict(copy_out_ns=0, host_step_ns=0, copy_back_ns=0,
                                             exposed_ns=0, steps=0, grads=0)
        if worker_threads is None:  # a CPU-only "device" shares the cores with backward
            n = torch.get_num_threads()
            worker_threads = n if cuda else max(1, n // 2)
        self.worker_threads = int(worker_threads)
        self._worker = _Worker(f"tpkit-offload-{id(self):x}", self.worker_threads)
        self._finalizer = weakref.finalize(self, _stop_worker, self._worker, self.kernel)
        self._pending_copy_back = False
        self._hooks = [s.param.register_post_accumulate_grad_hook(_grad_hook(weakref.ref(self), s.index))
                       for s in self._slots if s.param.requires_grad]
        _LIVE.add(self)

    # -- host state -------------------------------------------------------------------------
    def _on_device(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is on the accelerator (reached through host buffers and copy streams)."""
        return t.device.type == self.accelerator_type

    def _init_host_state(self, index: int, p: torch.nn.Parameter, group: dict) -> ParamState:
        on_host = not self._on_device(p)
        alias = on_host and p.dtype == torch.float32 and not self.delayed_update
        # a separate master is placed in a host arena by _make_arenas (this one is temporary)
        master = p.detach() if alias else torch.empty(0)
        state = self.state[p]
        state["step"] = torch.tensor(0.0)
        state["exp_avg"] = torch.zeros(p.shape, dtype=self.moments_dtype)
        state["exp_avg_sq"] = torch.zeros(p.shape, dtype=self.moments_dtype)
        if not alias:
            state["master_param"] = master
        # DPU on the host: weights are handed over by swapping storages, not copied (see _copy_back)
        swap = self.delayed_update and on_host and p.dtype == torch.float32
        return ParamState(index=index, param=p, group=group, master=master, alias=alias, swap=swap)

    def _make_arenas(self) -> list[HostArena]:
        """Separate fp32 masters (and, for device parameters, host gradient buffers): with
        ``pin_memory``, views into one flat pinned arena; else tensors of their own (pageable
        memory is not rounded up). Masters take the parameters' values."""
        masters = [s for s in self._slots if not s.alias]
        grads = [s for s in self._slots if self._on_device(s.param) and s.param.requires_grad]
        specs = [(s.param.shape, torch.float32) for s in masters + grads]
        if not specs:
            return []
        arena = HostArena(specs, pin_memory=True) if self.pin_memory else None
        views = arena.views if arena is not None else [torch.empty(shape, dtype=dt) for shape, dt in specs]
        for s, view in zip(masters, views):
            view.copy_(s.param.detach())
            s.master = view
            self.state[s.param]["master_param"] = view
        for s, view in zip(grads, views[len(masters):]):
            s.grad_buf = view
        return [arena] if arena is not None else []

    def host_state_bytes(self) -> int:
        """Bytes of the host optimizer state (moments, step counters, separate master copies):
        exactly what a memory probe counts from ``self.state``."""
        return sum(v.numel() * v.element_size() for s in self._slots for v in self.state[s.param].values()
                   if isinstance(v, torch.Tensor))

    def host_grad_bytes(self) -> int:
        """Bytes of gradients held on the host right now (offloaded, not yet consumed)."""
        return sum(s.host_grad.numel() * s.host_grad.element_size() for s in self._slots
                   if s.host_grad is not None and s.host_grad.device.type == "cpu")

    # -- the gradient path ------------------------------------------------------------------
    def _on_grad(self, i: int) -> None:
        """A parameter's gradient is accumulated (autograd's thread): hand it to the worker."""
        s = self._slots[i]
        p = s.param
        s.micro += 1
        if s.micro > self.accumulation_steps and self.streaming:
            # One backward() too many: this parameter's update already ran (or would have, after
            # the check step). Leave the gradient in p.grad; step() refuses (ExtraBackwardError).
            self._extra_backward = max(self._extra_backward, s.micro)
            return
        final = s.micro >= self.accumulation_steps
        if not self._checked or (not self.offload_gradients and not final) or p.grad is None:
            s.seen = grad_fingerprint(p.grad)
            return  # autograd keeps accumulating into p.grad
        grad = p.grad
        first = s.micro == 1 or not self.offload_gradients
        if self.offload_gradients:
            p.grad = None  # the device copy is freed once the worker holds it
        s.seen = grad_fingerprint(p.grad)
        event = None
        if self._on_device(grad):
            assert self._streams is not None
            event = self._streams.compute_event(grad.device)
        update = final and self.streaming
        self._worker.submit(lambda: self._take_grad(s, grad, event, first, final, update))

    def _take_grad(self, s: ParamState, grad: torch.Tensor, event: Any, first: bool, final: bool,
                   update: bool) -> None:
        """Worker: gradient to host (copy or add), its norm if clipping, the update if due."""
        t = perf_counter_ns()
        if self._on_device(grad):
            assert self._streams is not None  # made in __init__ when a parameter is on a GPU
            stream = self._streams.stream(grad.device)
            with torch.cuda.device(grad.device), torch.cuda.stream(stream):
                stream.wait_event(event)  # the gradient is complete on the compute stream
                host = self._host_grad_buffer(s)
                if first:
                    host.copy_(grad, non_blocking=True)
                    stream.synchronize()  # sync point (worker thread): the host reads it next
                else:
                    host.add_(grad.to("cpu", torch.float32))
                grad.record_stream(stream)
        elif first or s.host_grad is None:
            # on the host already: own the tensor when it was handed over, else read it in place
            s.host_grad = grad if grad.dtype == torch.float32 else grad.float()
        else:
            s.host_grad.add_(grad)
        if not self._on_device(grad):  # a device gradient is freed at once: that is the point
            self._spent.append(grad)
        self.counters["copy_out_ns"] += perf_counter_ns() - t
        self.counters["grads"] += 1
        if final and self.max_grad_value is not None:
            v, g = self.max_grad_value, s.host_grad
            assert g is not None
            if g is s.param.grad:  # p.grad itself (offload_gradients=False): not ours to write
                s.host_grad = g.clamp(-v, v)
            else:
                g.clamp_(-v, v)
        if final and self.max_grad_norm is not None:
            s.grad_norm = torch.linalg.vector_norm(s.host_grad, 2.0)
        if update:
            self._update(s, clip_coef=None)

    def _host_grad_buffer(self, s: ParamState) -> torch.Tensor:
        """The host gradient being summed this step, else the parameter's arena buffer."""
        if s.host_grad is None:
            if s.grad_buf is None:  # a gradient the hooks never saw, on a frozen parameter
                s.grad_buf = torch.empty(s.param.shape, dtype=torch.float32)
            s.host_grad = s.grad_buf
        return s.host_grad

    def _update(self, s: ParamState, clip_coef: float | None) -> None:
        """Worker: one parameter's host AdamW update, then its weights back to the device."""
        p, g, group = s.param, s.host_grad, s.group
        assert g is not None
        state = self.state[p]
        if clip_coef is not None and clip_coef < 1.0:
            g.mul_(clip_coef)
        t = perf_counter_ns()
        if s.refresh:  # after a swap the master buffer holds old weights: bring it up to date
            s.master.copy_(p.detach())
            s.refresh = False
            t_ref = perf_counter_ns()
            self.counters["copy_back_ns"] += t_ref - t
            t = t_ref
        state["step"] += 1
        beta1, beta2 = group["betas"]
        self.kernel.step(s.master.view(-1), g.reshape(-1), state["exp_avg"].view(-1),
                         state["exp_avg_sq"].view(-1), int(state["step"].item()), float(group["lr"]),
                         float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"]))
        t2 = perf_counter_ns()
        self.counters["host_step_ns"] += t2 - t
        s.updated = True
        if g is not s.grad_buf:
            self._spent.append(g)  # a host gradient we own is dropped like p.grad would be
        s.host_grad = None  # (an arena buffer is kept for the next gradient)
        if not self.delayed_update:
            self._copy_back(s)
            self.counters["copy_back_ns"] += perf_counter_ns() - t2

    def _copy_back(self, s: ParamState) -> None:
        """New weights to the parameter. On the host with a delayed update this is a swap of
        storages (O(1) on the critical path): the parameter takes the updated master buffer,
        and its old buffer becomes the next master, refreshed by the worker in the background
        before the next update."""
        if s.alias:
            return
        p = s.param
        if s.swap:
            old = p.data
            p.data = s.master
            s.master = old
            self.state[p]["master_param"] = old
            s.refresh = True
            return
        if self._on_device(p):
            assert self._streams is not None
            with torch.cuda.device(p.device), torch.cuda.stream(self._streams.stream(p.device)):
                p.detach().copy_(s.master, non_blocking=True)
        else:
            p.detach().copy_(s.master)

    # -- step -------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        rec = _rec.active()
        token = rec.enter("offload", "CPUOffloadAdamW") if (
            rec is not None and threading.get_ident() == rec.thread_id) else None
        t0 = perf_counter_ns()
        try:
            self._step()
        except BaseException:
            self._abandon_step()  # whatever failed, the next step starts clean
            raise
        finally:
            self.counters["exposed_ns"] += perf_counter_ns() - t0
            self.counters["steps"] += 1
            if token is not None and rec is not None:
                rec.exit(token)
        return loss

    def _step(self) -> None:
        """What is left of the step once backward is done. Work that has to wait for it anyway
        runs right here on the calling thread once the worker is idle (a hop to the worker
        would only add a thread handover and a second OpenMP team competing for the cores);
        only DPU's update goes back to the worker, to run behind the next forward/backward."""
        w = self._worker
        w.wait()  # streamed gradients and updates are in (DPU: update t-1 too)
        self._check_loop()
        if any(s.micro > 0 for s in self._slots):
            self._checked = True
        # gradients the hooks never saw (set by hand, or a parameter without requires_grad)
        for s in self._slots:
            p = s.param
            if p.grad is not None and s.micro == 0:
                s.micro = self.accumulation_steps
                grad = p.grad
                if self.offload_gradients:
                    p.grad = None
                self._take_grad(s, grad, self._grad_event(grad), True, True, False)
        if self.delayed_update:
            for s in self._slots:  # update t-1 is done; t's are due now
                s.updated = False
            if self._pending_copy_back:
                self._apply_copy_back()  # update t-1 to the parameters (queued, not waited for)
            self._spent.clear()  # update t-1's gradients; t's stay until the next step
            due = self._consume_due()
            coef = self._clip_coef(due)
            if due and self._unlanded:
                # the worker writes the masters next: first the copies reading them must have run
                # (a sync on the worker thread, behind the next forward; not on this thread)
                w.submit(functools.partial(wait_host, self._unlanded))
                self._unlanded = []
            for s in due:
                if s.host_grad is not None and s.host_grad is s.param.grad:
                    # p.grad itself (offload_gradients=False on the host): the loop may zero it or
                    # accumulate into it in place while this update runs behind the next backward
                    s.host_grad = s.host_grad.clone()
                w.submit(functools.partial(self._update, s, coef))
            self._pending_copy_back = bool(due)
            return
        due = self._consume_due()
        if due:  # not streamed (clipping, streaming=False): the whole host step, exposed
            coef = self._clip_coef(due)
            for s in due:
                self._update(s, coef)
        for s in self._slots:
            s.updated = False
        self._spent.clear()  # the worker is idle: consumed gradients are freed here, on this thread
        if self._streams is not None:
            self._streams.publish()  # weights back before the next forward (on the GPU)

    def _grad_event(self, grad: torch.Tensor) -> Any:
        """Readiness of a device gradient on its compute stream (None on the host)."""
        if not self._on_device(grad):
            return None
        assert self._streams is not None
        return self._streams.compute_event(grad.device)

    def _apply_copy_back(self) -> None:
        """Delayed update: the finished host update to every parameter. On a GPU the copies
        are queued after the compute work already queued (a backward may still read the
        weights) and the compute streams wait for them; the host does not wait."""
        if self._streams is not None:
            self._streams.after_compute()
        for s in self._slots:
            self._copy_back(s)
        if self._streams is not None:
            self._unlanded += self._streams.publish()
        self._pending_copy_back = False

    def _check_loop(self) -> None:
        """Refuse a loop the host update cannot follow, before anything of this step is applied
        (the worker is idle here)."""
        if self._extra_backward:
            n, k = self._extra_backward, self.accumulation_steps
            done = ("nothing was updated in this step" if not self._checked else
                    f"the parameters hold the update made from the first {k} backward()")
            raise ExtraBackwardError(
                f"CPUOffloadAdamW: {n} backward() calls before one step() with accumulation_steps={k}: "
                f"a streamed update runs as soon as a parameter's gradient is final, so later "
                f"gradients cannot be added to it ({done}). To accumulate gradients pass "
                f"accumulation_steps={n} ({n} backward() per step()), or streaming=False to sum any "
                f"number of backward() calls at step(). Call zero_grad() before the next backward(); "
                f"the optimizer is ready for it.")
        changed = [s for s in self._slots if s.micro > 0 and grad_fingerprint(s.param.grad) != s.seen]
        if changed:
            names = ", ".join(f"#{s.index} {tuple(s.param.shape)}" for s in changed[:4])
            more = f" and {len(changed) - 4} more" if len(changed) > 4 else ""
            done = ("nothing was updated in this step" if not self._checked else
                    "parameters whose update had already streamed keep it")
            raise GradientChangedError(
                f"CPUOffloadAdamW: the gradient of parameter {names}{more} changed between backward() "
                f"and step() (torch.nn.utils.clip_grad_norm_, clip_grad_value_, a GradScaler's "
                f"unscale_, or p.grad set by hand). This optimizer takes each gradient when backward "
                f"finishes it, so the change would be lost: clip with CPUOffloadAdamW(..., "
                f"max_grad_norm=...) instead of clip_grad_norm_ (same result), or max_grad_value=... "
                f"instead of clip_grad_value_ (with a Hugging Face Trainer: TrainingArguments("
                f"max_grad_norm=0) and CPUOffloadAdamW(..., max_grad_norm=1.0)); {done}.")

    def _abandon_step(self) -> None:
        """After a refused or failed step: wait for the worker, forget this step's gradients
        (p.grad is left to the user's zero_grad) and reset the per-step counts, so the next
        backward()/step() starts from a clean state."""
        try:
            self._worker.wait()
        except OffloadError:
            pass
        for s in self._slots:
            s.micro = 0
            s.updated = False
            s.grad_norm = None
            s.seen = None
            s.host_grad = None  # (an arena buffer stays for the next gradient)
        self._extra_backward = 0
        self._spent.clear()

    def _consume_due(self) -> list[ParamState]:
        """Parameters whose gradient arrived this step and which still need their update (the
        worker is idle here); resets the per-step gradient counts. A streamed parameter whose
        last micro-batch never came (``step()`` called early), and every parameter of the check
        step, is updated here."""
        due = [s for s in self._slots if s.micro > 0 and not s.updated]
        for s in due:  # gradients still in p.grad (check step, offload_gradients=False, last micro-batch missing)
            p = s.param
            if s.host_grad is None and p.grad is not None:
                grad = p.grad
                if self.offload_gradients:
                    p.grad = None
                self._take_grad(s, grad, self._grad_event(grad), True, True, False)
        if self.streaming:
            for s in due:
                self._update(s, None)
            due = []
        for s in self._slots:
            s.micro = 0
            s.seen = None
        return due

    def _clip_coef(self, due: list[ParamState]) -> float | None:
        """torch.nn.utils.clip_grad_norm_'s coefficient from the per-gradient norms."""
        if self.max_grad_norm is None or not due:
            return None
        self._worker.wait()
        norms = [s.grad_norm if s.grad_norm is not None else torch.linalg.vector_norm(s.host_grad, 2.0)
                 for s in due]
        total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
        for s in self._slots:
            s.grad_norm = None
        self.last_grad_norm = float(total)
        coef = self.max_grad_norm / (self.last_grad_norm + 1e-6)
        return min(coef, 1.0) if math.isfinite(coef) else coef

    def flush(self) -> None:
        """Wait for background work; with ``delayed_update``, apply the pending update to the
        parameters (call before evaluating or saving the model)."""
        self._worker.wait()
        if self._pending_copy_back:
            self._apply_copy_back()  # the compute streams wait for it; the host need not
        self._spent.clear()

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)

    # -- state dict (torch.optim.AdamW's format) -----------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """AdamW's layout: ``{"state": {index: {step, exp_avg, exp_avg_sq}}, "param_groups"}``,
        moments as fp32 tensors shaped like their parameters, only for parameters that were
        updated (as AdamW, whose state is created at the first update)."""
        self.flush()
        state: dict[int, dict[str, torch.Tensor]] = {}
        for slot in self._slots:
            s = self.state[slot.param]
            if float(s["step"]) == 0:
                continue
            state[slot.index] = {"step": s["step"].clone(),
                                 "exp_avg": s["exp_avg"].to(torch.float32, copy=True),
                                 "exp_avg_sq": s["exp_avg_sq"].to(torch.float32, copy=True)}
        groups, start = [], 0
        for g in self.param_groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            packed["params"] = list(range(start, start + len(g["params"])))
            start += len(g["params"])
            groups.append(packed)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load AdamW's (or our) state dict. Checks the whole layout first: a different number
        of groups or parameters, or a moment whose shape differs from its parameter, raises
        ``StateDictLayoutError`` and nothing is changed. Master weights are re-read from the
        parameters (load the model's weights first, as with any optimizer)."""
        groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        saved_state = state_dict.get("state", {}) if isinstance(state_dict, dict) else None
        if not isinstance(groups, list) or not isinstance(saved_state, dict):
            raise StateDictLayoutError("not an optimizer state dict: expected 'state' and 'param_groups'")
        if len(groups) != len(self.param_groups):
            raise StateDictLayoutError(f"the state dict has {len(groups)} parameter groups, this optimizer "
                                       f"{len(self.param_groups)}; nothing was loaded")
        index: dict[Any, int] = {}
        for gi, (saved, mine) in enumerate(zip(groups, self.param_groups)):
            if len(saved["params"]) != len(mine["params"]):
                raise StateDictLayoutError(
                    f"group {gi} has {len(saved['params'])} parameters in the state dict and "
                    f"{len(mine['params'])} here; nothing was loaded")
            for key in saved["params"]:
                index[key] = len(index)
        for key, s in saved_state.items():
            if key not in index:
                raise StateDictLayoutError(f"state for parameter {key!r}, which no group lists; nothing was loaded")
            p = self._slots[index[key]].param
            for name in ("exp_avg", "exp_avg_sq"):
                t = s.get(name)
                if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(p.shape):
                    got = tuple(t.shape) if isinstance(t, torch.Tensor) else t
                    raise StateDictLayoutError(
                        f"parameter {index[key]}: {name} has shape {got}, the parameter {tuple(p.shape)}; "
                        "the state dict is from a different model or parameter order; nothing was loaded")
            if "step" not in s:
                raise StateDictLayoutError(f"parameter {index[key]}: no 'step' in its state; nothing was loaded")
        # layout checked: now change things
        self.flush()
        wait_host(self._unlanded)  # sync point: the masters are written below, copies read them
        self._unlanded = []
        by_index = {index[k]: s for k, s in saved_state.items()}
        for slot in self._slots:
            p = slot.param
            st, s = self.state[p], by_index.get(slot.index)
            if s is None:
                st["step"].zero_()
                st["exp_avg"].zero_()
                st["exp_avg_sq"].zero_()
            else:
                st["step"].copy_(torch.as_tensor(s["step"], dtype=torch.float32))
                st["exp_avg"].copy_(s["exp_avg"])
                st["exp_avg_sq"].copy_(s["exp_avg_sq"])
            if not slot.alias:
                slot.master.copy_(p.detach())
        for saved, mine in zip(groups, self.param_groups):
            for k, v in saved.items():
                if k != "params":
                    mine[k] = v

    # -- life cycle -------------------------------------------------------------------------
    def close(self) -> None:
        """Finish pending work, remove the hooks and stop the worker thread. Idempotent."""
        try:
            self.flush()
        finally:
            for h in self._hooks:
                h.remove()
            self._hooks = []
            self._finalizer()

    def __enter__(self) -> "CPUOffloadAdamW":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def describe(self) -> dict[str, Any]:
        """Static facts for run.meta."""
        return {"optimizer": type(self).__name__, "kernel": self.kernel.name, "kernel_reason": self.kernel_reason,
                "mode": "delayed" if self.delayed_update else ("streaming" if self.streaming else "at_step"),
                "moments_dtype": str(self.moments_dtype).replace("torch.", ""),
                "clipping": self.max_grad_norm, "max_grad_value": self.max_grad_value, "accumulation_steps": self.accumulation_steps,
                "offload_gradients": self.offload_gradients, "pin_memory": self.pin_memory,
                "worker_threads": self.worker_threads,
                "parameters": sum(s.param.numel() for s in self._slots),
                "pinned_bytes": self.pinned_bytes, "host_state_bytes": self.host_state_bytes(),
                "host_grad_bytes": self.host_grad_bytes()}


def _grad_hook(ref: "weakref.ref[CPUOffloadAdamW]", i: int) -> Callable[[torch.Tensor], None]:
    def hook(param: torch.Tensor) -> None:
        opt = ref()
        if opt is not None:
            opt._on_grad(i)
    return hook


def _stop_worker(worker: _Worker, kernel: Any) -> None:
    worker.stop()
    close = getattr(kernel, "close", None)
    if close is not None:
        close()
