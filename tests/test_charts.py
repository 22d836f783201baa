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
    strip, body = spec["vconcat"]  # the overview strip (drag to zoom) above the lanes
    lanes = body["vconcat"][0]["layer"][0]
    enc = lanes["encoding"]
    assert lanes["mark"]["type"] == "bar"
    assert (enc["x"]["field"], enc["x2"]["field"], enc["y"]["field"]) == ("start_s", "end_s", "phase")
    scale = enc["color"]["scale"]
    assert scale["domain"] == ["data_wait", "forward", "backward", "augment"]
    assert scale["range"][0] == charts.PHASE_COLORS["data_wait"] == "#d62728"
    assert enc["y"]["sort"] == scale["domain"]
    assert {t["field"] for t in enc["tooltip"]} >= {"step", "phase", "duration_ms", "source"}
    (brush,) = spec["params"]
    assert brush["select"]["encodings"] == ["x"] and brush["views"] == [strip["name"]]
    assert enc["x"]["scale"]["domain"] == {"param": brush["name"], "encoding": "x"}
    values = spec["datasets"][lanes["data"]["name"]]
    assert len(values) == 6 and [v["warmup"] for v in values[:2]] == [True, True]


def test_step_breakdown_spec():
    steps = pd.DataFrame({"step": [-1, 0], "warmup": [True, False], **{c: [0.0, 0.0] for c in analysis.PHASE_COLUMNS}})
    steps["forward_s"] = [0.002, 0.001]
    spec = charts.step_breakdown(analysis.breakdown_long(steps)).to_dict()
    assert spec["encoding"]["y"]["aggregate"] == "sum" and spec["encoding"]["y"]["stack"] == "zero"
    values = next(iter(spec["datasets"].values()))
    fwd = [v for v in values if v["phase"] == "forward"]
    assert [v["ms"] for v in fwd] == [2.0, 1.0]
    assert len(values) == 2  # phases that took no time in any step draw nothing: left out
    steps["data_wait_s"] = [0.0, 0.003]
    values = next(iter(charts.step_breakdown(analysis.breakdown_long(steps)).to_dict()["datasets"].values()))
    assert sorted({v["phase"] for v in values}) == ["data_wait", "forward"] and len(values) == 4


def test_timeline_frame_cuts_long_runs():
    big = pd.concat([spans().assign(step=i, start_s=lambda d, i=i: d.start_s + i, end_s=lambda d, i=i: d.end_s + i)
                     for i in range(2000)], ignore_index=True)
    cut = analysis.timeline_frame(big, max_rows=600)
    # 6 spans a step and, from step 1 on, the 0.1 s no span covers before it ("other")
    assert len(cut) == 594 and cut["step"].max() == 84  # whole steps only
    assert (cut[cut["phase"] == "other"]["duration_s"].round(9) == 0.1).all()


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
    from tpkit.datasets.synthetic_run import synthetic_run
    from tpkit.views import html as report

    run = synthetic_run(steps=6000, clock_rows=40_000, memory_rows=80_000)
    titles = []
    for title, chart in report.section_charts(run):
        spec = chart.to_dict()
        titles.append(title)
        assert all(len(v) <= 5000 for v in spec.get("datasets", {}).values()), title
    assert titles == ["Stall timeline", "Clocks and power", "Memory"]


# -- summary first, one advice, vega once, static views, the report ------------------------

def hand_run(name="hand", data_share=0.3, n=8, loader=None, clocks=None, knobs=None):
    """A run with known shares: each 100 ms step waits ``data_share`` for data, the rest is
    forward 40% / backward 60%; 16 samples per step."""
    import numpy as np

    from tpkit.run import Run
    from tpkit.schema import frame

    d = np.full(n, 0.1)
    start = np.arange(n) * 0.1
    fwd, bwd = (1 - data_share) * 0.4 * d, (1 - data_share) * 0.6 * d
    steps = frame("steps", {"step": np.arange(n) - 1, "warmup": np.arange(n) < 1, "start_s": start,
                            "end_s": start + d, "duration_s": d, "samples": 16, "data_wait_s": d * data_share,
                            "h2d_s": 0.0, "forward_s": fwd, "backward_s": bwd, "optimizer_s": 0.0, "offload_s": 0.0,
                            "tpkit_s": 0.0, "other_s": 0.0, "throughput": 160.0, "loss": 1.0})
    rows = []
    for i in range(n):
        t = start[i]
        for phase, dur in (("data_wait", d[i] * data_share), ("forward", fwd[i]), ("backward", bwd[i])):
            rows.append((i - 1, phase, t, t + dur, dur, 0, "hook"))
            t += dur
    return Run(steps=steps, spans=frame("spans", rows), loader=loader, clocks=clocks,
               meta={"name": name, "knobs": knobs or {"num_workers": 0}, "warmup_steps": 1})


def test_summary_puts_the_answer_first_with_a_chart_and_human_figures():
    from tpkit.views import html as report

    run = hand_run()
    page = report.summary_html(run)
    verdict = page.index("INPUT-BOUND: 30% of step time waits for data")
    top = page.index("Top recommendation: Use 1 loader worker (now 0)")  # 30 ms to make a batch, 70 ms of work
    assert verdict < top < page.index("vegaEmbed(")  # verdict, then advice, then charts
    assert "knob <code>num_workers</code>" in page and "expected: about 1.43x samples/s with 1 worker" in page
    assert '"phase_share_bars"' not in page and "Where a step" in page  # the phase-share chart
    figures = dict(report.key_figures(run))
    assert figures["measured steps"] == "7 (+1 warmup), 112 samples"  # integers, not 7.000000
    assert figures["throughput"] == "160.0 samples/s" and figures["data stall"] == "30.0% of step time"
    assert figures["step time"] == "p50 100.00 ms, p95 100.00 ms"


