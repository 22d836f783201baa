"""A tracker's hooks on the trained model (``wandb.watch(model, log="all", log_freq=1)``: a forward
hook logging every parameter, a gradient hook on every parameter) run inside the forward and
backward: their time is those phases', and the run says whose hooks they are. Without a word a
watched model read COMPUTE-BOUND "forward+backward 83%" where the hooks were nine tenths of it.

The tracker here is a package the test writes and installs on ``sys.path`` (a module and its
distribution's metadata, as pip leaves them): its hooks sleep known times. Truth: those sleeps,
and which hooks are whose (the user's own hook, defined in this file, is none of the tracker's).
"""

from __future__ import annotations

import sys
import textwrap

import torch
import torch.nn.functional as F
import truth
from truth import STEPS, TOLERANCE, WARMUP

import tpkit as tp
from tpkit.schema import hooks_remedy

FORWARD_HOOK_S, GRAD_HOOK_S = 0.040, 0.020

TRACKER = textwrap.dedent(f"""
    import time

    def watch(model):
        '''A forward hook on the model, a gradient hook on each parameter: {FORWARD_HOOK_S} s, {GRAD_HOOK_S} s.'''
        model.register_forward_hook(lambda module, args, out: time.sleep({FORWARD_HOOK_S}))
        for p in model.parameters():
            p.register_hook(lambda grad: time.sleep({GRAD_HOOK_S}))
""")


def install_tracker(tmp_path, monkeypatch) -> object:  # noqa: ANN001
    """``hooktrack``, installed as pip would (its distribution's metadata beside it), imported."""
    (tmp_path / "hooktrack").mkdir()
    (tmp_path / "hooktrack" / "__init__.py").write_text(TRACKER)
    dist = tmp_path / "hooktrack-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: hooktrack\nVersion: 1.0\n")
    (dist / "top_level.txt").write_text("hooktrack\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "hooktrack", raising=False)
    import hooktrack

    return hooktrack


def train(watch: object | None) -> tp.Run:
    """A loop of SleepyNet (forward 30 ms, backward 20 ms) on batches held in memory, plain SGD,
    a user's own forward pre-hook counting calls; ``watch``: the tracker's ``watch``, or None."""
    torch.manual_seed(0)
    model = truth.SleepyNet()
    calls = [0]
    model.register_forward_pre_hook(lambda module, args: calls.__setitem__(0, calls[0] + 1))  # the user's own
    if watch is not None:
        watch(model)  # type: ignore[operator]
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [(torch.randn(8, 8), torch.randn(8, 1)) for _ in range(STEPS + WARMUP)]
    with tp.profile(steps=STEPS, warmup=WARMUP, name="watched" if watch else "plain", progress=False,
                    clock_hz=0) as prof:
        for x, y in batches:
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    assert calls[0] == STEPS + WARMUP
    return prof.run


def test_a_trackers_hooks_are_named_in_the_notes_and_the_verdict(tmp_path, monkeypatch):
    tracker = install_tracker(tmp_path, monkeypatch)
    run = train(tracker.watch)
    m = run.steps[~run.steps["warmup"]]
    # the phases hold the hooks (as they should: they run inside them) ...
    assert float(m["forward_s"].median()) >= (1 - TOLERANCE) * (truth.FORWARD_S + FORWARD_HOOK_S)
    assert float(m["backward_s"].median()) >= (1 - TOLERANCE) * (truth.BACKWARD_S + 2 * GRAD_HOOK_S)
    # ... and the run says whose they are: one forward hook and two gradient hooks, the user's not
    assert run.meta["model"]["hooks"] == {"hooktrack": 3}
    note = next(n for n in run.meta["notes"] if n.startswith("3 hook(s) of hooktrack on the model"))
    assert "their time is inside forward_s and backward_s" in note, note
    verdict = run.summary().verdict
    assert verdict.kind == "compute-bound", verdict.text
    assert verdict.advice.startswith("3 hook(s) of hooktrack on the model run inside forward and backward: "
                                     "register them less often, or remove them"), verdict.advice


def test_the_users_own_hooks_are_not_a_trackers():
    run = train(None)
    assert "hooks" not in run.meta["model"]
    assert not any("hook(s) of" in n for n in run.meta["notes"]), run.meta["notes"]
    assert "hook" not in run.summary().verdict.advice


def test_a_wandb_hook_gets_wandbs_remedy():
    """The advice for wandb's own hooks names its knobs (schema.HOOK_REMEDIES)."""
    advice = hooks_remedy({"wandb": 7})
    assert "wandb.watch(model, log_freq=100)" in advice and "wandb.unwatch(model)" in advice
