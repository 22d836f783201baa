"""CUDA-event phase timing, through a stand-in for torch.cuda whose events carry a GPU clock
and whose elapsed_time rounds like CUDA's (a 32-bit float of milliseconds)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import tpkit.capture.probes.cuda_timing as ct


class FakeCuda:
    """A GPU clock (ns) that the test moves; events take its time when recorded."""

    def __init__(self) -> None:
        self.gpu_ns = 0
        self.capturing = False
        self.syncs = 0
        fake = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                self.t = None

            def record(self) -> None:
                self.t = fake.gpu_ns

            def elapsed_time(self, other: "Event") -> float:
                return float(np.float32((other.t - self.t) / 1e6))  # ms, as a float32

        self.Event = Event

    def synchronize(self) -> None:
        self.syncs += 1

    def is_current_stream_capturing(self) -> bool:
        return self.capturing


@pytest.fixture
def clock(monkeypatch):
    """Host time the test sets: perf_counter_ns in the timer module reads it."""
    now = SimpleNamespace(ns=10**12)
    monkeypatch.setattr(ct, "perf_counter_ns", lambda: now.ns)
    return now


def test_phase_durations_an_hour_in_keep_microsecond_precision(clock):
    cuda = FakeCuda()
    timer = ct.CudaTimer(SimpleNamespace(cuda=cuda))
    marks, truth = [], []
    for _ in range(7200):  # an hour of half-second steps, each boundary 123,457 ns into the step
        clock.ns += 500_000_000
        cuda.gpu_ns += 500_000_000
        marks.append(timer.mark())
        cuda.gpu_ns += 123_457
        marks.append(timer.mark())
        truth += [cuda.gpu_ns - 123_457, cuda.gpu_ns]
    timer.finish()
    got = np.array([timer.resolve(m) for m in marks]) - timer.ref_host_ns
    truth = np.array(truth)
    durations, true_durations = got[1::2] - got[0::2], truth[1::2] - truth[0::2]
    assert np.abs(durations - true_durations).max() < 1_000  # each phase to under 1 µs, an hour in
    assert np.abs(got - truth).max() < 250_000  # where the step sits: the float's drift, bounded
    single_ref = np.array([float(np.float32(t / 1e6)) * 1e6 for t in truth])
    single_durations = single_ref[1::2] - single_ref[0::2]
    assert np.abs(single_durations - true_durations).max() > 50_000  # what one reference event gave


def test_no_sync_per_boundary(clock):
    cuda = FakeCuda()
    timer = ct.CudaTimer(SimpleNamespace(cuda=cuda))
    start = cuda.syncs
    for _ in range(1000):
        clock.ns += 1_000_000
        timer.mark()
    assert cuda.syncs == start
    timer.finish()
    assert cuda.syncs == start + 1


def test_boundaries_inside_a_cuda_graph_capture_keep_host_time(clock):
    cuda = FakeCuda()
    timer = ct.CudaTimer(SimpleNamespace(cuda=cuda))
    cuda.capturing = True
    assert timer.mark() is None  # an event recorded during capture would never complete
    cuda.capturing = False
    assert timer.mark() is not None
    assert timer.meta()["cuda_timing"]["host_stamped_in_graph_capture"] == 1


def test_a_loop_without_an_optimizer_ends_steps_on_the_gpu(clock):
    """tp.step() loops: the step's end is its GPU end, like the spans, not a host stamp."""
    from tpkit.capture.build import build_run
    from tpkit.capture.recorder import Recorder

    cuda = FakeCuda()
    rec = Recorder("gpu")
    rec.t0_ns = clock.ns
    rec.cuda_timer = ct.CudaTimer(SimpleNamespace(cuda=cuda))
    for _ in range(3):
        tok = rec.enter("forward", "test")
        clock.ns += 1_000_000  # the host queues 1 ms of work...
        cuda.gpu_ns += 10_000_000  # ...that takes 10 ms on the GPU
        rec.exit(tok)
        rec.end_step()
    run = build_run(rec, 0)
    fwd = run.spans[run.spans["phase"] == "forward"]
    assert list(run.steps["end_s"]) == pytest.approx(list(fwd["end_s"]), abs=1e-6)
    assert run.steps["duration_s"].iloc[1] == pytest.approx(0.010, abs=1e-6)


