"""Per-step analysis: shares, verdicts and the summary, as pure functions from frames.

Nothing here measures or draws. Every function takes the Run's tables (or a hand-made frame
with the same columns) so tests can check each rule on numbers chosen by hand.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from ..schema import PHASE_COLUMNS, UNCOUNTED_PHASES, VERDICTS
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
    data_stall_share: float = 0.0
    verdict: Verdict = field(default_factory=lambda: _verdict("no-steps", "no steps were measured"))
    notes: list[str] = field(default_factory=list)
    clocks: dict = field(default_factory=dict)  # analysis.clocks.ClockSummary.to_dict(), when clocks were sampled
    clock_lines: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

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
        rows += _clock_rows(self.clocks)
        return pd.DataFrame(rows, columns=["figure", "value", "unit"])

    def to_text(self) -> str:
        lines = [f"tpkit run '{self.name}'" + ("" if self.complete else " (INCOMPLETE)")]
        if self.steps == 0:
            lines.append("  no measured steps")
        else:
            lines.append(f"  {self.steps} steps (+{self.warmup_steps} warmup), "
                         f"{_rate(self.throughput)}, step p50 {self.step_p50_s * 1e3:.2f} ms, "
                         f"p95 {self.step_p95_s * 1e3:.2f} ms")
            shares = ", ".join(f"{c[:-2]} {v:.0%}" for c, v in self.phase_share.items() if v >= 0.005)
            lines.append(f"  time: {shares}")
        lines.append(f"  verdict: {self.verdict.text}")
        lines += [f"  {c}" for c in self.clock_lines]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


#: Why samples/s is unknown when steps were timed: no batch was seen, or none whose samples
#: could be counted (the run's notes then name the batch's type).
RATE_UNKNOWN = ("no samples counted: read batches through a DataLoader or tp.watch, or give samples_per_step")


def _rate(throughput: float) -> str:
    if throughput != throughput:  # NaN
        return f"samples/s unknown ({RATE_UNKNOWN})"
    return f"{throughput:,.1f} samples/s"


def measured(steps: pd.DataFrame) -> pd.DataFrame:
    """The steps after warmup."""
    return steps[~steps["warmup"].astype(bool)] if not steps.empty else steps


def phase_shares(steps: pd.DataFrame) -> dict[str, float]:
    """Share of total step time per phase column (sums to 1 when any time was measured)."""
    total = float(steps["duration_s"].sum()) if not steps.empty else 0.0
    if total <= 0:
        return {c: 0.0 for c in PHASE_COLUMNS}
    return {c: float(steps[c].sum()) / total for c in PHASE_COLUMNS}


#: The advice where no batch was seen in the slice (``batches_seen``): a loader tpkit does not
#: see (a torchdata.nodes Loader, a generator) waits inside ``other``. A loop spending 71% of
#: each step in such a loader's next() had read "Python between phases, logging, .item() syncs".
UNSEEN_LOADER = "no loader was seen (data_wait 0, no batch counted), so other may be waiting for data"
WATCH_IT = ("wrap the loader in tp.watch(...), or the function that makes the batches "
            "(get_batch = tp.watch(get_batch))")


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


def verdict(shares: dict[str, float], seen: bool = True, compiled: str = "") -> Verdict:
    """The one-line bottleneck verdict from phase shares. Order: the first rule that fires.
    Every verdict's name comes from ``schema.VERDICTS``; a run is called one thing only.
    ``seen``: whether any batch was seen (``batches_seen``); if not, the advice says so.
    ``compiled``: the torch.compile'd function the whole step ran in (``meta["compiled_step"]``),
    whose forward and optimizer step tpkit cannot see: its ``other`` is that function's graphs.

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
            return _verdict(kind, f"{share:.0%} of step time is {what} inside the slice",
                            f"training alone would run up to {1 / (1 - share):.2f}x faster: {knobs}; "
                            f"the other shares are of training and {others} together")
    away = sum(share for share, _ in breaks)
    if away <= 0.0:
        return _training_verdict(shares, seen, compiled)
    training = {c: v / (1 - away) for c, v in shares.items() if c not in INTERRUPTIONS}
    v = _training_verdict(training, seen, compiled)
    if v.kind == "no-steps":
        return v
    evidence = v.evidence.replace("of step time", "of training time")
    left = " and ".join(f"{what} {shares[c]:.0%}" for c, (_, what, _) in INTERRUPTIONS.items() if shares.get(c, 0.0) > 0)
    return _verdict(v.kind, f"{evidence} ({left} of the step left out)", v.advice)


def _training_verdict(shares: dict[str, float], seen: bool = True, compiled: str = "") -> Verdict:
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
                        "otherwise overlap communication (DDP bucket_cap_mb, FSDP2 prefetching) or send fewer bytes")
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
        return _verdict("overhead-bound", f"{shares['other_s']:.0%} of step time is outside every known phase",
                        "Python between phases, logging, .item() syncs" if seen else
                        f"{UNSEEN_LOADER}: {WATCH_IT}; else Python between phases, logging, .item() syncs")
    if data >= INPUT_LIMITED:
        return _verdict("input-limited", f"data wait is {data:.0%} of step time (forward+backward {compute:.0%})",
                        "the loader almost keeps up: more workers are worth a try")
    return _verdict("compute-bound", f"forward+backward take {compute:.0%} of step time",
                    "the input pipeline keeps up" if seen else f"{UNSEEN_LOADER}: {WATCH_IT} to time it")


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


def summarize(steps: pd.DataFrame, meta: dict, clocks: pd.DataFrame | None = None,
              memory: pd.DataFrame | None = None) -> Summary:
    """The run's summary; with ``clocks`` (``run.clocks``) it also says what clocks and energy did,
    with ``memory`` (``run.memory``) it notes memory that keeps growing from step to step."""
    m = measured(steps)
    shares = phase_shares(m)
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
        verdict=verdict(shares, batches_seen(steps, meta), str(meta.get("compiled_step") or "")),
        notes=list(meta.get("notes", [])),
    )
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
