"""Comparison statistics on hand-made Runs with exact numbers."""

from __future__ import annotations

import importlib

import numpy as np
import pandas as pd
import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as hs

from tpkit.run import Run
from tpkit.schema import frame as _frame

# ``tpkit.compare`` is also the name of the function tpkit exports: take the module itself
cmp = importlib.import_module("tpkit.analysis.compare")
st = importlib.import_module("tpkit.analysis.stats")
analysis_steps = importlib.import_module("tpkit.analysis.steps")
MIB = 1024 * 1024


def make_run(name: str, durations, samples: int = 10, warmup: int = 0, data_share: float = 0.25, loss=None,
             memory=None, clocks=None, **meta) -> Run:
    d = np.asarray(durations, dtype="float64")
    n = len(d)
    steps = _frame("steps", {
        "step": np.arange(n) - warmup, "warmup": np.arange(n) < warmup, "start_s": np.cumsum(d) - d,
        "end_s": np.cumsum(d), "duration_s": d, "samples": [samples] * n, "data_wait_s": d * data_share,
        "h2d_s": 0.0, "forward_s": d * (1 - data_share) / 2, "backward_s": d * (1 - data_share) / 2,
        "optimizer_s": 0.0, "offload_s": 0.0, "other_s": 0.0, "throughput": samples / d,
        "loss": loss if loss is not None else np.linspace(2.0, 1.0, n),
    })
    return Run(steps=steps, memory=memory, clocks=clocks, meta={"name": name, **meta})


def row(c, metric, run):
    t = c.table
    return t[(t["metric"] == metric) & (t["run"] == run)].iloc[0]


def test_bootstrap_ci_matches_the_documented_procedure():
    x = np.array([3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0])
    rng = np.random.default_rng(7)
    idx = rng.integers(0, len(x), size=(500, len(x)))
    want = np.percentile(np.median(x[idx], axis=1), [2.5, 97.5])
    assert st.bootstrap_ci(x, "median", n=500, seed=7) == (want[0], want[1])
    assert st.bootstrap_ci(x, lambda a: np.median(a, axis=1), 500, 7) == (want[0], want[1])
    assert st.bootstrap_ci(x, "median", n=500, seed=8) != (want[0], want[1])  # the seed matters


def test_bootstrap_ci_chunking_does_not_change_the_answer(monkeypatch):
    x = np.arange(50, dtype="float64") ** 1.5
    whole = st.bootstrap_ci(x, "mean", n=300, seed=1)
    monkeypatch.setattr(st, "CHUNK_ELEMENTS", 120)  # 2 resamples per chunk
    assert st.bootstrap_ci(x, "mean", n=300, seed=1) == pytest.approx(whole, rel=1e-12)


def test_bootstrap_ci_of_the_mean_has_the_normal_width():
    x = np.random.default_rng(0).normal(10.0, 2.0, size=400)
    lo, hi = st.bootstrap_ci(x, "mean", n=4000, seed=0)
    half = 1.96 * x.std(ddof=1) / np.sqrt(len(x))  # 0.196 for sd 2
    assert lo < x.mean() < hi
    assert (hi - lo) / 2 == pytest.approx(half, rel=0.1)


def test_bootstrap_ci_edge_cases():
    assert all(np.isnan(st.bootstrap_ci([], "median")))
    assert st.bootstrap_ci([4.0], "median") == (4.0, 4.0)
    assert st.bootstrap_ci([2.0] * 10, "median") == (2.0, 2.0)
    with pytest.raises(ValueError):
        st.bootstrap_ci([1.0, 2.0], "mode")


def test_ratio_bootstrap_keeps_steps_together():
    # every step has samples / duration == 100: every resample gives exactly 100
    pairs = np.array([[10, 0.1], [20, 0.2], [5, 0.05]])
    assert st.bootstrap_ci(pairs, st.ratio_of_sums, n=200, seed=0) == pytest.approx((100.0, 100.0))


def test_overlapping_runs_are_no_significant_difference():
    noise = [0.100, 0.104, 0.096, 0.102, 0.098, 0.101, 0.099, 0.103, 0.097, 0.100]
    a = make_run("a", noise)
    b = make_run("b", [x + 0.001 for x in noise])
    c = cmp.compare(a, b)
    r = row(c, "step_time_p50", "b")
    assert r["value"] == pytest.approx(101.0) and r["delta"] == pytest.approx(1.0)
    assert r["delta_pct"] == pytest.approx(1.0 / 100.0 * 100)
    assert r["ci_low"] <= row(c, "step_time_p50", "a")["ci_high"]
    assert r["significant"] == cmp.NO_DIFFERENCE
    assert row(c, "step_time_p50", "a")["significant"] == cmp.BASELINE
    assert row(c, "throughput", "b")["significant"] == cmp.NO_DIFFERENCE


