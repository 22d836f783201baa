"""Weight averaging each step: an EMA copy of the model (``torch.optim.swa_utils.AveragedModel``)
updated after the optimizer's step. Its time is the update's, ``optimizer``: it had been ``other``,
and a loop averaging every step read OVERHEAD-BOUND ("Python between phases, logging, .item()
syncs") with nothing of the kind in it.

Truth: the loop's own clock around ``update_parameters``, and the optimizer's own work.
"""

from __future__ import annotations

import sys
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


EMA_MODULE = '''
import sys
import time
import torch


class EMA:
    """An EMA copy of a model as other libraries write theirs (diffusers' EMAModel, timm's ModelEma):
    a class of their own, not torch's AveragedModel."""

    def __init__(self, model):
        self.shadow = [p.detach().clone() for p in model.parameters()]

    def update(self, model):
        time.sleep({sleep})
        with torch.no_grad():
            for s, p in zip(self.shadow, model.parameters()):
                s.mul_(0.99).add_(p.detach(), alpha=0.01)
'''


def test_an_ema_class_imported_inside_the_slice_is_optimizer_time_from_the_next_step(tmp_path, monkeypatch):
    """An averaging class listed in ``AVERAGERS`` by its import path (as diffusers' ``EMAModel.step``
    and timm's ``ModelEma*.update`` are) whose module the loop imports inside the slice, in its
    training function: its updates are the optimizer's from the end of the step it was imported in,
    as the loop's clock around them says. Only a module imported before the slice had been patched:
    diffusers' EMAModel imported so had read other, OVERHEAD-BOUND with advice to log less often."""
    from tpkit.capture.probes import phases

    (tmp_path / "tp_late_ema.py").write_text(EMA_MODULE.format(sleep=AVERAGE_S))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "tp_late_ema", raising=False)
    monkeypatch.setattr(phases, "AVERAGERS", (*phases.AVERAGERS, ("tp_late_ema", "EMA", "update")))
    torch.manual_seed(0)
    model = truth.SleepyNet()
    opt = truth.SleepySGD(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(truth.Regression(), batch_size=8, collate_fn=truth.sleepy_collate)
    averaging = []
    before = truth.hook_state()
    with tp.profile(steps=STEPS, warmup=WARMUP, name="late-ema", progress=False, clock_hz=0) as prof, \
            truth.TRUTH.recording():
        from tp_late_ema import EMA  # noqa: PLC0415 - imported inside the slice, as the loop does

        ema = EMA(model)
        for x, y in loader:
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            t = time.perf_counter()
            ema.update(model)
            averaging.append(time.perf_counter() - t)
    run = prof.run
    seen = truth.snapshot()
    truth.assert_hooks_removed(before)
    assert not hasattr(vars(EMA)["update"], "__wrapped__")  # put back
    assert len(averaging) == N and len(run.steps) == N
    # the first update (after step 1's end, where the module was found) is step 2's, and so on; the
    # last one's after the slice's last step
    optimizer = float(run.steps["optimizer_s"].sum())
    want = seen.seconds["optimizer"] + sum(averaging[:-1])
    assert abs(optimizer - want) <= TOLERANCE * want, (optimizer, want)
    assert float(run.steps["other_s"].iloc[1:].sum()) < AVERAGE_S
    assert run.summary().verdict.kind != "overhead-bound"
    sources = run.spans[run.spans["phase"] == "optimizer"]["source"]
    assert (sources == "EMA.update").sum() == N - 1


def test_other_libraries_averaging_and_clipping_are_listed_by_import_path():
    """diffusers' and timm's EMA updates, and timm's adaptive gradient clipping (every name timm's
    ``dispatch_clip_grad`` and a loop reach it by), are optimizer time where the loop uses them: each
    listed where it lives, and, where the library is installed, a function of that very place (the
    probe patches only an owner's own attribute)."""
    import importlib

    from tpkit.capture.probes.hook_places import AVERAGERS

    want = [("diffusers.training_utils", "EMAModel", "step"),
            ("timm.utils.model_ema", "ModelEma", "update"),
            ("timm.utils.model_ema", "ModelEmaV2", "update"),
            ("timm.utils.model_ema", "ModelEmaV3", "update"),
            ("timm.utils.agc", "", "adaptive_clip_grad"),
            ("timm.utils.clip_grad", "", "adaptive_clip_grad"),
            ("timm.utils", "", "adaptive_clip_grad")]
    assert [p for p in want if p in AVERAGERS] == want
    for module, owner, attr in want:
        try:
            mod = importlib.import_module(module)
        except Exception:  # noqa: BLE001 - not installed here (CI), or broken (diffusers raises RuntimeError)
            continue  # the place is only listed
        target = getattr(mod, owner) if owner else mod
        assert callable(vars(target).get(attr)), (module, owner, attr)
