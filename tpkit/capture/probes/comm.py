"""The communication probe: how long a rank is blocked in collectives, and which collectives ran
behind compute.

``CommProbe`` is standalone (imports only torch and the standard library; tests load it from its
file). A slice runs it through ``SliceCommProbe`` (at the end of this file), installed by
``tpkit.capture.slice`` whenever a process group is up: waits become ``comm`` spans of the
Recorder (``run.steps.comm_s``), in-flight time ``comm_overlapped`` spans. ``CommProbe`` calls ``on_span("comm", start_ns, end_ns, detail)`` for every
*exposed* wait (the rank could not go on until a collective finished) and keeps every collective's
*overlapped* time (in flight while the rank computed) in ``overlapped()``. Times are
``time.perf_counter_ns`` (the Recorder's clock).

How collectives are seen, without replacing anything the user or a framework installed:

- **Every collective is issued through the dispatcher.** Since torch 2.0, ``ProcessGroup``'s
  methods call the ``c10d::*`` operators (``c10d::allreduce_``, ``c10d::_allgather_base_``,
  ``c10d::reduce_scatter_tensor_coalesced_`` ...), whoever calls them: DDP's C++ Reducer for its
  gradient buckets (with the built-in all-reduce or any comm hook), FSDP2's all-gathers and
  reduce-scatters, DeepSpeed (``deepspeed.comm`` calls ``torch.distributed``), functional
  collectives (DTensor), and direct ``torch.distributed`` calls. The probe registers a kernel for
  those operators at the ``ADInplaceOrView`` key, one step above the backend kernels and after the
  autograd fallback (so autograd's behaviour is untouched): it stamps the issue, redispatches to
  the real kernel, and on gloo takes its completion time from the returned Work: at once when it
  already completed, else from a callback on its future.
  ``remove()`` destroys that registration and the operators dispatch as before (a fallthrough).
  DDP's ``register_comm_hook`` (one per model, never removable) is left to the user.
- **Exposed waits.** ``Work.wait`` is patched (Python ``torch.distributed`` calls it for every
  synchronous collective and for ``async_op=True`` handles; FSDP2 and DeepSpeed call it), and so
  is ``_c10d_functional::wait_tensor``. Two C++ entry points that block on broadcasts are wrapped
  as well: ``torch.distributed._broadcast_coalesced`` (DDP's buffer/parameter sync) and
  ``Reducer._rebuild_buckets`` (DDP's bucket-order broadcast on its second iteration).
- **The end of backward.** DDP waits for its buckets inside a callback the autograd engine runs
  after the last gradient (``Reducer::finalize_backward``, C++); FSDP2's final callback waits for
  its reduce-scatters the same way. When a collective is issued during a backward pass, the probe
  queues an engine callback (A); A runs once the graph's compute is done and queues a second one
  (B), which runs after every callback queued before it. [A, B] is the time the backward pass was
  held by those callbacks: the rank waiting for its gradient collectives (plus their small copies
  back into ``.grad``). It is reported as one exposed span of kind ``end_of_backward``.

Nested waits (a ``Work.wait`` inside ``_broadcast_coalesced``) are reported once, by the outer one.

On CUDA (guarded by ``torch.cuda.is_available()``, never a sync per step): a NCCL wait does not
block the host, it makes the current stream wait. Each exposed wait therefore also records a CUDA
event before and after it on the current stream (``detail["start_event"]`` / ``["end_event"]``:
the stream's stall is the time between them, resolved after the slice like the Recorder's own
span events), and each collective records an event at issue; ``overlapped(resolve=...)`` turns
[issue, first wait] into host time. Completion times from futures are not used on CUDA (a NCCL
future is marked complete when the kernel is enqueued). FSDP2 on CUDA waits with
``Stream.wait_event`` rather than ``Work.wait``; that stall is not seen here. The CUDA path has not
been run on a GPU yet.

Use::

    probe = CommProbe(on_span=lambda phase, s, e, d: spans.append((phase, s, e, d))).install()
    try:
        train()
    finally:
        probe.remove()
    probe.overlapped()   # [(start_ns, end_ns, detail)] of collectives in flight behind compute
    probe.totals()       # {"exposed_s", "overlapped_s", "ops", "bytes", "by_op": {...}}
"""

from __future__ import annotations

import os
import threading
from time import perf_counter_ns
from typing import Any, Callable

import torch

from ...intervals import merge, subtract

OnSpan = Callable[[str, int, int, dict], None]

PHASE = "comm"