def test_separated_runs_are_significant_with_direction():
    noise = np.array([0.100, 0.104, 0.096, 0.102, 0.098, 0.101, 0.099, 0.103, 0.097, 0.100])
    c = cmp.compare(make_run("slow", noise), make_run("fast", noise / 2))
    st = row(c, "step_time_p50", "fast")
    assert st["value"] == pytest.approx(50.0) and st["delta_pct"] == pytest.approx(-50.0)
    assert st["significant"] == cmp.SIGNIFICANT and st["direction"] == "better"
    assert st["ci_high"] < row(c, "step_time_p50", "slow")["ci_low"]
    thr = row(c, "throughput", "fast")
    assert thr["value"] == pytest.approx(10 * 10 / noise.sum() * 2)
    assert thr["delta_pct"] == pytest.approx(100.0)
    assert thr["significant"] == cmp.SIGNIFICANT and thr["direction"] == "better"
    # the same share of data wait in both: shown, not judged; the wait itself halved
    assert row(c, "data_stall_share", "fast")["value"] == pytest.approx(25.0)
    assert row(c, "data_stall_share", "fast")["significant"] == cmp.NOT_TESTED
    wait = row(c, "data_wait_time", "fast")
    assert wait["value"] == pytest.approx(0.25 * noise.mean() / 2 * 1e3) and wait["unit"] == "ms/step"
    assert wait["significant"] == cmp.SIGNIFICANT and wait["direction"] == "better"


def test_values_exclude_warmup_and_cover_loss_memory_energy():
    mem = _frame("memory", [
        (0, "forward", "enter", 0.1, "cpu", "parameters", 1000),
        (0, "forward", "enter", 0.1, "cpu", "activations", 0),
        (0, "forward", "peak", 0.2, "cpu", "parameters", 1000),
        (0, "forward", "peak", 0.2, "cpu", "activations", 3 * MIB),
        (0, "backward", "exit", 0.3, "cpu", "activations", 9 * MIB),  # not a peak row: ignored
        (0, "backward", "exit", 0.3, "cpu", "gradients", 2 * MIB),      # no peak rows: max of all
        (0, "backward", "exit", 0.3, "cpu", "data", 0),                     # zero everywhere: left out
    ])
    clocks = _frame("clocks", [(t, "cuda:0", "energy_j", 100.0 + 50.0 * t) for t in np.arange(0.0, 5.01, 0.05)])
    run = make_run("a", [5.0, 1.0, 1.0, 2.0], warmup=1, loss=[9.0, 3.0, 2.0, 1.5], memory=mem, clocks=clocks)
    c = cmp.compare(run)
    assert row(c, "step_time_p50", "a")["value"] == pytest.approx(1000.0)   # warmup 5 s left out
    assert row(c, "throughput", "a")["value"] == pytest.approx(30 / 4.0)
    assert row(c, "loss_final", "a")["value"] == 1.5
    assert row(c, "peak_memory_activations", "a")["value"] == pytest.approx(3.0)
    assert row(c, "peak_memory_gradients", "a")["value"] == pytest.approx(2.0)
    assert row(c, "peak_memory_parameters", "a")["value"] == pytest.approx(1000 / MIB)
    assert row(c, "peak_memory_total", "a")["value"] == pytest.approx(9.0 + 2.0)  # the exit boundary
    assert "peak_memory_data" not in set(c.table["metric"])
    # the energy counter climbs 50 J/s; measured steps last 4 s (5.0 .. 9.0) but the counter
    # stops at 5.0 s, so only the first measured step is covered... use a counter over all:
    clocks = _frame("clocks", [(t, "cuda:0", "energy_j", 100.0 + 50.0 * t) for t in np.arange(0.0, 9.01, 0.05)])
    run = make_run("b", [5.0, 1.0, 1.0, 2.0], warmup=1, clocks=clocks)
    assert row(cmp.compare(run), "energy_per_sample[cuda:0]", "b")["value"] == pytest.approx(50.0 * 4 / 30)


def test_warnings_for_models_steps_incomplete_and_devices():
    a = make_run("a", [0.1] * 5, model={"class": "Net", "parameters": 1000}, devices=["cpu: x"])
    b = make_run("a", [0.1] * 3, model={"class": "Net", "parameters": 2000}, devices=["cuda:0: y"],
                 complete=False, error="RuntimeError: boom")
    c = cmp.compare(a, b)
    assert c.labels == ["a", "a#2"]
    text = "\n".join(c.warnings)
    assert "different models" in text and "2,000 parameters" in text
    assert "different numbers of measured steps (a: 5, a#2: 3)" in text
    assert "'a#2' is incomplete (RuntimeError: boom)" in text
    assert "different devices" in text
    out = c.to_text()
    assert "WARNING: different models" in out
    bundle = c._repr_mimebundle_()
    assert "&#9888;" in bundle["text/html"] and "different models" in bundle["text/html"]


def test_like_for_like_runs_have_no_warnings():
    a = make_run("a", [0.1] * 5, model={"class": "Net", "parameters": 1000})
    b = make_run("b", [0.2] * 5, model={"class": "Net", "parameters": 1000})
    assert cmp.compare(a, b).warnings == []


def test_single_step_run_warns_and_is_not_tested():
    c = cmp.compare(make_run("a", [0.1, 0.1, 0.1]), make_run("b", [0.2]))
    assert any("'b' has 1 measured step" in w for w in c.warnings)
    r = row(c, "step_time_p50", "b")
    assert r["ci_low"] == r["ci_high"] == pytest.approx(200.0)


