"""``torch.compile`` under a slice: tpkit's hooks must not change what dynamo compiles.

Truth: the same loop run without tpkit (dynamo's own counters: graphs captured and graph
breaks), and the forward time the loop measures around each call of the compiled module.
``backend="eager"`` needs no C compiler; inductor runs only where one works (slow).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import truth
from torch._dynamo.utils import counters, get_compilation_metrics
from truth import STEPS, WARMUP

import tpkit as tp
from tpkit.analysis import recommend
from tpkit.schema import UNSEEN_OPTIMIZER_NOTE


class Net(torch.nn.Module):
    """(B, 256) -> (B, 1); moves its input as real models do."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(256, 1024)
        self.b = torch.nn.Linear(1024, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.a.weight.dtype)
        return self.b(torch.relu(self.a(x)))  # (B, 1)


def compiled_loop(backend: str, profile: bool, warm: bool = False, in_place: bool = False) -> dict:
    """A plain loop over a module compiled with ``backend``, first called inside the slice
    (or, ``warm``, three times before it); ``in_place``: ``model.compile()`` instead of
    ``torch.compile(model)``. Returns dynamo's counters and the run."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = Net()
    if in_place:
        model.compile(backend=backend)
        cmodel = model
    else:
        cmodel = torch.compile(model, backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(2048, 256), torch.randn(2048, 1)  # ~5-10 ms a forward: the truth is 30 ms+

    def step() -> None:
        with truth.timed("forward"):
            out = cmodel(x)
        loss = F.mse_loss(out, y)
        loss.backward()
        opt.step()
        opt.zero_grad()

    if warm:
        for _ in range(3):
            step()
    before_graphs = counters["stats"]["unique_graphs"]
    run, state = None, truth.hook_state()
    if profile:
        with tp.profile(steps=STEPS, warmup=WARMUP, name=f"compile-{backend}", progress=False, clock_hz=0) as prof, \
                truth.TRUTH.recording():
            for _ in range(100):
                step()
        run = prof.run
    else:
        for _ in range(STEPS + WARMUP):
            step()
    out = dict(run=run, before=state, model=model, truth=truth.snapshot(),
               graphs=counters["stats"]["unique_graphs"], new_graphs=counters["stats"]["unique_graphs"] - before_graphs,
               breaks=sum(counters["graph_break"].values()), break_reasons=list(counters["graph_break"]),
               recompiles=sum(counters["recompiles"].values()) if "recompiles" in counters else 0)
    torch._dynamo.reset()
    return out


@pytest.fixture(scope="module")
def eager_plain():
    return compiled_loop("eager", profile=False)


@pytest.fixture(scope="module")
def eager_sliced():
    return compiled_loop("eager", profile=True)


def test_control_without_tpkit_is_one_graph(eager_plain):
    assert eager_plain["graphs"] == 1 and eager_plain["breaks"] == 0


def test_first_compile_inside_the_slice_is_unchanged(eager_plain, eager_sliced):
    assert eager_sliced["breaks"] == 0, eager_sliced["break_reasons"]
    assert eager_sliced["graphs"] == eager_plain["graphs"]


def test_compiled_call_is_timed_as_forward_and_hooks_are_removed(eager_sliced):
    """The compiled call is forward, its first compilation (in the first warmup step) compile;
    no measured step compiles."""
    run = eager_sliced["run"]
    truth.assert_hooks_removed(eager_sliced["before"])
    assert len(run.steps) == STEPS + WARMUP and run.complete
    truth.assert_phases(run, eager_sliced["truth"], phases=("forward",), compiled=True)
    compile_s = run.steps.set_index("step")["compile_s"]
    # dynamo's tracing of this small model: tens of ms (a fixed 50 ms floor read 47.7 ms in a CI run)
    assert compile_s[-WARMUP] > 0.01 and (compile_s.drop(-WARMUP) == 0).all()
    assert run.meta["model"]["parameters"] == sum(p.numel() for p in eager_sliced["model"].parameters())


@pytest.fixture(scope="module")
def eager_warm():
    return compiled_loop("eager", profile=True, warm=True)


def test_warm_compiled_model_keeps_its_graph(eager_warm):
    """Compiled before the slice: the slice adds no graph and no recompile, and the compiled
    call is still timed as forward."""
    truth.assert_hooks_removed(eager_warm["before"])
    assert eager_warm["new_graphs"] == 0 and eager_warm["recompiles"] == 0
    truth.assert_phases(eager_warm["run"], eager_warm["truth"], phases=("forward",))
    assert (eager_warm["run"].steps["compile_s"] == 0).all()


def test_warm_compiled_model_has_no_graph_break(eager_warm):
    assert eager_warm["breaks"] == 0, eager_warm["break_reasons"]


def test_a_model_compiled_in_place_is_timed_as_forward():
    """``model.compile()`` compiles the module's whole call, its hooks included: tpkit sees the
    call from outside (``nn.Module.__call__``), so its forward is timed like any other, with
    the graphs and breaks of the same loop without tpkit."""
    plain = compiled_loop("eager", profile=False, in_place=True)
    sliced = compiled_loop("eager", profile=True, in_place=True)
    truth.assert_hooks_removed(sliced["before"])
    assert sliced["breaks"] == 0 and sliced["graphs"] == plain["graphs"] == 1
    truth.assert_phases(sliced["run"], sliced["truth"], phases=("forward",), compiled=True)
    assert not any("no module's forward" in n for n in sliced["run"].meta["notes"])


VOCAB = 32
FORWARD_SLEEP_S = 0.02  # the known part of each forward, outside the compiled region
RECOMPILE_AT = 2  # the measured step whose batch is longer: dynamo compiles the model again there


class Tagger(torch.nn.Module):
    """(B, T) tokens -> (B, T, VOCAB) with a compiled inside: its forward sleeps a known
    ``FORWARD_SLEEP_S``, then calls the compiled part."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.compile(torch.nn.Sequential(torch.nn.Embedding(VOCAB, 16), torch.nn.Linear(16, VOCAB)),
                                   backend="aot_eager")

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        time.sleep(FORWARD_SLEEP_S)
        return self.inner(idx)


