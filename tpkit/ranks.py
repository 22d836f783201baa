"""Several processes: every rank of a ``torchrun`` / ``deepspeed`` launch records its own Run,
and ``tp.load_ranks(dir)`` puts them side by side.

Each rank's slice is an ordinary slice; what is added here:

- ``rank_meta()``: rank, local rank and world size (from ``torch.distributed`` when it is
  initialised, else from the launcher's ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK``), written
  into ``run.meta``.
- ``finish_rank_run(run, save_dir)``: called by the profiler when a slice ends, however it
  ends. With ``tp.profile(..., save_dir=DIR)`` or ``TPKIT_SAVE_DIR=DIR`` in the launch
  environment, the Run goes to ``DIR/rank<k>`` (``DIR/<name>`` for a single process). A rank
  whose slice ended by an error (a peer died and the collective timed out) is saved the same
  way, marked ``complete: false`` with the error, so the survivors' runs are never lost.
- ``load_ranks(dir)``: ``RankRuns`` with one ``steps`` frame (a ``rank`` column), per-step
  skew (slowest rank, spread), the ranks that are missing or incomplete, and a merged Run
  whose dashboard has a "Ranks" section.

The arithmetic is in ``analysis``-style pure functions (``rank_steps``, ``rank_skew``) that
take frames, so tests can check them on hand-made numbers.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from .errors import RunFormatError
from .run import Run

ENV_SAVE_DIR = "TPKIT_SAVE_DIR"


def rank_meta() -> dict[str, Any]:
    """``{"rank", "local_rank", "world_size"}`` of this process, or ``{}`` when it is not part of
    a multi-process launch."""
    rank = world = None
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
    except Exception:  # a broken process group must not stop the run from being kept
        pass
    env = os.environ
    if rank is None and "RANK" in env and "WORLD_SIZE" in env:
        try:
            rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        except ValueError:
            return {}
    if rank is None:
        return {}
    local = env.get("LOCAL_RANK")
    return {"rank": int(rank), "world_size": int(world),
            "local_rank": int(local) if local is not None and local.isdigit() else None}


def rank_folder(save_dir: str | os.PathLike, meta: dict[str, Any]) -> Path:
    """Where a rank's Run is saved under ``save_dir``."""
    if meta.get("world_size") is not None and meta.get("rank") is not None:
        return Path(save_dir) / f"rank{int(meta['rank'])}"
    return Path(save_dir) / str(meta.get("name", "run"))


def finish_rank_run(run: Run, save_dir: str | os.PathLike | None = None) -> Path | None:
    """Put rank facts into ``run.meta`` and, when a save folder is given (argument or
    ``TPKIT_SAVE_DIR``), save the Run there. Never raises: a failed save is a note on the run."""
    try:
        info = rank_meta()
        run.meta.update(info)
        if info and not run.complete:
            run.meta["rank_status"] = "failed"
            if run.meta.get("rank_watchdog_fired"):
                run.meta["stopped_by"] = "stalled"
        target = save_dir if save_dir is not None else os.environ.get(ENV_SAVE_DIR) or None
        if target is None:
            return None
        return run.save(rank_folder(target, run.meta))
    except Exception as e:
        run.meta.setdefault("notes", []).append(f"saving the rank's run failed: {e!r}")
        return None


# -- merging ----------------------------------------------------------------------------------
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


@dataclass
class RankRuns:
    """The runs of one multi-process launch, by rank."""

    runs: dict[int, Run]
    world_size: int
    missing: list[int] = field(default_factory=list)  # ranks with no saved run
    incomplete: list[int] = field(default_factory=list)  # ranks whose slice ended in an error

    @property
    def steps(self) -> pd.DataFrame:
        return rank_steps(self.runs)

    @property
    def skew(self) -> pd.DataFrame:
        return rank_skew(self.steps)

    def summary(self) -> dict[str, Any]:
        sk = self.skew
        out: dict[str, Any] = {"world_size": self.world_size, "ranks": sorted(self.runs),
                               "missing": self.missing, "incomplete": self.incomplete}
        if not sk.empty:
            slowest = sk["slowest_rank"].value_counts()
            out.update(skew_p50_s=float(sk["skew_s"].median()), skew_max_s=float(sk["skew_s"].max()),
                       skew_share_p50=float(sk["skew_share"].median()),
                       slowest_rank=int(slowest.index[0]), slowest_rank_steps=int(slowest.iloc[0]))
        return out

    @property
    def run(self) -> Run:
        """A Run for the dashboard: the lowest complete rank's tables, with every rank's step
        times and the skew in ``meta["ranks"]`` (what the "Ranks" section draws)."""
        pick = min((k for k in self.runs if k not in self.incomplete), default=min(self.runs))
        base = self.runs[pick]
        meta = copy.deepcopy(base.meta)
        st = self.steps
        meta["ranks"] = {**self.summary(), "shown_rank": pick,
                         "step_times": [[int(r), int(s), float(d), bool(w)] for r, s, d, w in
                                        st[["rank", "step", "duration_s", "warmup"]].itertuples(index=False)]}
        notes = meta.setdefault("notes", [])
        for k in self.missing:
            notes.append(f"rank {k} of {self.world_size} left no run (it died before its slice ended?)")
        for k in self.incomplete:
            notes.append(f"rank {k}'s slice ended early: {self.runs[k].meta.get('error', 'incomplete')}")
        return Run(base.steps, base.spans, base.memory, base.clocks, base.loader, meta)

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> Any:
        return self.run._repr_mimebundle_(include, exclude)

    def __repr__(self) -> str:
        s = self.summary()
        skew = f", skew p50 {s['skew_p50_s'] * 1e3:.2f} ms" if "skew_p50_s" in s else ""
        lost = f", missing {self.missing}" if self.missing else ""
        return f"<tpkit.RankRuns: {len(self.runs)}/{self.world_size} ranks{skew}{lost}>"


