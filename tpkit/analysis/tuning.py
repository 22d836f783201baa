"""Tuning results as frames: one row per run of a tuner or sweep, and the best of them.

Pure functions over Runs (no widgets, no drawing), used by ``tpkit.widgets.tuner`` and by
anyone comparing a list of runs by hand.
"""

from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING, Any, Iterable

import pandas as pd

from ..schema import MIB
from .compare import peak_memory_bytes

if TYPE_CHECKING:
    from ..run import Run

RESULT_COLUMNS = ("run", "throughput", "step_p50_ms", "data_stall_pct", "peak_mib", "verdict", "complete", "best")


def results_frame(runs: Iterable["Run"]) -> pd.DataFrame:
    """One row per run: its knobs (one column each), throughput (samples/s), step p50 (ms),
    data-stall share (%), peak memory (MiB, NaN without memory rows), verdict, and ``best``
    (True on the complete run with the highest throughput)."""
    rows = []
    for run in runs:
        s = run.summary()
        peak = peak_memory_bytes(run.memory).get("total", math.nan)
        knobs = {k: v for k, v in run.meta.get("knobs", {}).items()}
        rows.append({"run": run.name, **knobs, "throughput": s.throughput, "step_p50_ms": s.step_p50_s * 1e3,
                     "data_stall_pct": s.data_stall_share * 100, "peak_mib": peak / MIB,
                     "verdict": s.verdict.kind, "complete": s.complete})
    df = pd.DataFrame(rows)
    if df.empty:
        return pd.DataFrame(columns=list(RESULT_COLUMNS))
    ok = df["complete"] & df["throughput"].notna()
    df["best"] = False
    if ok.any():
        df.loc[df.loc[ok, "throughput"].idxmax(), "best"] = True
    knob_cols = [c for c in df.columns if c not in RESULT_COLUMNS]
    return df[["run", *knob_cols, *RESULT_COLUMNS[1:]]]


def grid(options: dict[str, list[Any]], limit: int = 16) -> list[dict[str, Any]]:
    """Every combination of the knobs' options, in order; refuses more than ``limit``."""
    names = list(options)
    count = math.prod(len(options[n]) for n in names) if names else 0
    if count == 0:
        raise ValueError("a sweep needs at least one knob with at least one value")
    if count > limit:
        sizes = " x ".join(f"{n}({len(options[n])})" for n in names)
        raise ValueError(f"the sweep has {count} settings ({sizes}), more than the limit of {limit}: "
                         "narrow some knobs, or raise sweep_limit")
    return [dict(zip(names, combo)) for combo in itertools.product(*(options[n] for n in names))]
