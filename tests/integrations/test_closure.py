"""An optimizer that evaluates a closure several times per step (``torch.optim.LBFGS``):
the work inside ``optimizer.step(closure)`` is forward and backward as it happens; the
step's loss is the one ``step`` returns (the closure's first evaluation).

Truth: the self-timed forward and backward of ``truth.SleepyNet``, the closure's call count,
the losses ``step`` returned.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import truth
from truth import STEPS, WARMUP

import tpkit as tp


def test_lbfgs_closure_is_forward_and_backward():
    torch.manual_seed(0)
    model = truth.SleepyNet()
    opt = torch.optim.LBFGS(model.parameters(), max_iter=3)
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    calls, returned = [0], []

    def closure() -> torch.Tensor:
        calls[0] += 1
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        return loss

    before = truth.hook_state()
    with tp.profile(steps=STEPS, warmup=WARMUP, name="lbfgs", progress=False, clock_hz=0) as prof, \
            truth.TRUTH.recording() as known:
        for _ in range(100):
            returned.append(float(opt.step(closure)))
    run = prof.run
    truth.assert_hooks_removed(before)
    # a plain loop stops inside the 7th step() (after its update): 6 returned values
    assert len(run.steps) == STEPS + WARMUP == len(returned)  # the last step() returns: the next one stops
    assert calls[0] > len(returned) and known.calls["forward"] == calls[0]  # several evaluations per step
    truth.assert_phases(run, known, phases=("forward", "backward"))
    assert run.steps["optimizer_s"].sum() < 0.5 * run.steps["forward_s"].sum()  # LBFGS' own work is small
    truth.assert_losses(run.steps["loss"].tolist(), returned)
