"""The dashboard as HTML: the summary first (the verdict in words with its evidence, the top
recommendation, where a step's time goes, a small timeline, key figures with names and
units), then the recommendations, the loader, every chart once, and a comparison when
other runs are given. Used three ways:

- ``dashboard_html(run)``: a fragment with vega inlined once per page (the guard in
  ``render.bundle_html``), for ``Run``'s rich display;
- ``write_report(run, path)``: the standalone HTML file, opens offline;
- ``static_html(run)``: the same content with every chart drawn offline as SVG (no
  JavaScript): what a saved notebook shows without its kernel, on GitHub and in nbviewer.

Sections are registered in ``SECTIONS`` as ``(title, builder)``; a builder takes a Run and
returns a chart, or None when the Run has nothing for it (no memory rows, no loader rows).
"""

from __future__ import annotations

import html
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import altair as alt
import pandas as pd

from .. import charts
from ..analysis import steps as analysis
from ..schema import CLOCK_METRICS, fmt_bytes
from . import render
from .render import CSS, bundle_html, chart_html, vega_bundle

if TYPE_CHECKING:
    from ..analysis.recommend import Recommendation
    from ..run import Run

__all__ = ["CSS", "SECTIONS", "bundle_html", "chart_html", "dashboard_html", "key_figures", "section_charts",
           "static_html", "summary_html", "vega_bundle", "write_report"]

Draw = Callable[[Any], str]


def _timeline_section(run: "Run") -> alt.TopLevelMixin | None:
    spans = analysis.timeline_frame(run.spans, steps=run.steps)
    if spans.empty and run.steps.empty:
        return None
    parts: list[Any] = []
    if not spans.empty:
        parts.append(charts.stall_timeline(spans, steps=analysis.thin_steps(run.steps)))
    if not run.steps.empty:
        parts.append(charts.step_breakdown(analysis.breakdown_long(run.steps)))
    return alt.hconcat(*parts).resolve_scale(color="independent") if len(parts) > 1 else parts[0]


SectionBuilder = Callable[["Run"], "alt.TopLevelMixin | None"]
SECTIONS: list[tuple[str, SectionBuilder]] = [("Stall timeline", _timeline_section)]


def _clocks_section(run: "Run") -> alt.TopLevelMixin | None:
    """Clock, power and temperature panels under the stall timeline, on one time axis."""
    if run.clocks.empty:
        return None
    from ..analysis import clocks as ca
    from ..analysis import memory as ma

    device = ma.main_device(run.memory) if not run.memory.empty else None
    load = ca.host_load(run.clocks)
    return charts.clocks_with_timeline(analysis.timeline_frame(run.spans, steps=run.steps),
                                       ca.fold_cores(ca.trace_frame(run.clocks)),
                                       analysis.thin_steps(run.steps), ca.throttle_bands(run.clocks),
                                       memory=ma.levels_over_time(run.memory, device) if device else None,
                                       note=load["text"] if load and load["loaded"] else None)


SECTIONS.append(("Clocks and power", _clocks_section))


def _memory_section(run: "Run") -> alt.TopLevelMixin | None:
    """The waterfall of the measured step with the highest peak, beside memory across steps,
    on the device whose memory matters most (the GPU when one was used)."""
    if run.memory.empty:
        return None
    from ..analysis import memory as ma

    device = ma.main_device(run.memory)
    if device is None:
        return None
    across = ma.across_steps(run.memory, device)
    step = ma.peak_step(run.memory, device, across=across)
    assert step is not None
    room = ma.headroom(run.memory, run.meta)
    room = room[room["device"] == device]
    head = room.iloc[0] if not room.empty else None
    wf = charts.memory_waterfall(
        ma.waterfalls(run.memory, device=device, across=across) if step >= 0 else ma.waterfall(run.memory, step, device),
        ma.step_peak(run.memory, step, device),
        headroom_bytes=None if head is None or head["headroom_bytes"] != head["headroom_bytes"] else float(head["headroom_bytes"]),
        capacity_bytes=None if head is None or head["capacity_bytes"] != head["capacity_bytes"] else float(head["capacity_bytes"]),
        step=step, device=device)
    return alt.hconcat(wf, charts.memory_by_step(ma.thin_across(across)))


SECTIONS.append(("Memory", _memory_section))


