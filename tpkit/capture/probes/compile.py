"""torch.compile's compilations inside the slice: the ``compile`` phase, and what the run says
about them.

A compiled model compiles at its first call, and again whenever a guard fails (a new input
shape with ``dynamic=None``, a flag that changed, a model put in eval mode). That work runs
inside the call: it had been the forward of the step it fell in (18.8 s of inductor, 3.7 s of
``aot_eager``, in a step of 0.1 s), and inductor's lazy backward compile its backward, with no
word; the shares and the verdict were then about the compiler.

dynamo says when it compiles: ``torch._dynamo.callback.callback_handler`` calls its start and
end callbacks around each outermost compilation (``CallbackTrigger.DYNAMO``: a frame traced;
``LAZY_BACKWARD``: the backward graph compiled at its first run). Each one in the loop's thread
is a ``compile`` span nested in the phase open there (depth: the recorder's open stack), so
``build.exclusive_phase_times`` charges it to ``compile_s`` and takes it out of that phase. The
span runs from when dynamo began (its metrics context opens before the callbacks: it works out
why it recompiles there) to when it finished (its compilation record, written after the end
callback: it collects garbage first); it is recorded after the slice, where the record is. On a
GPU the backward runs in autograd's device thread: a lazy backward compile there while the
loop's backward is open is the loop's. The callbacks are put in with the slice's probes and
taken out with them, exactly (``torch._dynamo.reset()`` clears them: they are put back at the
next step's end). Where dynamo is not imported yet (``torch.compile`` first called inside the
slice), they go in when ``torch.compile(...)`` returns (it imported dynamo), else at the first step's
end: importing it costs seconds, nothing is imported for them. The ``torch.compile(...)`` call itself
is ``compile`` too in the loop's thread (the first imports dynamo: 3-17 s of a first step had been
other). Compilations dynamo recorded in the slice before the callbacks went in (dynamo imported by
something else, an optimizer made in the slice, then compiling before the step's end) are read from
its compilation records after the slice: no record says its thread, so one is the loop's where the
loop was inside a call that could compile then (a forward, a backward or an evaluation call of its
own, or its ``torch.compile(...)`` call), nested in what the loop had open (the first compile had
been all its forward: 2.2 s of a first step, compile_s 0); another thread's compilations (a helper
compiling through a reference taken at import) had been charged to the loop's step as well.

The notes, after the slice: the compilations (which steps, how long, dynamo's recompile reason
from its compilation records), a recompile limit reached (dynamo then runs the frame
uncompiled: no callback says so, its compilation record does), and graph breaks of a model
compiled before the slice (dynamo counts breaks when it compiles a frame, not per call, so the
phase probe's count over the slice is 0 there): they are read from dynamo's resume functions
(``ContinueExecutionCache``), which it makes at each break, keyed by the code that broke.
"""

from __future__ import annotations

import bisect
import os
import sys
import threading
import time
from time import perf_counter_ns
from typing import Any, Callable, NamedTuple

from .. import recorder as _rec
from ..recorder import Recorder
from .compiling import skip_own_frames

COMPILE = "compile"  # the phase (schema.BUILTIN_PHASES)
#: What the run says to do about compilations inside the measured steps.
KNOBS = ("for a new input shape, mark the changing dimension dynamic (torch._dynamo.mark_dynamic(x, dim), or "
         "torch.compile(dynamic=True)) or pad inputs to a few shapes; for an evaluation (grad_mode or training "
         "changed, a validation step's first call), run one evaluation in the warmup steps; else warm up past it")
LIMIT_REASON = "recompile limit"  # in the failure of a compilation dynamo refused (convert_frame.py)
#: The ``torch.compile(...)`` calls' own time in the slice, said from ``CALLS_SAID_S``.
CALLS_NOTE = ("the torch.compile(...) calls themselves took {:.2f} s (the first in a process imports torch._dynamo), "
              "timed as compile_s too")
