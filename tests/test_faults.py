"""Faults at any instant leave nothing behind and keep what was recorded: Ctrl-C inside each
probe's removal, while the Run is built and while it is saved; an exception raised from inside
each kind of probe callback; real SIGINTs at random instants over many slices."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from leftovers import diff, snapshot

import tpkit as tp
from tpkit.capture import slice as slice_mod
from tpkit.capture.interrupts import TermGuard
from tpkit.capture.probes.clocks import ClockProbe
from tpkit.capture.probes.memory import MemoryProbe
from tpkit.capture.probes.phases import PhaseProbe

STEPS, WARMUP = 4, 1


def make():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    data = torch.utils.data.TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    return model, loader, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train(model, loader, opt):
    for _ in range(100):
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()


def ctrl_c() -> None:
    """A real SIGINT to this process, as a Ctrl-C in a terminal or a kernel interrupt sends."""
    os.kill(os.getpid(), signal.SIGINT)


def run_slice() -> None:
    model, loader, opt = make()
    with tp.profile(steps=STEPS, warmup=WARMUP, progress=False, clock_hz=50):
        train(model, loader, opt)


@pytest.mark.parametrize("probe", [PhaseProbe, MemoryProbe, ClockProbe], ids=lambda c: c.__name__)
def test_ctrl_c_while_a_probe_is_removed_leaves_nothing_and_keeps_the_run(probe, monkeypatch):
    before = snapshot()
    original = probe.remove

    def remove_interrupted(self, *a, **k):
        ctrl_c()
        return original(self, *a, **k)

    monkeypatch.setattr(probe, "remove", remove_interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_slice()
    monkeypatch.undo()
    assert diff(before, snapshot()) == {}
    run = tp.last_run()
    assert run is not None and len(run.measured_steps) == STEPS  # the full slice was recorded and kept


@pytest.mark.parametrize("where", ["build_run", "autosave"])
def test_ctrl_c_while_the_run_is_built_or_saved_keeps_it(where, monkeypatch):
    from tpkit import store
    from tpkit.capture import build  # the slice imports build_run from it as the run is built

    before = snapshot()
    target = build if where == "build_run" else store
    original = getattr(target, where)

    def interrupted(*a, **k):
        ctrl_c()
        return original(*a, **k)

    monkeypatch.setattr(target, where, interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_slice()
    monkeypatch.undo()
    assert diff(before, snapshot()) == {}
    assert len(tp.last_run().measured_steps) == STEPS


@pytest.mark.parametrize("listener", ["phase_listeners", "step_listeners", "batch_listeners"])
def test_an_exception_inside_a_probe_callback_leaves_nothing_and_keeps_the_partial_run(listener):
    before = snapshot()
    model, loader, opt = make()
    calls = []

    def boom(*args):
        calls.append(args)
        if len(calls) == 3:
            raise RuntimeError("a probe failed")

    with pytest.raises(RuntimeError, match="a probe failed"):
        with tp.profile(steps=STEPS, warmup=WARMUP, progress=False) as prof:
            getattr(prof.rec, listener).append(boom)
            train(model, loader, opt)
    assert diff(before, snapshot()) == {}
    run = tp.last_run()
    assert run is prof.run and not run.complete and "a probe failed" in run.meta["error"]


def test_a_finally_that_raises_while_the_loop_stops_keeps_the_run_complete():
    """The loop's own ``finally`` raises while tpkit stops it (a checkpoint save that fails): the
    exception is the loop's and propagates (its ``__context__`` is tpkit's stop), and the Run, all
    of whose steps completed, stays complete, stopped by the slice, with a note naming it (it had
    read ``stopped_by: "error"``, incomplete)."""
    model, loader, opt = make()
    with pytest.raises(RuntimeError, match="checkpoint save failed") as raised:
        with tp.profile(steps=STEPS, warmup=WARMUP, progress=False, clock_hz=0) as prof:
            try:
                train(model, loader, opt)
            finally:
                raise RuntimeError("checkpoint save failed")
    assert isinstance(raised.value.__context__, tp.errors.StopSlice)
    run = prof.run
    assert len(run.steps) == STEPS + WARMUP and run.complete and run.meta["stopped_by"] == "slice"
    assert "error" not in run.meta
    assert any("RuntimeError: checkpoint save failed while tpkit stopped it" in n for n in run.meta["notes"])
    assert tp.last_run() is run


def test_ctrl_c_after_the_slices_last_step_is_said_to_be_the_users_interrupt():
    """Ctrl-C after the slice's last step, before tpkit stopped the loop (in its tail): the Run is
    complete and the note says the loop was interrupted. It had read "the loop raised
    KeyboardInterrupt:  after ..." (an empty message) and called the interrupt the loop's own."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    steps = 0
    with pytest.raises(KeyboardInterrupt):
        with tp.profile(steps=STEPS, warmup=WARMUP, progress=False, clock_hz=0) as prof:
            while True:
                model(torch.randn(2, 4)).sum().backward()
                opt.step()
                opt.zero_grad()
                steps += 1
                if steps == STEPS + WARMUP:
                    raise KeyboardInterrupt  # as Ctrl-C raises it: no message
    run = prof.run
    assert len(run.steps) == STEPS + WARMUP and run.complete and run.meta["stopped_by"] == "slice"
    said = [n for n in run.meta["notes"] if "KeyboardInterrupt" in n]
    assert len(said) == 1 and said[0].startswith("the loop was interrupted (KeyboardInterrupt) after the slice's last step")
    assert "  " not in said[0] and "loop's own" not in said[0]