def _ranks_section(run: "Run") -> alt.TopLevelMixin | None:
    """For a Run merged by ``tp.load_ranks``: the straggler verdict, per-rank step times and skew,
    the merged timeline (one lane per rank), the memory peaks, and the missing ranks named."""
    ranks = run.meta.get("ranks") or {}
    times = ranks.get("step_times")
    if not times:
        return None
    from ..analysis.ranks import rank_skew
    from ..charts.ranks import ranks_view

    steps = pd.DataFrame(times, columns=["rank", "step", "duration_s", "warmup"])
    timeline = pd.DataFrame(ranks.get("timeline") or [], columns=["rank", "step", "phase", "start_s", "end_s"])
    peaks = pd.DataFrame(ranks.get("memory_peaks") or [], columns=["rank", "device", "peak_bytes"])
    return ranks_view(steps, rank_skew(steps), timeline, peaks,
                      verdict=str(ranks.get("straggler") or "straggler: not computed (a run merged by an older tpkit)"),
                      straggler=ranks.get("straggler_rank"), world_size=ranks.get("world_size"),
                      missing=list(ranks.get("missing") or []))


SECTIONS.append(("Ranks", _ranks_section))


def _loader_section(run: "Run") -> alt.TopLevelMixin | None:
    """tpkit's loader: per-batch stages, titled with the one loader advice
    (``recommend.loader_advice``: the same worker count the recommendations give)."""
    from ..analysis.recommend import loader_advice
    from ..charts.loader import loader_batches

    v = loader_advice(run)
    if v is None:
        return None
    return loader_batches(run.loader).properties(
        title=alt.TitleParams(f"loader: {v.verdict}; would use {v.workers} workers", subtitle=[v.reason],
                              anchor="start"))


SECTIONS.append(("Loader", _loader_section))


def _ops_section(run: "Run") -> alt.TopLevelMixin | None:
    """Top operators by self time within each phase (``--ops``: torch.profiler's traced steps)."""
    if run.ops is None or run.ops.empty:
        return None
    from ..analysis.ops import top_ops
    from ..charts.ops import ops_per_phase

    top = top_ops(run.ops, run.spans)
    return None if top.empty else ops_per_phase(top, steps=(run.meta.get("ops") or {}).get("steps"))


SECTIONS.append(("Ops", _ops_section))


def section_charts(run: "Run") -> list[tuple[str, alt.TopLevelMixin]]:
    """The dashboard's charts for this Run, in order, skipping sections with no data."""
    out = []
    for title, build in SECTIONS:
        chart = build(run)
        if chart is not None:
            out.append((title, chart))
    return out


def report_charts(run: "Run") -> list[tuple[str, alt.TopLevelMixin]]:
    """``section_charts`` with each chart once: when the clocks section draws the stall
    timeline above its panels, the timeline section keeps only the per-step breakdown."""
    out = section_charts(run)
    titles = [t for t, _ in out]
    if "Clocks and power" in titles and "Stall timeline" in titles and not run.steps.empty:
        i = titles.index("Stall timeline")
        out[i] = ("Time per step by phase", charts.step_breakdown(analysis.breakdown_long(run.steps)))
    return out


# -- the summary -------------------------------------------------------------------------------

def _recommendations(run: "Run") -> list["Recommendation"]:
    from ..analysis.recommend import recommendations

    return recommendations(run)


def _summary(run: "Run") -> "analysis.Summary":
    """``summarize`` with clocks and memory; a clock analysis that fails on odd rows costs
    the clock lines only (said in a note), never the summary."""
    try:
        return analysis.summarize(run.steps, run.meta, run.clocks, run.memory, run.spans)
    except Exception as e:  # noqa: BLE001 - the rest of the summary still stands
        s = analysis.summarize(run.steps, run.meta, None, run.memory, run.spans)
        s.notes.append(f"clock summary unavailable ({type(e).__name__}: {e})")
        return s


def _num(v: float, digits: int = 3) -> str:
    if v != v:
        return "n/a"
    return f"{v:,.1f}" if abs(v) >= 10 else f"{v:,.{digits}g}"


