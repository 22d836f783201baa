"""Operators per phase (``--ops``): one bar chart per tpkit phase of the operators with the
most self time, labelled with their input shapes. ``frames -> altair.Chart``, nothing else."""

from __future__ import annotations

import altair as alt
import pandas as pd

from .style import phase_scale


def ops_per_phase(top: pd.DataFrame, width: int = 420, steps: list[int] | None = None) -> alt.VConcatChart:
    """A bar chart per phase: ms of self time per traced step for its top operators.

    ``top``: ``analysis.ops.top_ops(run.ops, run.spans)``; ``steps``: the traced steps, for
    the title (``run.meta["ops"]["steps"]``)."""
    data = top.assign(label=[f"{op}  {shapes}" if shapes else str(op)
                             for op, shapes in zip(top["op"], top["input_shapes"])])
    phases = list(dict.fromkeys(data["phase"]))
    scale = phase_scale(phases)
    charts = []
    for phase in phases:
        part = data[data["phase"] == phase]
        shown = float(part["share_of_phase"].sum())
        head = f"{phase}: top operators by self time ({shown:.0%} of the phase's operator time)"
        charts.append(alt.Chart(part, title=alt.Title(head, anchor="start", fontSize=12)).mark_bar().encode(
            x=alt.X("self_ms_per_step:Q", title="ms of self time per traced step"),
            y=alt.Y("label:N", sort="-x", title=None, axis=alt.Axis(labelLimit=360)),
            color=alt.Color("phase:N", scale=scale, legend=None),
            tooltip=[alt.Tooltip("op:N"), alt.Tooltip("input_shapes:N", title="input shapes"),
                     alt.Tooltip("calls:Q"), alt.Tooltip("self_ms_per_step:Q", format=",.3f", title="ms/step"),
                     alt.Tooltip("share_of_phase:Q", format=".0%", title="share of the phase's op time"),
                     alt.Tooltip("self_cpu_s:Q", format=",.6f", title="self CPU s (all traced steps)"),
                     alt.Tooltip("self_device_s:Q", format=",.6f", title="self device s (all traced steps)")],
        ).properties(width=width, height=max(40, 18 * len(part))))
    which = f" (steps {steps[0]}-{steps[-1]}, torch.profiler)" if steps else ""
    return alt.vconcat(*charts, spacing=12).properties(
        title=alt.Title(f"Ops per phase{which}", anchor="start"))