def load_ranks(path: str | os.PathLike) -> RankRuns:
    """Load every rank's Run saved under ``path`` (``rank<k>`` folders, or any folders whose
    ``meta.json`` carries a rank) and merge them."""
    root = Path(path)
    if not root.is_dir():
        raise RunFormatError(f"{root} is not a folder of per-rank runs")
    runs: dict[int, Run] = {}
    world = 0
    for sub in sorted(p for p in root.iterdir() if (p / "meta.json").is_file()):
        run = Run.load(sub)
        rank = run.meta.get("rank")
        if rank is None:
            continue
        if int(rank) in runs:
            raise RunFormatError(f"two runs under {root} claim rank {rank}")
        runs[int(rank)] = run
        world = max(world, int(run.meta.get("world_size") or 0), int(rank) + 1)
    if not runs:
        raise RunFormatError(f"no per-rank runs under {root}: save them with tp.profile(save_dir=...) "
                             f"or {ENV_SAVE_DIR}=DIR in each rank's environment")
    return RankRuns(runs=runs, world_size=world, missing=[k for k in range(world) if k not in runs],
                    incomplete=[k for k, r in sorted(runs.items()) if not r.complete])


# -- the stall watchdog -----------------------------------------------------------------------
ENV_TIMEOUT = "TPKIT_RANK_TIMEOUT_S"


class RankWatchdog:
    """In a multi-process launch, saves this rank's partial Run if no step ends for
    ``timeout_s`` (a peer died and a collective hangs instead of failing), marked
    ``stopped_by: "stalled"``, then raises KeyboardInterrupt in the main thread so the slice
    ends as soon as control returns to Python. A collective that fails by itself (gloo sees
    the peer's socket close) ends the slice through the normal error path first.

    Daemon thread, stop event, ``remove`` idempotent; nothing runs outside a launch."""

    def __init__(self, rec: Any, save_dir: str | os.PathLike, timeout_s: float, warmup_steps: int = 0,
                 poll_s: float = 0.2) -> None:
        import threading

        self.rec, self.save_dir, self.timeout_s, self.poll_s = rec, save_dir, float(timeout_s), poll_s
        self.warmup_steps = warmup_steps
        self.fired = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="tpkit-rank-watchdog", daemon=True)

    def install(self) -> "RankWatchdog":
        self._thread.start()
        return self

    def remove(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5.0)

    def meta(self) -> dict[str, Any]:
        return {"rank_watchdog_fired": True} if self.fired else {}

    def _loop(self) -> None:
        from time import perf_counter_ns

        while not self._stop.wait(self.poll_s):
            ends = self.rec.step_ends
            last_ns = ends[-1][0] if ends else self.rec.t0_ns
            if (perf_counter_ns() - last_ns) / 1e9 >= self.timeout_s:
                self._fire()
                return

    def _fire(self) -> None:
        import _thread

        self.fired = True
        rec = self.rec
        try:
            snap = copy.copy(rec)  # lists copied: the main thread may still append to the originals
            for name in ("spans", "step_ends", "memory", "clocks", "loader", "losses", "notes"):
                setattr(snap, name, list(getattr(rec, name)))
            snap.cuda_timer = None  # CUDA events are resolved by the main thread only
            msg = (f"no step ended for {self.timeout_s:g} s: this rank stalled (a peer died or hangs); "
                   "the Run holds the steps before the stall")
            snap.notes.append(msg)
            warmup = min(self.warmup_steps, len(snap.step_ends))
            run = Run.from_recorder(snap, warmup, {"complete": False, "stopped_by": "stalled", "error": msg})
            finish_rank_run(run, self.save_dir)
        finally:
            _thread.interrupt_main()  # ends the slice once the main thread is back in Python


def rank_watchdog(rec: Any, cfg: Any) -> RankWatchdog | None:
    """Factory for ``PROBE_FACTORIES``: only in a multi-process launch with a save folder and a
    timeout (``TPKIT_RANK_TIMEOUT_S``)."""
    timeout = os.environ.get(ENV_TIMEOUT)
    save_dir = getattr(cfg, "save_dir", None) or os.environ.get(ENV_SAVE_DIR)
    if not timeout or not save_dir or int(rank_meta().get("world_size") or 1) < 2:
        return None
    warmup = cfg.warmup if isinstance(getattr(cfg, "warmup", None), int) else 0
    return RankWatchdog(rec, save_dir, float(timeout), warmup)
