"""Ranks side by side: every rank's steps in one frame, the per-step skew across ranks, the rank
and phase that held the others back (stragglers), a merged timeline with one lane per rank, and
each rank's memory peak.

Pure functions over frames, so tests can check them on hand-made numbers.

The straggler rule (``rank_stragglers``): in a step that ends in a collective, every rank waits
for the last one to arrive, so the rank the others waited for is the one with the most time
*outside* collectives (``duration_s - comm_s``: its own work). Its phase is the one where it spent
the most beyond the other ranks (its seconds minus the median of the other ranks' seconds in that
phase), and ``excess_s`` is that excess: how long that phase held the others back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from ..schema import PHASE_COLUMNS

if TYPE_CHECKING:
    from ..run import Run

#: Below this excess (p50 over the steps) no rank is said to hold the others back: noise.
STRAGGLER_MIN_S = 0.001
#: ... nor below this share of the median step time.
STRAGGLER_MIN_SHARE = 0.05
#: The phases a straggler can be late in (everything but the wait itself).
STRAGGLER_PHASES: tuple[str, ...] = tuple(c[:-2] for c in PHASE_COLUMNS if c != "comm_s")
STRAGGLER_COLUMNS = ["step", "rank", "phase", "excess_s"]


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


def rank_stragglers(steps: pd.DataFrame) -> pd.DataFrame:
    """Per measured step: the ``rank`` the others waited for, the ``phase`` it was late in and
    ``excess_s``, its seconds in that phase beyond the other ranks' median (module docstring).
    Steps that only one rank has are left out. Runs saved before ``comm_s`` existed count it 0."""
    if steps.empty or "rank" not in steps:
        return pd.DataFrame({"step": pd.Series(dtype="int64"), "rank": pd.Series(dtype="int64"),
                             "phase": pd.Series(dtype=object), "excess_s": pd.Series(dtype="float64")})
    m = steps[~steps["warmup"].astype(bool)] if "warmup" in steps else steps
    m = m[m.groupby("step")["rank"].transform("size") > 1]
    cols = [f"{p}_s" for p in STRAGGLER_PHASES if f"{p}_s" in m.columns]
    if m.empty or not cols:
        return rank_stragglers(m.iloc[0:0].drop(columns="rank"))
    comm = m["comm_s"] if "comm_s" in m else 0.0
    own = (m["duration_s"] - comm).to_numpy()
    m = m.assign(_own=own).reset_index(drop=True)
    late = m.groupby("step")["_own"].idxmax()  # row of the straggler, per step
    others = m.drop(index=late.to_numpy())
    median = others.groupby("step")[cols].median()
    mine = m.loc[late.to_numpy()].set_index("step")
    excess = mine[cols] - median.reindex(mine.index)
    out = pd.DataFrame({"step": mine.index.astype("int64"), "rank": mine["rank"].astype("int64").to_numpy(),
                        "phase": [c[:-2] for c in excess.idxmax(axis=1)],
                        "excess_s": excess.max(axis=1).to_numpy(dtype="float64")})
    return out.sort_values("step", kind="stable").reset_index(drop=True)


def straggler_verdict(stragglers: pd.DataFrame, steps: pd.DataFrame | None = None) -> dict[str, Any]:
    """The one line every view shows, with its figures: the (rank, phase) most often late, in how
    many of the measured steps, and its excess p50. ``line`` reads e.g. "rank 3's data_wait held
    every step back by 42.0 ms (p50)"; ``rank`` is None where no rank held the others back by more
    than ``STRAGGLER_MIN_S`` and ``STRAGGLER_MIN_SHARE`` of the median step (noise)."""
    if stragglers.empty:
        return {"line": "no step ran on more than one rank: nothing to compare", "rank": None, "phase": None,
                "steps": 0, "of_steps": 0, "excess_p50_s": None}
    n = len(stragglers)
    top = stragglers.groupby(["rank", "phase"])["excess_s"].agg(["size", "sum"])  # most steps, then most time
    rank, phase = top.sort_values(["size", "sum"], ascending=False, kind="stable").index[0]
    hits = stragglers[(stragglers["rank"] == rank) & (stragglers["phase"] == phase)]
    p50 = float(hits["excess_s"].median())
    step_p50 = float(steps[~steps["warmup"].astype(bool)]["duration_s"].median()) if steps is not None and \
        not steps.empty else 0.0
    if not (p50 >= STRAGGLER_MIN_S and p50 >= STRAGGLER_MIN_SHARE * step_p50):
        all_p50 = float(stragglers["excess_s"].median())
        return {"line": f"no rank held the others back: the slowest rank's lead was {all_p50 * 1e3:.1f} ms (p50) "
                        f"over {n} steps", "rank": None, "phase": None, "steps": n, "of_steps": n,
                "excess_p50_s": all_p50}
    which = "every step" if len(hits) == n else f"{len(hits)} of {n} steps"
    return {"line": f"rank {int(rank)}'s {phase} held {which} back by {p50 * 1e3:.1f} ms (p50)",
            "rank": int(rank), "phase": str(phase), "steps": int(len(hits)), "of_steps": n, "excess_p50_s": p50}


def rank_offsets_s(metas: dict[int, dict[str, Any]], starts_s: dict[int, float] | None = None) -> dict[int, float]:
    """Seconds to add to each rank's times to put every rank on one axis: from
    ``meta["start_unix_ns"]`` (0 for the earliest rank). A rank without it (a run saved before
    tpkit recorded it) is aligned by its first measured step's start (``starts_s``) to the others'."""
    known = {k: int(m["start_unix_ns"]) for k, m in metas.items()
             if isinstance(m.get("start_unix_ns"), (int, float)) and not isinstance(m.get("start_unix_ns"), bool)}
    out: dict[int, float] = {}
    if known:
        base = min(known.values())
        out = {k: (ns - base) / 1e9 for k, ns in known.items()}
    starts_s = starts_s or {}
    placed = [out[k] + starts_s[k] for k in out if k in starts_s]  # known ranks' first steps on the axis
    ref = float(np.median(placed)) if placed else 0.0
    for k in metas:
        if k not in out:
            out[k] = ref - starts_s.get(k, 0.0)
    return out


def rank_timeline(spans: dict[int, pd.DataFrame], offsets_s: dict[int, float], *, ranks: list[int] | None = None,
                  max_rows: int = 5000) -> pd.DataFrame:
    """The merged timeline: per rank, its outermost phases and its waits in collectives (``comm``,
    drawn over the phase they interrupt) of the measured steps, on one time axis
    (``offsets_s`` from ``rank_offsets_s``). Columns ``rank, step, phase, start_s, end_s,
    duration_s, depth``, comm rows last (drawn on top). ``ranks`` picks the lanes (in that order of
    preference); past ``max_rows`` rows, lanes are dropped from the end of ``ranks`` and then the
    last steps, so a 256-rank launch still draws."""
    cols = ["rank", "step", "phase", "start_s", "end_s", "duration_s", "depth"]
    order = list(ranks) if ranks is not None else sorted(spans)
    parts: list[pd.DataFrame] = []
    total = 0
    for k in order:
        s = spans.get(k)
        if s is None or s.empty:
            continue
        s = s[(s["step"] >= 0) & ((s["depth"] == 0) | (s["phase"] == "comm")) & (s["phase"] != "tpkit")]
        if s.empty:
            continue
        if parts and total + len(s) > max_rows:
            break
        off = offsets_s.get(k, 0.0)
        parts.append(pd.DataFrame({"rank": k, "step": s["step"].to_numpy(), "phase": s["phase"].to_numpy(),
                                   "start_s": s["start_s"].to_numpy() + off, "end_s": s["end_s"].to_numpy() + off,
                                   "duration_s": s["duration_s"].to_numpy(), "depth": s["depth"].to_numpy()}))
        total += len(s)
    if not parts:
        return pd.DataFrame(columns=cols)
    out = pd.concat(parts, ignore_index=True)
    if len(out) > max_rows:  # one rank alone is too long: its first steps
        last = out.sort_values("start_s")["step"].iloc[max_rows - 1]
        out = out[out["step"] < last]
    out = out.assign(_comm=out["phase"] == "comm").sort_values(["_comm", "rank", "start_s"], kind="stable")
    return out.drop(columns="_comm").reset_index(drop=True)[cols]


def timeline_ranks(stragglers: pd.DataFrame, steps: pd.DataFrame, limit: int = 16) -> list[int]:
    """The lanes worth drawing first when not every rank fits: the ranks most often the
    straggler, then the fastest rank, then the rest in rank order (``limit`` at most)."""
    first = list(stragglers["rank"].value_counts().index.astype(int)) if not stragglers.empty else []
    m = steps[~steps["warmup"].astype(bool)] if "warmup" in steps and not steps.empty else steps
    if not m.empty:
        first.append(int(m.groupby("rank")["duration_s"].median().idxmin()))
    rest = sorted(int(r) for r in (steps["rank"].unique() if not steps.empty else []))
    out: list[int] = []
    for k in first + rest:
        if k not in out:
            out.append(k)
    return out[:limit]


def rank_memory_peaks(memory: dict[int, pd.DataFrame]) -> pd.DataFrame:
    """Each rank's highest total memory over its measured steps, per device: ``rank, device,
    peak_bytes, step, phase`` (the boundary or in-phase peak where it was reached). Ranks without
    memory rows (``memory=False``) have no row."""
    cols = ["rank", "device", "peak_bytes", "step", "phase"]
    parts = [mem[mem["step"] >= 0].assign(rank=k) for k, mem in sorted(memory.items()) if mem is not None and len(mem)]
    parts = [p for p in parts if len(p)]
    if not parts:
        return pd.DataFrame(columns=cols)
    m = pd.concat(parts, ignore_index=True)  # one groupby for every rank: 256 ranks in well under a second
    tot = m.groupby(["rank", "device", "t_s", "event"], sort=False, observed=True).agg(
        bytes=("bytes", "sum"), step=("step", "first"), phase=("phase", "first")).reset_index()
    out = tot.loc[tot.groupby(["rank", "device"], sort=True)["bytes"].idxmax()]
    out = out.rename(columns={"bytes": "peak_bytes"}).reset_index(drop=True)
    out["peak_bytes"] = out["peak_bytes"].astype("int64")
    return out[cols]


def rank_traces(runs: dict[int, Run], world_size: int) -> dict[int, dict[str, Any]]:
    """Each rank's Kineto-style trace document (``tpkit.analysis.kineto.run_to_kineto``), by rank."""
    from .kineto import run_to_kineto

    return {k: run_to_kineto(r.steps, r.spans, r.meta, int(k), world_size) for k, r in sorted(runs.items())}