def key_figures(run: "Run", s: "analysis.Summary | None" = None) -> list[tuple[str, str]]:
    """The summary's figures as ``(name, value with unit)``, for people: counts as integers,
    times in ms, shares in %, bytes in KiB/MiB/GiB, clocks by their names."""
    s = s if s is not None else _summary(run)
    out: list[tuple[str, str]] = []
    if s.steps == 0:
        return [("measured steps", "0")]
    timed = s.step_p50_s == s.step_p50_s  # False when the step durations are missing (NaN)
    out.append(("throughput", f"{_num(s.throughput)} samples/s" if s.throughput == s.throughput
                else "unknown (step durations missing)" if not timed
                else f"unknown ({analysis.RATE_UNCOUNTED if s.uncounted else analysis.RATE_UNKNOWN})"))
    out.append(("step time", f"p50 {s.step_p50_s * 1e3:,.2f} ms, p95 {s.step_p95_s * 1e3:,.2f} ms" if timed
                else "unknown (step durations missing)"))
    out.append(("measured steps", f"{s.steps:,d} (+{s.warmup_steps:,d} warmup), {s.samples:,d} samples"))
    out.append(("data stall", f"{s.data_stall_share:.1%} of step time"))
    if not run.memory.empty:
        from ..analysis.compare import peak_memory_bytes

        peaks = {k: v for k, v in peak_memory_bytes(run.memory).items() if k.startswith("total")}
        for key, nbytes in peaks.items():
            out.append(("peak memory" + key[len("total"):].replace("[", " (").replace("]", ")"), fmt_bytes(nbytes)))
    c = s.clocks or {}
    if c.get("metric"):
        name = re.sub(r"\s*\(.*\)$", "", CLOCK_METRICS.get(c["metric"], c["metric"]))
        unit = "MHz" if str(c["metric"]).endswith("_mhz") else ""
        moved = "" if c.get("clock_moved") else " (steady)"
        if c["mean_clock"] == c["mean_clock"]:
            out.append((f"{name}, mean ({c.get('device')})", f"{c['mean_clock']:,.0f} {unit}".rstrip() + moved))
        else:  # no reading inside the measured steps (a slice shorter than the sampling period)
            from ..analysis.clocks import ClockSummary

            text = ClockSummary(**{k: v for k, v in c.items() if k in ClockSummary.__dataclass_fields__}).clock_text(unit)
            out.append((f"{name} ({c.get('device')})", text[0].upper() + text[1:]))
    for device, e in (c.get("energy") or {}).items():
        out.append((f"energy per sample ({device})", f"{e['per_sample_j']:.3g} J"))
    if c.get("throttled_steps"):
        out.append(("throttled steps", f"{c['throttled_steps']:,d} of {c.get('steps', 0):,d}"))
    from ..analysis.recommend import loader_advice

    v = loader_advice(run)
    if v is not None:
        out.append(("tpkit loader", f"{v.verdict}; would use {v.workers} workers"))
    return out


def _share_frame(s: "analysis.Summary") -> pd.DataFrame:
    rows = [(c[:-2], v, v * s.total_s / s.steps * 1e3 if s.steps else 0.0)
            for c, v in s.phase_share.items() if v > 0.0005]
    return pd.DataFrame(rows, columns=["phase", "share", "ms_per_step"])


def recommendation_html(r: "Recommendation", top: bool = False) -> str:
    """One recommendation: the title, the knob and its new value, the expected gain, the evidence."""
    act = ", ".join(f"{k} = {v!r}" for k, v in r.action.items())
    head = "Top recommendation: " if top else ""
    return (f'<div class="tp-rec"><b>{head}{html.escape(r.title)}</b><br>'
            f"knob <code>{html.escape(str(r.knob))}</code>" + (f" &rarr; <code>{html.escape(act)}</code>" if act else "")
            + f"; expected: {html.escape(str(r.expected_gain))}"
            f'<br><span class="tp-small">evidence: {html.escape(r.evidence)}</span></div>')


def recommendations_html(recs: Sequence["Recommendation"], skip: int = 0) -> str:
    """The recommendations after the first ``skip``, collapsed under a count."""
    rest = list(recs)[skip:]
    if not rest:
        return ""
    items = "".join(recommendation_html(r) for r in rest)
    word = "more recommendation" if skip else "recommendation"
    return f"<details><summary>{len(rest)} {word}{'s' if len(rest) != 1 else ''}</summary>{items}</details>"