def dynamo_patched() -> None:
    """dynamo patches ``nn.Module`` at its first compilation in the process: done before a slice
    whose hooks are checked, where this file's test runs alone."""
    torch.compile(torch.nn.Linear(1, 1), backend="eager")(torch.ones(1, 1))


def recompile_loop(profile: bool) -> dict:
    """A loop whose batches grow from 8 to 12 tokens at measured step ``RECOMPILE_AT``
    (``dynamic=None``: dynamo compiles again there). Truth: the loop's clock around each forward,
    dynamo's own record of each compilation, the losses and the parameters it ends with."""
    dynamo_patched()
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Tagger()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    forward_s: list[float] = []
    losses: list[float] = []
    known = [id(r) for r in get_compilation_metrics()]

    def step(i: int) -> None:
        length = 8 if i < WARMUP + RECOMPILE_AT else 12
        idx = torch.randint(0, VOCAB, (4, length), generator=torch.Generator().manual_seed(i))
        t = time.perf_counter()
        out = model(idx)
        forward_s.append(time.perf_counter() - t)
        loss = F.cross_entropy(out.reshape(-1, VOCAB), idx.reshape(-1))
        losses.append(loss.item())
        loss.backward()
        opt.step()  # (the slice's last one ends it)
        opt.zero_grad()

    run, before = None, truth.hook_state()
    if profile:
        with tp.profile(steps=STEPS, warmup=WARMUP, name="recompile", progress=False, clock_hz=0) as prof:
            for i in range(100):
                step(i)
        run = prof.run
    else:
        for i in range(STEPS + WARMUP):
            step(i)
    records = [r for r in get_compilation_metrics() if id(r) not in known and r.is_forward]
    out = dict(run=run, before=before, forward_s=forward_s, losses=losses, records=records,
               params=[p.detach().clone() for p in model.parameters()])
    torch._dynamo.reset()
    return out


@pytest.fixture(scope="module")
def recompiled():
    return recompile_loop(profile=True)


def test_a_recompile_inside_the_measured_steps_is_compile_time_not_forward(recompiled):
    """The step where the batch grows holds dynamo's second compilation: its ``compile_s`` is
    dynamo's own time for it, and its forward what the loop's clock read less that (the known
    sleep and the compiled call), as in the steps around it. It had been all forward (3.7 s of
    aot_eager, 18.8 s of inductor in a 0.1 s step), with no word."""
    run = recompiled["run"]
    truth.assert_hooks_removed(recompiled["before"])
    steps = run.steps.set_index("step")
    first, again = recompiled["records"]  # dynamo's compilations: the first call's, the longer batch's
    assert first.recompile_reason is None and "size mismatch" in again.recompile_reason
    dynamo_s = (again.end_time_us - again.start_time_us) / 1e6
    assert abs(steps.compile_s[RECOMPILE_AT] - dynamo_s) <= 0.05 * dynamo_s + 0.01, (steps.compile_s, dynamo_s)
    loop_forward_s = recompiled["forward_s"][WARMUP + RECOMPILE_AT]
    assert abs(steps.forward_s[RECOMPILE_AT] - (loop_forward_s - dynamo_s)) <= 0.05 * dynamo_s + 0.01
    others = steps.forward_s[steps.index >= 0].drop(RECOMPILE_AT)
    assert FORWARD_SLEEP_S <= steps.forward_s[RECOMPILE_AT] <= others.max() + 0.02, steps.forward_s
    measured = steps.compile_s[steps.index >= 0]
    assert steps.compile_s[-WARMUP] > 0 and (measured.drop(RECOMPILE_AT) == 0).all()
    note = next(n for n in run.meta["notes"] if n.startswith("torch.compile compiled"))
    assert f"step {RECOMPILE_AT}: 1 (" in note and "size mismatch" in note and "1 in the measured steps" in note
    summary = run.summary()
    assert (summary.verdict.kind == "compile-bound") == (summary.phase_share["compile_s"] >= 0.30)


def test_a_recompile_under_tpkit_trains_as_without_it(recompiled):
    plain = recompile_loop(profile=False)
    assert recompiled["losses"] == plain["losses"]
    assert recompiled["run"].steps["loss"].tolist() == pytest.approx(plain["losses"], rel=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(recompiled["params"], plain["params"]))