def test_chart_frames_and_text():
    a = make_run("a", [0.1, 0.2], data_share=0.5)
    b = make_run("b", [0.1, 0.1], data_share=0.0)
    c = cmp.compare(a, b)
    assert list(c.steps.columns) == ["run", "step", "warmup", "duration_ms"]
    assert c.steps["duration_ms"].tolist() == pytest.approx([100.0, 200.0, 100.0, 100.0])
    ph = c.phases.set_index(["run", "phase"])
    assert set(c.phases["phase"]) == {"data_wait", "forward", "backward"}  # unused phases left out
    assert ph.loc[("a", "data_wait"), "median_ms"] == pytest.approx(75.0)
    assert ph.loc[("b", "forward"), "share"] == pytest.approx(0.5)
    wide = c.wide()
    assert list(wide.index) == ["a", "b"]  # one row per run, metrics as columns
    assert wide.loc["b", "step time p50 (ms)"] == pytest.approx(100.0)
    assert wide.loc["a", "data stall (%)"] == pytest.approx(50.0)
    assert "step time p50 (ms)" in c.to_text()
    assert isinstance(c.table, pd.DataFrame) and list(c.table.columns) == list(cmp.TABLE_COLUMNS)


def test_compare_loads_store_names(tmp_path, monkeypatch):
    from tpkit import store

    monkeypatch.setenv("TPKIT_RUNS", str(tmp_path))
    monkeypatch.setattr(store, "_configured", [store._UNSET])
    store.save(make_run("base", [0.1, 0.1]))
    store.save(make_run("base", [0.2, 0.2]))
    import tpkit as tp

    c = tp.compare(str(tmp_path / "base"), "base-2", baseline="base-2")
    assert c.labels == ["base", "base-2"] and c.baseline == "base-2"
    with pytest.raises(TypeError, match="tp.compare loads names"):
        cmp.compare("base", "base-2")  # the analysis function takes Runs only
    assert row(c, "step_time_p50", "base")["delta"] == pytest.approx(-100.0)


def test_a_rerun_name_compares_the_run_just_measured_and_says_so(tmp_path, monkeypatch):
    """Session 1 stored baseline (100 ms) and fast; session 2 reran both under the same names,
    its baseline 300 ms and cut short: "baseline" is session 2's, the comparison says which
    stored runs the names meant and that the baseline is incomplete."""
    from tpkit import store

    monkeypatch.setenv("TPKIT_RUNS", str(tmp_path))
    monkeypatch.setattr(store, "_configured", [store._UNSET])
    store.save(make_run("baseline", [0.1] * 6, start_unix_ns=1))
    store.save(make_run("fast", [0.05] * 6, start_unix_ns=2))
    store.save(make_run("baseline", [0.3] * 6, start_unix_ns=3, complete=False, stopped_by="error"))
    store.save(make_run("fast", [0.05] * 6, start_unix_ns=4))
    import tpkit as tp

    c = tp.compare("baseline", "fast")
    assert c.labels == ["baseline-2", "fast-2"] and c.baseline == "baseline-2"
    assert row(c, "step_time_p50", "baseline-2")["value"] == pytest.approx(300.0)
    assert c.warnings[0].startswith("'baseline' is the run stored as 'baseline-2', the newest of the 2 runs given that name "
                                    f"(the others: 'baseline~1' (stored as 'baseline' in {tmp_path / 'baseline'}))")
    assert c.warnings[1].startswith("'fast' is the run stored as 'fast-2'")
    assert "'baseline-2' is incomplete (error)" in c.to_text()
    assert not any("stored as" in w for w in tp.compare("baseline-2", "fast-2").warnings)  # exact names: one run each


def test_idle_phase_shares_are_left_out_but_data_stall_stays():
    c = cmp.compare(make_run("a", [0.1, 0.1], data_share=0.0), make_run("b", [0.1, 0.1], data_share=0.0))
    metrics = set(c.table["metric"])
    assert {"data_stall_share", "forward_share", "backward_share"} <= metrics
    assert {"data_wait_time", "forward_time", "backward_time"} <= metrics
    assert not metrics & {"h2d_share", "optimizer_share", "offload_share", "other_share"}
    assert not metrics & {"h2d_time", "optimizer_time", "offload_time", "other_time"}
    assert "significant (better)" in cmp.compare(make_run("a", [0.2, 0.21, 0.19, 0.2, 0.2]),
                                                 make_run("b", [0.1, 0.11, 0.09, 0.1, 0.1])).to_text()


