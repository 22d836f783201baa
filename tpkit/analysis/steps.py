"""Per-step analysis: shares, verdicts and the summary, as pure functions from frames.

Nothing here measures or draws. Every function takes the Run's tables (or a hand-made frame
with the same columns) so tests can check each rule on numbers chosen by hand.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from ..schema import (
    BUILTIN_PHASES,
    GC_PHASE,
    OTHER,
    PHASE_COLUMNS,
    PHASE_NAMES,
    TRACKERS,
    UNCOUNTED_PHASES,
    USER_PHASE_SOURCE,
    VERDICTS,
    ZERO_GRAD_SOURCE,
    hooks_phrase,
    hooks_remedy,
)
from .memory import memory_notes, stream_note

#: Verdict thresholds, as shares of measured step time (TraceML warns at 10% and 20%).
INPUT_BOUND = 0.20
INPUT_LIMITED = 0.10
COPY_BOUND = 0.15
OPTIMIZER_BOUND = 0.30
OFFLOAD_BOUND = 0.30
#: Time blocked in collectives (``comm_s``): waiting for a slower rank or for the network.
COMM_BOUND = 0.30
OVERHEAD_BOUND = 0.30
#: What interrupts training inside the slice, judged before the rest: its share of step time
#: from which it is the verdict. Column -> (verdict, what it is, what to turn).
INTERRUPTION_BOUND = 0.30
INTERRUPTIONS: dict[str, tuple[str, str, str]] = {
    "eval_s": ("eval-bound", "evaluation",
               "evaluate less often (eval_steps, val_check_interval) or on fewer batches (limit_val_batches, a Subset)"),
    "save_s": ("save-bound", "checkpoint saving",
               "save less often (save_steps, every_n_train_steps), or in the background "
               "(torch.distributed.checkpoint.async_save)"),
    "setup_s": ("setup-bound", "a trainer's setup",
                "a trainer's run began inside the slice (a sweep's next Trainer, a run tried again): profile "
                "one run, its setup in the warmup steps (more warmup, or one slice per train() / fit())"),
    "compile_s": ("compile-bound", "compilation (torch.compile)",
                  "torch.compile compiled inside the measured steps (the run's notes give dynamo's reason): for a "
                  "new input shape, mark the changing dimension dynamic (torch._dynamo.mark_dynamic(x, dim), or "
                  "torch.compile(dynamic=True)) or pad inputs to a few shapes; for an evaluation (grad mode or "
                  "eval mode changed, a validation step's first call), run one evaluation in the warmup steps; "
                  "else warm up past it"),
}


@dataclass
class Verdict:
    """The bottleneck verdict: ``kind`` (a key of ``schema.VERDICTS``), the full line ``text``
    (headline: evidence; advice), and its parts for views that lay them out."""

    kind: str  # a key of schema.VERDICTS
    text: str
    evidence: str = ""  # the measured shares behind it
    advice: str = ""    # what to look at next

    @property
    def headline(self) -> str:
        """``'INPUT-BOUND'``, ``'COMPUTE-BOUND'``...: the one name every view uses."""
        return VERDICTS.get(self.kind, self.kind.upper())


def _verdict(kind: str, evidence: str, advice: str = "") -> Verdict:
    text = f"{VERDICTS[kind]}: {evidence}" + (f"; {advice}" if advice else "")
    return Verdict(kind, text, evidence, advice)


@dataclass
class Summary:
    """A run's figures over its measured steps, its verdict and its notes."""

    name: str
    steps: int
    warmup_steps: int
    complete: bool
    samples: int
    total_s: float
    throughput: float  # samples/s over measured steps
    step_p50_s: float
    step_p95_s: float
    phase_share: dict[str, float] = field(default_factory=dict)  # column -> share of step time
    #: phase the user named (tp.phase) -> share of step time of its own time, which is in ``other``
    user_phase_share: dict[str, float] = field(default_factory=dict)
    data_stall_share: float = 0.0
    verdict: Verdict = field(default_factory=lambda: _verdict("no-steps", "no steps were measured"))
    notes: list[str] = field(default_factory=list)
    clocks: dict = field(default_factory=dict)  # analysis.clocks.ClockSummary.to_dict(), when clocks were sampled
    clock_lines: list[str] = field(default_factory=list)
    #: batches were read (``batches_seen``) but none of the measured steps' samples counted: a
    #: batch type tpkit cannot count (the notes name it), not a loader it did not see
    uncounted: bool = False

    def to_dict(self) -> dict:
        return asdict(self)

    def _in_other(self) -> str:
        """``" (of it your phase 'logging' 77%)"``: the user's phases ``other`` holds, named from
        the same share of it as the verdict names them (``USER_PHASE_NAMED``; the time line had
        named them from 0.5% of the step)."""
        least = USER_PHASE_NAMED * self.phase_share.get("other_s", 0.0)
        mine = phases_text({p: v for p, v in self.user_phase_share.items() if v > 0 and v >= least})
        return f" (of it {mine})" if mine else ""

    def to_frame(self) -> pd.DataFrame:
        """One row per figure: ``figure, value, unit``."""
        rows = [
            ("steps measured", self.steps, "steps"),
            ("warmup steps", self.warmup_steps, "steps"),
            ("throughput", self.throughput, "samples/s"),
            ("step time p50", self.step_p50_s * 1e3, "ms"),
            ("step time p95", self.step_p95_s * 1e3, "ms"),
        ]
        rows += [(f"{c[:-2]} share", v * 100, "%") for c, v in self.phase_share.items()
                 if v > 0 or c == "data_wait_s"]
        rows += [(f"your phase '{p}' share (in other)", v * 100, "%") for p, v in self.user_phase_share.items()]
        rows += _clock_rows(self.clocks)
        return pd.DataFrame(rows, columns=["figure", "value", "unit"])

    def to_text(self) -> str:
        lines = [f"tpkit run '{self.name}'" + ("" if self.complete else " (INCOMPLETE)")]
        if self.steps == 0:
            lines.append("  no measured steps")
        else:
            lines.append(f"  {self.steps} steps (+{self.warmup_steps} warmup), "
                         f"{_rate(self.throughput, self.uncounted)}, step p50 {self.step_p50_s * 1e3:.2f} ms, "
                         f"p95 {self.step_p95_s * 1e3:.2f} ms")
            shares = ", ".join(f"{c[:-2]} {v:.0%}" + (self._in_other() if c == "other_s" else "")
                               for c, v in self.phase_share.items() if v >= 0.005)
            lines.append(f"  time: {shares}")
        lines.append(f"  verdict: {self.verdict.text}")
        lines += [f"  {c}" for c in self.clock_lines]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


