"""The Recorder: the one place probes write to while a slice runs.

Probes append small tuples here and nothing else; the Run is built from these lists once,
when the slice ends (see ``tpkit.capture.build``). Everything on this path is plain Python lists and
ints from ``time.perf_counter_ns``: no pandas, no locks (``list.append`` is atomic in
CPython, which is all the sampler thread needs).

Hooks for other probes:
- ``phase_listeners``: called as ``fn(phase, event, raw_step)`` with event ``"enter"``
  (before the span's start is stamped) or ``"exit"`` (after its end is stamped), so the
  listener's own cost is not charged to the phase. The memory probe lives here. Only the
  outermost span of a phase is a boundary: a span of a phase that is already open (an
  optimizer wrapper's ``step()`` calling the wrapped optimizer's, as DeepSpeed's engine does)
  is recorded but not announced, since the phase does not change there.
- ``step_listeners``: called as ``fn(raw_step, end_ns)`` after a step has been recorded.
  The slice controller (stop, warmup, progress bar) lives here. Once it has set ``stop_pending``
  (the slice is full: a plain loop stops at its next training action) the listeners after it
  are not told of that step, as none were while the stop was raised from here. Nor is a
  listener taken out by one before it: where a trainer runs on past the slice, the controller
  takes the probes out right there, and a probe told after its removal had put its hooks back.
- ``batch_listeners``: called as ``fn(batch)`` by ``yielded`` when a loader hands a batch to
  the loop (loaders call ``rec.yielded(batch)`` after their ``data_wait`` span).
"""

from __future__ import annotations

import copy
import os
import sys
import threading
import weakref
from time import perf_counter_ns
from types import FrameType
from typing import Any, Callable

PhaseListener = Callable[[str, str, int], None]
StepListener = Callable[[int, int], None]

_ACTIVE: "Recorder | None" = None

#: Values per span in the Recorder's flat span log.
SPAN_FIELDS = 8

#: The note of a stop at a new pass over the loader of the last step's batch, read with grad while
#: the trained model was in eval mode (``Recorder.stop_before_read``): that pass is the next
#: epoch's as far as tpkit can tell, but it may have been an evaluation over the training loader.
EVAL_MODE_STOP = ("the loop was stopped where it began a new pass over the loader of its last step's batch, with grad "
                  "enabled, while the trained model was in eval mode: if that pass was an evaluation over the "
                  "training loader (model.eval(), then for batch in train_loader), it was cut at its "
                  "first batch and did not run; run such an evaluation under torch.no_grad() for it to run whole, or "
                  "profile with stop=False")
#: The note of such a stop at the read of an ignite Engine run from inside another Engine's run
#: (``_nested_engine_run``): an evaluator's, whose step calls ``model.eval()`` after its read.
NESTED_ENGINE_STOP = ("the loop was stopped where an ignite Engine run from inside another Engine's run (an evaluator "
                      "run from a handler, as train_evaluator.run(train_loader) at EPOCH_COMPLETED) began a pass over "
                      "the loader of the last step's batch, with grad enabled: that evaluation was cut at its first "
                      "batch and did not run; run it under torch.no_grad() (with torch.no_grad(): "
                      "train_evaluator.run(train_loader)) for it to run whole, or profile with stop=False")


def _nested_engine_run(max_frames: int = 256) -> bool:
    """Whether the calling thread is inside the runs of two ignite Engines, one started from
    inside the other's (an evaluator run from a trainer's handler). Read once, at the stop."""
    engines: set[int] = set()
    f: FrameType | None = sys._getframe(1)
    n = 0
    while f is not None and n < max_frames:
        if f.f_code.co_name == "_internal_run" and "ignite" in f.f_code.co_filename:
            engines.add(id(f.f_locals.get("self")))
        f, n = f.f_back, n + 1
    return len(engines) > 1


def active() -> "Recorder | None":
    """The Recorder of the slice now running, or None. Cheap enough for any hot path."""
    return _ACTIVE


