"""The Python API without the magic: tp.profile, profile_fn, warmup auto, tp.phase, tp.step,
tp.watch, h2d detection, nesting refused."""

from __future__ import annotations

import time

import pytest
import sleepy
import torch

import tpkit as tp


def test_profile_fn_counts_calls_as_steps_and_keeps_returned_loss():
    calls = []

    def step():
        calls.append(1)
        with tp.phase("work"):
            time.sleep(0.002)
        return torch.tensor(float(len(calls)))

    run = tp.profile_fn(step, steps=4, warmup=1, progress=False)
    assert len(calls) == 5
    assert list(run.steps["loss"]) == [1.0, 2.0, 3.0, 4.0, 5.0]
    # a collector pause may land in any slice; "tpkit" spans are the memory probe's own work
    spans = run.spans[~run.spans["phase"].isin(["gc", "tpkit"])]
    assert set(spans["phase"]) == {"work"}
    assert (spans["source"] == "tp.phase").all()


def test_profile_fn_with_an_optimizer_inside_counts_optimizer_steps():
    model, loader, opt = sleepy.make()
    it = iter(loader)

    def step():
        model(next(it)).backward()
        opt.step()
        opt.zero_grad()

    run = tp.profile_fn(step, steps=2, warmup=0, progress=False)
    assert len(run.steps) == 2 and (run.steps["samples"] == sleepy.BATCH).all()
    assert (run.steps["forward_s"] > sleepy.FORWARD_S * 0.9).all()


def test_warmup_auto_ends_when_step_times_settle():
    n = []

    def step():
        n.append(1)
        time.sleep(0.15 if len(n) == 1 else 0.04)  # long sleeps: jitter stays far under 20%

    run = tp.profile_fn(step, steps=3, warmup="auto", progress=False)
    assert run.meta["warmup_steps"] == 4 and len(n) == 7
    assert list(run.steps["warmup"]) == [True] * 4 + [False] * 3
    assert any("warmup auto: ended after 4 steps" in x for x in run.meta["notes"])


def test_warmup_auto_cap():
    n = []

    def step():
        n.append(1)
        time.sleep(0.02 if len(n) % 2 else 0.06)  # alternating 20 ms / 60 ms never settles

    run = tp.profile_fn(step, steps=2, warmup="auto", progress=False)
    assert run.meta["warmup_steps"] == tp.capture.slice.WARMUP_AUTO_CAP
    assert len(run.measured_steps) == 2


def test_watch_times_any_iterable_and_counts_samples():
    def gen():
        for i in range(100):
            time.sleep(0.004)
            yield {"x": torch.zeros(3, 2), "i": i}

    with tp.profile(steps=3, warmup=0, progress=False) as prof:
        for batch in tp.watch(gen()):
            tp.step()
    run = prof.run
    assert (run.steps["samples"] == 3).all()
    assert (run.steps["data_wait_s"] >= 0.0035).all()
    assert list(tp.watch([1, 2, 3])) == [1, 2, 3]  # free and transparent outside a slice


def test_h2d_is_a_move_off_the_host():
    with tp.profile(steps=2, warmup=0, progress=False) as prof:
        x = torch.ones(1000)
        while True:
            x.to(torch.float64)       # a dtype change on the host: not h2d
            x.to("cpu")               # a no-op: not h2d
            x.to("meta")              # leaves the host
            x.to(device="meta", dtype=torch.float16)
            tp.step()
    spans = prof.run.spans
    h2d = spans[spans["phase"] == "h2d"]
    assert len(h2d) == 4 and set(h2d["source"]) == {"Tensor.to"}


def test_nested_profile_is_refused_and_outer_survives():
    with tp.profile(steps=1, warmup=0, progress=False) as outer:
        with pytest.raises(tp.ProfileActiveError, match="already running"):
            with tp.profile(steps=1, progress=False):
                pass
        tp.step()
    assert len(outer.run.steps) == 1


def test_bad_config_is_refused():
    with pytest.raises(tp.TpkitError, match="steps must be"):
        tp.profile(steps=0)
    with pytest.raises(tp.TpkitError, match="warmup must be"):
        tp.profile(warmup="soon")
    with pytest.raises(tp.TpkitError, match="clock_hz"):
        tp.profile(clock_hz=500)
    with pytest.raises(tp.TpkitError, match="non-empty name"):
        tp.phase("")


def test_phase_and_step_are_free_outside_a_slice():
    with tp.phase("x"):
        tp.step()
    assert tp.capture.recorder.active() is None


def test_forward_inside_data_loading_is_not_forward():
    """A module used as a transform in the main-process loader belongs to data_wait."""
    norm = torch.nn.LayerNorm(4)

    class DS(torch.utils.data.Dataset):
        def __len__(self):
            return 100

        def __getitem__(self, i):
            return norm(torch.ones(4)).detach()

    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tp.profile(steps=2, warmup=0, progress=False) as prof:
        for b in torch.utils.data.DataLoader(DS(), batch_size=5):
            model(b).sum().backward()
            opt.step()
    fwd = prof.run.spans[prof.run.spans["phase"] == "forward"]
    assert len(fwd) == 2 and set(fwd["source"]) == {"Linear"}


def test_collector_pauses_are_gc_spans_and_the_callback_is_removed():
    import gc

    before = list(gc.callbacks)
    junk = []

    def step():
        junk.extend([[i] for i in range(50_000)])
        gc.collect()  # a full collection over ~50k containers takes well over 1 ms

    run = tp.profile_fn(step, steps=2, warmup=0, progress=False, memory=False, clock_hz=0)
    gcs = run.spans[run.spans["phase"] == "gc"]
    assert set(gcs["step"]) == {0, 1} and (gcs["duration_s"] >= 0.001).all()
    assert gcs["source"].str.startswith("gc gen").all()
    assert gc.callbacks == before
