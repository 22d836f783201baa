"""benchmarks/overhead.py's estimator (benchmarks/interleave.py): modes in short blocks inside one
training run, each block divided by the no-profiler blocks on either side of it. On a host that
runs the core at two speeds by turns (docs/MEASURED.md, "Timing ground truth"), it must recover a
mode's true cost where a ratio of pooled medians does not, and say "undecided" rather than
"met" when its interval straddles a goal."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    for name in ("overhead", "interleave", "common"):
        sys.modules.pop(name, None)
    import interleave
    import overhead

    return overhead, interleave


def test_every_mode_block_sits_between_two_baseline_blocks_and_the_order_rotates(bench):
    _, il = bench
    plan = il.schedule(["a", "b", "c"], cycles=3)
    assert plan[0] == plan[-1] == il.BASE
    assert all(m == il.BASE for m in plan[0::2]) and il.BASE not in plan[1::2]
    cycles = [plan[1 + 6 * c:7 + 6 * c:2] for c in range(3)]
    assert cycles == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]


class FakeClock:
    """perf_counter for the runner: a loop step advances it by the step's simulated time."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Costly:
    """A profiler whose steps take ``factor`` times as long while it is entered."""

    active: "Costly | None" = None

    def __init__(self, factor: float) -> None:
        self.factor = factor

    def __enter__(self) -> "Costly":
        Costly.active = self
        return self

    def __exit__(self, *exc) -> None:
        Costly.active = None


class DriftingLoop:
    """A loop on a host that is slow (1.9x) for stretches of 20-200 steps, a third of the time,
    whose first step after a switch costs 50 ms more (a profiler starting): the runner must drop it."""

    def __init__(self, clock: FakeClock, step_s: float = 0.010, seed: int = 0) -> None:
        self.clock, self.step_s, self.rng = clock, step_s, random.Random(seed)
        self.slow, self.left = False, 0
        self.steps_since_switch = 0

    def train(self, runner) -> None:
        runner.start()
        while True:
            if self.left == 0:
                self.slow, self.left = self.rng.random() < 1 / 3, self.rng.randint(20, 200)
            self.left -= 1
            factor = Costly.active.factor if Costly.active else 1.0
            t = self.step_s * factor * (1.9 if self.slow else 1.0) * (1 + 0.01 * self.rng.random())
            if len(runner._rec.ends) == 1:
                t += 0.050
            self.clock.now += t
            if not runner.step_end():
                return


def test_paired_blocks_recover_a_three_percent_cost_on_a_drifting_host(bench, monkeypatch):
    oh, il = bench
    clock = FakeClock()
    monkeypatch.setattr(oh, "clock", clock)
    monkeypatch.setattr(oh.gc, "collect", lambda *a: 0)  # nothing to collect in a simulation
    monkeypatch.setattr(oh, "MODES", {"none": lambda s, w: Costly(1.0), "tpkit": lambda s, w: Costly(1.03),
                                      "peer": lambda s, w: Costly(1.20)})
    out: dict = {}
    cycles = oh.measure_blocks(DriftingLoop(clock), ["none", "tpkit", "peer"], skip=3, block=8, budget_s=100.0,
                               watch=oh.GcWatch(), out=out)
    assert cycles >= 100
    est = il.estimate([r for _, r in out["tpkit"].pairs])
    assert est.lo <= 1.03 <= est.hi and est.hi - est.lo < 0.02, est
    assert est.verdict(1.05) == "met" and est.verdict(1.02) == "NOT met" and est.verdict(1.03) == "undecided"
    ahead = il.difference(out["peer"].pairs, out["tpkit"].pairs)
    assert ahead.lo > 0.15 and ahead.hi < 0.20, ahead
    # every kept step of a block is one of its 8; the 50 ms start of each block was dropped
    assert len(out["tpkit"].steps) == 8 * len(out["tpkit"].pairs)
    assert max(out["none"].steps) < 0.010 * 1.9 * 1.02


