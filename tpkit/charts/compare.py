"""Comparison charts: ``Comparison`` frames -> ``altair.Chart``. Every number drawn here was
computed in ``tpkit.compare``; these functions only encode it."""

from __future__ import annotations

import altair as alt
import pandas as pd

from .style import phase_sort

_RUN_COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]


def run_scale(runs: list[str]) -> alt.Scale:
    """One fixed colour per run, in the comparison's order (the first run is the baseline)."""
    return alt.Scale(domain=list(runs), range=[_RUN_COLORS[i % len(_RUN_COLORS)] for i in range(len(runs))])


def step_time_overlay(steps: pd.DataFrame, runs: list[str] | None = None, width: int = 520) -> alt.Chart:
    """Per-step duration of every run on one axis; warmup steps faded.

    ``steps``: ``Comparison.steps`` (``run, step, warmup, duration_ms``).
    """
    runs = runs or list(dict.fromkeys(steps["run"]))
    return (
        alt.Chart(steps, title="Step time by run")
        .mark_line(point=True)
        .encode(
            x=alt.X("step:Q", title="step (negative: warmup)"),
            y=alt.Y("duration_ms:Q", title="step time (ms)"),
            color=alt.Color("run:N", scale=run_scale(runs), legend=alt.Legend(title="run")),
            opacity=alt.condition("datum.warmup", alt.value(0.35), alt.value(1.0)),
            tooltip=["run:N", "step:Q", alt.Tooltip("duration_ms:Q", format=".3f", title="ms")],
        )
        .properties(width=width, height=220)
    )


def phase_bars(phases: pd.DataFrame, runs: list[str] | None = None, width: int = 520) -> alt.Chart:
    """Median milliseconds per phase, one bar per run side by side within each phase.

    ``phases``: ``Comparison.phases`` (``run, phase, median_ms, share``).
    """
    runs = runs or list(dict.fromkeys(phases["run"]))
    return (
        alt.Chart(phases, title="Median time per phase by run")
        .mark_bar()
        .encode(
            x=alt.X("phase:N", sort=phase_sort(list(phases["phase"].unique())), title=None),
            xOffset=alt.XOffset("run:N", sort=runs),
            y=alt.Y("median_ms:Q", title="median per step (ms)"),
            color=alt.Color("run:N", scale=run_scale(runs), legend=alt.Legend(title="run")),
            tooltip=["run:N", "phase:N", alt.Tooltip("median_ms:Q", format=".3f", title="median ms"),
                     alt.Tooltip("share:Q", format=".1%", title="share of step time")],
        )
        .properties(width=width, height=220)
    )


def metric_intervals(table: pd.DataFrame, metric: str, runs: list[str] | None = None, width: int = 360) -> alt.Chart:
    """One metric's value per run with its confidence interval as a whisker, so overlap
    (no significant difference) is visible at a glance.

    ``table``: ``Comparison.table``; ``metric``: e.g. ``"step_time_p50"``.
    """
    rows = table[table["metric"] == metric]
    runs = runs or list(dict.fromkeys(rows["run"]))
    unit = str(rows["unit"].iloc[0]) if not rows.empty else ""
    title = f"{metric} ({unit})" if unit else metric
    base = alt.Chart(rows, title=title).encode(
        y=alt.Y("run:N", sort=runs, title=None),
        color=alt.Color("run:N", scale=run_scale(runs), legend=None),
        tooltip=["run:N", alt.Tooltip("value:Q", format=",.4g"), alt.Tooltip("ci_low:Q", format=",.4g"),
                 alt.Tooltip("ci_high:Q", format=",.4g"), "significant:N"],
    )
    whisker = base.mark_rule(strokeWidth=2).encode(x=alt.X("ci_low:Q", title=title, scale=alt.Scale(zero=False)),
                                                   x2="ci_high:Q")
    point = base.mark_point(filled=True, size=70).encode(x="value:Q")
    return (whisker + point).properties(width=width, height=26 * max(2, len(runs)))


def change_intervals(table: pd.DataFrame, baseline: str, metrics: tuple[str, ...] = ("step_time_p50", "throughput"),
                     runs: list[str] | None = None, threshold_pct: float = 2.0, width: int = 300) -> alt.HConcatChart:
    """The change of each run against the baseline, in % of the baseline, with its 95%
    interval as a whisker and the practical threshold (±``threshold_pct``) shaded: a whisker
    clear of the band and of zero is a significant change. One panel per metric.

    ``table``: ``Comparison.table`` (its ``delta_pct``, ``delta_low_pct``, ``delta_high_pct``,
    ``significant`` columns); ``baseline``: the baseline's label.
    """
    runs = runs or list(dict.fromkeys(table["run"]))
    others = [r for r in runs if r != baseline]
    panels = []
    for metric in metrics:
        rows = table[(table["metric"] == metric) & (table["run"] != baseline)]
        if rows.empty:
            continue
        label = str(rows["label"].iloc[0]) if "label" in rows.columns else metric
        data = rows.assign(verdict=rows["significant"].astype(str) + rows["direction"].map(
            lambda d: f", {d}" if d else ""))
        band = alt.Chart(pd.DataFrame({"lo": [-threshold_pct], "hi": [threshold_pct]})).mark_rect(
            color="#eeeeee").encode(x="lo:Q", x2="hi:Q")
        zero = alt.Chart(pd.DataFrame({"x": [0.0]})).mark_rule(color="#888").encode(x="x:Q")
        base = alt.Chart(data).encode(
            y=alt.Y("run:N", sort=others, title=None),
            color=alt.Color("run:N", scale=run_scale(runs), legend=None),
            tooltip=["run:N", alt.Tooltip("delta_pct:Q", format="+.1f", title="change %"),
                     alt.Tooltip("delta_low_pct:Q", format="+.1f", title="95% low %"),
                     alt.Tooltip("delta_high_pct:Q", format="+.1f", title="95% high %"), "verdict:N"],
        )
        whisker = base.mark_rule(strokeWidth=3).encode(
            x=alt.X("delta_low_pct:Q", title=f"{label}: change vs {baseline} (%)"), x2="delta_high_pct:Q")
        point = base.mark_point(filled=True, size=80).encode(x="delta_pct:Q")
        panels.append(alt.layer(band, zero, whisker, point).properties(
            width=width, height=24 * max(1, len(others)), title=f"{label} vs '{baseline}'"))
    return alt.hconcat(*panels)
