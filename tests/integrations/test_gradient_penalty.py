"""``torch.autograd.grad`` in a training step.

A WGAN-GP critic differentiates its output with respect to its input (``create_graph=True``)
to build a gradient penalty, then backpropagates the loss. That first pass is a backward pass
too: it had fallen to ``other`` (the verdict then read OVERHEAD-BOUND, "Python between
phases"). Called inside a module's forward (a physics-informed model differentiating its
output), it stays the forward's time.

Truth: the loop's own clocks around each part, and the losses it computed.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch
import truth
from truth import STEPS, TOLERANCE, WARMUP

import tpkit as tp

N = STEPS + WARMUP


def test_a_gradient_penalty_pass_is_backward_time():
    torch.manual_seed(0)
    critic = truth.SleepyNet()
    opt = truth.SleepySGD(critic.parameters(), lr=0.01)
    clock: dict[str, float] = defaultdict(float)
    losses = []
    with tp.profile(steps=STEPS, warmup=WARMUP, name="wgan-gp", progress=False, clock_hz=0) as prof:
        for _ in range(N + 1):
            real, fake = torch.randn(8, 8), torch.randn(8, 8)
            alpha = torch.rand(8, 1)
            mixed = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
            t = time.perf_counter()
            score = critic(fake).mean() - critic(real).mean()
            out = critic(mixed)
            clock["forward"] += time.perf_counter() - t
            t = time.perf_counter()
            grad, = torch.autograd.grad(out.sum(), mixed, create_graph=True)  # through the sleepy node
            clock["penalty"] += time.perf_counter() - t
            loss = score + 10 * ((grad.norm(2, dim=1) - 1) ** 2).mean()
            t = time.perf_counter()
            loss.backward()
            clock["backward"] += time.perf_counter() - t
            losses.append(loss.item())
            opt.step()  # the slice ends inside the last
            opt.zero_grad()
    run = prof.run
    assert len(run.steps) == N
    truth.assert_losses(run.steps["loss"].tolist(), losses[:N])  # the penalty's pass adds no loss
    backward = float(run.steps["backward_s"].sum())
    want = clock["penalty"] + clock["backward"]
    assert abs(backward - want) <= TOLERANCE * want
    assert float(run.steps["other_s"].sum()) < 0.2 * clock["penalty"]
    assert any(n.startswith(f"torch.autograd.grad ran {N} time(s) outside the forward") for n in run.meta["notes"])


class Differentiating(torch.nn.Module):
    """A physics-informed model: its output's derivative with respect to its input is part of
    its forward."""

    def __init__(self) -> None:
        super().__init__()
        self.net = truth.SleepyNet()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.requires_grad_(True)
        u = self.net(x)
        du, = torch.autograd.grad(u.sum(), x, create_graph=True)
        return u + du.sum(dim=1, keepdim=True)


def test_autograd_grad_inside_a_forward_stays_the_forward():
    torch.manual_seed(0)
    model = Differentiating()
    opt = truth.SleepySGD(model.parameters(), lr=0.01)
    clock: dict[str, float] = defaultdict(float)
    with tp.profile(steps=STEPS, warmup=WARMUP, name="pinn", progress=False, clock_hz=0) as prof:
        for _ in range(N + 1):
            x, y = torch.randn(8, 8), torch.randn(8, 1)
            t = time.perf_counter()
            loss = ((model(x) - y) ** 2).mean()
            clock["forward"] += time.perf_counter() - t
            t = time.perf_counter()
            loss.backward()
            clock["backward"] += time.perf_counter() - t
            opt.step()
            opt.zero_grad()
    run = prof.run
    for phase in ("forward", "backward"):
        got = float(run.steps[f"{phase}_s"].sum())
        assert abs(got - clock[phase]) <= TOLERANCE * clock[phase], (phase, got, clock[phase])
    assert not any("torch.autograd.grad" in n for n in run.meta["notes"])


def test_autograd_grad_inside_an_evaluation_stays_the_evaluations():
    """Saliency in an evaluation (``tp.phase("eval")`` here, a trainer's ``evaluate()`` alike):
    its gradient passes are the evaluation's time, not the step's backward."""
    torch.manual_seed(0)
    model = truth.SleepyNet()
    opt = truth.SleepySGD(model.parameters(), lr=0.01)
    clock: dict[str, float] = defaultdict(float)
    with tp.profile(steps=STEPS, warmup=WARMUP, name="saliency", progress=False, clock_hz=0) as prof:
        for _ in range(N + 1):
            ((model(torch.randn(8, 8)) - torch.randn(8, 1)) ** 2).mean().backward()
            opt.step()
            opt.zero_grad()
            with tp.phase("eval"):
                x = torch.randn(8, 8, requires_grad=True)
                t = time.perf_counter()
                torch.autograd.grad(model(x).sum(), x)  # through the sleepy node
                clock["eval"] += time.perf_counter() - t
    run = prof.run
    assert not any("torch.autograd.grad" in n for n in run.meta["notes"])
    assert float(run.steps["backward_s"].sum()) < (N + 1) * truth.BACKWARD_S * (1 + TOLERANCE)
    assert float(run.steps["eval_s"].sum()) >= (N - 1) * truth.BACKWARD_S


def test_a_functional_loop_with_only_autograd_grad_says_why_its_loss_is_nan():
    """A functional loop (``torch.func.functional_call``, the gradients taken with
    ``torch.autograd.grad``, the update by hand, ``tp.step()`` at each end): no ``backward()``
    runs, so no loss reaches tpkit. Its loss column was NaN in every step with only "the loss is
    still only what went through backward()" to go on. Truth: the loop's own clock around its
    gradient passes."""
    torch.manual_seed(0)
    model = truth.SleepyNet()
    params = {k: v.detach().requires_grad_(True) for k, v in model.named_parameters()}
    clock = 0.0
    with tp.profile(steps=STEPS, warmup=WARMUP, name="functional", progress=False, clock_hz=0) as prof:
        for _ in range(N):
            x, y = torch.randn(8, 8), torch.randn(8, 1)
            loss = torch.nn.functional.mse_loss(torch.func.functional_call(model, params, (x,)), y)
            t = time.perf_counter()
            grads = torch.autograd.grad(loss, list(params.values()))
            clock += time.perf_counter() - t
            with torch.no_grad():
                for p, g in zip(params.values(), grads):
                    p -= 0.01 * g
            tp.step()
    run = prof.run
    assert len(run.steps) == N and run.steps["loss"].isna().all()
    assert abs(float(run.steps["backward_s"].sum()) - clock) <= TOLERANCE * clock
    said = [n for n in run.meta["notes"] if n.startswith(f"torch.autograd.grad ran {N} time(s)")]
    assert said and "backward() never ran" in said[0] and "NaN in every step" in said[0], run.meta["notes"]
