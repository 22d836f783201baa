"""Modes in short blocks inside one training run, each block paired with the no-profiler blocks
on either side of it: the estimator of benchmarks/overhead.py.

Why blocks (docs/MEASURED.md, "Timing ground truth"): the VM's host runs a guest core at one of
two speeds by turns, switching every 10 ms to about 1 s, the slow state 1.9x longer for the same
work, with nothing in the guest to show it. Rounds of a few seconds per mode compare a mode with
a baseline measured seconds away, on whatever speed the host had then: their per-round ratios
spread 0.86-1.14 and a 2% cost cannot be resolved in minutes. Here the profiler is switched on
and off inside one loop every few steps (``--skip`` dropped steps, as a slice's warmup, then
``--block`` kept steps), the order of modes rotating each cycle:

    none, A, none, B, none, C, none | none, B, none, C, none, A, none | ...

and each block of a mode is divided by the mean of the two no-profiler blocks around it, a
fraction of a second before and after. The estimate is the median of those per-block ratios, with
a 95% bootstrap interval over blocks; a goal is *met* when the whole interval is at or under it,
*not met* when the whole interval is over it, and *undecided* when the interval straddles it.

A mode switched on mid-run is the same profiler a user starts around ``trainer.train()``: tpkit
finds the Trainer from the frames of the loop at its first step's end either way, and the first
``--skip`` steps of a block are dropped for every mode alike (tpkit's slice looks at the
gradients after its first three backward passes, as in a slice's warmup).
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, field
from typing import Sequence

#: The mode every other mode is paired with.
BASE = "none"
#: Fewer paired values than this give an interval but no verdict: a percentile bootstrap over a
#: handful of blocks is too narrow to trust.
MIN_FOR_VERDICT = 10
#: Bootstrap resamples for an interval; a fixed seed, so a rerun of the report prints the same.
BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED = 2000, 0


def schedule(modes: Sequence[str], cycles: int) -> list[str]:
    """``cycles`` cycles of every mode once, each between two blocks of ``BASE``; the order of
    the modes rotates by one each cycle (so no mode always follows the same neighbour).
    Consecutive cycles share their edge ``BASE`` block."""
    out = [BASE]
    for c in range(cycles):
        k = c % len(modes)
        for mode in [*modes[k:], *modes[:k]]:
            out += [mode, BASE]
    return out


@dataclass
class Block:
    """One block of a mode: its kept steps (s) and what else was seen in them."""

    mode: str
    cycle: int
    steps: list[float] = field(default_factory=list)
    gc: list[float] = field(default_factory=list)  # s of gc pause inside each kept step
    gc_by_gen: list[int] = field(default_factory=lambda: [0, 0, 0])
    tpkit: list[float] = field(default_factory=list)  # the Run's tpkit_s per kept step
    tpkit_frac: list[float] = field(default_factory=list)  # tpkit_s / duration_s per kept step
    #: the clock sampler over the block's slice: (its CPU time as a share of one core, samples a
    #: second), from the Run's ``meta["clocks"]``; None where no sampler ran
    sampler: tuple[float, float] | None = None

    @property
    def median(self) -> float:
        return statistics.median(self.steps)


def paired_ratios(blocks: Sequence[Block]) -> dict[str, list[tuple[int, float]]]:
    """Per mode, ``(cycle, ratio)`` of each of its blocks: the block's median step over the mean
    of the medians of the ``BASE`` blocks right before and after it (one of them at an end of
    the run). Blocks with no kept step are skipped, and so is a mode block without a ``BASE``
    neighbour."""
    out: dict[str, list[tuple[int, float]]] = {}
    for i, b in enumerate(blocks):
        if b.mode == BASE or not b.steps:
            continue
        near = [blocks[j].median for j in (i - 1, i + 1)
                if 0 <= j < len(blocks) and blocks[j].mode == BASE and blocks[j].steps]
        if near:
            out.setdefault(b.mode, []).append((b.cycle, b.median / statistics.mean(near)))
    return out


@dataclass(frozen=True)
class Estimate:
    """A median with its 95% bootstrap interval over ``n`` paired values."""

    value: float
    lo: float
    hi: float
    n: int

    def verdict(self, goal: float) -> str:
        """'met' (the whole interval at or under ``goal``), 'NOT met' (all of it over), or
        'undecided' (it straddles the goal: more blocks, or a quieter host, would tell); 'too few
        blocks' under ``MIN_FOR_VERDICT`` values."""
        if self.n < MIN_FOR_VERDICT:
            return "too few blocks"
        if self.hi <= goal:
            return "met"
        if self.lo > goal:
            return "NOT met"
        return "undecided"

    def text(self, spec: str = ".3f", unit: str = "x") -> str:
        return f"{self.value:{spec}}{unit} [{self.lo:{spec}}-{self.hi:{spec}}]"


def estimate(values: Sequence[float], resamples: int = BOOTSTRAP_RESAMPLES,
             seed: int = BOOTSTRAP_SEED) -> Estimate | None:
    """The median of ``values`` with a percentile-bootstrap 95% interval (None when fewer than
    3 values)."""
    xs = list(values)
    if len(xs) < 3:
        return None
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(resamples))
    return Estimate(statistics.median(xs), meds[int(0.025 * resamples)], meds[int(0.975 * resamples) - 1], len(xs))


#: Student's t, two-sided 95%, by degrees of freedom; between entries the lower one's (wider).
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
        10: 2.228, 15: 2.131, 20: 2.086, 30: 2.042}


def mean_interval(values: Sequence[float]) -> Estimate | None:
    """The mean of a few independent values (one per launch) with its 95% Student-t interval
    (None under 2 values). Launches are read this way, not by bootstrap over blocks: what sets
    one launch apart from another (the program's layout in memory, the host it met) is shared
    by all of that launch's blocks, so only whole launches are independent, and there are few."""
    xs = list(values)
    if len(xs) < 2:
        return None
    mean, half = statistics.mean(xs), 0.0
    if len(set(xs)) > 1:
        t = T975[max(df for df in T975 if df <= len(xs) - 1)]
        half = t * statistics.stdev(xs) / len(xs) ** 0.5
    return Estimate(mean, mean - half, mean + half, len(xs))


def by_cycle(pairs: Sequence[tuple[int, float]]) -> dict[int, float]:
    """A mode's per-block ratios keyed by cycle (the mean where a cycle holds two blocks)."""
    acc: dict[int, list[float]] = {}
    for cycle, r in pairs:
        acc.setdefault(cycle, []).append(r)
    return {c: statistics.mean(v) for c, v in acc.items()}


def quotient(num: Sequence[tuple[int, float]], den: Sequence[tuple[int, float]]) -> Estimate | None:
    """Median over cycles of one mode's ratio divided by another's in the same cycle (e.g.
    memory off / phases only: what the clock sampler adds), with its interval."""
    a, b = by_cycle(num), by_cycle(den)
    return estimate([a[c] / b[c] for c in sorted(a.keys() & b.keys())])


def difference(first: Sequence[tuple[int, float]], second: Sequence[tuple[int, float]]) -> Estimate | None:
    """Median over cycles of one mode's ratio minus another's in the same cycle, with its
    interval: below zero throughout means the first costs less."""
    a, b = by_cycle(first), by_cycle(second)
    return estimate([a[c] - b[c] for c in sorted(a.keys() & b.keys())])
