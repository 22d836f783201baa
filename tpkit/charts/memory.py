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


def memory_waterfall(wf: pd.DataFrame, peak: dict[str, Any] | None = None, headroom_bytes: float | None = None,
                     capacity_bytes: float | None = None, step: int | None = None, device: str = "cpu",
                     width: int = 460) -> alt.LayerChart:
    """Rising and falling bars stacked by category, one bar per stretch of the step, with the
    running total as a line, the step's peak as a labelled rule and the headroom in the title.

    ``wf``: ``memory_analysis.waterfall``; ``peak``: ``memory_analysis.step_peak``.
    """
    data = wf.assign(label=wf["order"].astype(str).str.zfill(2) + " " + wf["phase"].astype(str),
                     direction=["fall" if d < 0 else "rise" for d in wf["delta_bytes"]],
                     y0_mib=wf["y0_bytes"] / MIB, y1_mib=wf["y1_bytes"] / MIB,
                     delta_mib=wf["delta_bytes"] / MIB, total_mib=wf["total_bytes"] / MIB)
    labels = list(dict.fromkeys(data.sort_values("order")["label"]))
    x = alt.X("label:N", sort=labels, title=None, axis=alt.Axis(labelAngle=-40))
    # a stretch that both allocates and frees draws its rises and falls side by side
    bars = alt.Chart(data).mark_bar().encode(
        x=x, xOffset=alt.XOffset("direction:N", sort=["rise", "fall"]),
        y=alt.Y("y0_mib:Q", title="MiB"), y2="y1_mib:Q",
        color=alt.Color("category:N", scale=category_scale(), legend=alt.Legend(title="category")),
        tooltip=[alt.Tooltip("phase:N"), alt.Tooltip("category:N"),
                 alt.Tooltip("delta_mib:Q", format="+,.3f", title="change (MiB)"),
                 alt.Tooltip("total_mib:Q", format=",.3f", title="total after (MiB)")],
    )
    totals = data.drop_duplicates("label")[["label", "total_mib"]]
    line = alt.Chart(totals).mark_line(point=True, color="#222", strokeDash=[4, 2]).encode(
        x=x, y="total_mib:Q", tooltip=[alt.Tooltip("total_mib:Q", format=",.3f", title="running total (MiB)")])
    layers: list[Any] = [bars, line]
    if peak:
        mix = sorted(peak["by_category"].items(), key=lambda kv: -kv[1])
        made = ", ".join(f"{c} {v / max(peak['total_bytes'], 1):.0%}" for c, v in mix if v > 0)
        text = f"peak {fmt_mib(peak['total_bytes'])} in {peak['phase']} ({made})"
        pk = pd.DataFrame({"peak_mib": [peak["total_bytes"] / MIB], "text": [text]})
        layers.append(alt.Chart(pk).mark_rule(color="#b00020", strokeWidth=2).encode(y="peak_mib:Q"))
        layers.append(alt.Chart(pk).mark_text(align="left", dx=4, dy=-7, color="#b00020", x=0).encode(
            y="peak_mib:Q", text="text:N"))
    title = "Memory waterfall" + (f", step {step}" if step is not None else "") + f" ({device})"
    subtitle = []
    if headroom_bytes is not None and capacity_bytes:
        subtitle.append(f"headroom at the slice's peak: {headroom_bytes / 2**30:,.2f} GiB "
                        f"of {capacity_bytes / 2**30:,.2f} GiB")
    return alt.layer(*layers).properties(
        title=alt.TitleParams(title, subtitle=subtitle) if subtitle else title, width=width, height=260)


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