def test_pooled_medians_are_fooled_by_where_the_slow_stretches_fell(bench):
    """Why blocks: the same two modes run one after the other (a mode's whole run, then the
    other's) read whatever the host did in each run."""
    _, il = bench
    rng = random.Random(3)

    def run(factor: float, slow_share: float, n: int = 400) -> list[float]:
        return [0.010 * factor * (1.9 if rng.random() < slow_share else 1.0) for _ in range(n)]

    import statistics

    none, tpkit = run(1.0, 0.2), run(1.03, 0.6)  # the host was slow more often during tpkit's run
    assert statistics.median(tpkit) / statistics.median(none) > 1.5


def test_quotient_and_difference_pair_blocks_of_the_same_cycle(bench):
    _, il = bench
    a = [(0, 1.10), (1, 1.20), (2, 1.30), (3, 1.40)]
    b = [(0, 1.00), (1, 1.00), (2, 1.25), (3, 1.40)]
    assert il.quotient(a, b).value == pytest.approx((1.04 + 1.10) / 2)  # of 1.10, 1.20, 1.04, 1.00
    assert il.difference(a, b).value == pytest.approx((0.05 + 0.10) / 2)  # of 0.10, 0.20, 0.05, 0.00
    assert il.quotient(a[:2], b[2:]) is None  # no cycle in common
    assert il.estimate([1.0, 2.0]) is None  # too few to say anything
    assert il.estimate([1.0, 1.01, 0.99, 1.0]).verdict(1.05) == "too few blocks"  # an interval, no verdict


def _verdicts(oh, monkeypatch, costs: dict) -> tuple[dict, dict]:
    """Modes costing ``costs`` (x the step) measured on the drifting host; the goal checks'
    verdicts by what they say (" (like for like)" kept), and the samples."""
    clock = FakeClock()
    monkeypatch.setattr(oh, "clock", clock)
    monkeypatch.setattr(oh.gc, "collect", lambda *a: 0)
    monkeypatch.setattr(oh, "MODES", {m: lambda s, w, c=c: Costly(c) for m, c in costs.items()})
    out: dict = {}
    oh.measure_blocks(DriftingLoop(clock), list(costs), skip=3, block=8, budget_s=100.0, watch=oh.GcWatch(), out=out)
    checks = {what.split(" (")[0] + (" (like for like)" if "like for like" in what else ""): verdict
              for what, _, verdict in oh.goal_checks(out)}
    return checks, out


def test_goal_checks_compare_the_default_and_like_for_like_modes_with_each_peer(bench, monkeypatch):
    """torch.profiler's CPU mode records no memory: the report says whether the default (memory on)
    is ahead of it, and whether tpkit with memory off, the same work, is."""
    oh, _ = bench
    checks, _ = _verdicts(oh, monkeypatch, {"none": 1.0, "tpkit default": 1.04, "tpkit memory off": 1.005,
                                            "tpkit phases only": 1.003, "torch.profiler CPU": 1.02,
                                            "torch.profiler + memory": 1.10})
    assert checks["tpkit default <= 1.05x"] == "met"
    assert checks["tpkit default ahead of torch.profiler CPU"] == "NOT met"
    assert checks["tpkit memory off ahead of torch.profiler CPU (like for like)"] == "met"
    assert checks["tpkit default ahead of torch.profiler + memory"] == "met"
    assert not any("like for like" in k and "+ memory" in k for k in checks)


def test_memory_off_with_stream_runs_the_bare_stream_inside_a_memory_off_profile_and_leaves_nothing(bench):
    """The component mode that takes the default apart: the allocator stream on inside a tpkit
    profile without its memory probe, both gone after; a stream that cannot start ends the profile."""
    import torch

    oh, _ = bench
    call = torch.nn.Module.__call__
    model = torch.nn.Linear(4, 4)
    with oh.COMPONENT_MODES["tpkit memory off + stream"](2, 0) as mode:
        assert torch.autograd._profiler_enabled()
        assert torch.nn.Module.__call__ is not call  # tpkit's phase probe is in
        for _ in range(2):
            model(torch.randn(2, 4)).sum().backward()
    assert not torch.autograd._profiler_enabled() and torch.nn.Module.__call__ is call
    assert mode.run is not None and mode.run.memory.empty  # no memory probe: no memory rows
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        with pytest.raises(RuntimeError, match="already running"):
            oh.COMPONENT_MODES["tpkit memory off + stream"](2, 0).__enter__()
        assert torch.nn.Module.__call__ is call