class Broken(torch.nn.Module):
    """(B, 8) -> (B, 1) with a graph break between its layers (dynamo's own marker)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        torch._dynamo.graph_break()
        return self.b(h)


BREAK_LINE = Broken.forward.__code__.co_firstlineno + 2


def test_a_model_compiled_with_a_graph_break_before_the_slice_is_noted():
    """Compiled and run before the slice (a second ``%%tp_profile`` of the cell): dynamo counts a
    break when it compiles, so none is counted while the slice runs and the run said nothing; the
    note names the break's line. A Ctrl-C in the loop after a compilation leaves none of the compile
    callbacks behind. The same model reaching dynamo's recompile limit inside the slice (no
    compilation runs there: dynamo runs the frame eager from then on) is said, with its step. A
    ``torch._dynamo.reset()`` inside the slice clears the callbacks: the next compilation is seen
    all the same, in the reset's own step too."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Broken()
    cmodel = torch.compile(model, backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def loop(rows: int = 4, rank_up_at: int | None = None, stop_at: int | None = None,
             reset_at: int | None = None, reset_top: int | None = None) -> None:
        for i in range(100):
            if i == stop_at:
                raise KeyboardInterrupt
            if i == reset_top:
                torch._dynamo.reset()  # the compile it causes comes in this very step
            x = torch.randn(rows, 8)
            cmodel(x.unsqueeze(1) if rank_up_at is not None and i >= rank_up_at else x).sum().backward()
            if i == reset_at:
                torch._dynamo.reset()  # (it clears dynamo's compile callbacks: tpkit's too)
            opt.step()
            opt.zero_grad()

    for _ in range(2):
        cmodel(torch.randn(4, 8))
    before = truth.hook_state()
    with tp.profile(steps=3, warmup=1, name="warm-break", progress=False, clock_hz=0) as prof:
        loop()
    truth.assert_hooks_removed(before)
    notes = prof.run.meta["notes"]
    assert any(f"has 1 graph break(s), made when dynamo compiled it before the slice (at test_compile.py:{BREAK_LINE})"
               in n for n in notes), notes
    assert (prof.run.steps["compile_s"] == 0).all()
    with pytest.raises(KeyboardInterrupt), tp.profile(steps=5, warmup=1, progress=False, clock_hz=0):
        loop(rows=6, stop_at=2)  # a new batch size: compiled again, then interrupted
    truth.assert_hooks_removed(before)
    assert tp.last_run().steps["compile_s"].sum() > 0
    with torch._dynamo.config.patch(recompile_limit=1), \
            tp.profile(steps=3, warmup=1, name="limit", progress=False, clock_hz=0) as prof:
        loop(rank_up_at=2)  # raw step 2: measured step 1
    truth.assert_hooks_removed(before)
    notes = prof.run.meta["notes"]
    assert any("reached its recompile limit (torch._dynamo.config.recompile_limit = 1)" in n and "at step 1" in n
               for n in notes), notes
    assert (prof.run.steps["compile_s"] == 0).all()
    with tp.profile(steps=3, warmup=1, name="reset", progress=False, clock_hz=0) as prof:
        loop(reset_at=1)  # the model compiled anew at raw step 2: measured step 1
    truth.assert_hooks_removed(before)
    compile_s = prof.run.steps.set_index("step")["compile_s"]
    assert compile_s[1] > 0 and (compile_s.drop(1) == 0).all()
    for _ in range(2):
        cmodel(torch.randn(4, 8))
    with tp.profile(steps=3, warmup=1, name="reset-top", progress=False, clock_hz=0) as prof:
        loop(reset_top=2)  # at raw step 2's top, its forward compiling anew: measured step 1
    truth.assert_hooks_removed(before)
    compile_s = prof.run.steps.set_index("step")["compile_s"]
    assert compile_s[1] > 0 and (compile_s.drop(1) == 0).all()  # (it had been forward, compile_s 0)
    torch._dynamo.reset()


def test_a_compile_probe_told_of_a_step_after_its_removal_puts_nothing_back():
    """A probe's ``remove()`` is final: its step listener, reached after the removal (the slice
    torn down by a listener before it in the same step), attaches no dynamo callback."""
    from tpkit.capture.probes.compile import CompileProbe
    from tpkit.capture.recorder import Recorder

    before = truth.hook_state()
    probe = CompileProbe(Recorder()).install()
    assert truth.hook_state()["dynamo compile callbacks"] != before["dynamo compile callbacks"]
    probe.remove()
    probe._at_step(0, 0)
    truth.assert_hooks_removed(before)


@pytest.mark.parametrize("how", ["call", "held"])
def test_dynamo_first_imported_inside_the_slice_still_times_the_first_compile(how, tmp_path):
    """A cell that compiles and trains, in a process that never imported dynamo: the callbacks
    had gone in at the first step's end, after the first compile, which was all the first step's
    forward (2.2 s, compile_s 0). ``call``: the ``torch.compile(...)`` call (which imports dynamo)
    is compile time too, and the callbacks go in when it returns; ``held``: torch.compile called
    through a reference taken before the slice, dynamo imported by the optimizer made inside it:
    the compilation comes from dynamo's records after the slice. Truth: dynamo's records, the
    loop's clocks around the call and around each forward."""
    child = Path(__file__).with_name("fresh_compile_child.py")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(tp.__file__).parents[1]),
                                                                      os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, str(child), how, str(tmp_path / "run")], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["torch_compile_back"]
    run = tp.load(str(tmp_path / "run"))
    steps = run.steps.set_index("step")
    dynamo_s = sum(r["seconds"] for r in got["records"])
    assert len(got["records"]) == 1 and dynamo_s > 0.05
    want = dynamo_s + got["call_s"]  # (held: the call is the library's, not seen: 0 here)
    assert abs(steps.compile_s[-1] - want) <= 0.05 * want + 0.01, (steps.compile_s, want)
    assert (steps.compile_s.drop(-1) == 0).all()
    first_forward = got["forward_s"][0] - dynamo_s  # the compiled call less its compilation
    assert abs(steps.forward_s[-1] - first_forward) <= truth.TOLERANCE * first_forward + 0.01
    note = next(n for n in run.meta["notes"] if n.startswith("torch.compile compiled 1 time(s)"))
    assert "step -1 (warmup): 1 (" in note
    assert ("the torch.compile(...) calls themselves took" in note) == (how == "call")


def test_another_threads_compilations_before_the_callbacks_are_not_the_loops(tmp_path):
    """dynamo first imported inside the slice, and a helper thread compiling through a reference
    taken at import during the loop's first step, before tpkit's callbacks go in at its end: the
    loop compiles nothing (it waits for the helper, then trains eagerly). Those compilations had
    been read from dynamo's records as the loop's (compile_s 0.35 s in the first step, and a
    note): no record says its thread, and the loop was in no call that compiles. Truth: dynamo's
    records (the helper's compilations happened), the loop's eager model."""
    child = Path(__file__).with_name("fresh_compile_child.py")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(tp.__file__).parents[1]),
                                                                      os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, str(child), "thread", str(tmp_path / "run")], capture_output=True,
                         text=True, timeout=300, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(got["records"]) >= 2  # the helper's
    run = tp.load(str(tmp_path / "run"))
    assert (run.steps["compile_s"] == 0).all(), run.steps["compile_s"].tolist()
    assert not any(n.startswith("torch.compile compiled") for n in run.meta["notes"]), run.meta["notes"]


