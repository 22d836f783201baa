"""A loose guard on what tpkit's default profile costs a plain training loop: a short version
of benchmarks/overhead.py (the built-in tiny transformer; no profiler and ``tp.profile`` with
phases, memory and clocks in blocks of a few steps inside one loop, each block paired with the
no-profiler blocks around it), <= 1.10.

The goals are tighter (<= 1.05, issue 14); this only catches a regression without flaking on a
shared machine: the ratio is the lower end of the estimator's 95% interval (a regression moves
the whole interval; a neighbour's burst widens it), and an interval over the limit is measured
once more before it fails. torch runs on one thread (the ``one_thread`` fixture): on a busy
2-core machine a two-thread pool stretches steps 10-100x.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
LIMIT = 1.10
SKIP, BLOCK, BUDGET_S = 2, 5, 12.0  # about 15 s on two idle cores


def _measure(overhead, interleave):
    loop = overhead.PlainLoop()
    loop.run(SKIP + 3, overhead.nullcontext())  # warm caches and the allocator
    watch = overhead.GcWatch().install()
    out: dict = {}
    try:
        overhead.measure_blocks(loop, ["none", "tpkit default"], SKIP, BLOCK, BUDGET_S, watch, out)
    finally:
        watch.remove()
    return interleave.estimate([r for _, r in out["tpkit default"].pairs])


@pytest.mark.slow
def test_default_profile_costs_a_plain_loop_at_most_ten_percent(monkeypatch, one_thread):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    for name in ("overhead", "interleave", "common"):
        sys.modules.pop(name, None)
    import interleave
    import overhead

    estimates = []
    for _attempt in range(2):
        est = _measure(overhead, interleave)
        estimates.append(est)
        if est.lo <= LIMIT:
            break
    assert min(e.lo for e in estimates) <= LIMIT, (
        f"tpkit default made the plain loop's step {estimates[-1].text()} as long as with no profiler "
        f"(median [95% interval] of {estimates[-1].n} paired blocks; limit {LIMIT}x)")


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
