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
                                   "missing": self.missing, "incomplete": self.incomplete}
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

    def summary_text(self) -> str:
        """The summary as lines for a terminal: ranks, missing ones, the skew, the straggler."""
        s = self.summary()
        lines = [f"{len(self.runs)} of {self.world_size} ranks loaded"]
        if self.missing:
            lines.append(f"missing: rank{'s' if len(self.missing) > 1 else ''} "
                         f"{', '.join(map(str, self.missing))} left no run (died or hung before saving)")
        if self.incomplete:
            lines.append(f"incomplete: rank{'s' if len(self.incomplete) > 1 else ''} "
                         f"{', '.join(map(str, self.incomplete))} (the slice ended early)")
        if "skew_p50_s" in s:
            lead = (f"slowest rank {s['slowest_rank']} in {s['slowest_rank_steps']} steps"
                    if s.get("straggler_rank") is not None else "no rank stands out")  # a tie on noise otherwise
            lines.append(f"step-time skew p50 {s['skew_p50_s'] * 1e3:.1f} ms, max {s['skew_max_s'] * 1e3:.1f} ms; {lead}")
        lines.append(f"straggler: {s['straggler']}")
        if self.uneven():
            lines.append(self.uneven())
        mean = self.run.steps["loss"] if "loss" in self.run.steps else None
        if mean is not None and mean.notna().any():
            whose = "the complete ranks'" if len(self.incomplete) < len(self.runs) else "the ranks'"
            lines.append(f"loss ({whose} mean, as a data-parallel trainer logs it): first {mean.dropna().iloc[0]:.4f}, "
                         f"last {mean.dropna().iloc[-1]:.4f}")
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
        st = st[st["rank"].isin([k for k in self.runs if k not in self.incomplete] or list(self.runs))]
        mean = st.groupby("step")["loss"].mean() if "loss" in st else pd.Series(dtype="float64")
        if mean.notna().any():  # what a data-parallel trainer logs
            steps["loss"] = steps["step"].map(mean).astype("float64")
        rates = {k: self.runs[k].summary().throughput for k in sorted(set(st["rank"]))}
        total = sum(r for r in rates.values() if r == r)
        why = " (the rank that held the others back)" if pick == held else ""
        notes.append(f"merged view of {len(rates)} rank(s): step times, phases and memory are rank {pick}'s{why}, the loss "
                     f"is the mean over those ranks (what a data-parallel trainer logs), samples/s rank {pick}'s own"
                     + (f"; the {len(rates)} ranks together read {total:,.1f} samples/s, each on batches of its own "
                        "(DDP, FSDP; with tensor or pipeline parallelism ranks share batches)" if total > 0 else ""))
        for k in self.missing:
            notes.append(f"rank {k} of {self.world_size} left no run (it died before its slice ended?)")
        for k in self.incomplete:
            notes.append(f"rank {k}'s slice ended early: {self.runs[k].meta.get('error', 'incomplete')}")
        uneven = self.uneven()
        if uneven:
            notes.append(uneven)
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


def load_ranks(path: str | os.PathLike) -> RankRuns:
    """Load every rank's Run saved under ``path`` (``rank<k>`` folders, or any folders whose
    ``meta.json`` carries a rank) and merge them."""
    root = Path(path)
    if not root.is_dir():
        raise RunFormatError(f"{root} is not a folder of per-rank runs")
    runs: dict[int, Run] = {}
    world = 0
    subs = sorted(p for p in root.iterdir() if (p / "meta.json").is_file())
    # Reading Parquet releases the GIL: a few threads load a 256-rank launch faster than one
    with ThreadPoolExecutor(max_workers=max(1, min(LOAD_THREADS, len(subs)))) as pool:
        loaded = list(pool.map(Run.load, subs))
    for run in loaded:
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
