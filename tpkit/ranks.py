"""Several processes: ``tp.load_ranks(dir)`` loads the Run each rank of a ``torchrun`` /
``deepspeed`` launch saved (``tp.profile(save_dir=DIR)`` or ``TPKIT_SAVE_DIR=DIR``) and puts
them side by side as ``RankRuns``: one ``steps`` frame with a ``rank`` column, the per-step
skew, the ranks that are missing or incomplete, and a merged Run whose dashboard has a
"Ranks" section.
"""

from __future__ import annotations

import copy
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pandas as pd

from .errors import RunFormatError
from .run import Run
from .schema import ENV_SAVE_DIR

#: Threads that read the ranks' runs in ``load_ranks``.
LOAD_THREADS = 4


@dataclass
class RankRuns:
    """The runs of one multi-process launch, by rank. Frames are computed once and cached
    (``runs`` is not expected to change after loading)."""

    runs: dict[int, Run]
    world_size: int
    missing: list[int] = field(default_factory=list)  # ranks with no saved run
    incomplete: list[int] = field(default_factory=list)  # ranks whose slice ended in an error
    #: runs under the folder from other launches, not loaded: ``{"launch", "ranks", "why"}`` each
    left_out: list[dict[str, Any]] = field(default_factory=list)
    launch: str = ""  # the launch loaded (``meta["launch"]["id"]``), "all" for a mix
    _cache: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def _cached(self, key: str, make: Callable[[], Any]) -> Any:
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    @property
    def steps(self) -> pd.DataFrame:
        """Every rank's ``steps``, with a ``rank`` column first."""
        from .analysis import ranks as ar

        return self._cached("steps", lambda: ar.rank_steps(self.runs))

    @property
    def skew(self) -> pd.DataFrame:
        """Per measured step: the slowest and fastest rank and the spread (``rank_skew``)."""
        from .analysis import ranks as ar

        return self._cached("skew", lambda: ar.rank_skew(self.steps))

    def stragglers(self) -> pd.DataFrame:
        """Per measured step (and per collective, where the ranks' waits line up), the rank the
        others waited for, the phase it was late in, how long it held them back and at which
        collective: ``[step, rank, phase, excess_s, collective]`` (the rule: ``tpkit.analysis.ranks``)."""
        from .analysis import ranks as ar

        return self._cached("stragglers", lambda: ar.rank_stragglers(
            self.steps, {k: r.spans for k, r in self.runs.items()})).copy()

    def straggler_verdict(self) -> dict[str, Any]:
        """The straggler line ("rank 3's data_wait held every step back by 42.0 ms (p50)") and its figures."""
        from .analysis import ranks as ar

        return self._cached("verdict", lambda: ar.straggler_verdict(self.stragglers(), self.steps))

    @property
    def memory_peaks(self) -> pd.DataFrame:
        """Each rank's memory peak over its measured steps: ``rank, device, peak_bytes, step, phase``."""
        from .analysis import ranks as ar

        return self._cached("memory_peaks", lambda: ar.rank_memory_peaks({k: r.memory for k, r in self.runs.items()}))

    def timeline(self, max_rows: int = 5000) -> pd.DataFrame:
        """The merged timeline, one lane per rank on one time axis (``meta["start_unix_ns"]``):
        each rank's phases and its waits in collectives. Past ``max_rows`` the lanes kept are
        the stragglers', the fastest rank's, then the lowest ranks (``rank_timeline``)."""
        from .analysis import ranks as ar

        def make() -> pd.DataFrame:
            st = self.steps
            first = {int(k): float(g["start_s"].min()) for k, g in st[~st["warmup"].astype(bool)].groupby("rank")} \
                if not st.empty else {}
            offsets = ar.rank_offsets_s({k: r.meta for k, r in self.runs.items()}, first)
            lanes = ar.timeline_ranks(self.stragglers(), st, limit=len(self.runs))
            return ar.rank_timeline({k: r.spans for k, r in self.runs.items()}, offsets, ranks=lanes,
                                    max_rows=max_rows)

        return self._cached(f"timeline{max_rows}", make)

    def summary(self) -> dict[str, Any]:
        """World size, ranks present, missing and incomplete, the skew, and the straggler verdict."""
        def make() -> dict[str, Any]:
            sk = self.skew
            out: dict[str, Any] = {"world_size": self.world_size, "ranks": sorted(self.runs),
                                   "missing": self.missing, "incomplete": self.incomplete,
                                   "launch": self.launch, "left_out": self.left_out,
                                   "stall": self.stall(), "config_mix": self.config_mix()}
            if not sk.empty:
                slowest = sk["slowest_rank"].value_counts()
                out.update(skew_p50_s=float(sk["skew_s"].median()), skew_max_s=float(sk["skew_s"].max()),
                           skew_share_p50=float(sk["skew_share"].median()),
                           slowest_rank=int(slowest.index[0]), slowest_rank_steps=int(slowest.iloc[0]))
            v = self.straggler_verdict()
            out.update(straggler=v["line"], straggler_rank=v["rank"], straggler_phase=v["phase"],
                       straggler_excess_p50_s=v["excess_p50_s"])
            return out

        return dict(self._cached("summary", make))

    def uneven(self) -> str:
        """What to say where one rank's loop ran out of batches while another's went on into a
        collective no one joined (uneven inputs without DDP's ``Join``): the ranks' own runs say
        only "the loop ended" and "cut short by a closed connection", each alone."""
        ended = sorted(k for k, r in self.runs.items() if r.meta.get("stopped_by") == "loop_end")
        cut = sorted(k for k in self.incomplete if k not in ended)
        if not ended or not cut:
            return ""
        steps = {k: len(self.runs[k].steps) for k in ended}
        return (f"rank{'s' if len(ended) > 1 else ''} {', '.join(map(str, ended))} ran out of batches (the loop ended "
                f"after {', '.join(str(steps[k]) for k in ended)} step(s)) while rank{'s' if len(cut) > 1 else ''} "
                f"{', '.join(map(str, cut))} went on and ended with an error in the next step: uneven inputs, a "
                "collective that the ranks which ended never joined; give every rank as many batches "
                "(DistributedSampler(drop_last=True)) or wrap the loop in DDP's Join")

    def loss_mean(self) -> tuple[pd.Series, str]:
        """Per step, the mean loss over the ranks that completed that step (a rank whose slice
        ended early counts for the steps it ended), and those words for it: "the 3 ranks' mean",
        or "per step, the mean over the ranks that completed it: 3 ranks for steps 0-9, 1 for 10-11"."""
        def make() -> tuple[pd.Series, str]:
            st = self.steps
            if "loss" not in st or not st["loss"].notna().any():
                return pd.Series(dtype="float64"), ""
            has = st[st["loss"].notna()]
            g = has.groupby("step")["loss"]
            mean, count = g.mean(), g.size()
            if count.nunique() == 1:
                return mean, f"the {int(count.iloc[0])} ranks' mean" if int(count.iloc[0]) > 1 else "one rank's own"
            runs: list[list[int]] = []  # contiguous steps with the same number of ranks
            for step, n in count.items():
                if runs and runs[-1][2] == n and runs[-1][1] == step - 1:
                    runs[-1][1] = step
                else:
                    runs.append([step, step, n])
            parts = [f"{n} rank{'s' if n > 1 else ''} for step{'s' if a != b else ''} {a}" + (f"-{b}" if a != b else "")
                     for a, b, n in runs]
            return mean, f"per step, the mean over the ranks that completed it: {', '.join(parts)}"

        mean, words = self._cached("loss_mean", make)
        return mean.copy(), words

    def stall(self) -> str:
        """Where ranks stalled (their watchdogs fired, ``TPKIT_RANK_TIMEOUT_S``): the ranks that were
        not waiting in a collective are the likely cause, named with where they were; the ranks
        waiting in collectives waited for them. Each rank's own run says only its own side."""
        stalled = {k: r.meta.get("stall") or {} for k, r in self.runs.items() if r.meta.get("stopped_by") == "stalled"}
        if not stalled:
            return ""
        own = sorted(k for k, st in stalled.items() if st.get("in_collective") is False)
        waiting = sorted(k for k, st in stalled.items() if st.get("in_collective"))
        if not own:
            gone = f"; rank{'s' if len(self.missing) > 1 else ''} {', '.join(map(str, self.missing))} left no run " \
                   "(died?)" if self.missing else ""
            return (f"rank{'s' if len(stalled) > 1 else ''} {', '.join(map(str, sorted(stalled)))} stalled"
                    + (f", rank{'s' if len(waiting) > 1 else ''} {', '.join(map(str, waiting))} waiting in a collective"
                       if waiting else "") + gone)
        where = "; ".join(f"rank {k} at {stalled[k]['at']}" for k in own if stalled[k].get("at"))
        line = (f"hang: rank{'s' if len(own) > 1 else ''} {', '.join(map(str, own))} stalled in its own code, not "
                f"waiting in any collective: the likely cause" + (f" ({where})" if where else ""))
        if waiting:
            what = sorted({str(stalled[k].get("collective")) for k in waiting})
            line += (f"; rank{'s' if len(waiting) > 1 else ''} {', '.join(map(str, waiting))} waited for "
                     f"{'it' if len(own) == 1 else 'them'} in {', '.join(what)}")
        return line

    def config_mix(self) -> str:
        """The ranks' ``steps`` / ``warmup`` where they differ (a slice stops its loop after warmup +
        steps: ranks given different values stop at different steps; where a process group was up
        at the slice's start, tpkit refuses such a launch before it starts)."""
        parts = []
        for key, name in (("steps_requested", "steps"), ("warmup_requested", "warmup")):
            by: dict[str, list[int]] = {}
            for k, r in sorted(self.runs.items()):
                by.setdefault(str(r.meta.get(key)), []).append(k)
            if len(by) > 1:
                parts.append(", ".join(f"{name}={v} on rank{'s' if len(ks) > 1 else ''} {', '.join(map(str, ks))}"
                                       for v, ks in by.items()))
        if not parts:
            return ""
        return ("the ranks were given different slice lengths (" + "; ".join(parts) + "): they stop their loops at "
                "different steps, and the ones still training wait in a collective for peers that left")

    def launches_left_out(self) -> str:
        """The runs under the folder that belong to other launches, and how to load them."""
        if not self.left_out:
            return ""
        return ("left out: " + "; ".join(f"rank{'s' if len(d['ranks']) > 1 else ''} "
                                          f"{', '.join(map(str, d['ranks']))} of {d['why']} (launch={d['launch']!r})"
                                          for d in self.left_out)
                + "; tp.load_ranks(DIR, launch=ID) loads another, launch='all' mixes them")

    def summary_text(self) -> str:
        """The summary as lines for a terminal: ranks, missing ones, the skew, the straggler."""
        s = self.summary()
        lines = [f"{len(self.runs)} of {self.world_size} ranks loaded"
                 + (f" (the newest launch under the folder, {len(self.left_out)} other(s) left out)"
                    if self.left_out else "")]
        if self.launches_left_out():
            lines.append(self.launches_left_out())
        if self.launch == "all" and len({str((r.meta.get("launch") or {}).get("id")) for r in self.runs.values()}) > 1:
            lines.append("a mix of launches (launch='all'): ranks of different launches side by side")
        if self.missing:
            lines.append(f"missing: rank{'s' if len(self.missing) > 1 else ''} "
                         f"{', '.join(map(str, self.missing))} left no run (died or hung before saving)")
        if self.incomplete:
            lines.append(f"incomplete: rank{'s' if len(self.incomplete) > 1 else ''} "
                         f"{', '.join(map(str, self.incomplete))} (the slice ended early)")
        if self.stall():  # a hang: who was not waiting, before the step figures
            lines.append(self.stall())
        if "skew_p50_s" in s:
            lead = (f"slowest rank {s['slowest_rank']} in {s['slowest_rank_steps']} steps"
                    if s.get("straggler_rank") is not None else "no rank stands out")  # a tie on noise otherwise
            lines.append(f"step-time skew p50 {s['skew_p50_s'] * 1e3:.1f} ms, max {s['skew_max_s'] * 1e3:.1f} ms; {lead}")
        lines.append(f"straggler: {s['straggler']}")
        for extra in (self.config_mix(), self.uneven()):
            if extra:
                lines.append(extra)
        mean, whose = self.loss_mean()
        mean = mean.dropna()
        if len(mean):
            lines.append(f"loss ({whose}, as a data-parallel trainer logs it): first {mean.iloc[0]:.4f}, "
                         f"last {mean.iloc[-1]:.4f}")
        return "\n".join(lines)

    @property
    def run(self) -> Run:
        """A Run for the dashboard: the lowest complete rank's tables, with every rank's step
        times, the straggler verdict and table, the merged timeline and the memory peaks in
        ``meta["ranks"]`` (what the "Ranks" section draws), and the missing ranks named."""
        return self._cached("run", self._merged)

    def _merged(self) -> Run:
        # the rank that held the others back, where one did: its own tables say why (its data wait
        # and the advice on it), where the lowest rank's showed the wait for it (COMM-BOUND, and
        # advice sized on its own smaller share: "1.18x" where the fix gave 1.98x)
        held = self.straggler_verdict().get("rank")
        pick = held if held in self.runs and held not in self.incomplete else \
            min((k for k in self.runs if k not in self.incomplete), default=min(self.runs))
        base = self.runs[pick]
        meta = copy.deepcopy(base.meta)
        st = self.steps
        peaks = self.memory_peaks
        meta["ranks"] = {**self.summary(), "shown_rank": pick,
                         "step_times": [[int(r), int(s), float(d), bool(w)] for r, s, d, w in
                                        st[["rank", "step", "duration_s", "warmup"]].itertuples(index=False)],
                         "stragglers": [[int(s), int(r), str(p), float(e)] for s, r, p, e in
                                        self.stragglers()[["step", "rank", "phase", "excess_s"]]
                                        .itertuples(index=False)],
                         "timeline": [[int(r), int(s), str(p), float(a), float(b)] for r, s, p, a, b in
                                      self.timeline()[["rank", "step", "phase", "start_s", "end_s"]]
                                      .itertuples(index=False)],
                         "memory_peaks": [[int(r), str(d), int(b)] for r, d, b in
                                          peaks[["rank", "device", "peak_bytes"]].itertuples(index=False)]}
        notes = meta.setdefault("notes", [])
        notes[:] = [n for n in notes if not n.startswith(f"the loss is rank {pick}'s own")]  # the mean here
        steps = base.steps.copy()
        # A step's loss is the mean over the ranks that completed that step, an incomplete rank's
        # included for the steps it ended (what DDP logged for them); the complete ranks' alone
        # had read one rank's own loss where the others' slices ended in an error after 10 steps.
        mean, _ = self.loss_mean()
        if mean.notna().any():  # what a data-parallel trainer logs
            steps["loss"] = steps["step"].map(mean).astype("float64")
        st = st[st["rank"].isin([k for k in self.runs if k not in self.incomplete] or list(self.runs))]
        rates = {k: self.runs[k].summary().throughput for k in sorted(set(st["rank"]))}
        total = sum(r for r in rates.values() if r == r)
        why = " (the rank that held the others back)" if pick == held else ""
        notes.append(f"merged view of {len(rates)} rank(s): step times, phases and memory are rank {pick}'s{why}, the loss "
                     f"is {self.loss_mean()[1]} (what a data-parallel trainer logs), samples/s rank {pick}'s own"
                     + (f"; the {len(rates)} ranks together read {total:,.1f} samples/s, each on batches of its own "
                        "(DDP, FSDP; with tensor or pipeline parallelism ranks share batches)" if total > 0 else ""))
        for k in self.missing:
            notes.append(f"rank {k} of {self.world_size} left no run (it died before its slice ended?)")
        for k in self.incomplete:
            notes.append(f"rank {k}'s slice ended early: {self.runs[k].meta.get('error', 'incomplete')}")
        for extra in (self.launches_left_out(), self.stall(), self.config_mix(), self.uneven()):
            if extra:
                notes.append(extra)
        if self.launch == "all" and len({str((r.meta.get("launch") or {}).get("id")) for r in self.runs.values()}) > 1:
            notes.append("a mix of launches (load_ranks(..., launch='all')): the ranks' runs come from different "
                         "launches, compared side by side as if one")
        return Run(steps, base.spans, base.memory, base.clocks, base.loader, meta)

    def to_html(self, path: str | os.PathLike) -> Path:
        """Write the merged dashboard (the "Ranks" section first among the rank views)."""
        return self.run.to_html(Path(path))

    def to_traces(self, path: str | os.PathLike) -> list[Path]:
        """Write one Kineto-style trace per rank, ``path/rank<k>.json``, that Holistic Trace
        Analysis reads (``TraceAnalysis(trace_dir=path)``: temporal breakdown, idle time,
        communication/computation overlap). Warmup steps are left out."""
        from .analysis.ranks import rank_traces

        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        written = []
        for k, doc in rank_traces(self.runs, self.world_size).items():
            target = out / f"rank{k}.json"
            tmp = target.with_name(target.name + ".tmp")  # written beside, then swapped in
            tmp.write_text(json.dumps(doc))  # default separators: HTA finds '"rank": k' (analysis/kineto.py)
            tmp.replace(target)
            written.append(target)
        return written

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> Any:
        return self.run._repr_mimebundle_(include, exclude)

    def __repr__(self) -> str:
        s = self.summary()
        skew = f", skew p50 {s['skew_p50_s'] * 1e3:.2f} ms" if "skew_p50_s" in s else ""
        lost = f", missing {self.missing}" if self.missing else ""
        return f"<tpkit.RankRuns: {len(self.runs)}/{self.world_size} ranks{skew}{lost}; {s['straggler']}>"


