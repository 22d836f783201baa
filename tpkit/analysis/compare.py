"""Run-to-run comparison with honest statistics: pure functions over Runs' frames.

``compare(a, b, c, baseline="b")`` gives one row per (metric, run) with the value, a
bootstrap 95% confidence interval where the metric comes from per-step numbers, the change
against the baseline (default: the first run) with a 95% interval of that change, and a
verdict on the change, one of:

- ``"significant"``: all three hold:

  1. the interval of the change excludes zero;
  2. the change is larger than a practical threshold: runs at least ``REL_THRESHOLD`` (2%)
     apart for step time and throughput (``|ln(b / a)| >= ln 1.02``, the same rule whichever
     run is the baseline); for a phase's time per step, a change of at least
     ``SHARE_THRESHOLD_PP`` (1) percent of the longer run's mean step (a phase that moves the
     step by less is not worth acting on);
  3. the change is beyond run-to-run drift: more than ``DRIFT_FACTOR`` (2) times the larger
     change either run shows between the first and second halves of its own measured steps
     (the same figure computed on each half). The intervals resample steps within a run and
     cannot see a machine's load moving between runs (two runs of the same loop on a loaded
     machine read throughput +5.8% and -5.1%, "significant"); a run's halves are the evidence
     of that drift its own steps hold.

  The row's ``why`` says which of them a change that is not called failed.
- ``"no meaningful difference"``: one of the three fails.
- ``"not enough data"``: either run has fewer than ``MIN_STEPS`` (5) measured steps, or the
  figure is unknown in either run (no samples counted, every duration NaN). Never a
  "-100% significant" from a run that did not count its samples.
- ``"n/a"``: figures shown, not judged: peak memory, final loss, energy, and phase shares
  of step time. A share moves when any other phase does (20 ms more forward read backward
  -10 points and optimizer -5 points, "significant", their times unchanged), so the phases
  are judged by their time per step (``forward_time``, ms a step), which only moves with the
  phase itself; the shares stay as context.

Conventions, chosen once:

- Statistics use the measured steps only (warmup excluded). Steps with a NaN (or infinite)
  duration are dropped, with a warning that counts them; NaN phase times count as zero.
- Ratio metrics (throughput, phase shares) are ratios of totals, ``sum(samples) /
  sum(duration_s)``, and a phase's time per step is its total over the steps; all are
  bootstrapped by resampling whole steps, so a step's samples, phases and duration stay
  together. The halves for the drift are the measured steps in order, split at the middle.
- The interval of a change subtracts the two runs' independent bootstrap draws
  (``stats.diff_interval``). Each run's resamples are seeded from the seed and its own
  durations (``stats.content_seed``): results are reproducible, identical runs draw
  identical resamples (their change is exactly zero) and swapping two runs mirrors the result.
- numpy only.
"""

from __future__ import annotations

import math
import warnings as _warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import pandas as pd

from ..errors import TpkitError
from ..schema import MIB, PHASE_COLUMNS, UNSEEN_UPDATES_NOTE, metric_label
from .stats import (
    BASELINE,
    BOOTSTRAP_N,
    BOOTSTRAP_SEED,
    CI_LEVEL,
    DRIFT_CAP,
    DRIFT_FACTOR,
    MIN_STEPS,
    NO_DIFFERENCE,
    NOT_ENOUGH_DATA,
    NOT_TESTED,
    REL_THRESHOLD,
    SHARE_THRESHOLD_PP,
    SIGNIFICANT,
    content_seed,
    diff_interval,
    fmt_num,
    fmt_signed,
    resamples_for,
    step_resamples,
)
from .steps import INTERRUPTIONS, batches_seen, gc_free_steps, gc_pauses, measured

if TYPE_CHECKING:
    from ..run import Run

TABLE_COLUMNS: tuple[str, ...] = ("metric", "label", "unit", "run", "value", "ci_low", "ci_high", "delta",
                                  "delta_pct", "delta_low", "delta_high", "delta_low_pct", "delta_high_pct", "significant",
                                  "direction", "why")


