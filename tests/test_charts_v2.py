"""Dashboard v2 charts (issue 18), checked by their Vega-Lite spec against hand-made frames
whose truth is known: the unattributed lane, numbered step boundaries, one brush zooming every
time view, the waterfall in the order phases ran, folded CPU cores, the host-load note and the
loader's queue wait kept apart from its work."""

from __future__ import annotations

import json
from typing import Any, Iterator

import numpy as np
import pandas as pd
import pytest
from factories import table

from tpkit import charts
from tpkit.analysis import clocks as ca
from tpkit.analysis import memory as ma
from tpkit.analysis import steps as analysis
from tpkit.charts.clocks import clock_traces
from tpkit.charts.loader import loader_batches
from tpkit.charts.memory import STEP_PARAM, memory_over_time
from tpkit.charts.timeline import TIME_BRUSH_NAME


def walk(spec: Any) -> Iterator[dict]:
    """Every dict in a spec, depth first."""
    if isinstance(spec, dict):
        yield spec
        for v in spec.values():
            yield from walk(v)
    elif isinstance(spec, list):
        for v in spec:
            yield from walk(v)


def units(spec: dict) -> list[dict]:
    """The unit specs (those with a mark)."""
    return [d for d in walk(spec) if "mark" in d]


def gap_spans() -> pd.DataFrame:
    """Two steps of 1 s each; nothing is measured in [0, 0.4) (before the first span) nor in
    [1.8, 2.0) (the end of step 1)."""
    rows = [(0, "data_wait", 0.4, 0.5, 0), (0, "forward", 0.5, 0.7, 0), (0, "backward", 0.7, 1.0, 0),
            (1, "data_wait", 1.0, 1.2, 0), (1, "forward", 1.2, 1.5, 0), (1, "backward", 1.5, 1.8, 0)]
    return table("spans", step=[r[0] for r in rows], phase=[r[1] for r in rows], start_s=[r[2] for r in rows],
                 end_s=[r[3] for r in rows], duration_s=[r[3] - r[2] for r in rows], depth=[0] * 6,
                 source=["t"] * 6)


def two_steps() -> pd.DataFrame:
    return table("steps", step=[0, 1], warmup=[False, False], start_s=[0.0, 1.0], end_s=[1.0, 2.0],
                 duration_s=[1.0, 1.0])


# -- timeline --------------------------------------------------------------------------------
def test_unattributed_time_is_a_lane_split_at_step_boundaries():
    f = analysis.timeline_frame(gap_spans(), steps=two_steps())
    other = f[f["phase"] == "other"].sort_values("start_s")
    assert other[["step", "start_s", "end_s"]].round(9).values.tolist() == [[0, 0.0, 0.4], [1, 1.8, 2.0]]
    assert set(other["source"]) == {"unattributed"}
    # every second of [0, 2] is drawn once: the lanes at depth 0 tile the slice
    top = f[f["depth"] == 0]
    assert abs(top["duration_s"].sum() - 2.0) < 1e-9
    # without the steps table the stretch before the first span is still there
    alone = analysis.timeline_frame(gap_spans())
    assert alone[alone["phase"] == "other"][["start_s", "end_s"]].round(9).values.tolist() == [[0.0, 0.4]]


def test_the_stretch_before_the_first_step_is_tpkits_probes_going_in():
    """The first step starts once the probes are in (``probes_install_s``; seconds in a
    process's first slice): before it the timeline draws tpkit's own work, not the loop's other
    (4.3 s of "other" had filled 80% of a timeline whose steps held 1 s)."""
    steps = table("steps", step=[0, 1], warmup=[False, False], start_s=[0.3, 1.0], end_s=[1.0, 2.0],
                  duration_s=[0.7, 1.0])
    f = analysis.timeline_frame(gap_spans(), steps=steps)
    lanes = f[f["phase"].isin(["tpkit", "other"])].sort_values("start_s")
    assert lanes[["step", "phase", "start_s", "end_s"]].round(9).values.tolist() == [
        [0, "tpkit", 0.0, 0.3], [0, "other", 0.3, 0.4], [1, "other", 1.8, 2.0]]

