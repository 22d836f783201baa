"""Ranks side by side: every rank's steps in one frame and the per-step skew across ranks.

Pure functions over frames, so tests can check them on hand-made numbers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

if TYPE_CHECKING:
    from ..run import Run


def rank_steps(runs: dict[int, Run]) -> pd.DataFrame:
    """Every rank's ``steps`` in one frame, ``rank`` first."""
    frames = [r.steps.assign(rank=k)[["rank", *r.steps.columns]] for k, r in sorted(runs.items())]
    if not frames:
        return pd.DataFrame(columns=["rank", "step", "duration_s"])
    return pd.concat(frames, ignore_index=True)


def rank_skew(steps: pd.DataFrame) -> pd.DataFrame:
    """Per measured step across ranks: ``step, ranks, slowest_rank, fastest_rank, max_s, min_s,
    median_s, skew_s`` (max - min) and ``skew_share`` (skew / max: the share of the slowest
    rank's step the others spend waiting at the next collective)."""
    cols = ["step", "ranks", "slowest_rank", "fastest_rank", "max_s", "min_s", "median_s", "skew_s", "skew_share"]
    m = steps[~steps["warmup"].astype(bool)] if "warmup" in steps else steps
    if m.empty:
        return pd.DataFrame(columns=cols)
    g = m.groupby("step")["duration_s"]
    out = pd.DataFrame({
        "ranks": g.size(),
        "slowest_rank": m.loc[g.idxmax(), ["step", "rank"]].set_index("step")["rank"],
        "fastest_rank": m.loc[g.idxmin(), ["step", "rank"]].set_index("step")["rank"],
        "max_s": g.max(), "min_s": g.min(), "median_s": g.median(),
    }).reset_index()
    out["skew_s"] = out["max_s"] - out["min_s"]
    with np.errstate(divide="ignore", invalid="ignore"):
        out["skew_share"] = np.where(out["max_s"] > 0, out["skew_s"] / out["max_s"], 0.0)
    return out[cols]
