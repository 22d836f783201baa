"""The A/B loss check on hand-made frames."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from tpkit.kernels.ab import COLUMNS, compare_losses


def losses(values, start=0):
    return pd.DataFrame({"step": range(start, start + len(values)), "loss": values})


def test_identical_runs_match():
    frame, verdict = compare_losses(losses([4.6, 4.2, 3.9]), losses([4.6, 4.2, 3.9]))
    assert list(frame.columns) == COLUMNS
    assert verdict.ok and verdict.n_steps == 3 and verdict.max_abs_diff == 0.0
    assert verdict.first_bad_step is None
    assert verdict.message.startswith("loss matches")


def test_small_rounding_differences_are_within_tolerance():
    a = [4.6, 4.2, 3.9, 3.7]
    b = [x * (1 + 3e-3) for x in a]  # bf16-sized differences
    frame, verdict = compare_losses(losses(a), losses(b))
    assert verdict.ok
    assert frame["within_tol"].all()
    assert verdict.max_rel_diff == pytest.approx(3e-3)
    assert frame["diff"].iloc[0] == pytest.approx(4.6 * 3e-3)


def test_drift_is_caught_at_its_first_step():
    a = [4.6, 4.2, 3.9, 3.7, 3.5]
    b = [4.6, 4.2, 3.95, 4.1, 4.4]  # step 2: 1.3% off, then diverging
    frame, verdict = compare_losses(losses(a), losses(b))
    assert not verdict.ok
    assert verdict.first_bad_step == 2
    assert list(frame["within_tol"]) == [True, True, False, False, False]
    assert verdict.message.startswith("LOSS DRIFT: step 2")
    assert "3 of 5 steps" in verdict.message
    # a looser tolerance accepts step 2 only
    _, loose = compare_losses(losses(a), losses(b), rtol=0.02)
    assert loose.first_bad_step == 3


def test_nan_in_one_run_is_drift_in_both_is_not():
    _, verdict = compare_losses(losses([4.0, 3.0]), losses([4.0, math.nan]))
    assert not verdict.ok and verdict.first_bad_step == 1
    _, verdict = compare_losses(losses([4.0, math.nan]), losses([4.0, math.nan]))
    assert verdict.ok


def test_missing_steps_are_reported_and_fail_the_verdict():
    frame, verdict = compare_losses(losses([4.0, 3.0, 2.0]), losses([4.0, 3.0]))
    assert len(frame) == 2 and verdict.missing_steps == (2,)
    assert not verdict.ok and "only one run: [2]" in verdict.message
    _, empty = compare_losses(losses([1.0]), losses([1.0], start=5))
    assert not empty.ok and empty.n_steps == 0


def test_series_input_and_bad_frames():
    a = pd.Series([1.0, 2.0], index=[0, 1])
    _, verdict = compare_losses(a, a)
    assert verdict.ok
    with pytest.raises(ValueError, match="'step' and 'loss'"):
        compare_losses(pd.DataFrame({"x": [1]}), a)
    with pytest.raises(ValueError, match="duplicate"):
        compare_losses(pd.DataFrame({"step": [0, 0], "loss": [1.0, 1.0]}), a)
