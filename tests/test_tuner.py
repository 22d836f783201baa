"""The tuner without a browser: runs, sweeps, failures shown, recommendations applied."""

from __future__ import annotations

import html
import time

import pytest

import tpkit as tp
from tpkit.analysis import recommend as rc
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
                memory=False, clock_hz=0, replicates=1)
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
    assert "<th>workers_ms</th><th>fail</th><th>slices</th>" in t.table.value  # one header per column


def test_replicates_pool_into_one_setting_with_an_interval_and_stored_names(tmp_path):
    from tpkit import store
    from tpkit.run import Run

    store.save(Run(meta={"name": "tune-1.2"}))  # a name from an earlier session: setting 1 is taken
    t = tp.tune(train_fn, knobs={"workers_ms": [1], "fail": False}, steps=2, warmup=0, memory=False, clock_hz=0)
    assert t.replicates == 3 and "3 slices per setting" in t.children[1].value
    rep = t.run_slice()
    names = [r.name for r in t.runs]
    assert names == ["tune-2.1", "tune-2.2", "tune-2.3"]  # the names they are stored under
    assert all((store.store_path() / n).is_dir() for n in names)
    assert "tune-2.1, tune-2.2, tune-2.3" in t.status.value and "over 3 slices" in t.status.value
    df = t.results()
    assert len(df) == 1 and df.loc[0, "replicates"] == 3 and rep.name == df.loc[0, "run"]
    thr = [r.summary().throughput for r in t.runs]
    assert df.loc[0, "throughput"] == pytest.approx(sum(thr) / 3)
    assert df.loc[0, "throughput_low"] <= min(thr) or df.loc[0, "throughput_low"] < df.loc[0, "throughput"]
    assert len(t.run_results()) == 3
    with pytest.raises(ValueError, match="replicates"):
        tp.tune(train_fn, knobs={"workers_ms": [1]}, replicates=0)


