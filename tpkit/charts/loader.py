"""The loader panel: where each batch's time went, stage by stage, and which worker made it."""

from __future__ import annotations

import altair as alt
import pandas as pd

STAGES = {"fetch_s": "read + transform", "collate_s": "collate", "transfer_s": "transfer", "queue_wait_s": "waited in queue"}
STAGE_COLORS = ["#1f77b4", "#9467bd", "#ff7f0e", "#b0b0b0"]


def loader_batches(loader: pd.DataFrame, width: int = 560) -> alt.HConcatChart:
    """Stacked milliseconds per batch by stage (left) and batches per worker (right).

    ``loader``: ``run.loader`` (rows of tpkit's Loader)."""
    long = loader.melt(id_vars=["batch", "worker"], value_vars=list(STAGES), var_name="stage", value_name="s")
    long["stage"] = long["stage"].map(STAGES)
    long["ms"] = long["s"] * 1e3
    order = list(STAGES.values())
    long["order"] = long["stage"].map({s: i for i, s in enumerate(order)})
    stages = alt.Chart(long, title="Loader: time per batch by stage").mark_bar().encode(
        x=alt.X("batch:O", title="batch"),
        y=alt.Y("sum(ms):Q", title="ms", stack="zero"),
        color=alt.Color("stage:N", scale=alt.Scale(domain=order, range=STAGE_COLORS), title="stage"),
        order=alt.Order("order:Q"),
        tooltip=["batch:O", "worker:N", "stage:N", alt.Tooltip("ms:Q", format=".3f")],
    ).properties(width=width, height=200)
    per_worker = alt.Chart(loader, title="Batches per worker").mark_bar().encode(
        x=alt.X("worker:O", title="worker (-1: main process)"), y=alt.Y("count():Q", title="batches"),
        tooltip=["worker:O", alt.Tooltip("count():Q", title="batches")],
    ).properties(width=140, height=200)
    return alt.hconcat(stages, per_worker).resolve_scale(color="independent")
