"""Phase probes: find data_wait, h2d, forward, backward and optimizer in an unchanged loop.

What is hooked, and why this way:
- forward: ``nn.Module.__call__`` is replaced (``module_calls.py``: every module's call, a model
  compiled in place included); only the outermost call of the loop's thread opens a span, and
  an exception inside forward still closes it.
- backward: ``torch.autograd.backward`` is wrapped (``Tensor.backward`` looks it up at call
  time, so one wrapper covers both), and so is ``torch.autograd.grad`` where it runs outside
  the forward, backward and optimizer (a gradient penalty, a meta-learning inner step): it is a
  backward pass too, though its result is no loss. Inside those phases it stays theirs (a
  physics-informed model differentiating its output in its forward, a second-order optimizer).
- optimizer: torch's global optimizer step pre/post hooks, plus ``Optimizer.zero_grad`` and
  ``Module.zero_grad``. The post hook of the *lead* optimizer (the first one that steps)
  ends a step, unless the user marks steps with ``tp.step()``. Another optimizer takes the lead
  where it replaces the lead (``_replaces_lead``: fine-tuning's next stage), or where it steps
  twice with a batch read between and no step of the lead's, whose update had a batch of its own
  (it steps once per iteration, the lead less often; a lead stepped on no batch of its own, a
  WGAN's generator before its critic loop, steps once per iteration around the others' batches).
- data_wait: ``__next__`` of torch's DataLoader iterators and ``DataLoader.__iter__`` (where
  workers start; torchdata's ``StatefulDataLoader`` too, ``LOADER_STARTS``); tpkit's loader
  and ``tp.watch`` report themselves. The batch's leading dimension counts the step's samples
  (``batches.batch_size_of``).
- h2d: ``Tensor.to`` / ``Tensor.cuda`` when the tensor leaves the host.
- save: ``torch.save`` and the frameworks' checkpoint writers (``SAVERS``); eval: a trainer's whole
  evaluation (``EVALUATORS``), besides the evaluation calls told apart after the slice; weight
  averaging (``AveragedModel.update_parameters``, diffusers' and timm's EMA, ``AVERAGERS``: a module
  imported inside the slice patched at the step's end) is optimizer time. The frameworks'
  methods wrapped (these tables and the others) are listed, each with why, in ``hook_places.py``.

Every hook ignores calls from threads other than the loop's (a loader thread running a
transform module is not the model's forward): the loop's thread is the one that started the
slice, unless the first optimizer step comes from another thread before that one did any
training work (a loop run in a background thread): the probe then follows that thread.
Under ``torch.compile`` every hook returns at once (no graph break, no recompile); a wrapper that
dynamo runs eagerly at one of its graph breaks (a step compiled whole calls ``loss.backward()``
so) is a frame dynamo skips, and so is the bookkeeping it calls (``compiling.skip_own_frames``).

- closures: ``optimizer.step(closure)`` (LBFGS, Lightning's automatic optimization) runs
  forward and backward inside the optimizer's step; the closure is wrapped so that its time
  is forward/backward/... as it happens and ``optimizer`` is the step's own work.
- AMP: ``GradScaler.scale`` and ``GradScaler.step`` are wrapped: the loss recorded is the
  unscaled one, and a step whose update the scaler skipped (inf/NaN) still ends the step,
  marked ``skipped``.
- loss: the sum of the one-element tensors backpropagated in the step (see ``loss_sums.LossSums``).
- activation checkpointing: a checkpointed block runs its forward again inside ``backward()``;
  a module call while backward is open (that, or a backward hook calling a module) opens no
  span (its time stays the backward's), and the run's notes say how many such calls there were.

``remove`` restores every registry and attribute exactly and is safe to call twice.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import functools
import gc
import sys
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from time import perf_counter_ns
from typing import Any

import torch
import torch.optim.optimizer as _optim
import torch.utils.data.dataloader as _dl

from ...errors import StopSlice
from ...schema import FILE_LOAD, JIT_TRACE, METRIC_CALL, UNSEEN_UPDATES_NOTE
from ..frameworks import EVALUATING, find_trainer, frame_self
from ..recorder import SPAN_FIELDS, Recorder, WeakRegistry
from . import batches, keras_optimizers, loss_sums, module_calls
from . import compiling as _cm
from .batches import forward_identity, handed_out, loader_dataset, loader_key, loader_settings
from .compiling import compiling, skip_own_frames, skipped_by_dynamo, watch_sessions
from .hook_places import (
    AVERAGERS,
    COMPILED_STEPS,
    DIFFUSION_PIPELINE,
    EVALUATORS,
    EVALUATORS_WHEN,
    FILE_LOADERS,
    LAUNCHERS,
    LOADER_SHUTDOWNS,
    LOADER_STARTS,
    OPTIMIZER_STEPS,
    OPTIMIZER_ZERO_GRADS,
    SAVERS,
    SEARCHES,
    TRACERS,
    TRAINER_RUNS,
    subclasses,
)
from .loss_sums import LossSums, static_scale
from .patching import UNIT_RESCALE_SKIPPERS, Patches, skip_unit_rescale

#: Collections shorter than this are not recorded as ``gc`` spans (a young-generation pass
#: takes microseconds and happens every few hundred allocations).
GC_SPAN_MIN_NS = 1_000_000

#: Phases during which a module call is not "the forward pass" (a transform in data loading,
#: recomputation in backward, a module used inside an optimizer).
_NOT_FORWARD = ("data_wait", "backward", "optimizer", "offload")

#: The classes whose subclasses' calls are metric calls (``schema.METRIC_CALL``), as (module,
#: name): found in a module class's MRO, so that torchmetrics is never imported by tpkit.
#: Distinct autograd nodes walked from a backward's roots looking for a metric's output used as
#: the loss (``PhaseProbe._metric_losses``): a metric with a dozen terms beside it; ~0.6 us a node.
METRIC_WALK = 64
_METRIC_CLASSES = frozenset({("torchmetrics.metric", "Metric"), ("torchmetrics.collections", "MetricCollection")})

#: True while torch.compile works in this thread: tpkit's hooks then do nothing at all.
_compiling = compiling
# The hottest hooks (backward, an optimizer's step hooks, zero_grad, a whole-phase wrapper) test
# ``compiling()`` as ``_dynamo_traces() or (_compiler._is_compiling_flag or _cm._foreign_at_start)
# and _compiling()``: the same answer (where neither flag is up ``compiling()`` reads False and
# changes nothing), without its frame in an eager step (7 frames a step on a Trainer's).
_dynamo_traces = torch.compiler.is_dynamo_compiling
_compiler: Any = torch.compiler
# run eagerly by a hook at a graph break, torch's function (``return False``) is now a callee of
# the hook's own frame: dynamo would compile it as a frame of the loop's (a code more than
# without tpkit, tests/integrations/test_compile.py); as under ``compiling()``, it is skipped.
# Tracing (inlining) is not affected: it folds to True there.
skipped_by_dynamo(_dynamo_traces)


def _same_model(module: torch.nn.Module) -> list[int]:
    """Ids of ``module`` and of the models it wraps (DDP's and DataParallel's ``.module``,
    torch.compile's ``_orig_mod``): a loop may train through the wrapper and evaluate the model
    inside it."""
    ids = []
    for _ in range(4):  # wrappers of wrappers, a few deep
        ids.append(id(module))
        inner = getattr(module, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            inner = getattr(module, "module", None)
        if not isinstance(inner, torch.nn.Module):
            break
        module = inner
    return ids


#: Lightning's batch fetcher, which reads one batch ahead over a loader with no length.
_LIGHTNING_FETCHERS = ("lightning.pytorch.loops.fetchers", "pytorch_lightning.loops.fetchers")


def _fetcher_workers(fetcher: Any) -> int:
    """The ``num_workers`` of the first DataLoader a Lightning fetcher reads (-1: none known)."""
    try:
        loaders = fetcher.combined_loader.flattened
        return int(getattr(loaders[0], "num_workers", -1)) if loaders else -1
    except Exception:  # noqa: BLE001 - not set up yet, or another Lightning
        return -1


def has_accelerator() -> bool:
    """Whether this process can see a device other than the host (CUDA, MPS, XPU...). Without
    one no ``Tensor.to`` can be a host-to-device copy, so the h2d wrappers are not installed:
    each costs 1.5-2 us per call (a Hugging Face Trainer step makes ~40 such calls) for spans
    that could never be recorded."""
    acc = getattr(torch, "accelerator", None)
    if acc is not None and hasattr(acc, "is_available"):
        return bool(acc.is_available())
    return torch.cuda.is_available()


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


class _LeadChange:
    """One change of the optimizer whose step() ends the steps (``PhaseProbe._replaces_lead``),
    kept until the notes are written: whether the old lead stepped again after it is known only
    then (a replacement steps no more; one stepping less often than the new lead goes on)."""

    __slots__ = ("step", "new", "old", "freed", "shared", "batch_between", "later", "merged", "new_name",
                 "old_name", "new_params")

    def __init__(self, step: int, new: str, old: str, freed: bool = False, shared: bool = False,
                 batch_between: bool = False) -> None:
        self.step = step  # the raw step the change ended (its new lead's step() ended it)
        self.new, self.old = new, old  # the optimizers' types
        # their names where the note must tell them apart (both step on): the types, or where both are of
        # one type, which of that type each was to step ("second SGD"), and the new one's parameter count
        self.new_name, self.old_name = new, old
        self.new_params: int | None = None
        self.freed = freed  # the old lead was garbage collected
        self.shared = shared  # the new lead holds a parameter of the old one's
        self.batch_between = batch_between  # a batch was handed out between the new lead's two step() calls
        self.later = 0  # the old lead's step() calls after the change
        self.merged = False  # the step the change ended holds more iterations than the one before it


_ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth")


def _ordinal(n: int) -> str:
    """``1`` -> ``"first"``; past the tenth, ``"11th"``, ``"22nd"``."""
    if n <= len(_ORDINALS):
        return _ORDINALS[n - 1]
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _tail_counts(flat: list, stride: int, step_at: int, step: int, phase: str | None = None) -> tuple[int, int]:
    """How many records of a flat per-step table (the Recorder's handouts or spans: ``stride``
    values each, the raw step at ``step_at``; spans of ``phase`` alone) belong to raw step
    ``step`` and to the one before it, read from the end (those are the newest)."""
    now = before = 0
    i = len(flat) - stride
    while i >= 0:
        s = flat[i + step_at]
        if s < step - 1:
            break
        if phase is None or flat[i] == phase:
            if s == step:
                now += 1
            elif s == step - 1:
                before += 1
        i -= stride
    return now, before


class PhaseProbe:
    """Installs the phase hooks for one Recorder; ``remove()`` undoes all of it."""

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec
        self._handles: list[Any] = []
        self._post_handle: Any = None  # the handle of tpkit's global optimizer step post-hook
        self._patched = Patches()
        self._set_inside: Callable[[int | None], None] = module_calls.set_inside  # (install: the route's own)
        self._fwd_gen = 0  # bumped when an early adoption is taken back: that thread's call no longer counts
        self._opt_tokens: list[tuple[int, str]] = []  # (token, source) of open optimizer spans
        self._closure_depth = 0  # > 0 while an optimizer's closure runs
        self._keras_depth = 0  # > 0 while a Keras optimizer's update runs (``_wrap_keras_step``)
        self._closure_evals = 0  # closure calls in the current optimizer step
        self._opt_posts = 0  # optimizer post hooks seen (a GradScaler step without one was skipped)
        self._worked = False  # a forward, backward, zero_grad or batch since the last step ended
        # the loop's last zero_grad(set_to_none=...); None until one is seen, and then whether
        # a trained parameter's .grad was None when the last backward began (a loop that drops
        # them by hand, p.grad = None, or zeroes them, p.grad.zero_())
        self._grads_to_none: bool | None = None
        self._none_before_backward = True
        self._ever_worked = False
        self._backward_seen = False
        self._read_ahead = 0  # > 0 while a read-ahead loader (accelerate) fetches its next batch
        self._scaled: tuple[Any, torch.Tensor] | None = None  # (weakref to scaler.scale()'s output, its input)
        self.losses = LossSums(rec)
        self.lead_optimizer: int | None = None
        self._lead_ref: weakref.ref | None = None  # the lead itself: its parameters, whether it lives
        self._lead_params: set[int] = set()  # ids of its parameters
        self._lead_steps = 0  # the lead's step() calls (``_replaces_lead`` asks whether it still steps)
        # others holding none of the lead's parameters, and the lead it replaced: they take the lead only by
        # stepping more often than it (``_replaces_lead``)
        self._lead_rivals: weakref.WeakSet = weakref.WeakSet()
        self._lead_sharers: weakref.WeakSet = weakref.WeakSet()  # others sharing a parameter with the lead
        self._sharer_at: int | None = None  # the lead's step() count at the last step() of any of them
        # every other optimizer's last step(): (the lead's step() count, len(rec.handouts)) then
        self._rival_at: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # len(rec.handouts) at the end of the last step() of any optimizer stepping on its own, and whether a batch
        # was handed out between that step() and the lead's last one (``_replaces_lead``: the lead's update had a
        # batch of its own)
        self._opt_handouts = 0
        self._lead_own_batch = True
        # each optimizer stepping on its own -> which of its type it was to step first (1, 2, ...): notes tell two
        # of one type apart by it (``_names``)
        self._ordinals: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._type_counts: dict[str, int] = {}
        self._replaced: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # old lead -> its _LeadChange
        self.lead_changes: list[_LeadChange] = []
        self.optimizers: dict[int, str] = {}
        self._stepping = WeakRegistry()  # the loop's optimizers, held weakly, in the order they first stepped
        self._paused = False  # a trainer's search or launcher runs (``SEARCHES``, ``LAUNCHERS``): the loop is not followed
        self.launches = 0  # Lightning's launches of processes that train (``LAUNCHERS``)
        self._run_optimizers: set[int] = set()  # those that stepped in this run of a trainer (or the loop)
        # those seen stepping only inside another's step() (a wrapper's optimizer: ZeroRedundancyOptimizer's,
        # Lookahead's base) -> the wrapper's type: not counted in ``_run_optimizers`` (ZeRO(Adam) had read
        # "2 optimizers stepped"); one that then steps on its own moves there
        self.inner_optimizers: dict[int, str] = {}
        # the lead stepped inside the step() now running (not its closure): that optimizer wraps it
        # (``_wraps_lead``)
        self._lead_inside = False
        # the SAVERS and AVERAGERS whose module was not imported yet, with their phase, and
        # len(sys.modules) when that was looked at (``_patch_late``)
        self._late_left: tuple[tuple[str, tuple[str, str, str]], ...] = (
            *(("save", p) for p in SAVERS), *(("optimizer", p) for p in AVERAGERS))
        self._modules_seen = 0
        self._joins: set[int] = set()  # ids of the DDP Join contexts the loop entered in the slice
        self._most_in_past_runs = 0  # the most optimizers that stepped in one trainer run before this one
        self.trainer_runs = 0  # runs of a trainer that stepped and ended before the slice was full
        self.run_ends: list[int] = []  # when each of them ended (ns)
        self.merged_steps = 0  # lead step() calls with no forward/backward since the previous one
        # the lead optimizer stepped inside backward (optimizers in gradient hooks): the step ends
        # when that backward returns, its every hook's update done (``_opt_post``)
        self._step_in_backward: torch.optim.Optimizer | None = None
        self.steps_in_backward = 0
        # outermost module calls inside backward: activation checkpointing recomputing its forward
        self.recomputed_calls = 0
        self.grad_calls = 0  # torch.autograd.grad calls timed as backward
        # updates no optimizer hook saw (``_unseen_update``): the watched parameters (weakly, see
        # ``_pick_sentinels``) and their version counters at the last backward's exit, None once a
        # step ended
        self._sentinels: list[Any] = []
        self._sentinel_models = -1  # models + zeroed optimizers known when the sentinels were chosen
        self._versions_at_backward: list[int] | None = None
        self._handouts_at_backward = 0  # len(rec.handouts) then
        self._progress_at_backward: dict[int, tuple[int, int]] = {}  # _optimizers_progress() then
        # the last top-level forward's leading input tensor (weakly), kept while updates are watched
        # and no batch was handed out: a second pass on the same batch is told by it (``_forward_coming``)
        self._last_input: Any = None
        self._zeroed_since_backward = False  # a zero_grad() since
        self.unseen_updates = 0  # steps ended that way
        self._watch_updates = True  # False once an optimizer's own step was seen: none goes unseen
        self.static_scaled: dict[float, int] = {}  # a hand-made loss scale -> losses unscaled by it
        self._free: dict[int, bool] = {}  # id(module) -> whether it has no parameters (a loss, a metric)
        self._metric_types: dict[type, bool] = {}  # module class -> whether it is a metric (``_is_metric``)
        # metric calls since the last backward whose output carries grad: (span index, its grad_fn nodes)
        self._metric_outputs: list[tuple[int, list[int]]] = []
        self.skipped_steps = 0  # steps whose update a GradScaler skipped (inf/NaN gradients)
        self.foreign_steps: dict[str, int] = {}  # thread name -> optimizer steps tpkit did not follow
        self.models = rec.models  # shared: the memory probe reads it
        self.installed = False
        self._gc_installed = False
        self._gc_start = 0
        self._start_tid = rec.thread_id  # the thread that started the slice
        self.loop_thread: threading.Thread | None = None  # the thread followed as the loop's (_adopt)
        self._early: tuple[str, int, int] | None = None  # (note, spans, samples) at an early adoption
        self._graph_breaks_at_start = _graph_breaks()
        self._wall_start_us = time.time_ns() // 1000  # dynamo's compilation records after it are the slice's
        # the torch.compile'd function the slice's first backward came from (the whole step compiled:
        # its forward and optimizer step run in graphs tpkit cannot see); "": none (``_compiled_backward``)
        self.compiled_step: str | None = None

    @property
    def most_optimizers(self) -> int:
        """The most optimizers that stepped in one run (one a new optimizer replaced not counted)."""
        return max(self._most_in_past_runs, len(self._run_optimizers))

    @property
    def tid(self) -> int:
        """The thread whose calls are the loop's (the Recorder's, which may follow the loop)."""
        return self.rec.thread_id

    # -- life cycle -------------------------------------------------------------------------
    def install(self) -> "PhaseProbe":
        if self.installed:
            return self
        self.installed = True
        self.rec.batch_coming = self._batch_coming
        try:
            watch_sessions(self._patched)  # first: the module-call route reads whose session it is
            why = module_calls.take(self, self._outer_call, self._patched)
            self._set_inside = module_calls.inside_setter()
            if why is not None:
                self.rec.note(f"module calls went through tpkit's Python route ({why}; its C route needs "
                              f"a C compiler); it costs ~0.5 us a module call more in a warm "
                              f"loop and ~4 us inside a training step (1.3% of a 2-layer GPT-2 Trainer's "
                              f"step; docs/OVERHEAD.md, \"Module calls in C\")")
            # torch runs the global step hooks in their table's order, before an optimizer's own
            # pre-hooks and after its own post-hooks: tpkit's pre-hook goes to the front of its
            # table and its post-hook stays at the back (``_opt_pre``), so the loop's own global
            # hooks (registered before the slice: a 20 ms pre-hook had read other, 0.2 ms
            # optimizer) are the step's time, and the stop raised in ``_opt_pre`` comes before them
            pre = _optim.register_optimizer_step_pre_hook(self._opt_pre)
            self._handles.append(pre)
            _move_hook(pre, last=False)
            self._post_handle = _optim.register_optimizer_step_post_hook(self._opt_post)
            self._handles.append(self._post_handle)
            self._patched.set(torch.autograd, "backward", self._wrap_backward(torch.autograd.backward))
            self._patched.set(torch.autograd, "grad", self._wrap_grad(torch.autograd.grad))
            self._patched.set(torch.optim.Optimizer, "zero_grad",
                        self._wrap_phase(torch.optim.Optimizer.zero_grad, "optimizer", "zero_grad"))
            self._patched.set(torch.nn.Module, "zero_grad",
                        self._wrap_phase(torch.nn.Module.zero_grad, "optimizer", "zero_grad"))
            self._patched.set(_dl._BaseDataLoaderIter, "__next__",
                        self._wrap_next(_dl._BaseDataLoaderIter.__next__, "DataLoader"))
            self._patched.set(_dl.DataLoader, "__iter__", self._wrap_iter(_dl.DataLoader.__iter__, "DataLoader"))
            # a DataLoader's workers shut down where its iterator is dropped (an epoch that was
            # not read to its end: a break, Lightning, which never calls the last next(); a
            # next(iter(loader)) each step): the loop waits for its data pipeline there, as at
            # the end of an epoch (it had been other: 21-28% of a step, "Python between phases")
            shutdown = vars(_dl._MultiProcessingDataLoaderIter).get("_shutdown_workers")
            if callable(shutdown):
                self._patched.set(_dl._MultiProcessingDataLoaderIter, "_shutdown_workers",
                                  self._wrap_shutdown(shutdown, "DataLoader._shutdown_workers"))
            self._patch_each(LOADER_STARTS, lambda fn, module, owner, attr: self._wrap_iter(fn, owner))
            self._patch_each(LOADER_SHUTDOWNS, lambda fn, module, owner, attr:
                             self._wrap_shutdown(fn, f"{owner}.{attr}"))
            if has_accelerator():
                self._patched.set(torch.Tensor, "to", self._wrap_h2d(torch.Tensor.to, "Tensor.to", always=False))
                self._patched.set(torch.Tensor, "cuda", self._wrap_h2d(torch.Tensor.cuda, "Tensor.cuda", always=True))
            for m in _LIGHTNING_FETCHERS:
                fetcher = getattr(sys.modules.get(m), "_PrefetchDataFetcher", None)
                if isinstance(fetcher, type):
                    for attr in ("__iter__", "__next__"):
                        self._patched.set(fetcher, attr, self._wrap_fetcher(vars(fetcher)[attr], attr == "__next__"))
            for name in ("DataLoaderShard", "DataLoaderDispatcher"):  # the second: over an IterableDataset
                shard = getattr(sys.modules.get("accelerate.data_loader"), name, None)
                if isinstance(shard, type) and "__iter__" in shard.__dict__:  # only if the loop imported it
                    self._patched.set(shard, "__iter__", self._wrap_read_ahead(shard.__dict__["__iter__"]))
            self._patched.set(torch, "save", self._wrap_whole(torch.save, "save", "torch.save"))
            self._patched.set(torch, "load", self._wrap_whole(torch.load, FILE_LOAD, "torch.load"))
            self._patch_each(FILE_LOADERS, lambda fn, module, owner, attr:
                             self._wrap_whole(fn, FILE_LOAD, f"{module}.{attr}"))
            self._patch_each(TRACERS, lambda fn, module, owner, attr: self._wrap_trace(fn, f"torch.jit.{attr}"))
            self._patch_each(EVALUATORS, lambda fn, module, owner, attr:
                             self._wrap_whole(fn, "eval", f"{owner or module}.{attr}"))
            self._patch_late()
            for module, owner, attr, test in EVALUATORS_WHEN:
                self._patch_each(((module, owner, attr),), lambda fn, module, owner, attr, test=test:
                                 self._wrap_whole(fn, "eval", f"{module.split('.')[0]}.{owner}.{attr}",
                                                  when=EVALUATING[test]))
            self._patch_pipelines()
            join = getattr(sys.modules.get("torch.distributed.algorithms.join"), "Join", None)
            if isinstance(join, type):  # only where the loop imported it (DDP does)
                for attr in ("__enter__", "__exit__"):
                    self._patched.set(join, attr, self._wrap_join(vars(join)[attr], enter=attr == "__enter__"))
            for cls in keras_optimizers.optimizer_classes():  # only where the loop imported Keras
                for attr in keras_optimizers.STEP_ATTRS:
                    if callable(vars(cls).get(attr)):
                        self._patched.set(cls, attr, self._wrap_keras_step(vars(cls)[attr]))
            self._patch_each(OPTIMIZER_STEPS, lambda fn, *_: self._wrap_foreign_step(fn))
            self._patch_each(OPTIMIZER_ZERO_GRADS, lambda fn, *_: self._wrap_phase(fn, "optimizer", "zero_grad",
                                                                                   to_none=False))
            self._patch_each(COMPILED_STEPS, lambda fn, *_: self._wrap_compiled_step(fn))
            self._patch_each(TRAINER_RUNS, lambda fn, *_: self._wrap_trainer_run(fn))
            self._patch_each(SEARCHES, lambda fn, module, owner, attr:
                             self._wrap_unprofiled(fn, self._search_note(f"{module.split('.')[0]}'s {attr}")))
            self._patch_each(LAUNCHERS, lambda fn, module, *_:
                             self._wrap_unprofiled(fn, self._launch_note(module.split(".")[0])))
            scaler = torch.amp.GradScaler
            self._patched.set(scaler, "scale", self._wrap_scale(scaler.scale))
            self._patched.set(scaler, "step", self._wrap_scaler_step(scaler.step, scaler.update))
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
        module_calls.release(self)
        self._patched.restore()
        if UNIT_RESCALE_SKIPPERS:  # torch's clip function is back under it: the offload optimizers' skip too
            skip_unit_rescale()
        self._scaled = None
        self.installed = False
        if self.rec.batch_coming == self._batch_coming:
            self.rec.batch_coming = None

    def claim_parts(self) -> None:
        """After the slice: a part of a trained model called on its own without grad is the trained
        model's (``generate()`` calls a sequence-to-sequence model's encoder directly), so that its
        calls count as evaluation. It had made every evaluation batch of a ``Seq2SeqTrainer`` with
        ``predict_with_generate`` the step's: 3x the samples, and its waits data_wait. So is a
        wrapper of a trained model called only without grad: ``eval_model = torch.compile(model)``
        for evaluation, the model trained eagerly (its evaluation had been the steps' forward)."""
        rec = self.rec
        alone = set(rec.no_grad_calls[2::4]) - rec.trained_modules
        if not alone:
            return
        for model in self.models.live():
            if id(model) in rec.trained_modules:
                rec.trained_modules.update(id(m) for m in model.modules() if id(m) in alone)
        for model in self.models.live():
            if id(model) in alone and any(i in rec.trained_modules for i in _same_model(model)[1:]):
                rec.trained_modules.add(id(model))

    @property
    def backward_seen(self) -> bool:
        """Whether the loop ran a backward pass in the slice (in its thread)."""
        return self._backward_seen

    def trains_weights(self) -> bool:
        """Whether a model the loop called has a parameter that requires grad (read once, at the
        slice's end): a loop whose backward passes only give it input gradients (a saliency map
        over a frozen model) updates nothing, and no optimizer is missing there."""
        return any(p.requires_grad for m in self.rec.models.live() for p in m.parameters())

    def says_why_no_step(self) -> bool:
        """Whether the run's notes already say why a slice recorded no step (the loop trained in
        another thread, or in processes Lightning launched): no advice to call ``tp.step()``."""
        return bool(self.foreign_steps or self.launches)

    def notes(self) -> list[str]:
        """What the loop did that changes how its numbers read (for ``run.meta["notes"]``)."""
        out = []
        runs = self.trainer_runs + (1 if self._run_optimizers else 0)
        if runs > 1:
            out.append(f"the slice holds the steps of {runs} runs of a trainer (train() / fit() "
                       "called again before it was full, or a Trainer's auto_find_batch_size trying again at a "
                       "smaller batch after an out-of-memory error), in order: each run's first optimizer ends "
                       f"its steps{self._setups()}")
        if self.steps_in_backward:
            out.append(f"optimizer.step() ran inside backward ({self.steps_in_backward} step(s); "
                       f"{self.most_optimizers} optimizer(s), as in gradient hooks stepping each parameter's own): "
                       "a step ends when that backward returns; the updates' time is optimizer, the rest "
                       "of the pass backward")
        out.extend(self._lead_notes())
        if self.merged_steps:
            out.append(f"optimizer.step() was called {self.merged_steps} more time(s) with no forward or "
                       "backward since the previous call: each such call is part of the same step")
        if self.foreign_steps and not self.rec.step_ends:
            where = ", ".join(f"'{n}' ({k}x)" for n, k in self.foreign_steps.items())
            out.append(f"no step was recorded here, but optimizer.step() ran in thread {where}: tpkit "
                       "follows one loop per slice, and the thread that started this slice trained first; "
                       "start the slice in the training thread (or let this one only wait for it)")
        if self._backward_seen and not self.models and not self.compiled_step:
            out.append("backward ran but no module's forward was seen: the model is not called as an "
                       "nn.Module (a functional model, or model.forward(...) "
                       "called directly); mark its forward with tp.phase('forward')")
        for scale, n in self.static_scaled.items():
            out.append(f"{n} loss(es) went through backward multiplied by {scale:g} (a static loss scale, as "
                       "(loss * scale).backward() with the gradients divided after): the loss recorded is the "
                       "unscaled one")
        if self.grad_calls and not self._backward_seen:  # (a functional loop: its loss column had been NaN, unexplained)
            out.append(f"torch.autograd.grad ran {self.grad_calls} time(s) outside the forward and backward() never "
                       "ran (gradients taken with torch.autograd.grad, as a functional loop does): its passes are "
                       "backward time (backward_s); tpkit reads a step's loss from what goes through backward(), "
                       "so run.steps.loss is NaN in every step")
        elif self.grad_calls:
            out.append(f"torch.autograd.grad ran {self.grad_calls} time(s) outside the forward (a gradient "
                       "penalty, a meta-learning inner step): its passes are backward time (backward_s); "
                       "the loss is still only what went through backward()")
        if self.recomputed_calls:
            out.append(f"modules ran inside backward ({self.recomputed_calls} outermost call(s)), as when "
                       "activation checkpointing recomputes the forward: that time is the backward's "
                       "(backward_s), not the forward's, and on the CPU the memory allocated there counts "
                       "as temporaries, not activations")
        if self.unseen_updates:
            out.append(f"{self.unseen_updates} {UNSEEN_UPDATES_NOTE}: the "
                       "parameters changed after backward (a torch.compile'd optimizer step, whose hooks dynamo "
                       "compiles away; an optimizer that is not a torch.optim.Optimizer; an update by hand). "
                       "Each such step ends at the loop's next batch (or forward, for a batch read before the "
                       "update) after its update (in a step compiled whole, at its zero_grad(), or else its next "
                       "backward), and its update's "
                       "time is in other_s, not optimizer_s: tpkit cannot time a compiled step from inside. A step compiled "
                       "before the slice is compiled once more at the slice's first step (dynamo guards on torch's "
                       "table of optimizer hooks, which tpkit's join)")
        if self.compiled_step:
            unseen = "forward and optimizer step" if self.unseen_updates or not self.optimizers else "forward"
            out.append(f"the loop's {unseen} ran inside {self.compiled_step}, compiled by torch.compile as a whole: "
                       "tpkit sees only what dynamo runs eagerly at its graph breaks (loss.backward() as backward_s, "
                       f"a zero_grad() it does not trace as optimizer_s); the {unseen} run in its compiled graphs, "
                       "other_s (where the backend runs a graph as a module, aot_eager, that graph reads as forward_s), "
                       "not Python between phases. Compile the model alone (torch.compile(model)) for the split. Dynamo "
                       "guards its optimizer step on torch's table of optimizer step hooks, which tpkit's join while "
                       "the slice runs: the step compiles once more after the slice (its function and what it resumes "
                       "after a graph break; a graph break more in the next cell), which a step run the same way "
                       "without tpkit does not")
        hooked = _hook_recompiles(self._wall_start_us)
        if hooked:
            out.append(f"torch.compile recompiled {hooked} time(s) in the slice because of tpkit: it adds its hooks to "
                       "torch's table of optimizer step hooks, on which dynamo guards a compiled optimizer step "
                       "(dynamo's reason: len(G['_global_optimizer_pre_hooks']) != 0); the step compiles once more "
                       "after the slice, when they are gone")
        breaks = _graph_breaks() - self._graph_breaks_at_start
        if breaks > 0 and self.compiled_step:
            out.append(f"torch.compile: {breaks} graph break(s) while the slice ran, the step compiled whole's own "
                       "(as without tpkit: dynamo runs loss.backward() and zero_grad() eagerly); after the slice the "
                       "step compiles again with one graph break more, because of tpkit's optimizer hooks (see the "
                       "note on the step compiled whole)")
        elif breaks > 0:
            out.append(f"torch.compile: {breaks} graph break(s) while the slice ran, none caused by tpkit "
                       "(its hooks return at once while dynamo traces); the model (or torch's own code: a compiled "
                       "optimizer step breaks on purpose around its update) runs partly eager: "
                       "see torch._dynamo.explain(model)(...) for the reasons")
        return out

    def _setups(self) -> str:
        """Where the next runs' setups went: from a run's end to the next run's first batch."""
        times = self.rec.handouts[0::3]
        gaps = []
        for end in self.run_ends:
            k = bisect.bisect_right(times, end)
            if k < len(times):
                gaps.append(f"{(times[k] - end) / 1e9:.2f} s")
        if not gaps:
            return ""
        return (f"; each later run's setup (from the run before's end to its first batch: {', '.join(gaps)}) is "
                "setup time (setup_s) of the step it falls in, with the run before's end, left out of the verdict")

    # -- the loop's thread --------------------------------------------------------------------
    def _adopt(self, tid: int, at_step: bool) -> bool:
        """Whether to follow thread ``tid`` as the loop's from now on: only before the slice's
        own thread did any training work, and then at the loop's first optimizer step
        (``at_step``), or earlier (its first batch or forward) when the slice's thread is
        starting or joining that very thread (``with tp.profile(): t.start(); t.join()``), so
        that the first step is seen whole. Should the slice's own thread then train before any
        step ended, the early choice was wrong (a loader thread's transform module): tpkit
        goes back to the slice's thread and drops what it recorded of the other."""
        rec = self.rec
        if tid == self._start_tid and self._early is not None and not rec.step_ends:
            self._back_to_start()
            return True
        if self._ever_worked or rec.step_ends or self._opt_tokens or rec.slice_steps is not None or self._paused:
            return False
        how = "" if at_step else _waits_for_current_thread(self._start_tid)
        if not at_step and not how:
            return False
        rec.thread_id = tid
        self.loop_thread = threading.current_thread()
        name = self.loop_thread.name
        rec.meta["loop_thread"] = name  # the slice's end leaves it running
        if at_step:
            rec.note(f"the training loop runs in thread '{name}', not the one that started the slice: "
                     "tpkit follows it from its first optimizer.step(), so that first step's data wait, "
                     "forward and backward were not seen (it is a warmup step when warmup >= 1)")
        else:
            # only join() is waiting: start() returns once the thread runs (a body that never joins
            # returns while the loop runs on; Profile._finish says so)
            text = (f"the training loop runs in thread '{name}', not the one that started the slice "
                    f"({'which waits for it' if how == 'join' else 'which started that thread'}): tpkit follows that thread")
            self._early = (text, rec.span_count(), rec.samples)
            rec.note(text)
        return True

    def _back_to_start(self) -> None:
        """Undo an early adoption (see ``_adopt``): the slice's own thread is the loop's."""
        rec = self.rec
        assert self._early is not None  # set by _adopt, which this undoes
        text, n_spans, samples = self._early
        self._early = None
        rec.close_all()
        rec.drop_spans(n_spans)
        rec.samples = samples
        rec.thread_id = self._start_tid
        self.loop_thread = None
        rec.meta.pop("loop_thread", None)
        if text in rec.notes:
            rec.notes.remove(text)
        module_calls.set_inside(None)
        self._fwd_gen += 1

    # -- garbage collection -------------------------------------------------------------------
    def _gc(self, event: str, info: dict) -> None:
        """Python's collector pausing the loop: a ``gc`` span (nested in whatever phase it
        interrupted, so it also shows which phase paid for it). Recorded without phase
        listeners: nothing may allocate tensors inside a collection."""
        if threading.get_ident() != self.rec.thread_id:
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
    def _outer_call(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        """An outermost module call (none of the loop thread's is running): a forward span
        unless it runs inside a phase that is not the forward pass. The module calls inside it
        go straight to torch (``module_calls.py``)."""
        __tracebackhide__ = True  # noqa: F841 - read by IPython's and pytest's traceback formatters
        tid = threading.get_ident()
        if tid != self.rec.thread_id and not self._adopt(tid, at_step=False):
            return module_calls._torch_call(module, *args, **kwargs)
        rec = self.rec
        metric = self._metric_types.get(type(module))  # (inline: no frame of tpkit's more a call)
        if metric or (metric is None and self._is_metric(type(module))):
            return self._metric_call(module, tid, args, kwargs)
        token = None
        no_grad_from = 0  # a call without grad: maybe evaluation (capture/evaluation.py)
        in_train_mode = False  # ... of a module with parameters in train mode (Recorder.no_grad_train_calls)
        if not any(map(rec._open.get, _NOT_FORWARD)):  # (no frame of tpkit's per phase: rec.is_open)
            if self._versions_at_backward is not None:
                self._forward_coming(args, kwargs)
            if self._watch_updates and not rec.handouts:
                self._last_input = _input_ref(args, kwargs)
            if rec.stop_pending is not None and not rec.training_sources and self._trains(module):
                rec.stop_pending()  # the slice is full: the loop stops at its next training forward
            no_grad_boundary = False  # a forward without grad whose enter is a phase boundary
            if torch.is_grad_enabled():
                if module.training and id(module) not in rec.trained_modules:
                    rec.trained_modules.update(_same_model(module))
            else:
                no_grad_boundary = not rec.is_open("forward")  # (one open already had its boundary)
                in_train_mode = not self._param_free(module) and module.training
                no_grad_from = perf_counter_ns()
            token = rec.enter("forward", type(module).__name__)
            if no_grad_boundary:
                rec.no_grad_forwards.append(perf_counter_ns())
            self._worked = self._ever_worked = True
            models = self.models  # (WeakRegistry.add, inlined where the model is known: a frame less a step)
            known = models._keys.get(id(module))
            if known is None or models.entries[known]() is not module:
                models.add(module)
        elif rec.is_open("backward"):
            self.recomputed_calls += 1
        gen = self._fwd_gen
        try:
            self._set_inside(tid)  # (inside the try: a Ctrl-C right after it still resets it)
            return module_calls._torch_call(module, *args, **kwargs)
        except Exception:
            if token is not None and gen == self._fwd_gen:  # a batch the loop may skip (read_ahead.failed)
                rec.failed_forwards += (perf_counter_ns(), forward_identity(args, kwargs), rec.step_index)
            raise
        finally:
            if gen == self._fwd_gen:  # not undone meanwhile (an early adoption taken back)
                self._set_inside(None)
                if token is not None:
                    rec.exit(token)
                    if no_grad_from:
                        (rec.no_grad_train_calls if in_train_mode else rec.no_grad_calls).extend(
                            (no_grad_from, perf_counter_ns(), id(module), rec.step_index))

    def _is_metric(self, cls: type) -> bool:
        """Whether ``cls`` is a metric module (torchmetrics' ``Metric``, ``MetricCollection``),
        noted in ``_metric_types``: its MRO is read once a class (about 1.3 us); ``_outer_call``
        looks the class up there first (a dict lookup, about 60 ns an outermost call)."""
        metric = self._metric_types[cls] = any((c.__module__, c.__qualname__) in _METRIC_CLASSES for c in cls.__mro__)
        return metric

    def _metric_call(self, module: torch.nn.Module, tid: int, args: tuple, kwargs: dict) -> Any:
        """An outermost call of a metric module (``metric(preds, target)``: an update, and a
        compute on the batch): a ``schema.METRIC_CALL`` span, whose time is other, not the model's
        forward (a metric whose compute took 77% of the step had read COMPUTE-BOUND). One whose
        output the next backward runs through is a loss made by a metric (``1 - ssim(x, y)``):
        its span becomes forward then, as a loss module's (``_metric_losses``). Without grad it is
        recorded as a call of a module without parameters is, so that after an evaluation call it
        is evaluation (capture/evaluation.py). Inside a phase that is not the forward (an
        optimizer's step) nothing is recorded, as for any module. Per call: a span, and where the
        output carries grad its nodes, kept until the next backward (the last 16 at most)."""
        rec = self.rec
        token = None
        no_grad_from = 0
        if not any(map(rec._open.get, _NOT_FORWARD)):
            if not torch.is_grad_enabled():
                no_grad_from = perf_counter_ns()
                rec.param_free_modules.add(id(module))  # a helper of an evaluation, whatever it holds
            token = rec.enter(METRIC_CALL, type(module).__name__)
        gen = self._fwd_gen
        out: Any = None
        try:
            module_calls.set_inside(tid)
            out = module_calls._torch_call(module, *args, **kwargs)
            return out
        finally:
            if gen == self._fwd_gen:
                module_calls.set_inside(None)
                if token is not None:
                    first = rec.span_count()
                    rec.exit(token)
                    if no_grad_from:
                        rec.no_grad_calls += (no_grad_from, perf_counter_ns(), id(module), rec.step_index)
                    else:
                        nodes = _grad_nodes(out)
                        if nodes:  # its span: the first closed at its depth (tpkit's own may follow)
                            spans = rec._spans
                            index = next((k for k in range(first, rec.span_count())
                                          if spans[k * SPAN_FIELDS + 3] == token), None)
                            if index is not None:
                                self._metric_outputs.append((index, nodes))
                                del self._metric_outputs[:-16]  # no backward since: let the graphs go

    def _metric_losses(self, tensors: Any) -> None:
        """Before a backward, after metric calls whose output carries grad (``_metric_call``): the
        ones whose output the backward runs through, found within METRIC_WALK distinct nodes of
        its roots, breadth first (a metric used as the loss, ``loss = 1 - ssim(x, y)``, a few
        terms with it), are forward; the rest (a differentiable metric logged,
        ``train_mse(preds, y)``) stay metric calls. The walk is tpkit's own time (a ``tpkit``
        span): it had cost ~170 us a backward in other on a 121-layer MLP (a list popped from the
        front, nodes shared by many terms walked again, 256 of them)."""
        start = perf_counter_ns()
        pending, self._metric_outputs = self._metric_outputs, []
        wanted = {n: index for index, nodes in pending for n in nodes}
        roots = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        todo = collections.deque(t.grad_fn for t in roots if isinstance(t, torch.Tensor) and t.grad_fn is not None)
        seen: set[int] = set()
        while todo and wanted and len(seen) < METRIC_WALK:
            node = todo.popleft()
            key = id(node)
            if key in seen:
                continue
            seen.add(key)
            index = wanted.pop(key, None)
            if index is not None:
                self.rec.relabel(index, METRIC_CALL, "forward")
            todo.extend(fn for fn, _ in node.next_functions if fn is not None)
        self.rec._own(start)

    def _trains(self, module: torch.nn.Module) -> bool:
        """Whether a call of ``module`` now is a training forward: with grad, in train mode, of a
        model the slice trained (not a loss module, not an evaluation without grad or in eval
        mode). Asked only once the slice is full, where the loop's next read is one tpkit does not
        see (no loader seen, or none read for the last step: ``slice._training_sources``); else
        its next read from that loader stops it, and a GAN's generator half after the lead
        optimizer's step runs as the iteration's tail. Where it is asked, that half's forward
        (or backward) stops the loop: the generator misses its last update (README, "How the
        loop is stopped")."""
        return (torch.is_grad_enabled() and module.training and id(module) in self.rec.trained_modules
                and not self._param_free(module))

    def _param_free(self, module: torch.nn.Module) -> bool:
        """Whether ``module`` has no parameters (a loss, a metric): called without grad, it is
        evaluation when it follows an evaluation call, whatever its mode (capture/evaluation.py).
        Asked once a module, and only for calls made without grad."""
        key = id(module)
        free = self._free.get(key)
        if free is None:
            free = self._free[key] = next(module.parameters(), None) is None
            if free:
                self.rec.param_free_modules.add(key)
        return free

    # -- optimizer --------------------------------------------------------------------------
    def _opt_pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> Any:
        if _dynamo_traces() or ((_compiler._is_compiling_flag or _cm._foreign_at_start) and _compiling()):
            return None
        tid = threading.get_ident()
        if tid != self.rec.thread_id and not self._adopt(tid, at_step=True):
            if not self.rec.step_ends:  # why a slice may end with no step: said in notes()
                name = threading.current_thread().name
                self.foreign_steps[name] = self.foreign_steps.get(name, 0) + 1
            return None
        _move_hook(self._post_handle, last=True)  # a global post-hook the loop registered since
        if self.rec.stop_pending is not None and id(opt) == self.lead_optimizer:
            # the slice is full: the loop stops before the step that would end a step (another
            # optimizer's after the lead's, Muon's AdamW, is the iteration's tail)
            self.rec.stop_pending()
        self._watch_updates = False  # torch's step hooks run: no update goes unseen
        self._versions_at_backward = None
        key = id(opt)
        source = type(opt).__name__
        # inside another's step() (not its closure): a wrapper's own optimizer (ZeRO's, Lookahead's base)
        inner = bool(self._opt_tokens) and not self._closure_depth
        if key not in self._run_optimizers and not (inner and key in self.inner_optimizers):
            if key not in self.inner_optimizers:
                self.optimizers[key] = type(opt).__name__
                self._stepping.add(opt)
                self.rec.optimizers.add(opt)
            if inner:  # part of the wrapper's step: no second optimizer (its count makes losses and notes)
                self.inner_optimizers[key] = self._opt_tokens[-1][1]
            else:
                self.inner_optimizers.pop(key, None)
                self._run_optimizers.add(key)
                if opt not in self._ordinals:  # (a replaced lead stepping again is no new optimizer)
                    n = self._type_counts[source] = self._type_counts.get(source, 0) + 1
                    self._ordinals[opt] = n
                self.rec.optimizer_count = len(self._run_optimizers)
                if self.lead_optimizer is None:
                    self._set_lead(opt)
        if not self._opt_tokens:
            self._closure_evals = 0
        elif inner and key == self.lead_optimizer:
            self._lead_inside = True
        self._opt_tokens.append((self.rec.enter("optimizer", source), source))
        # A closure (LBFGS, Lightning's automatic optimization) runs the loop's forward and
        # backward inside step(): it is wrapped so that its time is theirs, not the optimizer's.
        if "closure" in kwargs:
            if callable(kwargs["closure"]):
                return args, {**kwargs, "closure": self._wrap_closure(kwargs["closure"])}
        elif len(args) > 1 and callable(args[1]):  # args = (optimizer, closure, ...)
            return (args[0], self._wrap_closure(args[1]), *args[2:]), kwargs
        return None

    def _wrap_keras_step(self, fn: Any) -> Any:
        """A Keras optimizer's update (``keras_optimizers``), the outermost call: the step hooks
        torch.optim's ``step()`` runs, around it, on the optimizer's torch.optim-shaped view."""
        probe, rec = self, self.rec

        def keras_step(opt: Any, *args: Any, **kwargs: Any) -> Any:
            if _compiling() or threading.get_ident() != rec.thread_id or probe._keras_depth:
                return fn(opt, *args, **kwargs)
            shaped = keras_optimizers.view(opt)
            probe._opt_pre(shaped, (shaped,), {})  # type: ignore[arg-type]
            probe._keras_depth += 1
            try:
                out = fn(opt, *args, **kwargs)
            finally:
                probe._keras_depth -= 1
            shaped.refresh()  # (variables Keras built at this first update)
            probe._opt_post(shaped, (shaped,), {})  # type: ignore[arg-type]
            return out

        return skipped_by_dynamo(functools.update_wrapper(keras_step, fn))

    def _wrap_foreign_step(self, fn: Any) -> Any:
        """The step of an optimizer that is no ``torch.optim.Optimizer`` (``OPTIMIZER_STEPS``),
        between the phase probe's step hooks, as torch.optim runs its global ones around a step."""
        probe = self

        def step(opt: Any, *args: Any, **kwargs: Any) -> Any:
            changed = probe._opt_pre(opt, (opt, *args), kwargs)
            if changed is not None:  # (a closure wrapped)
                args, kwargs = tuple(changed[0][1:]), changed[1]
            out = fn(opt, *args, **kwargs)
            probe._opt_post(opt, (opt, *args), kwargs)
            return out

        return skipped_by_dynamo(functools.update_wrapper(step, fn))

    def _wrap_closure(self, closure: Any) -> Any:
        probe = self

        def closure_(*args: Any, **kwargs: Any) -> Any:
            rec = probe.rec
            if threading.get_ident() != rec.thread_id or not probe._opt_tokens:
                return closure(*args, **kwargs)
            sources = [s for _, s in probe._opt_tokens]
            rec.exit(probe._opt_tokens[0][0])  # the step's own work pauses while the closure runs
            probe._closure_depth += 1
            probe._closure_evals += 1
            try:
                return closure(*args, **kwargs)
            finally:
                probe._closure_depth -= 1
                probe._opt_tokens[:] = [(rec.enter("optimizer", s), s) for s in sources]

        closure_.__wrapped__ = closure  # type: ignore[attr-defined]
        return skipped_by_dynamo(closure_)

    def _opt_post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if (_dynamo_traces() or ((_compiler._is_compiling_flag or _cm._foreign_at_start) and _compiling())
                or threading.get_ident() != self.rec.thread_id or not self._opt_tokens):
            return
        self.rec.exit(self._opt_tokens.pop()[0])
        self._opt_posts += 1
        self.losses._updated = True  # (LossSums.updated, inlined) the gradients went into an update: a zero_grad() now throws none away
        own_batch = False  # a batch handed out since the last step() of any optimizer (stepping on its own)
        lead_inside = False
        if not self._opt_tokens:
            handouts = len(self.rec.handouts)
            own_batch, self._opt_handouts = handouts > self._opt_handouts, handouts
            lead_inside, self._lead_inside = self._lead_inside, False
        if id(opt) != self.lead_optimizer and not self._opt_tokens and not self.rec.explicit_steps:
            change = None
            if lead_inside:
                self._wraps_lead(opt)
            else:
                change = self._replaces_lead(opt)
            if change is not None:
                self.lead_changes.append(change)
                old = self._lead_ref() if self._lead_ref is not None else None
                if old is not None:
                    self._replaced[old] = change  # its later step() calls are counted there
                self._run_optimizers.discard(self.lead_optimizer or 0)  # back at its next step(), if any
                self.rec.optimizer_count = len(self._run_optimizers)
                self._set_lead(opt)
                self._sharer_at = self._lead_steps + 1  # its own step, counted below: a sharer's last
        if id(opt) == self.lead_optimizer and not self._opt_tokens and not self.rec.explicit_steps:
            self._lead_steps += 1
            self._lead_own_batch = own_batch
            # step() twice per iteration (nothing between: no batch, zero_grad, forward or
            # backward) is one step, not two; a step with only other work before it (a loop
            # that sleeps, or calls the model through code tpkit does not see) is a step
            if not self._worked and self._ever_worked and self.rec.step_ends:
                self.merged_steps += 1
                return
            if self.rec._open.get("backward"):
                # an optimizer per parameter, stepped as its gradient is ready: the step ending here
                # had split the backward across two steps (phases summed to 124-129% of a step) and
                # the slice's stop left the other parameters' updates undone
                self._step_in_backward = opt
                self.steps_in_backward += 1
                return
            self._end_step(opt)

    def _set_lead(self, opt: torch.optim.Optimizer) -> None:
        """``opt``'s step() ends the steps from now on; the one it replaces never takes the lead back."""
        old = self._lead_ref() if self._lead_ref is not None else None
        self.lead_optimizer = id(opt)
        self._lead_ref = weakref.ref(opt)
        self._lead_params = {id(p) for g in opt.param_groups for p in g["params"]}
        self._lead_rivals = weakref.WeakSet([old] if old is not None else [])
        self._lead_sharers = weakref.WeakSet()
        self._sharer_at = None
        self._rival_at = weakref.WeakKeyDictionary()

    def _wraps_lead(self, opt: torch.optim.Optimizer) -> None:
        """``opt``'s step() stepped the lead inside it: ``opt`` wraps it (Lookahead, ZeRO), so it is the
        loop's one optimizer, and it ends the steps from this step() on, this one included; the lead
        it wraps is its inner optimizer, no second one and no lead change for the notes.

        The lead had stepped on its own before: torch hooks a class's step() in
        ``Optimizer.__init__`` or at the first ``zero_grad()``, and a wrapper that skips
        ``Optimizer.__init__`` (timm's Lookahead) steps unhooked until its first ``zero_grad()``,
        so the step() inside it had looked like one standing alone and took the lead. Told as a
        new optimizer replacing it (``_replaces_lead``, at its second step()), the wrapper's first
        step() had ended no step: the slice's second step held two iterations (8 samples for 4,
        the two losses summed), and only in the first profile of a process (the hook stays)."""
        self._run_optimizers.discard(self.lead_optimizer or 0)
        self.inner_optimizers[self.lead_optimizer or 0] = type(opt).__name__
        self.rec.optimizer_count = len(self._run_optimizers)
        self._set_lead(opt)

    def _replaces_lead(self, opt: torch.optim.Optimizer) -> _LeadChange | None:
        """Whether ``opt``, another optimizer than the lead, stepping on its own (not inside another's
        step: SAM's or Lookahead's base optimizer), takes the lead now (the change, for the notes);
        None: it does not. The lead is meant to be the optimizer that steps once per iteration.

        A loop that makes a new optimizer partway (fine-tuning: the head first, then everything; a
        head replaced, with its optimizer) steps the old one no more: its steps had ended no step
        (30 step() calls read 3 steps, "the loop ended before the slice was full"). So ``opt`` takes
        the lead where the lead is gone, or where ``opt`` steps a parameter the lead holds (asked
        once) and the lead did not step between ``opt``'s last step and this one. Optimizers that
        step side by side (a GAN's D and G, Muon and AdamW, one per parameter in gradient hooks)
        hold parameters of their own, and those that share some with the lead and step beside it
        (a multi-task loop's per-task optimizers over a shared encoder, a Reptile-style meta step
        after inner steps) see the lead step between theirs, so the lead keeps ending the steps.
        Taking the lead at its first step had swapped it inside the first iteration of such loops
        (a half-iteration step of 0 samples). The price: the new lead's first step() ends no step,
        so its first iteration and its second may be one step (said in ``notes()``).

        An optimizer of parameters of its own takes the lead where it steps twice with a batch
        handed out between and no step of the lead's, and the lead's last update had a batch of
        its own (one handed out since the step() of any optimizer before it): the lead then steps
        less often than once an iteration (a slow optimizer stepped every 4th iteration before the
        one stepping every iteration, whose first step() came after it: one step had held 4
        iterations), or no more (a stage switching to other parameters). A batch read, not a
        forward, tells the iterations apart: a GAN's G stepped twice per iteration (a forward
        between) keeps D, which steps once, as the lead. A lead whose update had no batch of its
        own is stepped once per iteration with the others' batches inside it: a WGAN's generator
        stepped first, on noise, then 3 critic steps each on a batch of its own, keeps the lead (the
        critic had taken it at its second step: a step of one critic batch, 16 samples, for the
        loop's iteration of 3, 48). A loop whose batches tpkit does not see keeps the first lead;
        optimizers stepped in turn (each every other iteration) too: one step is then two
        iterations, one of each."""
        lead = self._lead_ref() if self._lead_ref is not None else None
        if lead is None:
            name = self.optimizers.get(self.lead_optimizer or 0, "optimizer")
            return _LeadChange(self.rec.step_index, type(opt).__name__, name, freed=True)
        replaced = self._replaced.get(opt) if self._replaced else None
        if replaced is not None:
            replaced.later += 1
        between, handouts = False, len(self.rec.handouts)
        if handouts:  # (no batch seen yet: none can lie between two steps; two weak-dict look-ups saved)
            prev = self._rival_at.get(opt)
            self._rival_at[opt] = (self._lead_steps, handouts)
            between = prev is not None and prev[0] == self._lead_steps and handouts > prev[1]
        if opt not in self._lead_rivals:
            if opt not in self._lead_sharers:
                if not any(id(p) in self._lead_params for g in opt.param_groups for p in g["params"]):
                    self._lead_rivals.add(opt)
                else:
                    self._lead_sharers.add(opt)
            # no step of the lead's since the last step() of an optimizer sharing its parameters (this
            # one's or one made just before it: an optimizer made anew every iteration while the old
            # ones stay referenced, by a list or accelerate's prepare(), had ended 1 step in 8)
            if opt in self._lead_sharers:
                if self._sharer_at == self._lead_steps:
                    return self._change(opt, lead, shared=True, batch_between=between)
                self._sharer_at = self._lead_steps
        if between and self._lead_own_batch:
            return self._change(opt, lead, shared=opt in self._lead_sharers, batch_between=True)
        return None

    def _name_apart(self, change: _LeadChange, new: torch.optim.Optimizer, old: torch.optim.Optimizer) -> None:
        """Where the two optimizers of a change are of one type (two SGDs), which of that type each
        was to step ("second SGD", "first SGD") and the new one's parameter count, for the note:
        one naming both "the SGD" told them not apart."""
        if change.new != change.old:
            return
        for attr, opt in (("new_name", new), ("old_name", old)):
            n = self._ordinals.get(opt)
            if n is not None:
                setattr(change, attr, f"{_ordinal(n)} {change.new}")
        change.new_params = sum(p.numel() for g in new.param_groups for p in g["params"])

    def _change(self, opt: torch.optim.Optimizer, lead: torch.optim.Optimizer, shared: bool,
                batch_between: bool) -> _LeadChange:
        """A change decided at ``opt``'s second step() with none of the lead's between; whether the
        step it ends holds more iterations than the one before (batches handed out; outermost
        forward passes where the slice saw no batch) is kept for its note."""
        rec = self.rec
        change = _LeadChange(rec.step_index, type(opt).__name__, type(lead).__name__, shared=shared,
                             batch_between=batch_between)
        self._name_apart(change, opt, lead)
        if rec.handouts:
            now, before = _tail_counts(rec.handouts, 3, 2, rec.step_index)
        else:
            now, before = _tail_counts(rec._spans, SPAN_FIELDS, 5, rec.step_index, phase="forward")
        change.merged = now > before
        return change

    def lead_phrase(self) -> str:
        """Whose step() ends the steps, for the note on several optimizers (``slice._phase_meta``)."""
        beside = [c for c in self.lead_changes if c.later]
        if not beside:
            return "the first one's step()"
        c = beside[-1]
        return (f"the {c.new_name}'s step() from the slice's step {c.step + 1} on (the {c.old_name}'s before it: "
                "see the note on that change)")

    def _lead_notes(self) -> list[str]:
        """One note per kind of lead change (new optimizer's type, why), with a count where the
        loop changed it again and again (an optimizer made anew every iteration). Each says only
        what happened: whether the old lead stepped again after the change (a replacement, or one
        stepping less often), and whether the step the change ended merged two iterations."""
        kinds: dict[tuple[str, str, bool], list[_LeadChange]] = {}
        for c in self.lead_changes:
            replaced = c.freed or (c.shared and not c.later)  # a new optimizer replacing the lead
            if c.freed:
                why = f"the {c.old} before it was freed"
            elif replaced:
                why = f"it updates parameters the {c.old} before it held (that one stepped no more)"
            else:
                read = "a batch read and " if c.batch_between else ""
                old = c.old_name
                why = f"it stepped twice with {read}no step() of the {old}'s between, and the {old}, which ended "
                why += (f"the steps before, stepped {c.later} more time(s) after that: the {old} steps less often, "
                        "so its step() is now part of the step it falls in" if c.later
                        else "the steps before, stepped no more")
            name = c.new
            if not replaced and c.new_params is not None:  # (one type: which one, and its size)
                name = f"the {c.new_name} to step, {c.new_params:,} parameters"
            kinds.setdefault((name, why, replaced), []).append(c)
        out = []
        for (name, why, replaced), changes in kinds.items():
            steps = [c.step + 1 for c in changes]
            merged = sum(c.merged for c in changes)
            tail = ""
            if merged:
                some = "" if merged == len(changes) else f"in {merged} of these changes "
                tail = (" Its first step() ended no step: tpkit tells an optimizer that takes the lead from one "
                        f"stepping beside it at its second step(), so {some}its first two iterations are one step")
            who = "a new optimizer" if replaced else "another optimizer"
            if len(changes) == 1:
                like = " (one made partway, as fine-tuning's next stage does)" if replaced else ""
                out.append(f"{who} ({name}) ends the steps from the slice's step {steps[0]} on (warmup "
                           f"steps counted): {why}{like}.{tail}")
            else:
                like = " (an optimizer made anew, as a loop making one every iteration does)" if replaced else ""
                out.append(f"{who} ({name}) took over ending the steps {len(changes)} times, at the slice's "
                           f"steps {steps[0]} to {steps[-1]} (warmup steps counted): each time {why}{like}.{tail}")
        return out

    def _end_step_in_backward(self) -> None:
        """The step the lead optimizer stepped inside backward ends, once no backward is open."""
        opt = self._step_in_backward
        if opt is not None and not self.rec.is_open("backward"):
            self._step_in_backward = None
            self._end_step(opt)

    def _patch_late(self) -> None:
        """Patch the ``SAVERS`` (``save``) and ``AVERAGERS`` (``optimizer``) whose module is
        imported now (nothing is imported here): called at install and at each step's end where a
        module was imported since (a length compared, a step). A loop importing its EMA class
        inside the slice (``from diffusers.training_utils import EMAModel`` in its training
        function) had its updates read other; ``mlflow.pytorch`` is loaded lazily at its first
        use (``import mlflow`` makes it a lazy module), so ``log_model`` had been save only where the
        loop imported ``mlflow.pytorch`` itself (the call that loads it stays other)."""
        self._modules_seen = len(sys.modules)
        now = tuple(e for e in self._late_left if e[1][0] in sys.modules)
        if now:
            self._late_left = tuple(e for e in self._late_left if e[1][0] not in sys.modules)
            for phase, place in now:
                self._patch_each((place,), lambda fn, module, owner, attr, phase=phase:
                                 self._wrap_whole(fn, phase, f"{owner or module}.{attr}"))

    def _end_step(self, opt: torch.optim.Optimizer | None) -> None:
        rec = self.rec
        self._worked = False
        if self._late_left and len(sys.modules) != self._modules_seen:
            self._patch_late()
        self._versions_at_backward = None
        if not rec.framework_looked:
            rec.framework_looked = True
            rec.framework = find_trainer(sys._getframe(1))
        try:
            rec.end_step()  # may raise StopSlice: the step is complete, parameters updated
        except StopSlice:
            # Only a step past the full slice (a trainer that keeps stepping: slice.Profile._stop;
            # a plain loop stops at its next training action instead, after its own zero_grad()).
            # The loop stops right after optimizer.step(), before its own zero_grad():
            # the update has consumed the gradients, so drop them as the loop would have,
            # or the next slice's first backward would add onto stale ones. So for every
            # optimizer the loop steps (Muon's and AdamW's pair: the second had not stepped yet,
            # and its gradients were left in place).
            # As the loop drops them: a loop that keeps its gradient tensors
            # (zero_grad(set_to_none=False), or p.grad.zero_() of its own) gets them zeroed;
            # one that sets them to None (zero_grad(), p.grad = None) gets None.
            # With no optimizer seen (an update compiled or by hand), the trained models'.
            owners: list[Any] = [o for o in (opt, *self._stepping.live()) if o is not None]
            if opt is None:
                owners += [m for m in self.models.live() if id(m) in rec.trained_modules]
            for each in dict.fromkeys(owners):
                zero_grad = type(each).zero_grad
                plain = getattr(zero_grad, "__wrapped__", zero_grad)
                try:
                    try:
                        plain(each, set_to_none=self._grads_to_none if self._grads_to_none is not None
                              else self._none_before_backward)
                    except TypeError:  # one without set_to_none (fastai's: it zeroes them in place)
                        plain(each)
                except Exception:  # noqa: BLE001 - an optimizer's own zero_grad must not replace the stop
                    pass
            raise

    # -- updates no optimizer hook saw ------------------------------------------------------
    def _first_grad_is_none(self) -> bool:
        """Whether the first trained parameter's ``.grad`` is None (how a loop that calls no
        zero_grad() drops its gradients), True where none is known."""
        trained = self.rec.trained_modules
        for model in self.models.live():
            if id(model) in trained:
                for p in model.parameters():
                    if p.requires_grad:
                        return p.grad is None
        return True

    def _note_versions(self, tensors: Any = None) -> None:
        """At a backward's exit: the version counters of parameters the backward gave a gradient
        (an in-place update bumps them; a backward, a forward and zero_grad() do not), of an
        optimizer the loop zeroes where one is known (a partly frozen model: the first of the
        model's may be one no optimizer holds), and each such optimizer's progress. Where neither
        is known (a step compiled whole: its forward and optimizer unseen), a parameter the loss
        ``tensors`` was computed from."""
        if self.rec.explicit_steps or not self._watch_updates:
            return
        if self._sentinel_models != len(self.models) + len(self.rec.optimizers) or not self._sentinels:
            self._sentinel_models = len(self.models) + len(self.rec.optimizers)
            self._sentinels = self._pick_sentinels()
            if not self._sentinels and self.compiled_step and isinstance(tensors, torch.Tensor):
                self._sentinels = _graph_leaf(tensors)
        self._versions_at_backward = [p._version if (p := r()) is not None else -1 for r in self._sentinels]
        self._progress_at_backward = self._optimizers_progress()
        self._handouts_at_backward = len(self.rec.handouts)
        self._zeroed_since_backward = False

    def _pick_sentinels(self) -> list[Any]:
        """Weak references to the parameters whose version counters tell an update: the first with
        a gradient in each group of the optimizers the loop zeroes, else in each trained model."""
        picked: list[Any] = []
        for opt in self.rec.optimizers.live():
            for group in opt.param_groups:
                first = next((p for p in group["params"] if p.grad is not None), None)
                if first is not None:
                    picked.append(weakref.ref(first))
        if picked:
            return picked
        trained = self.rec.trained_modules
        for model in self.models.live():
            if id(model) in trained:
                # one the backward gave a gradient (an unused layer's is never updated)
                first = next((p for p in model.parameters() if p.requires_grad and p.grad is not None), None)
                if first is not None:
                    picked.append(weakref.ref(first))
        return picked

    def _optimizers_progress(self) -> dict[int, tuple[int, int]]:
        """Per optimizer the loop zeroes (by id): how many states, and the version counter of the
        first one's first tensor (Adam's ``step``, SGD's momentum: a compiled step updates it in
        place). One first seen since is compared with an empty state (``_advanced``)."""
        out = {}
        for opt in self.rec.optimizers.live():
            state = opt.state
            first = next(iter(state.values()), None) if state else None
            tensor = next((v for v in first.values() if isinstance(v, torch.Tensor)), None) \
                if isinstance(first, dict) else None
            out[id(opt)] = (len(state), tensor._version if tensor is not None else -1)
        return out

    def _advanced(self) -> bool:
        """Whether an optimizer the loop zeroes advanced since the last backward (one the loop
        first zeroed since then: whether it holds any state: a plain SGD step keeps none)."""
        before = self._progress_at_backward
        return any(before.get(key, (0, -1)) != now for key, now in self._optimizers_progress().items())

    def _batch_coming(self) -> None:
        if self._versions_at_backward is not None and threading.get_ident() == self.rec.thread_id:
            self._unseen_update(at_batch=True)

    def _compiled_backward(self) -> None:
        """At the slice's first backward: whether it came from a torch.compile'd function (the
        whole step compiled: dynamo runs ``loss.backward()`` eagerly at a graph break), and which.
        In such a step the update runs in compiled graphs, and neither a batch nor a forward of
        the loop's may be seen after it (the batches a list's, the forward a graph of dynamo's):
        an update seen at a backward's start (no ``zero_grad()`` after it) ends the step there."""
        if self.compiled_step is None:
            self.compiled_step = _compiled_caller(sys._getframe(2))
            if self.compiled_step:
                self.rec.meta["compiled_step"] = self.compiled_step
        elif self._versions_at_backward is not None:
            self._unseen_update(at_batch=True)

    def _forward_coming(self, args: tuple, kwargs: dict) -> None:
        """A top-level forward: a loop that read its next batch before the update (a prefetch)
        has it end the step here (at the read, the parameters had not changed yet); so does one
        that hands out no batch tpkit sees, given a new input (not the tensor the forward before
        the backward was given: SAM's second pass reuses it)."""
        new_input = False
        if not self.rec.handouts:
            ref, now = self._last_input, _input_ref(args, kwargs)
            new_input = now is not None and ref is not None and ref() is not now()
        self._unseen_update(at_batch=False, new_input=new_input)

    def _unseen_update(self, at_batch: bool, new_input: bool = False) -> None:
        """Before the loop's next batch (or the forward on a batch read since the backward): the
        parameters changed since the last backward with no optimizer.step() seen (dynamo inlines
        torch's step hooks into a ``torch.compile``'d step, where tpkit's return at once; an
        optimizer that is no ``torch.optim.Optimizer``; an update by hand): the step ended there.
        With the step compiled, no step had been recorded and the slice never ended. Only an
        update ends it: the gradients were dropped since (zero_grad(), ``p.grad = None``) or an
        optimizer the loop zeroes advanced; a change with the gradients still there is no update
        (an eager loop clamping its weights after each accumulated backward before its first
        step), nor one before a second pass on the same batch (SAM's perturbation). A loop that
        hands out no batch tpkit sees (made with ``torch.randn`` or indexed from a tensor in the
        loop) had recorded no step at all: its step ends at the next forward given a new input
        tensor, or at one after an optimizer the loop zeroes advanced (a fixed batch); a plain SGD
        step (no state) on a fixed batch stays unseen (the run says to call ``tp.step()``)."""
        versions = self._versions_at_backward
        if versions is None or self._opt_tokens or not self._watch_updates or self.rec.explicit_steps:
            return
        same_batch = not at_batch and len(self.rec.handouts) <= self._handouts_at_backward
        if same_batch and self.rec.handouts:
            return  # a forward on the same batch (SAM's second pass)
        sentinels = [r() for r in self._sentinels]
        if [p._version if p is not None else -1 for p in sentinels] == versions:
            return
        dropped = self._zeroed_since_backward or any(p is not None and p.grad is None for p in sentinels)
        advanced = self._advanced()
        if not dropped and not advanced:
            return
        if same_batch and not (new_input or advanced):
            return  # no batch handed out, the forward given the same input: SAM's second pass
        self._versions_at_backward = None
        self.unseen_updates += 1
        self.losses.updated()
        self.losses.cancel_reset()  # a zero_grad() after the update was no reset of the step's gradients
        self._end_step(None)

    # -- AMP ----------------------------------------------------------------------------------
    def _wrap_scale(self, fn: Any) -> Any:
        """``GradScaler.scale(loss)``: remember the unscaled loss for the backward that follows."""
        probe = self

        def scale(scaler: Any, outputs: Any) -> Any:
            out = fn(scaler, outputs)
            if (out is not outputs and isinstance(outputs, torch.Tensor) and outputs.numel() == 1
                    and not _compiling() and threading.get_ident() == probe.rec.thread_id):
                probe._scaled = (weakref.ref(out), outputs.detach())  # until the backward that follows
            return out

        scale.__wrapped__ = fn  # type: ignore[attr-defined]
        scale.__doc__ = fn.__doc__
        return skipped_by_dynamo(scale)

    def _wrap_scaler_step(self, fn: Any, update: Any) -> Any:
        """``GradScaler.step(opt)``: a step whose update the scaler skipped (inf/NaN gradients,
        so ``opt.step()`` never ran) still ends the loop's step, marked ``skipped``."""
        probe = self

        def step(scaler: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            rec = probe.rec
            if threading.get_ident() != rec.thread_id or _compiling():
                return fn(scaler, optimizer, *args, **kwargs)
            if rec.stop_pending is not None and id(optimizer) == probe.lead_optimizer:
                rec.stop_pending()  # the slice is full: the loop stops before this step (the scaler untouched)
            before = probe._opt_posts
            try:
                out = fn(scaler, optimizer, *args, **kwargs)
                if probe._opt_posts == before and not probe._opt_tokens and not rec.explicit_steps:
                    key = id(optimizer)
                    if key not in probe.optimizers:
                        probe.optimizers[key] = type(optimizer).__name__
                        if probe.lead_optimizer is None:
                            probe._set_lead(optimizer)
                    if key == probe.lead_optimizer:
                        probe._lead_steps += 1
                        rec.skipped.add(rec.step_index)
                        probe.skipped_steps += 1
                        probe._end_step(optimizer)
                return out
            except StopSlice:
                # A trainer stepping past its full slice stops inside the step (slice.Profile._stop),
                # before its own scaler.update(): without it the scaler keeps this step's state
                # and the next step() would not unscale the gradients.
                update(scaler)
                raise

        step.__wrapped__ = fn  # type: ignore[attr-defined]
        step.__doc__ = fn.__doc__
        return skipped_by_dynamo(step)

    # -- wrappers ---------------------------------------------------------------------------
    def _wrap_phase(self, fn: Any, phase: str, source: str, to_none: bool | None = None) -> Any:
        """``to_none``: how a ``zero_grad`` drops the gradients where its arguments do not say
        (fastai's zeroes them in place); None: torch's ``set_to_none``, True by default."""
        rec, probe = self.rec, self
        reset = source == "zero_grad"

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if (_dynamo_traces() or ((_compiler._is_compiling_flag or _cm._foreign_at_start) and _compiling())
                    or threading.get_ident() != rec.thread_id):
                return fn(*args, **kwargs)
            probe._worked = True  # zero_grad: a new iteration's work (see _opt_post)
            if reset:
                probe._zeroed_since_backward = True
                if probe._watch_updates and isinstance(args[0], torch.optim.Optimizer):
                    # an optimizer whose step hooks may never run (compiled): the memory probe's
                    # look at its state needs it (its momentum had read other)
                    rec.optimizers.add(args[0])
                if not probe.losses._updated:  # (its test that matters after an update, inlined)
                    probe.losses.reset(rec.step_index)
                # how this loop drops its gradients, for the stop to drop them alike
                probe._grads_to_none = bool(kwargs.get("set_to_none", args[1] if len(args) > 1 else True)) \
                    if to_none is None else to_none
            token = rec.enter(phase, source)
            try:
                out = fn(*args, **kwargs)
            finally:
                rec.exit(token)
            if reset and probe._versions_at_backward is not None and probe.compiled_step:
                # a compiled step's zero_grad(), run eagerly at a graph break after its compiled
                # update: the step ends here (no forward of the loop's is seen to end it at)
                probe._unseen_update(at_batch=True)
            return out

        return skipped_by_dynamo(functools.update_wrapper(wrapper, fn))

    def _wrap_backward(self, fn: Any) -> Any:
        """backward phase; a one-element tensor being backpropagated is (part of) the step's
        loss: see ``_loss_of``."""
        rec, probe = self.rec, self

        def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
            if _dynamo_traces() or ((_compiler._is_compiling_flag or _cm._foreign_at_start) and _compiling()):
                return fn(tensors, *args, **kwargs)
            tid = threading.get_ident()
            if tid != rec.thread_id and not probe._adopt(tid, at_step=False):
                return fn(tensors, *args, **kwargs)
            if probe.compiled_step is None or (probe.compiled_step and probe._versions_at_backward is not None):
                probe._compiled_backward()  # (a compiled step: its last update may end a step here)
            if rec.stop_pending is not None and not rec.training_sources:
                rec.stop_pending()  # the slice is full (and no loader read stops it): before this backward
            probe._worked = probe._ever_worked = probe._backward_seen = True
            if not isinstance(tensors, (torch.Tensor, list, tuple)):
                with contextlib.suppress(TypeError):  # (not iterable: torch says what is wrong)
                    tensors = tuple(tensors)  # any iterable torch takes (dict.values()): read once, passed on
            if probe._grads_to_none is None:
                probe._none_before_backward = probe._first_grad_is_none()
            if probe._closure_depth == 0 or probe._closure_evals <= 1:
                probe._add_losses(tensors, args, kwargs)
            if probe._metric_outputs:
                probe._metric_losses(tensors)
            token = rec.enter("backward", "autograd")
            raised = True
            try:
                out = fn(tensors, *args, **kwargs)
                raised = False
            finally:
                rec.exit(token)
                if not probe._opt_tokens and probe._watch_updates and not rec.explicit_steps:
                    probe._note_versions(tensors)  # (its own first test, inlined: a frame less a step)
                if raised and probe._step_in_backward is not None:
                    # a hook raised after an optimizer stepped in it: the step ends here all the
                    # same (a loop that catches it goes on to its next iteration; the pending
                    # step had held two), and the loop's exception is the one that propagates
                    with contextlib.suppress(StopSlice):
                        probe._end_step_in_backward()
            if probe._step_in_backward is not None:
                probe._end_step_in_backward()  # may raise StopSlice: every hook's update is done
            return out

        backward.__wrapped__ = fn  # type: ignore[attr-defined]
        backward.__doc__ = fn.__doc__
        return skipped_by_dynamo(backward)

    def _wrap_grad(self, fn: Any) -> Any:
        """``torch.autograd.grad`` outside forward, backward and optimizer is backward time (a
        gradient penalty's pass); its outputs are gradients, never the step's loss."""
        rec, probe = self.rec, self

        def grad(*args: Any, **kwargs: Any) -> Any:
            if (_compiling() or threading.get_ident() != rec.thread_id or rec.is_open("forward")
                    or rec.is_open("backward") or rec.is_open("optimizer") or rec.is_open("eval")
                    or rec.is_open("save")):
                return fn(*args, **kwargs)
            if rec.stop_pending is not None and not rec.training_sources:
                rec.stop_pending()  # the slice is full (and no loader read stops it): before this pass
            probe.grad_calls += 1
            token = rec.enter("backward", "autograd.grad")
            try:
                return fn(*args, **kwargs)
            finally:
                rec.exit(token)

        return skipped_by_dynamo(functools.update_wrapper(grad, fn))

    def _add_losses(self, tensors: Any, args: tuple, kwargs: dict) -> None:
        """The step's loss from what goes through backward: a one-element tensor, or each of a
        sequence of them (``torch.autograd.backward([l1, l2])`` backpropagates their sum) when no
        gradients weigh them. Anything else (a per-sample loss vector with ``gradient=``) is
        counted, for the run to say why such steps have no loss (they read NaN with no word)."""
        if isinstance(tensors, torch.Tensor):
            if tensors.numel() == 1:
                self.losses.add(self.rec.step_index, self._loss_of(tensors))
                return
        elif (isinstance(tensors, (list, tuple)) and tensors and not (args and args[0] is not None)
                and kwargs.get("grad_tensors") is None
                and all(isinstance(t, torch.Tensor) and t.numel() == 1 for t in tensors)):
            for t in tensors:
                self.losses.add(self.rec.step_index, self._loss_of(t))
            return
        self.rec.unscalar_backwards += 1

    def _loss_of(self, tensor: torch.Tensor) -> torch.Tensor:
        """The loss behind a tensor being backpropagated: the unscaled loss when it came out
        of ``GradScaler.scale``. (Only a closure's first evaluation in a step counts: LBFGS
        re-evaluates it, and its step() returns the first.)"""
        scaled = self._scaled
        if scaled is not None:
            self._scaled = None
            if scaled[0]() is tensor:
                return scaled[1]
        fn = tensor.grad_fn  # (static_scale's first test, inlined: a frame less a step)
        if fn is None or type(fn).__name__ != "MulBackward0":
            return tensor
        scale = static_scale(tensor)
        if scale:
            self.static_scaled[scale] = self.static_scaled.get(scale, 0) + 1
            return tensor.detach() / scale
        return tensor

    def _wrap_read_ahead(self, fn: Any) -> Any:
        """accelerate's ``DataLoaderShard`` and ``DataLoaderDispatcher`` (a Trainer's loader over an
        ``IterableDataset``: each step had counted the next step's batch) read one batch ahead of
        the one they yield: its
        samples (and the batch the memory probe counts as ``data``) are the batch it hands to
        the loop, when it hands it over; the inner loader's reads stay ``data_wait``."""
        probe = self

        def __iter__(loader: Any) -> Any:
            inner = fn(loader)
            if probe.installed and threading.get_ident() == probe.rec.thread_id:
                probe.rec.accelerate_loader = True  # the loop is accelerate's (capture/build.py: its losses)
                probe.rec.source_loaders[id(inner)] = id(loader)
            yielded = False
            # (read once an epoch: a read through accelerate's __getattr__ at every batch)
            workers = getattr(loader, "num_workers", -1)
            while True:
                mine = probe.installed and threading.get_ident() == probe.rec.thread_id
                # the slice is full (Profile._stopping): the loop stops before it reads on, unless the
                # loader handed out its epoch's last batch (accelerate's end_of_dataloader, set as it
                # reads ahead past it; a new epoch's first read still stops): the loop then ends by
                # itself, as with a DataLoader's last batch (it had been stopped there instead)
                if (mine and probe.rec.stop_pending is not None
                        and not (yielded and getattr(loader, "end_of_dataloader", False) is True)):
                    probe.rec.stop_before_read(id(inner), id(loader))
                probe._read_ahead += mine
                try:
                    batch = next(inner)
                except StopIteration:
                    return
                finally:
                    probe._read_ahead -= mine
                if mine:
                    handed_out(probe.rec, batch, workers, id(inner))
                yielded = True
                yield batch

        __iter__.__wrapped__ = fn  # type: ignore[attr-defined]
        __iter__.__doc__ = fn.__doc__
        return skipped_by_dynamo(__iter__)

    def _wrap_fetcher(self, fn: Any, hands_out: bool) -> Any:
        """Lightning's ``_PrefetchDataFetcher``: over a loader with no length (an
        ``IterableDataset``) it reads one batch ahead, at ``__iter__`` and at each ``__next__``. The
        batch counted is the one ``__next__`` returns, when it returns it (each epoch's first step
        had counted two batches and its last none: 16, 8, 8, 0 for 8 a step); the reads stay
        ``data_wait``."""
        probe = self

        def fetch(fetcher: Any) -> Any:
            mine = probe.installed and threading.get_ident() == probe.rec.thread_id
            probe._read_ahead += mine
            try:
                out = fn(fetcher)
            finally:
                probe._read_ahead -= mine
            if mine and hands_out:
                batch = out[0] if isinstance(out, tuple) and len(out) == 3 else out  # (batch, batch_idx, loader_idx)
                handed_out(probe.rec, batch, _fetcher_workers(fetcher), id(fetcher))
            return out

        return skipped_by_dynamo(functools.update_wrapper(fetch, fn))

    def _wrap_next(self, fn: Any, source: str) -> Any:
        rec, probe = self.rec, self

        def __next__(it: Any) -> Any:
            tid = threading.get_ident()
            if tid != rec.thread_id and not probe._adopt(tid, at_step=False):
                return fn(it)
            waiting = rec._open.get("data_wait")  # (read inside another's wait: tp.watch over a DataLoader)
            if not waiting and probe._versions_at_backward is not None:  # (_batch_coming, inlined)
                probe._unseen_update(at_batch=True)
            key = loader_key(it)
            key = rec.key_alias.get(key, key)
            if rec.stop_pending is not None and not _handed_all(it):
                # the slice is full: the loop stops before it reads its training loader's next
                # batch (no batch taken, no worker's RNG drawn); an epoch's end still ends its loop
                rec.stop_before_read(key, id(it), dataset=loader_dataset(it),
                                     epoch_start=getattr(it, "_num_yielded", None) == 0)
            if waiting:
                return fn(it)
            probe._worked = True  # a batch read: a new iteration (see _opt_post)
            token = rec.enter("data_wait", source)
            try:
                batch = fn(it)
            finally:
                rec.exit(token)
            if not probe._read_ahead:  # else the reading-ahead loader hands it over later
                if key not in rec.source_datasets:
                    rec.source_datasets[key] = loader_dataset(it)
                handed_out(rec, batch, getattr(it, "_num_workers", -1), key)
            return batch

        __next__.__wrapped__ = fn  # type: ignore[attr-defined]
        return skipped_by_dynamo(__next__)

    def _wrap_whole(self, fn: Any, phase: str, source: str,
                    when: Callable[[tuple, dict], bool] | None = None) -> Any:
        """A call in the loop's thread that is ``phase`` as a whole: a checkpoint written
        (``torch.save``, a trainer's save: counted as ``other`` it had made a Trainer saving every
        few steps read OVERHEAD-BOUND, with advice about Python and logging), or a trainer's
        evaluation (its metrics had been ``other`` too). Inside a wait for data it is that wait's:
        tpkit's loader pickles a batch it cannot lay out in shared memory (a dataclass), and a
        tensor pickles through ``torch.save`` (44.5 ms of a 1354.7 ms wait had read as saving).
        ``when(args, kwargs)``: only the calls it says (``EVALUATORS_WHEN``)."""
        rec = self.rec

        def whole(*args: Any, **kwargs: Any) -> Any:
            if (_dynamo_traces() or ((_compiler._is_compiling_flag or _cm._foreign_at_start) and _compiling())
                    or threading.get_ident() != rec.thread_id or rec._open.get(phase)
                    or rec._open.get("data_wait") or (when is not None and not when(args, kwargs))):
                return fn(*args, **kwargs)
            token = rec.enter(phase, source)
            try:
                return fn(*args, **kwargs)
            finally:
                rec.exit(token)

        return skipped_by_dynamo(functools.update_wrapper(whole, fn))

    def _wrap_trace(self, fn: Any, source: str) -> Any:
        """TorchScript's tracing in the loop's thread (``TRACERS``): a ``schema.JIT_TRACE`` span, and
        the module calls inside it pass straight to torch as a forward's inner calls do (the
        thread is marked inside an outermost call for the trace's length): no forward, no
        evaluation call, nothing more per module call. TensorBoard's ``add_graph`` traces the
        model so, in eval mode: it had read as an evaluation inside the slice."""
        rec = self.rec

        def trace(*args: Any, **kwargs: Any) -> Any:
            tid = threading.get_ident()
            if _compiling() or tid != rec.thread_id or rec.is_open(JIT_TRACE):
                return fn(*args, **kwargs)
            token = rec.enter(JIT_TRACE, source)
            was = module_calls.inside()
            try:
                module_calls.set_inside(tid)
                return fn(*args, **kwargs)
            finally:
                module_calls.set_inside(was)
                rec.exit(token)

        return skipped_by_dynamo(functools.update_wrapper(trace, fn))

    def _wrap_shutdown(self, fn: Any, source: str) -> Any:
        """A DataLoader iterator's ``_shutdown_workers`` where the loop dropped it before its end:
        ``data_wait``, with the loader it belongs to (``Recorder.shutdowns``), so that an
        evaluation loader's shutdown is the evaluation's when the Run is built (a validation
        loader dropped at its epoch's length, as ignite's evaluator does, or left by ``break``:
        its workers' shutdown had read as the training's data_wait, 0.056 s of its 0.064 s).
        At an epoch's end it runs inside the last ``next()``, whose wait it is already."""
        rec = self.rec

        def shutdown(it: Any, *args: Any, **kwargs: Any) -> Any:
            if _compiling() or threading.get_ident() != rec.thread_id or rec.is_open("data_wait"):
                return fn(it, *args, **kwargs)
            key = loader_key(it)
            token = rec.enter("data_wait", source)
            rec.shutdowns += (rec.opened_at(token), rec.key_alias.get(key, key))
            try:
                return fn(it, *args, **kwargs)
            finally:
                rec.exit(token)

        return skipped_by_dynamo(functools.update_wrapper(shutdown, fn))

    def _patch_each(self, places: tuple[tuple[str, str, str], ...], wrap: Callable[..., Any]) -> None:
        """Patch each ``(module, owner, attribute)`` of ``places`` with ``wrap(fn, module, owner,
        attribute)``: only those the loop imported (nothing is imported here), and only an owner's
        own attribute, not an inherited one (an empty owner: the module's function)."""
        for module, owner, attr in places:
            target = getattr(sys.modules.get(module), owner, None) if owner else sys.modules.get(module)
            fn = vars(target).get(attr) if target is not None else None
            if callable(fn):
                self._patched.set(target, attr, wrap(fn, module, owner, attr))

    def _patch_pipelines(self) -> None:
        """diffusers' pipelines (``hook_places.DIFFUSION_PIPELINE``): each subclass's own
        ``__call__`` is an ``eval`` span whole (``_wrap_whole``), those made before the slice and
        those made inside it (diffusers imports a pipeline's module at its first use: the loop's
        ``diffusers.DDPMPipeline`` inside the slice had stayed training's forward), through an
        ``__init_subclass__`` on the base while the probe is in. Nothing where the loop did not
        import diffusers (nothing is imported here)."""
        base = getattr(sys.modules.get(DIFFUSION_PIPELINE[0]), DIFFUSION_PIPELINE[1], None)
        if not isinstance(base, type):
            return

        def wrap(cls: type) -> None:
            fn = vars(cls).get("__call__")
            if callable(fn):
                self._patched.set(cls, "__call__", self._wrap_whole(fn, "eval", f"{cls.__name__}.__call__"))

        for cls in subclasses(base):
            wrap(cls)
        if "__init_subclass__" not in vars(base):
            owner: type = base

            def made(cls: type, **kwargs: Any) -> None:
                super(owner, cls).__init_subclass__(**kwargs)  # type: ignore[arg-type]
                if self.installed:
                    wrap(cls)

            self._patched.set(base, "__init_subclass__", classmethod(made))

    def _wrap_compiled_step(self, fn: Any) -> Any:
        """Lightning's ``Strategy.training_step`` (``COMPILED_STEPS``): ``forward`` when the
        LightningModule was compiled whole; otherwise its module calls are the forward, as ever."""
        rec, probe = self.rec, self

        def training_step(strategy: Any, *args: Any, **kwargs: Any) -> Any:
            module = getattr(strategy, "lightning_module", None)
            if (module is None or getattr(module, "_compiler_ctx", None) is None or _compiling()
                    or threading.get_ident() != rec.thread_id or rec.is_open("forward")):
                return fn(strategy, *args, **kwargs)
            if torch.is_grad_enabled() and module.training and id(module) not in rec.trained_modules:
                rec.trained_modules.update(_same_model(module))
            probe.models.add(module)
            probe._worked = probe._ever_worked = True
            token = rec.enter("forward", f"{type(module).__name__}.training_step (compiled)")
            try:
                return fn(strategy, *args, **kwargs)
            finally:
                rec.exit(token)

        return skipped_by_dynamo(functools.update_wrapper(training_step, fn))

    def _wrap_trainer_run(self, fn: Any) -> Any:
        """A trainer's ``train()`` / ``fit()`` (``TRAINER_RUNS``)."""
        rec, probe = self.rec, self

        def run(trainer: Any, *args: Any, **kwargs: Any) -> Any:
            if _compiling() or threading.get_ident() != rec.thread_id:
                return fn(trainer, *args, **kwargs)
            if rec.slice_steps is None:
                rec.run_starts.append(perf_counter_ns())  # its setup: capture/setups.py
            failed = True
            try:
                out = fn(trainer, *args, **kwargs)
                failed = False
                return out
            finally:
                probe._stopped_run_returned(trainer, failed)

        return skipped_by_dynamo(functools.update_wrapper(run, fn))

    def _stopped_run_returned(self, trainer: Any, failed: bool = False) -> None:
        rec, fw = self.rec, self.rec.framework
        if rec.thread_id != threading.get_ident():
            return  # the slice ended already (a run it left running on)
        if failed and rec.slice_steps is None:
            # its unfinished iteration fed no step: a run tried again (auto_find_batch_size) starts afresh
            rec.samples = 0
            while rec.failed_forwards and rec.failed_forwards[-1] == rec.step_index:
                del rec.failed_forwards[-3:]  # their batches are out of the step's samples already
            self.losses.discard(rec.step_index)
        if rec.slice_steps is not None:
            if fw is not None and fw.stop_requested and fw.trainer is trainer and rec.stopped_run_returned is not None:
                rec.stopped_run_returned()  # the run the slice stopped: the probes come out now
            return
        if not self._run_optimizers:
            return  # it trained no step (a run that failed at once, a nested search)
        self.trainer_runs += 1
        self.run_ends.append(perf_counter_ns())
        self.lead_optimizer = self._lead_ref = None
        self._most_in_past_runs = self.most_optimizers
        self._run_optimizers = set()
        rec.framework_looked = False  # the next run's trainer is looked for at its first step's end

    def _wrap_join(self, fn: Any, enter: bool) -> Any:
        """DDP's ``Join`` context (uneven inputs across ranks): the slice may not end inside it
        with an exception (``_stop``); when the loop it ran on leaves it, the probes come out."""
        rec, inside = self.rec, self._joins

        def join(ctx: Any, *args: Any) -> Any:
            if enter:
                out = fn(ctx, *args)
                if threading.get_ident() == rec.thread_id:
                    inside.add(id(ctx))
                    rec.joins += 1
                return out
            try:
                return fn(ctx, *args)
            finally:
                if id(ctx) in inside:
                    inside.discard(id(ctx))
                    rec.joins -= 1
                    if rec.thread_id == 0 and not rec.joins and rec.stopped_run_returned is not None:
                        rec.stopped_run_returned()  # the slice ended inside it: the probes come out now

        return skipped_by_dynamo(functools.update_wrapper(join, fn))

    def _wrap_unprofiled(self, fn: Any, note: Callable[[tuple, float], str]) -> Any:
        """A call during which the probes ignore the loop (``SEARCHES``, ``LAUNCHERS``): its steps
        are none of the slice's and no stop ends it; a process forked inside it inherits the probes
        paused. Afterwards the run's notes say ``note(args, seconds)``."""
        rec, probe = self.rec, self

        def unprofiled(*args: Any, **kwargs: Any) -> Any:
            if _compiling() or threading.get_ident() != rec.thread_id or probe._paused:
                return fn(*args, **kwargs)
            probe._paused = True
            tid, rec.thread_id = rec.thread_id, 0  # no thread has ident 0: every probe ignores the loop
            t0 = perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                rec.thread_id = tid
                probe._paused = False
                rec.note(note(args, (perf_counter_ns() - t0) / 1e9))

        return skipped_by_dynamo(functools.update_wrapper(unprofiled, fn))

    def _search_note(self, what: str) -> Callable[[tuple, float], str]:
        """What a trainer's search (``SEARCHES``) is in the run: its time is ``other`` of the step it falls in."""
        rec = self.rec
        return lambda _args, seconds: (
            f"{what} ran inside the slice ({seconds:.3f} s), unprofiled: its training steps search a setting and "
            f"are none of the slice's; its time is other of the slice's step {rec.step_index + 1}, warmup steps counted")

    def _launch_note(self, package: str) -> Callable[[tuple, float], str]:
        """What a launch of processes that train (``LAUNCHERS``) is in the run."""
        def note(args: tuple, seconds: float) -> str:
            self.launches += 1
            start = getattr(args[0], "_start_method", "spawn") if args else "spawn"
            how = "forked" if start == "fork" else "started"
            return (f"{package} ran the training in processes it {how} ({seconds:.3f} s; start method '{start}', as "
                    "strategy='ddp_spawn', 'ddp_fork' or 'ddp_notebook' do), which tpkit does not profile: they trained as without "
                    "tpkit, and this process recorded no step. To profile each rank, run the script with "
                    "strategy='ddp' (Lightning starts the other ranks by running the script again) or under "
                    "torchrun, each rank with the same fixed warmup (docs/MULTI_NODE.md)")

        return note

    def _wrap_iter(self, fn: Any, source: str) -> Any:
        """``iter(loader)``: a DataLoader with workers starts them here (forks them, or resets
        persistent ones), each epoch; the loop waits for its data meanwhile. Counted as
        ``data_wait`` of the step it falls in (it had been ``other``: a 2-worker loader restarted
        every epoch lost ~44% of its data wait)."""
        rec, probe = self.rec, self

        def __iter__(loader: Any) -> Any:
            tid = threading.get_ident()
            if tid != rec.thread_id and not probe._adopt(tid, at_step=False):
                return fn(loader)
            key, dataset = rec.source_key(loader_key(loader), loader), loader_dataset(loader)
            if rec.stop_pending is not None:  # the slice is full: no new epoch of its training loader starts
                rec.stop_before_read(key, id(loader), dataset=dataset, epoch_start=True)
            if rec.is_open("data_wait"):
                return fn(loader)
            token = rec.enter("data_wait", f"{source}.__iter__")
            rec.restarts += (perf_counter_ns(), key)
            rec.source_datasets[key] = dataset
            if isinstance(loader, _dl.DataLoader):
                rec.loader_settings[key] = loader_settings(loader)
            try:
                return fn(loader)
            finally:
                rec.exit(token)

        return skipped_by_dynamo(functools.update_wrapper(__iter__, fn))

    def _wrap_h2d(self, fn: Any, source: str, always: bool) -> Any:
        rec = self.rec

        def move(self_: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if (_compiling() or threading.get_ident() != rec.thread_id or self_.device.type != "cpu"
                    or not (always or _leaves_host(args, kwargs)) or rec.is_open("h2d")):
                return fn(self_, *args, **kwargs)
            token = rec.enter("h2d", source)
            try:
                return fn(self_, *args, **kwargs)
            finally:
                rec.exit(token)

        return skipped_by_dynamo(functools.update_wrapper(move, fn))


def _handed_all(it: Any) -> bool:
    """Whether a DataLoader iterator over a map-style dataset has handed out its epoch's every
    batch (its next ``next()`` reads nothing and ends the loop); False where it cannot tell."""
    try:
        return it._dataset_kind == _dl._DatasetKind.Map and it._num_yielded >= len(it)
    except Exception:  # noqa: BLE001 - another iterator (torchdata's), a sampler with no length
        return False


def _waits_for_current_thread(tid: int, max_frames: int = 64) -> str:
    """``"join"`` or ``"start"`` where thread ``tid`` is now inside that method of the calling
    thread, else ``""``. Only ``join`` waits for the thread's work: ``start`` returns as soon as
    the thread runs."""
    me = threading.current_thread()
    f = sys._current_frames().get(tid)
    n = 0
    while f is not None and n < max_frames:
        code = f.f_code
        if code.co_name in ("join", "start") and code.co_filename == threading.__file__:
            return code.co_name if frame_self(f) is me else ""
        f, n = f.f_back, n + 1
    return ""


def _graph_leaf(tensor: torch.Tensor, limit: int = 256) -> list[Any]:
    """A weak reference to the first parameter (a leaf given a gradient) found in ``tensor``'s
    autograd graph, within ``limit`` nodes; none where there is none."""
    todo, seen = [tensor.grad_fn], 0
    while todo and seen < limit:
        node = todo.pop(0)
        seen += 1
        if node is None:
            continue
        leaf = getattr(node, "variable", None)  # an AccumulateGrad node
        if isinstance(leaf, torch.Tensor) and leaf.grad is not None:
            return [weakref.ref(leaf)]
        todo.extend(fn for fn, _ in getattr(node, "next_functions", ()))
    return []


def _grad_nodes(out: Any) -> list[int]:
    """The ids of the autograd nodes that made a module call's output (a tensor, or a mapping or
    sequence of them, one level: a ``MetricCollection``'s dict): what a backward through it would
    run. Ids, not the nodes: held, the nodes kept the graphs of up to 16 metric calls alive (an
    evaluation with grad left on: 16 inputs of 4 MiB and their activations, against 1 without
    tpkit). A freed node's id taken by a node of a later graph can only make one metric call read
    forward."""
    values = [out] if isinstance(out, torch.Tensor) else list(out.values()) if isinstance(out, dict) \
        else list(out) if isinstance(out, (list, tuple)) else []
    return [id(v.grad_fn) for v in values if isinstance(v, torch.Tensor) and v.grad_fn is not None]


def _input_ref(args: tuple, kwargs: dict) -> Any:
    """A weak reference to the tensor leading a forward's input (``batches._sized``'s), None where
    it has none. Weak and by object, not by address: a batch made anew often reuses the freed
    one's memory."""
    try:
        tensor = batches._sized(args[0] if args else kwargs)[1]
        return weakref.ref(tensor) if isinstance(tensor, torch.Tensor) else None
    except Exception:  # noqa: BLE001 - an input tensor tpkit cannot read: none
        return None


#: What dynamo names the functions that resume a compiled frame after a graph break.
_RESUME_PREFIX = "torch_dynamo_resume_in_"


def _compiled_caller(frame: Any, max_frames: int = 16) -> str:
    """The torch.compile'd function that ``frame`` (or a caller) runs, as ``name (file:line)``, or
    "" where none is: the first frame outside torch is one dynamo runs when it is a function
    dynamo resumes after a graph break, or one torch.compile's wrapper called."""
    torch_dir = torch.__file__.rsplit("/", 1)[0] + "/"
    n = 0
    while frame is not None and n < max_frames:
        code = frame.f_code
        if not code.co_filename.startswith(torch_dir):
            name = code.co_name
            if name.startswith(_RESUME_PREFIX):
                name = name[len(_RESUME_PREFIX):].rsplit("_at_", 1)[0]
            elif not _dynamo_entry(frame.f_back):
                return ""
            return f"{name} ({code.co_filename.rsplit('/', 1)[-1]})"
        frame, n = frame.f_back, n + 1
    return ""


def _dynamo_entry(frame: Any) -> bool:
    """Whether ``frame`` is the wrapper torch.compile put around a function it compiles (its
    callee is a frame dynamo compiled). ``torch.compiler.disable``'s wrapper lives in the same
    file (torch/_dynamo/eval_frame.py) and runs its function eagerly: an eager loop whose
    backward was in a disabled helper had read as a step compiled whole (meta['compiled_step'],
    COMPUTE-BOUND "the compiled step"). Both wrappers hold their context as ``self``."""
    if frame is None or not frame.f_code.co_filename.endswith("_dynamo/eval_frame.py"):
        return False
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    disable = getattr(eval_frame, "DisableContext", None)
    try:
        ctx = frame.f_locals.get("self")
    except Exception:  # noqa: BLE001 - a frame whose locals cannot be read: taken as compiled
        return True
    return not (disable is not None and isinstance(ctx, disable))


def _move_hook(handle: Any, last: bool) -> None:
    """Put the hook of ``handle`` (one of torch's global optimizer step hooks, kept in an ordered
    table run front to back) at its table's back (``last``) or front. Its removal is unchanged
    (by key); the others keep their order. Nothing is written when it is there already (a warm
    loop pays one look at the table's end a step)."""
    table = handle.hooks_dict_ref() if handle is not None else None
    if not isinstance(table, OrderedDict) or handle.id not in table:
        return
    end = next(reversed(table)) if last else next(iter(table))
    if end != handle.id:
        table.move_to_end(handle.id, last=last)


def _hook_recompiles(since_us: int) -> int:
    """Compilations dynamo began after ``since_us`` (wall clock, us) because a guard on torch's
    tables of optimizer step hooks failed (tpkit's joined them), read from its compilation records."""
    dynamo_utils = sys.modules.get("torch._dynamo.utils")
    if dynamo_utils is None:
        return 0
    try:
        records = dynamo_utils.get_compilation_metrics()
    except Exception:  # noqa: BLE001 - another torch
        return 0
    return sum(1 for r in records if (getattr(r, "start_time_us", 0) or 0) >= since_us
               and "_global_optimizer_" in str(getattr(r, "recompile_reason", "") or ""))


def _graph_breaks() -> int:
    """Graph breaks dynamo counted so far in this process (0 when dynamo was never imported)."""
    dynamo_utils = sys.modules.get("torch._dynamo.utils")
    if dynamo_utils is None:
        return 0
    return int(sum(dynamo_utils.counters["graph_break"].values()))


# tpkit's bookkeeping runs with no frame of its own compiled by dynamo, nor any it calls
# (compiling.skip_own_frames): where a wrapper runs eagerly at one of dynamo's graph breaks (inside
# a torch.compile'd training step), dynamo had compiled each method it called as a frame of user
# code. The wrappers, made at install, are marked again then (their callees, the loop's code, are
# compiled as ever), and so is the forward's handler, which calls the loop's module.
skip_own_frames(sys.modules[__name__], PhaseProbe, Recorder, WeakRegistry, loss_sums, loss_sums.LossSums, batches)
skipped_by_dynamo(module_calls.set_inside, callees=True)
skipped_by_dynamo(PhaseProbe._outer_call)
skipped_by_dynamo(PhaseProbe._metric_call)
