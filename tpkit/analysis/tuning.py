"""Tuning results as frames: one row per setting (its replicate slices pooled, with a 95%
interval), one row per run, and the best setting chosen from the replicates.

A single short slice is noisy (the same setting measured 93, 118 and 102 samples/s), so the
tuner runs each setting several times and ``settings_frame`` judges the mean of the
replicates' throughputs with its Student t interval; ``best`` is the complete setting with the
highest mean, and ``clear`` says whether its interval is above every other setting's. A run
that measured fewer steps than its slice asked (``short``: the loop ended first, a finite
epoch shorter than warmup + steps) is never ``best``: a 7-step window of a 10-step request had
been ranked with the full ones.

Pure functions over Runs (no widgets, no drawing), used by ``tpkit.views.tuner`` and by
anyone comparing a list of runs by hand.
"""

from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING, Any, Iterable

import pandas as pd

from ..schema import MIB
from .compare import peak_memory_bytes
from .stats import mean_interval

if TYPE_CHECKING:
    from ..run import Run

RESULT_COLUMNS = ("run", "throughput", "step_p50_ms", "data_stall_pct", "peak_mib", "verdict", "complete", "short",
                  "best")


def short_of_steps(run: "Run") -> tuple[int, int] | None:
    """(measured steps, steps asked) where the run measured fewer steps than its slice asked
    (``meta["steps_requested"]``); None where it measured them all or does not say."""
    asked = run.meta.get("steps_requested")
    if not isinstance(asked, int) or isinstance(asked, bool) or run.steps.empty:
        return None
    got = int((~run.steps["warmup"].astype(bool)).sum())
    return (got, asked) if got < asked else None


def results_frame(runs: Iterable["Run"]) -> pd.DataFrame:
    """One row per run: its knobs (one column each), throughput (samples/s), step p50 (ms),
    data-stall share (%), peak memory (MiB, NaN without memory rows), verdict, and ``best``
    (True on the complete run with the highest throughput, of those not ``short`` of the steps
    asked: ``short_of_steps``)."""
    rows = []
    for run in runs:
        s = run.summary(where=False)  # figures and the verdict's kind only
        peak = peak_memory_bytes(run.memory).get("total", math.nan)
        knobs = {k: v for k, v in run.meta.get("knobs", {}).items()}
        rows.append({"run": run.name, **knobs, "throughput": s.throughput, "step_p50_ms": s.step_p50_s * 1e3,
                     "data_stall_pct": s.data_stall_share * 100, "peak_mib": peak / MIB,
                     "verdict": s.verdict.kind, "complete": s.complete, "short": short_of_steps(run) is not None})
    df = pd.DataFrame(rows)
    if df.empty:
        return pd.DataFrame(columns=list(RESULT_COLUMNS))
    ok = df["complete"] & ~df["short"] & df["throughput"].notna()
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


SETTING_COLUMNS = ("run", "replicates", "throughput", "throughput_low", "throughput_high", "step_p50_ms",
                   "data_stall_pct", "peak_mib", "verdict", "complete", "short", "best", "clear", "runs")


def setting_key(knobs: dict[str, Any]) -> tuple:
    """A hashable key of a knob setting (values by ``repr``, so lists and dicts work too)."""
    return tuple(sorted((str(k), repr(v)) for k, v in knobs.items()))


def settings_frame(runs: Iterable["Run"]) -> pd.DataFrame:
    """One row per knob setting, in first-run order: its knobs (one column each), how many
    replicate slices ran, the mean throughput over them with its 95% interval, the median step
    p50, the mean data-stall share, the largest peak memory, the verdict of the replicate
    nearest the mean (``run``: that replicate's name, ``runs``: every replicate's), whether
    every replicate completed, whether any measured fewer steps than asked (``short``),
    ``best`` (the complete setting, none of its replicates short, with the highest mean) and
    ``clear`` (True on the best when its interval's low end is above every other setting's
    high end: the ranking is not noise)."""
    per = results_frame(runs)
    if per.empty:
        return pd.DataFrame(columns=list(SETTING_COLUMNS))
    runs = list(runs)
    keys = [setting_key(r.meta.get("knobs", {}) or {}) for r in runs]
    knob_cols = [c for c in per.columns if c not in RESULT_COLUMNS]
    rows = []
    for key in dict.fromkeys(keys):
        idx = [i for i, k in enumerate(keys) if k == key]
        g = per.iloc[idx]
        mean, lo, hi = mean_interval(g["throughput"].to_numpy(dtype="float64"))
        near = (g["throughput"] - mean).abs().idxmin() if g["throughput"].notna().any() else g.index[0]
        rows.append({"run": g.loc[near, "run"], **{c: g[c].iloc[0] for c in knob_cols}, "replicates": len(g),
                     "throughput": mean, "throughput_low": lo, "throughput_high": hi,
                     "step_p50_ms": float(g["step_p50_ms"].median()), "data_stall_pct": float(g["data_stall_pct"].mean()),
                     "peak_mib": float(g["peak_mib"].max()), "verdict": g.loc[near, "verdict"],
                     "complete": bool(g["complete"].all()), "short": bool(g["short"].any()), "runs": list(g["run"])})
    df = pd.DataFrame(rows)
    ok = df["complete"] & ~df["short"] & df["throughput"].notna()
    df["best"] = False
    df["clear"] = False
    if ok.any():
        b = df.loc[ok, "throughput"].idxmax()
        df.loc[b, "best"] = True
        others = df.loc[ok & (df.index != b), "throughput_high"]
        low = df.loc[b, "throughput_low"]
        df.loc[b, "clear"] = bool(low == low and (others.empty or (others.notna().all() and (others < low).all())))
    return df[["run", *knob_cols, *SETTING_COLUMNS[1:]]]