#: Why samples/s is unknown when steps were timed: no batch was seen, or none whose samples
#: could be counted (the run's notes then name the batch's type).
RATE_UNKNOWN = ("no samples counted: read batches through a DataLoader or tp.watch, or give samples_per_step")
#: Why, where batches were seen but tpkit could not count their samples (``Summary.uncounted``):
#: it had said to read them through a DataLoader of batches a DataLoader had handed out.
RATE_UNCOUNTED = ("no samples counted: tpkit saw the batches but could not count their samples (a note says "
                  "which), give samples_per_step")


def _rate(throughput: float, uncounted: bool = False) -> str:
    if throughput != throughput:  # NaN
        return f"samples/s unknown ({RATE_UNCOUNTED if uncounted else RATE_UNKNOWN})"
    return f"{throughput:,.1f} samples/s"


def measured(steps: pd.DataFrame) -> pd.DataFrame:
    """The steps after warmup."""
    return steps[~steps["warmup"].astype(bool)] if not steps.empty else steps


def phase_shares(steps: pd.DataFrame) -> dict[str, float]:
    """Share of total step time per phase column (sums to 1 when any time was measured). Of the
    phases' own sum where that is more than the steps' time (a span charged whole to the step it
    began in, running on past its end): no share over 100% (an evaluation had read 125%)."""
    total = max(float(steps["duration_s"].sum()), float(steps[list(PHASE_COLUMNS)].sum().sum())) \
        if not steps.empty else 0.0
    if total <= 0:
        return {c: 0.0 for c in PHASE_COLUMNS}
    return {c: float(steps[c].sum()) / total for c in PHASE_COLUMNS}


#: The advice where no batch was seen in the slice (``batches_seen``): a loader tpkit does not
#: see (a torchdata.nodes Loader, a generator) waits inside ``other``. A loop spending 71% of
#: each step in such a loader's next() had read "Python between phases, logging, .item() syncs".
UNSEEN_LOADER = "no loader was seen (data_wait 0, no batch counted), so other may be waiting for data"
WATCH_IT = ("wrap the loader in tp.watch(...), or the function that makes the batches "
            "(get_batch = tp.watch(get_batch))")


#: Phases the user named (``tp.phase``) holding at least this fraction of ``other`` are what the
#: overhead verdict speaks of (their own time is other: capture/build.py).
USER_PHASES_OF_OTHER = 0.5
#: A user phase holding at least this fraction of ``other`` is named beside it in the summary.
USER_PHASE_NAMED = 0.05
#: Time outside every phase, none of it named, sits "in one place" of the step when one place
#: (``other_parts``) holds at least this fraction of it.
ONE_PLACE = 0.5
#: What to do to have time outside every phase named.
NAME_IT = 'wrap the suspect code in `with tp.phase("name"):` to have it named'
#: Place of ``other`` time -> (where it is, what usually runs there and what to do). Other places
#: are named by the built-in phases around them.
PLACES: dict[str, tuple[str, str]] = {
    "tail": ("after optimizer.step(), before the next batch is read",
             "the loop's tail after the update (logging, metrics, an LR scheduler): log and compute metrics less "
             f"often, and {NAME_IT}"),
    "tail_forward": ("after optimizer.step(), before the next forward",
                     "the loop's tail after the update (logging, metrics, an LR scheduler) and whatever reads the "
                     f"next batch: log and compute metrics less often, and {NAME_IT}"),
    "before_forward": ("after the batch is read, before the forward",
                       f"preparing the batch (a transform, a copy tpkit does not see): {NAME_IT}"),
    "forward_backward": ("between the forward and the backward",
                         f"a loss or metrics computed outside the model, .item() syncs: {NAME_IT}"),
    "backward_optimizer": ("between the backward and optimizer.step()",
                           f"gradient clipping, a gradient norm, unscaling: {NAME_IT}"),
    "gc": ("in Python's garbage collections inside a wait for data",
           "the collector, not the loader: fewer objects kept alive between steps (cached records, lists "
           "of tensors), or gc.freeze() once the model and data are built"),
}
#: The places after the parameter update: the time there is the loop's tail (logging, metrics).
TAIL_PLACES = ("tail", "tail_forward")
_UPDATE = ("optimizer", "offload")


@dataclass
class OtherParts:
    """Where the measured steps' ``other`` time (no built-in phase open) sits, each part as a
    fraction of it: in phases the user named (``tp.phase``; ``other_s`` holds their own time), and,
    for the rest, in which place of the step (``PLACES`` keys, else ``"after X, before Y"``)."""

    phases: dict[str, float] = field(default_factory=dict)  # user phase -> fraction of other, largest first
    places: dict[str, float] = field(default_factory=dict)  # place -> fraction of other, none named; largest first

    @property
    def named(self) -> float:
        """The fraction of other the user's phases hold."""
        return sum(self.phases.values())

    def top_place(self) -> tuple[str, float]:
        """The place holding the most unnamed other time, and its fraction of other."""
        return next(iter(self.places.items()), ("", 0.0))


def place_text(place: str) -> str:
    """Where a place of ``other_parts`` is, in words."""
    return PLACES[place][0] if place in PLACES else place