def set_active(rec: "Recorder | None") -> None:
    """Make ``rec`` the Recorder that probes write to (None: no slice is running)."""
    global _ACTIVE
    _ACTIVE = rec


def _no_slice_in_child() -> None:
    """A process forked during a slice (a loader's worker) runs none: ``tp.phase`` or
    ``tp.watch`` called there had written into a copy of the loop's Recorder that no one reads."""
    set_active(None)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_no_slice_in_child)


class WeakRegistry:
    """Objects a probe has seen (models, optimizers), held weakly: tpkit never keeps alive what
    the loop let go (a model copied or an optimizer made anew every iteration had stayed alive
    to the slice's end, and read as a leak of the loop's). ``entries`` is a plain dict with a
    key per object seen, never reused, so its size only grows: the memory probe's C side
    tells that something new came from its size alone."""

    def __init__(self) -> None:
        self.entries: dict[int, weakref.ref] = {}
        self._keys: dict[int, int] = {}  # id(obj) -> its key in entries

    def add(self, obj: Any) -> bool:
        """Note ``obj``; True when it was not known (an id reused by a new object is new)."""
        key = self._keys.get(id(obj))
        if key is not None and self.entries[key]() is obj:
            return False
        key = self._keys[id(obj)] = len(self.entries)
        self.entries[key] = weakref.ref(obj)
        return True

    def live(self) -> list[Any]:
        """The objects seen that are still alive, in the order they were first seen."""
        return [o for o in (r() for r in self.entries.values()) if o is not None]

    def __len__(self) -> int:
        """Objects ever noted (it only grows)."""
        return len(self.entries)


