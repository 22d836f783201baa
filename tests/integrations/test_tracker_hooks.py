"""A tracker's hooks on the trained model (``wandb.watch(model, log="all", log_freq=1)``: a forward
hook logging every parameter, a gradient hook on every parameter) run inside the forward and
backward: their time is those phases', and the run says whose hooks they are. Without a word a
watched model read COMPUTE-BOUND "forward+backward 83%" where the hooks were nine tenths of it.

Only a known tracker's hooks (``schema.TRACKERS``) are called so and get advice, as often as they
log: ``wandb.watch``'s default (every 1000th call) costs nothing measurable and had been told to log
"less often" with ``log_freq=100``; a ZeRO-style parameter gather (ColossalAI's) or a user's own
installed package had been "a tracker's", told to be removed.

The packages here are written by the test and installed on ``sys.path`` (a module and its
distribution's metadata, as pip leaves them): their hooks sleep known times. ``wandb`` is a stand-in
keeping its watch's ``[count, log_freq]`` in its hooks' closures, as wandb's own
(``wandb/integration/torch/wandb_torch.py``) does. Truth: those sleeps, the log_freq given, and
which hooks are whose (the user's own hook, defined in this file, is none of the packages').
"""

from __future__ import annotations

import importlib.metadata
import sys
import textwrap
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import truth
from truth import STEPS, TOLERANCE, WARMUP

import tpkit as tp
from tpkit.schema import hooks_remedy

FORWARD_HOOK_S, GRAD_HOOK_S = 0.040, 0.020

#: A package whose hooks are no tracker's (a parameter gather around each forward, as ZeRO's).
GATHER = textwrap.dedent(f"""
    import time

    def wrap(model):
        # a forward hook on the model, a gradient hook on each parameter: {FORWARD_HOOK_S} s, {GRAD_HOOK_S} s
        model.register_forward_hook(lambda module, args, out: time.sleep({FORWARD_HOOK_S}))
        for p in model.parameters():
            p.register_hook(lambda grad: time.sleep({GRAD_HOOK_S}))
""")

#: wandb's watch as wandb keeps it: each hook's closure holds ``[count, log_freq]``, and it logs
#: (here: sleeps) at each log_freq-th call.
WANDB = textwrap.dedent(f"""
    import time

    def _due(track):
        track[0] += 1
        if track[0] < track[1]:
            return False
        track[0] = 0
        return True

    def watch(model, log_freq=1000):
        def log_parameters(track):
            if _due(track):
                time.sleep({FORWARD_HOOK_S})

        def log_gradient(track):
            if _due(track):
                time.sleep({GRAD_HOOK_S})

        params = [0, log_freq]
        model.register_forward_hook(lambda mod, inp, outp: log_parameters(params))
        for p in model.parameters():
            grads = [0, log_freq]
            p.register_hook(lambda grad, grads=grads: log_gradient(grads))
""")


def install(where: Path, monkeypatch: Any, name: str, source: str) -> Any:
    """Package ``name`` of ``source`` in ``where``, installed as pip would (its distribution's
    metadata beside it), imported."""
    where.mkdir(exist_ok=True)
    (where / name).mkdir()
    (where / name / "__init__.py").write_text(source)
    dist = where / f"{name}-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (dist / "top_level.txt").write_text(f"{name}\n")
    monkeypatch.syspath_prepend(str(where))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return __import__(name)


def train(watch: Any) -> tp.Run:
    """A loop of SleepyNet (forward 30 ms, backward 20 ms) on batches held in memory, plain SGD,
    a user's own forward pre-hook counting calls; ``watch``: a package's hooking of the model, or None."""
    torch.manual_seed(0)
    model = truth.SleepyNet()
    calls = [0]
    model.register_forward_pre_hook(lambda module, args: calls.__setitem__(0, calls[0] + 1))  # the user's own
    if watch is not None:
        watch(model)
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
    wandb = install(tmp_path, monkeypatch, "wandb", WANDB)
    run = train(lambda model: wandb.watch(model, log_freq=1))
    m = run.steps[~run.steps["warmup"]]
    # the phases hold the hooks (as they should: they run inside them) ...
    assert float(m["forward_s"].median()) >= (1 - TOLERANCE) * (truth.FORWARD_S + FORWARD_HOOK_S)
    assert float(m["backward_s"].median()) >= (1 - TOLERANCE) * (truth.BACKWARD_S + 2 * GRAD_HOOK_S)
    # ... and the run says whose they are: one forward hook and two gradient hooks, the user's not
    assert run.meta["model"]["hooks"] == {"wandb": 3}
    assert run.meta["model"]["hooks_log_freq"] == {"wandb": 1}
    note = next(n for n in run.meta["notes"] if n.startswith("3 hook(s) of wandb on the model"))
    assert "a tracker's" in note and "their time is inside forward_s and backward_s" in note, note
    verdict = run.summary().verdict
    assert verdict.kind == "compute-bound", verdict.text
    assert verdict.advice.startswith(
        "3 hook(s) of wandb on the model run inside forward and backward: wandb.watch logs every 1 call(s) "
        "(log_freq=1): call wandb.unwatch(model) while profiling, or watch it with a log_freq above the "
        f"{STEPS + WARMUP} steps profiled"), verdict.advice


