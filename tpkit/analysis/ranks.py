"""Ranks side by side: every rank's steps in one frame, the per-step skew across ranks, the rank
and phase that held the others back (stragglers), a merged timeline with one lane per rank, and
each rank's memory peak.

Pure functions over frames, so tests can check them on hand-made numbers.

The straggler rule (``rank_stragglers``): at a collective every rank waits for the last one to
arrive. Where the ranks' ``comm`` spans line up (the same collectives, in the same order, in a
step), each collective is judged on its own: the rank that waited least there arrived last, and
``excess_s`` is how long it held the others back, the longest wait there minus its own; its late
phase is the one it spent the most time in beyond the longest-waiting rank between the previous
collective and this one. Two ranks late before two different collectives of a step are both named,
each with its own hold-back (one late in its data before DDP's all-reduce, another in its own code
before an all_gather: 40 and 30 ms, where one figure per step had read "25 ms" for the first and
never named the second). Where the spans do not line up, per step: the rank the others waited for
is the one with the most time *outside* collectives (``duration_s - comm_s``), ``excess_s`` is the
most any other rank waited in collectives beyond it (its phase excess over the fastest other rank
where no rank waited at all), its phase the one where it spent the most beyond the fastest other rank.
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
STRAGGLER_COLUMNS = ["step", "rank", "phase", "excess_s", "collective"]


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


def _empty_stragglers() -> pd.DataFrame:
    return pd.DataFrame({"step": pd.Series(dtype="int64"), "rank": pd.Series(dtype="int64"),
                         "phase": pd.Series(dtype=object), "excess_s": pd.Series(dtype="float64"),
                         "collective": pd.Series(dtype=object)})


def _collective_label(source: str) -> str:
    """``end_of_backward:all_reduce`` -> ``all_reduce (end of backward)``; ``wait:all_gather`` -> ``all_gather``."""
    kind, _, op = str(source).partition(":")
    return f"{op or kind} (end of backward)" if kind == "end_of_backward" else (op or kind)


def _segment_phases(spans: pd.DataFrame, start: float, end: float) -> dict[str, float]:
    """Seconds per phase of a rank's outermost spans within [start, end] (a stretch between two
    collectives: no wait inside); the time no span covers is ``other``."""
    out: dict[str, float] = {}
    if end <= start:
        return out
    s = spans[(spans["end_s"] > start) & (spans["start_s"] < end)]
    covered = 0.0
    for phase, a, b in zip(s["phase"], s["start_s"], s["end_s"]):
        d = min(b, end) - max(a, start)
        if d > 0:
            out[phase] = out.get(phase, 0.0) + d
            covered += d
    out["other"] = out.get("other", 0.0) + max(0.0, (end - start) - covered)
    return out


def _before(spans: pd.DataFrame | None, comm: pd.DataFrame, i: int, step_start: float) -> dict[str, float]:
    """A rank's seconds per phase between its collective ``i - 1`` of a step (or the step's start)
    and its collective ``i`` (``comm``: its waits in the step, in order)."""
    begin = float(comm["end_s"].iloc[i - 1]) if i > 0 else step_start
    if spans is None:
        spans = pd.DataFrame(columns=["phase", "start_s", "end_s"])
    return _segment_phases(spans, begin, float(comm["start_s"].iloc[i]))


def _per_collective(steps: pd.DataFrame, spans: dict[int, pd.DataFrame]) -> tuple[list[dict[str, Any]], set[int]]:
    """The rows of the steps whose ranks' ``comm`` spans line up (module docstring), and those steps.
    Array work over every rank's waits; phases are read only for the two ranks compared at each
    collective (256 ranks x 50 steps x 2 collectives: about a second on a 2-core VM)."""
    from ..schema import COMM_OVERLAPPED

    parts = []
    for k, sp in spans.items():
        if sp is None or sp.empty:
            continue
        c = sp[(sp["phase"].to_numpy() == "comm") & (sp["step"].to_numpy() >= 0)]
        if len(c):
            parts.append(pd.DataFrame({"rank": k, "step": c["step"].to_numpy(), "start_s": c["start_s"].to_numpy(),
                                       "end_s": c["end_s"].to_numpy(), "source": c["source"].to_numpy()}))
    if not parts:
        return [], set()
    comm = pd.concat(parts, ignore_index=True).sort_values(["step", "rank", "start_s"], kind="stable")
    comm["wait_s"] = comm["end_s"] - comm["start_s"]
    comm["i"] = comm.groupby(["rank", "step"]).cumcount()
    n_ranks = steps.groupby("step")["rank"].nunique()
    # a step is judged per collective where every rank that has it waited the same number of times,
    # at the same collectives in the same order
    per = comm.groupby("step").agg(ranks=("rank", "nunique"), rows=("rank", "size"))
    same = comm.groupby(["step", "i"])["source"].nunique().groupby("step").max() == 1
    counts = comm.groupby(["step", "rank"]).size().groupby("step").nunique() == 1
    ok = per.index[(per["ranks"].to_numpy() == n_ranks.reindex(per.index).to_numpy()) & (per["ranks"] > 1).to_numpy()
                   & same.reindex(per.index).to_numpy() & counts.reindex(per.index).to_numpy()]
    comm = comm[comm["step"].isin(ok)]
    if comm.empty:
        return [], set()
    starts = steps.set_index(["rank", "step"])["start_s"]
    top: dict[int, pd.DataFrame] = {}

    def before(k: int, step: int, i: int) -> dict[str, float]:
        if k not in top:
            sp = spans[k]
            top[k] = sp[(sp["depth"] == 0) & ~sp["phase"].isin(["comm", COMM_OVERLAPPED])]
        mine = comm[(comm["rank"].to_numpy() == k) & (comm["step"].to_numpy() == step)]
        t = top[k]
        return _before(t[t["step"] == step], mine, i, float(starts.get((k, step), mine["start_s"].iloc[0])))

    grouped = comm.groupby(["step", "i"], sort=True)
    at_min = comm.loc[grouped["wait_s"].idxmin()].set_index(["step", "i"])
    at_max = comm.loc[grouped["wait_s"].idxmax()].set_index(["step", "i"])
    rows: list[dict[str, Any]] = []
    for (step, i), lo in at_min.iterrows():
        hi = at_max.loc[(step, i)]
        late, ref = int(lo["rank"]), int(hi["rank"])
        a, b = before(late, int(step), int(i)), before(ref, int(step), int(i))
        excess = {p: a.get(p, 0.0) - b.get(p, 0.0) for p in a if p in STRAGGLER_PHASES}
        phase = max(excess, key=lambda p: excess[p]) if excess else "other"
        rows.append({"step": int(step), "rank": late, "phase": phase, "excess_s": float(hi["wait_s"] - lo["wait_s"]),
                     "collective": _collective_label(lo["source"])})
    return rows, {int(x) for x in ok}


def rank_stragglers(steps: pd.DataFrame, spans: dict[int, pd.DataFrame] | None = None) -> pd.DataFrame:
    """Per measured step (and per collective where ``spans``, each rank's spans, line up): the
    ``rank`` the others waited for, the ``phase`` it was late in, ``excess_s``, how long it held
    the others back, and the ``collective`` they waited at (None where judged per step) (module
    docstring). Where the spans line up, a step has a row for each collective where some rank was
    held back beyond the noise (``STRAGGLER_MIN_S`` and ``STRAGGLER_MIN_SHARE`` of the step), and at
    least its longest hold. Steps that only one rank has are
    left out. Runs saved before ``comm_s`` existed count it 0."""
    if steps.empty or "rank" not in steps:
        return _empty_stragglers()
    m = steps[~steps["warmup"].astype(bool)] if "warmup" in steps else steps
    m = m[m.groupby("step")["rank"].transform("size") > 1]
    cols = [f"{p}_s" for p in STRAGGLER_PHASES if f"{p}_s" in m.columns]
    if m.empty or not cols:
        return _empty_stragglers()
    rows, done = _per_collective(m, spans) if spans else ([], set())
    out = pd.DataFrame(rows, columns=STRAGGLER_COLUMNS)
    if len(out):  # a step's collectives where no one was held (noise) add nothing but its longest hold
        step_s = out["step"].map(m.groupby("step")["duration_s"].median())
        loud = (out["excess_s"] >= STRAGGLER_MIN_S) & (out["excess_s"] >= STRAGGLER_MIN_SHARE * step_s)
        out = out[loud | (out["excess_s"] == out.groupby("step")["excess_s"].transform("max"))]
    rest = m[~m["step"].isin(done)]
    if not rest.empty:
        comm = rest["comm_s"] if "comm_s" in rest else pd.Series(0.0, index=rest.index)
        rest = rest.assign(_own=(rest["duration_s"] - comm).to_numpy(), _comm=comm.to_numpy()).reset_index(drop=True)
        late = rest.groupby("step")["_own"].idxmax()  # row of the straggler, per step
        others = rest.drop(index=late.to_numpy())
        fastest = others.groupby("step")[cols].min()
        waited = others.groupby("step")["_comm"].max()
        mine = rest.loc[late.to_numpy()].set_index("step")
        excess = mine[cols] - fastest.reindex(mine.index)
        held = (waited.reindex(mine.index) - mine["_comm"]).to_numpy(dtype="float64")
        phase_excess = excess.max(axis=1).to_numpy(dtype="float64")
        per_step = pd.DataFrame({"step": mine.index.astype("int64"), "rank": mine["rank"].astype("int64").to_numpy(),
                                 "phase": [c[:-2] for c in excess.idxmax(axis=1)],
                                 "excess_s": np.where(held > 0, held, phase_excess), "collective": None})
        out = pd.concat([out, per_step], ignore_index=True) if len(out) else per_step
    out = out.astype({"step": "int64", "rank": "int64", "excess_s": "float64"})
    return out.sort_values(["step", "excess_s"], ascending=[True, False], kind="stable").reset_index(drop=True)


#: Another (rank, phase) is named beside the first where it held back more than this share of the
#: steps (one step of four, on 4 ranks of a 2-core VM, is a rank scheduled late once).
STRAGGLER_ALSO_SHARE = 0.25
#: ... and at most this many of them.
STRAGGLER_ALSO_MAX = 3
#: A step's hold-back counts only above this many times the ranks' own step-time jitter (the median
#: absolute deviation of a rank's time outside collectives over its steps, the quietest rank's).
STRAGGLER_NOISE_MADS = 3.0


def straggler_noise_s(steps: pd.DataFrame | None) -> float:
    """The hold-back below which a step is not said to be held back: ``STRAGGLER_MIN_S``,
    ``STRAGGLER_MIN_SHARE`` of the median step, and ``STRAGGLER_NOISE_MADS`` times the quietest
    rank's jitter, the median absolute deviation of its time outside collectives
    (``duration_s - comm_s``) over its measured steps. A rank that holds the others back on some
    steps has a wide spread of its own, the others wait the time out in collectives: the quietest
    rank's spread is how far steps wander with no straggler (2-core VM under load: 1.7 to 6 ms,
    where the ranks' hold-backs of scheduling noise reached 16 ms and a 40 ms sleep read 39-40 ms).
    A rank late by the same time every step has no spread from it."""
    if steps is None or steps.empty:
        return STRAGGLER_MIN_S
    m = steps[~steps["warmup"].astype(bool)] if "warmup" in steps else steps
    if m.empty:
        return STRAGGLER_MIN_S
    own = m["duration_s"] - (m["comm_s"].fillna(0.0) if "comm_s" in m else 0.0)
    rank = m["rank"] if "rank" in m else pd.Series(0, index=m.index)
    med = own.groupby(rank).transform("median")
    jitter = float((own - med).abs().groupby(rank).median().min())
    return max(STRAGGLER_MIN_S, STRAGGLER_MIN_SHARE * float(m["duration_s"].median()), STRAGGLER_NOISE_MADS * jitter)


def _held_steps(per_step: pd.Series, noise: float) -> pd.Series:
    """Of one (rank, phase)'s hold-backs (one per step it held back most, by step), the steps it
    held back: none unless one reached the noise floor (else all of it is noise); then every step
    down from its largest hold until the first below the floor that lies more than the floor below
    the next larger one. A rank late by the same time every step under jitter holds back by a
    spread of times that runs below the floor without a break (10 ms late, 0-12 ms of jitter: 2 to
    20 ms, floor 8.7 ms) and is held back on all of them; a 40 ms sleep's steps stand apart from a
    1 ms lead of noise on another step, which is not counted."""
    e = per_step.sort_values(ascending=False, kind="stable")
    if e.empty or float(e.iloc[0]) < noise:
        return e.iloc[:0]
    apart = (e < noise) & (-e.diff().fillna(0.0) > noise)
    return e[apart.cumsum() == 0].sort_index()


def straggler_verdict(stragglers: pd.DataFrame, steps: pd.DataFrame | None = None) -> dict[str, Any]:
    """The one line every view shows, with its figures: the (rank, phase) that cost the job the
    most time, its hold-backs summed over the steps it held back (``_held_steps``: none where none
    reached the noise floor, ``straggler_noise_s``), in how many of the measured steps and by how much (p50), then any
    other (rank, phase) that held back more than ``STRAGGLER_ALSO_SHARE`` of the steps (``also``).
    ``line`` reads e.g. "rank 3's data_wait held every step back by 42.0 ms (p50)", with
    " at all_gather" where the collective is known; ``rank`` is None where no step was held back
    beyond the noise; ``noise_s`` is that floor. Ordered by most steps first, a few ms of
    scheduling noise on 6 of 9 steps (37 ms in all) had led before a 40 ms sleep on 3 (132 ms),
    and noise steps had counted as held back (5 of 9 for those 3)."""
    if stragglers.empty:
        return {"line": "no step ran on more than one rank: nothing to compare", "rank": None, "phase": None,
                "steps": 0, "of_steps": 0, "excess_p50_s": None, "also": [], "noise_s": None}
    n = int(stragglers["step"].nunique())
    st = stragglers if "collective" in stragglers else stragglers.assign(collective=None)
    noise = straggler_noise_s(steps)
    # a rank late before two collectives of a step: one hold of the step, summed
    per_step = st.groupby(["rank", "phase", "step"])["excess_s"].sum()
    kept = [_held_steps(g.droplevel([0, 1]), noise).to_frame().assign(rank=k[0], phase=k[1])
            for k, g in per_step.groupby(level=["rank", "phase"])]
    kept = [k for k in kept if len(k)]
    held = (pd.concat(kept).reset_index().set_index(["rank", "phase", "step"])["excess_s"] if kept
            else per_step.iloc[:0])
    if held.empty:
        all_p50 = float(st.groupby("step")["excess_s"].max().median())
        return {"line": f"no rank held the others back: the slowest rank's lead was {all_p50 * 1e3:.1f} ms (p50) "
                        f"over {n} steps, within the noise ({noise * 1e3:.1f} ms)", "rank": None, "phase": None,
                "steps": n, "of_steps": n, "excess_p50_s": all_p50, "also": [], "noise_s": noise}
    # most time held back first, then most steps
    top = held.groupby(["rank", "phase"]).agg(["sum", "size"])
    order = top.sort_values(["sum", "size"], ascending=False, kind="stable").index

    def figures(rank: Any, phase: Any) -> dict[str, Any]:
        mine = held.loc[(rank, phase)]
        hits = st[(st["rank"] == rank) & (st["phase"] == phase) & st["step"].isin(mine.index)]
        where = sorted({str(c) for c in hits["collective"] if isinstance(c, str)})
        return {"rank": int(rank), "phase": str(phase), "steps": int(len(mine)), "of_steps": n,
                "excess_p50_s": float(mine.median()), "excess_sum_s": float(mine.sum()), "collectives": where}

    def words(f: dict[str, Any]) -> str:
        which = "every step" if f["steps"] == n else f"{f['steps']} of {n} steps"
        at = f" at {', '.join(f['collectives'])}" if f["collectives"] else ""
        return f"rank {f['rank']}'s {f['phase']} held {which} back by {f['excess_p50_s'] * 1e3:.1f} ms (p50){at}"

    first = figures(*order[0])
    also = [f for f in (figures(*k) for k in order[1:]) if f["steps"] > STRAGGLER_ALSO_SHARE * n]
    line = "; ".join(words(f) for f in [first, *also[:STRAGGLER_ALSO_MAX]])
    if len(also) > STRAGGLER_ALSO_MAX:
        line += f"; and {len(also) - STRAGGLER_ALSO_MAX} more (ranks.stragglers())"
    return {"line": line, "rank": first["rank"], "phase": first["phase"], "steps": first["steps"], "of_steps": n,
            "excess_p50_s": first["excess_p50_s"], "excess_sum_s": first["excess_sum_s"],
            "collectives": first["collectives"], "also": also, "noise_s": noise}


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