def test_comparison_charts_by_spec():
    from tpkit.charts import compare as charts

    c = cmp.compare(make_run("a", [0.1, 0.2], data_share=0.5), make_run("b", [0.1, 0.1]))
    spec = charts.step_time_overlay(c.steps, c.labels).to_dict()
    enc = spec["encoding"]
    assert (enc["x"]["field"], enc["y"]["field"], enc["color"]["field"]) == ("step", "duration_ms", "run")
    assert enc["color"]["scale"]["domain"] == ["a", "b"]
    assert [v["duration_ms"] for v in next(iter(spec["datasets"].values()))] == pytest.approx([100, 200, 100, 100])
    spec = charts.phase_bars(c.phases, c.labels).to_dict()
    assert spec["mark"]["type"] == "bar" and spec["encoding"]["xOffset"]["field"] == "run"
    assert spec["encoding"]["x"]["sort"] == ["data_wait", "forward", "backward"]
    spec = charts.metric_intervals(c.table, "step_time_p50", c.labels).to_dict()
    rule, point = spec["layer"]
    assert rule["encoding"]["x"]["field"] == "ci_low" and rule["encoding"]["x2"]["field"] == "ci_high"
    assert point["encoding"]["x"]["field"] == "value"
    assert {v["metric"] for v in next(iter(spec["datasets"].values()))} == {"step_time_p50"}


def test_tp_compare_magic_displays_table_and_warnings(ip, tmp_path, monkeypatch):
    from IPython.core.error import UsageError
    from IPython.utils.capture import capture_output

    from tpkit import store

    monkeypatch.setenv("TPKIT_RUNS", str(tmp_path))
    monkeypatch.setattr(store, "_configured", [store._UNSET])
    store.save(make_run("base", [0.1, 0.1, 0.1], model={"class": "A", "parameters": 1}))
    store.save(make_run("next", [0.05, 0.05], model={"class": "B", "parameters": 1}))
    ip.user_ns["mine"] = make_run("mine", [0.2, 0.2])
    with capture_output() as cap:
        ip.run_line_magic("tp_compare", "base next mine")
    data = cap.outputs[-1].data
    assert "WARNING: different models" in data["text/plain"] and "step time p50 (ms)" in data["text/plain"]
    assert '<table class="tp-grid">' in data["text/html"] and "different models" in data["text/html"]
    assert ip.user_ns["_tp_compare"].labels == ["base", "next", "mine"]
    with pytest.raises(UsageError, match=r"'nope'[\s\S]*known runs: base, next"):
        ip.run_line_magic("tp_compare", "base nope")
    store.save(make_run("base", [0.3, 0.3, 0.3], model={"class": "A", "parameters": 1}))  # a rerun: base-2
    with capture_output():
        ip.run_line_magic("tp_compare", "base next")
    c = ip.user_ns["_tp_compare"]
    assert c.labels == ["base-2", "next"] and row(c, "step_time_p50", "base-2")["value"] == pytest.approx(300.0)
    assert c.warnings[0].startswith("'base' is the run stored as 'base-2', the newest of the 2 runs")
    # the names tp.runs() had listed: both the newest run (it had compared base-2 with itself)
    with pytest.raises(UsageError, match=r"%tp_compare: 'base' and 'base-2' are the same run, stored as 'base-2'.*"
                                         r"The other runs given 'base': 'base~1' \(stored as 'base'"):
        ip.run_line_magic("tp_compare", "base base-2")
    with capture_output():
        ip.run_line_magic("tp_compare", "base~1 base")
    c = ip.user_ns["_tp_compare"]
    assert [row(c, "step_time_p50", label)["value"] for label in c.labels] == pytest.approx([100.0, 300.0])
    with pytest.raises(UsageError, match="%tp_compare"):
        ip.run_line_magic("tp_compare", "")


def test_shared_resamples_give_the_same_intervals_as_bootstrap_ci():
    rng = np.random.default_rng(3)
    d = rng.normal(0.1, 0.01, 40)
    run = make_run("a", d, data_share=0.3)
    run.steps["data_wait_s"] = d * rng.uniform(0.1, 0.5, 40)  # shares that vary by step
    metrics = {m.metric: m for m in cmp.run_metrics(run, n=400, seed=5)}
    m = analysis_steps.measured(run.steps)
    dur = m["duration_s"].to_numpy()
    want = st.bootstrap_ci(dur, "median", 400, 5)
    assert metrics["step_time_p50"].ci == pytest.approx((want[0] * 1e3, want[1] * 1e3), rel=1e-12)
    pairs = np.stack([m["samples"].to_numpy(dtype=float), dur], axis=1)
    assert metrics["throughput"].ci == pytest.approx(st.bootstrap_ci(pairs, st.ratio_of_sums, 400, 5), rel=1e-12)
    pairs = np.stack([m["data_wait_s"].to_numpy(), dur], axis=1)
    lo, hi = st.bootstrap_ci(pairs, st.ratio_of_sums, 400, 5)
    assert metrics["data_stall_share"].ci == pytest.approx((lo * 100, hi * 100), rel=1e-12)
    assert lo < metrics["data_stall_share"].value / 100 < hi
    lo, hi = st.bootstrap_ci(m["forward_s"].to_numpy(), "mean", 400, 5)  # a phase's time: its mean per step
    assert metrics["forward_time"].ci == pytest.approx((lo * 1e3, hi * 1e3), rel=1e-12)


def test_long_runs_use_fewer_resamples():
    assert st.resamples_for(20) == st.BOOTSTRAP_N
    assert st.resamples_for(10_000) == 400 and st.resamples_for(1_000_000) == st.BOOTSTRAP_MIN_N


