"""The summary's chart: where a step's time goes, one bar per phase, in each phase's colour."""

from __future__ import annotations

import altair as alt
import pandas as pd

from .style import phase_scale, phase_sort


def phase_share_bars(shares: pd.DataFrame, width: int = 360) -> alt.LayerChart:
    """One horizontal bar per phase with its share of measured step time, labelled.

    ``shares``: ``phase, share`` (0..1) and ``ms_per_step``: what ``views.html`` builds from
    ``Summary.phase_share``; phases with no time left out by the caller.
    """
    phases = list(shares["phase"])
    order = phase_sort(phases)
    data = shares.assign(label=[f"{s:.0%}" if s >= 0.005 else "<1%" for s in shares["share"]])
    base = alt.Chart(data, title="Where a step's time goes").encode(
        y=alt.Y("phase:N", sort=order, title=None),
        x=alt.X("share:Q", title="share of measured step time", axis=alt.Axis(format="%"),
                scale=alt.Scale(domain=[0, 1])),
        tooltip=["phase:N", alt.Tooltip("share:Q", format=".1%", title="share"),
                 alt.Tooltip("ms_per_step:Q", format=",.2f", title="ms per step")],
    )
    bars = base.mark_bar().encode(color=alt.Color("phase:N", scale=phase_scale(phases), legend=None))
    text = base.mark_text(align="left", dx=4, fontSize=11).encode(text="label:N")
    return (bars + text).properties(width=width, height=20 * max(2, len(phases)))
