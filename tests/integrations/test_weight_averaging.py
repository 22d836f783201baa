"""Weight averaging each step: an EMA copy of the model (``torch.optim.swa_utils.AveragedModel``)
updated after the optimizer's step. Its time is the update's, ``optimizer``: it had been ``other``,
and a loop averaging every step read OVERHEAD-BOUND ("Python between phases, logging, .item()
syncs") with nothing of the kind in it.

Truth: the loop's own clock around ``update_parameters``, and the optimizer's own work.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
import truth
from truth import STEPS, TOLERANCE, WARMUP

import tpkit as tp

N = STEPS + WARMUP
AVERAGE_S = 0.025


def slow_ema(averaged: torch.Tensor, current: torch.Tensor, _num_averaged: torch.Tensor) -> torch.Tensor:
    time.sleep(AVERAGE_S / 2)  # two parameter tensors: AVERAGE_S an update
    return 0.99 * averaged + 0.01 * current


def test_an_ema_update_after_each_step_is_optimizer_time():
    torch.manual_seed(0)
    model = truth.SleepyNet()
    ema = torch.optim.swa_utils.AveragedModel(model, avg_fn=slow_ema)
    opt = truth.SleepySGD(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(truth.Regression(), batch_size=8, collate_fn=truth.sleepy_collate)
    averaging = []
    before = truth.hook_state()
    with tp.profile(steps=STEPS, warmup=WARMUP, name="ema", progress=False, clock_hz=0) as prof, \
            truth.TRUTH.recording():
        for x, y in loader:
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            t = time.perf_counter()
            ema.update_parameters(model)
            averaging.append(time.perf_counter() - t)
    run = prof.run
    seen = truth.snapshot()
    truth.assert_hooks_removed(before)
    # every iteration's update ran, the last one's too (after the slice's last step, where the
    # loop stops at its next batch): the N - 1 before it are in the slice, each after its step
    optimizer = float(run.steps["optimizer_s"].sum())
    want = seen.seconds["optimizer"] + sum(averaging[:-1])
    assert abs(optimizer - want) <= TOLERANCE * want, (optimizer, want)
    assert float(run.steps["other_s"].iloc[1:].sum()) < AVERAGE_S
    assert run.summary().verdict.kind != "overhead-bound"
    assert int(ema.n_averaged) == len(averaging) == N
