"""Ranks of a multi-process launch: ``frame -> altair.Chart``, nothing else.

- ``rank_step_times``: each rank's step time per step and the skew; past ``max_rows`` rows (many
  ranks) the lines become the spread across ranks (min, median, max per step) with the
  straggler's own line, so a 256-rank launch draws in a few thousand points.
- ``rank_timeline``: the merged timeline, one lane per rank, waits in collectives drawn over the
  phase they interrupted.
- ``rank_memory_peaks``: each rank's memory peak.
- ``ranks_view``: the three under the straggler verdict, as the dashboard's "Ranks" section.
"""

from __future__ import annotations

import altair as alt
import pandas as pd

from ..schema import MIB
from .style import phase_scale

#: altair's default row limit: a chart with more rows is drawn from an aggregate instead.
MAX_ROWS = 5000


def rank_step_times(steps: pd.DataFrame, skew: pd.DataFrame, width: int = 620, *, highlight: int | None = None,
                    max_rows: int = MAX_ROWS) -> alt.VConcatChart:
    """Top: each rank's step time per step (one line per rank, warmup faded), the slowest
    rank of each step ringed; past ``max_rows`` rows the band of all ranks (min to max, median
    line) and the ``highlight`` rank's line instead. Bottom: the skew per step (slowest minus
    fastest rank), the time the faster ranks wait at the next collective.

    ``steps``: columns ``rank, step, duration_s, warmup``; ``skew``: ``ranks.rank_skew`` rows.
    """
    slow = skew.assign(duration_ms=skew["max_s"] * 1e3, rank=skew["slowest_rank"].astype(str))
    if len(steps) <= max_rows:
        s = steps.assign(duration_ms=steps["duration_s"] * 1e3, rank=steps["rank"].astype(str))
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
    else:
        g = steps.groupby("step")["duration_s"]
        band = pd.DataFrame({"min_ms": g.min() * 1e3, "median_ms": g.median() * 1e3, "max_ms": g.max() * 1e3,
                             "ranks": g.size()}).reset_index()
        area = alt.Chart(band).mark_area(opacity=0.25, color="#1f77b4").encode(
            x=alt.X("step:Q", title="step (negative: warmup)"), y=alt.Y("min_ms:Q", title="step time (ms)"),
            y2="max_ms:Q", tooltip=["step:Q", "ranks:Q", alt.Tooltip("min_ms:Q", format=".2f"),
                                    alt.Tooltip("median_ms:Q", format=".2f"), alt.Tooltip("max_ms:Q", format=".2f")])
        med = alt.Chart(band).mark_line(color="#1f77b4").encode(x="step:Q", y="median_ms:Q")
        layers = area + med
        title = f"Step time across {steps['rank'].nunique()} ranks (band: fastest to slowest; line: median)"
        if highlight is not None:
            mine = steps[steps["rank"] == highlight].assign(duration_ms=lambda d: d["duration_s"] * 1e3)
            layers = layers + alt.Chart(mine).mark_line(color="#d62728", point=True).encode(
                x="step:Q", y="duration_ms:Q", tooltip=["rank:Q", "step:Q", alt.Tooltip("duration_ms:Q", format=".2f")])
            title += f"; red: rank {highlight}"
        top = layers.properties(title=title, width=width, height=180)
    bars = alt.Chart(skew.assign(skew_ms=skew["skew_s"] * 1e3)).mark_bar(color="#d62728").encode(
        x=alt.X("step:Q", title="step"), y=alt.Y("skew_ms:Q", title="skew (ms)"),
        tooltip=[alt.Tooltip("step:Q"), alt.Tooltip("skew_ms:Q", format=".2f", title="max - min (ms)"),
                 alt.Tooltip("skew_share:Q", format=".0%", title="of the slowest step"),
                 alt.Tooltip("slowest_rank:Q", title="slowest rank")]
    ).properties(title="Skew: slowest minus fastest rank", width=width, height=90)
    return alt.vconcat(top, bars)


