"""Memory analysis: pure functions over ``run.memory`` (columns in DESIGN.md).

Rows come in groups: one group per (boundary, device) with one row per category. Every
function here takes the long frame (or a hand-made one with the same columns) and returns
frames or small dicts, in bytes. Nothing measures, nothing draws.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from ..schema import CPU_SOURCE_COUNTER, MEMORY_CATEGORIES, PHASE_NAMES, fmt_bytes

_GROUP = ["step", "t_s", "phase", "event", "device"]

#: Growth rule: over at least LEAK_MIN_STEPS measured steps, the end-of-step level rose in at
#: least LEAK_RISING_SHARE of step-to-step transitions, never fell by more than it rose, and
#: grew by at least LEAK_MIN_BYTES in all (or LEAK_MIN_SHARE of the first level).
LEAK_MIN_STEPS = 3
LEAK_RISING_SHARE = 0.75
LEAK_MIN_BYTES = 1 << 20
LEAK_MIN_SHARE = 0.05

#: What torch's profiler costs the loop per allocator event while the CPU memory stream is on
#: (its report of each allocation and free), measured inside real steps on a 2-core EPYC VM:
#: ~800 events cost ~150-175 us of a 2-layer GPT-2 step (docs/OVERHEAD.md). An estimate for
#: other machines, said as one: the run cannot time it (it lands inside the ops that allocate).
STREAM_EVENT_COST_S = 0.2e-6
#: The same with tpkit's CPU allocation counter (``cpu_source`` CPU_SOURCE_COUNTER): the default
#: against memory off over the step's events, on 2-layer GPT-2 steps of 7-8 ms under the HF
#: Trainer and Lightning (0.12-0.16 ms a step for 816 and 1,244 events; the stream's default read
#: 0.21-0.25 ms in the same runs). It holds the memory probe's own work too: the counter alone
#: did not read above noise on a bare step (docs/OVERHEAD.md, "tpkit's own CPU allocation counter").
COUNTER_EVENT_COST_S = 0.14e-6
#: The stream's estimated share of the median step at which the summary says what it cost.
STREAM_NOTE_MIN_SHARE = 0.01
#: Events held by one slice's stream past which the summary says a long slice costs more: torch
#: keeps every event until the slice ends, and on the 2-core VM a profile's cost climbed from
#: ~1.07x to ~1.10x a step over ~4.5 million of them, and 8 million took 130 s to hand back
#: (docs/OVERHEAD.md, "A profile's cost grows with its length").
STREAM_LONG_EVENTS = 1_000_000


def wide(memory: pd.DataFrame, events: tuple[str, ...] = ("enter", "exit")) -> pd.DataFrame:
    """One row per (boundary, device): ``step, t_s, phase, event, device``, one column per
    category (bytes) and ``total_bytes``, in time order."""
    m = memory[memory["event"].isin(events)] if not memory.empty else memory
    cols = [*_GROUP, *MEMORY_CATEGORIES, "total_bytes"]
    if m.empty:
        return pd.DataFrame(columns=cols)
    w = m.pivot_table(index=_GROUP, columns="category", values="bytes", aggfunc="sum", fill_value=0)
    for c in MEMORY_CATEGORIES:
        if c not in w.columns:
            w[c] = 0
    w = w[list(MEMORY_CATEGORIES)].astype("int64").reset_index()
    w["total_bytes"] = w[list(MEMORY_CATEGORIES)].sum(axis=1)
    order = {"enter": 0, "exit": 1, "peak": 2}
    w = w.assign(_o=w["event"].map(order)).sort_values(["t_s", "_o"], kind="stable").drop(columns="_o")
    return w.reset_index(drop=True)[cols]


def main_device(memory: pd.DataFrame) -> str | None:
    """The device whose memory matters most: the one with the highest total at any boundary."""
    w = wide(memory, ("enter", "exit", "peak"))
    if w.empty:
        return None
    return str(w.groupby("device")["total_bytes"].max().idxmax())


def memory_peak(memory: pd.DataFrame, device: str | None = None,
                approximate: list[str] | tuple[str, ...] | None = None) -> pd.DataFrame:
    """What was alive at the peak of the measured steps (never a warmup step): one row per
    (device, category) with ``bytes`` and the ``step`` and ``phase`` of the peak
    (``total_bytes`` repeated on each row for convenience).

    ``mix_exact`` says whether the split into categories was taken at the peak's instant
    (the CPU allocation stream replayed to it) or is approximate: the devices listed in
    ``approximate`` (``run.meta["memory"]["approximate_mix"]``: CUDA, whose known sets come
    from the phase boundary, and the CPU when no allocator stream could be replayed). The
    total is the peak either way, except on a CUDA device listed in
    ``run.meta["memory"]["peak_lower_bound"]``, whose peak may be higher than this (the run's
    notes say so). Empty when no measured step has memory rows."""
    w = wide(memory, ("enter", "exit", "peak"))
    cols = ["device", "step", "phase", "category", "bytes", "total_bytes", "mix_exact"]
    if device is not None:
        w = w[w["device"] == device]
    w = w[w["step"] >= 0]
    if w.empty:
        return pd.DataFrame(columns=cols)
    rough = set(approximate or ())
    out = []
    for dev, g in w.groupby("device", sort=True):
        top = g.loc[g["total_bytes"].idxmax()]
        exact = dev not in rough
        for c in MEMORY_CATEGORIES:
            out.append((dev, int(top["step"]), top["phase"], c, int(top[c]), int(top["total_bytes"]), exact))
    return pd.DataFrame(out, columns=cols)


#: At most this many bars per step in a waterfall: more would be unreadable (and too many rows
#: for a chart); past it neighbouring stretches are merged.
MAX_BARS = 40


def waterfall(memory: pd.DataFrame, step: int, device: str = "cpu", max_bars: int = MAX_BARS) -> pd.DataFrame:
    """The waterfall of one step on one device, its stretches in the order they ran.

    The first bar (``label`` "start of step") is the level at the step's first boundary,
    stacked by category from zero. Each later bar is the stretch between two boundaries,
    named for a person after the innermost phase open during it ("forward", "optimizer
    step"; "zero_grad" for the optimizer's clearing before the step's forward), or "after X"
    when none is open and X ended last. It holds one row per category that changed:
    ``delta_bytes`` drawn from ``y0_bytes`` to ``y1_bytes`` (``kind`` "allocated": rises stack
    up from the previous running total; "freed": falls hang down from the top of the rises).
    ``total_bytes`` is the running total after the bar, ``peak_bytes`` the highest total
    inside the stretch (its boundaries and any peak recorded in it), so the step's peak is
    drawn in the bar where it happened. A stretch where nothing changed is left out unless
    its peak rose above both ends (one ``kind`` "peak only" row, delta 0). Columns: ``order,
    phase, label, category, kind, delta_bytes, y0_bytes, y1_bytes, total_bytes, peak_bytes``.

    A step with more than ``max_bars`` stretches (gradient accumulation, a loop of many small
    forwards) has runs of neighbouring stretches merged into one bar each (``merge_stretches``).
    """
    w = wide(memory)
    pk = wide(memory, ("peak",))
    return merge_stretches(_waterfall(w[(w["step"] == step) & (w["device"] == device)],
                                      pk[(pk["step"] == step) & (pk["device"] == device)]), max_bars)


_WF_COLUMNS = ["order", "phase", "label", "category", "kind", "delta_bytes", "y0_bytes", "y1_bytes", "total_bytes",
               "peak_bytes"]


def _waterfall(w: pd.DataFrame, pk: pd.DataFrame) -> pd.DataFrame:
    """``waterfall`` from one step's ``wide`` boundary rows ``w`` and peak rows ``pk``."""
    cols = _WF_COLUMNS
    if w.empty:
        return pd.DataFrame(columns=cols)
    peak_t, peak_v = pk["t_s"].to_numpy(dtype="float64"), pk["total_bytes"].to_numpy(dtype="int64")
    rows: list[tuple] = []
    first = w.iloc[0]
    y = 0
    start_total = int(first["total_bytes"])
    for c in MEMORY_CATEGORIES:
        if first[c]:
            rows.append((0, "step start", "start of step", c, "start", int(first[c]), y, y + int(first[c]),
                         start_total, start_total))
            y += int(first[c])
    stack: list[str] = []
    prev = first
    order = 1
    last_exit = ""
    seen: set[str] = set()
    names: dict[str, int] = {}
    _walk(stack, first)
    for _, b in w.iloc[1:].iterrows():
        phase = stack[-1] if stack else "between"
        label = _plain(phase, last_exit, seen)
        delta = {c: int(b[c]) - int(prev[c]) for c in MEMORY_CATEGORIES}
        # the same bytes change name from activations (or temporaries) to other when
        # forward/backward ends: only the part that really came or went is drawn
        for rest in ("activations", "temporaries"):
            a, o = delta[rest], delta["other"]
            if a * o < 0:
                moved = min(abs(a), abs(o))
                delta[rest] -= int(np.sign(a)) * moved
                delta["other"] -= int(np.sign(o)) * moved
        deltas = list(delta.items())
        total_before, total_after = int(prev["total_bytes"]), int(b["total_bytes"])
        inside = (peak_t > float(prev["t_s"])) & (peak_t <= float(b["t_s"]))
        top = max(total_before, total_after, int(peak_v[inside].max()) if inside.any() else 0)
        changed = any(d for _, d in deltas)
        if changed or top > max(total_before, total_after):
            n = names[label] = names.get(label, 0) + 1
            shown = label if n == 1 else f"{label} ({n})"
            rows += _bar_rows(order, phase, shown, deltas, total_before, total_after, top)
            order += 1
        if b["event"] == "exit":
            last_exit = str(b["phase"])
        if b["event"] == "enter":
            seen.add(str(b["phase"]))
        _walk(stack, b)
        prev = b
    return pd.DataFrame(rows, columns=cols)


def _bar_rows(order: int, phase: str, label: str, deltas: list[tuple[str, int]], total_before: int,
              total_after: int, top: int) -> list[tuple]:
    """One waterfall bar's rows: rises stacked up from ``total_before``, then falls hanging
    down from the top of the rises; a bar where nothing changed is one "peak only" row."""
    rows: list[tuple] = []
    y = total_before
    for c, d in deltas:
        if d > 0:
            rows.append((order, phase, label, c, "allocated", d, y, y + d, total_after, top))
            y += d
    for c, d in deltas:
        if d < 0:
            rows.append((order, phase, label, c, "freed", d, y + d, y, total_after, top))
            y += d
    if not rows:
        rows.append((order, phase, label, "other", "peak only", 0, total_after, total_after, total_after, top))
    return rows


def merge_stretches(wf: pd.DataFrame, max_bars: int = MAX_BARS) -> pd.DataFrame:
    """One step's ``waterfall`` with at most ``max_bars`` bars: the start bar is kept, and the
    stretches after it are cut into runs of equal length, each drawn as one bar. A merged bar
    holds each category's net change over its run (so the running totals are exactly those of
    the unmerged waterfall at the run's ends), the highest total inside the run as its peak, and
    a label that says what it spans ("forward … backward (12 stretches)")."""
    if wf.empty or max_bars < 2:
        return wf
    orders = sorted(int(o) for o in wf["order"].unique() if o > 0)
    if len(orders) + 1 <= max_bars:
        return wf
    size = -(-len(orders) // (max_bars - 1))
    start = wf[wf["order"] == 0]
    rows: list[tuple] = [tuple(r) for r in start[_WF_COLUMNS].itertuples(index=False)]
    first_total = int(start["total_bytes"].iloc[0]) if not start.empty else None
    by_order = {int(o): g for o, g in wf[wf["order"] > 0].groupby("order")}
    total_before = first_total
    for i in range(0, len(orders), size):
        run = [by_order[o] for o in orders[i:i + size]]
        part = pd.concat(run)
        order = i // size + 1
        total_after = int(run[-1]["total_bytes"].iloc[0])
        if total_before is None:  # no start bar: the total before the run, from its first bar
            g = run[0]
            total_before = int(g["total_bytes"].iloc[0]) - int(g["delta_bytes"].sum())
        top = max(int(part["peak_bytes"].max()), total_before, total_after)
        first_label, last_label = str(run[0]["label"].iloc[0]), str(run[-1]["label"].iloc[0])
        span = first_label if first_label == last_label else f"{first_label} … {last_label}"
        label = f"{span} ({len(run)} stretches)" if len(run) > 1 else first_label
        phase = str(part["phase"].mode().iloc[0])
        net = part.groupby("category", sort=False)["delta_bytes"].sum()
        deltas = [(c, int(net.get(c, 0))) for c in MEMORY_CATEGORIES]
        rows += _bar_rows(order, phase, label, deltas, total_before, total_after, top)
        total_before = total_after
    return pd.DataFrame(rows, columns=_WF_COLUMNS)


def _plain(phase: str, last_exit: str, seen: set[str]) -> str:
    """A stretch's name for people: the phase open during it (the optimizer's work before the
    step's forward is its zero_grad), or "after X" when none is open."""
    if phase == "between":
        if not last_exit:
            return "start of step"
        return "after " + (_plain(last_exit, "", seen) if last_exit != "between" else "start of step")
    if phase == "optimizer" and "forward" not in seen:
        return "zero_grad"
    return PHASE_NAMES.get(phase, phase)


def waterfalls(memory: pd.DataFrame, steps: list[int] | None = None, device: str = "cpu",
               max_steps: int = 40, across: pd.DataFrame | None = None, max_bars: int = MAX_BARS) -> pd.DataFrame:
    """``waterfall`` of several steps (default: the measured ones, at most ``max_steps``: every
    k-th, the first, the last and the peak step) in one frame with a ``step`` column, for a
    chart with a step selector. ``across``: ``across_steps(memory, device)`` when already made."""
    if steps is None:
        a = across if across is not None else across_steps(memory, device)
        a = a[a["step"] >= 0] if not a.empty else a
        all_steps = sorted(int(s) for s in a["step"].unique()) if not a.empty else []
        if len(all_steps) > max_steps:
            k = -(-len(all_steps) // max_steps)
            keep = set(all_steps[::k]) | {all_steps[0], all_steps[-1]}
            keep.add(int(a.loc[a["peak_bytes"].idxmax(), "step"]))
            all_steps = sorted(keep)
        steps = all_steps
    m = memory[(memory["device"] == device) & memory["step"].isin(steps)] if not memory.empty else memory
    w, pk = wide(m), wide(m, ("peak",))
    by_w, by_pk = dict(tuple(w.groupby("step"))), dict(tuple(pk.groupby("step")))
    parts = [merge_stretches(_waterfall(by_w[s], by_pk.get(s, pk.iloc[:0])), max_bars).assign(step=s)
             for s in steps if s in by_w]
    parts = [p for p in parts if not p.empty]
    if not parts:
        return pd.DataFrame(columns=["step", *_WF_COLUMNS])
    out = pd.concat(parts, ignore_index=True)
    return out[["step", *[c for c in out.columns if c != "step"]]]


def peak_step(memory: pd.DataFrame, device: str, across: pd.DataFrame | None = None) -> int | None:
    """The measured step with the highest peak on ``device`` (a warmup step when none was
    measured). ``across``: ``across_steps(memory, device)`` when already made."""
    a = across if across is not None else across_steps(memory, device)
    if a.empty:
        return None
    measured = a[a["step"] >= 0]
    pool = measured if not measured.empty else a
    return int(pool.loc[pool["peak_bytes"].idxmax(), "step"])


def _walk(stack: list[str], boundary: Any) -> None:
    if boundary["event"] == "enter":
        stack.append(str(boundary["phase"]))
    elif stack:
        if boundary["phase"] in stack:
            while stack and stack.pop() != boundary["phase"]:
                pass


def step_peak(memory: pd.DataFrame, step: int, device: str = "cpu") -> dict[str, Any]:
    """The highest level within one step on one device: ``{"total_bytes", "phase", "by_category"}``
    (empty dict when the step has no rows)."""
    w = wide(memory, ("enter", "exit", "peak"))
    w = w[(w["step"] == step) & (w["device"] == device)]
    if w.empty:
        return {}
    top = w.loc[w["total_bytes"].idxmax()]
    return {"total_bytes": int(top["total_bytes"]), "phase": str(top["phase"]),
            "by_category": {c: int(top[c]) for c in MEMORY_CATEGORIES}}


def across_steps(memory: pd.DataFrame, device: str | None = None) -> pd.DataFrame:
    """Memory by category at the end of every step (its last boundary), with the step's peak:
    one row per (device, step, category): ``device, step, category, bytes, total_bytes,
    peak_bytes``."""
    cols = ["device", "step", "category", "bytes", "total_bytes", "peak_bytes"]
    w = wide(memory, ("enter", "exit", "peak"))
    if device is not None:
        w = w[w["device"] == device]
    if w.empty:
        return pd.DataFrame(columns=cols)
    levels = w[w["event"] != "peak"]
    last = levels.groupby(["device", "step"], sort=True).tail(1)
    peak = w.groupby(["device", "step"], as_index=False)["total_bytes"].max().rename(columns={"total_bytes": "peak_bytes"})
    last = last[["device", "step", "total_bytes", *MEMORY_CATEGORIES]].merge(peak, on=["device", "step"], how="left")
    last["_row"] = np.arange(len(last))
    # one row per category, in the order the steps' last boundaries came (it had been a Python
    # loop over the rows: 2 s of a 2,000-step run's report, called twice)
    out = last.melt(id_vars=["_row", "device", "step", "total_bytes", "peak_bytes"], value_vars=list(MEMORY_CATEGORIES),
                    var_name="category", value_name="bytes")
    out["_cat"] = out["category"].map({c: i for i, c in enumerate(MEMORY_CATEGORIES)})
    out = out.sort_values(["_row", "_cat"], kind="stable").reset_index(drop=True)
    for c in ("step", "bytes", "total_bytes", "peak_bytes"):
        out[c] = out[c].astype("int64")
    return out[cols]


def thin_across(across: pd.DataFrame, max_steps: int = 400) -> pd.DataFrame:
    """``across_steps`` rows for at most ``max_steps`` steps: every k-th step, the first and
    last, and the step of the highest peak (a long run still draws quickly, and its peak and
    trend stay visible)."""
    steps = np.sort(across["step"].unique()) if not across.empty else np.array([])
    if len(steps) <= max_steps:
        return across
    k = -(-len(steps) // max_steps)
    keep = set(steps[::k]) | {steps[0], steps[-1]}
    keep.add(across.loc[across["peak_bytes"].idxmax(), "step"])
    return across[across["step"].isin(keep)]


def growth(memory: pd.DataFrame, device: str | None = None) -> pd.DataFrame:
    """Step-to-step growth of the end-of-step level over measured steps, per device: ``device,
    steps, first_bytes, last_bytes, growth_bytes, per_step_bytes, rising_share, top_category,
    leak`` (``leak`` is the growth rule above)."""
    cols = ["device", "steps", "first_bytes", "last_bytes", "growth_bytes", "per_step_bytes",
            "rising_share", "top_category", "leak"]
    a = across_steps(memory, device)
    a = a[a["step"] >= 0] if not a.empty else a
    out = []
    for dev, g in a.groupby("device", sort=True):
        totals = g.groupby("step")["total_bytes"].first().sort_index()
        n = len(totals)
        if n < 2:
            continue
        diffs = np.diff(totals.to_numpy())
        first, last = int(totals.iloc[0]), int(totals.iloc[-1])
        grew = last - first
        by_cat = g.pivot_table(index="step", columns="category", values="bytes", aggfunc="sum").sort_index()
        top = str((by_cat.iloc[-1] - by_cat.iloc[0]).idxmax())
        rising = float((diffs > 0).mean())
        leak = bool(n >= LEAK_MIN_STEPS and rising >= LEAK_RISING_SHARE
                    and -diffs[diffs < 0].sum() <= diffs[diffs > 0].sum() * 0.5
                    and (grew >= LEAK_MIN_BYTES or grew >= LEAK_MIN_SHARE * max(first, 1)))
        out.append((dev, n, first, last, grew, grew / (n - 1), rising, top, leak))
    return pd.DataFrame(out, columns=cols)


def headroom(memory: pd.DataFrame, meta: dict) -> pd.DataFrame:
    """Peak against capacity per device: ``device, peak_bytes, capacity_bytes, headroom_bytes,
    peak_share`` (capacity from ``meta["memory"]["capacity_bytes"]``; NaN when unknown)."""
    cap = ((meta or {}).get("memory") or {}).get("capacity_bytes") or {}
    p = memory_peak(memory)
    rows = []
    for dev, g in p.groupby("device", sort=True):
        peak = int(g["total_bytes"].iloc[0])
        c = cap.get(dev)
        rows.append((dev, peak, float(c) if c else np.nan, float(c) - peak if c else np.nan,
                     peak / float(c) if c else np.nan))
    return pd.DataFrame(rows, columns=["device", "peak_bytes", "capacity_bytes", "headroom_bytes", "peak_share"])


def memory_notes(memory: pd.DataFrame) -> list[str]:
    """Summary notes: memory that keeps growing from step to step."""
    notes = []
    g = growth(memory)
    for r in g[g["leak"]].itertuples(index=False) if not g.empty else []:
        notes.append(f"memory on {r.device} grew by {fmt_bytes(r.growth_bytes)} over {r.steps} steps "
                     f"(+{fmt_bytes(r.per_step_bytes)} per step, mostly {r.top_category}): a leak, or a "
                     "cache that never settles (a list keeping outputs or losses with their graph?)")
    return notes


def stream_cost(meta: dict, step_p50_s: float) -> dict | None:
    """What the CPU memory stream cost the loop's own phases, estimated: ``{"events_per_step",
    "per_step_s", "share"}`` (share of the median step), or None when the run had no stream
    (``memory=False``, or a stream that could not start) or no steps. Its events are counted exactly; their cost is
    ``STREAM_EVENT_COST_S`` each, a figure measured on one machine, so the result is an estimate."""
    mem = meta.get("memory") or {}
    events, steps = mem.get("stream_events"), mem.get("stream_steps")
    if not events or not steps or not step_p50_s > 0:
        return None
    per_step = events / steps
    cost_s = per_step * event_cost_s(meta)
    return {"events_per_step": per_step, "per_step_s": cost_s, "share": cost_s / step_p50_s}


def event_cost_s(meta: dict) -> float:
    """What one allocator event cost the loop with the run's CPU source (an estimate)."""
    counter = (meta.get("memory") or {}).get("cpu_source") == CPU_SOURCE_COUNTER
    return COUNTER_EVENT_COST_S if counter else STREAM_EVENT_COST_S


def stream_note(meta: dict, step_p50_s: float) -> str | None:
    """The summary's note on what the CPU memory stream cost, when it is a share worth saying
    or the slice held enough events to cost more than the estimate says."""
    c = stream_cost(meta, step_p50_s)
    if c is None:
        return None
    events = int(meta["memory"]["stream_events"])
    counter = meta["memory"].get("cpu_source") == CPU_SOURCE_COUNTER
    long = ""
    if events >= STREAM_LONG_EVENTS:
        long = (f"; this slice held {events:,} allocator events, which tpkit replays when the slice ends "
                f"(about 2 s a million on a 2-core VM): profile fewer steps, or memory=False for a long one"
                if counter else
                f"; this slice held {events:,} allocator events: torch keeps each one until the slice ends, "
                f"and past about a million of them a step costs more than this estimate (a few percent more "
                f"on a 2-core VM) and the slice takes longer to end: profile fewer steps, or memory=False "
                f"for a long one")
    if c["share"] < STREAM_NOTE_MIN_SHARE and not long:
        return None
    per_step_us = c["per_step_s"] * 1e6
    cost = f"{per_step_us / 1e3:.2f} ms" if per_step_us >= 100 else f"{per_step_us:.0f} us"
    who = "tpkit's allocation counter saw" if counter else "torch's profiler reported"
    each_us = event_cost_s(meta) * 1e6
    return (f"memory tracking cost about {cost} a step ({c['share']:.1%} of the median step): {who} "
            f"{c['events_per_step']:,.0f} allocations and frees a step, "
            f"~{each_us:.2f} us each (measured on a 2-core VM). That time is counted in "
            f"the phases that allocate (forward, backward, the optimizer step), not in tpkit's own "
            f"share; memory=False (--no-memory) times them without it{long}")


def levels_over_time(memory: pd.DataFrame, device: str, max_points: int = 600) -> pd.DataFrame:
    """``wide`` rows (boundaries and peaks) of one device in time order, for memory over time:
    at most ``max_points`` rows (every k-th, the first, the last and the highest), so a long
    run still draws quickly and its peak stays visible."""
    w = wide(memory, ("enter", "exit", "peak"))
    w = w[w["device"] == device].reset_index(drop=True)
    if len(w) <= max_points:
        return w
    k = -(-len(w) // max_points)
    keep = set(range(0, len(w), k)) | {0, len(w) - 1, int(w["total_bytes"].idxmax())}
    return w.iloc[sorted(keep)].reset_index(drop=True)