@pytest.mark.filterwarnings("ignore:Dynamo does not know how to trace")  # (SleepyNet reads a clock)
def test_an_evaluation_wrappers_first_compile_in_a_measured_step_is_said_to_be_evaluations():
    """A model trained eagerly and evaluated through ``torch.compile(model)`` first called in a
    measured step: its compilation is compile time (dynamo's record), the rest of the call eval;
    the note says it ran without grad (an evaluation's: it had given no reason at all), and the
    advice is about compilations, not recompiles only. Truth: dynamo's records, the loop's clock
    around the evaluation call."""
    torch._dynamo.reset()
    dynamo_patched()
    torch.manual_seed(0)
    model = truth.SleepyNet()
    eval_model = torch.compile(model, backend="eager")
    opt = truth.SleepySGD(model.parameters(), lr=0.01)
    x, y, vx = torch.randn(16, 8), torch.randn(16, 1), torch.randn(64, 8)
    known = {id(r) for r in get_compilation_metrics()}
    eval_s = 0.0
    with tp.profile(steps=STEPS, warmup=WARMUP, name="eval-compile", progress=False, clock_hz=0) as prof:
        for i in range(100):
            if i == WARMUP + 1:  # at the top of measured step 1
                model.eval()
                with torch.no_grad():
                    t = time.perf_counter()
                    eval_model(vx)
                    eval_s = time.perf_counter() - t
                model.train()
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    records = [r for r in get_compilation_metrics() if id(r) not in known and r.start_time_us and r.end_time_us]
    torch._dynamo.reset()
    run = prof.run
    dynamo_s = sum((r.end_time_us - r.start_time_us) / 1e6 for r in records)
    steps = run.steps.set_index("step")
    assert abs(steps.compile_s[1] - dynamo_s) <= 0.05 * dynamo_s + 0.01, (steps.compile_s, dynamo_s)
    assert (steps.compile_s.drop(1) == 0).all()
    assert abs(steps.eval_s[1] - (eval_s - dynamo_s)) <= truth.TOLERANCE * (eval_s - dynamo_s) + 0.01
    note = next(n for n in run.meta["notes"] if n.startswith("torch.compile compiled"))
    assert f"step 1: {len(records)} (" in note and f"{len(records)} of them without grad (an evaluation's" in note
    (rec,) = [r for r in recommend.recommendations(run) if r.kind == "compilation"]
    assert rec.title == "Keep torch.compile's compilations out of the measured steps"
    assert "run one evaluation in the warmup steps" in rec.expected_gain


def _c_compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++") or shutil.which("clang++")


@pytest.mark.slow
@pytest.mark.skipif(_c_compiler() is None, reason="inductor needs a C++ compiler; none on PATH")
def test_inductor_first_compile_inside_the_slice_is_unchanged():
    plain = compiled_loop("inductor", profile=False)
    sliced = compiled_loop("inductor", profile=True)
    truth.assert_hooks_removed(sliced["before"])
    assert plain["graphs"] == 1 and plain["breaks"] == 0
    assert sliced["breaks"] == 0, sliced["break_reasons"]
    assert sliced["graphs"] == plain["graphs"]



def _graphs_of_a_model_with_a_break(profile: bool) -> tuple[int, int]:
    """Dynamo's graphs and frames for truth's SleepyNet (its forward sleeps: a graph break)
    compiled with aot_eager, run STEPS + WARMUP times, with or without a slice."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = truth.SleepyNet()
    cmodel = torch.compile(model, backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(16, 8), torch.randn(16, 1)

    def step() -> None:
        F.mse_loss(cmodel(x), y).backward()
        opt.step()
        opt.zero_grad()

    if profile:
        with tp.profile(steps=STEPS, warmup=WARMUP, name="aot-eager", progress=False, clock_hz=0):
            for _ in range(100):
                step()
    else:
        for _ in range(STEPS + WARMUP):
            step()
    out = counters["stats"]["unique_graphs"], counters["frames"]["total"]
    torch._dynamo.reset()
    return out


def test_aot_eager_compiles_no_graph_of_tpkits():
    """``backend="aot_eager"`` runs each compiled graph as an FX ``GraphModule`` whose
    ``super().__call__`` reads ``nn.Module.__call__`` (tpkit's ``_module_call`` while a slice
    runs): dynamo compiled that frame as user code, a graph more (4 for 1 at 12 layers, seconds
    of compiling in a warmup step). Dynamo skips it now, as it skips torch's own call."""
    assert _graphs_of_a_model_with_a_break(profile=True) == _graphs_of_a_model_with_a_break(profile=False)


@pytest.mark.parametrize("update, source", [("compiled", "DataLoader"), ("by hand", "DataLoader"),
                                            ("compiled", "tp.watch"), ("compiled", "tp.data.Loader")])
