"""How the phase probe finds the forward: ``nn.Module.__call__`` replaced for the slice
(``module_calls.py``), on its C route and on its Python one alike. One ``forward`` span per
outermost call of the loop's thread, named after that module; inner calls, other threads' calls
and calls inside other phases open none; an exception closes the span; removal puts torch's
call back, and a ``nn.Module.__call__`` kept by code made during the slice only passes on
afterwards. On the C route an inner call runs no Python of tpkit's, and torch.compile sees the
same Python function on both routes: no graph break, no recompile when the slice ends."""

from __future__ import annotations

import sys
import threading
from collections import Counter
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tpkit.capture.probes import module_calls, native
from tpkit.capture.probes.phases import PhaseProbe
from tpkit.capture.recorder import Recorder

TORCH_CALL = torch.nn.Module.__dict__["__call__"]
ROUTES = ("C", "Python")


@pytest.fixture(params=ROUTES)
def route(request, monkeypatch):
    """Each test runs on both routes (``module_calls.C_ROUTE``)."""
    monkeypatch.setattr(module_calls, "C_ROUTE", request.param == "C")
    return request.param


class Boom(Exception):
    pass


class Node(torch.nn.Module):
    """Calls its children in order, then raises if ``fail`` (after they ran)."""

    def __init__(self, children: list["Node"], fail: bool = False) -> None:
        super().__init__()
        self.kids = torch.nn.ModuleList(children)
        self.fail = fail

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for k in self.kids:
            try:
                x = k(x)
            except Boom:
                pass  # a model that catches its submodule's error goes on
        if self.fail:
            raise Boom
        return x


def forward_spans(rec: Recorder) -> list[tuple]:
    return [s for s in rec.spans if s[0] == "forward"]


@pytest.fixture
def probe(route):
    p = PhaseProbe(Recorder("calls")).install()
    assert (module_calls._route is not None) == (route == "C")
    yield p
    p.remove()
    assert torch.nn.Module.__dict__["__call__"] is TORCH_CALL


def test_one_span_per_outermost_call_named_after_it(probe):
    model = Node([Node([Node([])]), Node([])])
    x = torch.zeros(1)
    model(x)
    model(x)
    spans = forward_spans(probe.rec)
    assert [s[4] for s in spans] == ["Node", "Node"]  # source: the outermost module's class
    assert all(s[1] <= s[2] for s in spans) and spans[0][2] <= spans[1][1]
    assert module_calls.inside() is None and probe.models.live() == [model]


def test_an_exception_inside_forward_closes_the_span_and_the_next_call_is_outermost_again(probe):
    model = Node([Node([])], fail=True)
    with pytest.raises(Boom):
        model(torch.zeros(1))
    assert module_calls.inside() is None and not probe.rec.is_open("forward")
    Node([])(torch.zeros(1))
    assert len(forward_spans(probe.rec)) == 2


def test_a_module_called_inside_another_phase_is_not_the_forward(probe):
    token = probe.rec.enter("data_wait", "loader")
    Node([Node([])])(torch.zeros(1))  # a transform module while the batch is made
    probe.rec.exit(token)
    assert forward_spans(probe.rec) == [] and module_calls.inside() is None


