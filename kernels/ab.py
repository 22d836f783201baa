"""Loss check for a kernels A/B run: does run B (kernels on) train like run A (kernels off)?

Pure functions on frames, for ``%%tp_profile --kernels ab`` to call after running the same
batches twice. A fused kernel that is fast but changes the loss (as Liger's fused loss did
under torch.compile) must be caught here, not weeks later.

    frame, verdict = compare_losses(losses_a, losses_b)
    verdict.ok, verdict.message  # e.g. "loss matches: max |diff| 3.1e-06 (rel 7.0e-07) over 20 steps"
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd

from .errors import KernelArgumentError

COLUMNS = ["step", "loss_a", "loss_b", "diff", "abs_diff", "rel_diff", "within_tol"]


@dataclass(frozen=True)
class LossVerdict:
    """Whether run B's losses match run A's, with the figures behind the answer."""

    ok: bool  # True when every common step is within tolerance and no step is missing
    n_steps: int  # steps present in both runs
    max_abs_diff: float
    max_rel_diff: float
    first_bad_step: int | None  # first step beyond tolerance (or non-finite in one run only)
    missing_steps: tuple[int, ...]  # steps in one run but not the other
    rtol: float
    atol: float
    message: str


def _as_losses(losses: pd.DataFrame | pd.Series, name: str) -> pd.Series:
    """A frame with ``step`` and ``loss`` columns (or a Series indexed by step) -> Series."""
    if isinstance(losses, pd.Series):
        s = losses
    elif {"step", "loss"} <= set(losses.columns):
        s = losses.set_index("step")["loss"]
    else:
        raise KernelArgumentError(f"run {name}: expected columns 'step' and 'loss', got {list(losses.columns)}")
    if s.index.has_duplicates:
        raise KernelArgumentError(f"run {name}: duplicate steps {sorted(set(s.index[s.index.duplicated()]))}")
    return s.astype("float64").rename(f"loss_{name}")


def compare_losses(
    losses_a: pd.DataFrame | pd.Series,
    losses_b: pd.DataFrame | pd.Series,
    rtol: float = 1e-2,
    atol: float = 1e-4,
) -> tuple[pd.DataFrame, LossVerdict]:
    """Per-step loss difference of run B against run A, and a verdict.

    A step is within tolerance when ``|b - a| <= atol + rtol * |a|`` (as ``numpy.isclose``),
    or when both losses are the same non-finite value. The defaults (1% relative) allow
    bf16 rounding differences between kernels and eager while catching a wrong loss.
    Returns a frame with columns ``COLUMNS`` (one row per step in both runs) and a verdict.
    """
    a = _as_losses(losses_a, "a")
    b = _as_losses(losses_b, "b")
    frame = pd.concat([a, b], axis=1, join="inner").rename_axis("step").reset_index()
    missing = tuple(sorted(set(a.index).symmetric_difference(b.index)))
    frame["diff"] = frame["loss_b"] - frame["loss_a"]
    frame["abs_diff"] = frame["diff"].abs()
    frame["rel_diff"] = frame["abs_diff"] / frame["loss_a"].abs().where(frame["loss_a"] != 0)
    same_nonfinite = (frame["loss_a"] == frame["loss_b"]) | (frame["loss_a"].isna() & frame["loss_b"].isna())
    close = frame["abs_diff"] <= atol + rtol * frame["loss_a"].abs()
    frame["within_tol"] = (close | same_nonfinite).astype(bool)
    frame = frame[COLUMNS]

    bad = frame.loc[~frame["within_tol"], "step"]
    first_bad = int(bad.iloc[0]) if len(bad) else None
    finite = frame[frame["abs_diff"].map(math.isfinite)]
    max_abs = float(finite["abs_diff"].max()) if len(finite) else float("nan")
    max_rel = float(finite["rel_diff"].max()) if len(finite) else float("nan")
    ok = first_bad is None and not missing and len(frame) > 0
    if len(frame) == 0:
        message = "no step in common between run A and run B"
    elif first_bad is not None:
        row = frame.loc[frame["step"] == first_bad].iloc[0]
        message = (
            f"LOSS DRIFT: step {first_bad} loss {row.loss_b:.6g} with kernels vs {row.loss_a:.6g} "
            f"without (|diff| {row.abs_diff:.3g} > {atol:g} + {rtol:g}*|a|); "
            f"{len(bad)} of {len(frame)} steps beyond tolerance"
        )
    else:
        message = (
            f"loss matches: max |diff| {max_abs:.2g} (rel {max_rel:.2g}) over {len(frame)} steps"
        )
    if missing:
        message += f"; steps in only one run: {list(missing)}"
    verdict = LossVerdict(ok, len(frame), max_abs, max_rel, first_bad, missing, rtol, atol, message)
    return frame, verdict
