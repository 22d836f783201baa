"""The Recorder's ``enter`` / ``exit`` in C (``recorder_spans.c``) record what the Python methods
record: the same spans, open counts, stack, CUDA events, listener calls and own time, for any
sequence of boundaries, listeners that raise included. Times come from one clock and differ
between two recorders; everything else is compared exactly, and the times by what they must
satisfy."""

from __future__ import annotations

import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tpkit.capture import recorder as recorder_module
from tpkit.capture.probes import native
from tpkit.capture.recorder import PYTHON_ENTER, PYTHON_EXIT, SPAN_FIELDS, Recorder

PHASES = ["forward", "backward", "optimizer", "data_wait", "h2d"]


def c_methods() -> tuple[Any, Any]:
    ext, why, _ = native.load(recorder_module.SPANS_EXTENSION, recorder_module.SPANS_SOURCE)
    if ext is None:
        pytest.skip(f"the C spans cannot be built here: {why}")
    return ext.methods(Recorder, PYTHON_ENTER, PYTHON_EXIT, vars(recorder_module), time.perf_counter_ns)


class FakeTimer:
    """A CUDA timer stand-in: each mark is the next integer (the order of marks is compared)."""

    def __init__(self) -> None:
        self.n = 0

    def mark(self) -> int:
        self.n += 1
        return self.n


class Listener:
    """A phase listener that notes what it was told and raises where asked."""

    def __init__(self, raise_on: tuple[str, str] | None = None) -> None:
        self.calls: list[tuple[str, str, int]] = []
        self.raise_on = raise_on

    def __call__(self, phase: str, event: str, step: int) -> None:
        self.calls.append((phase, event, step))
        if self.raise_on == (phase, event):
            raise RuntimeError(f"listener raised at {phase} {event}")


def without_times(rec: Recorder) -> list[tuple]:
    return [(p, d, src, step, sev, ev) for p, _s, _e, d, src, step, sev, ev in rec.spans]


def run(ops: list[tuple], enter: Any, exit_: Any, timer: bool, listeners: int) -> tuple[Recorder, list, list]:
    """Apply ``ops`` to a fresh recorder through ``enter`` / ``exit``; returns the recorder, what
    each op returned or raised, and what the listeners were told."""
    rec = Recorder()
    if timer:
        rec.cuda_timer = FakeTimer()
    told = [Listener(raise_on=("backward", "exit") if i == 1 else None) for i in range(listeners)]
    rec.phase_listeners.extend(told)
    tokens: list[int] = []
    out: list = []
    for op in ops:
        try:
            if op[0] == "enter":
                tokens.append(enter(rec, op[1], op[2]))
                out.append(tokens[-1])
            elif op[0] == "exit":
                token = tokens[op[1] % len(tokens)] if tokens else 0
                out.append(exit_(rec, token))
            else:
                rec.end_step()
                out.append("step")
        except RuntimeError as e:
            out.append(str(e))
    return rec, out, [t.calls for t in told]


op = st.one_of(st.tuples(st.just("enter"), st.sampled_from(PHASES), st.sampled_from(["user", "M", "autograd"])),
               st.tuples(st.just("exit"), st.integers(0, 6)),
               st.tuples(st.just("step")))


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(op, max_size=40), timer=st.booleans(), listeners=st.integers(0, 2))
def test_c_and_python_record_the_same(ops: list[tuple], timer: bool, listeners: int) -> None:
    c_enter, c_exit = c_methods()
    py, py_out, py_told = run(ops, PYTHON_ENTER, PYTHON_EXIT, timer, listeners)
    c, c_out, c_told = run(ops, c_enter, c_exit, timer, listeners)
    assert c_out == py_out
    assert c_told == py_told
    assert without_times(c) == without_times(py)
    assert c._open == py._open
    assert [e[:1] + e[2:] for e in c._stack] == [e[:1] + e[2:] for e in py._stack]
    assert c.step_index == py.step_index
    if timer:
        assert c.cuda_timer.n == py.cuda_timer.n
    # the times: every span ends where or after it starts, and tpkit's own time is its spans'
    for _p, s, e, *_ in c.spans:
        assert s <= e
    assert c.own_host_ns == sum(e - s for p, s, e, *_ in c.spans if p == "tpkit")


