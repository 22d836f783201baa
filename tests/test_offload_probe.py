"""The offload probe looks for DeepSpeed at each phase of a slice's first step only: an engine
module imported inside the profiled cell, before the loop, still has its step and backward
wrapped; after the first step the probe adds nothing to the loop's boundaries (no listener call,
no ``tpkit`` span), and a DeepSpeed first imported later is named in the run's notes. DeepSpeed itself is stood in for by a module of the same name."""

from __future__ import annotations

import sys
import types

import torch

import tpkit as tp

ENGINE_MODULE = "deepspeed.runtime.engine"


def _fake_deepspeed(monkeypatch) -> type:
    """Puts a ``deepspeed.runtime.engine`` with a ``DeepSpeedEngine`` into ``sys.modules``."""

    class DeepSpeedEngine:
        def step(self):  # pragma: no cover - only its identity is looked at
            pass

        def backward(self, loss):  # pragma: no cover
            pass

    mod = types.ModuleType(ENGINE_MODULE)
    mod.DeepSpeedEngine = DeepSpeedEngine
    monkeypatch.setitem(sys.modules, ENGINE_MODULE, mod)
    return DeepSpeedEngine


def _loop(steps: int, before_step=None) -> tp.profile:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tp.profile(steps=steps, warmup=0, memory=False, clock_hz=0, progress=False) as prof:
        for i in range(steps):
            if before_step is not None:
                before_step(i)
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
    return prof


def _import_at(step: int, monkeypatch, seen: dict):
    """A ``before_step`` that imports the stand-in engine module before loop step ``step`` and,
    before the next one, notes whether the probe has wrapped its ``step`` (``seen["wrapped"]``)."""

    def before_step(i):
        if i == step:
            cls = _fake_deepspeed(monkeypatch)
            seen["cls"], seen["step"] = cls, cls.__dict__["step"]
        elif i == step + 1:
            seen["wrapped"] = seen["cls"].__dict__["step"] is not seen["step"]

    return before_step


def test_deepspeed_imported_before_the_first_step_is_wrapped_and_put_back(monkeypatch):
    monkeypatch.delitem(sys.modules, ENGINE_MODULE, raising=False)
    seen: dict = {}
    _loop(3, _import_at(0, monkeypatch, seen))
    assert seen["wrapped"]
    assert seen["cls"].__dict__["step"] is seen["step"]  # the slice put it back


def test_after_the_first_step_the_probe_adds_nothing_to_the_boundaries(monkeypatch):
    monkeypatch.delitem(sys.modules, ENGINE_MODULE, raising=False)
    seen: dict = {}
    prof = _loop(5, _import_at(2, monkeypatch, seen))
    spans = prof.run.spans
    own = spans[(spans["phase"] == "tpkit")]
    assert set(own["step"]) <= {0}  # the first step's looks, none after (phases only: no other listener)
    assert (own["step"] == 0).sum() >= 4
    assert not seen["wrapped"]  # an engine module first imported after the loop's first step is not looked for
    assert (prof.run.steps["tpkit_s"].iloc[1:] == 0).all()
    assert any("DeepSpeed was first imported after the slice's first step" in n for n in prof.run.meta["notes"])


def test_a_slice_that_never_meets_deepspeed_says_nothing_about_it(monkeypatch):
    monkeypatch.delitem(sys.modules, ENGINE_MODULE, raising=False)
    assert not any("DeepSpeed" in n for n in _loop(3).run.meta["notes"])
