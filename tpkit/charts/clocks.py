"""Clock, power and temperature traces over the slice's time: ``frames -> altair.Chart``.

One panel per metric (lines per device), the step boundaries as rules, bands where a GPU
reported clock-event ("throttle") reasons, and the time selection ``TIME_BRUSH_NAME`` bound
to the x scale: every panel shares that scale with the stall timeline when composed by
``clocks_with_timeline``, so zooming or panning any of them moves all.

A series that never moved is drawn as the flat line it is, centred in its panel, with the
constant value in the panel's title (a VM's /proc/cpuinfo clock does not change).
"""

from __future__ import annotations

import warnings
from typing import Any

import altair as alt
import pandas as pd

from ..schema import CLOCK_METRICS
from .timeline import TIME_BRUSH_NAME, stall_timeline

#: Panel order and axis titles: ``tpkit.schema.CLOCK_METRICS``; metrics not listed come after,
#: titled by their name.
METRIC_TITLES = CLOCK_METRICS
X_TITLE = "time since slice start (s)"


def _time_brush() -> alt.Parameter:
    return alt.selection_interval(bind="scales", encodings=["x"], name=TIME_BRUSH_NAME)


def metric_order(metrics: list[str]) -> list[str]:
    """Metrics in panel order: the known ones first, in their fixed order, the others after."""
    return [m for m in METRIC_TITLES if m in metrics] + sorted(m for m in set(metrics) if m not in METRIC_TITLES)


def _panel(series: pd.DataFrame, metric: str, bounds: pd.DataFrame, bands: pd.DataFrame,
           brush: alt.Parameter, width: int, height: int) -> alt.LayerChart:
    values = series["value"]
    lo, hi = float(values.min()), float(values.max())
    flat = lo == hi
    title = METRIC_TITLES.get(metric, metric)
    if flat:  # an honest flat line: centred, with its value said out loud
        pad = max(abs(lo) * 0.05, 1.0)
        y_scale = alt.Scale(domain=[lo - pad, hi + pad], zero=False)
        title += f": constant {lo:,.6g} during the slice"
    else:
        y_scale = alt.Scale(zero=metric.endswith("_pct") or metric.endswith("_w"))
    x = alt.X("t_s:Q", title=X_TITLE)
    line = (
        alt.Chart(series)
        .mark_line(interpolate="linear", clip=True)
        .encode(
            x=x,
            y=alt.Y("value:Q", title=None, scale=y_scale),
            color=alt.Color("device:N", legend=alt.Legend(title="device")),
            strokeWidth=alt.condition("datum.device == 'cpu' || indexof(datum.device, 'cuda') == 0",
                                      alt.value(2.0), alt.value(0.8)),
            tooltip=[alt.Tooltip("t_s:Q", format=".3f", title="t (s)"), alt.Tooltip("device:N"),
                     alt.Tooltip("value:Q", format=",.4g", title=metric)],
        )
        .add_params(brush)
    )
    layers: list[alt.Chart] = []
    if not bands.empty:
        layers.append(
            alt.Chart(bands)
            .mark_rect(opacity=0.18, clip=True)
            .encode(x=alt.X("start_s:Q"), x2="end_s:Q",
                    color=alt.Color("reasons:N", legend=alt.Legend(title="clock event (NVML)")),
                    tooltip=[alt.Tooltip("device:N"), alt.Tooltip("reasons:N"),
                             alt.Tooltip("start_s:Q", format=".3f"), alt.Tooltip("end_s:Q", format=".3f")])
        )
    if not bounds.empty:
        layers.append(
            alt.Chart(bounds)
            .mark_rule(strokeDash=[3, 3], clip=True)
            .encode(x=alt.X("end_s:Q"),
                    color=alt.value("#999999"),
                    opacity=alt.condition("datum.warmup", alt.value(0.25), alt.value(0.6)),
                    tooltip=[alt.Tooltip("step:Q", title="end of step (negative: warmup)"),
                             alt.Tooltip("duration_ms:Q", format=".2f", title="step ms")])
        )
    return alt.layer(*layers, line, title=alt.Title(title, anchor="start", fontSize=12)).properties(
        width=width, height=height).resolve_scale(color="independent")


def _panels(trace: pd.DataFrame, steps: pd.DataFrame, bands: pd.DataFrame | None, width: int,
            height: int) -> list[alt.LayerChart]:
    bands = bands if bands is not None else pd.DataFrame(columns=["device", "start_s", "end_s", "reasons"])
    bounds = (steps[["step", "warmup", "end_s"]].assign(duration_ms=steps["duration_s"] * 1e3) if not steps.empty
              else pd.DataFrame(columns=["step", "warmup", "end_s", "duration_ms"]))
    brush = _time_brush()
    return [_panel(trace[trace["metric"] == m][["t_s", "device", "value"]], m, bounds, bands, brush, width, height)
            for m in metric_order(list(trace["metric"].unique()))]


def clock_traces(trace: pd.DataFrame, steps: pd.DataFrame, bands: pd.DataFrame | None = None,
                 width: int = 620, height: int = 90) -> alt.VConcatChart:
    """One panel per metric over the slice's time.

    ``trace``: ``clock_analysis.trace_frame(run.clocks)`` (t_s, device, metric, value).
    ``steps``: ``run.steps`` (step boundaries are drawn at ``end_s``).
    ``bands``: ``clock_analysis.throttle_bands(run.clocks)`` or None.
    """
    return _vconcat(*_panels(trace, steps, bands, width, height), spacing=8)


def clocks_with_timeline(spans: pd.DataFrame, trace: pd.DataFrame, steps: pd.DataFrame,
                         bands: pd.DataFrame | None = None, width: int = 620, height: int = 90) -> alt.VConcatChart:
    """The stall timeline on top of the clock panels, one shared time axis: zoom or pan any
    of them and the others follow. ``spans``: ``analysis.timeline_frame(run.spans)``."""
    panels = _panels(trace, steps, bands, width, height)
    if spans.empty:
        return _vconcat(*panels, spacing=8)
    return _vconcat(stall_timeline(spans, width=width), *panels, spacing=10)


def _vconcat(*charts: Any, spacing: int) -> alt.VConcatChart:
    """Stack charts on one shared x scale. The time brush is added to every panel on purpose:
    altair lifts it to one parameter over all their views, and says so in a warning that
    would only confuse a notebook user."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Automatically deduplicated selection parameter")
        return alt.vconcat(*charts, spacing=spacing).resolve_scale(x="shared", color="independent")
