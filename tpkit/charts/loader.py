"""The loader panel: where each batch's making went, stage by stage, which worker made it, and
apart from that work, how long each finished batch then waited for the training loop.

A batch waiting in the queue is the loader being *ahead* (slack), not a cost: stacked with
the work it would dominate a healthy loader's chart, so it gets its own panel, drawn light.
"""

from __future__ import annotations

import altair as alt
import pandas as pd

#: The work of making a batch, stacked per batch.
STAGES = {"fetch_s": "read + transform", "collate_s": "collate", "transfer_s": "transfer"}
STAGE_COLORS = ["#1f77b4", "#9467bd", "#ff7f0e"]
QUEUE_TITLE = "ready early: ms each finished batch waited for the loop (slack, not a stall)"


def loader_batches(loader: pd.DataFrame, width: int = 560) -> alt.VConcatChart:
    """Stacked milliseconds of work per batch by stage (left), batches per worker (right),
    and under them the time each batch waited in the queue for the loop.

    ``loader``: ``run.loader`` (rows of tpkit's Loader)."""
    long = loader.melt(id_vars=["batch", "worker"], value_vars=list(STAGES), var_name="stage", value_name="s")
    long["stage"] = long["stage"].map(STAGES)
    long["ms"] = long["s"] * 1e3
    order = list(STAGES.values())
    long["order"] = long["stage"].map({s: i for i, s in enumerate(order)})
    stages = alt.Chart(long, title="Loader: work per batch by stage").mark_bar().encode(
        x=alt.X("batch:O", title="batch"),
        y=alt.Y("sum(ms):Q", title="ms of work", stack="zero"),
        color=alt.Color("stage:N", scale=alt.Scale(domain=order, range=STAGE_COLORS), title="stage"),
        order=alt.Order("order:Q"),
        tooltip=["batch:O", "worker:N", "stage:N", alt.Tooltip("ms:Q", format=".3f")],
    ).properties(width=width, height=200)
    per_worker = alt.Chart(loader, title="Batches per worker").mark_bar().encode(
        x=alt.X("worker:O", title="worker (-1: main process)"), y=alt.Y("count():Q", title="batches"),
        tooltip=["worker:O", alt.Tooltip("count():Q", title="batches")],
    ).properties(width=140, height=200)
    queue = alt.Chart(loader.assign(queue_ms=loader["queue_wait_s"] * 1e3),
                      title=alt.Title(QUEUE_TITLE, fontSize=11, fontWeight="normal", anchor="start")).mark_bar(
        color="#b0b0b0", opacity=0.6).encode(
        x=alt.X("batch:O", title="batch"), y=alt.Y("queue_ms:Q", title="ms waited"),
        tooltip=["batch:O", "worker:N", alt.Tooltip("queue_ms:Q", format=".3f", title="waited (ms)")],
    ).properties(width=width, height=70)
    return alt.vconcat(alt.hconcat(stages, per_worker).resolve_scale(color="independent"), queue)
