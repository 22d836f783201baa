"""Charts are checked by their Vega-Lite spec, not by pixels."""

from __future__ import annotations

import pandas as pd

from tpkit import charts
from tpkit.analysis import steps as analysis


def spans():
    rows = [(-1, "data_wait", 0.0, 0.1, 0), (-1, "forward", 0.1, 0.3, 0), (0, "data_wait", 0.3, 0.5, 0),
            (0, "forward", 0.5, 0.6, 0), (0, "augment", 0.5, 0.55, 1), (0, "backward", 0.6, 0.9, 0)]
    df = pd.DataFrame(rows, columns=["step", "phase", "start_s", "end_s", "depth"])
    return df.assign(duration_s=df.end_s - df.start_s, source="t")


def test_stall_timeline_spec():
    spec = charts.stall_timeline(analysis.timeline_frame(spans())).to_dict()
    enc = spec["encoding"]
    assert spec["mark"]["type"] == "bar"
    assert (enc["x"]["field"], enc["x2"]["field"], enc["y"]["field"]) == ("start_s", "end_s", "phase")
    scale = enc["color"]["scale"]
    assert scale["domain"] == ["data_wait", "forward", "backward", "augment"]
    assert scale["range"][0] == charts.PHASE_COLORS["data_wait"] == "#d62728"
    assert enc["y"]["sort"] == scale["domain"]
    assert {t["field"] for t in enc["tooltip"]} >= {"step", "phase", "duration_ms", "source"}
    assert spec["params"][0]["bind"] == "scales" and spec["params"][0]["select"]["encodings"] == ["x"]
    values = next(iter(spec["datasets"].values()))
    assert len(values) == 6 and [v["warmup"] for v in values[:2]] == [True, True]


def test_step_breakdown_spec():
    steps = pd.DataFrame({"step": [-1, 0], "warmup": [True, False], **{c: [0.0, 0.0] for c in analysis.PHASE_COLUMNS}})
    steps["forward_s"] = [0.002, 0.001]
    spec = charts.step_breakdown(analysis.breakdown_long(steps)).to_dict()
    assert spec["encoding"]["y"]["aggregate"] == "sum" and spec["encoding"]["y"]["stack"] == "zero"
    values = next(iter(spec["datasets"].values()))
    fwd = [v for v in values if v["phase"] == "forward"]
    assert [v["ms"] for v in fwd] == [2.0, 1.0]
    assert len(values) == 2 * len(analysis.PHASE_COLUMNS)


def test_timeline_frame_cuts_long_runs():
    big = pd.concat([spans().assign(step=i, start_s=lambda d, i=i: d.start_s + i, end_s=lambda d, i=i: d.end_s + i)
                     for i in range(2000)], ignore_index=True)
    cut = analysis.timeline_frame(big, max_rows=600)
    assert len(cut) == 594 and cut["step"].max() == 98  # whole steps only


def test_dashboard_panel_tabs_and_plain_text():
    import time

    import tpkit as tp

    run = tp.profile_fn(lambda: time.sleep(0.002), steps=2, warmup=0, progress=False, memory=False, clock_hz=0)
    other = tp.profile_fn(lambda: time.sleep(0.004), steps=2, warmup=0, progress=False, memory=False, clock_hz=0)
    d = tp.dashboard(other, compare_with=[run])
    titles = [d.tab.get_title(i) for i in range(len(d.tab.children))]
    assert titles == ["Summary", "Stall timeline", "Compare", "Export"]
    html_of = {t: d.tab.children[i].outputs[0]["data"]["text/html"] for i, t in enumerate(titles) if t != "Export"}
    assert "OVERHEAD-BOUND" in html_of["Summary"]
    assert "vegaEmbed(" in html_of["Stall timeline"]
    assert "Comparison of 2 runs" in html_of["Compare"]
    assert "window.vegaEmbed=" in d.children[0].outputs[0]["data"]["text/html"]
    assert d._repr_mimebundle_()["text/plain"] == other.summary().to_text()


def test_load_ext_makes_altair_render_offline(ip):
    import altair as alt

    from tpkit.views.magic import enable_offline_charts

    alt.renderers.enable("default")
    assert enable_offline_charts() == "html"
    html = alt.Chart(pd.DataFrame({"a": [1]})).mark_point().encode(x="a")._repr_mimebundle_()["text/html"]
    assert "window.vegaEmbed=" in html and "cdn.jsdelivr.net/npm/vega@" not in html
    alt.renderers.enable("jupyter")  # a choice of the user's is kept
    assert enable_offline_charts() == "jupyter"
    alt.renderers.enable("html", template="inline")


def test_long_runs_reach_the_browser_thinned():
    """10,000-step runs must not hit altair's 5,000-row limit nor ship every row: each
    section's data is aggregated or thinned in analysis (benchmarks/render.py times it)."""
    from tpkit.views import html as report
    from tpkit.datasets.synthetic_run import synthetic_run

    run = synthetic_run(steps=6000, clock_rows=40_000, memory_rows=80_000)
    titles = []
    for title, chart in report.section_charts(run):
        spec = chart.to_dict()
        titles.append(title)
        assert all(len(v) <= 5000 for v in spec.get("datasets", {}).values()), title
    assert titles == ["Stall timeline", "Clocks and power", "Memory"]