def test_comparison_charts_list_skips_empty_parts():
    c = cmp.compare(make_run("a", [0.1, 0.2]), make_run("b", [0.1, 0.1]))
    titles = [t for t, _ in c.charts()]
    assert titles == ["Change against the baseline, with 95% intervals", "Step time and time per phase by run"]
    assert all(ch.to_dict() for _, ch in c.charts())
    assert cmp.compare(Run(meta={"name": "e"})).charts() == []


# -- compare v2: baseline, practical threshold, not enough data, NaN -------------------------

NOISE = [0.100, 0.104, 0.096, 0.102, 0.098, 0.101, 0.099, 0.103, 0.097, 0.100]


def test_deltas_are_against_the_chosen_baseline():
    runs = [make_run(n, np.array(NOISE) * f) for n, f in (("a", 1.0), ("b", 2.0), ("c", 4.0))]
    c = cmp.compare(*runs, baseline="b")
    assert c.baseline == "b" and c.labels == ["a", "b", "c"]
    assert row(c, "step_time_p50", "b")["significant"] == cmp.BASELINE
    assert row(c, "step_time_p50", "a")["delta_pct"] == pytest.approx(-50.0)
    assert row(c, "step_time_p50", "c")["delta_pct"] == pytest.approx(100.0)
    assert row(c, "step_time_p50", "a")["direction"] == "better"
    assert cmp.compare(*runs).baseline == "a"  # default: the first run
    assert cmp.compare(*runs, baseline=runs[2]).baseline == "c"
    assert cmp.compare(*runs, baseline=-1).baseline == "c"
    from tpkit.errors import TpkitError

    with pytest.raises(TpkitError, match="none of the compared runs: a, b, c"):
        cmp.compare(*runs, baseline="zzz")


def test_a_precise_but_tiny_change_is_no_meaningful_difference():
    # 200 steps each, a 0.2% slower step: the interval of the change excludes zero, but it is
    # below the 2% practical threshold
    d = 0.1 + 0.0002 * np.sin(np.arange(200))
    c = cmp.compare(make_run("a", d), make_run("b", d * 1.002))
    r = row(c, "step_time_p50", "b")
    assert r["delta_pct"] == pytest.approx(0.2, abs=0.01)
    assert r["delta_low"] > 0  # the change is real...
    assert r["significant"] == cmp.NO_DIFFERENCE  # ...but not worth acting on
    r = row(c, "step_time_p50", "b")
    c = cmp.compare(make_run("a", d), make_run("b", d * 1.03))  # 3%: above the threshold
    assert row(c, "step_time_p50", "b")["significant"] == cmp.SIGNIFICANT


def test_few_steps_are_not_enough_data():
    c = cmp.compare(make_run("a", [0.1, 0.1, 0.1, 0.1]), make_run("b", [0.2, 0.2, 0.2, 0.2]))
    assert row(c, "step_time_p50", "b")["significant"] == cmp.NOT_ENOUGH_DATA
    assert row(c, "throughput", "b")["significant"] == cmp.NOT_ENOUGH_DATA
    assert row(c, "step_time_p50", "b")["delta_pct"] == pytest.approx(100.0)  # the change is still shown
    one = cmp.compare(make_run("a", NOISE), make_run("b", [0.05]))
    assert one.verdict("step_time_p50", "b") == cmp.NOT_ENOUGH_DATA


def test_a_run_without_sample_counts_is_never_minus_100_percent_significant():
    c = cmp.compare(make_run("a", NOISE), make_run("b", NOISE, samples=0))
    r = row(c, "throughput", "b")
    assert np.isnan(r["value"]) and r["significant"] == cmp.NOT_ENOUGH_DATA
    assert any("'b' counted no samples" in w for w in c.warnings)
    assert "-100" not in c.to_text()
    # the other figures are still judged
    assert row(c, "step_time_p50", "b")["significant"] == cmp.NO_DIFFERENCE


def test_nan_durations_are_dropped_with_a_counted_warning():
    d = np.array(NOISE + [float("nan"), float("nan")])
    with pytest.warns(RuntimeWarning, match=r"NaN duration left out \(b: 2\)"):
        c = cmp.compare(make_run("a", NOISE), make_run("b", d))
    assert "'b': 2 measured steps with a NaN duration left out" in c.warnings
    assert row(c, "step_time_p50", "b")["value"] == pytest.approx(float(np.median(NOISE)) * 1e3)
    assert row(c, "throughput", "b")["value"] == pytest.approx(100 / sum(NOISE))
    assert c.counts == {"a": 10, "b": 10}


def test_all_nan_durations_do_not_crash_the_views():
    bad = make_run("bad", [float("nan")] * 6)
    with pytest.warns(RuntimeWarning):
        c = cmp.compare(bad, make_run("ok", NOISE))
    assert row(c, "step_time_p50", "ok")["significant"] == cmp.NOT_ENOUGH_DATA
    page = c.to_html(charts=False)
    assert "Comparison of 2 runs" in page and "not enough data" in page
    assert "tpkit comparison" in c.to_text()
    with pytest.warns(RuntimeWarning):
        assert cmp.compare(bad).to_html()  # the lone all-NaN run, charts and all