def _launch_key(meta: dict[str, Any]) -> tuple[Any, ...]:
    """What tells a run's launch from another's: the id every rank of a launch shares (set at the
    slice's start through the process group's store, ``tpkit.capture.ranks.start_check``), else what
    the launcher set and the world size, else (runs saved before tpkit recorded either) the world
    size and the slice's name."""
    found = meta.get("launch")
    launch: dict[str, Any] = found if isinstance(found, dict) else {}
    world = int(meta.get("world_size") or 0)
    if launch.get("id"):
        return ("id", str(launch["id"]))
    if launch:
        return ("env", world, *(str(launch.get(k, "")) for k in ("run_id", "restart", "master_addr", "master_port",
                                                                 "slurm_job_id")), str(meta.get("name", "")))
    return ("old", world, str(meta.get("name", "")))


def _started_ns(run: Run) -> int:
    ns = run.meta.get("start_unix_ns")
    return int(ns) if isinstance(ns, (int, float)) and not isinstance(ns, bool) else 0


def _launch_words(runs: list[Run]) -> str:
    world = max(int(r.meta.get("world_size") or 0) for r in runs)
    ranks = sorted(int(r.meta["rank"]) for r in runs)
    name = runs[0].meta.get("name", "run")
    return f"'{name}', {world} ranks (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} saved)"