def test_wandbs_default_watch_logs_too_rarely_to_be_advised(tmp_path, monkeypatch):
    """``wandb.watch(model)`` logs every 1000th call: none in the slice, nothing to time or advise."""
    wandb = install(tmp_path, monkeypatch, "wandb", WANDB)
    run = train(wandb.watch)
    m = run.steps[~run.steps["warmup"]]
    assert float(m["forward_s"].median()) < truth.FORWARD_S + FORWARD_HOOK_S / 2  # no hook slept
    assert run.meta["model"]["hooks"] == {"wandb": 3}
    note = next(n for n in run.meta["notes"] if n.startswith("3 hook(s) of wandb on the model"))
    assert (f"wandb logs every 1000 call(s) (log_freq=1000), at most once in the {STEPS + WARMUP} steps profiled"
            in note), note
    assert "log_freq=100)" not in note and "unwatch" not in note, note
    verdict = run.summary().verdict
    assert "hook" not in verdict.advice and "wandb" not in verdict.advice, verdict.advice


def test_other_packages_hooks_are_named_with_no_advice(tmp_path, monkeypatch):
    """A parameter gather's hooks (ColossalAI's, ZeRO-style) may be how the model trains: named, with
    where their time is; no tracker's, nothing to remove."""
    gather = install(tmp_path, monkeypatch, "zerogather", GATHER)
    run = train(gather.wrap)
    m = run.steps[~run.steps["warmup"]]
    assert float(m["forward_s"].median()) >= (1 - TOLERANCE) * (truth.FORWARD_S + FORWARD_HOOK_S)
    assert run.meta["model"]["hooks"] == {"zerogather": 3}
    assert "hooks_log_freq" not in run.meta["model"]
    note = next(n for n in run.meta["notes"] if n.startswith("3 hook(s) of zerogather on the model"))
    assert note == ("3 hook(s) of zerogather on the model ran in the steps: their time is inside forward_s and "
                    "backward_s, and what they allocate there reads as activations and temporaries in memory"), note
    verdict = run.summary().verdict
    assert verdict.kind == "compute-bound", verdict.text
    assert "hook" not in verdict.advice and "remove" not in verdict.advice, verdict.advice


def test_installed_distributions_are_read_once(tmp_path, monkeypatch):
    """Two packages off site-packages: the installed distributions' names (0.15 s to read with a few
    hundred installed) are read once at the slice's end, not once a package."""
    first = install(tmp_path / "a", monkeypatch, "gathera", GATHER)
    second = install(tmp_path / "b", monkeypatch, "gatherb", GATHER)
    reads = [0]
    read = importlib.metadata.packages_distributions

    def counted() -> Any:
        reads[0] += 1
        return read()

    monkeypatch.setattr(importlib.metadata, "packages_distributions", counted)
    run = train(lambda model: (first.wrap(model), second.wrap(model)))
    assert run.meta["model"]["hooks"] == {"gathera": 3, "gatherb": 3}
    assert reads[0] == 1


def test_the_users_own_hooks_are_not_a_trackers():
    run = train(None)
    assert "hooks" not in run.meta["model"]
    assert not any("hook(s) of" in n for n in run.meta["notes"]), run.meta["notes"]
    assert "hook" not in run.summary().verdict.advice


def test_no_advice_names_a_smaller_log_freq_than_the_watchs():
    """The advice for wandb's hooks names its knobs, never a shorter interval (schema.hooks_remedy)."""
    for every in (1, 10, 100):
        advice = hooks_remedy({"wandb": 7}, {"wandb": every}, 200)
        assert f"(log_freq={every})" in advice and "above the 200 steps profiled" in advice, advice
        assert "wandb.unwatch(model)" in advice
    assert hooks_remedy({"wandb": 7}, {"wandb": 1000}, 200) == ""
    assert "larger log_freq" in hooks_remedy({"wandb": 7})  # (the watch's interval unread)
    assert hooks_remedy({"colossalai": 4, "myproj": 1}) == ""
