"""Several processes: ``tp.load_ranks(dir)`` loads the Run each rank of a ``torchrun`` /
``deepspeed`` launch saved (``tp.profile(save_dir=DIR)`` or ``TPKIT_SAVE_DIR=DIR``) and puts
them side by side as ``RankRuns``: one ``steps`` frame with a ``rank`` column, the per-step
skew, the ranks that are missing or incomplete, and a merged Run whose dashboard has a
"Ranks" section.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from .errors import RunFormatError
from .run import Run
from .schema import ENV_SAVE_DIR


@dataclass
class RankRuns:
    """The runs of one multi-process launch, by rank."""

    runs: dict[int, Run]
    world_size: int
    missing: list[int] = field(default_factory=list)  # ranks with no saved run
    incomplete: list[int] = field(default_factory=list)  # ranks whose slice ended in an error

    @property
    def steps(self) -> pd.DataFrame:
        """Every rank's ``steps``, with a ``rank`` column first."""
        from .analysis.ranks import rank_steps

        return rank_steps(self.runs)

    @property
    def skew(self) -> pd.DataFrame:
        """Per measured step: the slowest and fastest rank and the spread (``rank_skew``)."""
        from .analysis.ranks import rank_skew

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