def test_an_update_no_optimizer_hook_sees_ends_the_step(update, source):
    """``torch.compile(opt.step)`` (PyTorch's compiled-optimizer recipe): dynamo compiles torch's
    step hooks away, and tpkit had recorded no step and never ended the slice (the loop ran all
    its batches). A step ends at the loop's next batch after the parameters changed and the
    gradients were dropped; losses are the loop's, the slice stops after its steps, the run says so. An SGD update written by hand
    (no optimizer at all) ends its steps the same way, and so does a loop over a watched source."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01))
    step = torch.compile(opt.step, backend="eager")

    def update_() -> None:
        if update == "compiled":
            step()
            opt.zero_grad()
        else:
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.01 * p.grad
                    p.grad = None

    loader = torch.utils.data.DataLoader(truth.Regression(), batch_size=8)
    x0, y0 = next(iter(loader))
    F.mse_loss(model(x0), y0).backward()
    update_()  # compiled before the slice
    losses, updates = [], 0
    batches = {"DataLoader": loader, "tp.watch": tp.watch(b for b in loader),  # (a generator: only tp.watch sees it)
               "tp.data.Loader": tp.data.Loader(truth.Regression(), batch_size=8, num_workers=0)}[source]
    with tp.profile(steps=STEPS, warmup=WARMUP, name="unseen", progress=False, clock_hz=0) as prof:
        for x, y in batches:
            loss = F.mse_loss(model(x), y)
            loss.backward()
            losses.append(loss.item())
            updates += 1
            update_()
    run = prof.run
    notes = run.meta["notes"]
    assert any(n.startswith(f"{STEPS + WARMUP} step(s) ended with no optimizer.step() tpkit saw run") for n in notes), notes
    assert not any("skipped" in n or "SAM" in n or "more than each later step" in n for n in notes), notes
    # its zero_grad() (or p.grad = None) before the next batch: the gradients went into an update
    assert updates == STEPS + WARMUP  # the slice ended at the batch after its last update
    assert run.steps["loss"].tolist() == pytest.approx(losses, rel=1e-6)
    assert (run.steps["samples"] == 8).all()


def test_steps_marked_with_tp_step_around_an_update_by_hand():
    """A loop with no optimizer marks its steps with ``tp.step()`` (the README's advice): each
    iteration is one step, never a second, empty one for the update no hook saw."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    loader = torch.utils.data.DataLoader(truth.Regression(), batch_size=8)
    losses = []
    with tp.profile(steps=STEPS, warmup=WARMUP, name="marked", progress=False, clock_hz=0) as prof:
        for x, y in loader:
            loss = F.mse_loss(model(x), y)
            loss.backward()
            losses.append(loss.item())
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.01 * p.grad
                    p.grad = None
            tp.step()
    assert len(losses) == STEPS + WARMUP
    assert prof.run.steps["loss"].tolist() == pytest.approx(losses, rel=1e-6)
    assert not any("no optimizer.step() tpkit saw" in n for n in prof.run.meta["notes"])
    # backward passes ran and no optimizer step was seen: the run says its update is other
    assert any("no optimizer step was seen" in n and UNSEEN_OPTIMIZER_NOTE in n for n in prof.run.meta["notes"])


class OwnSGD:
    """A framework's own optimizer (no ``torch.optim.Optimizer``, none tpkit follows): SGD, the
    gradients zeroed in place after the update, as fastai's and Keras's keep them."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params

    @torch.no_grad()
    def step(self) -> None:
        for p in self.params:
            p -= 0.01 * p.grad
            p.grad.zero_()


@pytest.mark.parametrize("marked", [False, True], ids=["unmarked", "tp.step()"])
def test_backward_passes_with_an_optimizer_tpkit_does_not_see_are_never_a_loop_without_one(marked):
    """Every iteration runs a backward and an update by an optimizer tpkit does not follow (a
    framework's own). Unmarked, no step is recorded and the run had said "in a loop without an
    optimizer, call tp.step()": it says backward passes ran and the loop's optimizer is not one
    tpkit sees, and where to call ``tp.step()``. Marked, the steps are the loop's and the run
    says the update's time and state are other, not optimizer. Truth: the loop's own count of
    backward passes and updates."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = OwnSGD(list(model.parameters()))
    x, y = torch.randn(8, 8), torch.randn(8, 1)
    passes = 0
    with tp.profile(steps=STEPS, warmup=WARMUP, name="own-optimizer", progress=False, clock_hz=0) as prof:
        for _ in range(STEPS + WARMUP):
            F.mse_loss(model(x), y).backward()
            opt.step()
            passes += 1
            if marked:
                tp.step()
    notes = prof.run.meta["notes"]
    assert passes == STEPS + WARMUP
    assert len(prof.run.steps) == (passes if marked else 0)
    assert not any("without an optimizer" in n for n in notes), notes
    if marked:
        assert any("no optimizer step was seen" in n and UNSEEN_OPTIMIZER_NOTE in n for n in notes), notes
        assert prof.run.steps["optimizer_s"].sum() == 0
    else:
        assert any("no step was recorded although backward passes ran" in n and UNSEEN_OPTIMIZER_NOTE in n
                   and "call tp.step() right after each update" in n for n in notes), notes


@pytest.mark.parametrize("marked", [False, True], ids=["unmarked", "tp.step()"])
def test_a_saliency_loop_over_a_frozen_model_is_no_loop_with_an_unseen_optimizer(marked):
    """Backward passes that only give the loop input gradients (a saliency map over a frozen
    model, no optimizer anywhere) update nothing: the run says nothing of an optimizer tpkit does
    not see (a first version of that note said "its update's time is in other_s ... its state in
    memory's other" of a loop with no update and no state). Unmarked, it keeps the advice for a
    loop without an optimizer."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    model.requires_grad_(False)
    maps = []
    with tp.profile(steps=STEPS, warmup=WARMUP, name="saliency", progress=False, clock_hz=0) as prof:
        for _ in range(STEPS + WARMUP):
            x = torch.randn(8, 8, requires_grad=True)
            model(x).sum().backward()
            maps.append(x.grad.abs())
            if marked:
                tp.step()
    notes = prof.run.meta["notes"]
    assert len(maps) == STEPS + WARMUP
    assert not any(UNSEEN_OPTIMIZER_NOTE in n for n in notes), notes
    if not marked:
        assert any("in a loop without an optimizer, call tp.step()" in n for n in notes), notes


class WithUnused(torch.nn.Module):
    """A model whose first parameters get no gradient (an auxiliary head the loss skips)."""

    def __init__(self) -> None:
        super().__init__()
        self.aux = torch.nn.Linear(8, 8)
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


@pytest.mark.parametrize("loop", ["eager, clamped while accumulating", "compiled, next batch read first",
                                  "compiled, first layer unused", "compiled, SAM", "compiled, head only"])
def test_the_unseen_update_rule_on_loops_around_it(loop):
    """An eager loop that clamps its weights after each of four accumulated backwards is never
    cut by the rule (its first step had been split in fragments); a compiled step after the
    next batch was read ends its step at the next forward, one whose model's first layer gets no
    gradient or whose optimizer holds only the head is still seen (they had never ended their
    slice), and SAM around a compiled step is one step an iteration (its perturbation before
    the second pass on the same batch had ended a step)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = WithUnused() if "unused" in loop else torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    params = list(model[2].parameters()) if "head only" in loop else list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.01, momentum=0.9)
    step = opt.step if loop.startswith("eager") else torch.compile(opt.step, backend="eager")
    it = iter(torch.utils.data.DataLoader(truth.Regression(), batch_size=8))
    losses, updates = [], 0
    with tp.profile(steps=STEPS, warmup=WARMUP, name="around", progress=False, clock_hz=0) as prof:
        if loop.startswith("eager"):
            while True:
                total = 0.0
                for _ in range(4):
                    x, y = next(it)
                    loss = F.mse_loss(model(x), y)
                    loss.backward()
                    total += loss.item()
                    with torch.no_grad():
                        for p in model.parameters():
                            p.clamp_(-1.0, 1.0)
                losses.append(total)
                updates += 1
                step()
                opt.zero_grad()
        elif "SAM" in loop:
            for x, y in it:
                opt.zero_grad()
                loss = F.mse_loss(model(x), y)
                loss.backward()
                losses.append(loss.item())
                with torch.no_grad():
                    eps = [0.05 * p.grad / (p.grad.norm() + 1e-12) for p in model.parameters()]
                    for p, e in zip(model.parameters(), eps):
                        p.add_(e)
                opt.zero_grad()
                F.mse_loss(model(x), y).backward()
                with torch.no_grad():
                    for p, e in zip(model.parameters(), eps):
                        p.sub_(e)
                updates += 1
                step()
        else:
            x, y = next(it)
            while True:
                if "head only" in loop:
                    opt.zero_grad()
                loss = F.mse_loss(model(x), y)
                loss.backward()
                losses.append(loss.item())
                nxt = next(it) if "read first" in loop else None
                updates += 1
                step()
                opt.zero_grad()
                x, y = nxt if nxt is not None else next(it)
    run = prof.run
    assert len(run.steps) == STEPS + WARMUP
    if loop.startswith("eager"):
        assert updates == STEPS + WARMUP
        assert run.steps["loss"].tolist() == pytest.approx(losses, rel=1e-5)
        assert (run.steps["samples"] == 32).all()
        assert not any("no optimizer.step() tpkit saw" in n for n in run.meta["notes"])
    else:
        assert updates in (STEPS + WARMUP, STEPS + WARMUP + 1)  # the slice ended
        assert any("no optimizer.step() tpkit saw" in n for n in run.meta["notes"])
        if "SAM" in loop:
            assert (run.steps["samples"] == 8).all() and run.steps["loss"].tolist() == pytest.approx(
                losses[:STEPS + WARMUP], rel=1e-5)


UPDATES = {"SGD, eager backend": ("SGD", "eager", False, "zero_grad"),
           "Adam, inductor, model compiled": ("Adam", "inductor", True, "zero_grad"),
           "SGD, gradients set to None by hand": ("SGD", "eager", False, "by hand")}


def compiled_update_loop(variant: str) -> dict:
    """The compiled-optimizer recipe as users write it inside a cell: ``@torch.compile def
    step_fn(): opt.step()`` made inside the slice, batches made in the loop (``torch.randn``: no
    loader, nothing handed out that tpkit sees), each iteration sleeping 30 ms first. Returns the
    run, the loop's losses, its iterations and its clock before each forward (where each step
    ends: at the forward on the next batch)."""
    name, backend, compile_model, drop = UPDATES[variant]
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    g = torch.Generator().manual_seed(1)
    losses: list[float] = []
    marks: list[float] = []
    iterations = 0
    with tp.profile(steps=STEPS, warmup=WARMUP, name="compiled-update", progress=False, clock_hz=0) as prof:
        f = torch.compile(model, backend="eager") if compile_model else model
        opt = torch.optim.SGD(model.parameters(), lr=0.01) if name == "SGD" else \
            torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01))

        @torch.compile(backend=backend)
        def step_fn() -> None:
            opt.step()

        for _ in range(STEPS + WARMUP + 2):
            iterations += 1
            x, y = torch.randn(32, 16, generator=g), torch.randn(32, 1, generator=g)
            time.sleep(0.03)
            marks.append(time.perf_counter())
            loss = F.mse_loss(f(x), y)
            loss.backward()
            losses.append(loss.item())
            step_fn()
            if drop == "by hand":
                for p in model.parameters():
                    p.grad = None
            else:
                opt.zero_grad()
    torch._dynamo.reset()
    return dict(run=prof.run, losses=losses, marks=marks, iterations=iterations)