def load_ranks(path: str | os.PathLike, launch: str | None = None) -> RankRuns:
    """Load the Runs each rank of a launch saved under ``path`` (``rank<k>`` folders, or any
    folders whose ``meta.json`` carries a rank) and merge them.

    A folder used by more than one launch (a 3-rank run, then a 2-rank rerun into the same
    ``TPKIT_SAVE_DIR``) holds runs of both: the runs are grouped by launch (``meta["launch"]``:
    an id every rank of a launch shares, else the launcher's environment and world size; runs
    saved before tpkit recorded it by world size and name), and the newest launch (by its slice
    start, ``meta["start_unix_ns"]``) is loaded; ``RankRuns.left_out`` says which runs were left
    out and why, and so do the summary and the merged view's notes. ``launch`` picks another:
    an id from ``left_out`` / ``meta["launch"]["id"]``, or ``"all"`` to merge every run (a mix of
    launches, said in the notes; refused where two runs claim one rank)."""
    root = Path(path)
    if not root.is_dir():
        raise RunFormatError(f"{root} is not a folder of per-rank runs")
    subs = sorted(p for p in root.iterdir() if (p / "meta.json").is_file())
    # Reading Parquet releases the GIL: a few threads load a 256-rank launch faster than one
    with ThreadPoolExecutor(max_workers=max(1, min(LOAD_THREADS, len(subs)))) as pool:
        loaded = [r for r in pool.map(Run.load, subs) if r.meta.get("rank") is not None]
    if not loaded:
        raise RunFormatError(f"no per-rank runs under {root}: save them with tp.profile(save_dir=...) "
                             f"or {ENV_SAVE_DIR}=DIR in each rank's environment")
    groups: dict[tuple[Any, ...], list[Run]] = {}
    for run in loaded:
        groups.setdefault(_launch_key(run.meta), []).append(run)
    order = sorted(groups, key=lambda k: max(_started_ns(r) for r in groups[k]), reverse=True)  # newest first
    ids = {k: (k[1] if k[0] == "id" else f"launch{i}") for i, k in enumerate(order)}
    if launch is None:
        chosen = [order[0]]
    elif launch == "all":
        chosen = list(order)
    else:
        chosen = [k for k in order if ids[k] == launch]
        if not chosen:
            raise RunFormatError(f"no launch {launch!r} under {root}: its launches are "
                                 + "; ".join(f"{ids[k]}: {_launch_words(groups[k])}" for k in order))
    runs: dict[int, Run] = {}
    for key in chosen:
        for run in groups[key]:
            rank = int(run.meta["rank"])
            if rank in runs:
                raise RunFormatError(
                    f"two runs under {root} claim rank {rank}" + (
                        f", from different launches ({', '.join(ids[k] for k in chosen)}): load one with "
                        "load_ranks(path, launch=ID)" if len(chosen) > 1 else ""))
            runs[rank] = run
    world = 0
    for rank, run in runs.items():
        world = max(world, int(run.meta.get("world_size") or 0), rank + 1)
    newest = max(_started_ns(r) for r in runs.values())
    left_out = []
    for key in order:
        if key in chosen:
            continue
        rs = groups[key]
        ago = (newest - max(_started_ns(r) for r in rs)) / 1e9
        when = f"started {ago:.0f} s before" if ago >= 0 else f"started {-ago:.0f} s after"
        left_out.append({"launch": ids[key], "ranks": sorted(int(r.meta["rank"]) for r in rs),
                         "why": f"another launch ({_launch_words(rs)}), {when} the one loaded"})
    out = RankRuns(runs=runs, world_size=world, missing=[k for k in range(world) if k not in runs],
                   incomplete=[k for k, r in sorted(runs.items()) if not r.complete])
    out.left_out = left_out
    out.launch = ids[chosen[0]] if len(chosen) == 1 else "all"
    return out