def test_timeline_legend_has_other_and_numbered_step_boundaries():
    spec = charts.stall_timeline(analysis.timeline_frame(gap_spans(), steps=two_steps()), steps=two_steps()).to_dict()
    bars = [u for u in units(spec) if u["mark"]["type"] == "bar" and "y" in u["encoding"]]
    assert len(bars) == 1
    color = bars[0]["encoding"]["color"]
    assert "other" in color["scale"]["domain"] and color["scale"]["range"][color["scale"]["domain"].index("other")] \
        == charts.PHASE_COLORS["other"]
    assert "unattributed" in color["legend"]["labelExpr"]
    rules = [u for u in units(spec) if u["mark"]["type"] == "rule"]
    texts = [u for u in units(spec) if u["mark"]["type"] == "text"]
    assert rules and texts
    data = spec["datasets"][texts[0]["data"]["name"]]
    assert [(d["label"], d["t_s"]) for d in data] == [("0", 0.0), ("1", 1.0), ("end", 2.0)]


def test_brush_zooms_every_time_view_through_one_shared_scale_clamped_at_zero():
    spans = analysis.timeline_frame(gap_spans(), steps=two_steps())
    clocks = table("clocks", t_s=[0.1, 0.6, 1.1, 1.6] * 2, device=["cpu"] * 4 + ["process"] * 4,
                   metric=["cpu_util_pct"] * 8, value=[50.0, 60, 70, 80, 10, 20, 30, 40])
    memory = table("memory", step=[0, 0, 1, 1], phase=["forward"] * 4, event=["enter", "exit"] * 2,
                   t_s=[0.5, 0.7, 1.2, 1.5], device=["cpu"] * 4, category=["activations"] * 4,
                   bytes=[0, 1 << 20, 0, 1 << 20])
    levels = ma.wide(memory, ("enter", "exit", "peak"))
    spec = charts.clocks_with_timeline(spans, ca.trace_frame(clocks), two_steps(), memory=levels).to_dict()
    # one interval selection, on x, cleared by a double-click, defined once
    params = [p for p in walk(spec) if isinstance(p.get("select"), dict)]
    assert len(params) == 1 and params[0]["name"] == TIME_BRUSH_NAME
    assert params[0]["select"]["type"] == "interval" and params[0]["select"]["encodings"] == ["x"]
    assert "bind" not in params[0]  # a brush that zooms, not a pan bound to the scales
    xs = [u["encoding"]["x"] for u in units(spec) if "x" in u.get("encoding", {})]
    zoomed = [x for x in xs if x.get("scale", {}).get("domain") == {"param": TIME_BRUSH_NAME, "encoding": "x"}]
    fields = {x["field"] for x in zoomed}
    assert {"start_s", "t_s", "end_s"} <= fields  # timeline lanes, clock lines, memory over time, rules
    assert all(x["scale"]["domainMin"] == 0 and x["scale"]["nice"] is False for x in zoomed)
    # the overview strip (the only unzoomed x) starts at 0 and ends at the data
    strip = [x for x in xs if x not in zoomed]
    assert len(strip) == 1 and strip[0]["scale"] == {"domainMin": 0, "nice": False, "zero": False}
    # the zoomed views share one x scale; the strip keeps its own
    assert spec["resolve"]["scale"]["x"] == "independent"
    assert spec["vconcat"][1]["resolve"]["scale"]["x"] == "shared"
    assert any(u["mark"]["type"] == "area" for u in units(spec))  # memory over time is in the same view


def test_memory_over_time_stacks_categories_in_mib():
    memory = table("memory", step=[0, 0], phase=["forward"] * 2, event=["enter", "exit"], t_s=[0.5, 0.7],
                   device=["cpu"] * 2, category=["activations"] * 2, bytes=[0, 3 << 20])
    spec = memory_over_time(ma.wide(memory, ("enter", "exit", "peak"))).to_dict()
    values = next(iter(spec["datasets"].values()))
    act = [v["mib"] for v in values if v["category"] == "activations"]
    assert act == [0.0, 3.0] and spec["encoding"]["y"]["stack"] == "zero"


