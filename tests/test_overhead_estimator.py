"""benchmarks/overhead.py's fast-host estimator: steps are kept only when the host canary read
the fast state before and after them, so a mode that ran more of its steps while the host was
slow is not charged for it (docs/MEASURED.md, "Timing ground truth")."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture
def overhead(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    sys.modules.pop("overhead", None)
    sys.modules.pop("common", None)
    import overhead

    return overhead


def _samples(overhead, step_s: float, slow_share: float, rng: random.Random, rounds: int = 4, steps: int = 40):
    """Steps of ``step_s`` on the fast host (canary 60 us) and 1.9x on the slow one (canary 85
    us), the slow state lasting several steps at a time and covering ``slow_share`` of them."""
    s = overhead.Samples()
    slow = False
    for _ in range(rounds):
        for _ in range(steps):
            if rng.random() < 0.2:  # the state changes now and then, not every step
                slow = rng.random() < slow_share
            canary = 85.0 if slow else 60.0 + rng.random()
            s.steps.append(step_s * (1.9 if slow else 1.0) * (1 + 0.001 * rng.random()))
            s.canaries.append((canary, canary))
        s.round_medians.append(0.0)
        s.round_ends.append(len(s.steps))
    return s


def test_a_mode_that_ran_more_on_the_slow_host_reads_its_true_cost(overhead):
    rng = random.Random(0)
    samples = {"none": _samples(overhead, 0.010, 0.2, rng), "tpkit default": _samples(overhead, 0.0103, 0.6, rng)}
    every_step = overhead.ratio(samples, "tpkit default", "none")
    bar, is_fast = overhead.fast_host([c for s in samples.values() for pair in s.canaries for c in pair])
    fast, share, per_round = overhead.fast_ratio(samples, "tpkit default", "none", is_fast)
    assert 60 < bar < 85
    assert every_step > 1.3  # the slow host's steps, charged to the mode that had more of them
    assert fast == pytest.approx(1.03, abs=0.002)
    assert 0.25 <= share < 0.6
    assert all(r == pytest.approx(1.03, abs=0.01) for r in per_round)


def test_too_few_fast_host_steps_give_no_ratio(overhead):
    rng = random.Random(1)
    samples = {"none": _samples(overhead, 0.010, 0.95, rng, rounds=1), "tpkit default": _samples(overhead, 0.0103, 0.95, rng, rounds=1)}
    _, is_fast = overhead.fast_host([60.0] + [c for s in samples.values() for pair in s.canaries for c in pair])
    fast, share, _ = overhead.fast_ratio(samples, "tpkit default", "none", is_fast)
    assert fast is None and share < overhead.FAST_MIN_SHARE