@dataclass
class Metric:
    """One figure of one run: its value, interval, which way is better, how it is judged."""

    metric: str
    unit: str
    value: float
    ci: tuple[float, float] = (float("nan"), float("nan"))
    direction: str = ""  # which way is better: "higher", "lower" or "" (no judgement)
    test: str = ""       # "ratio" (relative threshold), "time" (a phase's ms a step) or "" (not judged)
    draws: np.ndarray | None = field(default=None, repr=False)  # bootstrap draws of the value
    steps: int = 0       # measured steps behind the figure
    # the figure's change between the halves of the run's measured steps: |ln(second / first)|
    # for "ratio", ms a step for "time" (NaN: not known)
    drift: float = float("nan")
    step_ms: float = float("nan")  # the run's mean step (ms), the "time" test's scale


def judged_steps(run: "Run") -> pd.DataFrame:
    """The run's steps as the verdict judges them (``steps.gc_free_steps``): a collector pause
    inside ``data_wait`` moved to other."""
    return gc_free_steps(run.steps, gc_pauses(run.spans, run.steps))


def clean_measured(steps: pd.DataFrame) -> tuple[pd.DataFrame, int]:
    """The measured steps with a finite duration (NaN phase times as 0), and how many
    measured steps were dropped for a NaN or infinite duration."""
    m = measured(steps)
    if m.empty:
        return m, 0
    dur = pd.to_numeric(m["duration_s"], errors="coerce").astype("float64")
    ok = np.isfinite(dur.to_numpy())
    m = m[ok].copy()
    cols = [c for c in PHASE_COLUMNS if c in m.columns]
    if cols:
        m[cols] = m[cols].astype("float64").fillna(0.0)
    return m, int((~ok).sum())


def run_metrics(run: "Run", n: int = BOOTSTRAP_N, seed: int = BOOTSTRAP_SEED,
                seed_by_content: bool = False) -> list[Metric]:
    """Every comparable figure of one run, with confidence intervals (and the bootstrap draws
    behind them) where steps give them. ``seed_by_content``: seed the resamples from ``seed``
    and the run's durations (what ``compare`` does). The phases are as the verdict judges them
    (``steps.gc_free_steps``): a collector pause inside ``data_wait`` is other, as in the
    summary (a first slice's full collection in ``next()`` had read as a data stall here only)."""
    m, _ = clean_measured(judged_steps(run))
    out: list[Metric] = []
    dur = m["duration_s"].to_numpy(dtype="float64") if not m.empty else np.array([])
    total = float(dur.sum())
    k = len(dur)
    if k:
        samples = m["samples"].to_numpy(dtype="float64")
        cols = [c for c in PHASE_COLUMNS if c in m.columns]
        parts = m[cols].to_numpy(dtype="float64") if cols else np.empty((k, 0))
        s = content_seed(seed, dur) if seed_by_content else seed
        draws = step_resamples(samples, dur, parts, resamples_for(k, n), s)
        breaks = [j for j, c in enumerate(cols) if c in INTERRUPTIONS]
        training = dur - parts[:, breaks].sum(axis=1) if breaks else dur
        thr_drift, p50_drift, drift_ms = half_drifts(samples, training, parts)
        counted = samples.sum() > 0 and total > 0
        thr = float(samples.sum() / total) if counted else float("nan")
        thr_draws = draws["throughput"] if counted else np.full(len(draws["throughput"]), np.nan)
        out.append(Metric("throughput", "samples/s", thr, _ci(thr_draws), "higher", "ratio", thr_draws, k,
                          thr_drift))
        med = draws["median_s"] * 1e3
        out.append(Metric("step_time_p50", "ms", float(np.median(dur)) * 1e3, _ci(med), "lower", "ratio", med, k,
                          p50_drift))
        step_ms = total / k * 1e3
        for j, col in enumerate(cols):
            # a phase's own time per step: it moves with that phase only (its share moves
            # whenever another phase does); more of it in the same step is worse
            ms = draws["means"][:, j] * 1e3
            out.append(Metric(f"{col[:-2]}_time", "ms/step", float(parts[:, j].mean()) * 1e3, _ci(ms), "lower",
                              "time", ms, k, float(drift_ms[j]), step_ms))
        out += phase_shares(samples, dur, parts, cols, draws["shares"], resamples_for(k, n), s)
    for key, nbytes in peak_memory_bytes(run.memory).items():
        out.append(Metric(f"peak_memory_{key}", "MiB", nbytes / MIB, direction="lower"))
    for device, per_sample_j in energy_per_sample_j(run).items():
        out.append(Metric(f"energy_per_sample[{device}]", "J/sample", per_sample_j, direction="lower"))
    if "loss" in m.columns:
        loss = pd.to_numeric(m["loss"], errors="coerce").dropna()
        if not loss.empty:
            out.append(Metric("loss_final", "", float(loss.iloc[-1])))
    return out