# -- waterfall -------------------------------------------------------------------------------
def step_memory(step: int, act_bytes: int, peak_bytes: int, t0: float) -> list[tuple]:
    """One step: zero_grad frees 1 MiB of gradients; data arrives (64 KiB); forward keeps
    ``act_bytes``; backward makes 1 MiB of gradients, frees the activations, and peaks at
    ``peak_bytes`` of temporaries inside; the optimizer changes nothing."""
    mib = 1 << 20
    base = {"parameters": 4 * mib, "gradients": mib, "activations": 0, "temporaries": 0, "data": 0}
    out = []

    def at(t: float, phase: str, event: str, **over: int) -> None:
        for c, v in {**base, **over}.items():
            out.append((step, phase, event, t0 + t, "cpu", c, v))

    at(0.00, "optimizer", "enter")
    at(0.01, "optimizer", "exit", gradients=0)
    at(0.02, "data_wait", "enter", gradients=0)
    at(0.03, "data_wait", "exit", gradients=0, data=65536)
    at(0.04, "forward", "enter", gradients=0, data=65536)
    at(0.05, "forward", "exit", gradients=0, data=65536, activations=act_bytes)
    at(0.06, "backward", "enter", gradients=0, data=65536, activations=act_bytes)
    at(0.09, "backward", "peak", gradients=mib, data=65536, activations=act_bytes, temporaries=peak_bytes)
    at(0.09, "backward", "exit", gradients=mib, data=65536)
    at(0.10, "optimizer", "enter", data=65536)
    at(0.11, "optimizer", "exit", data=65536)
    return out


def memory_frame() -> pd.DataFrame:
    rows = step_memory(0, 2 << 20, 1 << 20, 0.0) + step_memory(1, 2 << 20, 5 << 20, 1.0) \
        + step_memory(2, 2 << 20, 2 << 20, 2.0)
    cols = ["step", "phase", "event", "t_s", "device", "category", "bytes"]
    return table("memory", **{c: [r[i] for r in rows] for i, c in enumerate(cols)})


def test_waterfall_names_stretches_in_the_order_they_ran_and_puts_the_peak_in_its_bar():
    wf = ma.waterfall(memory_frame(), 1, "cpu")
    labels = list(dict.fromkeys(wf.sort_values("order", kind="stable")["label"]))
    # stretches where nothing changed (between two phases here) are left out
    assert labels == ["start of step", "zero_grad", "waiting for data", "forward", "backward"]
    assert not any("between" in lab or lab[:2].isdigit() for lab in labels)
    bwd = wf[wf["label"] == "backward"]
    mib = 1 << 20
    # backward: 1 MiB of gradients allocated, 2 MiB of activations freed; the peak inside it
    assert sorted(zip(bwd["kind"], bwd["category"], bwd["delta_bytes"])) == [
        ("allocated", "gradients", mib), ("freed", "activations", -2 * mib)]
    level_before = 4 * mib + 65536 + 2 * mib
    assert bwd["peak_bytes"].iloc[0] == level_before + mib + 5 * mib  # params+data+acts + grads + temporaries
    assert wf["peak_bytes"].max() == bwd["peak_bytes"].iloc[0]
    assert (wf[wf["label"] != "backward"]["peak_bytes"] < bwd["peak_bytes"].iloc[0]).all()