def test_compare_view_has_one_row_per_run_and_collapses_memory():
    mem = _frame("memory", [(0, "forward", "peak", 0.1, "cpu", "activations", 3 * MIB)])
    runs = [make_run(f"r{i}", np.array(NOISE) * (1 + i / 10), memory=mem) for i in range(6)]
    page = cmp.compare(*runs).to_html(charts=False)
    main = page.split("<details>")[0]
    assert main.count("<tr>") == 1 + 6  # header + one row per run
    assert "<th>throughput (samples/s)</th>" in main and "peak memory" not in main
    assert "<summary>Peak memory and energy</summary>" in page and "peak memory, activations" in page


# -- properties on random runs ---------------------------------------------------------------

#: compare takes ~0.1 s a call here: no shrinking (minutes), the failing example is printed as drawn
QUICK = settings(max_examples=25, deadline=None, phases=(Phase.explicit, Phase.reuse, Phase.generate))

durations = hs.lists(hs.one_of(hs.floats(1e-4, 5.0), hs.just(float("nan"))), min_size=0, max_size=14)


@QUICK
@given(a=durations, b=durations, samples_a=hs.integers(0, 64), samples_b=hs.integers(0, 64),
       share=hs.floats(0.0, 1.0))
def test_compare_on_random_runs_never_crashes_and_is_symmetric(a, b, samples_a, samples_b, share):
    import warnings

    ra = make_run("a", a, samples=samples_a, data_share=share)
    rb = make_run("b", b, samples=samples_b, data_share=1 - share)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        ab, ba = cmp.compare(ra, rb, n=200), cmp.compare(rb, ra, n=200)
        assert ab.to_html(charts=False) and ab.to_text()
    for metric in set(ab.table["metric"]) | set(ba.table["metric"]):
        x = ab.table[(ab.table["metric"] == metric) & (ab.table["run"] == "b")]
        y = ba.table[(ba.table["metric"] == metric) & (ba.table["run"] == "a")]
        if x.empty or y.empty:  # a figure one run lacks is never judged
            assert cmp.SIGNIFICANT not in {*x["significant"], *y["significant"]}
            continue
        x, y = x.iloc[0], y.iloc[0]
        assert x["significant"] == y["significant"], metric
        if x["significant"] == cmp.SIGNIFICANT:
            assert np.sign(x["delta"]) == -np.sign(y["delta"]) != 0
            assert x["delta_low"] == pytest.approx(-y["delta_high"]) and x["delta_high"] == pytest.approx(-y["delta_low"])
            assert {x["direction"], y["direction"]} in ({"better", "worse"}, {""})


@QUICK
@given(d=hs.lists(hs.floats(1e-4, 5.0), min_size=1, max_size=30), samples=hs.integers(0, 64),
       share=hs.floats(0.0, 1.0))
def test_identical_runs_are_never_significant(d, samples, share):
    c = cmp.compare(make_run("x", d, samples=samples, data_share=share),
                    make_run("x", d, samples=samples, data_share=share), n=200)
    assert not (c.table["significant"] == cmp.SIGNIFICANT).any()
    tested = c.table[(c.table["run"] == "x#2") & c.table["significant"].isin([cmp.NO_DIFFERENCE])]
    assert (tested["delta"] == 0).all() and (tested["delta_low"] == 0).all()


def test_a_phase_share_that_rises_because_the_step_got_faster_is_not_called_worse():
    d = np.array(NOISE)
    slow = make_run("slow", d * 3, data_share=0.0)
    fast = make_run("fast", d, data_share=0.0)
    slow.steps["other_s"] = 0.003  # the same 3 ms of overhead in both: 1% -> 3%
    fast.steps["other_s"] = 0.003
    slow.steps["forward_s"] -= 0.003
    fast.steps["forward_s"] -= 0.003
    c = cmp.compare(slow, fast)
    assert row(c, "step_time_p50", "fast")["direction"] == "better"
    other = row(c, "other_share", "fast")
    assert other["value"] > 3 * row(c, "other_share", "slow")["value"] * 0.9
    assert other["significant"] == cmp.NOT_TESTED  # a share is shown, not judged
    other = row(c, "other_time", "fast")
    assert other["value"] == pytest.approx(3.0) and other["delta"] == pytest.approx(0.0)
    assert other["significant"] == cmp.NO_DIFFERENCE


