"""The memory waterfall and memory by category across steps: ``frames -> altair.Chart``."""

from __future__ import annotations

from typing import Any

import altair as alt
import pandas as pd

from ..schema import MEMORY_CATEGORIES, MIB, fmt_mib

CATEGORY_ORDER: list[str] = list(MEMORY_CATEGORIES)
CATEGORY_COLORS: dict[str, str] = {
    "parameters": "#1f77b4",
    "gradients": "#6a51a3",
    "optimizer_state": "#2ca02c",
    "activations": "#ff7f0e",
    "temporaries": "#fdd0a2",
    "data": "#d62728",
    "other": "#b0b0b0",
}


def category_scale() -> alt.Scale:
    """Colours of the memory categories, the same in every memory chart."""
    return alt.Scale(domain=CATEGORY_ORDER, range=[CATEGORY_COLORS[c] for c in CATEGORY_ORDER])


#: The step selector's parameter name (bound to a drop-down under the waterfall).
STEP_PARAM = "waterfall_step"
KIND_ORDER = ["start", "allocated", "freed"]


def _change_legend() -> alt.Legend:
    """One legend for how a bar changed memory (solid: allocated, light and dashed: freed)."""
    return alt.Legend(title="change", orient="right", values=["allocated", "freed"], symbolType="square",
                      symbolSize=160, symbolFillColor="#6a51a3", symbolStrokeColor="#3f2d6e", symbolStrokeWidth=1.5)


def memory_waterfall(wf: pd.DataFrame, peak: dict[str, Any] | None = None, headroom_bytes: float | None = None,
                     capacity_bytes: float | None = None, step: int | None = None, device: str = "cpu",
                     width: int = 460) -> alt.LayerChart:
    """One bar per stretch of the step, in the order they ran, stacked by category:
    allocations rise from the running total (solid), frees hang down from it (light, dashed
    outline); the running total is a dashed line and the step's peak a red tick inside the
    bar where it happened. Its own legends: categories, and allocated/freed.

    ``wf``: ``memory_analysis.waterfall`` (one step) or ``memory_analysis.waterfalls`` (a
    ``step`` column: a drop-down picks the step, ``step`` (default: the peak step) first);
    ``peak``: ``memory_analysis.step_peak`` of ``step``, for the title's mix at the peak.
    """
    data = wf.copy()
    if "label" not in data.columns:  # a frame of the older layout
        data["label"] = data["phase"].astype(str)
    if "kind" not in data.columns:
        data["kind"] = ["freed" if d < 0 else "allocated" for d in data["delta_bytes"]]
    if "peak_bytes" not in data.columns:
        data["peak_bytes"] = data["total_bytes"]
    steps = sorted(int(v) for v in data["step"].unique()) if "step" in data.columns else []
    if step is None and steps:
        step = int(data.loc[data["peak_bytes"].idxmax(), "step"])
    if not steps:
        data["step"] = step if step is not None else 0
    data = data.assign(y0_mib=data["y0_bytes"] / MIB, y1_mib=data["y1_bytes"] / MIB,
                       delta_mib=data["delta_bytes"] / MIB, total_mib=data["total_bytes"] / MIB,
                       peak_mib=data["peak_bytes"] / MIB)
    x = alt.X("label:N", sort=alt.EncodingSortField("order", op="min"), title=None,
              axis=alt.Axis(labelAngle=-35, labelLimit=140))
    drawn = data[data["kind"] != "peak only"]
    # a stretch that both allocates and frees draws its rises and falls side by side
    bars = alt.Chart(drawn).mark_bar(strokeWidth=1.2).encode(
        x=x, xOffset=alt.XOffset("kind:N", sort=KIND_ORDER),
        y=alt.Y("y0_mib:Q", title="MiB"), y2="y1_mib:Q",
        color=alt.Color("category:N", scale=category_scale(),
                        legend=alt.Legend(title="memory category", orient="right")),
        fillOpacity=alt.FillOpacity("kind:N", scale=alt.Scale(type="ordinal", domain=KIND_ORDER, range=[1.0, 1.0, 0.3]),
                                    legend=_change_legend()),
        stroke=alt.Color("category:N", scale=category_scale(), legend=None),
        strokeDash=alt.StrokeDash("kind:N", scale=alt.Scale(domain=KIND_ORDER, range=[[1, 0], [1, 0], [3, 2]]),
                                  legend=_change_legend()),
        tooltip=[alt.Tooltip("label:N", title="stretch"), alt.Tooltip("category:N"), alt.Tooltip("kind:N"),
                 alt.Tooltip("delta_mib:Q", format="+,.3f", title="change (MiB)"),
                 alt.Tooltip("total_mib:Q", format=",.3f", title="total after (MiB)")],
    )
    totals = data.drop_duplicates(["step", "order"])[["step", "order", "label", "total_mib", "peak_mib"]]
    line = alt.Chart(totals).mark_line(point=True, color="#222", strokeDash=[4, 2]).encode(
        x=x, y="total_mib:Q", tooltip=[alt.Tooltip("total_mib:Q", format=",.3f", title="running total (MiB)")])
    top = totals.loc[totals.groupby("step")["peak_mib"].idxmax()].assign(
        text=lambda d: [f"peak {v:,.2f} MiB" for v in d["peak_mib"]])
    tick = alt.Chart(top).mark_tick(color="#b00020", thickness=3, size=18).encode(
        x=x, y="peak_mib:Q", tooltip=[alt.Tooltip("label:N", title="peak during"),
                                      alt.Tooltip("peak_mib:Q", format=",.3f", title="peak (MiB)")])
    text = alt.Chart(top).mark_text(align="center", dy=-10, color="#b00020").encode(x=x, y="peak_mib:Q", text="text:N")
    # other stretches that rose above both their ends inside (a transient): a light tick at that height
    t = totals.sort_values(["step", "order"])
    before = t.groupby("step")["total_mib"].shift(1).fillna(t["total_mib"])
    inner = t[(t["peak_mib"] > t["total_mib"] + 1e-9) & (t["peak_mib"] > before + 1e-9)
              & ~t.index.isin(top.index)]
    transient = alt.Chart(inner).mark_tick(color="#b00020", opacity=0.45, thickness=2, size=14).encode(
        x=x, y="peak_mib:Q", tooltip=[alt.Tooltip("label:N", title="highest inside"),
                                      alt.Tooltip("peak_mib:Q", format=",.3f", title="MiB")])
    layers: list[Any] = [bars, line, tick, text, transient]
    title = f"Memory waterfall ({device})"
    subtitle = []
    if steps and len(steps) > 1:
        subtitle.append(f"pick a step below; shown first: step {step}, the one with the highest peak")
    elif step is not None:
        title += f", step {step}"
    if peak:
        mix = sorted(peak["by_category"].items(), key=lambda kv: -kv[1])
        made = ", ".join(f"{c} {v / max(peak['total_bytes'], 1):.0%}" for c, v in mix if v > 0)
        subtitle.append(f"step {step}: peak {fmt_mib(peak['total_bytes'])} during {peak['phase']} ({made})")
    if headroom_bytes is not None and capacity_bytes:
        subtitle.append(f"headroom at the slice's peak: {headroom_bytes / 2**30:,.2f} GiB "
                        f"of {capacity_bytes / 2**30:,.2f} GiB")
    chart = alt.layer(*layers)
    if len(steps) > 1:
        pick = alt.param(name=STEP_PARAM, value=step,
                         bind=alt.binding_select(options=steps, name="step "))
        chart = chart.add_params(pick).transform_filter(f"datum.step == {STEP_PARAM}")
    return chart.properties(title=alt.TitleParams(title, subtitle=subtitle) if subtitle else title,
                            width=width, height=260)