def test_waterfall_chart_shows_the_peak_step_first_with_a_selector_and_its_own_legends():
    mem = memory_frame()
    assert ma.peak_step(mem, "cpu") == 1
    wf = ma.waterfalls(mem, device="cpu")
    assert sorted(wf["step"].unique()) == [0, 1, 2]
    spec = charts.memory_waterfall(wf, ma.step_peak(mem, 1, "cpu")).to_dict()
    param = next(p for p in spec["params"] if p["name"] == STEP_PARAM)
    assert param["value"] == 1 and param["bind"]["input"] == "select" and param["bind"]["options"] == [0, 1, 2]
    assert {"filter": f"datum.step == {STEP_PARAM}"} in spec["transform"]
    bars = next(u for u in units(spec) if u["mark"]["type"] == "bar")
    enc = bars["encoding"]
    assert enc["color"]["legend"]["title"] == "memory category"
    assert enc["fillOpacity"]["scale"] == {"type": "ordinal", "domain": ["start", "allocated", "freed"],
                                          "range": [1.0, 1.0, 0.3]}  # frees drawn light
    assert enc["strokeDash"]["field"] == "kind"
    assert enc["x"]["sort"] == {"field": "order", "op": "min"}
    # the peak: a tick in the bar where it happened, at its height
    tick = next(u for u in units(spec) if u["mark"]["type"] == "tick")
    top = spec["datasets"][tick["data"]["name"]]
    step1 = next(t for t in top if t["step"] == 1)
    assert step1["label"] == "backward" and step1["peak_mib"] == (4 * 2**20 + 65536 + 2 * 2**20 + 6 * 2**20) / 2**20
    assert not any(u["mark"]["type"] == "rule" for u in units(spec))  # no line floating over every bar
    # a stretch that rose above both its ends but is not its step's peak: a light tick there
    mib = 1 << 20
    fwd_peak = [(0, "forward", "peak", 0.05, "cpu", c, v) for c, v in
                {"parameters": 4 * mib, "gradients": 0, "activations": 3 * mib, "temporaries": 0,
                 "data": 65536}.items()]
    cols = ["step", "phase", "event", "t_s", "device", "category", "bytes"]
    mem0 = pd.concat([mem[mem["step"] == 0], table("memory", **{c: [r[i] for r in fwd_peak]
                                                               for i, c in enumerate(cols)})], ignore_index=True)
    spec0 = charts.memory_waterfall(ma.waterfall(mem0, 0, "cpu"), step=0).to_dict()
    light = [u for u in units(spec0) if u["mark"]["type"] == "tick" and u["mark"].get("opacity")]
    (row,) = spec0["datasets"][light[0]["data"]["name"]]
    assert row["label"] == "forward" and row["peak_mib"] == (7 * mib + 65536) / mib


# -- clocks ----------------------------------------------------------------------------------
def core_trace(spread: float) -> pd.DataFrame:
    t = np.arange(6) * 0.1
    rows = []
    for dev, off in (("cpu0", -spread), ("cpu1", spread), ("cpu", 0.0)):
        rows += [(x, dev, "cpu_freq_mhz", 2596.0 + off) for x in t]
    return pd.DataFrame(rows, columns=["t_s", "device", "metric", "value"])


def test_flat_cores_fold_into_their_mean_and_cores_that_differ_stay():
    assert set(ca.fold_cores(core_trace(0.0))["device"]) == {"cpu"}
    assert set(ca.fold_cores(core_trace(400.0))["device"]) == {"cpu", "cpu0", "cpu1"}
    spec = clock_traces(ca.fold_cores(core_trace(0.0)), two_steps()).to_dict()
    line = next(u for u in units(spec) if u["mark"]["type"] == "line")
    assert {v["device"] for v in spec["datasets"][line["data"]["name"]]} == {"cpu"}
    assert line["encoding"]["x"]["scale"]["nice"] is False  # the axis ends at the data


def test_host_loaded_by_others_is_said_and_shown():
    t = np.arange(10) * 0.1
    clocks = table("clocks", t_s=np.concatenate([t, t]), device=["cpu"] * 10 + ["process"] * 10,
                   metric=["cpu_util_pct"] * 20, value=[100.0] * 10 + [30.0] * 10)
    load = ca.host_load(clocks)
    assert load["loaded"] and load["host_pct"] == 100.0 and load["process_pct"] == 30.0 and load["others_pct"] == 70.0
    quiet = clocks.assign(value=[40.0] * 10 + [35.0] * 10)
    assert ca.host_load(quiet)["loaded"] is False
    assert ca.host_load(clocks[clocks["device"] == "cpu"]) is None
    spec = clock_traces(ca.trace_frame(clocks), two_steps(), note=load["text"]).to_dict()
    assert "other processes used ~70%" in json.dumps(spec)


# -- loader ----------------------------------------------------------------------------------
def test_queue_wait_is_drawn_apart_from_the_work():
    loader = table("loader", batch=[0, 1, 2], worker=[0, 1, 0], fetch_s=[0.002] * 3, collate_s=[0.001] * 3,
                   queue_wait_s=[0.050] * 3, transfer_s=[0.0005] * 3)
    spec = loader_batches(loader).to_dict()
    stacked = next(u for u in units(spec) if u["encoding"].get("y", {}).get("aggregate") == "sum")
    work = spec["datasets"][stacked["data"]["name"]]
    assert {w["stage"] for w in work} == {"read + transform", "collate", "transfer"}
    assert abs(sum(w["ms"] for w in work if w["batch"] == 0) - 3.5) < 1e-9  # the work only, not the 50 ms wait
    queue = next(u for u in units(spec) if u["encoding"].get("y", {}).get("field") == "queue_ms")
    assert [round(v["queue_ms"], 9) for v in spec["datasets"][queue["data"]["name"]]] == [50.0] * 3
    assert "not a stall" in json.dumps(queue["title"])