def test_a_forward_change_is_called_in_forward_only():
    """20 ms more forward a step, the other phases' times alike: forward +20 ms and the step
    are significant, backward and optimizer are not (their shares fell 10 and 5 points, and
    had been called significant), the shares are shown unjudged."""
    jitter = np.array([0.0, 0.4, -0.3, 0.2, -0.4, 0.1, -0.1, 0.3, -0.2, 0.0] * 2) * 1e-3  # +-0.4 ms
    phases_s = {"data_wait_s": 0.0003, "forward_s": 0.020, "backward_s": 0.022, "optimizer_s": 0.011}

    def loop(name: str, extra_forward_s: float) -> Run:
        p = dict(phases_s, forward_s=phases_s["forward_s"] + extra_forward_s)
        run = make_run(name, np.full(20, sum(p.values())))
        for col, sec in p.items():
            run.steps[col] = sec + jitter[::-1] if col == "backward_s" else sec + jitter
        run.steps["duration_s"] = run.steps[list(p)].sum(axis=1)
        return run

    c = cmp.compare(loop("base", 0.0), loop("fwd+20ms", 0.020))
    fwd = row(c, "forward_time", "fwd+20ms")
    assert fwd["delta"] == pytest.approx(20.0) and fwd["value"] == pytest.approx(40.0)
    assert fwd["significant"] == cmp.SIGNIFICANT and fwd["direction"] == "worse"
    assert row(c, "step_time_p50", "fwd+20ms")["significant"] == cmp.SIGNIFICANT
    for phase in ("backward", "optimizer", "data_wait"):
        r = row(c, f"{phase}_time", "fwd+20ms")
        assert r["delta"] == pytest.approx(0.0, abs=1e-9) and r["significant"] == cmp.NO_DIFFERENCE, phase
    assert row(c, "backward_share", "fwd+20ms")["delta"] < -10  # the share moved...
    assert {row(c, f"{p}_share", "fwd+20ms")["significant"] for p in ("forward", "backward", "optimizer")} \
        == {cmp.NOT_TESTED}  # ...and is not judged
    called = set(c.table[c.table["significant"] == cmp.SIGNIFICANT]["metric"])
    assert called == {"throughput", "step_time_p50", "forward_time"}


def drifting(name: str, scale: float, drift: float = 0.05) -> Run:
    """20 steps of 100 ms (x ``scale``), the second half ``drift`` slower (a machine whose load
    rose mid-run), +-0.5% jitter within each half."""
    jitter = 1 + np.array([0.0, 0.005, -0.005, 0.003, -0.003, 0.004, -0.004, 0.002, -0.002, 0.001])
    return make_run(name, 0.1 * scale * np.concatenate([jitter, jitter * (1 + drift)]))


def test_a_difference_within_the_runs_own_drift_is_not_called():
    """Two runs that drift 5% between their halves: 5% apart is what their own steps show
    between halves, not called (a bootstrap over steps called it: its interval excludes 0);
    20% apart is called. The verdict says why."""
    base = drifting("a", 1.0)
    c = cmp.compare(base, drifting("b", 1.05))
    thr = row(c, "throughput", "b")
    assert thr["delta_pct"] == pytest.approx(-100 / 21, rel=1e-6)  # 1 / 1.05 - 1
    assert thr["delta_high"] < 0  # the steps' interval alone excludes 0...
    assert thr["significant"] == cmp.NO_DIFFERENCE  # ...the runs' own drift does not
    assert thr["why"] == ("within run-to-run drift: a run's own halves differ by up to 5.0%, "
                          "so a change is called from 10.0%")
    assert row(c, "step_time_p50", "b")["significant"] == cmp.NO_DIFFERENCE
    assert "within run-to-run drift" in c.to_text()
    c = cmp.compare(base, drifting("b", 1.20))
    assert row(c, "throughput", "b")["significant"] == cmp.SIGNIFICANT
    assert row(c, "step_time_p50", "b")["significant"] == cmp.SIGNIFICANT
    assert row(c, "step_time_p50", "b")["why"] == ""
    # runs steady within themselves keep the 2% rule: 5% apart is called
    c = cmp.compare(drifting("a", 1.0, drift=0.0), drifting("b", 1.05, drift=0.0))
    assert row(c, "throughput", "b")["significant"] == cmp.SIGNIFICANT


def test_a_run_that_trends_within_itself_still_has_its_real_change_called():
    """A steady 100 ms run against one slowing from 100 to 140 ms (a device throttling): its
    halves are 24% apart, but drift excuses at most 10% (DRIFT_CAP): its -17% throughput is
    called (twice its halves had read "no meaningful difference"), with a warning that the run
    was not steady."""
    steady = make_run("steady", np.full(20, 0.1) * (1 + np.tile([0.002, -0.002], 10)))
    slowing = make_run("slowing", np.linspace(0.100, 0.140, 20))
    c = cmp.compare(steady, slowing)
    thr = row(c, "throughput", "slowing")
    assert thr["delta_pct"] == pytest.approx(100 * (20 / np.linspace(0.100, 0.140, 20).sum() / 10 - 1), rel=1e-3)
    assert thr["significant"] == cmp.SIGNIFICANT and thr["direction"] == "worse"
    assert any(w.startswith("'slowing' was not steady: its training throughput differs by") for w in c.warnings)
    assert not any(w.startswith("'steady' was not steady") for w in c.warnings)


def test_a_setup_in_one_half_is_no_drift():
    """A trainer's setup (setup_s, 0.8 s) in one step of the baseline's first half is no load
    drift: the halves are judged on training time, so the other run's 2x throughput is called
    (it had read "within run-to-run drift: halves differ by up to 134%")."""
    d = np.full(12, 0.1) * (1 + np.tile([0.002, -0.002], 6))
    base = make_run("base", d)
    steps = base.steps.copy()
    steps.loc[3, "duration_s"] += 0.8
    steps.loc[3, "setup_s"] = 0.8
    faster = make_run("faster", d / 2)
    c = cmp.compare(Run(steps=steps, meta={"name": "base"}), faster)
    assert row(c, "throughput", "faster")["significant"] == cmp.SIGNIFICANT
    assert not any("was not steady" in w for w in c.warnings)