def _ci(draws: np.ndarray, level: float = CI_LEVEL) -> tuple[float, float]:
    d = draws[np.isfinite(draws)]
    if not len(d):
        return float("nan"), float("nan")
    tail = (1.0 - level) / 2 * 100
    lo, hi = np.percentile(d, [tail, 100 - tail])
    return float(lo), float(hi)


def phase_shares(samples: np.ndarray, dur: np.ndarray, parts: np.ndarray, cols: list[str], shares: np.ndarray,
                 n: int, seed: int) -> list[Metric]:
    """Each phase's share of step time (%), with its interval: shown beside the phase times,
    not judged (``test=""``: a share moves whenever another phase does)."""
    k, total = len(dur), float(dur.sum())
    # the training phases' shares are of training time: an evaluation or a save inside the
    # slice (their own shares are of the whole step) had moved every other share (a run with
    # an evaluation read forward -9 pp against one without, training alike)
    breaks = [j for j, c in enumerate(cols) if c in INTERRUPTIONS]
    train_dur = dur - parts[:, breaks].sum(axis=1) if breaks else dur
    train_total = float(train_dur.sum())
    train_shares = (step_resamples(samples, train_dur, parts, n, seed)["shares"]
                    if breaks and train_total < total else shares)
    out = []
    for j, col in enumerate(cols):
        name = "data_stall_share" if col == "data_wait_s" else f"{col[:-2]}_share"
        whole, of = (total, shares) if col in INTERRUPTIONS else (train_total, train_shares)
        share = float(parts[:, j].sum() / whole) * 100 if whole > 0 else float("nan")
        d = of[:, j] * 100
        out.append(Metric(name, "%", share, _ci(d), draws=d, steps=k))
    return out


