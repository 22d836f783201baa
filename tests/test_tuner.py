"""The tuner without a browser: runs, sweeps, failures shown, recommendations applied."""

from __future__ import annotations

import time

import pytest

import tpkit as tp
from tpkit.analysis import tuning


def train_fn(workers_ms, fail=False):
    """A loop whose data wait is set by a knob: 'more workers' shortens it."""
    if fail:
        raise ValueError("this setting cannot run")

    def batches():
        while True:
            time.sleep(workers_ms / 1000)
            yield [0] * 4

    for _ in tp.watch(batches()):
        time.sleep(0.004)
        tp.step()


def test_run_slice_adds_runs_and_results():
    t = tp.tune(train_fn, knobs={"workers_ms": [8, 1], "fail": False}, steps=3, warmup=1,
                memory=False, clock_hz=0)
    first = t.run_slice()
    second = t.run_slice(workers_ms=1)
    assert [r.name for r in t.runs] == ["tune-1", "tune-2"]
    assert first.meta["knobs"] == {"workers_ms": 8, "fail": False} and second.meta["knobs"]["workers_ms"] == 1
    df = t.results()
    assert list(df["run"]) == ["tune-1", "tune-2"] and list(df["workers_ms"]) == [8, 1]
    assert df["best"].tolist() == [False, True]  # 1 ms of data wait beats 8 ms
    assert df.loc[0, "data_stall_pct"] > 50 > df.loc[1, "data_stall_pct"]
    assert "tune-2" in t.table.value and t.chart.outputs and t.compare.outputs
    assert "Comparison of 2 runs" in t.compare.outputs[0]["data"]["text/html"]


def test_a_failing_setting_is_shown_and_changes_nothing():
    t = tp.tune(train_fn, knobs={"workers_ms": [1], "fail": False}, steps=2, warmup=0, memory=False, clock_hz=0)
    t.run_slice()
    assert t.run_slice(fail=True) is None
    assert "failed: ValueError: this setting cannot run" in t.status.value
    assert len(t.runs) == 1 and not t.run_button.disabled
    assert t.run_slice(fail=False) is not None and len(t.runs) == 2


def test_sweep_runs_the_grid_and_refuses_too_big_grids():
    t = tp.tune(train_fn, knobs={"workers_ms": [2, 1], "fail": [False]}, steps=2, warmup=0,
                memory=False, clock_hz=0, sweep_limit=3)
    done = t.sweep()
    assert [r.meta["knobs"]["workers_ms"] for r in done] == [2, 1]
    assert t.sweep({"workers_ms": [1, 2], "fail": [False, True]}) == []
    assert "4 settings" in t.status.value and "limit of 3" in t.status.value


def test_apply_sets_the_knob_and_reruns():
    t = tp.tune(train_fn, knobs={"workers_ms": [9], "fail": False}, steps=2, warmup=0, memory=False, clock_hz=0)
    run = t.apply({"workers_ms": 1})
    assert run.meta["knobs"]["workers_ms"] == 1 and t.controls["workers_ms"].value == 1
    assert t.apply({"num_workers": 4}) is None and "no knob" in t.status.value


def test_grid_and_bad_knobs():
    assert tuning.grid({"a": [1, 2], "b": [True]}) == [{"a": 1, "b": True}, {"a": 2, "b": True}]
    with pytest.raises(ValueError, match="at least one"):
        tuning.grid({})
    with pytest.raises(TypeError, match="give a list of options"):
        tp.tune(train_fn, knobs={"x": object()})
    with pytest.raises(TypeError, match="train_fn"):
        tp.tune(None, knobs={})
