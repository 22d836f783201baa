"""The slice: start the probes, let the user's loop run, stop it when the slice is full,
take every probe out again, and build the Run.

``tp.profile`` (a context manager) and ``tp.profile_fn`` are the Python API; the magic in
``tpkit.views.magic`` is a thin layer over ``Profile``.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import socket
import sys
import threading
import time
from contextlib import ContextDecorator
from dataclasses import dataclass, field
from types import FrameType
from typing import TYPE_CHECKING, Any, Callable, Iterator, Literal

import numpy as np
import torch

from .._version import __version__
from ..errors import ProfileActiveError, StopSlice, TpkitError
from ..schema import TRACKERS, UNSEEN_OPTIMIZER_NOTE
from . import evaluation, foreign_hooks
from . import recorder as _rec
from .frameworks import find_trainer
from .host import cpu_name, usable_cores
from .interrupts import TermGuard, held_sigint
from .probes.compiling import skipped_by_dynamo
from .probes.cuda_timing import maybe_cuda_timer
from .probes.phases import PhaseProbe

if TYPE_CHECKING:
    from ..run import Run

#: ``--warmup auto`` gives up waiting for step times to settle after this many steps.
WARMUP_AUTO_CAP = 20

#: Steps whose times must agree for ``--warmup auto`` to end (``settled``).
SETTLE_WINDOW = 5

#: Batches a torch DataLoader with workers queues per worker where it names no ``prefetch_factor``.
TORCH_PREFETCH = 2

#: The warmup every rank takes where ``warmup="auto"`` finds a process group of several ranks only
#: after the slice started (Lightning's ``strategy="ddp"`` run from a script makes it inside
#: ``fit``): the same count on every rank, so that all stop at the same step.
RANKS_WARMUP = 5

#: How long the slice's end watches a loop thread that is still alive as the body returns, to
#: tell a loop running on from a thread that ended it (``Profile._still_looping``): a median step,
#: within these bounds (seconds).
LOOP_WATCH_MIN_S, LOOP_WATCH_MAX_S = 0.02, 0.1

_LAST_RUN: Run | None = None


def _innermost(ident: int | None) -> tuple[int, int] | None:
    """Where thread ``ident`` is now: its innermost frame and the instruction in it."""
    frame = sys._current_frames().get(ident) if ident is not None else None
    return None if frame is None else (id(frame), frame.f_lasti)


def _step_caller() -> tuple[int, int, Any] | None:
    """The frame the current step came from (the first outside torch and tpkit, the loop's code
    or a trainer's), as (thread ident, id, code): a walk up a few frames, once per step, for a
    loop in another thread only (``Profile._still_looping``); no reference to the frame is kept."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and str(frame.f_globals.get("__name__", "")).partition(".")[0] in ("tpkit", "torch"):
        frame = frame.f_back
    return None if frame is None else (threading.get_ident(), id(frame), frame.f_code)


def last_run() -> Run | None:
    """The Run of the most recent slice (complete or not), or None."""
    return _LAST_RUN


@dataclass
class SliceConfig:
    """What a slice records and when it stops (the options of ``tp.profile`` and ``%%tp_profile``)."""
    steps: int = 20
    warmup: int | Literal["auto"] = 3
    name: str | None = None
    stop: bool = True  # False: profile until the loop ends (``--no-stop``)
    progress: bool = True
    samples_per_step: int | None = None
    memory: bool = True
    memory_detail: bool = False  # CUDA: keep the largest allocations alive at the peak, with stacks
    clock_hz: float = 20.0
    knobs: dict[str, Any] = field(default_factory=dict)
    save_dir: str | None = None  # save the Run under it (per rank: DIR/rank<k>); env TPKIT_SAVE_DIR
    ops: bool | int = False  # trace operators with torch.profiler in this many measured steps (True: 3)
    # Time collectives: None where the default process group has more than one rank, True at any
    # size (one rank included), False never.
    comm: bool | None = None
    # what the caller set up around the slice, for the run: meta keys (the magic's
    # ``meta["kernels"]``) and notes (e.g. "--kernels on: no module matched a kernel")
    extra_meta: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def validate(self) -> "SliceConfig":
        if not isinstance(self.steps, int) or isinstance(self.steps, bool) or self.steps < 1:
            raise TpkitError(f"steps must be a whole number >= 1, got {self.steps!r}")
        if self.warmup != "auto" and (not isinstance(self.warmup, int) or isinstance(self.warmup, bool)
                                      or self.warmup < 0):
            raise TpkitError(f"warmup must be a whole number >= 0 or 'auto', got {self.warmup!r}")
        if self.samples_per_step is not None and (not _is_count(self.samples_per_step) or self.samples_per_step < 1):
            raise TpkitError(f"samples_per_step must be a whole number >= 1, got {self.samples_per_step!r}")
        if not isinstance(self.clock_hz, (int, float)) or isinstance(self.clock_hz, bool) \
                or not 0 <= self.clock_hz <= 200:
            raise TpkitError(f"clock_hz must be a number of samples per second between 0 (off) and 200, "
                             f"got {self.clock_hz!r}")
        for flag in ("stop", "progress", "memory", "memory_detail"):
            if not isinstance(getattr(self, flag), bool):
                raise TpkitError(f"{flag} must be True or False, got {getattr(self, flag)!r}")
        if self.comm is not None and not isinstance(self.comm, bool):
            raise TpkitError(f"comm must be None (where there is more than one rank), True or False, got {self.comm!r}")
        if not isinstance(self.ops, (bool, int)) or (not isinstance(self.ops, bool) and self.ops < 0):
            raise TpkitError(f"ops must be True/False or a number of steps >= 0 to trace, got {self.ops!r}")
        if self.name is not None and not isinstance(self.name, str):
            raise TpkitError(f"name must be a string, got {self.name!r}")
        return self


class Profile:
    """``with tp.profile(steps=20, warmup=3) as prof: train()`` then ``prof.run``.

    The body stops by itself once ``warmup + steps`` steps are done: a plain loop at its next
    training action after the last step (a private exception, caught here; ``_stopping``). An
    error or Ctrl-C in the body removes every probe, keeps the partial Run (``prof.run``,
    ``tp.last_run()``, marked incomplete) and is re-raised; one raised after the slice was full
    (a ``finally`` failing while the loop stops) is re-raised too, the Run complete.
    """

    def __init__(self, config: SliceConfig) -> None:
        self.config = config.validate()
        self.run: Run | None = None
        self.rec: _rec.Recorder | None = None
        self._probes: list[Any] = []
        self._removed: list[Any] = []
        self._term = TermGuard()  # SIGTERM held while the slice runs and is taken down (interrupts.py)
        self._started = False  # every probe went in (False: the start was interrupted or failed)
        self._ran_on: str | None = None  # the loop's thread, running on as the body returned (_loop_running_on)
        self._slice_tid = threading.get_ident()
        # a loop in another thread: (thread ident, id, code) of the frame its last step came from
        self._step_caller: tuple[int, int, Any] | None = None
        self._bar: Any = None
        self._durations: list[float] = []
        self._last_end_ns = 0
        # --warmup auto: each step's own work (its time less its data waits) and its end (ns), and
        # how many of the recorder's spans were summed into them
        self._own: list[float] = []
        self._ends: list[int] = []
        self._spans_read = 0
        # StopSlice raised into the loop, and of them those raised after the loop had caught the
        # one before and gone on (an ``except BaseException:``, ignite's EXCEPTION_RAISED handler
        # that does not re-raise): ``_count_stop``, ``_swallowed_note``
        self._stops_after_caught = 0
        self._last_stop: StopSlice | None = None
        self.warmup_steps: int | None = config.warmup if config.warmup != "auto" else None
        self.on_step: list[Callable[[int], None]] = []  # extra callbacks (e.g. the tuner's bar)

    # -- life cycle -------------------------------------------------------------------------
    def __enter__(self) -> "Profile":
        running = _rec.active()
        if running is not None:
            raise ProfileActiveError(
                f"a tpkit profile ('{running.name}') is already running; a slice cannot start "
                "inside another. Let the running one finish, or interrupt it, then start again.")
        cfg = self.config
        if cfg.warmup == "auto" and cfg.stop:
            world = _world_size()
            if world > 1:  # each rank would settle after its own count and stop alone: the others hang
                raise TpkitError(
                    f"warmup='auto' is decided by each rank on its own step times, so the {world} ranks of "
                    "this launch could stop at different steps and leave the others waiting in a collective; "
                    "give a fixed warmup (e.g. warmup=5), the same on every rank")
        from .ranks import start_check

        # where a process group is up: the launch's id, and the ranks' steps and warmup compared
        ranks_facts = start_check(cfg.steps, cfg.warmup, cfg.stop)
        # a Profile used again (``with prof:`` twice) starts afresh: the last slice's probes, step
        # times and warmup had carried its notes into the next run and decided its auto warmup
        self.run, self._probes, self._removed, self._durations = None, [], [], []
        self._own, self._ends, self._spans_read = [], [], 0
        self._started, self._ran_on, self._step_caller = False, None, None
        self._slice_tid = threading.get_ident()
        self._term = TermGuard()  # (the last slice's had been tearing down: SIGTERM was only held)
        self.warmup_steps = cfg.warmup if cfg.warmup != "auto" else None
        # (read before the Recorder exists, so that a Ctrl-C in its tens of ms lands before the
        # slice; one while the probes go in keeps the slice's run, below)
        static = _static_meta(cfg)
        rec = self.rec = _rec.Recorder(cfg.name or "run")
        rec.samples_per_step = cfg.samples_per_step
        rec.meta.update(static)
        rec.meta.update(cfg.extra_meta)
        for text in cfg.notes:
            rec.note(text)
        if "launch" in ranks_facts:
            rec.meta["launch"] = ranks_facts["launch"]
        for note in ranks_facts.get("notes", []):
            rec.note(note)
        # the slice's start on the wall clock, to the nanosecond: ranks' timelines line up by it
        rec.meta["start_unix_ns"] = time.time_ns() - (time.perf_counter_ns() - rec.t0_ns)
        rec.step_listeners.append(self._on_step)
        rec.stopped_run_returned = self._after_stopped_run
        self._last_end_ns = rec.t0_ns
        try:
            # A Ctrl-C while a probe installs would land between registering a hook and keeping
            # its handle (or between enabling torch's profiler and marking it on): it is held
            # until every probe is in, then raised, and the teardown below takes them all out.
            with held_sigint("installing its probes (they are all removed)"):
                rec.cuda_timer = maybe_cuda_timer()
                self._probes = [PhaseProbe(rec)]
                self._probes[0].install()
                for probe in _optional_probes(rec, cfg):
                    self._probes.append(probe)
                for probe in self._probes:
                    if hasattr(probe, "follow"):  # probes that act on measured steps learn the warmup
                        probe.follow(lambda: self.warmup_steps)
                if cfg.progress:
                    self._bar = _progress_bar(cfg, self.warmup_steps)
                rec.first_step_ns = self._last_end_ns = time.perf_counter_ns()
                rec.meta["probes_install_s"] = (rec.first_step_ns - rec.t0_ns) / 1e9
                _rec.set_active(rec)
                self._term.install()
                self._started = True
        except BaseException as exc:
            # interrupted (a Ctrl-C held above is raised after the SIGTERM guard went in) or failed
            # while starting: every probe out, the guard given back (it had stayed for good: a later
            # SIGTERM raised tpkit's SystemExit in whatever ran, and never ended the process), and
            # an empty run kept that says so (``tp.last_run()`` and the magic's ``_tp`` had still
            # been the cell before's)
            self._started = False
            self._take_down(exc, at_end=False)
            raise
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        self._take_down(exc, at_end=True)
        return exc_type is not None and issubclass(exc_type, StopSlice)

    def _take_down(self, exc: BaseException | None, at_end: bool) -> None:
        """Every probe out, the run kept (``exc``: what ended the body or the start), then the
        SIGTERM guard given back (a SIGTERM held meanwhile ends the process now, the run kept).
        A Ctrl-C here would leave hooks installed and lose the run: from the moment SIGINT is
        held it waits until the end, and is then raised (tpkit/capture/interrupts.py); one that
        lands before the hold is in (its own first lines) is kept and raised after the same
        take-down, which then runs in full. ``TermGuard.tearing_down`` and the thread check run
        inside the hold: run before it, a Ctrl-C there had skipped the teardown and the run, every
        probe stayed in and every later slice refused to start (ProfileActiveError)."""
        early: KeyboardInterrupt | None = None
        begun = False
        while not begun:
            try:
                with held_sigint():
                    begun = True
                    try:
                        self._term.tearing_down()
                        if at_end:
                            self._ran_on = self._loop_running_on()
                        try:
                            self._teardown()
                        finally:
                            self._finish(exc)
                    finally:
                        self._term.release()
            except KeyboardInterrupt as e:
                if begun:
                    raise
                early = e  # landed before the hold: take everything down, then raise it
        if early is not None:
            raise early

    def _loop_running_on(self) -> str | None:
        """The name of the thread followed as the loop's (``PhaseProbe._adopt``) where it still
        runs as the slice's body returns before the slice was full: a cell that started the
        training thread and never joined it. Every probe ignores that thread from here on (it
        runs on, unprofiled, as after a full slice); None where the loop is the body's own, ended,
        or the slice was full."""
        rec = self.rec
        if rec is None or rec.slice_steps is not None:
            return None
        for probe in self._probes + self._removed:
            thread = probe.loop_thread if isinstance(probe, PhaseProbe) else None
            if thread is not None and thread.is_alive() and thread is not threading.current_thread():
                rec.thread_id = 0  # no thread has ident 0: every probe now ignores the loop (the Run
                # holds the steps until the body returned, whatever the thread does next)
                return thread.name if self._still_looping(thread) else None
        return None

    def _still_looping(self, thread: threading.Thread) -> bool:
        """Whether ``thread`` still runs the loop, not merely lives: watched for up to a median
        step (at least ``LOOP_WATCH_MIN_S``, at most ``LOOP_WATCH_MAX_S``), it must outlive the
        watch and either run Python meanwhile (its innermost frame moved) or be inside the
        frame that called its last step's ``optimizer.step()`` still (a step blocked in one long
        call). A pool's worker that ran the loop and idles in its queue's ``get`` (the body
        waited on ``pool.submit(train).result()``), or a thread finishing its last statement
        after the ``Event`` the body waited on: the loop ended. Both had read as a loop that ran
        on (``body_returned``, incomplete) for a loop that had run to its end inside the slice."""
        ident = thread.ident
        pace = float(np.median(self._durations)) if self._durations else LOOP_WATCH_MAX_S
        deadline = time.perf_counter() + min(LOOP_WATCH_MAX_S, max(LOOP_WATCH_MIN_S, pace))
        first = _innermost(ident)
        moved = False
        while thread.is_alive() and time.perf_counter() < deadline:
            time.sleep(0.002)
            moved = moved or _innermost(ident) != first
        if not thread.is_alive():
            return False
        if moved:
            return True
        caller = self._step_caller
        frame = sys._current_frames().get(ident) if caller is not None and caller[0] == ident else None
        while frame is not None:
            if caller is not None and (id(frame), frame.f_code) == caller[1:]:
                return True
            frame = frame.f_back
        return False

    def _teardown(self, keep: type | None = None, deactivate: bool = True) -> None:
        """Take every probe out (but those of type ``keep``); safe to run twice and after a
        partial start. A probe that fails to stop (with any exception) never keeps the others
        in: all are removed first, then the first failure that was not an ordinary error is
        raised. ``deactivate=False`` leaves the slice active (tpkit's loader, ``tp.watch`` and
        ``tp.step()`` still see a stop pending)."""
        if deactivate and self.rec is not None and _rec.active() is self.rec:
            _rec.set_active(None)
        rec = self.rec
        if rec is not None and rec.framework is not None:
            rec.framework.restore()  # the trainer's own limits, as before the slice
        if rec is not None and rec.cuda_timer is not None and self._probes:
            try:  # the GPU ends the slice's steps while the clock sampler still runs
                rec.cuda_timer.drain()
            except Exception as e:  # noqa: BLE001 - a device error must not keep a probe in
                rec.note(f"waiting for the GPU at the slice's end failed: {e!r}")
        fatal: BaseException | None = None
        kept = []
        while self._probes:
            probe = self._probes.pop()
            if keep is not None and isinstance(probe, keep):
                kept.append(probe)
                continue
            self._removed.append(probe)
            try:
                probe.remove()
            except BaseException as e:  # noqa: BLE001 - every probe must come out first
                if self.rec is not None:
                    self.rec.note(f"{type(probe).__name__} failed to stop cleanly: {e!r}")
                if not isinstance(e, Exception) and fatal is None:
                    fatal = e
        self._probes = kept[::-1]
        if self._bar is not None:
            bar, self._bar = self._bar, None
            try:
                bar.close()
            except Exception:  # noqa: BLE001 - a progress bar never costs the run
                pass
        if fatal is not None:
            raise fatal

    # -- steps ------------------------------------------------------------------------------
    def _on_step(self, raw_step: int, end_ns: int) -> None:
        cfg = self.config
        if threading.get_ident() != self._slice_tid:  # a loop in another thread: where it steps from
            self._step_caller = _step_caller()
        self._durations.append((end_ns - self._last_end_ns) / 1e9)
        self._last_end_ns = end_ns
        if self.warmup_steps is None:  # --warmup auto
            self._own.append(self._durations[-1] - self._read_waits())
            self._ends.append(end_ns)
            done = len(self._durations)
            # a process group may have come up since the slice started (checked only while undecided)
            world = _world_size() if cfg.stop else 1
            if world > 1:
                self._decide_warmup(max(done, RANKS_WARMUP), (
                    f"warmup auto: not used, as the process group came up inside the slice with {world} ranks "
                    "(each rank would settle after its own count and stop at a different step, leaving the "
                    f"others waiting in a collective): every rank took a fixed warmup of "
                    f"{max(done, RANKS_WARMUP)} steps; give warmup=N, the same on every rank, to choose it"))
            else:
                slow = slow_step(self._own, self._durations)
                queue, drained_at = (queue_drain(self.rec, slow, self._ends[slow] if slow >= 0 else 0)
                                     if self.rec is not None else (0, -1))
                after_queue = drained_at is not None and done - SETTLE_WINDOW > drained_at
                if done >= WARMUP_AUTO_CAP:
                    how = "cap reached before step times settled" if after_queue else (
                        f"cap reached while the loader's queue of {queue} batches (num_workers x "
                        "prefetch_factor) could still be draining: the measured steps may be faster "
                        "than its steady pace; give warmup=N past the queue")
                    self._decide_warmup(done, f"warmup auto: ended after {done} steps ({how})")
                elif after_queue and (period := settle_period(self._durations)):
                    self._decide_warmup(done, f"warmup auto: ended after {done} steps (step times settled"
                                        + (f" over every {period} steps" if period > 1 else "")
                                        + (f", after the loader's queue of {queue} batches" if queue else "") + ")")
        if self._bar is not None:
            self._bar.update(1)
        for fn in self.on_step:
            fn(raw_step)
        if cfg.stop and self.warmup_steps is not None and raw_step + 1 >= self.warmup_steps + cfg.steps:
            self._stop(raw_step)

    def _read_waits(self) -> float:
        """Seconds of ``data_wait`` recorded since the last call (the step that just ended): a
        pass over its new spans, while ``--warmup auto`` is undecided only."""
        rec = self.rec
        if rec is None:
            return 0.0
        flat, fields = rec._spans, _rec.SPAN_FIELDS
        start, end = self._spans_read, len(flat) - len(flat) % fields
        self._spans_read = end
        return sum(flat[i + 2] - flat[i + 1] for i in range(start, end, fields) if flat[i] == "data_wait") / 1e9

    def _decide_warmup(self, steps: int, note: str) -> None:
        """``--warmup auto`` is decided: ``steps`` warmup steps, and the run says how."""
        self.warmup_steps = steps
        if self.rec is not None:
            self.rec.note(note)
        if self._bar is not None:
            self._bar.total = steps + self.config.steps
            self._bar.refresh()

    def _stop(self, raw_step: int) -> None:
        """The slice is full: a trainer tpkit recognised ends through its own stop switch
        (capture/frameworks.py); any other loop stops with ``StopSlice`` at its next training
        action (``_stopping``), and a trainer that keeps stepping anyway at once. A loop in
        another thread than the slice's is left to run on, no longer followed: nothing there
        would catch the exception, and the thread may be the user's server or GUI."""
        rec = self.rec
        if rec is None:  # never: steps are recorded only while the slice runs
            raise StopSlice()
        fw = rec.framework
        if rec.slice_steps is None:
            rec.slice_steps = raw_step + 1
            if fw is not None and fw.request_stop(counted=rec.explicit_steps):
                return
            if fw is not None and fw.runs_on():
                rec.thread_id = 0  # every probe now ignores the loop: nothing is raised into the trainer
                rec.note(f"the slice ended after {raw_step + 1} steps; {fw.name} runs on, no longer profiled "
                         "(outside fit it has no switch that ends it early; profile it whole with stop=False, "
                         "--no-stop)")
                # and the probes come out now (here: tp.step(), no hook of theirs is running), so
                # nothing records while the trainer runs on (the allocation counter, torch.profiler)
                with held_sigint():
                    self._teardown()
                return
            if rec.joins:
                # inside DDP's Join (uneven inputs) an exception skips its join protocol: the ranks
                # that joined already wait in collectives that never come (a hang, or a closed
                # connection); the loop runs on to its end, and the probes come out as Join exits
                rec.thread_id = 0  # no thread has ident 0: every probe now ignores the loop
                rec.note(f"the slice ended after {raw_step + 1} steps inside DDP's Join (uneven inputs), where "
                         "stopping the loop would leave the ranks that joined waiting: the loop ran on to its end, "
                         "no longer profiled")
                # every probe but the phase probe comes out now (nothing records on: the allocation
                # stream, the clock sampler); its hooks run this very step (torch iterates them),
                # so it comes out as Join exits, ignoring the loop until then
                with held_sigint():
                    self._teardown(keep=PhaseProbe)
                return
            if "loop_thread" in rec.meta:
                rec.thread_id = 0  # no thread has ident 0: every probe now ignores the loop
                rec.note(f"the slice ended after {raw_step + 1} steps; the loop in thread "
                         f"'{rec.meta['loop_thread']}' runs on, no longer profiled")
                return
            self._stopping()
            return
        raise self._count_stop()

    def _stopping(self) -> None:
        """A plain loop's slice is full, inside its last ``optimizer.step()`` (or ``tp.step()``):
        it stops at its next training action in its thread instead (``Recorder.stop_pending``),
        so that what its iteration runs after the step (a scheduler's step, a step counter, a
        log line, an evaluation) runs as without tpkit. Raised inside the step, the exception had
        skipped that: after a 7-step slice ``StepLR.last_epoch`` read 6, a step counter 6, and
        a notebook training on in the next cell kept its scheduler a step behind the optimizer.
        Every probe but the phase probe (whose hooks see that action) comes out now, so that
        nothing past the slice is recorded (clocks, the allocation stream, collectives)."""
        rec = self.rec
        assert rec is not None  # (only from _stop, which a running slice's steps call)
        try:
            rec.training_sources, rec.last_sources = _training_sources(rec)
        except Exception as e:  # noqa: BLE001 - the stop must come: then at any source's read
            rec.training_sources = rec.last_sources = set(rec.handout_sources) | set(rec.source_loaders.values())
            rec.note(f"telling the training batches' loaders from the others at the slice's end failed ({e!r}): "
                     "the loop stopped at its next read from any loader")
        rec.training_datasets = {rec.source_datasets[s] for s in rec.training_sources if s in rec.source_datasets}
        rec.stop_pending = self._stop_now
        with held_sigint():
            self._teardown(keep=PhaseProbe, deactivate=False)

    def _stop_now(self) -> None:
        """The loop's first training action since its slice was full (``_stopping``): it stops."""
        rec = self.rec
        if rec is not None and rec.joins:
            # it entered DDP's Join since: an exception there would leave the ranks that joined
            # waiting (see _stop); it runs on, and the phase probe comes out as Join exits
            rec.stop_pending = None
            rec.thread_id = 0  # no thread has ident 0: every probe now ignores the loop
            rec.note(f"the slice ended after {rec.slice_steps} steps and the loop entered DDP's Join (uneven "
                     "inputs) before its next step, where stopping it would leave the ranks that joined waiting: "
                     "it ran on to its end, no longer profiled")
            return
        raise self._count_stop()

    def _count_stop(self) -> StopSlice:
        """The StopSlice to raise into the loop now: one raised while none is being handled, after
        an earlier one the loop's code caught (not tpkit's magic: ``StopSlice.handled_by_tpkit``),
        means the loop went on (its next training action stops it again, as ``stop_pending``
        stays set)."""
        last = self._last_stop
        if last is not None and not last.handled_by_tpkit and not isinstance(sys.exc_info()[1], StopSlice):
            self._stops_after_caught += 1
        self._last_stop = _stop_exception(self.rec)
        return self._last_stop

    def _after_stopped_run(self) -> None:
        """What the slice left running at its end has returned (the trainer run it stopped
        through its own switch, a loop inside DDP's Join): the probes come out now, the trainer's
        limits are put back (Lightning's ``max_steps``), and what the cell runs after it (a
        second ``train()``, ``fit()``) runs as without tpkit."""
        rec = self.rec
        if rec is None:
            return
        rec.thread_id = 0  # no thread has ident 0: every probe ignores the loop from here
        with held_sigint():
            self._teardown()

    # -- the Run ----------------------------------------------------------------------------
    def _finish(self, exc: BaseException | None) -> None:
        global _LAST_RUN
        rec, cfg = self.rec, self.config
        if rec is None:
            return
        rec.close_all()
        if rec.slice_steps is not None:
            del rec.step_ends[rec.slice_steps:]  # a trainer that overran its stop: not the slice's
        done = len(rec.step_ends)
        warmup = self.warmup_steps if self.warmup_steps is not None else done  # auto never settled
        meta: dict[str, Any] = {"complete": True, "stopped_by": "slice"}
        if exc is None and rec.slice_steps is not None:
            if rec.framework is not None and rec.framework.stop_requested:
                meta["stopped_through"] = rec.framework.name  # the trainer's own stop, not StopSlice
        elif exc is None and self._ran_on is not None:
            meta.update(complete=False, stopped_by="body_returned")
            rec.note(f"the slice's body returned after {done} steps while the training loop in thread "
                     f"'{self._ran_on}' ran on (the body never waited for it): the Run holds the steps until "
                     "then, and the loop went on unprofiled; join the thread inside the slice (thread.join() "
                     "at the end of the cell or with block), or start the slice inside the thread")
        elif exc is None:
            meta["stopped_by"] = "loop_end"
            if cfg.stop and done < warmup + cfg.steps:
                how = ("its epochs, early stopping or a callback" if getattr(rec.framework, "name", "") == "keras.Model"
                       else "its max_steps, max_time, early stopping or a callback")
                who = f"{rec.framework.name} stopped by itself ({how})" if rec.framework is not None else "the loop ended"
                rec.note(f"{who} after {done} steps, before the slice was full "
                         f"({warmup} warmup + {cfg.steps} steps): the Run holds the steps that happened")
        elif rec.slice_steps is not None and not isinstance(exc, StopSlice):
            # every step of the slice was recorded: the exception is the loop's own, raised after
            # them (a finally or a with block's exit failing while StopSlice unwound the loop, its
            # __context__; or what the iteration ran after its last step); it propagates as usual
            when = ("while tpkit stopped it (in a finally block or a with block's exit)" if _raised_while_stopping(exc)
                    else "after the slice's last step, before tpkit stopped it")
            what = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            if _interrupted(exc):  # Ctrl-C: the user's interrupt, not something the loop raised
                rec.note(f"the loop was interrupted ({what}) {when}; all {done} steps of the slice had completed, "
                         "so the Run is complete; the interrupt was raised as usual")
            else:
                rec.note(f"the loop raised {what} {when}; all {done} steps of the slice had completed, so the "
                         "Run is complete; the exception is the loop's own and was raised as usual")
        elif not isinstance(exc, StopSlice):
            how = ("terminated" if self._term.pending else "interrupt" if _interrupted(exc)
                   else "error")  # terminated: SIGTERM (a launcher stopping the ranks that survived one)
            meta.update(complete=False, stopped_by=how, error=f"{type(exc).__name__}: {exc}")
            if not self._started:
                rec.note(f"the slice was cut short by {type(exc).__name__} while tpkit installed its probes, "
                         "before the loop ran: no step was recorded, and every probe was taken out again")
            else:
                rec.note(f"the slice was cut short by {type(exc).__name__} after {done} steps; "
                         "the Run holds what was recorded")
        returned = exc is None and self._last_stop is not None and not self._last_stop.handled_by_tpkit
        # let it go: its traceback holds the loop's frames, and so its optimizers and loaders, whose
        # threads (an offload optimizer's worker, tpkit's loader's) outlived the slice with it
        self._last_stop = None
        if returned or self._stops_after_caught:
            rec.note(self._swallowed_note("returned" if returned else "stopped" if isinstance(exc, StopSlice) else ""))
        phases = next((p for p in self._removed if isinstance(p, PhaseProbe)), None)
        if done == 0 and self._started and not (phases is not None and phases.says_why_no_step()):
            rec.note(_no_step_note(phases))
        elif (done and rec.explicit_steps and phases is not None and phases.backward_seen and not phases.optimizers
              and not phases.unseen_updates and not phases.compiled_step and phases.trains_weights()):
            # (a compiled step's or an in-place update's own note says why; a frozen model's
            # backward passes, input gradients only, update nothing)
            rec.note(f"the steps ended at tp.step() and backward passes ran, but no optimizer step was seen: "
                     f"{UNSEEN_OPTIMIZER_NOTE}, or it did not step inside the slice (gradients accumulated over "
                     "more iterations than the slice holds); an update's time is then in other_s, not "
                     "optimizer_s, and its state in memory's other, not optimizer_state (where the update is "
                     "your code, wrap it in `with tp.phase(\"optimizer\"):`)")
        if self.warmup_steps is None and done:
            rec.note(f"warmup auto: step times never settled; all {done} steps are flagged warmup")
        for probe in self._removed:
            try:
                if isinstance(probe, PhaseProbe):
                    meta.update(_phase_meta(rec, probe))
                elif hasattr(probe, "meta"):
                    meta.update(probe.meta())
            except Exception as e:  # noqa: BLE001 - one probe's facts never cost the run
                rec.note(f"{type(probe).__name__} could not report its facts: {e!r}")
        if rec.cuda_timer is not None:
            meta.update(rec.cuda_timer.meta())
            # on a GPU the tpkit spans are what the GPU waited for tpkit; this is its host time
            meta["cuda_timing"]["tpkit_host_s"] = rec.own_host_ns / 1e9
        try:
            from .build import build_run  # pandas only once the slice is over (_collect_startup)

            self.run = build_run(rec, warmup, meta)
            for probe in self._removed:
                if hasattr(probe, "table_rows"):  # the ops probe's operator events
                    from ..schema import frame

                    self.run.ops = frame("ops", probe.table_rows(warmup))
        except Exception as e:  # never lose the user's error to a failure of ours
            from ..run import Run

            self.run = Run(meta={"name": rec.name, "complete": False, "notes": [f"building the Run failed: {e!r}"]})
            _LAST_RUN = self.run
            if exc is None or isinstance(exc, StopSlice):
                raise
        from .ranks import finish_rank_run

        finish_rank_run(self.run, cfg.save_dir)  # rank facts into meta; per-rank save; never raises
        from ..store import autosave

        autosave(self.run)  # never raises; a failure is noted on the run
        _LAST_RUN = self.run

    def _swallowed_note(self, end: str) -> str:
        """The note of a stop the loop caught and did not re-raise (``_count_stop``): the Run
        had read ``stopped_by=slice``, complete, with no word, while an ignite handler on
        ``Events.EXCEPTION_RAISED`` had saved an "interrupted" checkpoint and the code after
        ``trainer.run`` had run."""
        again = self._stops_after_caught
        what = [f"tpkit stopped it again at its next training action ({again} time{'s' if again > 1 else ''})"
                ] if again else []
        if end:  # "returned": the body returned after a stop; "stopped": the last one ended it
            what.append("the body then returned without the stop" if end == "returned" else "the last stop ended the body")
        return (f"tpkit stopped the loop after the slice's last step with StopSlice (tpkit.errors.StopSlice), and "
                f"the loop caught it and went on ({'; '.join(what)}): an except BaseException: or bare except:, or a framework's "
                "handler that does not re-raise (ignite's Events.EXCEPTION_RAISED), swallowed the stop, and the code "
                "after it ran as if training had ended or failed (a checkpoint saved as interrupted, a final "
                "evaluation). The Run holds the slice's steps as recorded; re-raise BaseException (or StopSlice) in "
                "such handlers, or profile with tp.profile(stop=False) to let the loop run to its end")


# raised from a wrapper dynamo runs at a graph break (a backward in a step compiled whole): no frame
# of it is compiled (capture/probes/compiling.py)
skipped_by_dynamo(Profile._stop_now, callees=True)


def _no_step_note(phases: PhaseProbe | None) -> str:
    """The run's note on a slice that recorded no step: where backward passes ran, the loop's
    optimizer is one tpkit does not see (never "a loop without an optimizer")."""
    if phases is not None and phases.backward_seen and phases.trains_weights():
        return (f"no step was recorded although backward passes ran: {UNSEEN_OPTIMIZER_NOTE}, so no step ended "
                "at its update; call tp.step() right after each update, at the end of each iteration (in a "
                "framework's fit, in a callback at each batch's end)")
    return ("no step was recorded: tpkit ends a step at each optimizer.step(); in a loop "
            "without an optimizer, call tp.step() at the end of each iteration")


def _stop_exception(rec: _rec.Recorder | None) -> StopSlice:
    """What stops the loop: ``StopSlice``, or inside a fastai fit an exception that is fastai's
    own cancel of the fit as well (``frameworks.FrameworkTrainer.stop_exception``)."""
    fw = rec.framework if rec is not None else None
    return (fw.stop_exception() if fw is not None else None) or StopSlice()


def _raised_while_stopping(exc: BaseException) -> bool:
    """Whether ``exc`` was raised while tpkit's ``StopSlice`` unwound the loop (its context)."""
    seen: set[int] = set()
    ctx = exc.__context__
    while ctx is not None and id(ctx) not in seen:
        if isinstance(ctx, StopSlice):
            return True
        seen.add(id(ctx))
        ctx = ctx.__context__
    return False


def _training_sources(rec: _rec.Recorder) -> tuple[set[int], set[int]]:
    """The sources (``Recorder.handout_sources``) of the slice's training batches, with the
    loaders they read (``Recorder.source_loaders``): those read for evaluation told apart as
    the Run does (capture/evaluation.py); and of them those that handed out the last step's
    training batch. Asked once, when the slice is full."""
    past = rec.slice_steps if rec.slice_steps is not None else len(rec.step_ends)
    hand = rec.handouts
    ev = evaluation.split(rec.spans, hand, rec.no_grad_calls, rec.trained_modules, rec.param_free_modules, past,
                          sources=rec.handout_sources,
                          train_mode_calls=rec.no_grad_train_calls)
    out = {s for k, s in enumerate(rec.handout_sources) if s and k not in ev.handouts and hand[3 * k + 2] < past}
    if not any(s in out and hand[3 * k + 2] == past - 1 for k, s in enumerate(rec.handout_sources)):
        # the last step's batch came from no source tpkit saw (itertools.cycle past a DataLoader's
        # first epoch, a prefetching thread's queue): the loop's next read is not seen either, and
        # waiting for the lead optimizer's next step had run a forward and backward past the slice
        # (BatchNorm's running statistics, the gradients); it stops as a loop with no loader does,
        # at its next trained forward or backward
        return set(), set()
    last = {s for k, s in enumerate(rec.handout_sources) if s in out and hand[3 * k + 2] == past - 1}

    def with_loaders(sources: set[int]) -> set[int]:
        return sources | {rec.source_loaders[s] for s in sources if s in rec.source_loaders}

    return with_loaders(out), with_loaders(last)


def _world_size() -> int:
    """Ranks of this process's launch (1 outside one): its process group's, else the launcher's
    environment."""
    from .ranks import rank_meta

    return int(rank_meta().get("world_size") or 1)


def _optional_probes(rec: _rec.Recorder, cfg: SliceConfig) -> Iterator[Any]:
    """Probes beyond phases (memory, clocks), each installed only when asked for and able;
    each is handed over as soon as it is in, so a later one failing leaves none unowned."""
    for factory in PROBE_FACTORIES:
        probe = factory(rec, cfg)
        if probe is not None:
            yield probe.install()


#: Callables ``(recorder, config) -> probe or None``; a probe has ``install()`` returning
#: itself, ``remove()`` (idempotent) and optionally ``meta() -> dict`` (merged into
#: ``run.meta`` after removal). Memory and clock probes register here.
PROBE_FACTORIES: list[Callable[[_rec.Recorder, SliceConfig], Any]] = []


def _clock_probe(rec: _rec.Recorder, cfg: SliceConfig) -> Any:
    if cfg.clock_hz <= 0:
        return None
    from .probes.clocks import clock_probe  # imported only when sampling is on

    return clock_probe(rec, cfg)


def _memory_probe(rec: _rec.Recorder, cfg: SliceConfig) -> Any:
    if not cfg.memory:
        return None
    from .probes.memory import MemoryProbe  # imported only when memory is tracked

    warmup = WARMUP_AUTO_CAP if cfg.warmup == "auto" else cfg.warmup  # the most steps the slice records
    return MemoryProbe(rec, detail=cfg.memory_detail, steps=cfg.steps + warmup)


PROBE_FACTORIES.append(_memory_probe)


def _offload_probe(rec: _rec.Recorder, cfg: SliceConfig) -> Any:
    from .probes.offload import offload_probe  # imports neither deepspeed nor the optimizer

    return offload_probe(rec, cfg)


PROBE_FACTORIES.append(_offload_probe)


def _rank_watchdog(rec: _rec.Recorder, cfg: SliceConfig) -> Any:
    from .ranks import rank_watchdog  # a thread only in a multi-process launch with a timeout

    return rank_watchdog(rec, cfg)


PROBE_FACTORIES.append(_rank_watchdog)


#: Said in the run when a process group of one rank is up and its collectives are not timed.
ONE_RANK_NOTE = ("one rank in the process group: its collectives have no peer, so they are not timed as "
                 "communication; what they cost locally stays in the phase that runs them (DDP's in "
                 "backward). tp.profile(comm=True) / %%tp_profile --comm on times them anyway")


def _comm_probe(rec: _rec.Recorder, cfg: SliceConfig) -> Any:
    """Collectives, where a process group of more than one rank is up (``cfg.comm`` None), or of
    any size (True); where none is up yet, from the moment one comes up inside the slice. At one
    rank a collective has no peer: nothing is communicated or waited for, and timing it cost a DDP
    step 1-2% (docs/OVERHEAD.md), so the run says it was not."""
    import torch.distributed as dist

    if cfg.comm is False or not dist.is_available():
        return None

    def one_rank() -> bool:
        if cfg.comm is None:
            rec.note(ONE_RANK_NOTE)
        return bool(cfg.comm)

    if not dist.is_initialized():  # a trainer may create it inside the slice (Lightning's fit)
        from .probes.comm import LateCommProbe

        return LateCommProbe(rec, one_rank)
    if dist.get_world_size() == 1 and not one_rank():
        return None
    from .probes.comm import SliceCommProbe

    return SliceCommProbe(rec)


PROBE_FACTORIES.append(_comm_probe)


def ops_steps(ops: bool | int, steps: int) -> int:
    """Measured steps ``--ops`` traces: ``True`` is 3; never more than the slice measures."""
    n = 3 if ops is True else int(ops or 0)
    return min(n, steps)


def _compile_probe(rec: _rec.Recorder, cfg: SliceConfig) -> Any:
    from .probes.compile import CompileProbe  # imports no part of dynamo

    return CompileProbe(rec)


PROBE_FACTORIES.append(_compile_probe)


def _ops_probe(rec: _rec.Recorder, cfg: SliceConfig) -> Any:
    """torch.profiler over the last measured steps, only when ``ops`` asks for it."""
    n = ops_steps(cfg.ops, cfg.steps)
    if n <= 0:
        return None
    from .probes.ops import OpsProbe

    return OpsProbe(rec, n, cfg.warmup if cfg.warmup != "auto" else None, cfg.steps if cfg.stop else None)


PROBE_FACTORIES.append(_ops_probe)
# The clock sampler registers last: installed last and removed first (``_teardown`` pops), so
# its samples end when the slice does, not after the memory probe has turned its allocator
# stream into rows (which can take most of a second after a long slice).
PROBE_FACTORIES.append(_clock_probe)


def _progress_bar(cfg: SliceConfig, warmup: int | None) -> Any:
    from tqdm.auto import tqdm

    total = warmup + cfg.steps if warmup is not None else None
    return tqdm(total=total, desc=f"tpkit {cfg.name or 'run'}", unit="step", leave=False)


def _static_meta(cfg: SliceConfig) -> dict[str, Any]:
    devices = [f"cpu: {cpu_name()} ({os.cpu_count()} cores)"]
    if torch.cuda.is_available():
        devices += [f"cuda:{i}: {torch.cuda.get_device_name(i)}" for i in range(torch.cuda.device_count())]
    return {
        "name": cfg.name or "run",
        "knobs": dict(cfg.knobs),
        "steps_requested": cfg.steps,
        "warmup_requested": cfg.warmup,
        "stop": cfg.stop,
        "samples_per_step": cfg.samples_per_step,
        "devices": devices,
        "versions": {"tpkit": __version__, "torch": torch.__version__, "python": sys.version.split()[0]},
        "host": {"hostname": socket.gethostname(), "platform": platform.platform(),
                 "cpu_count": os.cpu_count(), "usable_cores": usable_cores(),
                 "torch_threads": torch.get_num_threads()},
        "start_time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def _interrupted(exc: BaseException) -> bool:
    """A Ctrl-C, or what a trainer made of one: Lightning ends an interrupted fit with
    ``sys.exit(1)`` raised while handling the KeyboardInterrupt (the run had said "error")."""
    if isinstance(exc, KeyboardInterrupt):
        return True
    return isinstance(exc, SystemExit) and isinstance(exc.__context__, KeyboardInterrupt)


def _optimizer_names(types: dict[int, str], inner: dict[int, str]) -> list[str]:
    """The types of the optimizers the loop stepped, one name per optimizer: one stepped only inside
    another's step() (``PhaseProbe.inner_optimizers``) is named inside its wrapper's,
    ``ZeroRedundancyOptimizer(Adam)``, ``Lookahead(SGD)``; they had read as two optimizers."""
    wrapped: dict[str, set[str]] = {}
    for key, outer in inner.items():
        wrapped.setdefault(outer, set()).add(types[key])
    names: set[str] = set()
    for key, name in types.items():
        if key not in inner:
            names |= {f"{name}({i})" for i in wrapped.get(name, ())} or {name}
    return sorted(names)


def _phase_meta(rec: _rec.Recorder, probe: PhaseProbe) -> dict[str, Any]:
    """Model and optimizer facts the phase probe saw."""
    out: dict[str, Any] = {"optimizers": _optimizer_names(probe.optimizers, probe.inner_optimizers)}
    several = probe.most_optimizers
    if several > 1 and rec.explicit_steps:
        rec.note(f"{several} optimizers stepped; steps end at tp.step() (once it is called, no "
                 "optimizer's step() ends one)")
    elif several > 1 and not probe.steps_in_backward:  # (its note says how steps end then)
        unseen = "" if rec.handouts else (
            "; no batch source was seen, so tpkit cannot tell which optimizer steps once an iteration: where "
            "another steps more often than that one (a slower optimizer stepping first every few iterations), a "
            "step holds several iterations; wrap the batch source in tp.watch (get_batch = tp.watch(get_batch)) "
            "to have each iteration a step")
        rec.note(f"{several} optimizers stepped; steps end at {probe.lead_phrase()}, and a "
                 "step's loss is everything backpropagated since the previous one (with that optimizer "
                 f"stepping before the others' backward, a step holds their losses of the iteration before){unseen}")
    probe.claim_parts()
    for text in probe.notes():
        rec.note(text)
    if probe.skipped_steps:
        out["skipped_steps"] = probe.skipped_steps
    if probe.merged_steps:
        out["merged_optimizer_steps"] = probe.merged_steps
    fw = rec.framework
    trained = fw.model() if fw is not None else None
    if fw is not None:
        out["framework"] = fw.name
    models = [trained] if isinstance(trained, torch.nn.Module) else _trained_models(rec, probe.models.live())
    if models:
        params = {id(p): p for m in models for p in m.parameters()}.values()
        out["model"] = {"class": " + ".join(type(m).__name__ for m in models),
                        "parameters": int(sum(p.numel() for p in params)),
                        "trainable": int(sum(p.numel() for p in params if p.requires_grad))}
        hooks = foreign_hooks.find(models)
        if hooks:
            out["model"]["hooks"] = hooks
            every = foreign_hooks.log_freq(models) if any(name in TRACKERS for name in hooks) else {}
            if every:
                out["model"]["hooks_log_freq"] = every
            rec.note(foreign_hooks.note(hooks, every, len(rec.step_ends)))
    return out


def _trained_models(rec: _rec.Recorder, called: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """The models the loop trained, largest first: each outermost module called in the loop that
    holds parameters an optimizer stepped (where none was seen: that was called with grad in
    training mode) and is no part of another. The two towers of a CLIP-style loop, a multi-task
    loop's models: the largest alone had been the run's model (144 of 257 parameters). A module
    with no parameter (a loss) or none of the stepped ones (a frozen teacher) is none of it; an
    encoder trained in eval mode is. The largest called module where none qualifies."""
    inner = [getattr(m, "_orig_mod", m) for m in called]  # torch.compile's wrapper: the model inside
    stepped = {id(p) for opt in rec.optimizers.live() for group in opt.param_groups for p in group["params"]}
    if stepped:
        trained = [m for m in inner if any(id(p) in stepped for p in m.parameters())]
    else:
        trained = [m for m, c in zip(inner, called) if (id(c) in rec.trained_modules or id(m) in rec.trained_modules)
                   and next(m.parameters(), None) is not None]
    if not trained:
        return [max(inner, key=_size)] if inner else []
    parts = {id(sub) for m in trained for sub in m.modules() if sub is not m}
    return sorted({id(m): m for m in trained if id(m) not in parts}.values(), key=_size, reverse=True)


def _size(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def profile(steps: int = 20, warmup: int | Literal["auto"] = 3, name: str | None = None, *,
            stop: bool = True, progress: bool = True, samples_per_step: int | None = None,
            memory: bool = True, clock_hz: float = 20.0, clocks: bool = True,
            knobs: dict[str, Any] | None = None, memory_detail: bool = False,
            save_dir: str | None = None, ops: bool | int = False, comm: bool | None = None) -> Profile:
    """Profile a slice of a training loop::

        with tp.profile(steps=20, warmup=3, name="baseline") as prof:
            for batch in loader: ...        # stops by itself after 23 optimizer steps, at the
                                            # next iteration's batch read (or forward)
        prof.run.steps

    ``clocks=False`` (or ``clock_hz=0``) turns the clock/power sampler off. ``save_dir`` (or
    ``TPKIT_SAVE_DIR``) saves the Run there, under ``rank<k>`` in a multi-process launch.
    ``ops=3`` (or True) traces operators with torch.profiler in the last 3 measured steps:
    ``run.ops``, and the Ops section (top operators by self time within each phase).
    ``comm`` times collectives (waits as ``comm`` spans, in-flight time behind compute): by
    default where the process group has more than one rank; True at one rank as well; False never.
    """
    return Profile(SliceConfig(steps=steps, warmup=warmup, name=name, stop=stop, progress=progress,
                               samples_per_step=samples_per_step, memory=memory,
                               memory_detail=memory_detail, clock_hz=clock_hz if clocks else 0.0,
                               knobs=dict(knobs or {}), save_dir=save_dir, ops=ops, comm=comm))


def profile_fn(step_fn: Callable[[], Any], steps: int = 20, warmup: int | Literal["auto"] = 3,
               name: str | None = None, **kwargs: Any) -> Run:
    """Call a one-step function until the slice is full and return the Run.

    A call that did not end a step by itself (no optimizer inside, no ``tp.step()``) counts as
    one step; if it returns a scalar (tensor or number) and no backward was seen, that is the
    step's loss.
    """
    prof = profile(steps=steps, warmup=warmup, name=name, **kwargs)
    limit = (WARMUP_AUTO_CAP if warmup == "auto" else int(warmup)) + steps
    with prof:
        rec = prof.rec
        assert rec is not None
        for _ in range(10 * limit + 10):  # a step_fn that never ends a step cannot loop forever
            if prof.warmup_steps is not None and rec.step_index >= prof.warmup_steps + steps:
                break  # stop=False: no StopSlice, but the slice is still warmup + steps calls
            before, losses = rec.step_index, len(rec.losses)
            out = step_fn()
            if len(rec.losses) == losses and _is_scalar(out):
                rec.losses.append((before, out.detach().clone() if isinstance(out, torch.Tensor) else float(out)))
            if rec.step_index == before:
                rec.end_step()
    assert prof.run is not None
    return prof.run


def _is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_scalar(x: Any) -> bool:
    if isinstance(x, torch.Tensor):
        return x.numel() == 1
    return isinstance(x, (int, float)) and not isinstance(x, bool)


class phase(ContextDecorator):
    """Name a part of the step: ``with tp.phase("augment"): ...`` or ``@tp.phase("eval")``.

    Free when no slice runs. Phases nest; a built-in name (e.g. "forward") counts as that
    built-in phase, which marks code that hooks cannot see (a functional model).
    """

    def __init__(self, name: str) -> None:
        if not isinstance(name, str) or not name.strip():
            raise TpkitError("tp.phase needs a non-empty name, e.g. tp.phase('augment')")
        self.name = name
        self._tokens: list[tuple[_rec.Recorder, int] | None] = []

    def __enter__(self) -> "phase":
        rec = _rec.active()
        if rec is not None and threading.get_ident() == rec.thread_id:
            self._tokens.append((rec, rec.enter(self.name, "tp.phase")))
        else:
            self._tokens.append(None)
        return self

    def __exit__(self, *exc: Any) -> None:
        entry = self._tokens.pop() if self._tokens else None
        if entry is not None:
            entry[0].exit(entry[1])


def step() -> None:
    """Mark the end of a step (for loops with no optimizer). Free when no slice runs.

    Once called in a slice, only ``tp.step()`` ends steps; optimizer steps no longer do.
    """
    rec = _rec.active()
    if rec is not None and threading.get_ident() == rec.thread_id:
        if not rec.explicit_steps and rec.idle_since_step():
            # the first tp.step(), right after an optimizer step ended this iteration's step: the
            # same step (it had made an empty one, the first measured step with 0 samples)
            rec.explicit_steps = True
            return
        if rec.stop_pending is not None:
            rec.stop_pending()  # the slice is full: the loop stops here (Profile._stopping)
        rec.explicit_steps = True
        if not rec.framework_looked:  # tp.step() in a trainer's callback: the slice ends through it
            rec.framework_looked = True
            rec.framework = find_trainer(sys._getframe(1))
        rec.end_step()


def slow_step(own: list[float], durations: list[float], window: int = SETTLE_WINDOW) -> int:
    """The last step before the settle window whose own work (``own``: its time less its data
    waits) was much longer than the loop's steady pace (a first step, a compile): over twice the
    window's median own work and longer than the window's median step by more than one step,
    time in which a loader's workers made batches ahead; -1: none."""
    if len(own) <= window:
        return -1
    pace = float(np.median(own[-window:]))
    step = float(np.median(durations[-window:]))
    for i in range(len(own) - window - 1, -1, -1):
        if own[i] > 2 * pace and own[i] - pace > step:
            return i
    return -1


def queue_drain(rec: _rec.Recorder, slow: int, slow_end_ns: int) -> tuple[int, int | None]:
    """``(queue, step)``: the batches the torch DataLoaders the loop read in its last step can hold
    ready (``num_workers`` x ``prefetch_factor``, the deepest of them; 0: none with workers) and the
    last raw step by which each had handed out that many since the slow step ``slow`` (``slow_step``,
    ending at ``slow_end_ns``; None: not yet; -1: nothing to drain). Its workers fill the queue while
    the loop's own work is slow (a first step, a compile), and the loop then takes ready batches at
    its own pace, faster than they are made: step times that look settled there are the drain's,
    not the loader's (1 worker, 8 queued batches of 30 ms and a 600 ms first step: 6 ms steps, 758
    samples/s for a steady 440). ``--warmup auto`` times its settle window after that step, as the
    tuner warms up for ``queued_batches`` (tpkit/views/tuner.py). With no slow step, or a loader
    whose ``iter()`` came after it (its queue starts empty), nothing is drained: the loop's steps
    are its steady ones (a queue deeper than the cap, or than an epoch, had always run to the cap,
    and said the queue "could still be draining"). A loop whose own work is most of the loader's
    pace drains slower than a batch a step, and some of the queue can remain past it. Cost: a pass
    over the slice's handouts at each step end while the warmup is undecided (at most the cap's)."""
    handouts, sources = rec.handouts, rec.handout_sources
    current = rec.step_index - 1  # the step that just ended
    reading = {sources[j] for j in range(len(sources)) if handouts[3 * j + 2] == current}
    last_iter = {rec.restarts[i + 1]: rec.restarts[i] for i in range(0, len(rec.restarts), 2)}
    deepest, drained_at = 0, -1
    for key, settings in rec.loader_settings.items():
        workers = settings.get("num_workers") or 0
        if key not in reading or key not in last_iter or workers <= 0:
            continue
        queue = workers * (settings.get("prefetch_factor") or TORCH_PREFETCH)
        if slow < 0 or last_iter[key] > slow_end_ns:
            continue  # nothing let the workers run ahead of the loop's steady pace
        deepest = max(deepest, queue)
        n, at = 0, None
        for j, src in enumerate(sources):
            if src == key and handouts[3 * j + 2] > slow:
                n += 1
                if n == queue:
                    at = handouts[3 * j + 2]
                    break
        if at is None:
            return deepest, None
        drained_at = max(drained_at, at)
    return deepest, drained_at


#: The longest repeating pattern of step times ``--warmup auto`` recognises (settle_period).
SETTLE_PERIOD_MAX = 4


def settle_period(durations: list[float], window: int = SETTLE_WINDOW, tolerance: float = 0.2) -> int:
    """The shortest period ``p`` (1 to ``SETTLE_PERIOD_MAX``) over which the loop is steady: the
    last ``window`` sums of ``p`` consecutive step times agree within ``tolerance`` of their median;
    0 where none is (the rule of ``--warmup auto``). A period: a loop that logs every other step
    (32 / 57 ms), a loader whose 2 workers hand out in bursts (15 / 145 ms), had never settled
    and run to the cap, its note saying so, though every pair of steps took 88-92 ms."""
    for period in range(1, SETTLE_PERIOD_MAX + 1):
        if len(durations) < window * period + 1:  # the first step always pays one-time costs
            return 0
        last = np.asarray(durations[-window * period:]).reshape(window, period).sum(axis=1)
        med = float(np.median(last))
        if med > 0 and float(last.max() - last.min()) <= tolerance * med:
            return period
    return 0


def settled(durations: list[float], window: int = SETTLE_WINDOW, tolerance: float = 0.2) -> bool:
    """Whether the loop is steady (``settle_period``). Five step times, not three: four flat 80
    ms steps before the loop's 20 ms ones had settled after three of them, and a slow step was
    measured (p95 57 ms for 26)."""
    return settle_period(durations, window, tolerance) > 0
