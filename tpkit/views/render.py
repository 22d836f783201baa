"""How a chart reaches a page: live (vega in the browser) or static (SVG made offline).

- ``chart_html(chart)``: a div and a script that embeds the chart once vega is on the page.
- ``bundle_html()``: vega + vega-lite + vega-embed (~900 KB), guarded so that it runs at most
  once per page: a second copy does nothing (no "Identifier 'Ti' has already been declared").
- ``svg_html(chart)``: the chart drawn by vl-convert as an SVG image (no JavaScript, no
  network): the static form every display also carries, for a notebook reopened without its
  kernel, nbviewer and GitHub. It is an ``<img>`` with a ``data:`` URI, not inline ``<svg>``:
  JupyterLab's sanitizer removes inline SVG from an untrusted notebook's HTML and keeps
  images (seen in tests/test_browser.py). A chart whose SVG would be very large becomes a PNG.

Nothing here measures or builds a chart; views call these on charts from ``tpkit.charts``.
"""

from __future__ import annotations

import base64
import html
import json
import uuid
from functools import lru_cache
from typing import Any

#: An SVG larger than this (thousands of marks) is written as a PNG instead.
SVG_MAX_BYTES = 400_000

CSS = """
.tpkit-dash{font-family:system-ui,-apple-system,Segoe UI,sans-serif;font-size:13px;color:#222}
.tpkit-dash h3{margin:14px 0 6px;font-size:15px}
.tpkit-dash h4{margin:10px 0 4px;font-size:13px}
.tpkit-dash table.tp-sum{border-collapse:collapse;margin:4px 0}
.tpkit-dash table.tp-sum td,.tpkit-dash table.tp-sum th{padding:2px 12px 2px 0;text-align:left;vertical-align:top}
.tpkit-dash table.tp-grid{border-collapse:collapse;margin:4px 0}
.tpkit-dash table.tp-grid th{border-bottom:1px solid #bbb;padding:3px 10px;text-align:left;white-space:nowrap}
.tpkit-dash table.tp-grid td{border-bottom:1px solid #eee;padding:3px 10px;vertical-align:top;white-space:nowrap}
.tpkit-dash .tp-verdict{font-weight:600;margin:6px 0;font-size:14px}
.tpkit-dash .tp-bad{color:#b00020}
.tpkit-dash .tp-good{color:#1a7f37}
.tpkit-dash .tp-note{color:#555}
.tpkit-dash .tp-small{font-size:11px;color:#555}
.tpkit-dash .tp-rec{border-left:3px solid #1f77b4;padding:4px 8px;margin:6px 0;background:#f5f8fc}
.tpkit-dash .tp-row{display:flex;flex-wrap:wrap;gap:16px;align-items:flex-start}
.tpkit-dash details{margin:6px 0}
.tpkit-dash summary{cursor:pointer;font-weight:600}
"""


def styled(body: str) -> str:
    """``body`` inside tpkit's style scope."""
    return f'<div class="tpkit-dash"><style>{CSS}</style>{body}</div>'


@lru_cache(maxsize=1)
def vega_bundle() -> str:
    """vega + vega-lite + vega-embed as one script, matching altair's Vega-Lite version."""
    from altair.utils._importers import import_vl_convert, vl_version_for_vl_convert

    return import_vl_convert().javascript_bundle(vl_version=vl_version_for_vl_convert())


def bundle_html() -> str:
    """vega's JavaScript as a script tag that runs only when the page has no vega yet.

    The bundle sits in a block, so its top-level ``const``/``let`` are block-scoped: a second
    copy on the page (another dashboard, a rerun cell) declares nothing globally and is
    skipped by the guard. Charts (``chart_html``) wait for ``window.vegaEmbed``."""
    return ('<script type="text/javascript">if(!window.vegaEmbed){\n'
            f"{vega_bundle()}\n}}</script>")


def chart_html(chart: Any) -> str:
    """A div and the script that embeds ``chart`` in it once vega is on the page (the
    script waits for it, so the order in which a frontend renders outputs does not matter).
    The analyses bound every chart's rows; altair's own row limit is lifted so that a long
    run draws (slowly) rather than failing the dashboard."""
    import altair as alt

    div = f"tp-{uuid.uuid4().hex[:12]}"
    with alt.data_transformers.disable_max_rows():
        spec = json.dumps(chart.to_dict(), separators=(",", ":")).replace("</", "<\\/")
    opts = '{"actions":{"export":true,"source":false,"compiled":false,"editor":false}}'
    return (f'<div id="{div}" class="tp-live-chart"></div><script type="text/javascript">(function(){{var n=0;'
            f'function go(){{if(window.vegaEmbed){{window.vegaEmbed("#{div}",{spec},{opts}).catch(console.error);}}'
            f'else if(n++<400){{setTimeout(go,50);}}}}go();}})();</script>')


def _vl_version() -> str:
    from altair.utils._importers import vl_version_for_vl_convert

    return vl_version_for_vl_convert()


def svg_html(chart: Any) -> str:
    """``chart`` drawn offline by vl-convert: an SVG ``img`` (a PNG for a chart whose SVG
    passes ``SVG_MAX_BYTES``). Charts whose data altair refuses to inline are drawn
    with the row limit lifted. An empty string if vl-convert fails (the live view remains)."""
    import altair as alt
    import vl_convert as vlc

    try:
        with alt.data_transformers.disable_max_rows():
            spec = chart.to_dict()
        svg = vlc.vegalite_to_svg(spec, vl_version=_vl_version())
        if len(svg) <= SVG_MAX_BYTES:
            data = "data:image/svg+xml;base64," + base64.b64encode(svg.encode()).decode()
        else:
            png = vlc.vegalite_to_png(spec, vl_version=_vl_version(), scale=1.0)
            data = "data:image/png;base64," + base64.b64encode(png).decode()
        title = html.escape(str(spec.get("title", "chart")) if isinstance(spec.get("title"), str) else "chart")
        return f'<div class="tp-static-chart"><img alt="{title}" src="{data}"></div>'

    except Exception:  # noqa: BLE001 - a static picture is a fallback, never a failure
        return ""