@pytest.mark.parametrize("variant", [
    "SGD, eager backend",
    pytest.param("Adam, inductor, model compiled", marks=[
        pytest.mark.slow, pytest.mark.skipif(_c_compiler() is None, reason="inductor needs a C++ compiler")]),
    "SGD, gradients set to None by hand"])
def test_a_step_function_compiled_inside_the_slice_ends_each_step(variant):
    """``@torch.compile def step_fn(): opt.step()`` in a loop that makes its batches itself:
    dynamo compiles tpkit's optimizer hooks away, and the update rule had waited for a batch
    handed out that never came: no step recorded in 7 iterations ("no-steps", "call
    tp.step()"). Each update ends its step at the forward on the next batch (a new input
    tensor: SAM's second pass reuses its batch): one step an iteration, the loop's losses, the
    slice stops the loop at the forward after its last step, and each step lasts what the
    loop's clock says from one forward to the next."""
    got = compiled_update_loop(variant)
    run, marks = got["run"], got["marks"]
    steps = run.steps
    assert len(steps) == STEPS + WARMUP and run.meta["complete"]
    assert got["iterations"] == STEPS + WARMUP + 1  # stopped at the next iteration's forward
    assert steps["loss"].tolist() == pytest.approx(got["losses"], rel=1e-6)
    assert any(n.startswith(f"{STEPS + WARMUP} step(s) ended with no optimizer.step() tpkit saw run")
               for n in run.meta["notes"]), run.meta["notes"]
    ends = marks[1:]  # where each step ended (the next forward), by the loop's clock
    for step in range(1, STEPS + WARMUP):
        want = ends[step] - ends[step - 1]
        got_s = steps["duration_s"].iloc[step]
        assert abs(got_s - want) <= truth.TOLERANCE * want + 0.002, f"step {step}: {got_s:.4f} s, loop {want:.4f} s"


