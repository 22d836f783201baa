"""How the phase probe finds the forward: ``nn.Module.__call__`` replaced for the slice
(``_module_call``). One ``forward`` span per outermost call of the loop's thread, named after
that module; inner calls, other threads' calls and calls inside other phases open none; an
exception closes the span; removal puts torch's call back, and a ``_module_call`` kept by code
made during the slice only passes on afterwards."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tpkit.capture.probes import phases
from tpkit.capture.probes.phases import PhaseProbe
from tpkit.capture.recorder import Recorder

TORCH_CALL = torch.nn.Module.__dict__["__call__"]


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
def probe():
    p = PhaseProbe(Recorder("calls")).install()
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
    assert probe._inside is None and list(probe.models.values()) == [model]


def test_an_exception_inside_forward_closes_the_span_and_the_next_call_is_outermost_again(probe):
    model = Node([Node([])], fail=True)
    with pytest.raises(Boom):
        model(torch.zeros(1))
    assert probe._inside is None and not probe.rec.is_open("forward")
    Node([])(torch.zeros(1))
    assert len(forward_spans(probe.rec)) == 2


def test_a_module_called_inside_another_phase_is_not_the_forward(probe):
    token = probe.rec.enter("data_wait", "loader")
    Node([Node([])])(torch.zeros(1))  # a transform module while the batch is made
    probe.rec.exit(token)
    assert forward_spans(probe.rec) == [] and probe._inside is None


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
    assert [s[4] for s in spans] == ["Waits"] and probe._inside is None


def test_after_removal_a_kept_module_call_only_passes_on():
    p = PhaseProbe(Recorder("calls")).install()
    kept = torch.nn.Module.__call__  # what a model compiled inside the slice would hold
    assert kept is phases._module_call
    p.remove()
    assert torch.nn.Module.__dict__["__call__"] is TORCH_CALL
    assert torch.equal(kept(torch.nn.Identity(), torch.ones(2)), torch.ones(2))
    assert forward_spans(p.rec) == []


def test_a_second_probe_at_once_is_refused_and_the_first_keeps_working(probe):
    with pytest.raises(RuntimeError, match="one slice at a time"):
        PhaseProbe(Recorder("second")).install()
    assert torch.nn.Module.__dict__["__call__"] is phases._module_call
    Node([])(torch.zeros(1))
    assert len(forward_spans(probe.rec)) == 1


# a call tree: each node is (fails, children)
trees = st.recursive(st.tuples(st.booleans(), st.just([])),
                     lambda kids: st.tuples(st.booleans(), st.lists(kids, max_size=3)), max_leaves=12)


def build(tree: tuple) -> Node:
    fail, kids = tree
    return Node([build(k) for k in kids], fail=fail)


@settings(max_examples=60, deadline=None)
@given(st.lists(trees, min_size=1, max_size=4))
def test_any_call_tree_with_any_failures_gives_one_closed_span_per_outermost_call(forest):
    p = PhaseProbe(Recorder("calls")).install()
    try:
        for tree in forest:
            try:
                build(tree)(torch.zeros(1))
            except Boom:
                pass
        spans = forward_spans(p.rec)
        assert len(spans) == len(forest)
        assert all(s[3] == 0 for s in spans)  # depth 0: none nested in another
        assert p._inside is None and not p.rec.is_open("forward")
    finally:
        p.remove()