#: ``c10d`` operators and the collective each one is. ``check_for_nan`` is not a collective.
C10D_OPS: dict[str, str] = {
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce",
    "allgather_": "all_gather", "_allgather_base_": "all_gather", "allgather_coalesced_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "reduce_scatter_": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "reduce_": "reduce", "broadcast_": "broadcast", "gather_": "gather", "scatter_": "scatter",
    "alltoall_": "all_to_all", "alltoall_base_": "all_to_all", "barrier": "barrier",
    "monitored_barrier_": "barrier", "send": "send", "recv_": "recv", "recv_any_source_": "recv",
}

#: Kernel key: above the backends, below autograd (see the module docstring).
DISPATCH_KEY = "ADInplaceOrView"

#: Collectives remembered for ``overlapped()``; past this the oldest are dropped (a note says so).
MAX_OPS = 200_000
#: Work handles kept to match a later ``wait()`` with its collective: in flight (gloo) or not
#: waited yet (CUDA), pruned past this many.
MAX_PENDING = 512
#: Handles of completed, not yet waited collectives kept (a ``wait()`` right after issue must find
#: the same Python object); only this many, so the probe keeps almost no tensor alive.
MAX_COMPLETED = 16

_ACTIVE: "CommProbe | None" = None


class Collective:
    """One collective as issued: what, how big, when it was issued and when it completed."""

    __slots__ = ("op", "bytes", "device", "issue_ns", "done_ns", "wait_ns", "in_backward",
                 "issue_event", "wait_event")

    def __init__(self, op: str, nbytes: int, device: str, issue_ns: int, in_backward: bool) -> None:
        self.op, self.bytes, self.device = op, nbytes, device
        self.issue_ns = issue_ns
        self.done_ns: int | None = None  # completion (gloo: the Work's future), host clock
        self.wait_ns: int | None = None  # first wait on it from Python, host clock
        self.in_backward = in_backward
        self.issue_event: Any = None  # CUDA event on the issuing stream
        self.wait_event: Any = None  # CUDA event on the waiting stream, before the wait

    def as_dict(self) -> dict[str, Any]:
        return {"op": self.op, "bytes": self.bytes, "device": self.device,
                "issue_ns": self.issue_ns, "done_ns": self.done_ns, "wait_ns": self.wait_ns,
                "in_backward": self.in_backward}


def _tensor_bytes(args: tuple) -> tuple[int, str]:
    """Bytes of the first argument's tensors (the collective's input; a list of lists for
    all_gather's outputs is not the payload) and their device type."""
    first = args[0] if args else None
    tensors = first if isinstance(first, (list, tuple)) else [first]
    total, device = 0, "cpu"
    for t in tensors:
        if isinstance(t, (list, tuple)):  # allgather_'s output lists come second; a nested first arg
            t = t[0] if t else None
        if isinstance(t, torch.Tensor):
            total += t.numel() * t.element_size()
            device = t.device.type
    return total, device


class _CudaClock:
    """Events on the host clock: one reference event recorded right after a synchronisation at
    install, one synchronisation in ``finish()``; nothing in between."""

    def __init__(self) -> None:
        torch.cuda.synchronize()
        self.ref = torch.cuda.Event(enable_timing=True)
        self.ref_ns = perf_counter_ns()
        self.ref.record()
        self.finished = False

    @staticmethod
    def mark() -> Any:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def finish(self) -> None:
        if not self.finished:
            torch.cuda.synchronize()
            self.finished = True

    def resolve(self, ev: Any) -> int:
        self.finish()
        return self.ref_ns + int(self.ref.elapsed_time(ev) * 1e6)