def test_sam_with_its_batches_made_in_the_loop_is_one_step_an_iteration():
    """An eager SAM loop over a list of batches (no loader: nothing handed out): its perturbation
    and ``zero_grad()`` before its first ``step()`` look like an update no hook saw; the second
    pass is given the same input tensor, so no step ends there (ending at the ``zero_grad()``
    had split the first iteration in two, a step with the perturbed pass's loss)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = [(torch.randn(8, 8), torch.randn(8, 1)) for _ in range(STEPS + WARMUP + 2)]
    first: list[float] = []
    with tp.profile(steps=STEPS, warmup=WARMUP, name="sam-list", progress=False, clock_hz=0) as prof:
        for x, y in data:
            loss = F.mse_loss(model(x), y)
            loss.backward()
            first.append(loss.item())
            with torch.no_grad():
                eps = [0.05 * p.grad / (p.grad.norm() + 1e-12) for p in model.parameters()]
                for p, e in zip(model.parameters(), eps):
                    p.add_(e)
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            with torch.no_grad():
                for p, e in zip(model.parameters(), eps):
                    p.sub_(e)
            opt.step()
            opt.zero_grad()
    assert len(first) == len(prof.run.steps) == STEPS + WARMUP
    assert prof.run.steps["loss"].tolist() == pytest.approx(first, rel=1e-6)


def test_a_step_function_compiled_inside_the_slice_with_dynamo_first_imported_there(tmp_path):
    """The same recipe in a process that never imported dynamo (the cell's first torch.compile
    inside the slice): it had recorded no step either. Truth: the loop's losses and clock."""
    child = Path(__file__).with_name("fresh_compile_child.py")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(tp.__file__).parents[1]),
                                                                      os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, str(child), "step", str(tmp_path / "run")], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    run = tp.load(str(tmp_path / "run"))
    steps = run.steps
    assert len(steps) == got["warmup"] + got["steps"] == got["iterations"] - 1 and run.meta["complete"]
    assert steps["loss"].tolist() == pytest.approx(got["losses"], rel=1e-6)
    ends = got["marks"][1:]
    for step in range(1, len(steps)):
        want = ends[step] - ends[step - 1]
        got_s = steps["duration_s"].iloc[step]
        assert abs(got_s - want) <= truth.TOLERANCE * want + 0.002, f"step {step}: {got_s:.4f} s, loop {want:.4f} s"


def test_a_model_compiled_in_another_thread_leaves_the_loop_profiled():
    """A compile session holds torch's process-wide compiling flag: a model compiled in another
    thread (a backend taking 1.5 s here) had turned every hook off for the loop too (a
    background compile of 12-14 s left 4 of 40 steps recorded and the slice unended). The flag
    counts for the thread whose session it is now. Truth: the loop's iterations (the slice ends
    after exactly warmup + steps of them) and its clock around each forward."""
    import threading

    def slow_backend(gm: torch.fx.GraphModule, _inputs: list) -> object:
        time.sleep(1.5)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(torch.nn.Linear(2, 2), backend="eager")(torch.randn(1, 2))  # dynamo's one-time set-up
    other = torch.compile(torch.nn.Linear(8, 8), backend=slow_backend)
    compiling = threading.Event()

    def compile_in_background() -> None:
        compiling.set()
        other(torch.randn(4, 8))

    torch.manual_seed(0)
    model = truth.SleepyNet()
    opt = truth.SleepySGD(model.parameters(), lr=0.01)
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    forwards: list[float] = []
    before = truth.hook_state()
    worker = threading.Thread(target=compile_in_background)
    with tp.profile(steps=STEPS, warmup=WARMUP, name="background-compile", progress=False, clock_hz=0) as prof:
        worker.start()
        compiling.wait()
        time.sleep(0.2)  # inside its session now
        for _ in range(100):
            t = time.perf_counter()
            out = model(x)
            forwards.append(time.perf_counter() - t)
            F.mse_loss(out, y).backward()
            opt.step()
            opt.zero_grad()
    worker.join()
    torch._dynamo.reset()
    truth.assert_hooks_removed(before)
    run = prof.run
    assert len(forwards) == STEPS + WARMUP == len(run.steps)  # every iteration a step, and the slice ended
    assert run.meta["complete"] and run.steps["compile_s"].sum() == 0  # not the loop's compile
    for step, (got, want) in enumerate(zip(run.steps["forward_s"], forwards)):
        assert abs(got - want) <= truth.TOLERANCE * want + 0.002, f"step {step}: forward {got:.4f} s, truth {want:.4f}"


def whole_step_loop(profile: bool, warm: bool, after: int = 0) -> dict:
    """A training step compiled as one function (forward, ``loss.backward()``, ``opt.step()``,
    ``opt.zero_grad()``; aot_eager), first called inside the slice (or, ``warm``, three times
    before it), with no ``tp.step()``. A hook on the last layer's weight sleeps 30 ms inside each
    backward (the autograd engine runs it: dynamo runs ``loss.backward()`` eagerly at a graph
    break) and times its own sleeps. Returns dynamo's counters and codes, the loop's losses,
    its calls and the hook's seconds, and the run; with ``after``, dynamo's compilations and graph
    breaks in that many more calls after the slice (a next cell)."""
    from torch._dynamo import convert_frame

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    slept: list[float] = []

    @torch.compiler.disable  # its own clock: no compilation inside it
    def sleepy(grad: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        time.sleep(0.03)
        slept.append(time.perf_counter() - t0)
        return grad

    model[2].weight.register_hook(sleepy)

    @torch.compile(backend="aot_eager")
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(32, 16, generator=g), torch.randn(32, 1, generator=g)) for _ in range(8)]
    if warm:
        for x, y in data[:3]:
            train_step(x, y)
    codes0 = {id(r()) for r in convert_frame.input_codes.seen}
    frames0, breaks0 = counters["frames"]["total"], sum(counters["graph_break"].values())
    since_us = time.time_ns() // 1000  # dynamo's records are a bounded deque: counted by their start
    losses: list[float] = []
    calls, run = 0, None
    slept.clear()
    if profile:
        with tp.profile(steps=STEPS, warmup=WARMUP, name="whole-step", progress=False, clock_hz=0) as prof:
            for i in range(100):
                calls += 1
                losses.append(train_step(*data[i % 8]).item())
        run = prof.run
    else:
        for i in range(STEPS + WARMUP):
            calls += 1
            losses.append(train_step(*data[i % 8]).item())
    codes = [c for r in convert_frame.input_codes.seen if (c := r()) is not None and id(c) not in codes0]
    out = dict(run=run, losses=losses, calls=calls, slept=list(slept),
               frames=counters["frames"]["total"] - frames0, breaks=sum(counters["graph_break"].values()) - breaks0,
               compilations=sum(1 for r in get_compilation_metrics() if (r.start_time_us or 0) >= since_us),
               graphs=counters["stats"]["unique_graphs"],
               codes={(c.co_name, os.path.basename(c.co_filename)) for c in codes},
               tpkit_codes=sorted(c.co_name for c in codes if f"{os.sep}tpkit{os.sep}" in c.co_filename))
    if after:
        since_us, breaks0 = time.time_ns() // 1000, sum(counters["graph_break"].values())
        for x, y in data[:after]:
            train_step(x, y)
        out.update(after_compilations=sum(1 for r in get_compilation_metrics() if (r.start_time_us or 0) >= since_us),
                   after_breaks=sum(counters["graph_break"].values()) - breaks0)
    torch._dynamo.reset()
    return out