def test_a_slice_times_the_loaders_steady_rate_not_the_batches_it_queued():
    """4 workers each make a batch of 2 in 60 ms (a sleep): steady, 4 batches every 60 ms, 133
    samples/s. The loop's first step takes 300 ms (a model's first call): the workers fill their
    queue (4 x prefetch_factor 3 = 12 batches) meanwhile. The slice's warmup is 2 + those 12, so
    its window starts once they are read (with 2 warmup steps it had timed them: the window
    began with ~10 batches ready); and its 6 steps become 8, two whole bursts of 4 batches (6
    held one or two of the waits for a burst: 200 or 100 samples/s)."""
    import torch

    def collate(items: list) -> torch.Tensor:
        time.sleep(0.06)
        return torch.ones(len(items), 1)

    def fn(num_workers, prefetch_factor):
        model = torch.nn.Linear(1, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        loader = torch.utils.data.DataLoader(range(10_000), batch_size=2, num_workers=num_workers,
                                             prefetch_factor=prefetch_factor, collate_fn=collate)
        for k, x in enumerate(loader):
            if k == 0:
                time.sleep(0.3)
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()

    t = tp.tune(fn, knobs={"num_workers": [4], "prefetch_factor": [3]}, steps=6, warmup=2, memory=False,
                clock_hz=0, replicates=1)
    run = t.run_slice()
    assert (run.meta["warmup_requested"], run.meta["steps_requested"]) == (2 + 4 * 3, 8)
    assert run.summary().throughput == pytest.approx(4 * 2 / 0.06, rel=0.1)


def test_the_queue_and_the_window_of_a_setting_come_from_its_knobs():
    queued = tp.views.tuner.queued_batches
    assert queued({"num_workers": 4}) == 8  # torch's prefetch_factor 2
    assert queued({"num_workers": 4, "prefetch_factor": 3}) == queued({"num_workers": 4, "prefetch": 3}) == 12
    assert queued({"num_workers": 4, "loader": "tpkit"}) == 32  # tp.data.Loader's small batches: 8 each
    assert queued({"num_workers": 0}) == queued({}) == queued({"num_workers": "auto"}) == 0
    window = tp.views.tuner.window_steps
    assert window(10, {"num_workers": 4}) == 12 and window(8, {"num_workers": 4}) == 8
    assert window(10, {"num_workers": 1}) == window(10, {}) == window(10, {"num_workers": "auto"}) == 10


def test_the_queues_warmup_is_at_most_twice_the_window():
    from tpkit.views.tuner import queue_warmup as warm

    assert warm(6, {"num_workers": 4, "prefetch_factor": 3}) == 12  # the whole queue: under 2 x 8
    assert warm(10, {"num_workers": 2, "prefetch_factor": 8}) == 16
    assert warm(10, {"num_workers": 16, "loader": "tpkit"}) == 32  # 128 queued, a window of 16: 2 x 16
    assert warm(3, {"num_workers": 2, "prefetch_factor": 8}) == 8  # a window of 4
    assert warm(10, {}) == 0


def test_a_setting_whose_loop_ended_before_the_window_filled_is_short_and_never_best():
    """``train_fn`` trains one finite epoch: 3 batches, fewer than the 4 steps asked. Its slice
    is marked short in the frame, the table and the status, and the other setting (4 of 4
    steps, 8 ms a batch: slower than 1 ms) is best (the short one had been best: complete, and
    its 3 steps faster)."""
    def fn(batches, wait_ms):
        for _ in tp.watch([[0] * 4] * batches if wait_ms == 1 else _slow(batches, wait_ms)):
            time.sleep(0.004)
            tp.step()

    def _slow(n, ms):
        for _ in range(n):
            time.sleep(ms / 1000)
            yield [0] * 4

    t = tp.tune(fn, knobs={"batches": [3, 100], "wait_ms": [1, 8]}, steps=4, warmup=0, memory=False, clock_hz=0,
                replicates=1)
    short = t.run_slice(batches=3, wait_ms=1)
    status = t.status.value
    full = t.run_slice(batches=100, wait_ms=8)
    df = t.results()
    assert df.loc[0, "throughput"] > df.loc[1, "throughput"]  # faster, but 3 steps of 4
    assert df["best"].tolist() == [False, True]
    assert df["short"].tolist() == [True, False] and df["complete"].tolist() == [True, True]
    assert tuning.short_of_steps(short) == (3, 4) and tuning.short_of_steps(full) is None
    assert "tune-1 measured 3 of the 4 steps asked" in status and "not ranked as best" in status
    assert "short" not in t.status.value
    assert tuning.results_frame(t.runs)["best"].tolist() == [False, True]
    assert t.table.value.count("(short: fewer steps than asked, not ranked)") == 1


def test_best_is_chosen_from_replicate_means_not_single_slices():
    import numpy as np

    from tpkit.run import Run
    from tpkit.schema import frame

    def run(name, knobs, throughput):
        d = np.full(6, 16 / throughput)  # 16 samples per step
        steps = frame("steps", {"step": range(6), "warmup": False, "start_s": np.cumsum(d) - d, "end_s": np.cumsum(d),
                                "duration_s": d, "samples": 16, "data_wait_s": 0.0, "h2d_s": 0.0, "forward_s": d,
                                "backward_s": 0.0, "optimizer_s": 0.0, "offload_s": 0.0, "tpkit_s": 0.0,
                                "other_s": 0.0, "throughput": throughput, "loss": 1.0})
        return Run(steps=steps, meta={"name": name, "knobs": knobs})

    # the same setting measured 93, 118 and 102 samples/s; the other 108, 110, 109
    runs = [run(f"a{i}", {"w": 0}, x) for i, x in enumerate([93.0, 118.0, 102.0])]
    runs += [run(f"b{i}", {"w": 2}, x) for i, x in enumerate([108.0, 110.0, 109.0])]
    df = tuning.settings_frame(runs)
    assert list(df["w"]) == [0, 2] and list(df["replicates"]) == [3, 3]
    assert df["throughput"].tolist() == pytest.approx([313 / 3, 109.0])
    assert df["best"].tolist() == [False, True]  # not the 118 of a single noisy slice
    assert not df.loc[1, "clear"]  # its interval overlaps setting w=0's: within noise
    assert df.loc[1, "throughput_low"] == pytest.approx(109 - 4.303 * 1.0 / np.sqrt(3))
    assert df.loc[1, "run"] == "b2"  # the replicate nearest the mean (109) stands for it
    assert tuning.results_frame(runs)["best"].tolist() == [False, True, False, False, False, False]


def test_apply_is_offered_only_for_knobs_the_tuner_has():
    t = tp.tune(train_fn, knobs={"workers_ms": [30], "fail": False}, steps=2, warmup=0, memory=False, clock_hz=0,
                replicates=1)
    t.run_slice()  # 30 ms of data wait in a 34 ms step: "use 2 loader workers"
    html_of = [c for c in t.recs.children]
    assert not any(isinstance(x, tp.views.tuner.w.HBox) for x in html_of)  # no Apply button
    assert "to apply it here, add num_workers to knobs=" in str([x.children[1].value for x in html_of
                                                                if hasattr(x, "children")])
    assert t.controls["workers_ms"].style.description_width == "initial"  # "workers_ms", never cut
    summary = t.summary.children
    top = rc.data_stall(t.runs[-1])[0]  # ceil(30 / 4) = 8 workers, capped at the host's cores
    assert top.action == {"num_workers": min(8, rc.host_cores(t.runs[-1].meta))}
    assert len(summary) == 1 and f"Top recommendation: {html.escape(top.title)}" in summary[0].outputs[0]["data"]["text/html"]


def test_the_summary_tab_applies_the_top_recommendation_when_the_tuner_has_its_knob():
    calls = []

    def fn(num_workers, workers_ms=30):
        calls.append(num_workers)
        train_fn(workers_ms if num_workers == 0 else 1)

    t = tp.tune(fn, knobs={"num_workers": [0]}, steps=2, warmup=0, memory=False, clock_hz=0, replicates=1)
    t.run_slice()
    button = t.summary.children[-1]
    n = min(8, rc.host_cores(t.runs[-1].meta))  # ceil(30 ms to make a batch / 4 ms of work), at most the cores
    assert button.description == f"Apply num_workers={n} and rerun"
    button.click()
    assert calls == [0, n] and t.runs[-1].meta["knobs"] == {"num_workers": n}


def test_a_failing_setting_is_shown_and_changes_nothing():
    t = tp.tune(train_fn, knobs={"workers_ms": [1], "fail": False}, steps=2, warmup=0, memory=False, clock_hz=0,
                replicates=1)
    t.run_slice()
    assert t.run_slice(fail=True) is None
    assert "failed: ValueError: this setting cannot run" in t.status.value
    assert len(t.runs) == 1 and not t.run_button.disabled
    assert t.run_slice(fail=False) is not None and len(t.runs) == 2


def test_sweep_runs_the_grid_and_refuses_too_big_grids():
    t = tp.tune(train_fn, knobs={"workers_ms": [2, 1], "fail": [False]}, steps=2, warmup=0,
                memory=False, clock_hz=0, sweep_limit=3, replicates=1)
    done = t.sweep()
    assert [r.meta["knobs"]["workers_ms"] for r in done] == [2, 1]
    assert t.sweep({"workers_ms": [1, 2], "fail": [False, True]}) == []
    assert "4 settings" in t.status.value and "limit of 3" in t.status.value


def test_apply_sets_the_knob_and_reruns():
    t = tp.tune(train_fn, knobs={"workers_ms": [9], "fail": False}, steps=2, warmup=0, memory=False, clock_hz=0,
                replicates=1)
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
