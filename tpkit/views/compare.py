"""A comparison drawn: the overlaid charts of ``tp.compare(...)``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..analysis.stats import CI_LEVEL
from ..charts import compare as ch

if TYPE_CHECKING:
    from ..analysis.compare import Comparison


def comparison_charts(c: "Comparison") -> list[tuple[str, Any]]:
    """``(title, altair chart)`` for each chart with data: step time per step, median time per
    phase, and the intervals of step time and throughput."""
    out: list[tuple[str, Any]] = []
    if not c.steps.empty:
        out.append(("Step time by run", ch.step_time_overlay(c.steps, c.labels)))
    if not c.phases.empty:
        out.append(("Median time per phase by run", ch.phase_bars(c.phases, c.labels)))
    for metric in ("step_time_p50", "throughput"):
        if (c.table["metric"] == metric).any():
            out.append((f"{metric} with {CI_LEVEL:.0%} intervals", ch.metric_intervals(c.table, metric, c.labels)))
    return out
