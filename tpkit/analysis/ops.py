"""Operators per tpkit phase: pure functions over ``run.ops`` and ``run.spans``.

``run.ops`` holds one row per operator event torch.profiler saw in the traced steps (``--ops``),
on the slice's clock. Each event belongs to the innermost tpkit phase span that contains it
(its midpoint), so "which operators make backward slow" is a group-by. Self times are
exclusive of an op's children (they add up to the traced time); on a GPU the device's self
time is what ranks an op, on the CPU the host's.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ..schema import OTHER, PHASE_ORDER, UNCOUNTED_PHASES

#: Columns of ``ops_by_phase``.
COLUMNS = ["phase", "op", "input_shapes", "calls", "self_cpu_s", "self_device_s", "self_s", "self_ms_per_step",
           "share_of_phase"]


def assign_phases(ops: pd.DataFrame, spans: pd.DataFrame) -> pd.DataFrame:
    """``ops`` with a ``phase`` column: the innermost span (deepest; the latest to start on a
    tie) containing the event's midpoint, ``other`` where none does."""
    out = ops.copy()
    out["phase"] = OTHER
    if ops.empty or spans.empty:
        return out
    sp = spans[~spans["phase"].isin(UNCOUNTED_PHASES)]
    lo, hi = float(ops["start_s"].min()), float(ops["end_s"].max())
    sp = sp[(sp["end_s"] >= lo) & (sp["start_s"] <= hi)].sort_values(["depth", "start_s"], kind="stable")
    mid = ((ops["start_s"] + ops["end_s"]) / 2).to_numpy(dtype="float64")
    phase = np.full(len(ops), OTHER, dtype=object)
    # deeper (and later) spans are visited last, so they overwrite the spans around them
    for s0, s1, name in zip(sp["start_s"].to_numpy(), sp["end_s"].to_numpy(), sp["phase"].to_numpy()):
        inside = (mid >= s0) & (mid <= s1)
        phase[inside] = name
    out["phase"] = phase
    return out


def _phase_rank(phase: str) -> tuple[int, str]:
    return (PHASE_ORDER.index(phase), "") if phase in PHASE_ORDER else (len(PHASE_ORDER), phase)


def ops_by_phase(ops: pd.DataFrame, spans: pd.DataFrame) -> pd.DataFrame:
    """Self time per (phase, operator, input shapes) over the traced steps: ``phase, op,
    input_shapes, calls, self_cpu_s, self_device_s, self_s`` (device time when the run has
    any, else CPU time), ``self_ms_per_step`` and ``share_of_phase`` (of the phase's op time).
    Phases in step order, operators by self time, largest first."""
    if ops.empty:
        return pd.DataFrame(columns=COLUMNS)
    a = assign_phases(ops, spans)
    n_steps = max(1, a["step"].nunique())
    on_device = float(a["self_device_s"].sum()) > 0
    g = a.groupby(["phase", "op", "input_shapes"], sort=False).agg(
        calls=("op", "size"), self_cpu_s=("self_cpu_s", "sum"), self_device_s=("self_device_s", "sum")).reset_index()
    g["self_s"] = g["self_device_s"] if on_device else g["self_cpu_s"]
    g["self_ms_per_step"] = g["self_s"] * 1e3 / n_steps
    total = g.groupby("phase")["self_s"].transform("sum")
    g["share_of_phase"] = np.where(total > 0, g["self_s"] / total.where(total > 0, 1.0), 0.0)
    g["_rank"] = g["phase"].map(lambda p: _phase_rank(str(p)))
    g = g.sort_values(["_rank", "self_s"], ascending=[True, False], kind="stable").drop(columns="_rank")
    return g.reset_index(drop=True)[COLUMNS]


def top_ops(ops: pd.DataFrame, spans: pd.DataFrame, n: int = 8, min_share: float = 0.0) -> pd.DataFrame:
    """The ``n`` operators (with their input shapes) with the most self time in each phase:
    ``ops_by_phase`` rows, phases in step order. Phases tpkit itself spent (``tpkit``) are
    left out: they are tpkit's cost, not the model's."""
    g = ops_by_phase(ops, spans)
    if g.empty:
        return g
    g = g[(g["phase"] != "tpkit") & (g["share_of_phase"] >= min_share)]
    return g.groupby("phase", sort=False).head(n).reset_index(drop=True)


def top_op_lines(ops: pd.DataFrame, spans: pd.DataFrame, n: int = 3) -> list[str]:
    """One line per phase: its top operators by self time, for the report's words."""
    t = top_ops(ops, spans, n)
    lines = []
    for phase, g in t.groupby("phase", sort=False):
        parts = [f"{r.op} {r.input_shapes or ''} {r.self_ms_per_step:,.2f} ms ({r.share_of_phase:.0%})".replace("  ", " ")
                 for r in g.itertuples(index=False)]
        lines.append(f"{phase}: " + "; ".join(parts))
    return lines