def _place(prev: str, nxt: str) -> str:
    """The place between the built-in phase that ended last (``prev``) and the next to start."""
    if prev in _UPDATE and nxt in ("data_wait", ""):
        return "tail"
    if prev in _UPDATE and nxt in ("h2d", "forward"):
        return "tail_forward"
    if prev in ("data_wait", "h2d") and nxt == "forward":
        return "before_forward"
    if prev == "forward" and nxt == "backward":
        return "forward_backward"
    if prev == "backward" and nxt == "optimizer":
        return "backward_optimizer"
    if prev == nxt:
        return f"between {PHASE_NAMES.get(prev, prev)} calls"
    after = f"after {PHASE_NAMES.get(prev, prev)}" if prev else "at the slice's start"
    return f"{after}, before {PHASE_NAMES.get(nxt, nxt)}" if nxt else f"{after}, at the slice's end"


def _innermost(mid: np.ndarray, starts: np.ndarray, ends: np.ndarray, depth: np.ndarray) -> np.ndarray:
    """For each piece's middle ``mid``, the index of the deepest interval open there, or -1.
    The intervals nest (one thread's stack): those of one depth never overlap, so each depth is
    laid over the shallower ones with one ``searchsorted`` (a Python loop per span had taken
    most of a 3,000-step summary's 100 ms)."""
    owner = np.full(len(mid), -1)
    for d in np.unique(depth):
        idx = np.flatnonzero(depth == d)
        idx = idx[np.argsort(starts[idx], kind="stable")]
        a, b = starts[idx], ends[idx]
        at = np.searchsorted(a, mid, side="right") - 1
        inside = (at >= 0) & (mid < b[np.maximum(at, 0)])
        owner[inside] = idx[at[inside]]
    return owner


def _own_time(us: np.ndarray, ue: np.ndarray, depth: np.ndarray, ks: np.ndarray,
              ke: np.ndarray) -> tuple[np.ndarray, ...]:
    """The stretches of each user phase (``us``, ``ue``, ``depth``) that are its own: before its
    first built-in child and after its last (built-in spans' sorted starts ``ks`` and ends
    ``ke``); where it has none, the whole span. The time between built-in children is the
    step's, placed as if the phase were not there: ``tp.phase("train_step")`` around forward,
    backward and optimizer.step() (or ``tp.phase("train")`` around the loop) had taken every gap
    of the step as its own, with the advice "run your phase 'train_step' less often".
    Returns (index of the span, start, end, depth) of each stretch."""
    first = np.searchsorted(ks, us, side="left")
    has = first < np.searchsorted(ks, ue, side="left")  # a built-in span starts inside it
    fs = ks[np.minimum(first, len(ks) - 1)] if len(ks) else us
    le = ke[np.maximum(np.searchsorted(ke, ue, side="right") - 1, 0)] if len(ke) else ue
    pre_end = np.where(has, fs, ue)
    post_start = np.where(has, np.maximum(le, fs), ue)
    i = np.arange(len(us))
    return (np.concatenate([i, i]), np.concatenate([us, post_start]), np.concatenate([pre_end, ue]),
            np.concatenate([depth, depth]))