class CommProbe:
    """Times collectives; ``install()`` / ``remove()`` (idempotent, exact, safe after a failed
    install). One probe may be installed at a time."""

    def __init__(self, on_span: OnSpan | None = None, *, max_ops: int = MAX_OPS, cuda_clock: Any = None) -> None:
        self.on_span = on_span
        self.max_ops = max_ops
        # On CUDA: what marks and resolves events (``mark()``, ``finish()``, ``resolve(mark)``); the
        # slice passes its CUDA timer so the probe's events resolve with the Recorder's. None: its own.
        self._clock = cuda_clock
        self.ops: list[Collective] = []
        self.exposed: list[tuple[int, int, dict]] = []  # every exposed span reported, host clock
        self.notes: list[str] = []
        self.installed = False
        self.hooked: list[str] = []  # what install() caught, for run.meta
        self._libs: list[Any] = []
        self._patched: list[tuple[Any, str, Any, bool]] = []  # (owner, attr, original, owned)
        self._pending: dict[int, tuple[Any, Collective]] = {}  # id(Work) -> (Work, collective)
        # Completed on gloo before anyone waited, the newest MAX_COMPLETED: id(Work) -> (Work,
        # collective). The handle is kept so that the caller gets this same Python object (pybind
        # returns the live instance of a C++ object) when the collective completed before the
        # call returned, and its id stays valid.
        self._completed: dict[int, tuple[Any, Collective]] = {}
        self._tls = threading.local()  # .depth: open exposed waits on this thread
        self._graph_tasks: set[int] = set()  # backward passes that already queued callback A
        # end-of-backward windows whose callback B has not run: graph task -> (A's start, -1
        # before A runs; thread id). One left at the end with A run is a backward pass that a
        # failed collective ended
        self.unfinished: dict[int, tuple[int, int]] = {}
        self._cuda: _CudaClock | None = None
        self._issued = 0  # collectives issued since install, kept or not
        self._world: int | None = None  # the default process group's size at install
        # Waits under way: thread id -> (start_ns, the collective's op); one dict write and pop per
        # exposed wait, read by the rank watchdog (``blocked``) when no step ended for a while
        self._waiting: dict[int, tuple[int, str]] = {}

    # -- life cycle ---------------------------------------------------------------------------
    def install(self) -> "CommProbe":
        global _ACTIVE
        if self.installed:
            return self
        if _ACTIVE is not None:
            raise RuntimeError("a CommProbe is already installed; remove it first")
        import torch.distributed as dist

        if not dist.is_available():
            self._note("torch.distributed is not available in this build: no collective is timed")
            return self
        self.installed = True
        _ACTIVE = self
        try:
            self._world = dist.get_world_size() if dist.is_initialized() else None
            if self._world == 1:
                self._note("one rank: collectives have no peer, so their time in flight is not timed "
                           "(no completion callbacks); waits for them are")
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                self._cuda = self._clock if self._clock is not None else _CudaClock()
            from torch._C import _distributed_c10d as c10d

            lib = torch.library.Library("c10d", "IMPL")
            self._libs.append(lib)
            for name, kind in C10D_OPS.items():
                packet = getattr(torch.ops.c10d, name, None)
                if packet is None:
                    continue
                lib.impl(name, self._issue_kernel(packet.default, kind, c10d.Work), DISPATCH_KEY,
                         with_keyset=True)
                self.hooked.append(f"c10d::{name}")
            wait_tensor = getattr(getattr(torch.ops, "_c10d_functional", None), "wait_tensor", None)
            if wait_tensor is not None:
                flib = torch.library.Library("_c10d_functional", "IMPL")
                self._libs.append(flib)
                flib.impl("wait_tensor", self._wait_tensor_kernel(wait_tensor.default), DISPATCH_KEY,
                          with_keyset=True)
                self.hooked.append("_c10d_functional::wait_tensor")
            self._patch(c10d.Work, "wait", self._wrap_wait(c10d.Work.wait))
            self.hooked.append("Work.wait")
            if hasattr(dist, "_broadcast_coalesced"):
                self._patch(dist, "_broadcast_coalesced",
                            self._wrap_blocking(dist._broadcast_coalesced, "broadcast", "_broadcast_coalesced"))
                self.hooked.append("torch.distributed._broadcast_coalesced")
            reducer = getattr(c10d, "Reducer", None)
            if reducer is not None and hasattr(reducer, "_rebuild_buckets"):
                self._patch(reducer, "_rebuild_buckets",
                            self._wrap_blocking(reducer._rebuild_buckets, "broadcast", "Reducer._rebuild_buckets"))
                self.hooked.append("Reducer._rebuild_buckets")
        except BaseException:
            self.remove()
            raise
        return self

    def remove(self) -> None:
        """Undo every registration and patch, newest first. Idempotent."""
        global _ACTIVE
        self.installed = False  # kernels still called during the teardown just pass through
        errors: list[BaseException] = []
        while self._patched:
            owner, attr, orig, owned = self._patched.pop()
            try:
                if owned:
                    setattr(owner, attr, orig)
                else:
                    delattr(owner, attr)
            except Exception as e:  # keep undoing the rest
                errors.append(e)
        while self._libs:
            try:
                self._libs.pop()._destroy()
            except Exception as e:
                errors.append(e)
        self._pending.clear()  # drop every Work handle: the probe keeps no tensor alive
        self._completed.clear()
        self._graph_tasks.clear()
        self.unfinished.clear()
        if _ACTIVE is self:
            _ACTIVE = None
        if errors:
            raise errors[0]

    def __enter__(self) -> "CommProbe":
        return self.install()

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def _patch(self, owner: Any, attr: str, new: Any) -> None:
        owned = attr in owner.__dict__ if isinstance(owner, type) else True
        orig = owner.__dict__[attr] if isinstance(owner, type) and owned else getattr(owner, attr)
        self._patched.append((owner, attr, orig, owned))
        setattr(owner, attr, new)

    # -- results ------------------------------------------------------------------------------
    def overlapped(self, resolve: Callable[[Any], int] | None = None) -> list[tuple[int, int, dict]]:
        """Collectives' time in flight that no exposed wait covers: ``(start_ns, end_ns, detail)``
        pieces, host clock. A collective's interval is [issue, completion] where completion is
        known (gloo), else [issue, first wait] (an upper bound; on CUDA from the events, with
        ``resolve(event) -> host ns``, by default the probe's own reference)."""
        holes = merge([(s, e) for s, e, d in self._exposed_resolved(resolve)])
        out = []
        for c in list(self.ops):
            start, end, bound = c.issue_ns, c.done_ns, "completed"
            if c.issue_event is not None and c.wait_event is not None:
                res = resolve or self._default_resolve()
                if res is None:
                    continue
                start, end, bound = res(c.issue_event), res(c.wait_event), "waited"
            elif end is None:
                end, bound = c.wait_ns, "waited"
            if end is None or end <= start:
                continue
            for s, e in subtract(start, end, holes):
                out.append((s, e, {"op": c.op, "bytes": c.bytes, "end": bound, "in_backward": c.in_backward}))
        return out

    def _default_resolve(self) -> Callable[[Any], int] | None:
        """The probe's CUDA clock's ``resolve``, its events completed first (one sync, after the slice)."""
        if self._cuda is None:
            return None
        self._cuda.finish()
        return self._cuda.resolve

    def _exposed_resolved(self, resolve: Callable[[Any], int] | None) -> list[tuple[int, int, dict]]:
        res = resolve or (self._default_resolve() if any(d.get("start_event") is not None for _, _, d in self.exposed)
                          else None)
        out = []
        for s, e, d in self.exposed:
            if res is not None and d.get("start_event") is not None and d.get("end_event") is not None:
                s, e = res(d["start_event"]), res(d["end_event"])
            out.append((s, e, d))
        return out

    def totals(self, resolve: Callable[[Any], int] | None = None) -> dict[str, Any]:
        """Seconds exposed and overlapped, collectives and bytes issued, by collective."""
        exposed = merge([(s, e) for s, e, _ in self._exposed_resolved(resolve)])
        over = self.overlapped(resolve)
        by_op: dict[str, dict[str, float]] = {}
        for c in list(self.ops):
            row = by_op.setdefault(c.op, {"ops": 0, "bytes": 0})
            row["ops"] += 1
            row["bytes"] += c.bytes
        return {"exposed_s": sum(e - s for s, e in exposed) / 1e9,
                "overlapped_s": sum(e - s for s, e in merge([(s, e) for s, e, _ in over])) / 1e9,
                "ops": len(self.ops), "bytes": sum(c.bytes for c in list(self.ops)), "by_op": by_op}

    def meta(self) -> dict[str, Any]:
        notes = list(self.notes)
        if self._issued > len(self.ops):
            notes.append(f"{self._issued - len(self.ops)} collectives beyond the first {self.max_ops} "
                         "were not kept for overlap")
        return {"comm": {"hooked": list(self.hooked), "cuda_events": self._cuda is not None, "notes": notes}}

    # -- reporting ----------------------------------------------------------------------------
    def _emit(self, start_ns: int, end_ns: int, detail: dict) -> None:
        detail["thread_id"] = threading.get_ident()
        self.exposed.append((start_ns, end_ns, detail))
        if self.on_span is not None:
            try:
                self.on_span(PHASE, start_ns, end_ns, detail)
            except Exception as e:  # a failing consumer must not break a collective
                self._note(f"on_span failed: {e!r}")

    def _note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def _begin(self) -> bool:
        """Enter a wait on this thread; True when it is the one to report: the outermost, and not
        inside an end-of-backward window of the same backward pass (that window reports it)."""
        tls = self._tls
        depth = getattr(tls, "depth", 0)
        tls.depth = depth + 1
        if depth:
            return False
        window = getattr(tls, "window", None)
        return window is None or window != torch._C._current_graph_task_id()

    def _end(self) -> None:
        self._tls.depth = max(0, getattr(self._tls, "depth", 1) - 1)

    def blocked(self, thread_id: int) -> tuple[int, str] | None:
        """Whether ``thread_id`` is blocked in a collective now: ``(since_ns, what)``, else None.
        Read from another thread (the rank watchdog), once, when the loop stalled."""
        w = self._waiting.get(thread_id)
        if w is not None:
            return w
        for start, tid in list(self.unfinished.values()):
            if tid == thread_id and start >= 0:  # the graph's compute done, its collectives not
                ops = {c.op for c in self.ops[-64:] if c.in_backward}
                what = ops.pop() if len(ops) == 1 else "the gradients' collectives"
                return start, f"{what} at the end of backward"
        return None

    def _mark(self, device: str) -> Any:
        return self._cuda.mark() if (self._cuda is not None and device == "cuda") else None

    # -- issue: the dispatcher kernel ----------------------------------------------------------
    def _issue_kernel(self, op: Any, kind: str, work_cls: Any) -> Callable[..., Any]:
        after = torch._C._after_ADInplaceOrView_keyset
        graph_task = torch._C._current_graph_task_id

        def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
            if not self.installed:
                return op.redispatch(keyset & after, *args, **kwargs)
            rec = None
            try:  # the probe's bookkeeping never stops the collective, nor runs it twice
                nbytes, device = _tensor_bytes(args)
                gt = graph_task()
                rec = Collective(kind, nbytes, device, perf_counter_ns(), gt != -1)
                rec.issue_event = self._mark(device)
            except Exception as e:
                self._note(f"a collective was not recorded: {e!r}")
            out = op.redispatch(keyset & after, *args, **kwargs)
            if rec is not None:
                try:
                    self._track(rec, out, work_cls)
                    if gt != -1 and gt not in self._graph_tasks:
                        self._graph_tasks.add(gt)
                        self._queue_end_of_backward(gt, rec.device)
                except Exception as e:
                    self._note(f"a collective was not tracked: {e!r}")
            return out

        return kernel

    def _track(self, rec: Collective, out: Any, work_cls: Any) -> None:
        self._issued += 1
        if len(self.ops) < self.max_ops:
            self.ops.append(rec)
        work = out[-1] if isinstance(out, (tuple, list)) and out else out
        try:
            handle = work_cls.unbox(work)  # the same Python object Work.wait will be called on
        except Exception:
            return
        if rec.device == "cuda" or self._world == 1:
            # No completion callback on CUDA (a NCCL future completes at enqueue), nor where the
            # default group has one rank (a collective with no peer: nothing to overlap, and a
            # callback costs the loop ~75 us, below): keep the handle until it is waited,
            # bounded, pruning the ones that finished.
            if len(self._pending) >= MAX_PENDING:
                for key, (h, _) in list(self._pending.items()):
                    if h.is_completed():
                        self._pending.pop(key, None)
                while len(self._pending) >= MAX_PENDING:
                    self._pending.pop(next(iter(self._pending)), None)
            self._pending[id(handle)] = (handle, rec)
            return
        key = id(handle)
        if handle.is_completed():
            # Done before the call returned (gloo's thread was quicker than this line): now is
            # its completion time, microseconds late, and no callback is needed. A callback
            # costs the loop ~75 us a collective on a 2-core VM (gloo's thread takes the GIL;
            # docs/OVERHEAD.md), most of what timing a world-1 DDP step's all-reduce cost.
            rec.done_ns = perf_counter_ns()
            self._keep_completed(key, (handle, rec))
            return
        self._pending[key] = (handle, rec)

        def done(_fut: Any) -> None:
            rec.done_ns = perf_counter_ns()
            # gloo's thread; single dict operations are atomic under the GIL
            entry = self._pending.pop(key, None)
            if entry is not None and rec.wait_ns is None:
                self._keep_completed(key, entry)

        try:
            handle.get_future().add_done_callback(done)
        except Exception:  # a backend without futures: matched at wait, if waited
            pass

    def _keep_completed(self, key: int, entry: tuple[Any, Collective]) -> None:
        """A collective completed before anyone waited for it: kept (the newest
        ``MAX_COMPLETED``) so that its wait, if one comes, is matched to it."""
        self._completed[key] = entry
        while len(self._completed) > MAX_COMPLETED:
            self._completed.pop(next(iter(self._completed)), None)

    # -- the end of a backward pass --------------------------------------------------------------
    def _queue_end_of_backward(self, gt: int, device: str) -> None:
        """Callback A (queued now, at the first collective of this backward pass) runs when the
        graph's compute is done and queues B, which runs after every callback queued before it
        (DDP's finalize_backward among them). [A, B] is reported as one exposed span."""
        engine = torch.autograd.Variable._execution_engine
        first = len(self.ops) - 1  # this collective's index

        def callback_b(start_ns: int, start_ev: Any) -> None:
            end_ns = perf_counter_ns()
            self._tls.window = None
            self._graph_tasks.discard(gt)
            self.unfinished.pop(gt, None)
            if not self.installed:
                return
            try:  # an error here would surface from the user's backward(): never let it
                end_ev = self._mark(device)
                ops = [c for c in self.ops[max(0, first):] if c.in_backward]
                kinds = {c.op for c in ops}
                self._emit(start_ns, end_ns, {
                    "kind": "end_of_backward", "source": "autograd final callbacks",
                    "op": kinds.pop() if len(kinds) == 1 else ("mixed" if kinds else "unknown"),
                    "ops": len(ops), "bytes": sum(c.bytes for c in ops), "device": device,
                    "start_event": start_ev, "end_event": end_ev})
            except Exception as e:
                self._note(f"an end-of-backward wait was not recorded: {e!r}")

        def callback_a() -> None:
            start_ns = perf_counter_ns()
            try:
                start_ev = self._mark(device)
                engine.queue_callback(lambda: callback_b(start_ns, start_ev))
                self._tls.window = gt  # waits inside the window are part of it
                if gt in self.unfinished:
                    self.unfinished[gt] = (start_ns, threading.get_ident())
            except Exception as e:
                self._note(f"an end-of-backward wait was not recorded: {e!r}")

        try:
            engine.queue_callback(callback_a)
            # until B runs: a callback queued before B that raises (DDP's finalize, its peer gone
            # or timed out) ends the backward pass without B; the wait starts at A (the graph's
            # compute done). Where A never ran the pass failed in its compute: no wait of ours
            self.unfinished[gt] = (-1, threading.get_ident())
        except Exception as e:  # not inside a backward pass after all
            self._graph_tasks.discard(gt)
            self._note(f"end-of-backward callback not queued: {e!r}")

    # -- exposed waits ---------------------------------------------------------------------------
    def _timed(self, call: Callable[[], Any], detail: Callable[[], dict], device: str,
               rec: Collective | None = None, what: str = "a collective") -> Any:
        """Run a blocking ``call``; report it as exposed when it is the outermost wait."""
        if not self.installed:
            return call()
        if not self._begin():
            try:
                return call()
            finally:
                self._end()
        try:
            start_ev = self._mark(device)
        except Exception:  # never stop the wait itself
            start_ev = None
        if rec is not None and rec.wait_ns is None:
            rec.wait_event = start_ev
        start = perf_counter_ns()
        tid = threading.get_ident()
        self._waiting[tid] = (start, rec.op if rec is not None else what)
        try:
            return call()
        finally:
            end = perf_counter_ns()
            self._waiting.pop(tid, None)
            self._end()
            try:
                end_ev = self._mark(device)
                if rec is not None and rec.wait_ns is None:
                    rec.wait_ns = start
                d = detail()
                if d:
                    d.update(device=device, start_event=start_ev, end_event=end_ev)
                    self._emit(start, end, d)
            except Exception as e:  # the wait's own result or error goes through untouched
                self._note(f"a wait was not recorded: {e!r}")

    def _wrap_wait(self, orig: Any) -> Callable[..., Any]:
        def wait(work: Any, *args: Any, **kwargs: Any) -> Any:
            rec = None
            if self.installed:
                entry = self._pending.pop(id(work), None) or self._completed.pop(id(work), None)
                rec = entry[1] if entry is not None and entry[0] is work else None
            return self._timed(lambda: orig(work, *args, **kwargs),
                               lambda: {"kind": "wait", "source": "Work.wait", "op": rec.op if rec else "unknown",
                                        "ops": 1, "bytes": rec.bytes if rec else 0},
                               rec.device if rec is not None else "cpu", rec)

        wait.__wrapped__ = orig  # type: ignore[attr-defined]
        wait.__doc__ = getattr(orig, "__doc__", None)
        return wait

    def _wait_tensor_kernel(self, op: Any) -> Callable[..., Any]:
        after = torch._C._after_ADInplaceOrView_keyset

        def kernel(keyset: Any, tensor: Any) -> Any:
            device = tensor.device.type if isinstance(tensor, torch.Tensor) else "cpu"
            return self._timed(lambda: op.redispatch(keyset & after, tensor),
                               lambda: {"kind": "wait", "source": "wait_tensor", "op": "functional",
                                        "ops": 1, "bytes": 0}, device, what="a functional collective")

        return kernel

    def _wrap_blocking(self, orig: Any, kind: str, source: str) -> Callable[..., Any]:
        """A C++ call that issues collectives and waits for them before it returns: exposed as a
        whole when it issued any."""

        def blocking(*args: Any, **kwargs: Any) -> Any:
            n0 = self._issued

            def detail() -> dict:
                n = self._issued - n0
                if n == 0:
                    return {}
                issued = self.ops[-n:] if n <= len(self.ops) else list(self.ops)
                return {"kind": "blocking_call", "source": source, "op": kind, "ops": n,
                        "bytes": sum(c.bytes for c in issued)}

            return self._timed(lambda: orig(*args, **kwargs), detail, "cpu", what=f"{kind} ({source})")

        blocking.__wrapped__ = orig  # type: ignore[attr-defined]
        blocking.__doc__ = getattr(orig, "__doc__", None)
        return blocking


