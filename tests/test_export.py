"""Exports: the Perfetto trace by its events, PNG by its magic bytes, CSV/Parquet round trips."""

from __future__ import annotations

import json

import altair as alt
import pandas as pd
import pytest

from tpkit.run import TABLES, Run
from tpkit.schema import frame as _frame
from tpkit.views import export


def make_run() -> Run:
    steps = _frame("steps", [
        (-1, True, 0.0, 0.5, 0.5, 8, 0.1, 0.0, 0.2, 0.1, 0.1, 0.0, 0.0, 0.0, 16.0, 2.0),
        (0, False, 0.5, 0.75, 0.25, 8, 0.05, 0.0, 0.1, 0.05, 0.05, 0.0, 0.0, 0.0, 32.0, float("nan")),
    ])
    spans = _frame("spans", [
        (-1, "data_wait", 0.0, 0.1, 0.1, 0, "hook"),
        (-1, "forward", 0.1, 0.3, 0.2, 0, "hook"),
        (-1, "augment", 0.15, 0.2, 0.05, 1, "tp.phase"),
        (0, "data_wait", 0.5, 0.55, 0.05, 0, "hook"),
        (0, "forward", 0.55, 0.650001, 0.100001, 0, "cuda"),
    ])
    clocks = _frame("clocks", [(0.0, "cpu", "cpu_util_pct", 50.0), (0.05, "cpu", "cpu_util_pct", 75.0),
                               (0.05, "cuda:0", "sm_clock_mhz", 1980.0), (0.1, "cpu", "cpu_util_pct", float("nan"))])
    memory = _frame("memory", [(0, "forward", "enter", 0.55, "cpu", "parameters", 1024 * 1024),
                               (0, "forward", "enter", 0.55, "cpu", "activations", 0),
                               (0, "forward", "peak", 0.6, "cpu", "activations", 5 * 1024 * 1024)])
    loader = _frame("loader", [(0, 0, 0.01, 0.002, 0.0, 0.001)])
    return Run(steps, spans, memory, clocks, loader, meta={"name": "ex", "knobs": {"num_workers": 2}})


def test_perfetto_trace_has_one_x_event_per_span_in_microseconds(tmp_path):
    run = make_run()
    path = run.to_perfetto(tmp_path / "trace.json")
    doc = json.loads(path.read_text())  # strict JSON: no NaN
    events = doc["traceEvents"]
    spans = [e for e in events if e["ph"] == "X" and e["cat"] == "span"]
    assert len(spans) == len(run.spans)
    assert [(e["name"], e["ts"], e["dur"], e["tid"]) for e in spans] == [
        ("data_wait", 0.0, 100000.0, 1), ("forward", 100000.0, 200000.0, 1), ("augment", 150000.0, 50000.0, 2),
        ("data_wait", 500000.0, 50000.0, 1), ("forward", 550000.0, 100001.0, 1)]
    steps = [e for e in events if e["ph"] == "X" and e["cat"] == "step"]
    assert [(e["name"], e["ts"], e["dur"], e["tid"]) for e in steps] == [
        ("step -1 (warmup)", 0.0, 500000.0, 0), ("step 0", 500000.0, 250000.0, 0)]
    assert steps[0]["args"]["loss"] == 2.0 and "loss" not in steps[1]["args"]
    names = {(e["tid"], e["args"]["name"]) for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {(0, "steps"), (1, "depth 0"), (2, "depth 1")}
    counters = [e for e in events if e["ph"] == "C" and e["cat"] == "clocks"]
    assert [(e["name"], e["ts"], e["args"]) for e in counters] == [
        ("cpu cpu_util_pct", 0.0, {"cpu_util_pct": 50.0}), ("cpu cpu_util_pct", 50000.0, {"cpu_util_pct": 75.0}),
        ("cuda:0 sm_clock_mhz", 50000.0, {"sm_clock_mhz": 1980.0})]  # the NaN sample is left out
    mem = [e for e in events if e["ph"] == "C" and e["cat"] == "memory"]
    assert [(e["ts"], e["args"]) for e in mem] == [(550000.0, {"parameters": 1.0, "activations": 0.0})]
    assert doc["otherData"]["meta"]["knobs"] == {"num_workers": 2}


def test_empty_run_exports_a_valid_trace(tmp_path):
    doc = json.loads(Run(meta={"name": "e"}).to_perfetto(tmp_path / "t.json").read_text())
    assert [e for e in doc["traceEvents"] if e["ph"] != "M"] == []


def test_png_has_the_png_magic_bytes(tmp_path):
    chart = alt.Chart(pd.DataFrame({"x": [1, 2], "y": [3, 4]})).mark_line().encode(x="x:Q", y="y:Q")
    path = export.to_png(chart, tmp_path / "sub" / "c.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_csv_and_parquet_round_trip_row_counts(tmp_path):
    run = make_run()
    paths = run.to_csv(tmp_path / "csv")
    assert sorted(p.name for p in paths) == sorted([f"{t}.csv" for t in TABLES] + ["meta.json"])
    for t in TABLES:
        back = pd.read_csv(tmp_path / "csv" / f"{t}.csv")
        assert len(back) == len(getattr(run, t)) and list(back.columns) == list(getattr(run, t).columns)
    assert json.loads((tmp_path / "csv" / "meta.json").read_text())["name"] == "ex"
    export.to_parquet(run, tmp_path / "pq")
    back = Run.load(tmp_path / "pq")
    for t in TABLES:
        assert len(getattr(back, t)) == len(getattr(run, t))
    pd.testing.assert_frame_equal(back.spans, run.spans)


@pytest.mark.parametrize("bad", [float("inf")])
def test_non_finite_clock_values_never_break_the_json(tmp_path, bad):
    run = make_run()
    run.clocks = _frame("clocks", [(0.0, "cpu", "cpu_util_pct", bad)])
    json.loads(run.to_perfetto(tmp_path / "t.json").read_text())


def test_run_to_html_with_a_comparison(tmp_path):
    other = make_run()
    other.meta["name"] = "other"
    page = make_run().to_html(tmp_path / "r.html", compare_with=[other]).read_text()
    assert "Comparison of 2 runs" in page and "Changes against <b>other</b>" in page
    assert "not enough data" in page  # one measured step each: no verdict on the change


def test_a_run_whose_durations_are_all_nan_still_has_a_report(tmp_path):
    run = make_run()
    run.steps["duration_s"] = float("nan")
    other = make_run()
    other.meta["name"] = "other"
    with pytest.warns(RuntimeWarning, match="NaN duration left out"):
        page = run.to_html(tmp_path / "r.html", compare_with=[other]).read_text()
    assert "unknown (step durations missing)" in page and "nan ms" not in page
    assert "Comparison of 2 runs" in page
