"""The tuner's trade-off chart: throughput against peak memory, best setting marked."""

from __future__ import annotations

import altair as alt
import pandas as pd


def tradeoff(results: pd.DataFrame, width: int = 420) -> alt.LayerChart:
    """``results``: ``tpkit.tuning.results_frame``. Runs without memory rows sit at x = 0."""
    knob_cols = [c for c in results.columns if c not in
                 ("run", "throughput", "step_p50_ms", "data_stall_pct", "peak_mib", "verdict", "complete", "best")]
    data = results.assign(peak_mib=results["peak_mib"].fillna(0.0),
                          label=results["run"] + results["best"].map({True: "  (best)", False: ""}))
    base = alt.Chart(data, title="Throughput vs peak memory").encode(
        x=alt.X("peak_mib:Q", title="peak memory (MiB)", scale=alt.Scale(zero=False)),
        y=alt.Y("throughput:Q", title="samples/s", scale=alt.Scale(zero=False)),
    )
    points = base.mark_circle().encode(
        size=alt.condition("datum.best", alt.value(260), alt.value(90)),
        color=alt.condition("datum.best", alt.value("#2ca02c"), alt.value("#1f77b4")),
        tooltip=["run:N", *[f"{c}:N" for c in knob_cols], alt.Tooltip("throughput:Q", format=",.1f"),
                 alt.Tooltip("step_p50_ms:Q", format=".2f"), alt.Tooltip("peak_mib:Q", format=",.1f"), "verdict:N"],
    )
    labels = base.mark_text(align="left", dx=8, dy=-6, fontSize=11).encode(text="label:N")
    return (points + labels).properties(width=width, height=260)
