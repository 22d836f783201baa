"""The kernels A/B loss chart: the loss of both runs per step, and their difference."""

from __future__ import annotations

import altair as alt
import pandas as pd


def loss_ab(losses: pd.DataFrame, width: int = 420) -> alt.HConcatChart:
    """``losses``: ``tpkit.kernels.ab.compare_losses`` frame (step, loss_a, loss_b, diff, ...)."""
    long = losses.melt(id_vars=["step"], value_vars=["loss_a", "loss_b"], var_name="run", value_name="loss")
    long["run"] = long["run"].map({"loss_a": "A: kernels off", "loss_b": "B: kernels on"})
    lines = alt.Chart(long, title="Loss per step").mark_line(point=True).encode(
        x=alt.X("step:Q"), y=alt.Y("loss:Q", scale=alt.Scale(zero=False)),
        color=alt.Color("run:N", scale=alt.Scale(range=["#1f77b4", "#ff7f0e"])),
        strokeDash=alt.StrokeDash("run:N"), tooltip=["step:Q", "run:N", alt.Tooltip("loss:Q", format=".6g")],
    ).properties(width=width, height=220)
    diff = alt.Chart(losses, title="Loss difference (B - A)").mark_bar().encode(
        x=alt.X("step:O"), y=alt.Y("diff:Q", title="B - A"),
        color=alt.condition("datum.within_tol", alt.value("#2ca02c"), alt.value("#d62728")),
        tooltip=["step:Q", alt.Tooltip("diff:Q", format=".3g"), alt.Tooltip("rel_diff:Q", format=".3g"), "within_tol:N"],
    ).properties(width=width * 0.8, height=220)
    return alt.hconcat(lines, diff)
