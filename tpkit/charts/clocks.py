"""Clock, power and temperature traces over the slice's time: ``frames -> altair.Chart``.

One panel per metric (one line per meaningful series: per-core lines that follow their mean
are folded into it by ``analysis.clocks.fold_cores`` before they get here), the step
boundaries as rules, bands where a GPU reported clock-event ("throttle") reasons. Every panel
draws its x axis with ``timeline.time_scale``: the brush on the overview strip above them
zooms the stall timeline, every clock panel and memory over time together; the axis ends
where the data ends.

A series that never moved is drawn as the flat line it is, centred in its panel, with the
constant value in the panel's title (a VM's /proc/cpuinfo clock does not change).
"""

from __future__ import annotations

from typing import Any

import altair as alt
import pandas as pd

from ..schema import CLOCK_METRICS
from .timeline import X_TITLE, time_scale, time_views, timeline_lanes

#: Panel order and axis titles: ``tpkit.schema.CLOCK_METRICS``; metrics not listed come after,
#: titled by their name.
METRIC_TITLES = CLOCK_METRICS
#: How a device reads in the legend.
DEVICE_LABELS = {"cpu": "host (all cores)", "process": "this process"}


def metric_order(metrics: list[str]) -> list[str]:
    """Metrics in panel order: the known ones first, in their fixed order, the others after."""
    return [m for m in METRIC_TITLES if m in metrics] + sorted(m for m in set(metrics) if m not in METRIC_TITLES)


def _panel(series: pd.DataFrame, metric: str, bounds: pd.DataFrame, bands: pd.DataFrame,
           width: int, height: int) -> alt.LayerChart:
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
    x = alt.X("t_s:Q", title=X_TITLE, scale=time_scale())
    labels = " : ".join(f"datum.label == '{k}' ? '{v}'" for k, v in DEVICE_LABELS.items()) + " : datum.label"
    line = (
        alt.Chart(series)
        .mark_line(interpolate="linear", clip=True)
        .encode(
            x=x,
            y=alt.Y("value:Q", title=None, scale=y_scale),
            color=alt.Color("device:N", legend=alt.Legend(title="series", labelExpr=labels)),
            strokeWidth=alt.condition("datum.device == 'cpu' || indexof(datum.device, 'cuda') == 0",
                                      alt.value(2.0), alt.value(0.8)),
            tooltip=[alt.Tooltip("t_s:Q", format=".3f", title="t (s)"), alt.Tooltip("device:N"),
                     alt.Tooltip("value:Q", format=",.4g", title=metric)],
        )
    )
    layers: list[alt.Chart] = []
    if not bands.empty:
        layers.append(
            alt.Chart(bands)
            .mark_rect(opacity=0.18, clip=True)
            .encode(x=alt.X("start_s:Q", scale=time_scale(), title=X_TITLE), x2="end_s:Q",
                    color=alt.Color("reasons:N", legend=alt.Legend(title="clock event (NVML)")),
                    tooltip=[alt.Tooltip("device:N"), alt.Tooltip("reasons:N"),
                             alt.Tooltip("start_s:Q", format=".3f"), alt.Tooltip("end_s:Q", format=".3f")])
        )
    if not bounds.empty:
        layers.append(
            alt.Chart(bounds)
            .mark_rule(strokeDash=[3, 3], clip=True)
            .encode(x=alt.X("end_s:Q", scale=time_scale(), title=X_TITLE),
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
    return [_panel(trace[trace["metric"] == m][["t_s", "device", "value"]], m, bounds, bands, width, height)
            for m in metric_order(list(trace["metric"].unique()))]


def _overview_rows(spans: pd.DataFrame, steps: pd.DataFrame, trace: pd.DataFrame) -> pd.DataFrame:
    """What the overview strip draws: the spans, else the steps, else the sampled stretch."""
    if not spans.empty:
        return spans
    if not steps.empty:
        return steps[["step", "start_s", "end_s"]].assign(phase="other")
    t = trace["t_s"] if not trace.empty else pd.Series([0.0])
    return pd.DataFrame({"step": [0], "start_s": [0.0], "end_s": [float(t.max())], "phase": ["other"]})


def _note_title(note: str | None, width: int) -> list[Any]:
    if not note:
        return []
    badge = pd.DataFrame({"text": [f"\u26a0 {note}"]})
    return [alt.Chart(badge).mark_text(align="left", x=0, y=8, color="#b00020", fontWeight="bold",
                                       fontSize=12).encode(text="text:N").properties(width=width, height=16)]


def clock_traces(trace: pd.DataFrame, steps: pd.DataFrame, bands: pd.DataFrame | None = None,
                 width: int = 620, height: int = 90, note: str | None = None) -> alt.VConcatChart:
    """One panel per metric over the slice's time, under the overview strip that zooms them.

    ``trace``: ``clock_analysis.fold_cores(clock_analysis.trace_frame(run.clocks))`` (t_s,
    device, metric, value). ``steps``: ``run.steps`` (step boundaries are drawn at ``end_s``).
    ``bands``: ``clock_analysis.throttle_bands(run.clocks)`` or None. ``note``: a warning shown
    above the panels (``clock_analysis.host_load(...)["text"]`` when the host was loaded).
    """
    views = [*_note_title(note, width), *_panels(trace, steps, bands, width, height)]
    return time_views(views, _overview_rows(pd.DataFrame(), steps, trace), width)


def clocks_with_timeline(spans: pd.DataFrame, trace: pd.DataFrame, steps: pd.DataFrame,
                         bands: pd.DataFrame | None = None, width: int = 620, height: int = 90,
                         memory: pd.DataFrame | None = None, note: str | None = None) -> alt.VConcatChart:
    """The stall timeline, the clock panels and memory over time on one time axis, under one
    overview strip: drag across it and all of them zoom to that interval.

    ``spans``: ``analysis.timeline_frame(run.spans, steps=run.steps)``; ``memory``:
    ``memory_analysis.wide(run.memory, ("enter", "exit", "peak"))`` for one device (or None);
    ``note``: see ``clock_traces``."""
    from .memory import memory_over_time

    views: list[Any] = [*_note_title(note, width)]
    if not spans.empty:
        views.append(timeline_lanes(spans, steps, width))
    views += _panels(trace, steps, bands, width, height)
    if memory is not None and not memory.empty:
        views.append(memory_over_time(memory, width=width, height=max(height, 110)))
    return time_views(views, _overview_rows(spans, steps, trace), width)
