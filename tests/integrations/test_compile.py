"""``torch.compile`` under a slice: tpkit's hooks must not change what dynamo compiles.

Truth: the same loop run without tpkit (dynamo's own counters: graphs captured and graph
breaks), and the forward time the loop measures around each call of the compiled module.
``backend="eager"`` needs no C compiler; inductor runs only where one works (slow).
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.nn.functional as F
import truth
from torch._dynamo.utils import counters
from truth import STEPS, WARMUP

import tpkit as tp


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
    run = eager_sliced["run"]
    truth.assert_hooks_removed(eager_sliced["before"])
    assert len(run.steps) == STEPS + WARMUP and run.complete
    truth.assert_phases(run, eager_sliced["truth"], phases=("forward",))
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
    truth.assert_phases(sliced["run"], sliced["truth"], phases=("forward",))
    assert not any("no module's forward" in n for n in sliced["run"].meta["notes"])


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
