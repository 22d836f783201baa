"""Two backward passes in a step with ``zero_grad()`` between them.

SAM (sharpness-aware minimization) runs forward and backward twice on each batch: the first
pass's gradients only find where to perturb the weights, ``zero_grad()`` throws them away, and
the second pass's gradients make the update. Its loss, as SAM loops log it, is the first
pass's; tpkit had reported the sum of both (2.1x) with no word. With two optimizers (a GAN),
one optimizer's ``zero_grad()`` throws away nothing of the other's: the step's loss stays
everything backpropagated since the previous step, as the run's note says.

Truth: the losses the loop itself computed, and its clocks.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch
import torch.nn.functional as F
import truth
from truth import STEPS, TOLERANCE, WARMUP

import tpkit as tp

N = STEPS + WARMUP


def test_sam_steps_report_the_first_pass_loss():
    torch.manual_seed(0)
    model = truth.SleepyNet()
    opt = truth.SleepySGD(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(truth.Regression(), batch_size=8, collate_fn=truth.sleepy_collate)
    first, second = [], []
    clock: dict[str, float] = defaultdict(float)
    with tp.profile(steps=STEPS, warmup=WARMUP, name="sam", progress=False, clock_hz=0) as prof:
        for x, y in loader:
            loss = F.mse_loss(model(x), y)
            t = time.perf_counter()
            loss.backward()
            clock["backward"] += time.perf_counter() - t
            first.append(loss.item())
            with torch.no_grad():  # climb to the worst nearby weights
                eps = [0.05 * p.grad / (p.grad.norm() + 1e-12) for p in model.parameters()]
                for p, e in zip(model.parameters(), eps):
                    p.add_(e)
            opt.zero_grad()
            loss2 = F.mse_loss(model(x), y)
            t = time.perf_counter()
            loss2.backward()
            clock["backward"] += time.perf_counter() - t
            second.append(loss2.item())
            with torch.no_grad():
                for p, e in zip(model.parameters(), eps):
                    p.sub_(e)
            opt.step()  # the slice ends inside the last
            opt.zero_grad()
    run = prof.run
    assert len(run.steps) == N
    truth.assert_losses(run.steps["loss"].tolist(), first[:N])
    assert all(abs(a - b) > 0.01 for a, b in zip(first, second))  # the two passes are told apart
    backward = float(run.steps["backward_s"].sum())
    assert abs(backward - clock["backward"]) <= TOLERANCE * clock["backward"]  # both passes' backward
    assert any(n.startswith(f"{N} step(s) backpropagated again after zero_grad()") for n in run.meta["notes"])


def test_two_optimizers_keep_every_loss_since_the_previous_step():
    """A GAN-like pair: D's optimizer steps first (it ends the steps), then G's. A step holds G's
    loss of the iteration before, then D's: D's ``zero_grad()`` between them discards nothing."""
    torch.manual_seed(0)
    g, d = torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)
    opt_g, opt_d = torch.optim.SGD(g.parameters(), lr=0.01), torch.optim.SGD(d.parameters(), lr=0.01)
    d_losses, g_losses = [], []
    with tp.profile(steps=STEPS, warmup=WARMUP, name="gan", progress=False, clock_hz=0) as prof:
        for _ in range(N + 1):
            z, real = torch.randn(16, 4), torch.randn(16, 8)
            opt_d.zero_grad()
            loss_d = F.softplus(-d(real)).mean() + F.softplus(d(g(z).detach())).mean()
            loss_d.backward()
            d_losses.append(loss_d.item())
            opt_d.step()  # the lead optimizer: the slice ends inside the last
            opt_g.zero_grad()
            loss_g = F.softplus(-d(g(z))).mean()
            loss_g.backward()
            g_losses.append(loss_g.item())
            opt_g.step()
    want = [d_losses[0]] + [g_losses[k - 1] + d_losses[k] for k in range(1, N)]
    run = prof.run
    truth.assert_losses(run.steps["loss"].tolist(), want)
    assert not any("zero_grad()" in n for n in run.meta["notes"])
    assert any(n.startswith("2 optimizers stepped") for n in run.meta["notes"])