CALLS_SAID_S = 0.05


class CompileProbe:
    """Times dynamo's compilations as ``compile`` spans (see the module docstring)."""

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec
        self._warmup_of: Callable[[], int | None] = lambda: None
        self._handler: Any = None  # dynamo's callback handler, once the callbacks went in
        self._on_start, self._on_end = self._start, self._end  # one object each: removed by identity
        self._on_clear = self._cleared
        self._open: Compilation | None = None  # the compilation under way (its end not known yet)
        self.compiles: list[Compilation] = []
        self._records_before: list[Any] = []  # dynamo's compilation records at the start (held: ids stay theirs)
        self._breaks_before: int | None = None  # dynamo's graph-break count at the start (None: not imported)
        self._attached_wall_ns: int | None = None  # when the callbacks first went in (time.time_ns())
        self._calls: list[tuple[int, float]] = []  # (raw step, seconds) of each torch.compile(...) call in the loop's thread
        self._torch_compile: Any = None  # torch.compile as it was, while ours stands in for it

    # -- life cycle -------------------------------------------------------------------------
    def install(self) -> "CompileProbe":
        import torch

        self.rec.step_listeners.append(self._at_step)
        if "torch._dynamo.callback" in sys.modules:
            utils = sys.modules["torch._dynamo.utils"]
            self._records_before = utils.get_compilation_metrics()
            self._breaks_before = int(sum(utils.counters["graph_break"].values()))
            self._attach()
        self._torch_compile = torch.compile
        torch.compile = self._timed_compile(torch.compile)
        return self

    def follow(self, warmup_of: Callable[[], int | None]) -> None:
        self._warmup_of = warmup_of

    def remove(self) -> None:
        """Idempotent, and exact: only what this probe registered comes out."""
        if self._at_step in self.rec.step_listeners:
            self.rec.step_listeners.remove(self._at_step)
        original, self._torch_compile = self._torch_compile, None
        if original is not None:
            import torch

            if getattr(torch.compile, "_tpkit_probe", None) is self:  # (not where the loop set its own since)
                torch.compile = original
        handler, self._handler = self._handler, None
        if handler is not None:
            if handler.__dict__.get("clear") is self._on_clear:
                del handler.__dict__["clear"]  # the class's own again
            if self._on_start in handler.start_callbacks:
                handler.remove_start_callback(self._on_start)
            if self._on_end in handler.end_callbacks:
                handler.remove_end_callback(self._on_end)

    def _attach(self) -> None:
        """Register the callbacks (again, after a ``torch._dynamo.reset()`` cleared them). The
        handler is kept first, so a removal after an interrupted attach still finds what went in."""
        from torch._dynamo.callback import callback_handler

        self._handler = callback_handler
        if self._attached_wall_ns is None:
            self._attached_wall_ns = time.time_ns()
        if "clear" not in callback_handler.__dict__:
            # torch._dynamo.reset() clears every callback: ours go back at once, or a compile
            # later in the same step (a reset at an epoch's or a sweep's next run's top) had
            # been its forward (0.92 s of forward, compile_s 0)
            callback_handler.__dict__["clear"] = self._on_clear
        if self._on_start not in callback_handler.start_callbacks:
            callback_handler.register_start_callback(self._on_start)
        if self._on_end not in callback_handler.end_callbacks:
            callback_handler.register_end_callback(self._on_end)

    def _cleared(self) -> None:
        """dynamo's ``callback_handler.clear()`` (``torch._dynamo.reset()``), then ours back in."""
        handler = self._handler
        if handler is None:
            return
        type(handler).clear(handler)
        handler.register_start_callback(self._on_start)
        handler.register_end_callback(self._on_end)

    def _timed_compile(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """``torch.compile`` for the slice: the call, in the loop's thread, is a ``compile`` span
        (the first imports dynamo: seconds), and the callbacks go in as soon as dynamo is
        imported, before the compiled model's first call. Nothing is added to the calls of what
        it returns. In decorator form (``torch.compile(fullgraph=True)``) the call that compiles
        is the decorator's: it calls ``torch.compile`` again, timed there."""
        probe = self

        def timed_compile(*args: Any, **kwargs: Any) -> Any:
            rec = probe.rec
            ours = _rec.active() is rec and threading.get_ident() == rec.thread_id
            timer = rec.cuda_timer if ours else None
            start, start_event = perf_counter_ns(), timer.mark() if timer is not None else None
            try:
                return original(*args, **kwargs)
            finally:
                end = perf_counter_ns()
                if ours:
                    rec.add_timed_span(COMPILE, start, end, CALL_SOURCE, None, start_event,
                                       timer.mark() if timer is not None else None)
                    probe._calls.append((rec.step_index, (end - start) / 1e9))
                if probe._torch_compile is not None:  # (a wrapper kept past the slice attaches nothing)
                    probe._at_step(0, 0)  # dynamo imported by it: the callbacks in now

        for attr in ("__module__", "__name__", "__qualname__", "__doc__", "__wrapped__"):
            setattr(timed_compile, attr, getattr(original, attr, None) if attr != "__wrapped__" else original)
        timed_compile._tpkit_probe = probe  # type: ignore[attr-defined]
        return timed_compile

    def _at_step(self, _raw_step: int, _end_ns: int) -> None:
        if self._torch_compile is None:
            return  # removed (or never installed): nothing goes back in
        if "torch._dynamo.callback" in sys.modules and (
                self._handler is None or self._on_start not in self._handler.start_callbacks):
            self._attach()

    # -- dynamo's callbacks -------------------------------------------------------------------
    def _ours(self, trigger: str) -> bool:
        """A compilation of the slice's loop: in its thread, or its backward's compiled in
        autograd's device thread while the loop waits in backward."""
        rec = self.rec
        if _rec.active() is not rec:
            return False
        return threading.get_ident() == rec.thread_id or (trigger == "LAZY_BACKWARD" and rec.is_open("backward"))

    def _start(self, args: Any) -> None:
        trigger = args.callback_trigger.name
        if not self._ours(trigger):
            return
        rec, timer = self.rec, self.rec.cuda_timer
        now, wall = perf_counter_ns(), time.time_ns()
        self._open = Compilation(_began_ns(now, wall), now - wall, len(rec._stack), rec.step_index,
                                 timer.mark() if timer is not None else None, 0, None, trigger, args.compile_id,
                                 trigger == "DYNAMO" and not _grad_enabled())

    def _end(self, args: Any) -> None:
        opened, self._open = self._open, None
        # (dynamo runs the end callbacks where the last of overlapping compilations ends, with its
        # arguments: one of another thread's is not this one's end)
        if opened is None or opened.compile_id != args.compile_id or not self._ours(opened.trigger):
            return
        timer = self.rec.cuda_timer
        self.compiles.append(opened._replace(end_ns=perf_counter_ns(),
                                             end_event=timer.mark() if timer is not None else None))

    # -- after the slice --------------------------------------------------------------------------
    def meta(self) -> dict[str, Any]:
        """The compilations' spans (here: their ends are dynamo's, known once its record is
        written), and the notes (``rec.note``); nothing of its own in ``run.meta``."""
        rec = self.rec
        utils = sys.modules.get("torch._dynamo.utils")
        if utils is None:
            return {}
        held = {id(r) for r in self._records_before}
        new = [r for r in utils.get_compilation_metrics() if id(r) not in held]
        done = [c._replace(end_ns=_ended_ns(c, new)) for c in self.compiles]
        done = sorted(done + self._before_callbacks(new), key=lambda c: c.start_ns)
        for c in done:
            rec.add_timed_span(COMPILE, c.start_ns, c.end_ns, f"torch.compile ({c.trigger.lower()})",
                               c.depth, c.start_event, c.end_event, raw_step=c.raw_step)
        past = rec.slice_steps if rec.slice_steps is not None else len(rec.step_ends) + 1
        warmup = self._warmup_of()
        warmup = len(rec.step_ends) if warmup is None else warmup
        text = compilations_note([c for c in done if c.raw_step < past], new, warmup,
                                 sum(s for step, s in self._calls if step < past))
        if text:
            rec.note(text)
        text = limit_note(new, rec, warmup)
        if text:
            rec.note(text)
        if self._breaks_before is not None and sum(utils.counters["graph_break"].values()) == self._breaks_before:
            for model in rec.models.live():
                text = breaks_before_note(model)
                if text:
                    rec.note(text)
        return {}


    def _before_callbacks(self, records: list[Any]) -> list["Compilation"]:
        """The compilations dynamo recorded in the slice before the callbacks went in (all the
        slice's: see the module docstring), outermost only, each nested in the spans that enclose
        it and in the step it began in."""
        rec = self.rec
        began_unix_ns = rec.meta.get("start_unix_ns")
        if began_unix_ns is None:
            return []
        perf_minus_wall = rec.t0_ns - began_unix_ns
        until = self._attached_wall_ns if self._attached_wall_ns is not None else time.time_ns()
        found: list[tuple[int, int, Any]] = []
        for r in sorted(records, key=lambda r: r.start_time_us or 0):
            if not (r.start_time_us and r.end_time_us) or getattr(r, "is_runtime", False):
                continue
            start, end = r.start_time_us * 1000, r.end_time_us * 1000
            if start < began_unix_ns or start >= until or (found and end <= found[-1][1]):
                continue  # not in the slice, seen by the callbacks, or inside the one before
            found.append((start + perf_minus_wall, end + perf_minus_wall, r))
        if not found:
            return []
        spans, ends = rec.spans, [e for e, _ in rec.step_ends]
        could = sorted((s, e) for phase, s, e, _, source, *_ in spans
                       if phase in _COMPILING_PHASES or (phase == COMPILE and source == CALL_SOURCE))
        out = []
        for start, end, r in found:
            if not _inside(could, start):
                continue  # the loop was in no call that compiles: another thread's
            depth = 1 + max((d for _, s, e, d, *_ in spans if s <= start and e >= end), default=-1)
            out.append(Compilation(start, perf_minus_wall, depth, bisect.bisect_right(ends, start), None, end, None,
                                   "LAZY_BACKWARD" if r.is_forward is False else "DYNAMO", str(r.compile_id)))
        return out


#: The loop's phases inside which a compilation is the loop's (its model called, its backward,
#: an evaluation's call): a record dynamo wrote before the callbacks went in says no thread.
_COMPILING_PHASES = frozenset({"forward", "backward", "eval"})
#: The source of the ``torch.compile(...)`` call's own span.
CALL_SOURCE = "torch.compile (call)"


def _inside(spans: list[tuple[int, int]], t_ns: int) -> bool:
    """Whether ``t_ns`` falls inside one of ``spans`` (sorted by start; they may nest)."""
    i = bisect.bisect_right(spans, (t_ns, 1 << 62))
    return any(s <= t_ns <= e for s, e in spans[:i])


class Compilation(NamedTuple):
    """One compilation of the loop's, as its callbacks saw it (``perf_counter_ns``; CUDA events
    or None)."""
    start_ns: int
    perf_minus_wall_ns: int  # perf_counter_ns() - time.time_ns() at its start: dynamo's records are on the wall clock
    depth: int
    raw_step: int
    start_event: Any
    end_ns: int
    end_event: Any
    trigger: str  # CallbackTrigger's name: DYNAMO, LAZY_BACKWARD
    compile_id: str
    no_grad: bool = False  # began with grad off (an evaluation's, a model's called without grad); False: not known

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


def _ended_ns(c: Compilation, records: list[Any]) -> int:
    """When dynamo finished the compilation ``c``: its record's end (after the end callback it
    collects garbage, ``config.run_gc_after_compile``, and writes the record: 25 ms of a 1.3 s
    recompile), else the end callback's time."""
    for r in records:
        if str(r.compile_id) != c.compile_id or (r.is_forward is False) != (c.trigger == "LAZY_BACKWARD"):
            continue
        if not (r.start_time_us and r.end_time_us):
            continue
        began, ended = (r.start_time_us * 1000 + c.perf_minus_wall_ns, r.end_time_us * 1000 + c.perf_minus_wall_ns)
        if began <= c.end_ns and ended >= c.end_ns:  # its own (compile ids start again after a reset)
            return ended
    return c.end_ns


def _grad_enabled() -> bool:
    import torch

    return torch.is_grad_enabled()


def _began_ns(now_ns: int, wall_ns: int) -> int:
    """When dynamo began the compilation whose start callback runs now, on ``perf_counter_ns``'s
    clock: its metrics context opens (``time.time_ns()``) as it starts compiling, before the
    callbacks run; between the two it works out why it recompiles (its guards' failures) and may
    collect garbage (a 0.75 s gen-2 collection there had stayed forward)."""
    utils = sys.modules["torch._dynamo.utils"]
    context = utils.get_metrics_context()
    began_wall_ns = getattr(context, "_start_time_ns", 0)
    if not began_wall_ns or not context.in_progress():
        return now_ns
    return now_ns - max(0, wall_ns - began_wall_ns)


def _step_name(raw_step: int, warmup: int) -> str:
    """A raw step as ``run.steps`` numbers it (warmup steps negative)."""
    return f"{raw_step - warmup}" + (" (warmup)" if raw_step < warmup else "")


def compilations_note(compiles: list["Compilation"], records: list[Any], warmup: int, calls_s: float = 0.0) -> str:
    """What the slice compiled: per step, how many and how long; the recompile reasons dynamo
    gave (its compilation records of the slice, by compile id); the ``torch.compile(...)`` calls'
    time (``calls_s``), where it counts."""
    if not compiles:
        return CALLS_NOTE.format(calls_s) if calls_s >= CALLS_SAID_S else ""
    reasons = {str(r.compile_id): r.recompile_reason for r in records
               if r.is_forward is not False and r.recompile_reason}
    by_step: dict[int, list[Compilation]] = {}
    for c in compiles:
        by_step.setdefault(c.raw_step, []).append(c)
    parts = []
    for step, items in sorted(by_step.items()):
        why = sorted({_first_line(reasons[c.compile_id]) for c in items
                      if c.trigger == "DYNAMO" and c.compile_id in reasons})
        lazy = sum(1 for c in items if c.trigger == "LAZY_BACKWARD")
        no_grad = sum(1 for c in items if c.no_grad)
        parts.append(f"step {_step_name(step, warmup)}: {len(items)} ({sum(c.seconds for c in items):.2f} s"
                     + (f", {lazy} of them backward graphs compiled at their first run" if lazy else "")
                     + (f", {no_grad} of them without grad (an evaluation's, or a model's called without grad: "
                        "its first call so, or grad mode or eval mode changed)" if no_grad else "")
                     + (f"; dynamo's recompile reason: {'; '.join(why)}" if why else "") + ")")
    total = sum(c.seconds for c in compiles)
    measured = [c for c in compiles if c.raw_step >= warmup]
    text = (f"torch.compile compiled {len(compiles)} time(s) inside the slice, {total:.2f} s in all, timed as "
            f"compile_s (not as the forward or backward it ran in): {', '.join(parts)}")
    if calls_s >= CALLS_SAID_S:
        text += "; " + CALLS_NOTE.format(calls_s)
    if measured:
        text += (f"; {len(measured)} in the measured steps ({sum(c.seconds for c in measured):.2f} s): the verdict "
                 f"judges it first (COMPILE-BOUND from 30% of step time), training's shares without it; {KNOBS}")
    return text


def _first_line(reason: str, limit: int = 160) -> str:
    line = reason.strip().splitlines()[0] if reason.strip() else reason
    return line if len(line) <= limit else line[:limit - 3] + "..."


def limit_note(records: list[Any], rec: Recorder, warmup: int) -> str:
    """dynamo's recompile limit reached inside the slice: its refused compilation's record
    (no callback runs for it). The step comes from the record's wall-clock start."""
    hits = [r for r in records if r.fail_reason and LIMIT_REASON in r.fail_reason]
    if not hits:
        return ""
    import torch._dynamo.config as config

    names = {}
    for r in sys.modules["torch._dynamo.utils"].get_compilation_metrics():
        if r.co_name and r.compile_id:
            names[str(r.compile_id).split("/")[0]] = f"'{r.co_name}' ({os.path.basename(r.co_filename or '')}:" \
                                                    f"{r.co_firstlineno})"
    ends = [e for e, _ in rec.step_ends]
    said = []
    for r in hits:
        frame = str(r.compile_id).split("/")[0]
        at = ""
        if r.start_time_us and "start_unix_ns" in rec.meta:
            step = bisect.bisect_right(ends, rec.t0_ns + r.start_time_us * 1000 - rec.meta["start_unix_ns"])
            at = f" at step {_step_name(step, warmup)}"
        said.append(f"{names.get(frame, 'a frame')}{at}"
                    + (f", last reason {_first_line(r.recompile_reason)}" if r.recompile_reason else ""))
    return (f"torch.compile reached its recompile limit (torch._dynamo.config.recompile_limit = "
            f"{config.recompile_limit}) inside the slice for {'; '.join(said)}: dynamo runs that code uncompiled "
            f"(eager) from then on for inputs its compiled graphs do not fit; {KNOBS}")


def breaks_before_note(model: Any) -> str:
    """A model compiled (``torch.compile(model)``, or ``model.compile()``) whose forwards dynamo
    broke before the slice: the places of its resume functions in the model's modules' forwards."""
    inner = getattr(model, "_orig_mod", None)
    if inner is None and getattr(model, "_compiled_call_impl", None) is None:
        return ""
    sites = graph_break_sites(inner if inner is not None else model)
    if not sites:
        return ""
    return (f"torch.compile: the trained model ({type(inner if inner is not None else model).__name__}, compiled) "
            f"has {len(sites)} graph break(s), made when dynamo compiled it before the slice (at "
            f"{', '.join(sites)}): it runs partly eager, returning to Python at each break every call; none was "
            "counted while the slice ran, as dynamo counts breaks when it compiles, not per call: see "
            "torch._dynamo.explain(model)(...) for the reasons")


def graph_break_sites(module: Any) -> list[str]:
    """``file:line`` of each graph break dynamo made in the forwards of ``module``'s modules
    (since its last ``torch._dynamo.reset()``): the resume functions it made there, and in them."""
    resume = sys.modules.get("torch._dynamo.resume_execution")
    if resume is None:
        return []
    cache = resume.ContinueExecutionCache.cache
    todo = list({code for m in module.modules()
                 if (code := getattr(getattr(type(m), "forward", None), "__code__", None)) is not None})
    sites: list[str] = []
    while todo:
        for made in (cache.get(todo.pop()) or {}).values():
            sites.append(f"{os.path.basename(made.co_filename)}:{made.co_firstlineno}")
            todo.append(made)
    return sorted(set(sites))


# dynamo calls the probe's callbacks while its own frame callback is set: no frame of tpkit's is
# compiled there (compiling.skip_own_frames; they had been 8 frames more in dynamo's counters)
skip_own_frames(sys.modules[__name__], CompileProbe)
