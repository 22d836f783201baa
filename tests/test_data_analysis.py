"""The loader's recorder rows and its verdict, on hand-made frames."""

from __future__ import annotations

import time

import pandas as pd
import pytest
import torch
from data_helpers import Mixed

from tpkit.analysis.loader import loader_verdict
from tpkit.capture import recorder
from tpkit.data import Loader


def _frame(n=20, workers=2, fetch_s=0.010, collate_s=0.001, queue_wait_s=0.0, transfer_s=0.0005):
    return pd.DataFrame({"batch": range(n), "worker": [i % workers for i in range(n)],
                         "fetch_s": fetch_s, "collate_s": collate_s,
                         "queue_wait_s": queue_wait_s, "transfer_s": transfer_s})


def test_healthy_when_batches_wait_for_the_loop_and_it_would_trim_workers():
    v = loader_verdict(_frame(queue_wait_s=0.02), step_s=0.05)
    assert v.verdict == "healthy" and v.ready_fraction == 1.0
    assert v.workers == 1  # ceil(1.2 * 11.5 ms / 50 ms) = 1 is enough
    assert loader_verdict(_frame(queue_wait_s=0.02)).workers == 2  # no step time: keep


def test_queue_empty_asks_for_the_workers_the_rates_need():
    v = loader_verdict(_frame(fetch_s=0.030, collate_s=0.002, transfer_s=0.001), step_s=0.010)
    assert v.verdict == "queue empty"
    assert v.workers == 4  # ceil(1.2 * 33 ms / 10 ms)
    assert v.make_s == pytest.approx(0.032)
    assert loader_verdict(_frame(), num_workers=2).workers == 3  # without step time: one more


def test_workers_starved_when_they_could_keep_up_but_the_loop_still_waited():
    v = loader_verdict(_frame(fetch_s=0.004, collate_s=0.001), step_s=0.010, num_workers=2)
    assert v.verdict == "workers starved" and v.workers == 2


def test_transfer_bound_when_moving_costs_more_than_making():
    v = loader_verdict(_frame(fetch_s=0.001, collate_s=0.0005, transfer_s=0.004))
    assert v.verdict == "transfer-bound" and v.transfer_s == pytest.approx(0.004)


def test_frame_checks():
    with pytest.raises(ValueError, match="lacks columns"):
        loader_verdict(pd.DataFrame({"batch": [0]}))
    assert loader_verdict(_frame(n=0)).verdict == "healthy"


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_records_data_wait_samples_and_batches_into_the_active_recorder(workers):
    rec = recorder.Recorder("t")
    recorder.set_active(rec)
    try:
        # main_helps=False: batch b from worker b % 2 (a helping main process on 2 cores
        # would make some itself and give one worker's share to the other)
        loader = Loader(Mixed(10), batch_size=4, num_workers=workers, main_helps=False)
        batches = list(loader)
        # An outer data_wait (a DataLoader probe) is not doubled.
        tok = rec.enter("data_wait", "probe")
        next(iter(loader))
        rec.exit(tok)
    finally:
        recorder.set_active(None)
    assert len(batches) == 3
    spans = [s for s in rec.spans if s[0] == "data_wait"]
    # 3 batches + the call that found the epoch over (also time the loop waited), then the probe's.
    assert [s[4] for s in spans] == ["tpkit.data"] * 4 + ["probe"]
    assert all(s[2] >= s[1] for s in spans)
    assert rec.samples == 10 + 4
    rows = pd.DataFrame(rec.loader, columns=["batch", "worker", "fetch_s", "collate_s",
                                             "queue_wait_s", "transfer_s"])
    assert rows["batch"].tolist() == [0, 1, 2, 0]
    assert rows["worker"].tolist() == ([0, 1, 0, 0] if workers == 2 else [0, 0, 0, 0])
    assert (rows[["fetch_s", "collate_s", "queue_wait_s", "transfer_s"]] >= 0).all().all()
    assert loader_verdict(rows).verdict in ("healthy", "queue empty", "workers starved", "transfer-bound")


def test_workers_auto_picks_a_count_and_loads_correctly():
    loader = Loader(Mixed(64), batch_size=8, workers="auto")
    got = [b["i"].tolist() for b in loader]
    assert isinstance(loader.num_workers, int) and 0 <= loader.num_workers <= 2
    assert got == [list(range(i, i + 8)) for i in range(0, 64, 8)]
    assert Loader(Mixed(64), batch_size=8).autotune(max_workers=1, trial_batches=3) in (0, 1)