def test_a_step_compiled_whole_compiles_as_without_tpkit():
    """tpkit's wrappers of ``torch.autograd.backward`` and ``Optimizer.zero_grad`` run where dynamo
    breaks its graph (``Tensor.backward`` calls the first eagerly; the second is a function dynamo
    does not trace): dynamo had compiled each as a frame of user code and broken again inside it
    at torch's function, and compiled tpkit's bookkeeping frame by frame (6 graph breaks for 4,
    10 compilations for 8, 74 frames for 64). Now the same breaks and compilations as without
    tpkit, and no frame of tpkit's (dynamo's guard on torch's table of optimizer step hooks,
    which tpkit's join, leaves out one frame of torch's: no more)."""
    plain = whole_step_loop(profile=False, warm=False)
    sliced = whole_step_loop(profile=True, warm=False)
    assert sliced["tpkit_codes"] == []
    assert (sliced["breaks"], sliced["compilations"], sliced["graphs"]) == \
        (plain["breaks"], plain["compilations"], plain["graphs"])
    assert sliced["codes"] <= plain["codes"], sliced["codes"] - plain["codes"]
    assert plain["frames"] - 1 <= sliced["frames"] <= plain["frames"]
    # the slice stopped the loop after its steps, in the next call (at its backward: the compiled
    # forward before it is nothing tpkit sees)
    assert sliced["calls"] == STEPS + WARMUP + 1 and len(sliced["losses"]) == STEPS + WARMUP
    assert sliced["losses"] == plain["losses"]  # bit for bit


@pytest.mark.parametrize("warm", [False, True], ids=["compiled in the slice", "compiled before it"])
def test_a_step_compiled_whole_is_seen_where_dynamo_runs_it_eagerly(warm):
    """The whole step compiled, no ``tp.step()``: tpkit had recorded no step (the slice never
    ended: "in a loop without an optimizer, call tp.step()"), no backward, and read
    OVERHEAD-BOUND with advice about Python between phases. Each compiled update ends a step
    (at the ``zero_grad()`` dynamo runs eagerly after it), the backward dynamo runs eagerly is
    timed (the hook's 30 ms sleeps in it), the losses are the loop's, and the run names the
    compiled function whose forward and optimizer step it cannot see; a step compiled before the
    slice recompiles there because of tpkit's optimizer hooks, and the run says so."""
    out = whole_step_loop(profile=True, warm=warm)
    run = out["run"]
    notes = run.meta["notes"]
    steps = run.steps
    # the loop's losses, the last call's too: the loop stops in the next call, at its backward
    assert len(steps) == STEPS + WARMUP == len(out["losses"]) and out["calls"] == STEPS + WARMUP + 1
    assert steps["loss"].tolist() == pytest.approx(out["losses"], rel=1e-6)
    measured = steps[~steps.warmup]
    slept = out["slept"][WARMUP:]
    assert len(slept) == STEPS
    for backward, truth_s in zip(measured["backward_s"], slept):
        assert truth_s <= backward < truth_s + 0.05
    assert not any("call tp.step()" in n for n in notes), notes
    assert any("ran inside train_step (test_compile.py), compiled by torch.compile as a whole" in n for n in notes), notes
    v = run.summary().verdict
    assert v.kind != "overhead-bound" and "Python between phases" not in v.text, v.text
    recompiled = [n for n in notes if "recompiled" in n and "because of tpkit" in n]
    assert bool(recompiled) == warm, notes


def test_an_eager_loop_whose_backward_is_in_a_disabled_helper_is_no_compiled_step():
    """An eager loop (nothing compiled) calls ``loss.backward()`` inside a helper decorated with
    ``torch.compiler.disable`` and sleeps 40 ms a step outside every phase (its logging). The
    disable wrapper lives in dynamo's eval_frame.py as torch.compile's does: the loop had read as a
    step compiled whole (meta['compiled_step'], a note, COMPUTE-BOUND "the compiled step"). Now no
    compiled step is named and the verdict is about the 40 ms outside the phases."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    @torch.compiler.disable
    def backward(loss: torch.Tensor) -> None:
        loss.backward()

    data = [(torch.randn(8, 8), torch.randn(8, 1)) for _ in range(8)]
    slept: list[float] = []
    with tp.profile(steps=STEPS, warmup=WARMUP, progress=False, clock_hz=0) as prof:
        for i in range(100):
            x, y = data[i % 8]
            backward(F.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
            t0 = time.perf_counter()
            time.sleep(0.04)
            slept.append(time.perf_counter() - t0)
    run = prof.run
    assert "compiled_step" not in run.meta
    assert not any("compiled by torch.compile as a whole" in n for n in run.meta["notes"])
    measured = run.steps[~run.steps.warmup]
    assert measured["other_s"].sum() >= sum(slept[WARMUP:WARMUP + STEPS]) - 0.01
    assert measured["backward_s"].min() > 0
    v = run.summary().verdict
    assert v.kind == "overhead-bound" and "compiled step" not in v.text, v.text


def test_a_step_compiled_whole_in_the_slice_is_said_to_recompile_after_it():
    """A step compiled whole inside the slice compiles again in the next cell (dynamo guards it on
    torch's table of optimizer hooks, which tpkit's joined), with a graph break more; the same
    loop without tpkit compiles nothing more. The notes say so, and no longer say that none of
    the slice's graph breaks is tpkit's as if that were all."""
    plain = whole_step_loop(profile=False, warm=False, after=3)
    sliced = whole_step_loop(profile=True, warm=False, after=3)
    assert (plain["after_compilations"], plain["after_breaks"]) == (0, 0)
    assert sliced["after_compilations"] > 0 and sliced["after_breaks"] == 1
    notes = sliced["run"].meta["notes"]
    assert not any("none caused by tpkit" in n for n in notes), notes
    assert any("after the slice the step compiles again with one graph break more, because of tpkit" in n
               for n in notes), notes
    assert any("the step compiles once more after the slice" in n and "a graph break more in the next cell" in n
               for n in notes), notes