def test_training_shares_leave_an_evaluation_out():
    """Two runs that train alike, one evaluating inside the slice (eval 20% of its steps): the
    training phases' times per step agree, and so do their shares, of training time (forward
    read -9 pp, "significant", against the run without); the evaluation's own share is of the
    whole step, its time is called; the comparison says how it counted."""
    noise = np.array([0.100, 0.104, 0.096, 0.102, 0.098, 0.101, 0.099, 0.103, 0.097, 0.100])
    plain = make_run("plain", noise)
    evaluating = make_run("evaluating", noise / 0.8)  # the same training, plus 20% evaluation
    steps = evaluating.steps.copy()
    steps["eval_s"] = steps["duration_s"] * 0.2
    for col in ("data_wait_s", "forward_s", "backward_s"):
        steps[col] = steps[col] * 0.8
    c = cmp.compare(plain, Run(steps=steps, meta={"name": "evaluating"}))
    for metric in ("data_stall_share", "forward_share", "backward_share"):
        assert row(c, metric, "evaluating")["value"] == pytest.approx(row(c, metric, "plain")["value"])
    for metric in ("data_wait_time", "forward_time", "backward_time"):
        assert row(c, metric, "evaluating")["value"] == pytest.approx(row(c, metric, "plain")["value"])
        assert row(c, metric, "evaluating")["significant"] == cmp.NO_DIFFERENCE
    assert row(c, "eval_share", "evaluating")["value"] == pytest.approx(20.0)
    assert row(c, "eval_time", "evaluating")["value"] == pytest.approx(noise.mean() / 0.8 * 0.2 * 1e3)
    assert row(c, "eval_time", "evaluating")["significant"] == cmp.SIGNIFICANT
    assert any(w.startswith("what interrupts training ran inside the slice ('plain': none; "
                            "'evaluating': evaluation 20%") for w in c.warnings), c.warnings


def test_a_run_whose_updates_or_data_waits_tpkit_could_not_see_is_named():
    """An eager step against a compiled one (its update time is other, its note says so), and a
    watched loader against one tpkit does not see (its wait is other): the shares move between
    phases for that reason alone, and the comparison says so (it had called optimizer -92% and
    other +732% significant with no word)."""
    from tpkit.schema import UNSEEN_UPDATES_NOTE

    compiled = make_run("compiled", NOISE, notes=[f"7 {UNSEEN_UPDATES_NOTE}: ..."])
    c = cmp.compare(make_run("eager", NOISE), compiled)
    assert any(w.startswith("'compiled': the optimizer's updates ran where tpkit cannot time them") for w in c.warnings)
    blind = make_run("unwatched", NOISE, samples=0, data_share=0.0)
    c = cmp.compare(make_run("watched", NOISE), blind)
    assert any(w.startswith("'unwatched': no batch was seen") for w in c.warnings), c.warnings
    assert cmp.compare(make_run("a", NOISE), make_run("b", NOISE)).warnings == []


def test_a_collector_pause_inside_a_wait_for_data_is_no_data_stall():
    """A full collection that lands in ``next()`` (a first slice's) is Python's own time, which no
    loader shortens: ``compare`` reads it as other, as the summary's verdict does, where it had
    read a data stall 3x the loader's (30 ms of wait a step for the loader's 10 ms)."""
    from tpkit.capture import build
    from tpkit.schema import BUILTIN_PHASES

    rows = []
    for k in range(6):
        t = k * 0.1
        rows += [(k, "data_wait", t, t + 0.03, 0), (k, "gc", t + 0.005, t + 0.025, 1),
                 (k, "forward", t + 0.03, t + 0.07, 0), (k, "backward", t + 0.07, t + 0.1, 0)]
    d = pd.DataFrame(rows, columns=["step", "phase", "start_s", "end_s", "depth"])
    spans = d.assign(duration_s=d.end_s - d.start_s, source=np.where(d.phase.isin(BUILTIN_PHASES), "test", "gen2"))
    bounds = pd.DataFrame({"step": range(6), "warmup": False, "start_s": np.arange(6) * 0.1,
                           "end_s": np.arange(1, 7) * 0.1, "samples": 8, "loss": 1.0})
    steps = build.step_breakdown(spans, bounds)
    assert steps["data_wait_s"].tolist() == pytest.approx([0.03] * 6)  # the table's contract: as charged
    run = Run(steps=steps, spans=spans, meta={"name": "gc"})
    c = cmp.compare(run, make_run("b", [0.1] * 6, samples=8, data_share=0.1))
    assert row(c, "data_wait_time", "gc")["value"] == pytest.approx(10.0)
    assert row(c, "other_time", "gc")["value"] == pytest.approx(20.0)
    assert row(c, "data_stall_share", "gc")["value"] == pytest.approx(10.0)
    phases = c.phases[c.phases["run"] == "gc"].set_index("phase")["median_ms"]  # the chart's too
    assert phases["data_wait"] == pytest.approx(10.0) and phases["other"] == pytest.approx(20.0)