def test_phase_share_bars_spec():
    from tpkit.charts.summary import phase_share_bars

    spec = phase_share_bars(pd.DataFrame({"phase": ["backward", "data_wait"], "share": [0.7, 0.3],
                                          "ms_per_step": [70.0, 30.0]})).to_dict()
    bars, text = spec["layer"]
    assert bars["encoding"]["y"]["sort"] == ["data_wait", "backward"]  # the order a step runs
    assert bars["encoding"]["color"]["scale"]["range"][0] == charts.PHASE_COLORS["data_wait"]
    assert [v["label"] for v in next(iter(spec["datasets"].values()))] == ["70%", "30%"]


def test_a_run_is_never_called_two_things():
    from tpkit.schema import VERDICTS

    v = analysis.verdict({"data_wait_s": 0.12, "forward_s": 0.4, "backward_s": 0.48})
    assert v.kind == "input-limited" and v.text.startswith("INPUT-LIMITED: data wait is 12%")
    assert "COMPUTE-BOUND" not in v.text
    for shares in ({"data_wait_s": 0.5, "forward_s": 0.5}, {"forward_s": 1.0}, {"other_s": 0.4, "forward_s": 0.6}):
        v = analysis.verdict(shares)
        assert v.headline == VERDICTS[v.kind] and v.text.startswith(v.headline + ": ")
        assert sum(h in v.text for h in VERDICTS.values()) == 1


def test_loader_tab_summary_and_recommendation_give_one_worker_count():
    from tpkit.analysis import recommend
    from tpkit.schema import frame
    from tpkit.views import html as report

    # 200 ms to make a batch, 70 ms of loop work a step: ceil(1.2 * 200 / 70) = 4 workers
    loader = frame("loader", [(i, 0, 0.15, 0.05, 0.0, 0.0) for i in range(8)])
    run = hand_run(loader=loader, knobs={"num_workers": 1})
    rec = recommend.recommendations(run)[0]
    assert rec.action == {"num_workers": 4}
    assert "Loader: queue empty; would use 4 workers" in report.loader_html(run)
    assert dict(report.key_figures(run))["tpkit loader"] == "queue empty; would use 4 workers"
    title = dict(report.section_charts(run))["Loader"].to_dict()["title"]["text"]
    assert title == "loader: queue empty; would use 4 workers"


def test_dashboards_share_one_guarded_vega_bundle_and_offer_apply_only_for_known_knobs():
    import tpkit as tp
    from tpkit.views import render

    run = hand_run()
    applied = []
    d1 = tp.dashboard(run, apply=applied.append, knobs=["num_workers"])
    d2 = tp.dashboard(run, apply=applied.append, knobs=["batch_size"])
    d3 = tp.dashboard(run)
    assert d1.children[0] is d2.children[0] is d3.children[0]  # one bundle widget for all
    js = d1.children[0].outputs[0]["data"]["text/html"]
    assert js.startswith('<script type="text/javascript">if(!window.vegaEmbed){')
    assert js == render.bundle_html() and "tpkit-live" in d1._dom_classes
    assert d1.apply_button is not None and d1.apply_button.description == "Apply num_workers=1 and rerun"
    d1.apply_button.click()
    assert applied == [{"num_workers": 1}]
    assert d2.apply_button is None and d3.apply_button is None  # the tuner has no such knob / no tuner


def test_static_view_has_svg_charts_and_no_script():
    from tpkit.views import html as report

    page = report.static_html(hand_run())
    assert page.count('<img alt="') >= 2 and "<script" not in page
    import base64
    import re

    first = re.search(r'src="data:image/svg\+xml;base64,([^"]+)"', page).group(1)
    assert base64.b64decode(first).startswith(b"<svg")  # a real SVG, drawn offline
    assert "INPUT-BOUND" in page and "Top recommendation" in page and ".tpkit-live" in page


def test_report_has_recommendations_loader_comparison_and_each_chart_once(tmp_path):
    import numpy as np

    from tpkit.schema import frame
    from tpkit.views import html as report

    clocks = frame("clocks", [(t, "cpu", "cpu_util_pct", 50.0) for t in np.arange(0, 0.8, 0.05)])
    loader = frame("loader", [(i, 0, 0.15, 0.05, 0.0, 0.0) for i in range(8)])
    run = hand_run("b", clocks=clocks, loader=loader, knobs={"num_workers": 1})
    page = report.write_report(run, tmp_path / "r.html", compare_with=[hand_run("a", data_share=0.1)]).read_text()
    assert page.count('"title":"Stall timeline"') == 1  # drawn once (inside the clocks section)
    assert "Top recommendation: Use 4 loader workers (now 1)" in page
    assert "Loader: queue empty; would use 4 workers" in page
    assert "Comparison of 2 runs" in page and "Changes against <b>a</b>" in page
    assert page.count("if(!window.vegaEmbed)") == 1
