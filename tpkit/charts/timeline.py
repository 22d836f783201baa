"""The stall timeline and the per-step breakdown: ``frames -> altair.Chart``, nothing else.

Zoom works the same in every view of the slice's time: drag across the thin overview strip
above the timeline (``time_overview``) to pick an interval, and the timeline, the clock
panels and memory over time all zoom to it; a double-click on the strip shows the whole
slice again. One selection parameter (``TIME_BRUSH_NAME``) drives one x scale
(``time_scale``); the strip's own axis starts at 0 and ends at the data, so nothing ever
pans into negative time.
"""

from __future__ import annotations

from typing import Any

import altair as alt
import pandas as pd

from ..schema import OTHER
from .style import phase_scale, phase_sort

#: The selection on time shared by every chart whose x axis is the slice's time.
TIME_BRUSH_NAME = "time_brush"
X_TITLE = "time since slice start (s)"
#: How the time left to no phase is named in the legend.
OTHER_LABEL = "other / unattributed"
#: At most this many step numbers are written above the timeline (every k-th on a long run).
MAX_STEP_LABELS = 40


def time_brush() -> alt.Parameter:
    """The interval selection on x that every time view zooms to (drag: select; double-click: clear)."""
    return alt.selection_interval(encodings=["x"], name=TIME_BRUSH_NAME, clear="dblclick")


def time_scale() -> alt.Scale:
    """The x scale of a zoomed view: the brush's interval when one is drawn, else 0 to the end
    of the data (no padding past it)."""
    return alt.Scale(domain={"param": TIME_BRUSH_NAME, "encoding": "x"}, domainMin=0, nice=False, zero=False)


def _legend() -> alt.Legend:
    return alt.Legend(title="phase", labelExpr=f"datum.label == '{OTHER}' ? '{OTHER_LABEL}' : datum.label")


def _boundaries(spans: pd.DataFrame, steps: pd.DataFrame | None) -> pd.DataFrame:
    """Step starts (and the last step's end) as ``step, t_s, label``; from the spans when no
    steps table is given."""
    if steps is not None and not steps.empty:
        st = steps.sort_values("start_s")
        rows = [(int(r.step), float(r.start_s), f"{int(r.step)}") for r in st.itertuples(index=False)]
        rows.append((int(st["step"].iloc[-1]) + 1, float(st["end_s"].iloc[-1]), "end"))
    elif not spans.empty:
        first = spans.groupby("step")["start_s"].min().sort_index()
        rows = [(int(k), float(v), f"{int(k)}") for k, v in first.items()]
    else:
        rows = []
    out = pd.DataFrame(rows, columns=["step", "t_s", "label"])
    if len(out) > MAX_STEP_LABELS:
        k = -(-len(out) // MAX_STEP_LABELS)
        out = out.assign(label=[lab if i % k == 0 or lab == "end" else "" for i, lab in enumerate(out["label"])])
    return out


def time_overview(spans: pd.DataFrame, width: int = 620) -> alt.Chart:
    """A thin strip of the whole slice, coloured by phase, holding the time brush: drag across
    it to zoom every time view, double-click to see the whole slice again."""
    phases = list(spans["phase"].unique())
    return (
        alt.Chart(spans, title=alt.Title("whole slice: drag here to zoom, double-click to reset",
                                         fontSize=11, fontWeight="normal", anchor="start", color="#555"))
        .mark_bar(height={"band": 1.0})
        .encode(
            x=alt.X("start_s:Q", title=None, scale=alt.Scale(domainMin=0, nice=False, zero=False)),
            x2="end_s:Q",
            color=alt.Color("phase:N", scale=phase_scale(phases), legend=None),
        )
        .add_params(time_brush())
        .properties(width=width, height=18)
    )


def timeline_lanes(spans: pd.DataFrame, steps: pd.DataFrame | None = None, width: int = 620) -> alt.LayerChart:
    """One lane per phase (``other`` included: time no phase covered) along the zoomed time
    axis, with numbered step boundaries; hover for the step, phase, duration and source."""
    phases = list(spans["phase"].unique())
    x = alt.X("start_s:Q", title=X_TITLE, scale=time_scale())
    bars = (
        alt.Chart(spans)
        .mark_bar(height={"band": 0.8}, clip=True)
        .encode(
            x=x, x2="end_s:Q",
            y=alt.Y("phase:N", sort=phase_sort(phases), title=None),
            color=alt.Color("phase:N", scale=phase_scale(phases), legend=_legend()),
            opacity=alt.condition("datum.warmup", alt.value(0.35), alt.value(1.0)),
            tooltip=[
                alt.Tooltip("step:Q", title="step (negative: warmup)"), alt.Tooltip("phase:N"),
                alt.Tooltip("duration_ms:Q", format=".3f", title="ms"),
                alt.Tooltip("start_s:Q", format=".4f"), alt.Tooltip("source:N", title="measured at"),
            ],
        )
    )
    bounds = _boundaries(spans, steps)
    layers: list[Any] = [bars]
    if not bounds.empty:
        bx = alt.X("t_s:Q", scale=time_scale(), title=X_TITLE)
        layers.append(alt.Chart(bounds).mark_rule(color="#555", strokeDash=[2, 3], opacity=0.7, clip=True).encode(
            x=bx, tooltip=[alt.Tooltip("label:N", title="step starts"), alt.Tooltip("t_s:Q", format=".4f")]))
        layers.append(alt.Chart(bounds).mark_text(align="left", baseline="top", dx=2, y=1, fontSize=9,
                                                  color="#555", clip=True).encode(x=bx, text="label:N"))
    # numbers above the lanes: where each step starts (negative: warmup)
    return alt.layer(*layers, title="Stall timeline").properties(width=width, height=28 * max(3, len(phases)))


def stall_timeline(spans: pd.DataFrame, width: int = 620, steps: pd.DataFrame | None = None) -> alt.VConcatChart:
    """The overview strip (drag to zoom, double-click to reset) above one lane per phase.

    ``spans``: the rows of ``analysis.timeline_frame`` (columns of ``run.spans`` +
    duration_ms, warmup; ``other`` rows for time no phase covered); ``steps``: ``run.steps``
    for the numbered step boundaries (else they come from the spans)."""
    return time_views([timeline_lanes(spans, steps, width)], spans, width, spacing=6)


def time_views(views: list[Any], spans: pd.DataFrame, width: int, spacing: int = 8) -> alt.VConcatChart:
    """The overview strip above ``views`` (each drawn with ``time_scale``): the strip keeps its
    own scale (the whole slice), the views share one x scale (the brush's interval)."""
    body = alt.vconcat(*views, spacing=spacing).resolve_scale(x="shared", color="independent")
    return alt.vconcat(time_overview(spans, width), body, spacing=4).resolve_scale(x="independent",
                                                                                  color="independent")


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
