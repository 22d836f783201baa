"""From the Recorder's buffers to the Run's tables, once, when a slice ends.

The steps table is made here: each instant of a step is charged to the innermost built-in
phase open at that instant (``exclusive_phase_times``), and ``other_s`` is what no built-in
phase covered.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pandas as pd

from ..run import Run
from ..schema import (
    BUILTIN_PHASES,
    FILE_LOAD,
    FILE_LOAD_SOURCES,
    JIT_TRACE,
    METRIC_CALL,
    PHASE_COLUMNS,
    SCHEMAS,
    UNCOUNTED_PHASES,
    USER_PHASE_SOURCE,
    frame,
    jsonable,
)
from . import evaluation, read_ahead, sampling
from .losses import step_losses
from .recorder import Recorder
from .setups import setup_spans


def exclusive_phase_times(spans: pd.DataFrame) -> pd.DataFrame:
    """Seconds of each built-in phase per step, each instant charged to the innermost
    built-in phase open at that instant (an h2d copy inside forward is h2d, not forward).

    Innermost: the deepest open span, the latest started among equals. Spans need not nest
    cleanly: on a GPU some are stamped by CUDA events and some on the host, so a span can begin
    a few microseconds before its sibling ends (the offload span inside an optimizer step and
    a ``tpkit`` span beside it, on an H200: charging by a stack of open ancestors counted the
    offload's 583 ms twice). Every instant is charged once.

    User phases (``tp.phase``) do not take time from built-in phases: a built-in phase
    inside a user phase keeps its time, and a user phase's own time falls to ``other``.
    Returns one row per step with columns ``step`` and ``<phase>_s`` for built-in phases.
    Spans of ``UNCOUNTED_PHASES`` (collectives in flight behind compute) are left out.
    """
    cols = [f"{p}_s" for p in BUILTIN_PHASES]
    if len(spans) and spans["phase"].isin(UNCOUNTED_PHASES).any():
        spans = spans[~spans["phase"].isin(UNCOUNTED_PHASES)]
    builtin_spans = spans[spans["phase"].isin(set(BUILTIN_PHASES))] if len(spans) else spans
    steps = sorted(int(k) for k in spans["step"].unique()) if len(spans) else []
    if not steps:
        return pd.DataFrame(columns=["step", *cols])
    rows: dict[int, dict[str, float]] = {k: dict.fromkeys(BUILTIN_PHASES, 0.0) for k in steps}
    # the columns once, grouped by step with numpy (a pandas group per step had cost 1.6 s of a
    # 2,000-step slice's build: ~8,000 column lookups)
    by_step = builtin_spans["step"].to_numpy()
    order = np.argsort(by_step, kind="stable")  # within a step, the spans' own order
    all_starts = builtin_spans["start_s"].to_numpy(dtype="float64")[order]
    all_ends = builtin_spans["end_s"].to_numpy(dtype="float64")[order]
    all_depths = builtin_spans["depth"].to_numpy()[order]
    all_phases = builtin_spans["phase"].to_numpy()[order]
    keys, firsts = np.unique(by_step[order], return_index=True)
    for n, step in enumerate(keys):
        lo, hi = firsts[n], firsts[n + 1] if n + 1 < len(firsts) else len(order)
        acc = rows[int(step)]
        # boundaries in time order, ends before starts at the same instant
        marks: list[tuple[float, int, int]] = []
        starts, depths, phases = all_starts[lo:hi], all_depths[lo:hi], all_phases[lo:hi]
        for i, (a, b) in enumerate(zip(starts.tolist(), all_ends[lo:hi].tolist())):
            if b > a:
                marks += [(a, 1, i), (b, 0, i)]
        marks.sort()
        open_: set[int] = set()
        last = None
        for t, kind, i in marks:
            if open_ and last is not None and t > last:
                top = max(open_, key=lambda j: (depths[j], starts[j], j))
                acc[str(phases[top])] += t - last
            if kind:
                open_.add(i)
            else:
                open_.discard(i)
            last = t
    out = pd.DataFrame.from_dict({k: {f"{p}_s": v for p, v in r.items()} for k, r in rows.items()}, orient="index")
    out.index.name = "step"
    return out.reset_index()


def step_breakdown(spans: pd.DataFrame, bounds: pd.DataFrame) -> pd.DataFrame:
    """``run.steps`` from spans and step bounds (columns: step, warmup, start_s, end_s,
    samples, loss, skipped). ``other_s`` is what no built-in phase covered."""
    phases = exclusive_phase_times(spans)
    phases["step"] = phases["step"].astype("int64")
    out = bounds.merge(phases, on="step", how="left")
    for c in PHASE_COLUMNS[:-1]:
        out[c] = out[c].astype("float64").fillna(0.0)
    out["duration_s"] = out["end_s"] - out["start_s"]
    covered = out[list(PHASE_COLUMNS[:-1])].sum(axis=1)
    out["other_s"] = (out["duration_s"] - covered).clip(lower=0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        out["throughput"] = np.where(out["duration_s"] > 0, out["samples"] / out["duration_s"], np.nan)
    return out


def build_run(rec: Recorder, warmup_steps: int, meta: dict | None = None) -> Run:
    """The Run of a finished (or interrupted) slice, from its Recorder's buffers. Warmup
    steps are renumbered ``-warmup .. -1``; CUDA events are resolved here, once."""
    t0 = rec.t0_ns
    timer = rec.cuda_timer
    if timer is not None:
        timer.finish()

    def at(ns: int, ev: Any) -> float:
        return ((timer.resolve(ev) if (timer is not None and ev is not None) else ns) - t0) / 1e9

    # Past a full slice (a framework asked to stop, and ends its step and its run before the
    # slice closes) nothing belongs to the slice any more.
    past = rec.slice_steps if rec.slice_steps is not None else len(rec.step_ends) + 1
    raw_spans = evaluation.without_training_runs(rec.spans)  # a trainer's run is no evaluation
    # evaluation inside the slice: its calls and waits are ``eval``, its samples not the steps'
    ev = evaluation.split(raw_spans, rec.handouts, rec.no_grad_calls, rec.trained_modules,
                          rec.param_free_modules, past, rows=len(rec.step_ends), sources=rec.handout_sources,
                          train_mode_calls=rec.no_grad_train_calls, step_ends=[e for e, _ in rec.step_ends],
                          shutdowns=rec.shutdowns)
    relabel = evaluation.relabel_span if ev else (lambda _ev, phase, _s, _e: phase)
    spans = frame("spans", [
        (step - warmup_steps, relabel(ev, phase, s, e), at(s, sev), at(e, eev), 0.0, depth, source)
        for phase, s, e, depth, source, step, sev, eev in raw_spans + setup_spans(rec, ev.handouts, past)
        + evaluation.glue_spans(ev)
        if step < past
    ])
    spans["duration_s"] = spans["end_s"] - spans["start_s"]
    spans = spans.sort_values(["start_s", "depth"], kind="stable").reset_index(drop=True)

    # Step bounds: a step runs from the end of the previous one (for the first: the slice's
    # start once its probes were in) to the end of its optimizer step. On a GPU, the end is the GPU's.
    ends = [(e - t0) / 1e9 for e, _ in rec.step_ends]
    if timer is not None:
        gpu_ends = [at(e, rec.step_events.get(i)) for i, (e, _) in enumerate(rec.step_ends)]
        ends = _gpu_step_ends(spans, gpu_ends, warmup_steps)
    # the step's loss, and the first step's batches read ahead (losses.py, read_ahead.py)
    slice_steps = min(past, len(ends))
    losses, loss_notes = step_losses(rec, slice_steps)
    # batches whose forward raised, skipped by the loop: none of the rules below counts them again
    skipped, unmatched = ({}, []) if rec.samples_per_step is not None else \
        read_ahead.failed(rec.failed_forwards, raw_spans, rec.handouts, rec.handout_ids, ev.handouts, slice_steps)
    extra_batches, extra_samples = (0, 0) if rec.samples_per_step is not None else \
        read_ahead.read_ahead(rec.handouts, ev.handouts, slice_steps, Counter([*skipped.values(), *unmatched]))
    dropped = {} if rec.samples_per_step is not None else \
        read_ahead.discarded(rec.restarts, raw_spans, rec.handouts, rec.handout_sources,
                             ev.handouts | set(skipped), slice_steps, rec.source_datasets)
    skipped_by_step: Counter[int] = Counter()
    for k, step in skipped.items():
        skipped_by_step[step] += rec.handouts[3 * k + 1]
    bounds = pd.DataFrame({
        "step": np.arange(len(ends), dtype="int64") - warmup_steps,
        "warmup": np.arange(len(ends)) < warmup_steps,
        "start_s": [(rec.first_step_ns - t0) / 1e9, *ends[:-1]] if ends else [],
        "end_s": ends,
        "samples": np.array([n if rec.samples_per_step is not None else
                             n - ev.samples_by_step.get(i, 0) - (extra_samples if i == 0 else 0)
                             - sum(dropped.get(i, ())) - skipped_by_step[i]
                             for i, (_, n) in enumerate(rec.step_ends)], dtype="int64"),
        "loss": [losses.get(i, float("nan")) for i in range(len(ends))],
        "skipped": [i in rec.skipped for i in range(len(ends))],
    })
    steps = frame("steps", step_breakdown(spans, bounds)[list(SCHEMAS["steps"])])

    memory_rows = evaluation.relabel_memory(ev, rec.memory, raw_spans)
    memory = frame("memory", [
        (step - warmup_steps, phase, event, (t - t0) / 1e9, device, category, nbytes)
        for step, phase, event, t, device, category, nbytes in memory_rows if step < past
    ])
    clocks = frame("clocks", [((t - t0) / 1e9, d, m, v) for t, d, m, v in rec.clocks])
    loader = frame("loader", rec.loader)
    full_meta = {**rec.meta, **(meta or {})}
    full_meta.setdefault("name", rec.name)
    full_meta["warmup_steps"] = warmup_steps
    full_meta["notes"] = list(rec.notes) + list(full_meta.get("notes", []))
    full_meta["notes"] += loss_notes
    loads = _file_load_note(spans)
    if loads:
        full_meta["notes"].append(loads)
    metrics = _metric_call_note(spans)
    if metrics:
        full_meta["notes"].append(metrics)
    traces = _jit_trace_note(spans)
    if traces:
        full_meta["notes"].append(traces)
    if extra_batches:
        full_meta["notes"].append(read_ahead.note(extra_batches, extra_samples))
    if dropped:
        full_meta["notes"].append(read_ahead.discarded_note(sum(len(v) for v in dropped.values()),
                                                            sum(sum(v) for v in dropped.values())))
    if skipped:
        full_meta["notes"].append(read_ahead.failed_note(len(skipped), sum(skipped_by_step.values())))
    if unmatched:
        full_meta["notes"].append(read_ahead.unmatched_note(len(unmatched)))
    if rec.loader_make_s > 0 and isinstance(full_meta.get("loader"), dict):
        full_meta["loader"]["make_cpu_share"] = min(1.0, rec.loader_cpu_s / rec.loader_make_s)
    trained_at = [k for k, w in enumerate(rec.handout_workers)
                  if w >= 0 and k not in ev.handouts and rec.handouts[3 * k + 2] < past]
    trained = Counter(rec.handout_workers[k] for k in trained_at)
    if trained:  # the training batches' torch DataLoader (the one most of them came from)
        workers, batches = trained.most_common(1)[0]
        full_meta["torch_loader"] = {**_training_loader_settings(rec, trained_at, workers),
                                     "num_workers": workers, "batches": batches}
    # training batches a loader or tp.watch handed out: samples_per_step (or DeepSpeed's engine)
    # fills in the samples where none was seen, and the verdict's "no loader was seen" reads this
    # (an evaluation's batches are not the training's: a validation loader had silenced it)
    full_meta["batches_seen"] = sum(1 for k, step in enumerate(rec.handouts[2::3]) if step < past and k not in ev.handouts)
    uncounted = sum(1 for i in range(0, len(rec.handouts), 3) if rec.handouts[i + 1] == 0 and rec.handouts[i + 2] < past)
    if uncounted and rec.samples_per_step is None and rec.uncounted is not None:
        full_meta["notes"].append(f"{uncounted} batch(es) read in the slice held samples tpkit could not count "
                                  f"(a {rec.uncounted}: no batch_size or num_graphs it says, no tensor, array, mapping, "
                                  "sequence or dataclass field to take a leading dimension from, or tensors whose "
                                  "leading dimensions differ): samples/s leaves them out; give the batch size "
                                  "with samples_per_step=N (--samples-per-step N)")
    given = _samples_given_note(rec, ev.handouts, past)
    if given:
        full_meta["notes"].append(given)
    counted = steps["samples"].to_numpy()
    unfed = [i for i in range(len(counted)) if counted[i] == 0 and steps["forward_s"].iloc[i] > 0]
    if rec.samples_per_step is None and unfed == [0] and len(counted) > 1:
        # only the first: the loop's steps end before their iteration reads its batches (a WGAN's
        # generator stepped first, then the critic's steps on a batch each), not an unseen source
        full_meta["notes"].append(
            "the first step ran a forward on no batch, and every later step read its batches: the loop's "
            "steps end before their iteration reads its batches (a lead optimizer stepped before the others "
            "read theirs: each step holds its update and the others' updates of the iteration before), so the "
            "first holds no batch and its samples are 0")
    elif rec.samples_per_step is None and unfed and len(unfed) < len(counted):
        # batches that reached the model through no loader tpkit sees (itertools.cycle replaying
        # an epoch's batches, a cache, a generator not wrapped in tp.watch): samples/s had read
        # 22.5 for 112, with no word
        full_meta["notes"].append(
            f"{len(unfed)} of {len(counted)} steps ran a forward on no batch tpkit saw handed out (itertools.cycle "
            "over a loader replays the batches it kept; a cache or a generator not wrapped in tp.watch hands "
            "them over unseen): their samples are 0, so samples/s reads low; wrap the source in tp.watch(...) "
            "or give samples_per_step=N")
    eval_s = float(steps["eval_s"].sum())
    if ev and evaluation.in_rows(ev, eval_s):
        full_meta["evaluation"] = evaluation.describe(ev)
        full_meta["notes"].append(evaluation.note(ev, eval_s))
    sampled = sampling.train_mode_runs(rec.no_grad_train_calls, rec.no_grad_calls, rec.trained_modules, raw_spans,
                                       rec.handouts, ev, min(len(rec.step_ends), past))
    if sampled.calls:
        full_meta["notes"].append(sampling.note(sampled))
    return Run(steps, spans, memory, clocks, loader, jsonable(full_meta))


def _gpu_step_ends(spans: pd.DataFrame, host_ends: list[float], warmup_steps: int) -> list[float]:
    """On a GPU, step k ends when its end event completes on the GPU (``host_ends`` holds those,
    resolved) or its last optimizer span ends there, whichever is later."""
    opt = spans[spans["phase"] == "optimizer"].groupby("step")["end_s"].max()
    return [float(max(h, opt.get(i - warmup_steps, h))) for i, h in enumerate(host_ends)]


def _samples_given_note(rec: Recorder, eval_handouts: set[int], past: int) -> str | None:
    """Where ``samples_per_step`` was given and the batches tpkit counted say otherwise: the
    given figure stays (it is the documented override), and the run says what the batches held
    (the most common count of a step's training batches). A given 5 for 16-row batches had read
    237 samples/s for 759, with no word."""
    given = rec.samples_per_step
    if given is None:
        return None
    by_step: Counter[int] = Counter()
    sizes: Counter[int] = Counter()
    h = rec.handouts
    for k in range(len(h) // 3):
        n, step = h[3 * k + 1], h[3 * k + 2]
        if n and k not in eval_handouts and step < past:
            by_step[step] += n
            sizes[n] += 1
    if not by_step:
        return None
    held = Counter(by_step.values()).most_common(1)[0][0]
    if held == given:
        return None
    batch = sizes.most_common(1)[0][0]
    each = f"{held} samples a step" + (f" (batches of {batch})" if batch != held else "")
    return (f"samples_per_step={given} given, and samples/s counts it; the batches handed out held {each}: "
            "leave samples_per_step out for tpkit to count them")


def _training_loader_settings(rec: Recorder, trained_at: list[int], workers: int) -> dict[str, Any]:
    """The settings (``batches.loader_settings``) of the DataLoader most of the training batches
    came from (``Recorder.loader_settings``, by loader: a one-off pass over the training set with
    another loader, 0 workers and batches of 512, had been taken for the 2-worker training
    loader, its num_workers too), where they have the batches' worker count; else (no training
    batch came through a DataLoader iterated in the slice) the slice's DataLoaders with that
    worker count where they agree; {} where none says."""
    settings = rec.loader_settings
    by_source = Counter(rec.handout_sources[k] for k in trained_at if rec.handout_sources[k] in settings)
    candidates = [settings[by_source.most_common(1)[0][0]]] if by_source else list(settings.values())
    same = [s for s in candidates if s.get("num_workers") == workers]
    return dict(same[0]) if same and all(s == same[0] for s in same) else {}


def _file_load_note(spans: pd.DataFrame) -> str | None:
    """What the loop's own file reads (``schema.FILE_LOAD`` spans: ``torch.load``, safetensors)
    took in the measured steps, and how much of it is ``other`` (no built-in phase open around
    it): a checkpoint read back mid-slice (127 ms) had been other with no word. By their sources:
    a user's own ``tp.phase`` of the same name had read as files read."""
    loads = spans[(spans["phase"] == FILE_LOAD) & spans["source"].isin(FILE_LOAD_SOURCES) & (spans["step"] >= 0)]
    if loads.empty:
        return None
    other_s = _in_other(spans, loads)
    steps = sorted({int(k) for k in loads["step"]})
    shown = ", ".join(map(str, steps[:8])) + (", ..." if len(steps) > 8 else "")
    return (f"files were read in the loop {len(loads)} time(s) in the measured steps ({', '.join(sorted(set(loads['source'])))}; "
            f"step{'s' if len(steps) != 1 else ''} {shown}): {float(loads['duration_s'].sum()) * 1e3:.1f} ms, "
            f"{other_s * 1e3:.1f} ms of it counted in other (a checkpoint read back, or batches read with no "
            "loader: tpkit cannot tell which; the timeline shows them as 'files loaded')")


def _in_other(spans: pd.DataFrame, inside: pd.DataFrame) -> float:
    """How much of the spans ``inside`` (rows of ``spans``) no built-in phase is open around: other."""
    inner = spans[spans["phase"].isin(set(BUILTIN_PHASES) - {"tpkit"}) & (spans["step"] >= 0)]
    other_s = 0.0
    for s, e in zip(inside["start_s"].to_numpy(), inside["end_s"].to_numpy()):
        around = inner[(inner["start_s"] <= s) & (inner["end_s"] >= e)]
        other_s += 0.0 if len(around) else float(e - s)
    return other_s


def _jit_trace_note(spans: pd.DataFrame) -> str | None:
    """What ``torch.jit.trace`` (``schema.JIT_TRACE`` spans) took in the measured steps, and how
    much of it is other: TensorBoard's ``add_graph`` traces the model, whose calls had read as
    an evaluation inside the slice."""
    traces = spans[(spans["phase"] == JIT_TRACE) & (spans["source"] != USER_PHASE_SOURCE) & (spans["step"] >= 0)]
    if traces.empty:
        return None
    return (f"torch.jit.trace ran inside the slice {len(traces)} time(s) (TensorBoard's add_graph? tensorboardX's, "
            f"Lightning's log_graph=True): {float(traces['duration_s'].sum()):.3f} s, "
            f"{_in_other(spans, traces):.3f} s of it in other; its calls of the model are neither forward nor "
            "evaluation (the timeline shows them as 'torch.jit.trace'); log the graph before or after profiling")


def _metric_call_note(spans: pd.DataFrame) -> str | None:
    """What the loop's calls of metric modules (``schema.METRIC_CALL`` spans: ``train_acc(logits,
    y)``, torchmetrics' update and compute on the batch) took in the measured steps: their time is
    other, not forward. A metric whose compute took 77% of the step had been the model's forward
    (COMPUTE-BOUND, with no word)."""
    calls = spans[(spans["phase"] == METRIC_CALL) & (spans["source"] != USER_PHASE_SOURCE) & (spans["step"] >= 0)]
    if calls.empty:
        return None
    names = ", ".join(sorted(set(calls["source"].astype(str)))[:4])
    return (f"metric modules were called {len(calls)} time(s) in the measured steps ({names}: an update and a "
            f"compute on the batch each): {float(calls['duration_s'].sum()) * 1e3:.1f} ms, "
            f"{_in_other(spans, calls) * 1e3:.1f} ms of it counted in other, not forward (the timeline shows them "
            "as 'metric calls'); where that is much, update the metric each step and compute it only when you log")