def test_suggest_workers_from_measured_batches():
    from tpkit.data.autotune import suggest_workers

    ms = 1e-3
    # workers keep up: a batch takes 8 ms to make, the step 3 ms, hand-over 0.1 ms -> ceil(1.1*8/3.1) = 3
    assert suggest_workers([8 * ms] * 5, [0.1 * ms, 0.2 * ms, 0.1 * ms, 0.3 * ms, 0.1 * ms], [3 * ms] * 5, 8)[0] == 3
    assert suggest_workers([8 * ms] * 5, [0.1 * ms] * 5, [3 * ms] * 5, 2) == (
        2, "a batch takes 8.00 ms to make and the loop 3.10 ms per step: 3 worker(s) keep up, capped at 2")
    # the loop waits 2x longer for a worker's batch than it takes to make one itself: none
    n, why = suggest_workers([0.2 * ms] * 5, [0.4 * ms] * 5, [0.01 * ms] * 5, 8)
    assert n == 0 and why.startswith("the loop waited 0.40 ms per batch")
    # a slow step needs one worker however cheap the hand-over
    assert suggest_workers([2 * ms] * 3, [0.05 * ms] * 3, [50 * ms] * 3, 8)[0] == 1


class Sleepy(torch.utils.data.Dataset):
    """Each sample takes 4 ms (a sleep)."""

    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(0.004)
        return torch.tensor([i])


def test_workers_auto_never_delays_the_first_batch_and_chooses_from_the_epoch():
    """No timed trials before the first batch: it comes as fast as a fixed count's; the first
    epoch's batches (4 ms each to make, a 2 ms step) decide the
    next epoch's count: ceil(1.1 * 4 / (2 + hand-over)) = 3 workers, capped at the cores."""
    import os

    loader = Loader(Sleepy(), batch_size=1, workers="auto")
    assert loader.num_workers == min(2, os.cpu_count() or 1)
    t0 = time.perf_counter()
    it = iter(loader)
    first = next(it)
    assert time.perf_counter() - t0 < 0.5 and first.tolist() == [[0]]
    got = [0]
    for b in it:
        got.append(int(b))
        time.sleep(0.002)
    assert got == list(range(48))
    iter(loader)
    assert loader.num_workers == min(3, os.cpu_count() or 1)
    assert "a batch takes" in loader.workers_reason
    loader.close()


def test_step_time_from_run_steps_ignores_warmup_and_data_wait():
    from tpkit.analysis.loader import loop_step_s

    steps = pd.DataFrame({"warmup": [True, False, False, False],
                          "duration_s": [1.0, 0.030, 0.040, 0.050],
                          "data_wait_s": [0.0, 0.020, 0.030, 0.040]})
    assert loop_step_s(steps) == pytest.approx(0.010)
    v = loader_verdict(_frame(fetch_s=0.030, collate_s=0.002, transfer_s=0.001), steps=steps)
    assert v.verdict == "queue empty" and v.workers == 4
    assert loop_step_s(pd.DataFrame()) is None


@pytest.mark.parametrize("workers, mode", [(0, "main process"), (2, "thread")])
def test_the_profile_records_how_the_loader_made_its_batches(tmp_path, workers, mode):
    """The run knows the worker count without a ``knobs=`` entry, so the advice says "now 2",
    not "now 0", and it survives a save and load."""
    import tpkit as tp
    from tpkit.analysis.recommend import current_workers
    from tpkit.run import Run

    loader = Loader(Mixed(40), batch_size=4, num_workers=workers, mode="thread")
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with tp.profile(steps=4, warmup=1, progress=False, memory=False, clocks=False) as prof:
        for b in loader:
            model(b["i"].float()[:, None]).sum().backward()
            opt.step()
    meta = prof.run.meta["loader"]
    assert 0.0 <= meta["make_cpu_share"] <= 1.0  # its making's time on a core (test_recommend.py)
    assert {k: v for k, v in meta.items() if k != "make_cpu_share"} == {
        "num_workers": workers, "mode": mode, "batch_size": 4, "prefetch": loader.prefetch}
    assert current_workers(prof.run.meta) == workers
    assert current_workers({"knobs": {"num_workers": 3}, "loader": meta}) == 3  # the user's knob first
    prof.run.save(tmp_path / "run")
    assert Run.load(tmp_path / "run").meta["loader"] == meta