def test_the_gpu_ends_its_queued_steps_before_the_clock_sampler_stops(monkeypatch):
    """The host runs ahead of the GPU; a sampler stopped when the host's last step ends misses
    the GPU's last steps. The slice waits for the GPU (its one end sync) before stopping it."""
    import torch

    import tpkit as tp
    import tpkit.capture.slice as slice_mod
    from tpkit.capture.probes import clocks

    order: list[str] = []
    cuda = FakeCuda()
    cuda.synchronize = lambda: order.append("gpu sync")  # type: ignore[method-assign]
    monkeypatch.setattr(slice_mod, "maybe_cuda_timer", lambda: ct.CudaTimer(SimpleNamespace(cuda=cuda)))
    remove = clocks.ClockProbe.remove

    def noted_remove(self):  # noqa: ANN001, ANN202
        order.append("sampler stopped")
        return remove(self)

    monkeypatch.setattr(clocks.ClockProbe, "remove", noted_remove)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tp.profile(steps=3, warmup=1, progress=False, memory=False, clock_hz=50) as prof:
        while True:
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
    assert len(prof.run.steps) == 4
    start_syncs = 2  # CudaTimer's: before and after its reference event
    # the sampler stops at the last step's end, once the GPU has ended it; the loop is stopped
    # at its next training action after that, and the slice's end syncs once more
    assert order[start_syncs:start_syncs + 2] == ["gpu sync", "sampler stopped"]


def test_on_a_gpu_tpkit_spans_are_what_the_gpu_waited_for(clock, monkeypatch):
    """A listener's host work (400 us a boundary) is charged to the GPU's timeline only where
    the GPU had nothing queued: with 10 ms of work queued ahead it waited for nothing."""
    import tpkit.capture.recorder as recorder_mod
    from tpkit.capture.build import build_run
    from tpkit.capture.recorder import Recorder

    monkeypatch.setattr(recorder_mod, "perf_counter_ns", lambda: clock.ns)
    cuda = FakeCuda()
    rec = Recorder("gpu")
    rec.t0_ns = clock.ns
    rec.cuda_timer = ct.CudaTimer(SimpleNamespace(cuda=cuda))
    idle = {"gpu": False}

    def listener(phase, event, step):  # noqa: ANN001, ANN202
        clock.ns += 400_000
        if idle["gpu"]:  # the GPU ran out of work: its clock goes on with the host's
            cuda.gpu_ns += 400_000

    rec.phase_listeners.append(listener)
    for gpu_idle in (False, True):
        idle["gpu"] = gpu_idle
        tok = rec.enter("forward", "test")
        clock.ns += 1_000_000
        cuda.gpu_ns += 10_000_000
        rec.exit(tok)
        rec.end_step()
    run = build_run(rec, 0)
    own = run.spans[run.spans["phase"] == "tpkit"].groupby("step")["duration_s"].sum()
    assert own.loc[0] == pytest.approx(0.0, abs=1e-9)  # queued work: the GPU never waited
    assert own.loc[1] == pytest.approx(0.0008, abs=1e-6)  # idle: both boundaries' 400 us
    assert rec.own_host_ns == 4 * 400_000


def test_on_the_host_tpkit_spans_border_the_phases_and_never_overlap(monkeypatch):
    """A listener's time is a ``tpkit`` span that ends where the phase it opens starts and starts
    where the phase it closes ends: one clock read a boundary, and no time between a phase and
    tpkit's that is no one's. Where an exit closes spans an exception left open, their listeners'
    spans follow one another (the clock here moves 1 us at each read)."""
    import tpkit.capture.recorder as recorder_mod
    from tpkit.capture.recorder import Recorder

    now = SimpleNamespace(ns=10**12)

    def read() -> int:
        now.ns += 1_000
        return now.ns

    monkeypatch.setattr(recorder_mod, "perf_counter_ns", read)
    rec = Recorder("cpu")
    rec.phase_listeners.append(lambda phase, event, step: setattr(now, "ns", now.ns + 300_000))
    outer = rec.enter("forward", "test")
    now.ns += 1_000_000
    rec.enter("loss", "test")  # left open: the forward's exit closes it too
    now.ns += 2_000_000
    rec.exit(outer)
    own = sorted((a, b) for p, a, b, *_ in rec.spans if p == "tpkit")
    fwd = next((a, b) for p, a, b, *_ in rec.spans if p == "forward")
    loss = next((a, b) for p, a, b, *_ in rec.spans if p == "loss")
    assert own[0][1] == fwd[0] and own[1][1] == loss[0]  # enters: the phase starts as its listeners end
    assert loss[1] == fwd[1] == own[2][0]  # both close at the exit's stamp; the first listeners start there
    assert own[2][1] == own[3][0]  # the second's follow them
    assert [b - a for a, b in own] == [301_000] * 4  # the listener's 300 us and the clock read after it
    assert rec.own_host_ns == sum(b - a for a, b in own)