def test_another_threads_module_calls_leave_the_loops_forward_alone(probe):
    inner_ran = threading.Event()

    class Waits(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            t = threading.Thread(target=lambda: (Node([Node([])])(x), inner_ran.set()))
            t.start()
            t.join()
            return x

    probe._ever_worked = True  # the loop has trained: no other thread is adopted
    Waits()(torch.zeros(1))
    assert inner_ran.is_set()
    spans = forward_spans(probe.rec)
    assert [s[4] for s in spans] == ["Waits"] and module_calls.inside() is None


def test_after_removal_a_kept_module_call_only_passes_on(route):
    p = PhaseProbe(Recorder("calls")).install()
    kept = torch.nn.Module.__call__  # what a model compiled inside the slice would hold
    assert kept is module_calls._module_call
    p.remove()
    assert torch.nn.Module.__dict__["__call__"] is TORCH_CALL
    assert torch.equal(kept(torch.nn.Identity(), torch.ones(2)), torch.ones(2))
    assert forward_spans(p.rec) == []


def test_a_second_probe_at_once_is_refused_and_the_first_keeps_working(probe):
    with pytest.raises(RuntimeError, match="one slice at a time"):
        PhaseProbe(Recorder("second")).install()
    assert torch.nn.Module.__call__ is module_calls._module_call
    Node([])(torch.zeros(1))
    assert len(forward_spans(probe.rec)) == 1


# a call tree: each node is (fails, children)
trees = st.recursive(st.tuples(st.booleans(), st.just([])),
                     lambda kids: st.tuples(st.booleans(), st.lists(kids, max_size=3)), max_leaves=12)


def build(tree: tuple) -> Node:
    fail, kids = tree
    return Node([build(k) for k in kids], fail=fail)


@pytest.mark.parametrize("c_route", [True, False], ids=ROUTES)
@settings(max_examples=40, deadline=None)
@given(forest=st.lists(trees, min_size=1, max_size=4))
def test_any_call_tree_with_any_failures_gives_one_closed_span_per_outermost_call(c_route, forest):
    module_calls.C_ROUTE = c_route
    try:
        p = PhaseProbe(Recorder("calls")).install()
    finally:
        module_calls.C_ROUTE = True
    try:
        for tree in forest:
            try:
                build(tree)(torch.zeros(1))
            except Boom:
                pass
        spans = forward_spans(p.rec)
        assert len(spans) == len(forest)
        assert all(s[3] == 0 for s in spans)  # depth 0: none nested in another
        assert module_calls.inside() is None and not p.rec.is_open("forward")
    finally:
        p.remove()


def _tpkit_frames_during(fn) -> list[str]:
    """Python frames of ``module_calls.py`` and ``phases.py`` entered while ``fn()`` runs (not the
    probe's garbage-collection callback, which a collection may run at any moment)."""
    ours = {module_calls.__file__, sys.modules[PhaseProbe.__module__].__file__}
    seen = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename in ours and frame.f_code.co_name not in ("<genexpr>", "_gc"):
            seen.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


def test_on_the_c_route_only_the_outermost_call_runs_tpkit_python(route):
    """Seven module calls: on the C route the outermost goes to the probe (its handler, and,
    the first time a model trains, the one noting it and the models it wraps; the first time a
    class is called, the one asking whether it is a metric: the thread is marked inside by the
    route's own C setter), the six inside it reach torch with no Python of tpkit's; on the
    Python route each of the seven runs ``_module_call`` first, and the two marks are Python."""
    model = Node([Node([Node([]), Node([])]), Node([Node([]), Node([])])])
    p = PhaseProbe(Recorder("calls")).install()
    try:
        frames = _tpkit_frames_during(lambda: model(torch.zeros(1)))
    finally:
        p.remove()
    assert len(forward_spans(p.rec)) == 1
    # (_input_ref: the outermost call's input noted while no loader tpkit sees hands out batches)
    outer = {"_outer_call": 1, "_same_model": 1, "_input_ref": 1, "_is_metric": 1}
    assert Counter(frames) == (outer if route == "C" else {**outer, "_module_call": 7, "set_inside": 2})


def test_reading_the_call_gives_the_python_function_on_both_routes(route):
    """What dynamo, ``inspect`` and code reading ``nn.Module.__call__`` see; a bound
    ``module.__call__(x)`` spelled out is routed the same (one span)."""
    import inspect

    p = PhaseProbe(Recorder("calls")).install()
    try:
        assert torch.nn.Module.__call__ is module_calls._module_call
        held = torch.nn.Module.__dict__["__call__"]
        assert (held is module_calls._module_call) == (route == "Python")
        model = Node([Node([])])
        assert list(inspect.signature(model.__call__).parameters) == ["args", "kwargs"]
        model.__call__(torch.zeros(1))
    finally:
        p.remove()
    assert [s[4] for s in forward_spans(p.rec)] == ["Node"]


def test_a_model_compiled_inside_the_slice_has_no_graph_break_nor_a_recompile_after(route):
    """dynamo traces the Python function on both routes: one graph with ``fullgraph=True``, and
    calling the compiled model after the slice reuses it (had dynamo met the C object it would
    have guarded on it and compiled again once the slice put torch's call back)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = Node([Node([Node([])]), Node([])])
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    x = torch.ones(3)
    p = PhaseProbe(Recorder("calls")).install()
    try:
        out = compiled(x)
    finally:
        p.remove()
    graphs = counters["stats"]["unique_graphs"]
    after = compiled(x)
    try:
        assert torch.equal(out, x) and torch.equal(after, x)
        assert [s[4] for s in forward_spans(p.rec)] == ["OptimizedModule"]
        assert graphs == 1 and counters["stats"]["unique_graphs"] == 1
        assert not counters["graph_break"]
    finally:
        torch._dynamo.reset()


def test_without_the_c_route_the_python_one_runs_and_the_run_says_why(monkeypatch):
    monkeypatch.setattr(module_calls, "_c_route", lambda: (None, "RuntimeError: no C compiler"))
    p = PhaseProbe(Recorder("calls")).install()
    try:
        assert torch.nn.Module.__dict__["__call__"] is module_calls._module_call
        Node([Node([])])(torch.zeros(1))
    finally:
        p.remove()
    assert len(forward_spans(p.rec)) == 1
    assert any("Python route" in n and "no C compiler" in n for n in p.rec.notes)


def test_a_source_that_does_not_compile_fails_once_with_the_compilers_words(tmp_path, monkeypatch):
    monkeypatch.setenv("TPKIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "_loaded", {})
    bad = tmp_path / "bad.c"
    bad.write_text("#include <Python.h>\nthis is not C;\n")
    module, why, built_s = native.load("tpkit_bad", bad)
    assert module is None and built_s == 0.0 and why is not None
    assert why.startswith("RuntimeError: the compiler failed") and "error" in why
    bad.write_text("")  # a second load does not compile again: the failure is remembered
    assert native.load("tpkit_bad", bad)[1] == why


def test_without_the_compiler_the_failure_names_it(tmp_path, monkeypatch):
    import sysconfig

    real = sysconfig.get_config_var
    monkeypatch.setattr(sysconfig, "get_config_var",
                        lambda name: "tpkit-no-such-cc -shared" if name == "LDSHARED" else real(name))
    monkeypatch.setenv("TPKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "_loaded", {})
    module, why, _ = native.load(module_calls.EXTENSION_NAME, module_calls.SOURCE)
    assert module is None
    assert why == "RuntimeError: no C compiler: 'tpkit-no-such-cc', the one this Python was built with, is not installed"
    assert not list(tmp_path.iterdir())  # no half-written file left


def test_a_build_is_cached_across_processes(tmp_path):
    """The first process compiles (its build time is reported), the next loads the cached file."""
    import subprocess

    code = ("import sys; from tpkit.capture.probes import module_calls as m, native; "
            "mod, why, s = native.load(m.EXTENSION_NAME, m.SOURCE); "
            "print(why is None and hasattr(mod, 'Route'), s > 0)")
    env = {**__import__("os").environ, "TPKIT_CACHE_DIR": str(tmp_path)}
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                           check=True).stdout.split() for _ in range(2)]
    assert runs == [["True", "True"], ["True", "False"]]
    assert len(list(Path(tmp_path).glob("tpkit_module_calls-*"))) == 1