def summary_html(run: "Run", draw: Draw = chart_html, timeline: bool = True,
                 recs: Sequence["Recommendation"] | None = None) -> str:
    """The summary, answer first: verdict with evidence, top recommendation, where the time
    goes (chart) beside a small timeline, key figures, notes, then details. ``draw``: how a
    chart reaches the page (``render.chart_html`` live, ``render.svg_html`` static)."""
    s = _summary(run)
    recs = list(recs) if recs is not None else _recommendations(run)
    state = "" if s.complete else (' <span class="tp-bad">INCOMPLETE: '
                                   f'{html.escape(str(run.meta.get("error", "")))}</span>')
    model = run.meta.get("model") or {}
    about = ", ".join(x for x in [
        f"model {model.get('class')} ({model.get('parameters', 0):,} parameters)" if model else "",
        "; ".join(str(d) for d in run.meta.get("devices", []) or []),
    ] if x)
    v = s.verdict
    verdict = (f'<div class="tp-verdict">{html.escape(v.headline)}: {html.escape(v.evidence)}</div>'
               + (f'<div class="tp-note">{html.escape(v.advice)}</div>' if v.advice else ""))
    top = recommendation_html(recs[0], top=True) if recs else \
        '<div class="tp-note">No recommendation: no rule fired.</div>'
    drawn = ""
    shares = _share_frame(s)
    if not shares.empty:
        from ..charts.summary import phase_share_bars

        drawn += draw(phase_share_bars(shares))
    if timeline:
        # with the steps: the stretch before the first step is tpkit's probes going in, not other
        spans = analysis.timeline_frame(run.spans, steps=run.steps, max_rows=1500)
        if not spans.empty:
            drawn += draw(charts.stall_timeline(spans, width=440))
    rows = "".join(f"<tr><td>{html.escape(k)}</td><td><b>{html.escape(val)}</b></td></tr>"
                   for k, val in key_figures(run, s))
    notes = "".join(f'<div class="tp-note">note: {html.escape(n)}</div>' for n in s.notes)
    details = "".join(f"<div>{html.escape(c)}</div>" for c in s.clock_lines)
    details = f"<details><summary>Clock details</summary>{details}</details>" if details else ""
    return (f"<h3>tpkit run '{html.escape(run.name)}'{state}</h3>"
            f'<div class="tp-note">{html.escape(about)}</div>{verdict}{top}'
            f'<div class="tp-row">{drawn}</div>'
            f'<table class="tp-sum tp-figures">{rows}</table>{notes}'
            f"{recommendations_html(recs, skip=1)}{details}")


def loader_html(run: "Run") -> str:
    """The loader's verdict in words (the same advice as the recommendations)."""
    from ..analysis.recommend import loader_advice

    v = loader_advice(run)
    if v is None:
        return ""
    return (f'<div class="tp-verdict">Loader: {html.escape(v.verdict)}; would use {v.workers} workers</div>'
            f'<div class="tp-note">{html.escape(v.reason)}; a batch takes {v.make_s * 1e3:,.2f} ms to make '
            f"and {v.transfer_s * 1e3:,.2f} ms to move; {v.ready_fraction:.0%} were ready when the loop asked</div>")


def _comparison(run: "Run", compare_with: Sequence["Run"], charts_as: str) -> str:
    others = [r for r in compare_with if r is not run]
    if not others:
        return ""
    from ..analysis.compare import compare
    from .compare import comparison_html

    return comparison_html(compare(*others, run), charts=charts_as)


def _page(run: "Run", draw: Draw, compare_with: Sequence["Run"], charts_as: str) -> str:
    parts = [summary_html(run, draw=draw, timeline=False)]
    for title, chart in report_charts(run):
        extra = loader_html(run) if title == "Loader" else ""
        parts.append(f"<h3>{html.escape(title)}</h3>{extra}{draw(chart)}")
    parts.append(_comparison(run, compare_with, charts_as))
    return "".join(parts)


def dashboard_html(run: "Run", include_js: bool = True, compare_with: Sequence["Run"] = ()) -> str:
    """An HTML fragment: summary, recommendations, every chart once, the comparison with
    ``compare_with``. ``include_js`` puts vega on the page (once per page: guarded)."""
    body = _page(run, chart_html, compare_with, "vega")
    return render.styled((bundle_html() if include_js else "") + body)


#: Hides a static view wherever the live widget beside it rendered (JupyterLab, Notebook 7,
#: nbviewer with widget state): the static copy shows only when the widget cannot.
STATIC_HIDE_CSS = (".jp-OutputArea:has(.tpkit-live) .tpkit-static,.output_area:has(.tpkit-live) ~ * .tpkit-static,"
                   ".jp-Cell:has(.tpkit-live) .tpkit-static,.cell:has(.tpkit-live) .tpkit-static{display:none}")


def static_html(run: "Run", compare_with: Sequence["Run"] = ()) -> str:
    """The dashboard with every chart drawn offline as SVG: no JavaScript, so it shows in a
    notebook reopened without its kernel, on GitHub and in nbviewer."""
    body = _page(run, render.svg_html, compare_with, "svg")
    return (f'<div class="tpkit-static"><style>{STATIC_HIDE_CSS}</style>'
            f'<div class="tp-note" style="font:12px system-ui">tpkit dashboard (static copy: open the notebook '
            f"with its kernel for the interactive one)</div>{render.styled(body)}</div>")


def write_report(run: "Run", path: str | Path, compare_with: Sequence["Run"] = ()) -> Path:
    """A standalone HTML file of the dashboard (and the comparison with ``compare_with``);
    opens offline."""
    out = Path(path)
    if out.suffix.lower() not in (".html", ".htm"):
        out = out / "report.html"
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = (f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>tpkit: {html.escape(run.name)}</title>'
           f"</head><body>{dashboard_html(run, compare_with=compare_with)}</body></html>")
    out.write_text(doc, encoding="utf-8")
    return out
