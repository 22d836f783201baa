"""Colours and order shared by every chart, so a phase looks the same everywhere."""

from __future__ import annotations

import altair as alt

from .. import schema

#: The steps' phases, then the spans tpkit records inside ``other`` (files the loop read itself,
#: metric calls, torch.jit.trace).
PHASE_ORDER: list[str] = [*schema.PHASE_ORDER, schema.FILE_LOAD, schema.METRIC_CALL, schema.JIT_TRACE]
PHASE_COLORS: dict[str, str] = {
    "data_wait": "#d62728",  # red: the stall the eye must find first
    "h2d": "#ff7f0e",
    "forward": "#1f77b4",
    "backward": "#6a51a3",
    "optimizer": "#2ca02c",
    "offload": "#8c564b",
    "comm": "#393b79",  # blocked in collectives (waiting for other ranks)
    "eval": "#aec7e8",  # evaluation inside the slice: a paler forward
    "save": "#637939",  # checkpoints written inside the slice
    "setup": "#c7c7c7",  # a trainer's setup inside the slice: a paler other
    "compile": "#ce6dbd",  # torch.compile compiling inside the slice: apart from every training colour
    "tpkit": "#e7ba52",  # tpkit's own probe work
    "other": "#b0b0b0",
    schema.FILE_LOAD: "#8a8a8a",  # files the loop read itself, inside other: a darker other
    schema.METRIC_CALL: "#9c9ede",  # metric calls (torchmetrics), inside other
    schema.JIT_TRACE: "#dbdb8d",  # torch.jit.trace (TensorBoard's add_graph), inside other
}
_USER_COLORS = ["#17becf", "#bcbd22", "#e377c2", "#7f7f7f", "#9edae5", "#c49c94"]


def phase_scale(phases: list[str]) -> alt.Scale:
    """A colour scale with built-in phases in their fixed colours and user phases after them."""
    domain = [p for p in PHASE_ORDER if p in phases] + sorted(p for p in set(phases) if p not in PHASE_COLORS)
    user = iter(_USER_COLORS * 4)
    return alt.Scale(domain=domain, range=[PHASE_COLORS.get(p) or next(user) for p in domain])


def phase_sort(phases: list[str]) -> list[str]:
    """Phases in drawing order: built-in phases in their fixed order, user phases after, sorted."""
    return [p for p in PHASE_ORDER if p in phases] + sorted(p for p in set(phases) if p not in PHASE_COLORS)
