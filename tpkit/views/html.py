"""The dashboard as self-contained HTML: the summary, the recommendations and every chart,
with vega's JavaScript inlined (from vl-convert) so it renders with no network, both under a
notebook cell and as a file opened from disk.

Sections are registered in ``SECTIONS`` as ``(title, builder)``; a builder takes a Run and
returns a chart, or None when the Run has nothing for it (no memory rows, no loader rows).
"""

from __future__ import annotations

import html
import json
import uuid
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import altair as alt

from .. import charts
from ..analysis import steps as analysis

if TYPE_CHECKING:
    from ..run import Run


def _timeline_section(run: "Run") -> alt.TopLevelMixin | None:
    spans = analysis.timeline_frame(run.spans)
    if spans.empty and run.steps.empty:
        return None
    parts = []
    if not spans.empty:
        parts.append(charts.stall_timeline(spans))
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

    return charts.clocks_with_timeline(analysis.timeline_frame(run.spans), ca.trace_frame(run.clocks),
                                       analysis.thin_steps(run.steps), ca.throttle_bands(run.clocks))


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
    measured = across[across["step"] >= 0]
    pool = measured if not measured.empty else across
    step = int(pool.loc[pool["peak_bytes"].idxmax(), "step"])
    room = ma.headroom(run.memory, run.meta)
    room = room[room["device"] == device]
    head = room.iloc[0] if not room.empty else None
    wf = charts.memory_waterfall(
        ma.waterfall(run.memory, step, device), ma.step_peak(run.memory, step, device),
        headroom_bytes=None if head is None or head["headroom_bytes"] != head["headroom_bytes"] else float(head["headroom_bytes"]),
        capacity_bytes=None if head is None or head["capacity_bytes"] != head["capacity_bytes"] else float(head["capacity_bytes"]),
        step=step, device=device)
    return alt.hconcat(wf, charts.memory_by_step(ma.thin_across(across)))


SECTIONS.append(("Memory", _memory_section))


def _ranks_section(run: "Run") -> alt.TopLevelMixin | None:
    """Per-rank step times and skew, for a Run merged by ``tp.load_ranks``."""
    times = (run.meta.get("ranks") or {}).get("step_times")
    if not times:
        return None
    import pandas as pd

    from ..analysis.ranks import rank_skew

    steps = pd.DataFrame(times, columns=["rank", "step", "duration_s", "warmup"])
    return charts.rank_step_times(steps, rank_skew(steps))


SECTIONS.append(("Ranks", _ranks_section))


def _loader_section(run: "Run") -> alt.TopLevelMixin | None:
    """tpkit's loader: per-batch stages, and its verdict with the worker count it would choose."""
    if run.loader.empty:
        return None
    from ..analysis.loader import loader_verdict
    from ..charts.loader import loader_batches

    v = loader_verdict(run.loader, steps=run.steps)
    return loader_batches(run.loader).properties(
        title=alt.TitleParams(f"loader: {v.verdict}; would use {v.workers} workers", subtitle=[v.reason],
                              anchor="start"))


SECTIONS.append(("Loader", _loader_section))


def section_charts(run: "Run") -> list[tuple[str, alt.TopLevelMixin]]:
    """The dashboard's charts for this Run, in order, skipping sections with no data."""
    out = []
    for title, build in SECTIONS:
        chart = build(run)
        if chart is not None:
            out.append((title, chart))
    return out


@lru_cache(maxsize=1)
def vega_bundle() -> str:
    """vega + vega-lite + vega-embed as one script, matching altair's Vega-Lite version."""
    from altair.utils._importers import import_vl_convert, vl_version_for_vl_convert

    return import_vl_convert().javascript_bundle(vl_version=vl_version_for_vl_convert())


CSS = """
.tpkit-dash{font-family:system-ui,-apple-system,Segoe UI,sans-serif;font-size:13px;color:#222}
.tpkit-dash h3{margin:14px 0 6px;font-size:15px}
.tpkit-dash table.tp-sum{border-collapse:collapse;margin:4px 0}
.tpkit-dash table.tp-sum td{padding:2px 10px 2px 0}
.tpkit-dash .tp-verdict{font-weight:600;margin:6px 0}
.tpkit-dash .tp-bad{color:#b00020}
.tpkit-dash .tp-note{color:#555}
"""


def summary_html(run: "Run") -> str:
    s = analysis.summarize(run.steps, run.meta, run.clocks)  # run.summary() plus the clock lines
    rows = "".join(
        f"<tr><td>{html.escape(str(f))}</td><td><b>{_fmt(v)}</b> {html.escape(str(u))}</td></tr>"
        for f, v, u in s.to_frame().itertuples(index=False)
    )
    state = "" if s.complete else (' <span class="tp-bad">INCOMPLETE: '
                                   f'{html.escape(str(run.meta.get("error", "")))}</span>')
    notes = "".join(f'<div class="tp-note">note: {html.escape(n)}</div>' for n in s.notes)
    notes = "".join(f"<div>{html.escape(c)}</div>" for c in s.clock_lines) + notes
    model = run.meta.get("model") or {}
    about = ", ".join(x for x in [
        f"model {model.get('class')} ({model.get('parameters', 0):,} parameters)" if model else "",
        "; ".join(run.meta.get("devices", [])),
    ] if x)
    return (f"<h3>tpkit run '{html.escape(run.name)}'{state}</h3>"
            f'<div class="tp-note">{html.escape(about)}</div>'
            f'<div class="tp-verdict">{html.escape(s.verdict.text)}</div>'
            f'<table class="tp-sum">{rows}</table>{notes}')


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return "n/a" if v != v else (f"{v:,.1f}" if abs(v) >= 100 else f"{v:,.3g}")
    return html.escape(str(v))


def chart_html(chart: alt.TopLevelMixin) -> str:
    """A div and the script that embeds ``chart`` in it once vega is on the page (the
    script waits for it, so the order in which a frontend renders outputs does not matter)."""
    div = f"tp-{uuid.uuid4().hex[:12]}"
    spec = json.dumps(chart.to_dict(), separators=(",", ":")).replace("</", "<\\/")
    opts = '{"actions":{"export":true,"source":false,"compiled":false,"editor":false}}'
    return (f'<div id="{div}"></div><script type="text/javascript">(function(){{var n=0;function go(){{'
            f'if(window.vegaEmbed){{window.vegaEmbed("#{div}",{spec},{opts}).catch(console.error);}}'
            f'else if(n++<400){{setTimeout(go,50);}}}}go();}})();</script>')


def bundle_html() -> str:
    """vega's JavaScript as a script tag (~900 KB): once per page or dashboard."""
    return f'<script type="text/javascript">{vega_bundle()}</script>'


def dashboard_html(run: "Run", include_js: bool = True) -> str:
    """An HTML fragment: summary + charts. ``include_js`` inlines vega (~900 KB)."""
    parts = [f'<div class="tpkit-dash"><style>{CSS}</style>', summary_html(run)]
    sections = section_charts(run)
    if include_js and sections:
        parts.append(bundle_html())
    for title, chart in sections:
        parts.append(f"<h3>{html.escape(title)}</h3>{chart_html(chart)}")
    parts.append("</div>")
    return "".join(parts)


def write_report(run: "Run", path: str | Path) -> Path:
    """A standalone HTML file of the dashboard; opens offline."""
    out = Path(path)
    if out.suffix.lower() not in (".html", ".htm"):
        out = out / "report.html"
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = (f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>tpkit: {html.escape(run.name)}</title>'
           f"</head><body>{dashboard_html(run)}</body></html>")
    out.write_text(doc, encoding="utf-8")
    return out