def half_drifts(samples: np.ndarray, dur: np.ndarray, parts: np.ndarray) -> tuple[float, float, np.ndarray]:
    """How far a run's figures move between the first and second halves of its measured
    steps, in order (the middle step of an odd count in the second): throughput and median
    step time as ``log_drift``, each phase's time per step in ms (``[P]``). NaN under 2 steps.
    ``dur``: the steps' training time (what interrupts training taken out: a setup or an
    evaluation in one half is no load). Each half's figure is its steps' trimmed mean
    (``_trimmed``): a few odd steps (a queue's last batches, a slow first one) move it little."""
    k = len(dur)
    if k < 2:
        return float("nan"), float("nan"), np.full(parts.shape[1], np.nan)
    first, second = slice(0, k // 2), slice(k // 2, k)
    with np.errstate(divide="ignore", invalid="ignore"):
        rate = np.where(dur > 0, samples / dur, np.nan)
    thr = [_trimmed(rate[h]) for h in (first, second)]
    p50 = [float(np.median(dur[h])) for h in (first, second)]
    phases_ms = np.abs(np.array([_trimmed(c) for c in parts[second].T]) -
                       np.array([_trimmed(c) for c in parts[first].T])) * 1e3
    return log_drift(*thr), log_drift(*p50), phases_ms.reshape(parts.shape[1])


def _trimmed(values: np.ndarray, cut: float = 0.25) -> float:
    """The mean of ``values`` without their lowest and highest ``cut`` (NaN dropped)."""
    v = np.sort(values[np.isfinite(values)])
    if not len(v):
        return float("nan")
    k = int(len(v) * cut)
    return float(v[k:len(v) - k].mean())


def log_drift(first: float, second: float) -> float:
    """``|ln(second / first)|``: how far apart a figure is between a run's halves; inf where
    one half is 0 and the other is not, NaN where a half has no figure."""
    if not (np.isfinite(first) and np.isfinite(second)) or min(first, second) < 0:
        return float("nan")
    if first == second:
        return 0.0
    if min(first, second) == 0:
        return float("inf")
    return abs(math.log(second / first))


def peak_memory_bytes(memory: pd.DataFrame) -> dict[str, float]:
    """Peak bytes per memory category (and ``total``): from the ``peak`` rows of a category
    when it has any, else from all its rows. With several devices the key carries the device
    (``activations[cuda:0]``). ``total`` is the largest sum over categories at one recorded
    boundary (step, phase, event, time, device)."""
    if memory is None or memory.empty:
        return {}
    devices = sorted(memory["device"].astype(str).unique())
    out: dict[str, float] = {}
    for device in devices:
        d = memory[memory["device"].astype(str) == device]
        suffix = f"[{device}]" if len(devices) > 1 else ""
        for category, g in d.groupby("category", sort=True):
            peaks = g[g["event"] == "peak"]
            out[f"{category}{suffix}"] = float((peaks if not peaks.empty else g)["bytes"].max())
        at_once = d.groupby(["step", "phase", "event", "t_s"], sort=False)["bytes"].sum()
        out[f"total{suffix}"] = float(at_once.max())
    return out


def energy_per_sample_j(run: "Run") -> dict[str, float]:
    """Joules per sample over the measured steps, per device with an ``energy_j`` counter
    (the counter's difference over each step, summed, divided by the samples of the steps
    it covers: ``clock_analysis.clock_summary``)."""
    clocks = run.clocks
    if clocks is None or clocks.empty or not (clocks["metric"] == "energy_j").any():
        return {}
    from .clocks import clock_summary

    cs = clock_summary(clocks, run.steps)
    if cs is None:
        return {}
    return {device: float(e["per_sample_j"]) for device, e in cs.energy.items() if e.get("source") == "counter"}


# -- the comparison ----------------------------------------------------------------------------

@dataclass
class Comparison:
    """``table``: one row per (metric, run) (``TABLE_COLUMNS``; ``why``: what a change that is
    not called significant fell short of); ``warnings``: reasons to read
    the table with care; ``steps`` and ``phases``: frames for the overlaid charts;
    ``baseline``: the label every change is measured against; ``counts``: measured steps per
    run (after NaN durations are dropped)."""

    runs: list["Run"]
    labels: list[str]
    table: pd.DataFrame
    warnings: list[str] = field(default_factory=list)
    steps: pd.DataFrame = field(default_factory=pd.DataFrame)
    phases: pd.DataFrame = field(default_factory=pd.DataFrame)
    baseline: str = ""
    counts: dict[str, int] = field(default_factory=dict)

    def wide(self, what: str = "value") -> pd.DataFrame:
        """One row per run (in the comparison's order), one column per metric (its label and
        unit): ``what`` is ``"value"``, ``"delta_pct"`` or ``"significant"``."""
        t = self.table.assign(column=[f"{lab} ({u})" if u else lab for lab, u in zip(self.table["label"],
                                                                                      self.table["unit"])])
        cols = list(dict.fromkeys(t["column"]))
        w = t.pivot(index="run", columns="column", values=what) if not t.empty else pd.DataFrame()
        return w.reindex(index=self.labels, columns=cols)

    def verdict(self, metric: str, run: str) -> str:
        """The verdict on ``run``'s change in ``metric`` (``SIGNIFICANT``, ``NO_DIFFERENCE``,
        ``NOT_ENOUGH_DATA``, ``NOT_TESTED``, ``BASELINE``); ``""`` when the run lacks it."""
        r = self.table[(self.table["metric"] == metric) & (self.table["run"] == run)]
        return str(r["significant"].iloc[0]) if not r.empty else ""

    def charts(self) -> list[tuple[str, Any]]:
        """The charts, ``(title, altair chart)``, intervals first, skipping those with no data."""
        from ..views.compare import comparison_charts  # a rich-display hook: drawing is the views' job

        return comparison_charts(self)

    def to_text(self) -> str:
        lines = [f"tpkit comparison: {', '.join(self.labels)} (changes against '{self.baseline}'; "
                 f"{CI_LEVEL:.0%} bootstrap intervals; significant = interval excludes 0, at least "
                 f"{REL_THRESHOLD:.0%} apart ({SHARE_THRESHOLD_PP:g}% of the step for a phase's time) and more than "
                 f"{DRIFT_FACTOR:g}x the drift between a run's own halves; shares are not judged)"]
        lines += [f"  WARNING: {w}" for w in self.warnings]
        for (label, unit), g in self.table.groupby(["label", "unit"], sort=False):
            lines.append(f"  {label}" + (f" ({unit})" if unit else ""))
            for r in g.itertuples(index=False):
                txt = f"    {r.run:<16} {fmt_num(r.value)}"
                if not np.isnan(r.ci_low):
                    txt += f" [{fmt_num(r.ci_low)}, {fmt_num(r.ci_high)}]"
                if r.significant != BASELINE:
                    txt += f"  {fmt_signed(r.delta)} ({fmt_signed(r.delta_pct)}%)"
                    if r.significant != NOT_TESTED:
                        txt += f"  {r.significant}" + (f" ({r.direction})" if r.direction else "")
                        txt += f": {r.why}" if r.why else ""
                lines.append(txt)
        return "\n".join(lines)

    def to_html(self, charts: bool = True) -> str:
        """A static HTML view (tables, and the charts as inline SVG made offline): renders
        anywhere, with no JavaScript."""
        from ..views.compare import comparison_html

        return comparison_html(self, charts="svg" if charts else "none")

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        return {"text/plain": self.to_text(), "text/html": self.to_html()}

    def __repr__(self) -> str:
        return self.to_text()


def unique_labels(runs: list["Run"]) -> list[str]:
    """Run names, with ``#2``, ``#3``... added where two runs share a name."""
    seen: dict[str, int] = {}
    out = []
    for r in runs:
        seen[r.name] = seen.get(r.name, 0) + 1
        out.append(r.name if seen[r.name] == 1 else f"{r.name}#{seen[r.name]}")
    return out


def judge(test: str, base: Metric, m: Metric, delta_low: float, delta_high: float) -> str:
    """The verdict on the change from ``base`` to ``m`` (see the module docstring)."""
    return judgement(test, base, m, delta_low, delta_high)[0]


def judgement(test: str, base: Metric, m: Metric, delta_low: float, delta_high: float) -> tuple[str, str]:
    """``judge``'s verdict and why a change is not called (``""`` when it is, or untested)."""
    if not test:
        return NOT_TESTED, ""
    if min(base.steps, m.steps) < MIN_STEPS:
        return NOT_ENOUGH_DATA, f"fewer than {MIN_STEPS} measured steps in a run"
    if not (np.isfinite(base.value) and np.isfinite(m.value) and np.isfinite(delta_low)
            and np.isfinite(delta_high)) or (test == "ratio" and min(base.value, m.value) <= 0):
        return NOT_ENOUGH_DATA, "unknown in a run"
    if not (delta_low > 0 or delta_high < 0):
        return NO_DIFFERENCE, f"the {CI_LEVEL:.0%} interval of the change includes 0"
    halves = float(np.nanmax([base.drift, m.drift, 0.0]))
    if test == "ratio":
        change, floor = abs(math.log(m.value / base.value)), math.log1p(REL_THRESHOLD)
        if change < floor:
            return NO_DIFFERENCE, f"under the {REL_THRESHOLD:.0%} threshold"
        bar = min(DRIFT_FACTOR * halves, math.log1p(DRIFT_CAP))
        if change <= bar:
            return NO_DIFFERENCE, (f"within run-to-run drift: a run's own halves differ by up to "
                                   f"{math.expm1(halves):.1%}, so a change is called from {math.expm1(bar):.1%}")
        return SIGNIFICANT, ""
    step_ms = max(base.step_ms, m.step_ms)
    change, floor = abs(m.value - base.value), SHARE_THRESHOLD_PP / 100 * step_ms
    if change < floor:
        return NO_DIFFERENCE, f"under the threshold ({SHARE_THRESHOLD_PP:g}% of the step: {fmt_num(floor)} ms)"
    bar = min(DRIFT_FACTOR * halves, DRIFT_CAP * step_ms)
    if change <= bar:
        return NO_DIFFERENCE, (f"within run-to-run drift: a run's own halves differ by up to "
                               f"{fmt_num(halves)} ms a step, so a change is called from {fmt_num(bar)} ms")
    return SIGNIFICANT, ""


def comparison_table(per_run: list[list[Metric]], labels: list[str], base: int = 0) -> pd.DataFrame:
    """Rows for every metric any run has, in first-seen order, runs in ``labels`` order;
    changes, their intervals and verdicts against run ``base`` (NaN where it lacks the metric)."""
    order: list[tuple[str, str]] = []
    by_key: list[dict[str, Metric]] = []
    for metrics in per_run:
        by_key.append({m.metric: m for m in metrics})
        for m in metrics:
            if (m.metric, m.unit) not in order:
                order.append((m.metric, m.unit))
    rows = []
    nan = float("nan")
    for metric, unit in order:
        b: Metric | None = by_key[base].get(metric)
        for i, label in enumerate(labels):
            cand = by_key[i].get(metric)
            if cand is None:
                continue
            lo = hi = nan
            why = ""
            if i == base:
                delta, pct, sig = 0.0, 0.0, BASELINE
            elif b is None:
                delta, pct, sig = nan, nan, NOT_ENOUGH_DATA if cand.test else NOT_TESTED
                why = "not in the baseline" if cand.test else ""
            else:
                delta = cand.value - b.value
                pct = delta / b.value * 100 if b.value and np.isfinite(b.value) else nan
                if cand.test and cand.draws is not None and b.draws is not None:
                    lo, hi = diff_interval(b.draws, cand.draws)
                sig, why = judgement(cand.test, b, cand, lo, hi)
            direction = ""
            if sig == SIGNIFICANT and cand.direction:
                direction = "better" if (delta > 0) == (cand.direction == "higher") else "worse"
            scale = 100 / b.value if b is not None and b.value and np.isfinite(b.value) else nan
            rows.append((metric, metric_label(metric), unit, label, cand.value, cand.ci[0], cand.ci[1], delta, pct, lo, hi,
                         lo * scale, hi * scale, sig, direction, why))
    return pd.DataFrame(rows, columns=list(TABLE_COLUMNS))


def drop_idle_phases(table: pd.DataFrame) -> pd.DataFrame:
    """Leave out phase-time, phase-share and memory-category rows that are zero in every run
    (the data wait and stall stay: 0 is the answer a user looks for)."""
    share = (table["metric"].str.endswith("_share") | table["metric"].str.endswith("_time")) \
        & ~table["metric"].isin(["data_stall_share", "data_wait_time"])
    share |= table["metric"].str.startswith("peak_memory_")
    idle = table[share].groupby("metric")["value"].apply(lambda v: bool((v.fillna(0) == 0).all()))
    return table[~table["metric"].isin(idle[idle].index)].reset_index(drop=True)


def unsteady_warnings(per_run: list[list[Metric]], labels: list[str]) -> list[str]:
    """Runs whose training throughput moved more than ``DRIFT_CAP`` between the halves of their
    own steps: a change up to that is read as drift, a larger one is called, and either way such
    a run's figures depend on where it was cut."""
    out = []
    for metrics, label in zip(per_run, labels):
        drift = next((m.drift for m in metrics if m.metric == "throughput"), float("nan"))
        if np.isfinite(drift) and drift > math.log1p(DRIFT_CAP):
            out.append(f"'{label}' was not steady: its training throughput differs by {math.expm1(drift):.0%} between the "
                       "halves of its measured steps (a loader's queue draining, throttling, a load that came or went): "
                       f"changes up to {DRIFT_CAP:.0%} are read as drift, larger ones are called; a longer slice "
                       "or more warmup steadies it")
    return out


def comparison_warnings(runs: list["Run"], labels: list[str], dropped: dict[str, int] | None = None) -> list[str]:
    """What makes a comparison of these runs less than like for like."""
    out = []
    models = {}
    for r, label in zip(runs, labels):
        mdl = r.meta.get("model")
        if isinstance(mdl, dict) and ("class" in mdl or "parameters" in mdl):
            models[label] = (mdl.get("class"), mdl.get("parameters"))
    if len(set(models.values())) > 1:
        desc = ", ".join(f"{k}: {c} with {p:,} parameters" if isinstance(p, int) else f"{k}: {c}"
                         for k, (c, p) in models.items())
        out.append(f"different models ({desc}): differences may come from the model, not the knob")
    for label, k in (dropped or {}).items():
        if k:
            out.append(f"'{label}': {k} measured step{'s' if k != 1 else ''} with a NaN duration left out")
    counts = {label: len(clean_measured(r.steps)[0]) for r, label in zip(runs, labels)}
    if len(set(counts.values())) > 1:
        out.append("different numbers of measured steps ("
                   + ", ".join(f"{k}: {v}" for k, v in counts.items()) + "): intervals differ in width")
    for label, k in counts.items():
        if k < MIN_STEPS:
            out.append(f"'{label}' has {k} measured step{'s' if k != 1 else ''} (fewer than {MIN_STEPS}): "
                       "not enough data to call a difference")
    for r, label in zip(runs, labels):
        m = clean_measured(r.steps)[0]
        if len(m) and not (pd.to_numeric(m["samples"], errors="coerce").fillna(0) > 0).any():
            out.append(f"'{label}' counted no samples: its throughput is unknown")
    breaks = {}
    for r, label in zip(runs, labels):
        m = clean_measured(r.steps)[0]
        total = float(m["duration_s"].sum()) if len(m) else 0.0
        parts = {INTERRUPTIONS[c][1]: float(m[c].sum()) / total for c in INTERRUPTIONS if c in m.columns and total > 0}
        breaks[label] = {what: share for what, share in parts.items() if share > 0}
    if any(breaks.values()):
        held = "; ".join(f"'{k}': " + (", ".join(f"{w} {v:.0%}" for w, v in b.items()) or "none")
                         for k, b in breaks.items())
        out.append(f"what interrupts training ran inside the slice ({held} of step time): throughput and step "
                   "time count them; each phase's time per step is its own, the other phases' shares are of "
                   "training time, theirs of the whole step")
    unseen = [label for r, label in zip(runs, labels)
              if any(UNSEEN_UPDATES_NOTE in str(n) for n in r.meta.get("notes", []))]
    if unseen and len(unseen) < len(runs):
        out.append(f"{', '.join(repr(k) for k in unseen)}: the optimizer's updates ran where tpkit cannot time them "
                   "(a compiled optimizer step: its time is other there, optimizer in the others): the optimizer and "
                   "other times differ for that reason; compare step time and their sum")
    blind = [label for r, label in zip(runs, labels) if not batches_seen(clean_measured(r.steps)[0], r.meta)]
    if blind and len(blind) < len(runs):
        out.append(f"{', '.join(repr(k) for k in blind)}: no batch was seen (a loader tpkit does not see: wrap it, or "
                   "the function that makes the batches, in tp.watch), so its wait for data is other there, data_wait in the others: the data wait and "
                   "other differ for that reason")
    for r, label in zip(runs, labels):
        if not r.complete:
            why = r.meta.get("error") or r.meta.get("stopped_by") or "stopped early"
            out.append(f"'{label}' is incomplete ({why}): its figures cover only the steps that ran")
    devices = {label: tuple(r.meta["devices"]) for r, label in zip(runs, labels) if r.meta.get("devices")}
    if len(set(devices.values())) > 1:
        out.append("the runs ran on different devices (" + "; ".join(f"{k}: {', '.join(v)}" for k, v in devices.items()) + ")")
    return out


def steps_frame(runs: list["Run"], labels: list[str]) -> pd.DataFrame:
    """Per-step durations of every run, for overlays: ``run, step, warmup, duration_ms``
    (steps with a NaN duration left out)."""
    parts = [pd.DataFrame({"run": label, "step": r.steps["step"].to_numpy(), "warmup": r.steps["warmup"].to_numpy(),
                           "duration_ms": pd.to_numeric(r.steps["duration_s"], errors="coerce").to_numpy(
                               dtype="float64") * 1e3})
             for r, label in zip(runs, labels)]
    df = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=["run", "step", "warmup", "duration_ms"])
    return df[np.isfinite(df["duration_ms"].to_numpy(dtype="float64"))].reset_index(drop=True)


