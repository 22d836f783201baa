"""A comparison drawn: the charts and the one-screen HTML view of ``tp.compare(...)``.

The view: warnings, the rule that calls a change significant, the change charts (intervals
first), then one row per run with metrics as columns (value; change against the baseline
with its interval and verdict), time per phase, phase shares and memory collapsed below. Six runs fit in
about 1,000 px of height.
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING, Any

import altair as alt
import numpy as np

from ..analysis import stats as cmp  # the words and thresholds of the verdicts on a change
from ..analysis.stats import CI_LEVEL
from ..charts import compare as ch
from . import render

if TYPE_CHECKING:
    from ..analysis.compare import Comparison

#: The main table's columns, in order; phase times, phase shares and memory go in collapsed tables.
MAIN_METRICS = ("throughput", "step_time_p50", "data_wait_time", "data_stall_share", "loss_final")


def comparison_charts(c: "Comparison") -> list[tuple[str, Any]]:
    """``(title, altair chart)`` for each chart with data, intervals first: the change of
    step time and throughput against the baseline with intervals, then step time per step
    beside the median time per phase."""
    out: list[tuple[str, Any]] = []
    metrics = tuple(m for m in ("step_time_p50", "throughput")
                    if ((c.table["metric"] == m) & (c.table["run"] != c.baseline)
                        & c.table["delta_pct"].notna()).any())
    if metrics and len(c.labels) > 1:
        out.append(("Change against the baseline, with 95% intervals",
                    ch.change_intervals(c.table, c.baseline, metrics, c.labels,
                                        threshold_pct=cmp.REL_THRESHOLD * 100)))
    lower = []
    if not c.steps.empty:
        lower.append(ch.step_time_overlay(c.steps, c.labels, width=420))
    if not c.phases.empty:
        lower.append(ch.phase_bars(c.phases, c.labels, width=360))
    if lower:
        chart = alt.hconcat(*lower).resolve_scale(color="shared") if len(lower) > 1 else lower[0]
        out.append(("Step time and time per phase by run", chart))
    return out


def _cell(r: Any, baseline: str) -> str:
    """One table cell: the value (with its interval) and, for other runs, the change."""
    value = f"<b>{cmp.fmt_num(r.value)}</b>"
    if np.isfinite(r.ci_low) and r.ci_low != r.ci_high:
        value += f' <span class="tp-small">[{cmp.fmt_num(r.ci_low)}, {cmp.fmt_num(r.ci_high)}]</span>'
    if r.run == baseline:
        return value + '<br><span class="tp-small">baseline</span>'
    if r.unit == "%":  # shares change in percentage points
        change, lo, hi, unit = r.delta, r.delta_low, r.delta_high, " pp"
    elif np.isfinite(r.delta_pct):
        change, lo, hi, unit = r.delta_pct, r.delta_low_pct, r.delta_high_pct, "%"
    else:
        change, lo, hi, unit = r.delta, r.delta_low, r.delta_high, ""
    change_txt = f"{change:+.1f}{unit}" if np.isfinite(change) else "n/a"
    if np.isfinite(lo) and np.isfinite(hi) and r.significant != cmp.NOT_TESTED:
        change_txt += f" [{lo:+.1f}, {hi:+.1f}]"
    cls = "tp-note"
    verdict = "" if r.significant == cmp.NOT_TESTED else str(r.significant)
    if r.significant == cmp.SIGNIFICANT:
        cls = "tp-good" if r.direction == "better" else "tp-bad" if r.direction == "worse" else "tp-note"
        verdict += f", {r.direction}" if r.direction else ""
    why = f' title="{html.escape(str(r.why))}"' if r.why else ""
    return value + f'<br><span class="tp-small {cls}"{why}>{html.escape(change_txt)} {html.escape(verdict)}</span>'


def _grid(c: "Comparison", metrics: list[str], first: str = "") -> str:
    t = c.table
    metrics = [m for m in metrics if (t["metric"] == m).any()]
    if not metrics:
        return ""
    head = "<th>run</th>" + (f"<th>{first}</th>" if first else "")
    for m in metrics:
        r = t[t["metric"] == m].iloc[0]
        head += f"<th>{html.escape(str(r.label))}" + (f" ({html.escape(str(r.unit))})" if r.unit else "") + "</th>"
    rows = []
    for label in c.labels:
        cells = f"<td><b>{html.escape(label)}</b></td>"
        if first:
            cells += f"<td>{c.counts.get(label, 0)}</td>"
        for m in metrics:
            r = t[(t["metric"] == m) & (t["run"] == label)]
            cells += f"<td>{_cell(r.iloc[0], c.baseline) if not r.empty else 'n/a'}</td>"
        rows.append(f"<tr>{cells}</tr>")
    return f'<table class="tp-grid"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'


def comparison_html(c: "Comparison", charts: str = "svg", title: bool = True) -> str:
    """The comparison as HTML. ``charts``: ``"svg"`` (drawn offline, static: renders
    anywhere), ``"vega"`` (live, needs ``render.bundle_html()`` on the page) or ``"none"``."""
    warn = "".join(f'<div class="tp-bad">&#9888; {html.escape(w)}</div>' for w in c.warnings)
    rule = (f'<div class="tp-note">Changes against <b>{html.escape(c.baseline)}</b> with {CI_LEVEL:.0%} intervals. '
            f"<i>significant</i>: the interval excludes 0, the runs are at least {cmp.REL_THRESHOLD:.0%} apart "
            f"({cmp.SHARE_THRESHOLD_PP:g}% of the step for a phase's time per step) and further apart than "
            f"{cmp.DRIFT_FACTOR:g}x the drift between the halves of either run's own steps (the intervals cannot "
            f"see a machine's load moving between runs; hover a verdict for why a change is not called); shares "
            f"of step time are shown, not judged; <i>not enough data</i>: fewer than "
            f"{cmp.MIN_STEPS} measured steps or a figure unknown in a run.</div>")
    drawn = ""
    if charts != "none":
        draw = render.svg_html if charts == "svg" else render.chart_html
        drawn = '<div class="tp-row">' + "".join(draw(chart) for _, chart in comparison_charts(c)) + "</div>"
    metrics = list(dict.fromkeys(c.table["metric"]))
    main = _grid(c, [m for m in MAIN_METRICS if m in metrics], first="steps")
    times = [m for m in metrics if m.endswith("_time") and m not in MAIN_METRICS]
    shares = [m for m in metrics if m.endswith("_share") and m not in MAIN_METRICS]
    memory = [m for m in metrics if m.startswith("peak_memory_") or m.startswith("energy_per_sample")]
    more = ""
    if times:
        more += f"<details><summary>Time per phase (ms a step)</summary>{_grid(c, times)}</details>"
    if shares:
        more += f"<details><summary>Share of step time per phase (not judged)</summary>{_grid(c, shares)}</details>"
    if memory:
        more += f"<details><summary>Peak memory and energy</summary>{_grid(c, memory)}</details>"
    head = f"<h3>Comparison of {len(c.labels)} runs</h3>" if title else ""
    return render.styled(f'<div class="tpkit-compare">{head}{warn}{rule}{drawn}{main}{more}</div>')
