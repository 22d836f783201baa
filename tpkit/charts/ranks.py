"""Per-rank step times of a multi-process launch: ``frame -> altair.Chart``, nothing else."""

from __future__ import annotations

import altair as alt
import pandas as pd


def rank_step_times(steps: pd.DataFrame, skew: pd.DataFrame, width: int = 620) -> alt.VConcatChart:
    """Top: each rank's step time per step (one line per rank, warmup faded), the slowest
    rank of each step ringed. Bottom: the skew per step (slowest minus fastest rank), the
    time the faster ranks wait at the next collective.

    ``steps``: columns ``rank, step, duration_s, warmup``; ``skew``: ``ranks.rank_skew`` rows.
    """
    s = steps.assign(duration_ms=steps["duration_s"] * 1e3, rank=steps["rank"].astype(str))
    slow = skew.assign(duration_ms=skew["max_s"] * 1e3, rank=skew["slowest_rank"].astype(str))
    base = alt.Chart(s).encode(
        x=alt.X("step:Q", title="step (negative: warmup)"),
        y=alt.Y("duration_ms:Q", title="step time (ms)"),
        color=alt.Color("rank:N", legend=alt.Legend(title="rank")),
    )
    lines = base.mark_line(point=True).encode(
        opacity=alt.condition("datum.warmup", alt.value(0.35), alt.value(1.0)),
        tooltip=["rank:N", "step:Q", alt.Tooltip("duration_ms:Q", format=".2f", title="ms")])
    ring = alt.Chart(slow).mark_point(size=160, filled=False, strokeWidth=2).encode(
        x="step:Q", y="duration_ms:Q", color=alt.Color("rank:N"),
        tooltip=[alt.Tooltip("step:Q"), alt.Tooltip("rank:N", title="slowest rank"),
                 alt.Tooltip("duration_ms:Q", format=".2f", title="ms")])
    top = (lines + ring).properties(title="Step time per rank (ringed: slowest rank)", width=width, height=180)
    bars = alt.Chart(skew.assign(skew_ms=skew["skew_s"] * 1e3)).mark_bar(color="#d62728").encode(
        x=alt.X("step:Q", title="step"), y=alt.Y("skew_ms:Q", title="skew (ms)"),
        tooltip=[alt.Tooltip("step:Q"), alt.Tooltip("skew_ms:Q", format=".2f", title="max - min (ms)"),
                 alt.Tooltip("skew_share:Q", format=".0%", title="of the slowest step"),
                 alt.Tooltip("slowest_rank:Q", title="slowest rank")]
    ).properties(title="Skew: slowest minus fastest rank", width=width, height=90)
    return alt.vconcat(top, bars)