def rank_timeline(timeline: pd.DataFrame, width: int = 620, *, world_size: int | None = None,
                  missing: list[int] | None = None) -> alt.Chart:
    """One lane per rank on one time axis (``ranks.rank_timeline`` rows: ``rank, step, phase,
    start_s, end_s``): each rank's phases, its waits in collectives (``comm``) over them. Missing
    ranks are named in the title; lanes not drawn (a large launch) are counted there."""
    t = timeline.assign(start_ms=timeline["start_s"] * 1e3, end_ms=timeline["end_s"] * 1e3,
                        duration_ms=(timeline["end_s"] - timeline["start_s"]) * 1e3)
    if len(t):
        t = t.assign(start_ms=t["start_ms"] - t["start_ms"].min(), end_ms=t["end_ms"] - t["start_ms"].min())
    lanes = sorted(int(r) for r in t["rank"].unique()) if len(t) else []
    title = ["Ranks on one timeline (measured steps; dark: waiting in collectives)"]
    if world_size is not None and len(lanes) < world_size:
        title.append(f"{len(lanes)} of {world_size} ranks drawn")
    if missing:
        title.append(f"missing: rank {', '.join(map(str, missing))} (no run saved)")
    return alt.Chart(t).mark_bar(height=alt.RelativeBandSize(0.8)).encode(
        x=alt.X("start_ms:Q", title="ms from the first rank's first measured step"), x2="end_ms:Q",
        y=alt.Y("rank:O", title="rank", sort=lanes),
        color=alt.Color("phase:N", scale=phase_scale(sorted(set(t["phase"])) if len(t) else []),
                        legend=alt.Legend(title="phase")),
        tooltip=["rank:O", "step:Q", "phase:N", alt.Tooltip("duration_ms:Q", format=".2f", title="ms")],
    ).properties(title=title if len(title) > 1 else title[0], width=width,
                 height=max(60, min(16, 600 // max(1, len(lanes))) * max(1, len(lanes))))


def rank_memory_peaks(peaks: pd.DataFrame, width: int = 620, *, max_labels: int = 32) -> alt.Chart:
    """Each rank's memory peak per device (``ranks.rank_memory_peaks`` rows), in MiB; past
    ``max_labels`` ranks the rank axis is numeric (one thin bar per rank and device)."""
    p = peaks.assign(peak_mib=peaks["peak_bytes"] / MIB, rank=peaks["rank"].astype(int))
    many = p["rank"].nunique() > max_labels
    x = alt.X("rank:Q", title="rank") if many else alt.X("rank:O", title="rank", axis=alt.Axis(labelAngle=0))
    enc: dict = {} if many else {"xOffset": "device:N"}
    return alt.Chart(p).mark_bar().encode(
        x=x, y=alt.Y("peak_mib:Q", title="peak memory (MiB)"),
        color=alt.Color("device:N", legend=alt.Legend(title="device")),
        tooltip=["rank:O", "device:N", alt.Tooltip("peak_mib:Q", format=",.1f", title="MiB")], **enc,
    ).properties(title="Memory peak per rank (measured steps)", width=width, height=120)


def ranks_view(steps: pd.DataFrame, skew: pd.DataFrame, timeline: pd.DataFrame, peaks: pd.DataFrame, *,
               verdict: str, straggler: int | None = None, world_size: int | None = None,
               missing: list[int] | None = None, width: int = 620) -> alt.VConcatChart:
    """The "Ranks" section: the straggler verdict as its title, then the step times and skew, the
    merged timeline and the memory peaks (the last two only when there are rows)."""
    parts: list[alt.VConcatChart | alt.Chart] = [rank_step_times(steps, skew, width, highlight=straggler)]
    if len(timeline):
        parts.append(rank_timeline(timeline, width, world_size=world_size, missing=missing))
    if len(peaks):
        parts.append(rank_memory_peaks(peaks, width))
    title = [verdict] + ([f"missing: rank {', '.join(map(str, missing))} left no run"] if missing else [])
    return alt.vconcat(*parts).resolve_scale(color="independent").resolve_legend(color="independent").properties(
        title=alt.TitleParams(title, anchor="start", fontSize=14))