def test_ctrl_c_in_the_loop_keeps_the_partial_run_marked_interrupted():
    before = snapshot()
    model, loader, opt = make()
    seen = []

    def interrupt_at_third(raw_step, end_ns):
        seen.append(raw_step)
        if len(seen) == 3:
            ctrl_c()

    with pytest.raises(KeyboardInterrupt):
        with tp.profile(steps=50, warmup=WARMUP, progress=False) as prof:
            prof.rec.step_listeners.append(interrupt_at_third)
            train(model, loader, opt)
    assert diff(before, snapshot()) == {}
    run = tp.last_run()
    assert run.meta["stopped_by"] == "interrupt" and not run.complete
    assert len(run.steps) == 3  # the three steps that happened


@pytest.mark.parametrize("where", ["first probe", "clock probe", "SIGTERM guard"])
def test_ctrl_c_while_the_probes_go_in_leaves_nothing_and_keeps_a_run_that_says_so(where, monkeypatch):
    """A Ctrl-C while the slice installs its probes is held until they are all in, then raised:
    every probe comes out, the SIGTERM and SIGINT handlers are Python's again, and the run kept
    (``tp.last_run()``) is this slice's, empty and marked interrupted at its start, not the
    slice before's. tpkit's SIGTERM guard had stayed installed for good and no run was kept."""
    run_slice()
    previous = tp.last_run()
    before = snapshot()
    assert before["sigterm"] is signal.SIG_DFL and before["sigint"] is signal.default_int_handler
    target, name = {"first probe": (slice_mod, "maybe_cuda_timer"), "clock probe": (ClockProbe, "install"),
                    "SIGTERM guard": (TermGuard, "install")}[where]
    original = getattr(target, name)

    def interrupted(*a, **k):
        ctrl_c()
        return original(*a, **k)

    monkeypatch.setattr(target, name, interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_slice()
    monkeypatch.undo()
    assert diff(before, snapshot()) == {}
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    run = tp.last_run()
    assert run is not previous and len(run.steps) == 0
    assert not run.complete and run.meta["stopped_by"] == "interrupt"
    notes = run.meta["notes"]
    assert any("cut short by KeyboardInterrupt while tpkit installed its probes" in n for n in notes), notes
    assert not any("tp.step()" in n for n in notes), notes  # no advice about how steps end
    run_slice()  # and the next slice runs as usual
    assert len(tp.last_run().measured_steps) == STEPS



def test_ctrl_c_as_the_teardown_begins_leaves_nothing_and_keeps_the_run(monkeypatch):
    """A Ctrl-C as the body's end starts the teardown (in ``TermGuard.tearing_down``, which had
    run before SIGINT was held): every probe comes out, the full slice is kept, and the next
    slice starts. It had left every hook and the active Recorder in, kept no run, and every
    later ``tp.profile()`` raised ProfileActiveError."""
    run_slice()
    before = snapshot()
    original = TermGuard.tearing_down

    def interrupted(self):
        ctrl_c()
        return original(self)

    monkeypatch.setattr(TermGuard, "tearing_down", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_slice()
    monkeypatch.undo()
    assert diff(before, snapshot()) == {}
    assert len(tp.last_run().measured_steps) == STEPS and tp.last_run().complete
    run_slice()
    assert len(tp.last_run().measured_steps) == STEPS


def test_ctrl_c_before_the_teardown_holds_sigint_leaves_nothing_and_keeps_the_run(monkeypatch):
    """A Ctrl-C landing as the slice's end begins, before SIGINT is held at all (inside
    ``held_sigint``'s own first lines): it is raised after the same full teardown."""
    run_slice()
    before = snapshot()
    real = slice_mod.held_sigint
    fired = []

    def late_hold(*a, **k):
        if sys._getframe(1).f_code.co_name == "_take_down" and not fired:
            fired.append(1)
            ctrl_c()  # raised here, before the hold is in
        return real(*a, **k)

    monkeypatch.setattr(slice_mod, "held_sigint", late_hold)
    with pytest.raises(KeyboardInterrupt):
        run_slice()
    monkeypatch.undo()
    assert fired and diff(before, snapshot()) == {}
    assert len(tp.last_run().measured_steps) == STEPS
    run_slice()
    assert len(tp.last_run().measured_steps) == STEPS


def test_a_second_ctrl_c_while_an_interrupted_start_is_undone_leaves_nothing(monkeypatch):
    """A Ctrl-C while the probes go in, and a second one as tpkit begins taking them out again
    (``TermGuard.tearing_down``): every probe comes out, the run kept says the start was
    interrupted, and the next slice starts. The second had left every probe in."""
    run_slice()
    previous = tp.last_run()
    before = snapshot()
    timer, tearing_down = slice_mod.maybe_cuda_timer, TermGuard.tearing_down

    def first(*a, **k):
        ctrl_c()
        return timer(*a, **k)

    def second(self):
        ctrl_c()
        return tearing_down(self)

    monkeypatch.setattr(slice_mod, "maybe_cuda_timer", first)
    monkeypatch.setattr(TermGuard, "tearing_down", second)
    with pytest.raises(KeyboardInterrupt):
        run_slice()
    monkeypatch.undo()
    assert diff(before, snapshot()) == {}
    run = tp.last_run()
    assert run is not previous and len(run.steps) == 0 and run.meta["stopped_by"] == "interrupt"
    run_slice()
    assert len(tp.last_run().measured_steps) == STEPS


def test_a_ctrl_c_held_while_the_probes_go_in_says_so(monkeypatch):
    """With SIGINT's default action in place (no Python handler), the KeyboardInterrupt tpkit
    raises for a Ctrl-C it held while installing says "installing", not "removing"."""
    timer = slice_mod.maybe_cuda_timer

    def interrupted(*a, **k):
        ctrl_c()  # held: the process does not end
        return timer(*a, **k)

    monkeypatch.setattr(slice_mod, "maybe_cuda_timer", interrupted)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        with pytest.raises(KeyboardInterrupt, match="^interrupted while tpkit was installing its probes"):
            run_slice()
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)

SIGTERM_CHILD = Path(__file__).parent / "sigterm_child.py"
SIGINT_SOAK = Path(__file__).with_name("sigint_soak.py")


@pytest.mark.slow
@pytest.mark.parametrize("where,steps,stopped_by", [("loop", 4, "terminated"), ("teardown", 3, "loop_end"),
                                                     ("reused", 4, "terminated"), ("start", 0, "interrupt")])
def test_sigterm_keeps_the_run_then_ends_the_process_as_sigterm_does(where, steps, stopped_by, tmp_path):
    """torchrun stops every surviving rank with SIGTERM the moment one fails: a rank stopped
    inside tpkit's teardown lost its run (the healthy rank's, 3 of 3 launches). In the loop, the
    slice now ends through its error path; in the teardown, the signal waits for its end; then
    the process still ends by SIGTERM, with the run kept. A Profile used again does the same (its
    signal guard had stayed in its teardown state: SIGTERM was held to the slice's end). After a
    Ctrl-C while the probes went in ("start"), a SIGTERM in the code that runs next ends the
    process too (tpkit's guard had stayed for good: it raised tpkit's SystemExit there, and the
    process lived on), and the interrupted start's empty run was kept."""
    out = subprocess.run([sys.executable, str(SIGTERM_CHILD), where, str(tmp_path)], capture_output=True,
                         text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == -signal.SIGTERM, (out.returncode, out.stdout, out.stderr[-2000:])
    assert "not reached" not in out.stdout
    run = tp.load(str(tmp_path / (f"sigterm-{where}" + ("-2" if where == "reused" else ""))))  # (its second run)
    assert len(run.steps) == steps and run.meta["stopped_by"] == stopped_by


def test_a_process_forked_during_a_slice_ends_by_sigterm_at_once():
    """A loader's worker forked while the slice holds SIGTERM gets the default action back: its
    parent ends it with SIGTERM, and it has no run to keep."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with tp.profile(steps=2, warmup=0, progress=False, clock_hz=0, memory=False):
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL  # held in this process
        for _ in range(2):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            read, write = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child: say it is ready, then wait to be ended
                os.write(write, b"1" if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL else b"0")
                time.sleep(30)
                os._exit(0)
            default = os.read(read, 1) == b"1"
            os.kill(pid, signal.SIGTERM)
            _, status = os.waitpid(pid, 0)
            os.close(read)
            os.close(write)
            assert default and os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # given back


def test_real_sigints_at_random_instants_over_many_slices_leave_nothing_behind():
    out = subprocess.run([sys.executable, str(SIGINT_SOAK), "--slices", "40", "--seed", "3"],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TPKIT_RUNS": "off"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = out.stdout.strip().splitlines()[-1]
    interrupted, clean = (int(x.split("=")[1]) for x in summary.split()[:2])
    assert clean == 40 and interrupted >= 10, summary  # Ctrl-C landed in most slices, nothing ever left


@pytest.mark.parametrize("kwargs,match", [
    ({"clock_hz": "fast"}, "clock_hz"), ({"clock_hz": True}, "clock_hz"), ({"samples_per_step": 2.5}, "samples_per_step"),
    ({"steps": 2.0}, "steps"), ({"warmup": -1}, "warmup"), ({"memory": "yes"}, "memory"), ({"name": 3}, "name"),
])
def test_bad_profile_arguments_are_refused_with_a_tpkit_error(kwargs, match):
    before = snapshot()
    with pytest.raises(tp.TpkitError, match=match):
        tp.profile(**kwargs)
    assert diff(before, snapshot()) == {}


def test_profile_fn_without_stop_calls_warmup_plus_steps_times():
    calls = []
    run = tp.profile_fn(lambda: calls.append(1), steps=3, warmup=1, stop=False, progress=False, memory=False)
    assert len(calls) == 4 and len(run.steps) == 4


@pytest.mark.parametrize("args,code,says", [
    (["demo", "--warmup", "x"], 2, "--warmup"), (["demo", "--batch-size", "0"], 2, "--batch-size"),
    (["demo", "--workers", "-1"], 2, "--workers"), (["demo", "--out", "/proc/x"], 1, "cannot be written"),
    (["report", "/nonexistent-run"], 1, "not a folder"),
])
def test_the_cli_says_what_is_wrong_in_one_line(args, code, says):
    out = subprocess.run([sys.executable, "-m", "tpkit", *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == code
    assert says in out.stderr and "Traceback" not in out.stderr


def test_the_demos_help_says_what_each_option_is_and_its_default(capsys):
    """``python -m tpkit demo --help``: --steps, --batch-size, --name and --out had no help text
    and no default shown. Truth: the defaults the parser uses."""
    from tpkit.views.cli import main

    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for option, default in (("--steps", "20"), ("--warmup", "3"), ("--batch-size", "16"), ("--workers", "0"),
                            ("--cpu-ms", "0"), ("--name", "demo"), ("--out", "tpkit_report")):
        after = text.split(f"{option} {option.lstrip('-').replace('-', '_').upper()} ", 1)[1]
        assert f"default {default}" in after.split(" --", 1)[0], (option, after[:120])


def test_magic_save_to_a_bad_path_is_refused_before_the_cell_runs(ip, tmp_path):
    from IPython.core.error import UsageError

    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    ip.user_ns["ran"] = []
    for bad in ("/proc/x", str(a_file)):
        with pytest.raises(UsageError, match="--save"):
            ip.run_cell_magic("tp_profile", f"--steps 2 --quiet --save {bad}", "ran.append(1)")
    assert ip.user_ns["ran"] == []


def test_every_patch_in_place_is_listed_until_restored_even_if_its_holder_is_dropped():
    """``patching.in_place()`` lists each patch of tpkit's in place, whichever probe's ``Patches``
    holds it; the suite's check after every test reads it (``leftovers.tpkit_hooks``). A holder
    dropped without ``restore`` (a probe lost mid-teardown) still has its patch listed."""
    import gc

    from tpkit.capture.probes import patching

    class Owner:
        def f(self) -> str:
            return "own"

    assert patching.in_place() == []
    kept, dropped = patching.Patches(), patching.Patches()
    kept.set(Owner, "f", lambda self: "patched")
    dropped.set(Owner, "g", lambda self: "new")
    assert set(patching.in_place()) == {(Owner, "f"), (Owner, "g")}
    del dropped
    gc.collect()
    assert set(patching.in_place()) == {(Owner, "f"), (Owner, "g")}
    kept.restore()
    assert patching.in_place() == [(Owner, "g")] and Owner().f() == "own"
    (held,) = [p for p in patching._IN_PLACE.values() if p._done[0][0] is Owner]
    held.restore()
    assert patching.in_place() == [] and not hasattr(Owner, "g")