def memory_over_time(levels: pd.DataFrame, width: int = 620, height: int = 110) -> alt.Chart:
    """Memory by category at every phase boundary (and phase peak) along the slice's time,
    stacked, on the shared zoomable time axis (``timeline.time_scale``).

    ``levels``: ``memory_analysis.wide(run.memory, ("enter", "exit", "peak"))`` for one device."""
    from .timeline import X_TITLE, time_scale

    cats = [c for c in CATEGORY_ORDER if c in levels.columns]
    long = levels.melt(id_vars=["t_s", "step", "phase"], value_vars=cats, var_name="category", value_name="bytes")
    long = long.assign(mib=long["bytes"] / MIB, order=long["category"].map({c: i for i, c in enumerate(CATEGORY_ORDER)}))
    return alt.Chart(long, title=alt.Title("memory over time (MiB)", anchor="start", fontSize=12)).mark_area(
        interpolate="step-after", clip=True).encode(
        x=alt.X("t_s:Q", title=X_TITLE, scale=time_scale()),
        y=alt.Y("mib:Q", stack="zero", title=None),
        color=alt.Color("category:N", scale=category_scale(), legend=alt.Legend(title="memory category")),
        order=alt.Order("order:Q"),
        tooltip=[alt.Tooltip("t_s:Q", format=".4f", title="t (s)"), alt.Tooltip("step:Q"), alt.Tooltip("phase:N"),
                 alt.Tooltip("category:N"), alt.Tooltip("mib:Q", format=",.3f", title="MiB")],
    ).properties(width=width, height=height)


def memory_by_step(across: pd.DataFrame, width: int = 360) -> alt.LayerChart:
    """Memory by category at the end of every step (stacked bars) and the step's peak (line):
    growth from step to step shows as a staircase.

    ``across``: ``memory_analysis.across_steps`` for one device.
    """
    order = {c: i for i, c in enumerate(CATEGORY_ORDER)}
    data = across.assign(mib=across["bytes"] / MIB, peak_mib=across["peak_bytes"] / MIB,
                         order=across["category"].map(order))
    bars = alt.Chart(data).mark_bar().encode(
        x=alt.X("step:O", title="step (negative: warmup)"),
        y=alt.Y("sum(mib):Q", title="MiB at step end", stack="zero"),
        color=alt.Color("category:N", scale=category_scale(), legend=None),
        order=alt.Order("order:Q"),
        tooltip=[alt.Tooltip("step:O"), alt.Tooltip("category:N"), alt.Tooltip("mib:Q", format=",.3f", title="MiB")],
    )
    peaks = data.drop_duplicates("step")[["step", "peak_mib"]]
    line = alt.Chart(peaks).mark_line(point=True, color="#b00020").encode(
        x="step:O", y="peak_mib:Q", tooltip=[alt.Tooltip("step:O"), alt.Tooltip("peak_mib:Q", format=",.3f", title="peak MiB")])
    return alt.layer(bars, line).properties(title="Memory by category across steps (line: step peak)",
                                            width=width, height=260)