def test_lightning_loop_runs_lightnings_own_profiler_for_its_blocks_only(bench, monkeypatch):
    """On the Lightning loop, Lightning's SimpleProfiler (a peer its users compare with) times
    every step of its blocks, as ``Trainer(profiler="simple")`` would, and the Trainer's own
    profiler is back for the no-profiler blocks; the other loops never run that mode."""
    pytest.importorskip("lightning")
    pytest.importorskip("transformers")
    from lightning.pytorch.profilers import PassThroughProfiler

    oh, _ = bench
    made, restored = [], []

    class Kept(oh.LightningProfiler):
        def __init__(self, steps, warmup):
            super().__init__(steps, warmup)
            made.append(self)

        def __exit__(self, *exc):
            super().__exit__(*exc)
            restored.append(type(oh.LightningLoop.trainer.profiler))

    monkeypatch.setitem(oh.LOOP_MODES, "Lightning SimpleProfiler", (oh.LightningLoop, Kept))
    monkeypatch.setattr(oh.gc, "collect", lambda *a: 0)
    loop = oh.LightningLoop(1)
    out: dict = {}
    cycles = oh.measure_blocks(loop, ["none", "Lightning SimpleProfiler"], skip=1, block=2, budget_s=0.0,
                               watch=oh.GcWatch(), out=out)
    assert cycles == 3 and len(made) == 3
    for mode in made:  # each block: 1 dropped + 2 kept steps, every one timed by Lightning's profiler
        assert len(mode.profiler.recorded_durations["run_training_batch"]) == 3
    assert restored == [PassThroughProfiler] * 3
    assert len(out["Lightning SimpleProfiler"].steps) == 3 * 2 and len(out["none"].pairs) == 0
    assert oh.LightningLoop.trainer is None  # the fit is over
    assert oh.modes_for(object(), ["none", "Lightning SimpleProfiler"]) == ["none"]


def test_lightnings_simple_profiler_is_set_against_phases_only_like_for_like(bench, monkeypatch):
    """Lightning's SimpleProfiler times hooks and records no memory: beside the default's line the
    report sets tpkit's phases only against it; on loops where it did not run there is no line."""
    oh, _ = bench
    monkeypatch.setattr(oh, "LOOP_MODES", {})
    checks, out = _verdicts(oh, monkeypatch, {"none": 1.0, "tpkit default": 1.06, "tpkit phases only": 1.015,
                                              "Lightning SimpleProfiler": 1.0})
    assert checks["tpkit default ahead of Lightning SimpleProfiler"] == "NOT met"
    assert checks["tpkit phases only ahead of Lightning SimpleProfiler (like for like)"] == "NOT met"
    del out["Lightning SimpleProfiler"]
    monkeypatch.setattr(oh, "LOOP_MODES", {"Lightning SimpleProfiler": (oh.LightningLoop, None)})
    assert not any("SimpleProfiler" in what for what, _, _ in oh.goal_checks(out))