def phases_frame(runs: list["Run"], labels: list[str]) -> pd.DataFrame:
    """Median milliseconds and share of step time per phase per run (measured steps):
    ``run, phase, median_ms, share``. Phases no run spent time in are left out. As judged
    (``judged_steps``): the phase chart had shown a collector pause in ``next()`` as data_wait
    beside a table that read it other."""
    rows = []
    for r, label in zip(runs, labels):
        m, _ = clean_measured(judged_steps(r))
        total = float(m["duration_s"].sum()) if not m.empty else 0.0
        for col in PHASE_COLUMNS:
            if col in m.columns and not m.empty:
                rows.append((label, col[:-2], float(m[col].median()) * 1e3,
                             float(m[col].sum()) / total if total > 0 else float("nan")))
    df = pd.DataFrame(rows, columns=["run", "phase", "median_ms", "share"])
    used = df.groupby("phase")["share"].max()
    return df[df["phase"].isin(used[used > 0].index)].reset_index(drop=True)


def baseline_index(baseline: "int | str | Run | None", runs: Sequence["Run"], labels: list[str]) -> int:
    """Where the baseline stands among ``runs``: an index, a label or run name, or a Run."""
    if baseline is None:
        return 0
    if isinstance(baseline, bool):
        raise TpkitError(f"baseline must be a run, its name or its position, not {baseline!r}")
    if isinstance(baseline, int):
        if -len(runs) <= baseline < len(runs):
            return baseline % len(runs)
        raise TpkitError(f"baseline={baseline} but there are {len(runs)} runs")
    if isinstance(baseline, str):
        for i, (r, label) in enumerate(zip(runs, labels)):
            if baseline in (label, r.name):
                return i
        raise TpkitError(f"baseline={baseline!r} is none of the compared runs: {', '.join(labels)}")
    for i, r in enumerate(runs):
        if r is baseline:
            return i
    raise TpkitError("baseline is a Run that is not among the compared runs: pass it to compare too")


