"""The stall timeline and the per-step breakdown: ``frames -> altair.Chart``, nothing else."""

from __future__ import annotations

import altair as alt
import pandas as pd

from .style import phase_scale, phase_sort

#: A selection on time shared by every chart whose x axis is the slice's time.
TIME_BRUSH_NAME = "time_brush"


def stall_timeline(spans: pd.DataFrame, width: int = 620) -> alt.Chart:
    """One bar per phase per step along the slice's time; data wait in red. Drag to zoom
    the time axis, hover for the step, phase, duration and where it was measured.

    ``spans``: the rows of ``analysis.timeline_frame`` (columns of ``run.spans`` + duration_ms).
    """
    phases = list(spans["phase"].unique())
    zoom = alt.selection_interval(bind="scales", encodings=["x"], name="timeline_zoom")
    return (
        alt.Chart(spans, title="Stall timeline")
        .mark_bar(height={"band": 0.8}, clip=True)
        .encode(
            x=alt.X("start_s:Q", title="time since slice start (s)"),
            x2="end_s:Q",
            y=alt.Y("phase:N", sort=phase_sort(phases), title=None),
            color=alt.Color("phase:N", scale=phase_scale(phases), legend=alt.Legend(title="phase")),
            opacity=alt.condition("datum.warmup", alt.value(0.35), alt.value(1.0)),
            tooltip=[
                alt.Tooltip("step:Q", title="step (negative: warmup)"), alt.Tooltip("phase:N"), alt.Tooltip("duration_ms:Q", format=".3f", title="ms"),
                alt.Tooltip("start_s:Q", format=".4f"), alt.Tooltip("source:N", title="measured at"),
            ],
        )
        .add_params(zoom)
        .properties(width=width, height=28 * max(3, len(phases)))
    )


def step_breakdown(long: pd.DataFrame, width: int = 420) -> alt.Chart:
    """Stacked milliseconds per phase for every step; warmup steps faded.

    ``long``: ``analysis.breakdown_long(run.steps)``.
    """
    phases = list(long["phase"].unique())
    order = {p: i for i, p in enumerate(phase_sort(phases))}
    data = long.assign(order=long["phase"].map(order))
    return (
        alt.Chart(data, title="Time per step by phase")
        .mark_bar()
        .encode(
            x=alt.X("step:O", title="step (negative: warmup)"),
            y=alt.Y("sum(ms):Q", title="ms", stack="zero"),
            color=alt.Color("phase:N", scale=phase_scale(phases), legend=None),
            order=alt.Order("order:Q"),
            opacity=alt.condition("datum.warmup", alt.value(0.35), alt.value(1.0)),
            tooltip=[alt.Tooltip("step:O"), alt.Tooltip("phase:N"), alt.Tooltip("ms:Q", format=".3f"),
                     alt.Tooltip("warmup:N")],
        )
        .properties(width=width, height=220)
    )