def test_own_process_differences_are_told_apart_only_beyond_what_launches_alone_differ_by(bench, monkeypatch):
    """tpkit and TraceML each run in a launch of their own, and two launches of one program run
    up to ~2% apart: a lead smaller than that is undecided however narrow its interval, a larger
    one is met; when the run's own A/A differs by more, that is the bar."""
    oh, _ = bench
    costs = {"none": 1.0, oh.TRACEML: 1.05, oh.TPKIT_OWN: 1.04, oh.TPKIT_WHOLE: 1.00, oh.SECOND_LAUNCH: 1.0}
    checks, _ = _verdicts(oh, monkeypatch, costs)
    assert checks[f"{oh.TPKIT_OWN} ahead of {oh.TRACEML}"].startswith("undecided (launches alone differ by up to 0.020")
    assert checks[f"{oh.TPKIT_WHOLE} ahead of {oh.TRACEML}"] == "met"  # 0.05 ahead
    checks, _ = _verdicts(oh, monkeypatch, {**costs, oh.SECOND_LAUNCH: 1.06})  # this run's launches: 6% apart
    assert checks[f"{oh.TPKIT_WHOLE} ahead of {oh.TRACEML}"].startswith("undecided (launches alone differ by up to 0.06")
    checks, _ = _verdicts(oh, monkeypatch, {**costs, oh.TPKIT_WHOLE: 1.09})  # 0.04 behind
    assert checks[f"{oh.TPKIT_WHOLE} ahead of {oh.TRACEML}"] == "NOT met"
    assert oh.launch_spread(None) == oh.LAUNCH_SPREAD


def _launch(oh, il, speeds: dict[str, float], cycles: int = 12) -> list:
    """One launch of the own-process modes taking turns: each mode's blocks run at ``speeds``
    (its own process's pace, the profiler's cost included) against the baseline's, with a little
    block-to-block jitter."""
    rng = random.Random(len(speeds) * 1000 + int(sum(speeds.values()) * 1e4))
    order = [m for m in (*oh.SUBPROCESS_MODES[1:], oh.TPKIT_LIKE_TRACEML) if m in speeds]
    blocks = []
    for mode in il.schedule(order, cycles):
        pace = 1.0 if mode == il.BASE else speeds[mode]
        cycle = max(len(blocks) - 1, 0) // (2 * len(order))
        blocks.append(il.Block(mode, cycle, steps=[0.01 * pace * rng.uniform(0.998, 1.002) for _ in range(8)]))
    return blocks


def test_with_several_launches_tpkit_against_traceml_is_read_across_launches(bench):
    """Each launch sets its processes' pace apart by up to ~2%, shared by all of its blocks, so one
    launch each cannot tell a 1.5-point lead. Across five launches whose differences agree, the
    lead is met though under LAUNCH_SPREAD; differences that change sign from launch to launch stay
    undecided; with two launches the verdict falls back to the launch spread."""
    oh, il = bench
    lead = [(1.060, 1.045), (1.040, 1.024), (1.052, 1.038), (1.045, 1.031), (1.058, 1.042)]  # TraceML, tpkit
    out: dict = {}
    for traceml, tpkit in lead:
        oh.add_own_process(out, _launch(oh, il, {oh.TRACEML: traceml, oh.TPKIT_OWN: tpkit, oh.SECOND_LAUNCH: 1.0,
                                                 oh.TPKIT_LIKE_TRACEML: traceml + 0.004}))
    assert [round(x, 3) for x in out[oh.TRACEML].launches] == [t for t, _ in lead]
    assert len({c for c, _ in out[oh.TRACEML].pairs}) == 5 * 12  # every launch's cycles kept apart
    checks = {what.split(" (")[0]: (value, verdict) for what, value, verdict in oh.goal_checks(out)}
    value, verdict = checks[f"{oh.TPKIT_OWN} ahead of {oh.TRACEML}"]
    assert verdict == "met (across 5 launches)"
    assert float(value.split()[0]) == pytest.approx(0.015, abs=0.001)
    # like for like (memory off, as TraceML records no CPU allocation): 0.004 behind, every launch
    assert checks[f"{oh.TPKIT_LIKE_TRACEML} ahead of {oh.TRACEML}"][1] == "NOT met (across 5 launches)"

    mixed = [(1.050, 1.040), (1.040, 1.055), (1.052, 1.038), (1.041, 1.050), (1.058, 1.042)]
    out = {}
    for traceml, tpkit in mixed:
        oh.add_own_process(out, _launch(oh, il, {oh.TRACEML: traceml, oh.TPKIT_OWN: tpkit}))
    checks = {what.split(" (")[0]: verdict for what, _, verdict in oh.goal_checks(out)}
    assert checks[f"{oh.TPKIT_OWN} ahead of {oh.TRACEML}"] == "undecided (across 5 launches)"

    out = {}
    for traceml, tpkit in lead[:2]:
        oh.add_own_process(out, _launch(oh, il, {oh.TRACEML: traceml, oh.TPKIT_OWN: tpkit}))
    checks = {what.split(" (")[0]: verdict for what, _, verdict in oh.goal_checks(out)}
    assert checks[f"{oh.TPKIT_OWN} ahead of {oh.TRACEML}"].startswith("undecided (launches alone differ by up to 0.020")