class SliceCommProbe:
    """The probe as a slice runs it (``tpkit.capture.slice.PROBE_FACTORIES``): each exposed wait on
    the loop's thread becomes a ``comm`` span of the Recorder, nested in the phase it interrupted
    (so the steps table takes it out of that phase), timed on the GPU by the slice's CUDA timer
    when there is one. After the slice, ``meta()`` adds the collectives' overlapped time as
    ``comm_overlapped`` spans (in the step they fall in, never charged to a phase) and the probe's
    facts to ``run.meta["comm"]``. ``rec`` is a ``tpkit.capture.recorder.Recorder``."""

    def __init__(self, rec: Any) -> None:
        self.rec = rec
        self.other_threads = 0  # waits seen on threads that are not the loop's
        self.probe = CommProbe(self._on_span, cuda_clock=rec.cuda_timer)

    def install(self) -> "SliceCommProbe":
        try:
            self.probe.install()
        except RuntimeError as e:  # the user's own CommProbe is in: the slice runs without timing collectives
            self.rec.note(f"collectives not timed: {e}")
        return self

    def remove(self) -> None:
        probe = self.probe
        try:
            for start, _tid in list(probe.unfinished.values()):
                if start >= 0:  # A ran; the window is the loop's where one of its backward spans holds it
                    self._failed_window(start)
        except Exception as e:  # noqa: BLE001 - the probe comes out whatever happens here
            probe._note(f"a failed backward pass's wait was not recorded: {e!r}")
        finally:
            probe.unfinished.clear()
            probe.remove()

    def _failed_window(self, start_ns: int) -> None:
        """A backward pass whose gradient all-reduce failed (its peer gone, a timeout): the wait
        from the end of its compute to its end is ``comm`` (it had been the backward's: a 20 s
        backward span on the timeline, where the rank waited for a dead peer)."""
        rec = self.rec
        for phase, start, end, depth, _source, step, *_ in reversed(rec.spans):
            if phase == "backward" and start <= start_ns <= end:
                rec.add_timed_span(PHASE, start_ns, end, "end_of_backward:failed", depth=depth + 1, raw_step=step)
                self.probe.exposed.append((start_ns, end, {"kind": "end_of_backward", "op": "failed"}))
                self.probe._note(f"a backward pass ended in an error {(end - start_ns) / 1e9:.3f} s into its wait "
                                 "for the gradients' collectives (a peer gone or timed out): that wait is comm")
                return

    def _on_span(self, phase: str, start_ns: int, end_ns: int, detail: dict) -> None:
        rec = self.rec
        if detail.get("thread_id") != rec.thread_id:
            self.other_threads += 1
            return
        rec.add_timed_span(phase, start_ns, end_ns, f"{detail.get('kind')}:{detail.get('op')}",
                           start_event=detail.get("start_event"), end_event=detail.get("end_event"))

    def meta(self) -> dict[str, Any]:
        """Adds the overlapped spans to the Recorder (once) and returns ``{"comm": facts}``."""
        import bisect

        from ...schema import COMM_OVERLAPPED

        rec, probe = self.rec, self.probe
        timer = rec.cuda_timer if probe._cuda is rec.cuda_timer else None
        resolve = None
        if timer is not None:
            timer.finish()
            resolve = timer.resolve
        ends = [e for e, _ in rec.step_ends]
        pieces = probe.overlapped(resolve)
        for s, e, d in pieces:
            rec.add_timed_span(COMM_OVERLAPPED, s, e, str(d["op"]), depth=1, raw_step=bisect.bisect_left(ends, s))
        out = probe.meta()
        totals = probe.totals(resolve)
        out["comm"].update(exposed_s=totals["exposed_s"], overlapped_s=totals["overlapped_s"], ops=totals["ops"],
                           bytes=totals["bytes"], by_op=totals["by_op"])
        if self.other_threads:
            out["comm"]["notes"].append(f"{self.other_threads} waits on threads other than the loop's "
                                        "were not charged to its steps")
        self.probe.ops.clear()  # reported once: a second meta() adds nothing
        self.probe.exposed.clear()
        return out


