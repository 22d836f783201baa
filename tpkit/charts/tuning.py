"""The tuner's trade-off chart: throughput against peak memory, one point per setting with
its 95% interval over the replicate slices, the best setting labelled."""

from __future__ import annotations

import altair as alt
import pandas as pd

#: Columns of the tuner's frames that are not knobs.
NOT_KNOBS = ("run", "replicates", "throughput", "throughput_low", "throughput_high", "step_p50_ms", "data_stall_pct",
             "peak_mib", "verdict", "complete", "short", "best", "clear", "runs")


def setting_labels(results: pd.DataFrame) -> list[str]:
    """``'num_workers=2, batch_size=16'`` per row, from the knob columns."""
    knobs = [c for c in results.columns if c not in NOT_KNOBS]
    return [", ".join(f"{k}={row[k]}" for k in knobs) or str(row["run"]) for _, row in results.iterrows()]


def tradeoff(results: pd.DataFrame, width: int = 420) -> alt.LayerChart:
    """``results``: ``tuning.settings_frame`` (or ``results_frame``: no intervals). Settings
    without memory rows sit at x = 0. Only the best point is labelled (every label on a
    crowded chart overlaps); the others say who they are on hover."""
    knob_cols = [c for c in results.columns if c not in NOT_KNOBS]
    data = results.drop(columns=[c for c in ("runs",) if c in results.columns]).assign(
        peak_mib=results["peak_mib"].fillna(0.0), setting=setting_labels(results))
    data["label"] = ["best: " + s if b else "" for s, b in zip(data["setting"], data["best"])]
    base = alt.Chart(data, title="Throughput vs peak memory (one point per setting)").encode(
        x=alt.X("peak_mib:Q", title="peak memory (MiB)", scale=alt.Scale(zero=False)),
        y=alt.Y("throughput:Q", title="samples/s", scale=alt.Scale(zero=False)),
    )
    tips = ["setting:N", *[f"{c}:N" for c in knob_cols], alt.Tooltip("throughput:Q", format=",.1f"),
            alt.Tooltip("step_p50_ms:Q", format=".2f"), alt.Tooltip("peak_mib:Q", format=",.1f"), "verdict:N"]
    layers = []
    if "throughput_low" in data.columns:
        tips += [alt.Tooltip("throughput_low:Q", format=",.1f", title="95% low"),
                 alt.Tooltip("throughput_high:Q", format=",.1f", title="95% high"), "replicates:Q"]
        layers.append(base.mark_rule(strokeWidth=2, color="#999").encode(y="throughput_low:Q", y2="throughput_high:Q"))
    layers.append(base.mark_circle(opacity=0.9).encode(
        size=alt.condition("datum.best", alt.value(260), alt.value(90)),
        color=alt.condition("datum.best", alt.value("#2ca02c"), alt.value("#1f77b4")), tooltip=tips))
    layers.append(base.mark_text(align="left", dx=10, dy=-8, fontSize=11).encode(text="label:N"))
    return alt.layer(*layers).properties(width=width, height=260)