def other_parts(steps: pd.DataFrame, spans: pd.DataFrame | None,
                pauses: pd.DataFrame | None = None) -> OtherParts | None:
    """Where the measured steps' time outside every built-in phase sits (``OtherParts``), from the
    spans: each instant of the measured steps that no built-in span covers is the innermost user
    phase's open there (of its own stretches: ``_own_time``), else it is placed between the
    built-in phases around it (tpkit's own spans and ``zero_grad()`` skipped: the place is the
    same whichever side of it the time is). None where no such time or no span was recorded (a
    hand-made frame). ``pauses`` (``gc_pauses``): the collector's pauses inside ``data_wait``,
    which the verdict judges as other (``gc_free_steps``), are a place of their own (``"gc"``):
    left out, a 0.3-0.8 s collection inside ``next()`` had been credited to the time around it
    (the loop's tail: "log and compute metrics less often", for a loop whose tail took 11 ms).

    A phase the user named takes 77% of a step: ``other_s`` holds it (capture/build.py keeps the
    steps table's columns fixed), and the verdict had read "77% outside every known phase;
    Python between phases, logging" with no word of that phase. Arrays throughout (names
    factorized once): on 3,000 steps (21,000 spans) frames and string compares had cost ~100 ms."""
    m = measured(steps)
    if m.empty or spans is None or spans.empty:
        return None
    w0, w1 = float(m["start_s"].min()), float(m["end_s"].max())
    f64 = "float64"
    start, end = spans["start_s"].to_numpy(f64), spans["end_s"].to_numpy(f64)
    depth = spans["depth"].to_numpy()
    code, names = pd.factorize(spans["phase"], sort=False)
    names = np.asarray(names, dtype=object).astype(str)
    src_code, srcs = pd.factorize(spans["source"], sort=False)

    def codes_of(values: tuple[str, ...], vocab: np.ndarray) -> np.ndarray:
        return np.flatnonzero(np.isin(vocab, values))

    ok = (end > start) & ~np.isin(code, codes_of(UNCOUNTED_PHASES, names))
    builtin = ok & np.isin(code, codes_of(BUILTIN_PHASES, names))
    # every span, not only the measured steps': the first measured step's tail follows the last
    # warmup step's update
    user = ok & ~builtin & np.isin(src_code, codes_of((USER_PHASE_SOURCE,), np.asarray(srcs, dtype=object)))
    tpkit = np.isin(code, codes_of(("tpkit",), names))
    bs, be = start[builtin], end[builtin]
    kid = builtin & ~tpkit
    users = np.flatnonzero(user)
    which, us, ue, ud = _own_time(start[users], end[users], depth[users], np.sort(start[kid]), np.sort(end[kid]))
    us, ue = np.clip(us, w0, w1), np.clip(ue, w0, w1)
    keep = ue > us
    which, us, ue, ud = which[keep], us[keep], ue[keep], ud[keep]
    pts = np.unique(np.clip(np.concatenate([bs, be, us, ue, [w0, w1]]), w0, w1))
    lo, hi = pts[:-1], pts[1:]
    mid, length = (lo + hi) / 2, hi - lo
    # built-in spans open at each piece's middle: started before it less ended before it
    free = np.searchsorted(np.sort(bs), mid) - np.searchsorted(np.sort(be), mid) <= 0
    gc_s = 0.0
    if pauses is not None and not pauses.empty:
        waits = pauses[(pauses["phase"] == "data_wait") & pauses["step"].isin(m["step"])]
        gc_s = float(waits["duration_s"].sum())
    total = float(length[free].sum()) + gc_s
    if total <= 0:
        return None
    owner = _innermost(mid, us, ue, ud)
    named = free & (owner >= 0)
    by_name = np.bincount(code[users[which[owner[named]]]], weights=length[named], minlength=len(names)) / total
    rest = free & (owner < 0)
    # the built-in phases around each unnamed piece: the one ended last before it (the outermost
    # among equals), the first started after it; tpkit's own spans and zero_grad() are no place
    zero = np.isin(src_code, codes_of((ZERO_GRAD_SOURCE,), np.asarray(srcs, dtype=object)))
    ref = np.flatnonzero(kid & ~zero)
    rd, rs, re_, rp = depth[ref], start[ref], end[ref], code[ref]
    by_end, by_start = np.lexsort((-rd, re_)), np.lexsort((rd, rs))
    i_prev = np.searchsorted(re_[by_end], lo[rest], side="right") - 1
    i_next = np.searchsorted(rs[by_start], hi[rest], side="left")
    none = len(names)  # no phase: the slice's start or end
    prev = np.append(rp[by_end], none)[np.where(i_prev >= 0, i_prev, len(by_end))]
    nxt = np.append(rp[by_start], none)[i_next]
    pair, inv = np.unique(prev * (none + 1) + nxt, return_inverse=True)
    pair_s = np.bincount(inv.ravel(), weights=length[rest], minlength=len(pair))
    label = np.append(names, "")
    places: dict[str, float] = {"gc": gc_s / total} if gc_s > 0 else {}
    for pn, sec in zip(pair.tolist(), pair_s.tolist()):
        key = _place(str(label[pn // (none + 1)]), str(label[pn % (none + 1)]))
        places[key] = places.get(key, 0.0) + sec / total
    phases = {str(n): float(v) for n, v in zip(names, by_name) if v > 0}
    return OtherParts(dict(sorted(phases.items(), key=lambda kv: -kv[1])),
                      dict(sorted(((k, v) for k, v in places.items() if v > 0), key=lambda kv: -kv[1])))


def batches_seen(steps: pd.DataFrame, meta: dict | None = None) -> bool:
    """Whether the slice saw any batch: a wait for one, or a batch handed out
    (``meta["batches_seen"]``). Samples are no sign where ``samples_per_step`` (or DeepSpeed's
    engine) filled them in: a nanoGPT ``get_batch()`` taking 96% of the step lost the "no loader
    was seen" advice once samples_per_step was given. A run saved before that key: a sample
    counted in some step."""
    if steps.empty or float(steps["data_wait_s"].sum()) > 0:
        return True
    if meta is not None and "batches_seen" in meta:
        return int(meta["batches_seen"]) > 0
    return int(steps["samples"].sum()) > 0


def verdict(shares: dict[str, float], seen: bool = True, compiled: str = "",
            parts: OtherParts | None = None, model: str = "") -> Verdict:
    """The one-line bottleneck verdict from phase shares. Order: the first rule that fires.
    Every verdict's name comes from ``schema.VERDICTS``; a run is called one thing only.
    ``seen``: whether any batch was seen (``batches_seen``); if not, the advice says so.
    ``compiled``: the torch.compile'd function the whole step ran in (``meta["compiled_step"]``),
    whose forward and optimizer step tpkit cannot see: its ``other`` is that function's graphs.
    ``parts``: where ``other`` sits (``other_parts``): an overhead verdict names the user's phases
    that hold it, else the place of the step that does, and advises on that.
    ``model``: the trained model's class (``meta["model"]["class"]``): the advice on communication
    names the knobs of the wrapper it is (``_overlap_knobs``).

    What interrupts training inside the slice (evaluation, ``eval_s``; checkpoints written,
    ``save_s``) is judged first, the larger first; below its bound the other rules judge
    training alone: its shares with those left out (a loader that starves training 25% of its
    time is input-bound whether or not an evaluation or a save ran too)."""
    if not shares or sum(shares.values()) == 0:
        return _verdict("no-steps", "no steps were measured: nothing to judge")
    breaks = sorted(((shares.get(c, 0.0), c) for c in INTERRUPTIONS), reverse=True)
    for share, col in breaks:
        kind, what, knobs = INTERRUPTIONS[col]
        if share >= INTERRUPTION_BOUND:
            others = " and ".join(INTERRUPTIONS[c][1] for c in INTERRUPTIONS)
            share = min(share, 1.0)  # (never over the whole step, nor a negative speed-up)
            faster = f"up to {1 / (1 - share):.2f}x" if share < 1 else "many times"
            return _verdict(kind, f"{share:.0%} of step time is {what} inside the slice",
                            f"training alone would run {faster} faster: {knobs}; "
                            f"the other shares are of training and {others} together")
    away = sum(share for share, _ in breaks)
    if away <= 0.0:
        return _training_verdict(shares, seen, compiled, parts, model)
    training = {c: v / (1 - away) for c, v in shares.items() if c not in INTERRUPTIONS}
    v = _training_verdict(training, seen, compiled, parts, model)
    if v.kind == "no-steps":
        return v
    evidence = v.evidence.replace("of step time", "of training time")
    left = " and ".join(f"{what} {shares[c]:.0%}" for c, (_, what, _) in INTERRUPTIONS.items() if shares.get(c, 0.0) > 0)
    return _verdict(v.kind, f"{evidence} ({left} of the step left out)", v.advice)


def _overlap_knobs(model: str) -> str:
    """Where to overlap communication, for the wrapper the model trained in: FSDP1
    (``FullyShardedDataParallel``) has its own constructor knobs (an FSDP1 run had been told of
    DDP's bucket_cap_mb and FSDP2's prefetching, neither of which it has); other wrappers, or none
    known, hear of DDP's and FSDP2's."""
    if "FullyShardedDataParallel" in model:
        return ("FSDP's forward_prefetch=True, backward_prefetch=BackwardPrefetch.BACKWARD_PRE; keep "
                "limit_all_gathers=True so the prefetched all-gathers do not run ahead of memory")
    return "DDP bucket_cap_mb, FSDP2 prefetching"


def _training_verdict(shares: dict[str, float], seen: bool = True, compiled: str = "",
                      parts: OtherParts | None = None, model: str = "") -> Verdict:
    """The verdict's rules for training time."""
    data = shares.get("data_wait_s", 0.0)
    compute = shares.get("forward_s", 0.0) + shares.get("backward_s", 0.0)
    if data >= INPUT_BOUND:
        return _verdict("input-bound", f"{data:.0%} of step time waits for data",
                        "the model idles while the loader works (more workers, tp.data.Loader)")
    if shares.get("h2d_s", 0.0) >= COPY_BOUND:
        return _verdict("copy-bound", f"{shares['h2d_s']:.0%} of step time copies batches to the device",
                        "pin_memory, non_blocking copies, prefetch")
    if shares.get("offload_s", 0.0) >= OFFLOAD_BOUND:
        return _verdict("offload-bound", f"{shares['offload_s']:.0%} of step time moves or updates offloaded "
                        "optimizer state on the host",
                        "hide it: the streaming step or delayed_update=True of tp.offload.CPUOffloadAdamW; "
                        "shorten it: all cores in torch.set_num_threads, cores bound to the rank, bf16 moments, "
                        "kernel='auto'")
    if shares.get("comm_s", 0.0) >= COMM_BOUND:
        return _verdict("comm-bound", f"{shares['comm_s']:.0%} of step time waits in collectives",
                        "in a multi-rank run, find the rank that holds the others back (tp.load_ranks(dir).stragglers()); "
                        f"otherwise overlap communication ({_overlap_knobs(model)}) or send fewer bytes")
    if shares.get("optimizer_s", 0.0) >= OPTIMIZER_BOUND:
        return _verdict("optimizer-bound", f"{shares['optimizer_s']:.0%} of step time is the optimizer",
                        "fused/foreach kernels, fewer parameter tensors (weight averaging counts here: an "
                        "AveragedModel averages with foreach kernels given multi_avg_fn=get_ema_multi_avg_fn())")
    if compiled and shares.get("other_s", 0.0) >= OVERHEAD_BOUND:
        # the step's compiled graphs (its forward and optimizer step), not Python between phases: a
        # step compiled whole had read OVERHEAD-BOUND 44-100%, advice about logging and .item()
        return _verdict("compute-bound", f"{shares['other_s'] + compute:.0%} of step time is the compiled step "
                        f"{compiled} ({shares['other_s']:.0%} inside its graphs, where tpkit sees no phase)",
                        "compile the model alone (torch.compile(model)) for its forward, backward and optimizer apart"
                        + ("" if seen else f"; {UNSEEN_LOADER}: {WATCH_IT}"))
    if shares.get("other_s", 0.0) >= OVERHEAD_BOUND:
        return _overhead_verdict(shares["other_s"], seen, parts)
    if data >= INPUT_LIMITED:
        return _verdict("input-limited", f"data wait is {data:.0%} of step time (forward+backward {compute:.0%})",
                        "the loader almost keeps up: more workers are worth a try")
    return _verdict("compute-bound", f"forward+backward take {compute:.0%} of step time",
                    "the input pipeline keeps up" if seen else f"{UNSEEN_LOADER}: {WATCH_IT} to time it")


def _with_hooks(v: Verdict, model: dict[str, Any], steps: int) -> Verdict:
    """A compute-bound verdict where a tracker's hooks sit on the trained model
    (``meta["model"]["hooks"]``, capture/foreign_hooks.py) and log within the ``steps`` profiled:
    their time is inside forward and backward, and the advice names them first (wandb.watch(log="all",
    log_freq=1) had made 90% of a step forward and backward, "COMPUTE-BOUND" with no word of it).
    Other packages' hooks (how a model may train: a ZeRO-style gather) get no advice here."""
    hooks, every = model.get("hooks"), model.get("hooks_log_freq")
    if v.kind != "compute-bound" or not isinstance(hooks, dict) or not hooks:
        return v
    remedy = hooks_remedy(hooks, every if isinstance(every, dict) else None, steps)
    if not remedy:
        return v
    trackers = {name: n for name, n in hooks.items() if name in TRACKERS}
    return _verdict(v.kind, v.evidence, f"{hooks_phrase(trackers)} run inside forward and backward: "
                    f"{remedy}; " + v.advice)


#: The overhead verdict's advice where nothing says where ``other`` sits (no spans: a frame by hand).
GUESS = "Python between phases, logging, .item() syncs"


def phases_text(shares: dict[str, float]) -> str:
    """``"your phase 'logging' 77%"``: the user's phases with their shares of step time, in
    words (the one place that says them: the time line, the verdict and the advice)."""
    if not shares:
        return ""
    return (f"your phase{'s' if len(shares) > 1 else ''} "
            + " and ".join(f"'{p}' {v:.0%}" for p, v in shares.items()))


def your_phases(parts: OtherParts, other: float, least: float = USER_PHASE_NAMED) -> str:
    """``"your phase 'logging' 77%"``: the user's phases holding at least ``least`` of ``other``
    (a share of step time), with their shares of step time."""
    return phases_text({p: other * f for p, f in parts.phases.items() if f >= least})


def _overhead_verdict(other: float, seen: bool, parts: OtherParts | None) -> Verdict:
    """OVERHEAD-BOUND, saying where the time outside every phase sits: in phases the user named
    (``tp.phase``), else in one place of the step, else spread over it. A logger sleeping 30 ms
    after each update, or a phase the user named "logging" taking 77% of each step, had both read
    "outside every known phase; Python between phases, logging, .item() syncs"."""
    evidence = f"{other:.0%} of step time is outside every known phase"
    unseen = f"{UNSEEN_LOADER}: {WATCH_IT}"
    if parts is None:
        return _verdict("overhead-bound", evidence, GUESS if seen else f"{unseen}; else {GUESS}")
    mine = [p for p, f in parts.phases.items() if f >= USER_PHASE_NAMED]
    if parts.named >= USER_PHASES_OF_OTHER and mine:
        names = " and ".join(f"'{p}'" for p in mine)
        advice = (f"{names} {'is' if len(mine) == 1 else 'are'} code you named with tp.phase, which tpkit counts "
                  "as other: if it runs every step (logging, metrics), run it every n steps instead; else make it "
                  "cheaper, nesting tp.phase inside it to find the part that takes the time")
        return _verdict("overhead-bound", f"{other:.0%} of step time is outside every built-in phase, of it "
                        f"{your_phases(parts, other)}", advice if seen else f"{advice}; {unseen}")
    yours = your_phases(parts, other)
    yours = f" ({yours})" if yours else ""
    place, frac = parts.top_place()
    if frac >= ONE_PLACE:
        where, what = PLACES.get(place, (place, NAME_IT))
        return _verdict("overhead-bound", f"{evidence}, {other * frac:.0%} {where}{yours}",
                        what if seen else f"{unseen}; else {what}")
    spread = ", ".join(f"{place_text(p)} {other * f:.0%}" for p, f in list(parts.places.items())[:3])
    advice = f"{GUESS}: {NAME_IT}"
    return _verdict("overhead-bound", f"{evidence}, spread over the step ({spread}){yours}",
                    advice if seen else f"{unseen}; else {advice}")


def _clock_rows(clocks: dict) -> list[tuple]:
    """Summary figures from a ClockSummary dict: energy per sample and the clock correlation."""
    rows: list[tuple] = []
    for device, e in (clocks.get("energy") or {}).items():
        rows.append((f"energy per sample ({device})", e["per_sample_j"], "J"))
    if clocks.get("metric") and clocks.get("clock_moved"):
        rows.append((f"step time vs {clocks['metric']} r", clocks["correlation"], ""))
    return rows


#: A first measured step this many times the others' median is one-time work (first_step_note).
FIRST_STEP_OUTLIER = 3.0


def first_step_note(m: pd.DataFrame, warmup_steps: int) -> str | None:
    """With no warmup the slice's first step is measured, and it pays what happens once (a
    trainer's setup, a DataModule's ``prepare_data``, compilation): a Lightning fit's 0.5 s of setup
    made p95 5x p50 and the verdict OVERHEAD-BOUND, with no word. Said when that step is an outlier."""
    if warmup_steps or len(m) < 3:
        return None
    dur = m["duration_s"].to_numpy()
    rest = float(np.median(dur[1:]))
    if not rest > 0 or dur[0] < FIRST_STEP_OUTLIER * rest:
        return None
    row = m.iloc[0]
    cols = [c for c in m.columns if c.endswith("_s") and c != "duration_s"]
    top = max(cols, key=lambda c: float(row[c]) - float(m[c].iloc[1:].median()))
    return (f"the first measured step took {dur[0]:.3f} s, {dur[0] / rest:.1f}x the others' median ({rest:.3f} s), "
            f"most of it {top[:-2]}: with warmup 0 it holds what runs once (a trainer's setup, the first batches' "
            "workers, compilation) and weighs on the shares and the verdict; warmup=1 or 'auto' leaves it out")


#: A collector pause inside a measured step is said (``gc_note``) from this share of its step, or
#: from this long.
GC_NOTE_SHARE = 0.05
GC_NOTE_S = 0.05
_GC_COLUMNS = ["step", "phase", "start_s", "duration_s", "generation", "share"]


def gc_pauses(spans: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """Python's collector pauses (``gc`` spans) in ``steps``, each with the built-in phase it
    interrupted: the deepest built-in span of its step that holds it, ``other`` where none does.
    A ``gc`` span is no built-in phase, so the steps table charged its time to that phase (a full
    collection that landed in ``next()`` read as a wait for data). Columns: step, phase, start_s,
    duration_s, generation (-1 unknown), share (of its step's duration)."""
    if spans is None or spans.empty or steps.empty:
        return pd.DataFrame(columns=_GC_COLUMNS)
    gcs = spans[(spans["phase"] == GC_PHASE) & spans["step"].isin(steps["step"])]
    if gcs.empty:
        return pd.DataFrame(columns=_GC_COLUMNS)
    hosts = spans[spans["phase"].isin(set(BUILTIN_PHASES)) & ~spans["phase"].isin(UNCOUNTED_PHASES)
                  & spans["step"].isin(set(gcs["step"]))]
    by_step = {int(k): g for k, g in hosts.groupby("step")}
    durations = dict(zip(steps["step"].astype(int), steps["duration_s"].astype(float)))
    rows = []
    for g in gcs.itertuples(index=False):
        step = int(g.step)
        h = by_step.get(step)
        phase = OTHER
        if h is not None:
            inside = h[(h["start_s"] <= g.start_s) & (h["end_s"] >= g.end_s) & (h["depth"] < g.depth)]
            if not inside.empty:
                phase = str(inside.sort_values(["depth", "start_s"], kind="stable")["phase"].iloc[-1])
        gen = str(g.source).rsplit("gen", 1)[-1]
        dur = durations.get(step, float("nan"))
        rows.append((step, phase, float(g.start_s), float(g.duration_s), int(gen) if gen.isdigit() else -1,
                     float(g.duration_s) / dur if dur > 0 else float("nan")))
    return pd.DataFrame(rows, columns=_GC_COLUMNS)


def gc_free_steps(steps: pd.DataFrame, pauses: pd.DataFrame) -> pd.DataFrame:
    """``steps`` as the verdict and the advice judge them: the collector's pauses inside
    ``data_wait`` moved from ``data_wait_s`` to ``other_s`` (Python's own time, which no loader
    or worker count shortens). ``run.steps`` itself keeps its contract (each instant charged to
    the deepest built-in phase open at it); this is a copy."""
    waits = pauses[pauses["phase"] == "data_wait"] if not pauses.empty else pauses
    if waits.empty:
        return steps
    moved = waits.groupby("step")["duration_s"].sum()
    out = steps.copy()
    take = np.minimum(out["step"].map(moved).fillna(0.0).to_numpy(dtype="float64"),
                      out["data_wait_s"].to_numpy(dtype="float64"))
    out["data_wait_s"] = out["data_wait_s"] - take
    out["other_s"] = out["other_s"] + take
    return out


def gc_note(pauses: pd.DataFrame, steps: pd.DataFrame) -> str | None:
    """The collector's notable pauses in the measured steps, in words (the longest named), or None."""
    m = set(measured(steps)["step"].astype(int)) if not steps.empty else set()
    if pauses.empty or not m:
        return None
    p = pauses[pauses["step"].isin(m)]
    p = p[(p["duration_s"] > GC_NOTE_S) | (p["share"] > GC_NOTE_SHARE)]
    if p.empty:
        return None
    top = p.loc[p["duration_s"].idxmax()]
    kind = "a full garbage collection" if int(top["generation"]) == 2 else (
        f"a garbage collection (gen{int(top['generation'])})" if int(top["generation"]) >= 0 else "a garbage collection")
    where = "between phases (other)" if top["phase"] == OTHER else f"inside {top['phase']}"
    what = f"{kind} of {top['duration_s'] * 1e3:.0f} ms in step {int(top['step'])}, {where}"
    if top["phase"] == "data_wait":
        what += ": not the loader"
    head = (f"Python's garbage collector paused the loop {len(p)} times in the measured steps "
            f"({p['duration_s'].sum() * 1e3:.0f} ms; the longest: {what})" if len(p) > 1 else what)
    tail = ("; the verdict and the advice count collections inside data_wait as other (Python's own time), "
            "not as waiting for data" if (p["phase"] == "data_wait").any() else "")
    return head + tail + " (gc spans in run.spans)"


def summarize(steps: pd.DataFrame, meta: dict, clocks: pd.DataFrame | None = None,
              memory: pd.DataFrame | None = None, spans: pd.DataFrame | None = None, where: bool = True) -> Summary:
    """The run's summary; with ``clocks`` (``run.clocks``) it also says what clocks and energy did,
    with ``memory`` (``run.memory``) it notes memory that keeps growing from step to step, with
    ``spans`` (``run.spans``) it names the user's phases in ``other`` and where the rest of it sits,
    says the collector's pauses and judges their time as other, never as waiting for data
    (``gc_free_steps``). ``where=False`` skips saying where ``other`` sits (``other_parts``, most of
    a long run's cost): for callers that read only the figures and the verdict's kind (a tuner's
    table), which it leaves as they are."""
    seen = batches_seen(steps, meta)
    pauses = gc_pauses(spans, steps) if spans is not None else pd.DataFrame(columns=_GC_COLUMNS)
    steps = gc_free_steps(steps, pauses)
    m = measured(steps)
    shares = phase_shares(m)
    parts = other_parts(steps, spans, pauses) if where and spans is not None and shares.get("other_s", 0.0) > 0 \
        else None
    total = float(m["duration_s"].sum()) if not m.empty else 0.0
    samples = int(m["samples"].sum()) if not m.empty else 0
    dur = m["duration_s"].to_numpy() if not m.empty else np.array([])
    out = Summary(
        name=str(meta.get("name", "run")),
        steps=len(m),
        warmup_steps=int(meta.get("warmup_steps", 0)),
        complete=bool(meta.get("complete", True)),
        samples=samples,
        total_s=total,
        throughput=samples / total if total > 0 and samples > 0 else float("nan"),
        step_p50_s=float(np.percentile(dur, 50)) if dur.size else float("nan"),
        step_p95_s=float(np.percentile(dur, 95)) if dur.size else float("nan"),
        phase_share=shares,
        data_stall_share=shares.get("data_wait_s", 0.0),
        user_phase_share={p: f * shares["other_s"] for p, f in parts.phases.items()} if parts else {},
        verdict=_with_hooks(verdict(shares, seen, str(meta.get("compiled_step") or ""), parts,
                                    str((meta.get("model") or {}).get("class") or "")),
                            meta.get("model") or {}, len(steps)),
        notes=list(meta.get("notes", [])),
        uncounted=seen and samples == 0,
    )
    paused = gc_note(pauses, steps)
    if paused is not None:
        out.notes.append(paused)
    first = first_step_note(m, out.warmup_steps)
    if first is not None:
        out.notes.append(first)
    skipped = int(m["skipped"].sum()) if "skipped" in m.columns else 0
    if skipped:
        out.notes.append(f"{skipped} of {len(m)} measured steps were skipped by the GradScaler (inf/NaN "
                         "gradients): no parameter update happened in them")
    if clocks is not None and not clocks.empty:
        from .clocks import clock_summary  # only runs with clock rows pay for it

        cs = clock_summary(clocks, steps, meta.get("clocks"))
        if cs is not None:
            out.clocks, out.clock_lines = cs.to_dict(), cs.lines()
    if memory is not None and not memory.empty:
        out.notes += [n for n in memory_notes(memory) if n not in out.notes]
    cost = stream_note(meta, out.step_p50_s)
    if cost is not None and cost not in out.notes:
        out.notes.append(cost)
    return out


def timeline_frame(spans: pd.DataFrame, max_rows: int = 4000, steps: pd.DataFrame | None = None) -> pd.DataFrame:
    """Spans for the stall timeline (warmup flagged, so a chart can fade it), cut to the first
    steps that fit in ``max_rows`` so a long run still draws quickly.

    Time that no span covered, from the slice's start (0 s) to the end of the last step (or
    span), is added as ``other`` rows (``source`` "unattributed"): the timeline draws every
    second of the slice, the stretch before the first span included. With ``steps``
    (``run.steps``) such a stretch is split at step boundaries and numbered by its step, and
    the stretch before the first step is ``tpkit``'s (its probes going in: seconds in a process's
    first slice, which had been drawn as the loop's ``other`` though no step holds it)."""
    s = spans.sort_values("start_s", kind="stable") if not spans.empty else spans
    s = pd.concat([s, _unattributed(s, steps)], ignore_index=True) if not s.empty or steps is not None else s
    s = s.sort_values(["start_s", "depth"], kind="stable").reset_index(drop=True) if not s.empty else s
    if len(s) > max_rows:
        last = s["step"].iloc[max_rows - 1]
        s = s[s["step"] < last]
    return s.assign(duration_ms=s["duration_s"] * 1e3, warmup=s["step"] < 0)


#: Gaps shorter than this are not drawn as ``other`` (the few microseconds between two stamps).
MIN_GAP_S = 20e-6


def _unattributed(spans: pd.DataFrame, steps: pd.DataFrame | None) -> pd.DataFrame:
    """``other`` rows for the stretches of [0, end] that no span covers."""
    cols = list(spans.columns) if len(spans.columns) else ["step", "phase", "start_s", "end_s", "duration_s",
                                                            "depth", "source"]
    counted = spans[~spans["phase"].isin(UNCOUNTED_PHASES)] if not spans.empty else spans
    end = float(counted["end_s"].max()) if not counted.empty else 0.0
    if steps is not None and not steps.empty:
        end = max(end, float(steps["end_s"].max()))
    # the union of the spans (sorted by start): a gap opens where a span starts after every
    # earlier one has ended
    starts = counted["start_s"].to_numpy(dtype="float64") if not counted.empty else np.array([])
    reach = np.maximum.accumulate(counted["end_s"].to_numpy(dtype="float64")) if not counted.empty else np.array([])
    before = np.concatenate([[0.0], reach[:-1]]) if len(reach) else np.array([0.0])
    before = np.maximum(before, 0.0)
    open_at: Any = np.nonzero(starts[: len(before)] - before[: len(starts)] >= MIN_GAP_S)[0] if len(starts) else []
    gaps: list[tuple[float, float]] = [(float(before[i]), float(starts[i])) for i in open_at]
    t = float(reach[-1]) if len(reach) else 0.0
    if end - t >= MIN_GAP_S:
        gaps.append((t, end))
    if steps is not None and not steps.empty:  # cut at step boundaries, each piece numbered by its step
        st = steps.sort_values("start_s")
        s_step, s0, s1 = st["step"].to_numpy(), st["start_s"].to_numpy(dtype="float64"), st["end_s"].to_numpy(dtype="float64")
        cut = []
        for a, b in gaps:
            if a < s0[0] and min(b, s0[0]) - a >= MIN_GAP_S:  # before the first step: tpkit's probes going in
                cut.append((int(s_step[0]), a, min(b, float(s0[0])), "tpkit", "probes install (before the first step)"))
            i = int(np.searchsorted(s1, a, side="right"))  # the first step ending after the gap opens
            while i < len(s0) and s0[i] < b:
                lo, hi = max(a, float(s0[i])), min(b, float(s1[i]))
                if hi - lo >= MIN_GAP_S:
                    cut.append((int(s_step[i]), lo, hi, "other", "unattributed"))
                i += 1
        rows = cut
    else:
        starts = counted["start_s"].to_numpy() if not counted.empty else np.array([])
        step_of = counted["step"].to_numpy() if not counted.empty else np.array([])
        rows = []
        for a, b in gaps:  # the step of the next span (the stretch before the first: the first's)
            i = int(np.searchsorted(starts, a, side="left"))
            rows.append((int(step_of[min(i, len(step_of) - 1)]) if len(step_of) else 0, a, b, "other", "unattributed"))
    out = pd.DataFrame([{"step": st, "phase": phase, "start_s": a, "end_s": b, "duration_s": b - a,
                         "depth": 0, "source": source} for st, a, b, phase, source in rows], columns=cols)
    return out.astype({c: spans[c].dtype for c in cols if c in spans.columns}) if len(spans.columns) else out


def breakdown_long(steps: pd.DataFrame, max_bars: int = 500, max_rows: int = 4000) -> pd.DataFrame:
    """``run.steps`` melted to one row per (step, phase) with seconds, for stacked bars.

    A run of more than ``max_bars`` steps (fewer where many phases took time: at most
    ``max_rows`` rows) is averaged over runs of consecutive steps (a bar is then labelled with
    its first step), so a 10,000-step run still draws quickly. Phases that took no time in any
    step are left out (they draw nothing, and the legend names what happened)."""
    cols = [c for c in PHASE_COLUMNS if c in steps.columns]
    cols = [c for c in cols if (steps[c] != 0).any()] or cols
    max_bars = max(1, min(max_bars, max_rows // len(cols)))
    if len(steps) > max_bars:
        group = np.arange(len(steps)) * max_bars // len(steps)
        agg = steps.groupby(group).agg({"step": "first", "warmup": "all", **{c: "mean" for c in cols}})
        steps = agg.reset_index(drop=True)
    long = steps.melt(id_vars=["step", "warmup"], value_vars=cols, var_name="phase", value_name="seconds")
    long["phase"] = long["phase"].str[:-2]
    long["ms"] = long["seconds"] * 1e3
    return long


def thin_steps(steps: pd.DataFrame, max_rows: int = 400) -> pd.DataFrame:
    """Every k-th row of ``run.steps`` so that at most ``max_rows`` remain (step boundaries
    drawn as rules on a long run: more than a few hundred is a grey wash and a slow chart)."""
    if len(steps) <= max_rows:
        return steps
    k = -(-len(steps) // max_rows)
    return steps.iloc[::k]
