"""A synthetic Run of any size: for exploring the dashboard without training anything, and
for checking that charts stay quick at 10,000 steps and a million rows (benchmarks/render.py)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from tpkit.run import Run
from tpkit.schema import MEMORY_CATEGORIES, PHASE_COLUMNS, frame

PHASES = ["data_wait", "forward", "backward", "optimizer"]


def synthetic_run(steps: int = 1000, clock_rows: int = 40_000, memory_rows: int = 60_000, seed: int = 0) -> Run:
    """``steps`` steps of four phases with gamma-distributed times, four clock series with
    ``clock_rows`` rows in all, and ``memory_rows`` memory rows in six categories."""
    rng = np.random.default_rng(seed)
    dur = rng.gamma(20, 0.0015, size=(steps, len(PHASES)))  # [S, P] seconds per phase
    step_s = dur.sum(1)
    ends = np.cumsum(step_s)
    starts = ends - step_s
    s = pd.DataFrame({"step": np.arange(steps), "warmup": False, "start_s": starts, "end_s": ends,
                      "duration_s": step_s, "samples": 32, "loss": np.linspace(6, 3, steps)})
    for c in PHASE_COLUMNS:
        s[c] = 0.0
    for j, p in enumerate(PHASES):
        s[f"{p}_s"] = dur[:, j]
    s["throughput"] = 32 / step_s
    span_start = starts[:, None] + np.concatenate([np.zeros((steps, 1)), np.cumsum(dur, 1)[:, :-1]], 1)
    spans = pd.DataFrame({"step": np.repeat(np.arange(steps), len(PHASES)), "phase": np.tile(PHASES, steps),
                          "start_s": span_start.ravel(), "end_s": (span_start + dur).ravel(),
                          "duration_s": dur.ravel(), "depth": 0, "source": "synthetic"})
    t = np.linspace(0, ends[-1], clock_rows // 4)
    clocks = pd.concat([pd.DataFrame({"t_s": t, "device": d, "metric": m, "value": v(t)}) for d, m, v in [
        ("cpu", "cpu_freq_mhz", lambda t: 2600 - 300 * (np.sin(t / 7) > 0.9)),
        ("cpu", "cpu_util_pct", lambda t: 80 + 20 * np.sin(t)),
        ("cpu0", "cpu_util_pct", lambda t: 70 + 30 * np.cos(t)),
        ("cpu1", "cpu_util_pct", lambda t: 60 + 40 * np.sin(2 * t))]], ignore_index=True)
    bounds = max(1, -(-memory_rows // (steps * len(MEMORY_CATEGORIES))))  # boundaries per step
    b = np.arange(bounds)
    step_idx = np.repeat(np.arange(steps), bounds * len(MEMORY_CATEGORIES))
    b_idx = np.tile(np.repeat(b, len(MEMORY_CATEGORIES)), steps)
    memory = pd.DataFrame({
        "step": step_idx, "phase": np.array(PHASES)[(b_idx // 2) % len(PHASES)],
        "event": np.where(b_idx % 2 == 0, "enter", "exit"),
        "t_s": starts[step_idx] + b_idx * 1e-4, "device": "cpu",
        "category": np.tile(MEMORY_CATEGORIES, steps * bounds),
        "bytes": rng.integers(1 << 20, 1 << 26, size=len(step_idx))})
    meta = {"name": "synthetic", "warmup_steps": 0, "complete": True, "notes": []}
    return Run(frame("steps", s), frame("spans", spans), frame("memory", memory), frame("clocks", clocks),
               None, meta)