class LateCommProbe:
    """For a slice that starts before its process group exists (Lightning, accelerate and
    DeepSpeed create it inside ``fit()`` / ``prepare()``): ``torch.distributed.init_process_group``
    is wrapped, and the moment it returns a ``SliceCommProbe`` goes in, subject to the same rule
    as at the slice's start (``one_rank``: what to do at one rank). A loop that holds
    ``init_process_group`` under a name of its own is caught at the next step's end instead, and
    the run says from which step collectives were timed. Without it, a Lightning DDP run read
    ``comm_s`` 0 and charged rank 0's wait for its peer to backward."""

    def __init__(self, rec: Any, one_rank: Callable[[], bool]) -> None:
        self.rec = rec
        self._one_rank = one_rank  # returns True to time collectives at one rank too
        self.inner: SliceCommProbe | None = None
        self._orig: list[tuple[Any, Any]] = []  # (module, its own init_process_group)
        self._listening = False
        self._removed = False  # a wrapper someone kept past the slice must do nothing then
        self._pid = os.getpid()  # a process forked during the slice (Lightning's ddp_fork ranks) is not the loop

    def install(self) -> "LateCommProbe":
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        for module in (dist, c10d):
            orig = module.__dict__.get("init_process_group")
            if orig is not None:
                self._orig.append((module, orig))
                module.init_process_group = self._wrap(orig)  # type: ignore[attr-defined]
        self.rec.step_listeners.append(self._on_step)
        self._listening = True
        return self

    def _wrap(self, fn: Any) -> Any:
        import functools

        def init_process_group(*args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            if os.getpid() != self._pid:  # (its probe would time every collective into a Recorder no one reads)
                return out
            try:
                self._timed_start(None)
            except Exception as e:  # noqa: BLE001 - the loop's process group is up: never fail it for tpkit
                self.rec.note(f"collectives not timed: the probe failed to go in ({e!r})")
            return out

        return functools.update_wrapper(init_process_group, fn)

    def _on_step(self, raw_step: int, _end_ns: int) -> None:
        if self.inner is None and torch.distributed.is_initialized():
            try:
                self._timed_start(raw_step + 1)
            except Exception as e:  # noqa: BLE001 - a step listener's failure would reach the loop
                self.rec.note(f"collectives not timed: the probe failed to go in ({e!r})")

    def _timed_start(self, from_step: int | None) -> None:
        """``_start``, its time a ``tpkit`` span where it runs in the loop's thread: the probe's
        install (c10d's kernels registered, ``Work.wait`` patched) took 2-3 ms of a 2-core VM at
        the step's end, and had read as the next step's ``other``."""
        if threading.get_ident() != getattr(self.rec, "thread_id", None):
            self._start(from_step)
            return
        t = perf_counter_ns()
        try:
            self._start(from_step)
        finally:
            self.rec._own(t)

    def _start(self, from_step: int | None) -> None:
        import torch.distributed as dist

        if self._removed or self.inner is not None or not dist.is_initialized():
            return
        self._stop_listening()
        if dist.get_world_size() == 1 and not self._one_rank():
            return
        self.inner = SliceCommProbe(self.rec)  # kept before it goes in: remove() takes out what did
        self.inner.install()
        if from_step is not None:
            self.rec.note(f"the process group came up inside the slice, through a name tpkit does not wrap: "
                          f"collectives are timed only after its first {from_step} step(s), warmup included "
                          "(comm_s is 0 before)")

    def _stop_listening(self) -> None:
        if self._listening:
            self._listening = False
            try:
                self.rec.step_listeners.remove(self._on_step)
            except ValueError:
                pass

    def remove(self) -> None:
        self._removed = True
        while self._orig:
            module, orig = self._orig.pop()
            module.init_process_group = orig
        self._stop_listening()
        if self.inner is not None:
            self.inner.remove()

    def meta(self) -> dict[str, Any]:
        return self.inner.meta() if self.inner is not None else {}