# -- the brush in a real browser ---------------------------------------------------------------
@pytest.mark.slow
def test_dragging_the_strip_zooms_every_view_and_never_below_zero(tmp_path):
    """Chromium draws the composed chart (vega inlined, no network); a drag on the overview strip
    sets the one shared x scale of the timeline, clocks and memory panels to the dragged
    interval, a drag past the left edge stops at 0, and a double-click shows the whole slice."""
    import time

    import browser

    if browser.missing():
        pytest.skip(browser.missing())
    from playwright.sync_api import sync_playwright

    from tpkit.views import render

    spans = analysis.timeline_frame(gap_spans(), steps=two_steps())
    clocks = table("clocks", t_s=[0.1, 0.6, 1.1, 1.6, 2.0], device=["cpu"] * 5, metric=["cpu_util_pct"] * 5,
                   value=[50.0, 60, 70, 80, 90])
    spec = json.dumps(charts.clocks_with_timeline(spans, ca.trace_frame(clocks), two_steps(), width=600).to_dict())
    page = tmp_path / "brush.html"
    page.write_text("<html><body>" + render.bundle_html() + '<div id="c"></div><script>'
                    f'vegaEmbed("#c", {spec}, {{renderer: "svg", actions: false}}).then(r => {{ window.V = r.view; }});'
                    "</script></body></html>")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=browser.CHROMIUM, args=browser.CHROME_ARGS)
        try:
            pg = b.new_page(viewport={"width": 1000, "height": 1200})
            pg.goto(page.as_uri())
            pg.wait_for_function("window.V !== undefined", timeout=30000)

            def domain() -> list[float]:
                return pg.evaluate("window.V.scale('concat_1_x').domain()")

            assert domain() == [0, 2.0]  # the whole slice, from 0 to the end of the data
            x0, y0, w, _ = pg.evaluate("""() => { const r = document.querySelector('#c svg g.mark-group.role-scope')
                .getBoundingClientRect(); return [r.x, r.y, r.width, r.height]; }""")
            y = y0 + 30  # inside the strip, under its title

            def drag(a: float, b: float) -> None:
                pg.mouse.move(a, y)
                pg.mouse.down()
                pg.mouse.move(b, y, steps=5)
                pg.mouse.up()
                time.sleep(0.3)

            drag(x0 + 0.5 * w, x0 + 0.75 * w)
            lo, hi = domain()
            assert lo == pytest.approx(1.0, abs=0.05) and hi == pytest.approx(1.5, abs=0.05)
            pg.mouse.dblclick(x0 + 0.3 * w, y)
            time.sleep(0.3)
            assert domain() == [0, 2.0]
            drag(x0 + 0.1 * w, x0 - 150)  # past the left edge
            lo, hi = domain()
            assert lo == 0 and hi == pytest.approx(0.2, abs=0.05)
        finally:
            b.close()


def test_a_gap_across_steps_is_cut_at_each_boundary():
    """Nothing measured from 0.9 s to 2.1 s: the stretch is split into the end of step 0, all of
    step 1 and the start of step 2, each numbered by its step."""
    spans = table("spans", step=[0, 2], phase=["forward", "forward"], start_s=[0.0, 2.1], end_s=[0.9, 3.0],
                  duration_s=[0.9, 0.9], depth=[0, 0], source=["t", "t"])
    steps = table("steps", step=[0, 1, 2], start_s=[0.0, 1.0, 2.0], end_s=[1.0, 2.0, 3.0], duration_s=[1.0] * 3)
    f = analysis.timeline_frame(spans, steps=steps)
    other = f[f["phase"] == "other"]
    assert other[["step", "start_s", "end_s"]].round(9).values.tolist() == [[0, 0.9, 1.0], [1, 1.0, 2.0],
                                                                             [2, 2.0, 2.1]]