def test_a_boundarys_own_span_sits_between_the_phases_it_separates() -> None:
    """enter: the listeners' time ends before the phase starts; exit: it starts after the phase ends."""
    c_enter, c_exit = c_methods()
    rec = Recorder()
    rec.phase_listeners.append(lambda *a: time.sleep(0.002))
    c_exit(rec, c_enter(rec, "forward", "M"))
    own_in, fwd, own_out = rec.spans
    assert (own_in[0], fwd[0], own_out[0]) == ("tpkit", "forward", "tpkit")
    assert own_in[2] <= fwd[1] and fwd[2] <= own_out[1]
    assert own_in[2] - own_in[1] >= 2_000_000 and own_out[2] - own_out[1] >= 2_000_000
    assert fwd[2] - fwd[1] < 2_000_000  # the listeners' sleeps are not the phase's
    assert rec.own_host_ns == (own_in[2] - own_in[1]) + (own_out[2] - own_out[1])


def test_the_c_clock_is_perf_counter_ns() -> None:
    ext, why, _ = native.load(recorder_module.SPANS_EXTENSION, recorder_module.SPANS_SOURCE)
    if ext is None:
        pytest.skip(why)
    before = time.perf_counter_ns()
    mine = ext.perf_counter_ns()
    after = time.perf_counter_ns()
    assert before <= mine <= after


def test_a_clock_replaced_in_the_recorder_module_is_the_one_read(monkeypatch) -> None:
    """As the Python methods read ``recorder.perf_counter_ns`` (a test's fake clock), so do the C ones."""
    c_enter, c_exit = c_methods()
    ticks = iter(range(1000, 100000, 1000))
    monkeypatch.setattr(recorder_module, "perf_counter_ns", lambda: next(ticks))
    rec = Recorder()
    rec.phase_listeners.append(lambda *a: None)
    c_exit(rec, c_enter(rec, "forward", "M"))
    assert [s[:3] for s in rec.spans] == [("tpkit", 2000, 3000), ("forward", 4000, 5000), ("tpkit", 6000, 7000)]
    assert rec.own_host_ns == 2000


def test_keywords_and_wrong_calls_behave_as_the_python_methods() -> None:
    c_enter, c_exit = c_methods()
    rec = Recorder()
    token = c_enter(rec, phase="forward", source="Model")
    assert rec._stack[0][0] == "forward" and rec._stack[0][3] == "Model"
    c_exit(rec, token=token)
    assert without_times(rec) == [("forward", 0, "Model", 0, None, None)]
    for call in (lambda: c_enter(rec), lambda: c_enter(rec, "a", "b", "c"), lambda: c_enter(rec, "a", colour="red"),
                 lambda: c_exit(rec), lambda: c_exit(rec, 0, 1)):
        with pytest.raises(TypeError):
            call()
    with pytest.raises(TypeError):
        c_exit(rec, None)  # as the Python: len(stack) > None


def test_a_recorder_holding_other_types_goes_through_the_python_methods() -> None:
    """A recorder whose tables are not what the Python writes (a list subclass, a token that is
    no int) is handed to the Python methods before anything is recorded: same result."""
    c_enter, c_exit = c_methods()

    class Stack(list):
        pass

    class Token(int):
        pass

    rec = Recorder()
    rec._stack = Stack()
    token = c_enter(rec, "forward", "M")
    c_exit(rec, Token(token))
    assert rec._open == {"forward": 0} and len(rec.spans) == 1 and isinstance(rec._stack, Stack)
    assert token == 0


def test_the_recorder_uses_c_once_built_and_python_when_asked() -> None:
    try:
        why = recorder_module.use_c_spans(True)
        if why is not None:
            pytest.skip(why)
        assert type(Recorder.enter).__name__ == "method_descriptor" and recorder_module.c_spans_why() is None
        assert recorder_module.use_c_spans(False) == "the Python methods were asked for (recorder.C_SPANS = False)"
        assert Recorder.enter is PYTHON_ENTER and Recorder.exit is PYTHON_EXIT
    finally:
        recorder_module.use_c_spans(recorder_module.C_SPANS)


def test_a_snapshot_records_into_itself() -> None:
    """The C methods read the recorder they are called on (a copy from ``snapshot`` has its own lists)."""
    c_enter, c_exit = c_methods()
    rec = Recorder()
    c_exit(rec, c_enter(rec, "forward", "M"))
    snap = rec.snapshot()
    c_exit(snap, c_enter(snap, "backward", "autograd"))
    assert [s[0] for s in rec.spans] == ["forward"]
    assert [s[0] for s in snap.spans] == ["forward", "backward"]


def test_spans_are_whole_records() -> None:
    _c_enter, _c_exit = c_methods()
    rec = Recorder()
    for _ in range(3):
        rec.exit(rec.enter("forward"))
    assert len(rec._spans) == 3 * SPAN_FIELDS
