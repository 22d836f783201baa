"""Mixed precision on the CPU: ``torch.amp.GradScaler("cpu")`` (works in torch 2.13) and bf16
autocast, in a plain loop.

Truth: the loop's own loss (before scaling), which iterations the scaler skipped (its scale
drops when it finds inf/NaN gradients), the self-timed parts of ``truth``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import truth
from truth import STEPS, WARMUP

import tpkit as tp

BATCH = 4
INF_AT = 3  # the iteration (1-based) whose gradients are made infinite


def scaler_loop(inject_inf: bool) -> dict:
    torch.manual_seed(0)
    model = truth.SleepyNet()
    opt = truth.SleepySGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    loader = torch.utils.data.DataLoader(truth.Regression(), batch_size=BATCH, collate_fn=truth.sleepy_collate)
    losses, skipped = [], []
    before = truth.hook_state()
    with tp.profile(steps=STEPS, warmup=WARMUP, name="gradscaler", progress=False, clock_hz=0) as prof, \
            truth.TRUTH.recording():
        for i, (x, y) in enumerate(loader, start=1):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.mse_loss(model(x).float(), y)
            losses.append(loss.item())
            scaled = scaler.scale(loss)
            if inject_inf and i == INF_AT:
                scaled = scaled * float("inf")
            scaled.backward()
            scale = scaler.get_scale()
            skipped.append(False)  # until the step below returns: a stop inside it means it stepped
            scaler.step(opt)
            scaler.update()
            skipped[-1] = scaler.get_scale() < scale
            opt.zero_grad()
    return dict(run=prof.run, before=before, losses=losses, skipped=skipped, truth=truth.snapshot(),
                scale=scaler.get_scale())


@pytest.fixture(scope="module")
def clean():
    return scaler_loop(inject_inf=False)


def test_gradscaler_slice_runs_and_hooks_are_removed(clean):
    run = clean["run"]
    truth.assert_hooks_removed(clean["before"])
    assert clean["scale"] == 65536.0  # really scaled, nothing skipped
    assert len(run.steps) == STEPS + WARMUP == len(clean["losses"]) and run.complete
    truth.assert_phases(run, clean["truth"])


def test_gradscaler_loss_is_unscaled(clean):
    truth.assert_losses(clean["run"].steps["loss"].tolist(), clean["losses"])


def test_gradscaler_skipped_step_is_a_marked_step():
    out = scaler_loop(inject_inf=True)
    run = out["run"]
    truth.assert_hooks_removed(out["before"])
    assert out["skipped"][:STEPS + WARMUP] == [i + 1 == INF_AT for i in range(STEPS + WARMUP)]  # the truth
    assert len(run.steps) == len(out["losses"]) == STEPS + WARMUP
    assert run.steps["skipped"].tolist() == out["skipped"]
    assert "skipped" in run.summary().to_text()


def test_bf16_autocast_loss_and_phases():
    """bf16 autocast on the CPU, no scaler: the loss and phases are the loop's."""
    torch.manual_seed(0)
    model = truth.SleepyNet()
    opt = truth.SleepySGD(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(truth.Regression(), batch_size=BATCH, collate_fn=truth.sleepy_collate)
    losses = []
    before = truth.hook_state()
    with tp.profile(steps=STEPS, warmup=WARMUP, name="bf16", progress=False, clock_hz=0) as prof, \
            truth.TRUTH.recording() as known:
        for x, y in loader:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
                assert out.dtype == torch.bfloat16
                loss = F.mse_loss(out, y.to(torch.bfloat16))
            losses.append(loss.item())
            loss.backward()
            opt.step()
            opt.zero_grad()
    run = prof.run
    truth.assert_hooks_removed(before)
    assert len(run.steps) == STEPS + WARMUP
    truth.assert_losses(run.steps["loss"].tolist(), losses)
    truth.assert_phases(run, known)


def test_a_static_loss_scale_by_hand_is_taken_out():
    """``(loss * 1024).backward()`` with the gradients divided before the step (a static loss
    scale, as apex's or older fp16 recipes): the loss recorded is the loop's, not 1024x (it had
    read 1642.7 for 1.6042, with no word), and the run says what it took out. A weight of the loss
    (``* 0.5``) and an accumulation divisor (``/ 2``) are left as they are."""
    torch.manual_seed(0)
    model = truth.SleepyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(truth.Regression(), batch_size=8)
    logged = []
    N = STEPS + WARMUP
    with tp.profile(steps=STEPS, warmup=WARMUP, name="static-scale", progress=False, clock_hz=0) as prof:
        for x, y in loader:
            loss = F.mse_loss(model(x), y)
            (loss * 1024).backward()
            for p in model.parameters():
                p.grad /= 1024
            logged.append(loss.item())
            opt.step()
            opt.zero_grad()
    truth.assert_losses(prof.run.steps["loss"].tolist(), logged[:N])
    assert any(n.startswith(f"{N} loss(es) went through backward multiplied by 1024") for n in prof.run.meta["notes"])
    from tpkit.capture.probes.loss_sums import static_scale

    w = torch.ones(2, requires_grad=True)
    assert [static_scale(w.sum() * k) for k in (0.5, 100.0, 128.0, 65536.0)] == [0.0, 0.0, 128.0, 65536.0]
    assert static_scale(w.sum() / 2) == 0.0
