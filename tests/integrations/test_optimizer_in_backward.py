"""The optimizer stepped inside backward: one optimizer per parameter, stepped and zeroed in a
``register_post_accumulate_grad_hook`` hook (PyTorch's recipe that frees each gradient as soon
as it is used); the loop calls only ``loss.backward()``.

Truth: the known sleeps of ``truth.SleepyNet``-style forward/backward and ``truth.SleepySGD``,
the loop's own ``loss.item()``, and the same loop run without tpkit for as many iterations.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
import truth
from truth import STEPS, WARMUP

import tpkit as tp


class Net(torch.nn.Module):
    """(B, 8) -> (B, 1) through two layers; forward and backward sleep their known times."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with truth.timed("forward"):
            time.sleep(truth.FORWARD_S)
            return truth.sleep_backward(self.l2(torch.relu(self.l1(x))))


def optimizers_in_backward(model: torch.nn.Module) -> dict:
    """Each parameter's own SleepySGD, stepped and zeroed as its gradient is ready."""
    opts = {p: truth.SleepySGD([p], lr=0.01) for p in model.parameters()}

    def hook(p: torch.Tensor) -> None:
        opts[p].step()
        opts[p].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)
    return opts


def make() -> tuple:
    torch.manual_seed(0)
    model = Net()
    optimizers_in_backward(model)
    return model, torch.utils.data.DataLoader(truth.Regression(), batch_size=4, collate_fn=truth.sleepy_collate)


def train(model: Net, loader: torch.utils.data.DataLoader, iterations: int | None, losses: list[float]) -> None:
    for i, (x, y) in enumerate(loader):
        if iterations is not None and i == iterations:
            break
        loss = F.mse_loss(model(x), y)
        losses.append(loss.item())
        loss.backward()


def test_steps_in_backward_end_with_it_and_every_parameter_is_updated():
    """A step ends when the backward its optimizers stepped in returns: every phase is counted
    once (the step had ended at the first parameter's step, inside backward, and the backward
    was charged to one step while its optimizers' time after that went to the next: phases
    summed to 124-129% of the step), and the slice stops after the whole update (it had stopped
    after the first of four parameters' steps: the model matched neither 6 nor 7 iterations)."""
    losses: list[float] = []
    model, loader = make()
    before = truth.hook_state()
    with tp.profile(steps=STEPS, warmup=WARMUP, name="in-backward", progress=False, clock_hz=0) as prof, \
            truth.TRUTH.recording() as known:
        train(model, loader, None, losses)
    run = prof.run
    truth.assert_hooks_removed(before)
    assert len(run.steps) == STEPS + WARMUP == len(losses)
    truth.assert_phases(run, known, ("forward", "optimizer", "data_wait"))
    # the truth's backward runs to the pass's end, the updates in it included
    inside = float(run.steps["backward_s"].sum() + run.steps["optimizer_s"].sum())
    assert inside == pytest.approx(known.seconds["backward"], rel=truth.TOLERANCE)
    phases = run.steps[["data_wait_s", "forward_s", "backward_s", "optimizer_s", "tpkit_s"]].sum(axis=1)
    assert (phases <= run.steps["duration_s"] * 1.001).all()
    truth.assert_losses(run.steps["loss"].tolist(), losses)
    assert (run.steps["samples"] == 4).all()
    alone, alone_loader = make()
    train(alone, alone_loader, STEPS + WARMUP, [])
    for mine, theirs in zip(model.parameters(), alone.parameters()):
        assert torch.equal(mine, theirs)
    assert any("inside backward" in n for n in run.meta["notes"])


def test_a_hook_raising_after_an_update_still_ends_the_step():
    """In iteration 4 the second gradient hook raises after the first parameter's optimizer
    stepped; the loop catches it and goes on: that iteration is a step of its own (the pending
    step had held two iterations: 7 steps for 8), and the loop's exception is what it caught."""
    model, loader = make()
    calls, caught = [0], []

    def boom(_p: torch.Tensor) -> None:
        calls[0] += 1
        if calls[0] == 4:
            raise RuntimeError("hook failed")

    model.l1.weight.register_post_accumulate_grad_hook(boom)  # after l2's parameters (the lead) stepped
    with tp.profile(steps=STEPS, warmup=WARMUP, name="in-backward-raise", progress=False, clock_hz=0) as prof:
        for x, y in loader:
            loss = F.mse_loss(model(x), y)
            try:
                loss.backward()
            except RuntimeError as e:
                caught.append(str(e))
    run = prof.run
    assert caught == ["hook failed"] and calls[0] == STEPS + WARMUP
    assert len(run.steps) == STEPS + WARMUP and (run.steps["samples"] == 4).all()
    assert (run.steps["forward_s"] < 1.5 * truth.FORWARD_S).all()  # one forward a step