def test_a_mean_interval_over_launches_uses_students_t(bench):
    _, il = bench
    e = il.mean_interval([1.0, 2.0, 3.0])  # mean 2, sd 1, t(2) = 4.303
    assert (e.value, e.n) == (2.0, 3)
    assert e.hi - e.value == pytest.approx(4.303 / 3 ** 0.5, rel=1e-4)
    assert il.mean_interval([0.5]) is None
    assert il.mean_interval([0.5, 0.5]).lo == 0.5


def _clock_runs(oh, fast_cost: float, slow: tuple, fast: tuple) -> dict:
    """Ten cycles: phases only at 1.0x, the 200 Hz sampler at ``fast_cost`` of it; each block's
    sampler (CPU share of a core, wake-ups a second) at 20 and 200 Hz."""
    r = {m: oh.Samples() for m in ("tpkit phases only", "tpkit memory off", oh.CLOCKS_FAST)}
    for c in range(10):
        r["tpkit phases only"].pairs.append((c, 1.0))
        r["tpkit memory off"].pairs.append((c, 1.0))
        r[oh.CLOCKS_FAST].pairs.append((c, fast_cost))
        r["tpkit memory off"].sampler.append(slow)
        r[oh.CLOCKS_FAST].sampler.append(fast)
    return r


def test_the_clock_samplers_cost_at_20_hz_is_read_from_200_hz_by_the_larger_of_its_two_scales(bench):
    """Per wake-up or per CPU-second of the sampler's, whichever mix: the 20 Hz cost is at most the
    larger quotient of the two rates' wake-ups and CPU shares times the 200 Hz cost."""
    oh, _ = bench
    # the CPU share grew 4x for 10x the wake-ups (a read every 0.2 s at either rate): scale 0.25
    est, said = oh.clock_bound(_clock_runs(oh, 1.04, slow=(0.003, 20.0), fast=(0.012, 200.0)))
    assert est.value == pytest.approx(1.01) and est.hi == pytest.approx(1.01)
    assert "x0.25" in said and "0.30% / 1.20% of a core" in said and "20 / 200 wake-ups" in said
    # a sampler whose share grew more than its wake-ups: the wake-ups' scale is the larger
    est, said = oh.clock_bound(_clock_runs(oh, 1.04, slow=(0.001, 20.0), fast=(0.02, 100.0)))
    assert est.value == pytest.approx(1.008) and "x0.20" in said
    checks = {w.split(" (")[0]: v for w, _, v in oh.goal_checks(_clock_runs(oh, 1.02, (0.003, 20.0), (0.012, 200.0)))}
    assert checks["clocks at 20 Hz <= 1.01x, read from 200 Hz"] == "met"  # 1.005x for 1.02x at 200 Hz
    assert checks["clocks at 20 Hz <= 1.01x"] == "met"  # memory off / phases only, 1.000x here
    assert oh.clock_bound({m: s for m, s in _clock_runs(oh, 1.04, (0.003, 20.0), (0.012, 200.0)).items()
                           if m != oh.CLOCKS_FAST}) is None  # not run at 200 Hz: no bound