def compare(*runs: "Run", baseline: "int | str | Run | None" = None, n: int = BOOTSTRAP_N,
            seed: int = BOOTSTRAP_SEED) -> Comparison:
    """Compare Runs against a baseline (default: the first); ``tp.compare`` also takes store
    names and folders (it loads them, then calls this).

    ``compare(a, b, c, baseline="b")``: ``.table`` per (metric, run), ``.wide()`` one row
    per run, ``.warnings``, ``.to_text()``, ``.to_html()``; the rule that calls a change
    significant is in this module's docstring.
    """
    if len(runs) == 1 and isinstance(runs[0], (list, tuple)):
        runs = tuple(runs[0])
    if not runs:
        raise ValueError("compare needs at least one run")
    bad = [r for r in runs if not hasattr(r, "steps")]
    if bad:
        raise TypeError(f"compare takes Runs, not {type(bad[0]).__name__}: tp.compare loads names and folders")
    loaded = list(runs)
    labels = unique_labels(loaded)
    base = baseline_index(baseline, loaded, labels)
    dropped = {label: clean_measured(r.steps)[1] for r, label in zip(loaded, labels)}
    if any(dropped.values()):
        _warnings.warn("tpkit.compare: measured steps with a NaN duration left out ("
                       + ", ".join(f"{k}: {v}" for k, v in dropped.items() if v) + ")", RuntimeWarning, stacklevel=2)
    per_run = [run_metrics(r, n, seed, seed_by_content=True) for r in loaded]
    table = drop_idle_phases(comparison_table(per_run, labels, base))
    warnings = comparison_warnings(loaded, labels, dropped) + unsteady_warnings(per_run, labels)
    return Comparison(runs=loaded, labels=labels, table=table, warnings=warnings,
                      steps=steps_frame(loaded, labels), phases=phases_frame(loaded, labels), baseline=labels[base],
                      counts={label: len(clean_measured(r.steps)[0]) for r, label in zip(loaded, labels)})


__all__ = ["BASELINE", "DRIFT_CAP", "DRIFT_FACTOR", "MIN_STEPS", "NOT_ENOUGH_DATA", "NOT_TESTED", "NO_DIFFERENCE", "REL_THRESHOLD",
           "SHARE_THRESHOLD_PP", "SIGNIFICANT", "TABLE_COLUMNS", "Comparison", "Metric", "compare", "comparison_table",
           "fmt_num", "fmt_signed", "judge", "judgement", "run_metrics"]