class Recorder:
    """Event buffers of one slice.

    Span tuples: ``(phase, start_ns, end_ns, depth, source, raw_step, start_event, end_event)``
    where the events are CUDA events (or None) resolved when the Run is built.
    Raw steps count from 0 at slice start, warmup included; the Run renumbers them.
    """

    def __init__(self, name: str = "run") -> None:
        self.name = name
        self.thread_id = threading.get_ident()
        self.t0_ns = perf_counter_ns()
        # when the first step starts: once every probe is in (the slice sets it), so installing
        # them (~80 ms with memory tracking) is no part of the loop's first step
        self.first_step_ns = self.t0_ns
        # Spans, flat: SPAN_FIELDS values each. Recording one appends plain values and allocates
        # nothing the garbage collector tracks (a tuple per span made tpkit's ~12 spans a step
        # trigger young collections inside the loop's steps twice as often); ``spans`` builds
        # the tuples when asked (after the slice).
        self._spans: list[Any] = []
        self.step_ends: list[tuple[int, int]] = []  # (end_ns, samples)
        self.memory: list[tuple] = []  # (raw_step, phase, event, t_ns, device, category, bytes)
        self.clocks: list[tuple] = []  # (t_ns, device, metric, value)
        self.loader: list[tuple] = []  # (batch, worker, fetch_s, collate_s, queue_wait_s, transfer_s)
        self.losses: list[tuple[int, Any]] = []  # (raw_step, scalar tensor or float), resolved at build
        self.loss_counts: dict[int, int] = {}  # raw step -> losses backpropagated in it (micro-batches)
        # losses backpropagated after zero_grad() in a step that had backpropagated already (SAM's
        # second pass), as ``losses``; kept apart for the build (capture/build.py)
        self.losses_after_reset: list[tuple[int, Any]] = []
        # set while such a reset waits: a batch handed out first makes it a new iteration whose
        # update the loop skipped, not a second pass (probes.loss_sums.LossSums.reset)
        self.batch_after_reset: Any = None
        # the phase probe's, called before a loader tpkit sees reads a batch (an update no
        # optimizer hook saw may end the step there: phases.PhaseProbe._unseen_update)
        self.batch_coming: Callable[[], None] | None = None
        self.skipped_iterations: dict[int, int] = {}  # raw step -> iterations in it with no update
        self.unscalar_backwards = 0  # backward() of what is no loss: a tensor of several elements, weighted ones
        self.optimizer_count = 0  # distinct optimizers that stepped
        self.accelerate_loader = False  # the loop read batches from a loader accelerate prepared
        # Evaluation inside the slice (capture/evaluation.py), flat like the spans: every batch a
        # loader handed to the loop (t_ns, samples, raw_step), every outermost call made without
        # grad in eval mode or of a module without parameters (start_ns, end_ns, id(module), raw_step),
        # the modules called with grad in train mode (the trained ones) and the modules without
        # parameters called without grad (a loss, a metric)
        self.handouts: list[int] = []
        self.run_starts: list[int] = []  # when each trainer run was called in the slice (ns; capture/setups.py)
        self.loader_cpu_s = self.loader_make_s = 0.0  # tpkit's loader: CPU and wall time making batches
        self.handout_workers: list[int] = []  # per handout: its DataLoader's num_workers, -1: not one
        # per handout: the key of the source it came from (a torch DataLoader's batches.loader_key,
        # the same across its epochs; else the id of the iterator; 0: not known)
        self.handout_sources: list[int] = []
        self.handout_ids: list[int] = []  # per handout: batches.identity of its leading tensor (0: none)
        self.restarts: list[int] = []  # a DataLoader's iter(), flat: (start_ns, its loader_key)
        # a DataLoader's workers shut down where its iterator was dropped, flat: (the start_ns of
        # that data_wait span, its loader_key): an evaluation loader's is eval (capture/evaluation.py)
        self.shutdowns: list[int] = []
        # a torch DataLoader's settings, by its loader_key, as its latest iter() in the slice saw
        # them (capture/slice.py: queue_drain; capture/build.py: meta['torch_loader'])
        self.loader_settings: dict[int, dict[str, Any]] = {}
        self.source_datasets: dict[int, int] = {}  # a DataLoader's loader_key -> the id of its Dataset
        # a loader_key is an id: a loader made anew (each epoch) can get the id of one freed
        # before it; ``source_key`` gives the new one a key of its own (``key_alias``)
        self.key_alias: dict[int, int] = {}
        self._key_refs: dict[int, Callable[[], Any]] = {}
        self._next_alias = -1  # (negative: never an id)
        # outermost forwards that raised, flat: (ns, batches.forward_identity of their batch, raw_step) (read_ahead.failed)
        self.failed_forwards: list[int] = []
        self.uncounted: str | None = None  # the type of the first batch whose samples no rule could count
        self.no_grad_calls: list[int] = []
        # calls without grad of a module with parameters in train mode, flat as no_grad_calls: an
        # evaluation that never calls model.eval() where its batches feed no training
        # (capture/evaluation.py: _evaluated_in_train_mode), else the step's own work
        self.no_grad_train_calls: list[int] = []
        # when each forward run without grad began (ns, right after its enter boundary): it makes
        # no loss to backpropagate (the memory probe's replay)
        self.no_grad_forwards: list[int] = []
        self.trained_modules: set[int] = set()
        self.param_free_modules: set[int] = set()
        self.skipped: set[int] = set()  # raw steps whose update a GradScaler skipped (inf/NaN grads)
        self.framework: Any = None  # the HF / Lightning trainer running the loop (capture.frameworks)
        self.framework_looked = False  # looked for it (once, at the first step's end)
        # the slice's: called when what it left running at its end has returned (the trainer run
        # it stopped through its switch, DDP's Join): the probes come out there
        self.stopped_run_returned: Callable[[], None] | None = None
        self.joins = 0  # DDP Join contexts the loop is inside (no exception may end the slice there)
        self.slice_steps: int | None = None  # once the slice is full: steps past it are not the slice's
        # Set once the slice is full in a plain loop (slice.Profile._stopping): called at the loop's next
        # training action in its thread (a batch read from a training batches' source, a trained
        # forward, a backward, an optimizer step, tp.step()), where it raises StopSlice; what the
        # iteration ran after its last step (a scheduler's step, a counter, a log, an evaluation)
        # has run by then. ``training_sources``: the sources (``handout_sources``' keys, with their
        # loaders from ``source_loaders``) that handed out the slice's training batches;
        # ``training_datasets``: their DataLoaders' Datasets (a loader made anew over one of them,
        # as some loops do each epoch, is the training loader too).
        self.stop_pending: Callable[[], None] | None = None
        self.training_sources: set[int] = set()
        self.last_sources: set[int] = set()  # of them, the ones that handed out the last step's batch
        self.training_datasets: set[int] = set()
        # an epoch's iterator (a handout source) -> the loader or iterable it reads (tp.data.Loader,
        # tp.watch, accelerate's loader): the next epoch's reads are that loader's too
        self.source_loaders: dict[int, int] = {}
        self.notes: list[str] = []
        # tensors tpkit allocates for itself during a slice (e.g. loss sums): the memory probe leaves them out
        self.own_tensors: list[Any] = []
        self.meta: dict[str, Any] = {}
        self.phase_listeners: list[PhaseListener] = []
        self.step_listeners: list[StepListener] = []
        self.batch_listeners: list[Callable[[Any], None]] = []  # fn(batch) for each batch a loader yields
        self.models = WeakRegistry()  # outermost modules seen in forward (the phase probe fills it)
        # optimizers that stepped, noted before their step is entered (the memory probe's look at
        # the gradients there knows a master copy's parameters from the first step on)
        self.optimizers = WeakRegistry()
        self.step_index = 0
        self.explicit_steps = False  # True once tp.step() was called: optimizers stop ending steps
        self.samples = 0  # samples seen in the current step
        self.samples_per_step: int | None = None  # when set, overrides what loaders reported
        self.cuda_timer: Any = None  # set by the CUDA timing probe when a GPU is in use
        self.own_host_ns = 0  # host time of tpkit's own work (the tpkit spans' host durations)
        self.step_events: dict[int, Any] = {}  # raw step -> CUDA event at its end (GPU runs only)
        self._stack: list[list] = []  # open spans: [phase, start_ns, depth, source, raw_step, ev]
        self._open: dict[str, int] = {}

    # -- spans --------------------------------------------------------------------------
    @property
    def spans(self) -> list[tuple]:
        """Every span recorded so far, as tuples (see the class doc)."""
        f = self._spans
        return list(zip(*(f[i::SPAN_FIELDS] for i in range(SPAN_FIELDS))))

    def span_count(self) -> int:
        return len(self._spans) // SPAN_FIELDS

    def drop_spans(self, keep: int) -> None:
        """Forget every span after the first ``keep``."""
        del self._spans[keep * SPAN_FIELDS:]

    def snapshot(self) -> "Recorder":
        """A copy whose event lists are copies, safe to build a Run from in another thread
        while this one keeps recording (each record is one list append or extend, atomic in
        CPython, so a copy holds whole records)."""
        snap = copy.copy(self)
        for name in ("_spans", "step_ends", "memory", "clocks", "loader", "losses", "notes", "handouts",
                     "no_grad_calls", "no_grad_train_calls", "losses_after_reset", "handout_workers", "handout_sources", "handout_ids", "restarts",
                     "run_starts", "failed_forwards"):
            setattr(snap, name, list(getattr(self, name)))
        snap.loss_counts = dict(self.loss_counts)
        snap.loader_settings = dict(self.loader_settings)
        snap.skipped_iterations = dict(self.skipped_iterations)
        return snap

    # -- phases -------------------------------------------------------------------------
    def enter(self, phase: str, source: str = "user") -> int:
        """Open a span; returns a token for ``exit``. Listeners run before the stamp, and
        their time is a ``tpkit`` span of its own (tpkit's cost, never charged to a phase)."""
        already = self._open.get(phase, 0)
        timer = self.cuda_timer
        if self.phase_listeners and not already:
            t = perf_counter_ns()
            sev = timer.mark() if timer is not None else None
            for fn in self.phase_listeners:
                fn(phase, "enter", self.step_index)
            ev = timer.mark() if timer is not None else None
            # (_own, inlined: a frame less each boundary) on a GPU it ends at the phase's own start
            # event; on the host the phase starts at its end (one clock read a boundary fewer)
            start = perf_counter_ns()
            self.own_host_ns += start - t
            self._spans += ("tpkit", t, start, len(self._stack), "probes", self.step_index, sev, ev)
        else:
            ev = timer.mark() if timer is not None else None
            start = perf_counter_ns()
        depth = len(self._stack)
        self._stack.append([phase, start, depth, source, self.step_index, ev])
        self._open[phase] = already + 1
        return depth

    def exit(self, token: int) -> None:
        """Close the span opened with ``token`` and any left open above it (an exception
        that skipped their exits)."""
        end = perf_counter_ns()
        ev = self.cuda_timer.mark() if self.cuda_timer is not None else None
        own_start = end  # the listeners' time starts where the phase ends (one clock read a boundary fewer)
        while len(self._stack) > token:
            phase, start, depth, source, step, sev = self._stack.pop()
            left = self._open[phase] = self._open[phase] - 1
            self._spans += (phase, start, end, depth, source, step, sev, ev)
            if self.phase_listeners and not left:
                for fn in self.phase_listeners:
                    fn(phase, "exit", step)
                # (_own, inlined: a frame less each boundary) on a GPU it starts at the phase's own end event
                own_ev = self.cuda_timer.mark() if ev is not None else None
                own_end = perf_counter_ns()
                self.own_host_ns += own_end - own_start
                self._spans += ("tpkit", own_start, own_end, len(self._stack), "probes", self.step_index, ev, own_ev)
                own_start = own_end  # (spans left open above close at ``end`` too; their listeners' time follows)

    def relabel(self, index: int, was: str, phase: str) -> None:
        """Give span number ``index`` (in closing order), of phase ``was``, another phase: one
        known only later (a metric call whose output the backward ran through is a loss,
        capture/probes/phases.py). Nothing where that span is gone (``drop_spans``)."""
        i = index * SPAN_FIELDS
        if i < len(self._spans) and self._spans[i] == was:
            self._spans[i] = phase

    def idle_since_step(self) -> bool:
        """Whether no training work was recorded since the last step ended: no batch handed out,
        no span open, none closed after it but the optimizer's (its ``zero_grad()``) and tpkit's."""
        if not self.step_ends or self._stack or self.samples:
            return False
        end, spans = self.step_ends[-1][0], self._spans
        for i in range(len(spans) - SPAN_FIELDS, -1, -SPAN_FIELDS):
            if spans[i + 2] <= end:
                return True
            if spans[i] not in ("optimizer", "tpkit", "gc"):
                return False
        return True

    def opened_at(self, token: int) -> int:
        """The start (ns) of the span opened with ``token``, still open."""
        return int(self._stack[token][1])

    def is_open(self, phase: str) -> bool:
        return self._open.get(phase, 0) > 0

    def close_all(self) -> None:
        """Close every open span (slice end, error, interrupt)."""
        if self._stack:
            self.exit(0)

    def add_span(self, phase: str, start_ns: int, end_ns: int, source: str, depth: int = 0) -> None:
        """Record a finished span measured elsewhere (another thread, a loader stage)."""
        self._spans += (phase, start_ns, end_ns, depth, source, self.step_index, None, None)

    def add_timed_span(self, phase: str, start_ns: int, end_ns: int, source: str, depth: int | None = None,
                       start_event: Any = None, end_event: Any = None, raw_step: int | None = None) -> None:
        """Record a finished span a probe timed on this clock (a wait in a collective), with its
        CUDA events (or None; the ``cuda_timer``'s marks, resolved when the Run is built).
        ``depth`` None: nested in the spans open now. ``raw_step`` None: the current step."""
        self._spans += (phase, start_ns, end_ns, len(self._stack) if depth is None else depth, source,
                        self.step_index if raw_step is None else raw_step, start_event, end_event)

    # -- steps ----------------------------------------------------------------------------
    def add_samples(self, n: int) -> None:
        self.samples += n

    def handed_out(self, n: int, workers: int = -1, source: int = 0, ident: int = 0) -> None:
        """A loader handed the loop a batch of ``n`` samples (0: not known): counted in the step,
        and noted with its time (a batch read for evaluation is taken out when the Run is built)
        and its torch DataLoader's ``num_workers`` (-1: another loader), the iterator it came
        from (``source``, an id; 0: not known) and its identity (``batches.identity``; 0: none)."""
        self.samples += n
        self.handouts += (perf_counter_ns(), n, self.step_index)
        self.handout_workers.append(workers)
        self.handout_sources.append(source)
        self.handout_ids.append(ident)
        if self.batch_after_reset is not None:
            self.batch_after_reset()

    def end_step(self, end_ns: int | None = None) -> None:
        """Record the end of the current step, then tell the step listeners (which may raise)."""
        end = perf_counter_ns() if end_ns is None else end_ns
        n = self.samples if self.samples_per_step is None else self.samples_per_step
        self.step_ends.append((end, n))
        step = self.step_index
        if self.cuda_timer is not None:  # the GPU's end of the step (a loop with no optimizer too)
            self.step_events[step] = self.cuda_timer.mark()
        self.step_index += 1
        self.samples = 0
        listeners = self.step_listeners
        for fn in list(listeners):  # (a listener may take itself out: the late comm probe)
            if fn not in listeners:
                continue  # taken out by one before it: the slice's end tears the probes down in place
            fn(step, end)
            if self.stop_pending is not None:  # the slice is full: the probes after it are out
                break

    def source_key(self, key: int, loader: Any) -> int:
        """The key of a DataLoader's batches at its ``iter()`` (``key``: its ``batches.loader_key``,
        its index sampler's id, with its Dataset's): where that id was another loader's, freed since (a
        validation loader made after the training loader of the epoch before had taken its
        sampler's id: the two were one source), a key of its own from now on. Per epoch, not
        per batch (a batch reads ``key_alias``)."""
        sampler = getattr(loader, "_index_sampler", None)
        if sampler is None:
            return self.key_alias.get(key, key)
        ref = self._key_refs.get(key)
        if ref is not None and ref() is sampler:
            return self.key_alias.get(key, key)
        try:
            self._key_refs[key] = weakref.ref(sampler)
        except TypeError:  # (a sampler that takes no weak reference: its id as it is)
            return self.key_alias.get(key, key)
        if ref is not None:  # the id was a freed loader's
            self.key_alias[key], self._next_alias = self._next_alias, self._next_alias - 1
        return self.key_alias.get(key, key)

    def stop_before_read(self, *sources: int, dataset: int | None = None, epoch_start: bool = False) -> None:
        """The loop's thread is about to read a batch from ``sources`` (keys of an iterator and
        of the loader it reads; ``dataset``: a torch DataLoader's Dataset's id): where the slice
        is full and the slice's training batches came from one of them, the loop stops here,
        before the read (see ``stop_pending``); so it does at a DataLoader the slice never read,
        over a training Dataset (a loop that makes its loader anew each epoch). A read from
        another loader (an evaluation's, over the training Dataset too: a train/val split by
        samplers, a train-accuracy pass) goes on, and so does one without grad (under
        ``torch.no_grad()`` or ``inference_mode``): an evaluation with the Dataset's id for its
        source had stopped the loop after its ``model.eval()`` and before its ``model.train()``;
        a loop that ended by itself runs such a read on. ``epoch_start``: the read begins a pass
        over the loader (its ``iter()``): one of the last step's loader in eval mode may be an
        evaluation over the training loader, cut at its first batch: the run says so (ignite's
        ``train_evaluator.run(train_loader)`` reads before its step's ``model.eval()``, in train
        mode: nothing tells that read from the next epoch's, README "How the loop is stopped")."""
        import torch  # (loaded: the loop reads through torch's or tpkit's loader)

        if (self.stop_pending is None or threading.get_ident() != self.thread_id
                or not torch.is_grad_enabled()):
            return
        if any(s in self.last_sources for s in sources):
            if epoch_start and self._evaluating():
                self.note(EVAL_MODE_STOP)
            elif epoch_start and _nested_engine_run():
                self.note(NESTED_ENGINE_STOP)
            self.stop_pending()  # the loader of the last step's batch: the next iteration's read
        elif (any(s in self.training_sources for s in sources) or (
                dataset is not None and dataset in self.training_datasets
                and not any(s in self.source_datasets for s in sources))) and not self._evaluating():
            self.stop_pending()

    def _evaluating(self) -> bool:
        """Every model trained in the slice (called with grad in train mode) is in eval mode
        while the loop reads a training source other than the last step's batch's: the loop is
        evaluating, with grad left on (``torch.no_grad()`` forgotten; that evaluation's batches
        are training by the forward's rule, their loader one of the training batches'); it
        stops at its next read of the last step's loader, as the loop stopped by ``break`` is
        left (it had been stopped inside the evaluation, the model left in eval mode). A read of
        the last step's loader always stops the loop, in eval mode too (a loop calling
        ``model.train()`` at its top, or training in eval mode). A module without parameters (a
        loss module such as ``nn.CrossEntropyLoss()``, called with grad in train mode and never
        put in eval mode) is none of them: it had kept every loop with one from reading as
        evaluating. Asked only while a stop is pending."""
        trained = [m for m in self.models.live()
                   if id(m) in self.trained_modules and next(m.parameters(), None) is not None]
        return bool(trained) and not any(getattr(m, "training", True) for m in trained)

    # -- other tables ---------------------------------------------------------------------
    def add_memory(self, phase: str, event: str, device: str, category: str, nbytes: int,
                   t_ns: int | None = None, raw_step: int | None = None) -> None:
        t = perf_counter_ns() if t_ns is None else t_ns
        step = self.step_index if raw_step is None else raw_step
        self.memory.append((step, phase, event, t, device, category, nbytes))

    def yielded(self, batch: Any) -> None:
        """A loader handed ``batch`` to the loop (the memory probe counts it as ``data``)."""
        t = perf_counter_ns()
        timer = self.cuda_timer
        sev = timer.mark() if timer is not None and self.batch_listeners else None
        for fn in self.batch_listeners:
            fn(batch)
        self._own(t, sev, timer.mark() if sev is not None else None)

    def _own(self, start_ns: int, start_event: Any = None, end_event: Any = None) -> None:
        """tpkit's own work since ``start_ns`` (probe listeners): a ``tpkit`` span. On a GPU it
        is timed by CUDA events around that work, like the phases: what the GPU spent waiting
        for it (nothing while the GPU still had queued work; an H200's GPT-2-small slice had
        charged 7.5 ms of host time a step to the GPU's timeline: docs/GPU_RUNS.md). Its host
        time adds up in ``own_host_ns`` (``meta["cuda_timing"]["tpkit_host_s"]``). ``enter`` and
        ``exit`` write the same span themselves (a frame less at each phase boundary): a change
        here goes there too."""
        end_ns = perf_counter_ns()
        self.own_host_ns += end_ns - start_ns
        self._spans += ("tpkit", start_ns, end_ns, len(self._stack), "probes",
                        self.step_index, start_event, end_event)

    def add_clock(self, t_ns: int, device: str, metric: str, value: float) -> None:
        self.clocks.append((t_ns, device, metric, value))

    def add_loader_batch(self, batch: int, worker: int, fetch_s: float, collate_s: float,
                         queue_wait_s: float, transfer_s: float, cpu_s: float = float("nan")) -> None:
        """A batch of tpkit's loader; ``cpu_s``: the CPU time its making took (its share of the
        making time goes to ``meta["loader"]["make_cpu_share"]``)."""
        self.loader.append((batch, worker, fetch_s, collate_s, queue_wait_s, transfer_s))
        if cpu_s == cpu_s:
            self.loader_cpu_s += cpu_s
            self.loader_make_s += fetch_s + collate_s

    def loader_used(self, config: dict[str, Any]) -> None:
        """tpkit's loader says how it runs (``num_workers``, ``mode``...): ``meta["loader"]``,
        the first loader's of the slice (the training loop's, before any evaluation)."""
        self.meta.setdefault("loader", config)

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)
