"""A loose guard on what tpkit's default profile costs a plain training loop: a short version
of benchmarks/overhead.py (the built-in tiny transformer; no profiler vs ``tp.profile`` with
phases, memory and clocks), the median over rounds of each round's paired ratio of median step
times, <= 1.10.

The goals are tighter (<= 1.05, issue 14); this only catches a regression without flaking on a
shared machine: the test skips, saying why, when two rounds with no profiler differ by more
than 30%, and a ratio over the limit is measured once more before it fails (a regression
repeats, a neighbour's burst seldom does). torch runs on one thread (the ``one_thread``
fixture): on a busy 2-core machine a two-thread pool stretches steps 10-100x.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
LIMIT = 1.10
ROUNDS, STEPS, SKIP = 6, 12, 2
BUDGET_S = 90  # about 10 s on two idle cores; far longer means the machine is busy


def _measure(overhead) -> tuple[float, list[float]]:
    """Ratio tpkit default / none (median of the rounds' paired ratios) and the per-round
    medians of none."""
    t0 = time.perf_counter()
    loop = overhead.PlainLoop()
    loop.run(SKIP + 3, overhead.nullcontext())  # warm caches and the allocator
    watch = overhead.GcWatch().install()
    samples = {"none": overhead.Samples(), "tpkit default": overhead.Samples()}
    try:
        for r in range(ROUNDS):
            order = ["none", "tpkit default"] if r % 2 == 0 else ["tpkit default", "none"]
            for mode in order:
                overhead.measure(loop, overhead.MODES[mode], STEPS, SKIP, watch, samples[mode])
            if time.perf_counter() - t0 > BUDGET_S:
                pytest.skip(f"machine too loaded to measure: {r + 1} of {ROUNDS} rounds took "
                            f"{time.perf_counter() - t0:.0f} s (about 10 s on two idle cores)")
    finally:
        watch.remove()
    # paired: each round's tpkit median over the same round's no-profiler median, then the median
    # of those; a machine that drifts between rounds moves both halves of a pair alike
    pairs = zip(samples["tpkit default"].round_medians, samples["none"].round_medians)
    ratio = statistics.median(t / n for t, n in pairs)
    return ratio, samples["none"].round_medians


@pytest.mark.slow
def test_default_profile_costs_a_plain_loop_at_most_ten_percent(monkeypatch, one_thread):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    sys.modules.pop("overhead", None)
    import overhead

    ratios = []
    for _attempt in range(2):
        ratio, none_rounds = _measure(overhead)
        lo, hi = min(none_rounds), max(none_rounds)
        if hi > 1.3 * lo:
            pytest.skip(f"machine too loaded to measure: rounds with no profiler took {lo * 1e3:.1f} to "
                        f"{hi * 1e3:.1f} ms/step (more than 30% apart)")
        ratios.append(ratio)
        if ratio <= LIMIT:
            break
    assert min(ratios) <= LIMIT, (f"tpkit default made the plain loop's step {min(ratios):.3f}x as long as with no "
                                  f"profiler (limit {LIMIT}x; measured {', '.join(f'{r:.3f}' for r in ratios)})")


def test_tpkit_adds_at_most_four_gc_tracked_objects_per_step():
    """Python's collector runs a young-generation pass every 700 net container allocations; what
    tpkit keeps per step counts toward it and so adds pauses inside the loop's steps. Spans are
    kept flat (plain values, no tuple per span): what remains per step is the step's end, its
    loss entry and that loss's slot (3), and the memory probe's look at the gradients now and
    then (a list). Counted exactly with the collector off: the growth of
    the young generation's count per step, with tpkit (phases, memory, no clocks) minus
    without."""
    import gc

    import torch

    import tpkit as tp

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(4, 8)

    def step():
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    def per_step(n=100):
        gc.collect()
        gc.disable()
        try:
            before = gc.get_count()[0]
            for _ in range(n):
                step()
            return (gc.get_count()[0] - before) / n
        finally:
            gc.enable()

    for _ in range(3):
        step()
    # A hundred steps, median of three counts: objects of earlier tests freed inside one count
    # (a dozen, seen on CI) move it by a tenth, not by half an object per step.
    plain = statistics.median(per_step() for _ in range(3))
    with tp.profile(steps=10**6, warmup=0, progress=False, name="gc-count", clocks=False):
        step()
        step()
        profiled = statistics.median(per_step() for _ in range(3))
    assert profiled - plain <= 4.0, (plain, profiled)  # 16 when every span was a tuple
