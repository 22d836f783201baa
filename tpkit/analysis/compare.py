"""Run-to-run comparison with honest statistics: pure functions over Runs' frames.

``compare(a, b, ...)`` gives one row per (metric, run) with the value, a bootstrap 95%
confidence interval where the metric comes from per-step numbers, the change against the
first run, and whether the intervals overlap. Overlapping intervals read "no significant
difference": the conservative reading (two intervals can overlap a little while a proper
test would still find a difference), which is the right way to err when a user is deciding
whether a knob helped.

Conventions, chosen once:

- Statistics use the measured steps only (warmup excluded).
- Ratio metrics (throughput, phase shares) are ratios of totals, ``sum(samples) /
  sum(duration_s)``, and are bootstrapped by resampling whole steps, so a step's samples and
  its duration stay together.
- The bootstrap is the percentile bootstrap, seeded, numpy only: results are reproducible.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from ..schema import MIB, PHASE_COLUMNS
from .stats import BOOTSTRAP_N, BOOTSTRAP_SEED, CI_LEVEL, cis_overlap, resamples_for, step_bootstrap
from .steps import measured

if TYPE_CHECKING:
    from ..run import Run

TABLE_COLUMNS: tuple[str, ...] = ("metric", "unit", "run", "value", "ci_low", "ci_high", "delta", "delta_pct",
                                  "significant", "direction")
NO_DIFFERENCE = "no significant difference"
SIGNIFICANT = "significant"
BASELINE = "baseline"
NOT_TESTED = "n/a"


@dataclass
class Metric:
    metric: str
    unit: str
    value: float
    ci: tuple[float, float] = (float("nan"), float("nan"))
    direction: str = ""  # which way is better: "higher", "lower" or "" (no judgement)


def run_metrics(run: "Run", n: int = BOOTSTRAP_N, seed: int = BOOTSTRAP_SEED) -> list[Metric]:
    """Every comparable figure of one run, with confidence intervals where steps give them."""
    m = measured(run.steps)
    out: list[Metric] = []
    dur = m["duration_s"].to_numpy(dtype="float64") if not m.empty else np.array([])
    total = float(dur.sum())
    if dur.size:
        samples = m["samples"].to_numpy(dtype="float64")
        cols = [c for c in PHASE_COLUMNS if c in m.columns]
        parts = m[cols].to_numpy(dtype="float64") if cols else np.empty((len(dur), 0))
        if len(dur) > 1:
            ci = step_bootstrap(samples, dur, parts, resamples_for(len(dur), n), seed)
        else:  # one step: the interval is the point
            one = (samples[0] / dur[0], dur[0], parts[0] / dur[0])
            ci = {"throughput": (one[0], one[0]), "median_s": (one[1], one[1]), "shares": (one[2], one[2])}
        thr = float(samples.sum() / total) if total > 0 else float("nan")
        out.append(Metric("throughput", "samples/s", thr, (float(ci["throughput"][0]), float(ci["throughput"][1])),
                          "higher"))
        lo, hi = ci["median_s"]
        out.append(Metric("step_time_p50", "ms", float(np.median(dur)) * 1e3, (float(lo) * 1e3, float(hi) * 1e3),
                          "lower"))
        for j, col in enumerate(cols):
            name = "data_stall_share" if col == "data_wait_s" else f"{col[:-2]}_share"
            share = float(parts[:, j].sum() / total) if total > 0 else float("nan")
            lo, hi = ci["shares"][0][j], ci["shares"][1][j]
            out.append(Metric(name, "%", share * 100, (float(lo) * 100, float(hi) * 100),
                              "lower" if col in ("data_wait_s", "h2d_s", "other_s") else ""))
    for key, nbytes in peak_memory_bytes(run.memory).items():
        out.append(Metric(f"peak_memory_{key}", "MiB", nbytes / MIB, direction="lower"))
    for device, per_sample_j in energy_per_sample_j(run).items():
        out.append(Metric(f"energy_per_sample[{device}]", "J/sample", per_sample_j, direction="lower"))
    if "loss" in m.columns:
        loss = m["loss"].dropna()
        if not loss.empty:
            out.append(Metric("loss_final", "", float(loss.iloc[-1])))
    return out


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
    """``table``: one row per (metric, run) (``TABLE_COLUMNS``); ``warnings``: reasons to read
    the table with care; ``steps`` and ``phases``: frames for the overlaid charts."""

    runs: list["Run"]
    labels: list[str]
    table: pd.DataFrame
    warnings: list[str] = field(default_factory=list)
    steps: pd.DataFrame = field(default_factory=pd.DataFrame)
    phases: pd.DataFrame = field(default_factory=pd.DataFrame)

    def wide(self) -> pd.DataFrame:
        """Metrics as rows, runs as columns (values only)."""
        w = self.table.pivot_table(index=["metric", "unit"], columns="run", values="value", sort=False)
        return w[self.labels] if set(self.labels) <= set(w.columns) else w

    def charts(self) -> list[tuple[str, Any]]:
        """The overlaid charts, ``(title, altair chart)``, skipping those with no data: step
        time per step, median time per phase, and the intervals of step time and throughput."""
        from ..views.compare import comparison_charts  # a rich-display hook: drawing is the views' job

        return comparison_charts(self)

    def to_text(self) -> str:
        lines = [f"tpkit comparison: {', '.join(self.labels)} (deltas against '{self.labels[0]}'; "
                 f"{CI_LEVEL:.0%} bootstrap intervals)"]
        lines += [f"  WARNING: {w}" for w in self.warnings]
        for (metric, unit), g in self.table.groupby(["metric", "unit"], sort=False):
            lines.append(f"  {metric}" + (f" ({unit})" if unit else ""))
            for r in g.itertuples(index=False):
                txt = f"    {r.run:<16} {_num(r.value)}"
                if not np.isnan(r.ci_low):
                    txt += f" [{_num(r.ci_low)}, {_num(r.ci_high)}]"
                if r.significant != BASELINE:
                    txt += f"  {_signed(r.delta)} ({_signed(r.delta_pct)}%)"
                    if r.significant != NOT_TESTED:
                        txt += f"  {r.significant}" + (f" ({r.direction})" if r.direction else "")
                lines.append(txt)
        return "\n".join(lines)

    def to_html(self) -> str:
        warn = "".join(f'<div style="color:#b00020;font-weight:600">&#9888; {html.escape(w)}</div>'
                       for w in self.warnings)
        rows = []
        for r in self.table.itertuples(index=False):
            ci = "" if np.isnan(r.ci_low) else f"[{_num(r.ci_low)}, {_num(r.ci_high)}]"
            delta = "" if r.significant == BASELINE else f"{_signed(r.delta)} ({_signed(r.delta_pct)}%)"
            sig = "" if r.significant in (BASELINE, NOT_TESTED) else r.significant
            cells = [r.metric, r.unit, r.run, _num(r.value), ci, delta,
                     f"{sig} ({r.direction})" if r.direction else sig]
            rows.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>")
        head = "".join(f"<th>{h}</th>" for h in ("metric", "unit", "run", "value", "95% CI", "delta", "significance"))
        return (f'<div class="tpkit-compare">{warn}<table><thead><tr>{head}</tr></thead>'
                f'<tbody>{"".join(rows)}</tbody></table></div>')

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        return {"text/plain": self.to_text(), "text/html": self.to_html()}

    def __repr__(self) -> str:
        return self.to_text()


def _num(x: float) -> str:
    if x is None or np.isnan(x):
        return "nan"
    return f"{x:,.4g}" if abs(x) < 1000 else f"{x:,.1f}"


def _signed(x: float) -> str:
    return "nan" if x is None or np.isnan(x) else f"{x:+,.4g}" if abs(x) < 1000 else f"{x:+,.1f}"


def unique_labels(runs: list["Run"]) -> list[str]:
    """Run names, with ``#2``, ``#3``... added where two runs share a name."""
    seen: dict[str, int] = {}
    out = []
    for r in runs:
        seen[r.name] = seen.get(r.name, 0) + 1
        out.append(r.name if seen[r.name] == 1 else f"{r.name}#{seen[r.name]}")
    return out


def comparison_table(per_run: list[list[Metric]], labels: list[str]) -> pd.DataFrame:
    """Rows for every metric any run has, in first-seen order; deltas and significance
    against the first run's value (NaN where the first run lacks the metric)."""
    order: list[tuple[str, str]] = []
    by_key: list[dict[str, Metric]] = []
    for metrics in per_run:
        by_key.append({m.metric: m for m in metrics})
        for m in metrics:
            if (m.metric, m.unit) not in order:
                order.append((m.metric, m.unit))
    rows = []
    for metric, unit in order:
        base = by_key[0].get(metric)
        for i, label in enumerate(labels):
            m = by_key[i].get(metric)
            if m is None:
                continue
            if i == 0:
                delta, pct, sig = 0.0, 0.0, BASELINE
            elif base is None:
                delta, pct, sig = float("nan"), float("nan"), NOT_TESTED
            else:
                delta = m.value - base.value
                pct = delta / base.value * 100 if base.value else float("nan")
                overlap = cis_overlap(base.ci, m.ci)
                sig = NOT_TESTED if overlap is None else NO_DIFFERENCE if overlap else SIGNIFICANT
            direction = ""
            if sig == SIGNIFICANT and m.direction:
                better = (delta > 0) == (m.direction == "higher")
                direction = "better" if better else "worse"
            rows.append((metric, unit, label, m.value, m.ci[0], m.ci[1], delta, pct, sig, direction))
    return pd.DataFrame(rows, columns=list(TABLE_COLUMNS))


def drop_idle_phases(table: pd.DataFrame) -> pd.DataFrame:
    """Leave out phase-share and memory-category rows that are zero in every run (the data
    stall share stays: 0% is the answer a user looks for)."""
    share = table["metric"].str.endswith("_share") & (table["metric"] != "data_stall_share")
    share |= table["metric"].str.startswith("peak_memory_")
    idle = table[share].groupby("metric")["value"].apply(lambda v: bool((v.fillna(0) == 0).all()))
    return table[~table["metric"].isin(idle[idle].index)].reset_index(drop=True)


def comparison_warnings(runs: list["Run"], labels: list[str]) -> list[str]:
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
    counts = {label: len(measured(r.steps)) for r, label in zip(runs, labels)}
    if len(set(counts.values())) > 1:
        out.append("different numbers of measured steps ("
                   + ", ".join(f"{k}: {v}" for k, v in counts.items()) + "): intervals differ in width")
    for label, k in counts.items():
        if k < 2:
            out.append(f"'{label}' has {k} measured step{'s' if k != 1 else ''}: no confidence interval")
    for r, label in zip(runs, labels):
        if not r.complete:
            why = r.meta.get("error") or r.meta.get("stopped_by") or "stopped early"
            out.append(f"'{label}' is incomplete ({why}): its figures cover only the steps that ran")
    devices = {label: tuple(r.meta["devices"]) for r, label in zip(runs, labels) if r.meta.get("devices")}
    if len(set(devices.values())) > 1:
        out.append("the runs ran on different devices (" + "; ".join(f"{k}: {', '.join(v)}" for k, v in devices.items()) + ")")
    return out


def steps_frame(runs: list["Run"], labels: list[str]) -> pd.DataFrame:
    """Per-step durations of every run, for overlays: ``run, step, warmup, duration_ms``."""
    parts = [pd.DataFrame({"run": label, "step": r.steps["step"].to_numpy(), "warmup": r.steps["warmup"].to_numpy(),
                           "duration_ms": r.steps["duration_s"].to_numpy(dtype="float64") * 1e3})
             for r, label in zip(runs, labels)]
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=["run", "step", "warmup", "duration_ms"])


def phases_frame(runs: list["Run"], labels: list[str]) -> pd.DataFrame:
    """Median milliseconds and share of step time per phase per run (measured steps):
    ``run, phase, median_ms, share``. Phases no run spent time in are left out."""
    rows = []
    for r, label in zip(runs, labels):
        m = measured(r.steps)
        total = float(m["duration_s"].sum()) if not m.empty else 0.0
        for col in PHASE_COLUMNS:
            if col in m.columns and not m.empty:
                rows.append((label, col[:-2], float(m[col].median()) * 1e3,
                             float(m[col].sum()) / total if total > 0 else float("nan")))
    df = pd.DataFrame(rows, columns=["run", "phase", "median_ms", "share"])
    used = df.groupby("phase")["share"].max()
    return df[df["phase"].isin(used[used > 0].index)].reset_index(drop=True)


def compare(*runs: "Run | str", n: int = BOOTSTRAP_N, seed: int = BOOTSTRAP_SEED) -> Comparison:
    """Compare runs (Runs, store names or folders) against the first one.

    ``tp.compare(base, other)``: ``.table`` per (metric, run), ``.warnings``, ``.to_text()``;
    charts from ``tpkit.charts.compare``.
    """
    from ..store import load

    if len(runs) == 1 and isinstance(runs[0], (list, tuple)):
        runs = tuple(runs[0])
    if not runs:
        raise ValueError("compare needs at least one run")
    loaded = [load(r) for r in runs]
    labels = unique_labels(loaded)
    table = drop_idle_phases(comparison_table([run_metrics(r, n, seed) for r in loaded], labels))
    return Comparison(runs=loaded, labels=labels, table=table, warnings=comparison_warnings(loaded, labels),
                      steps=steps_frame(loaded, labels), phases=phases_frame(loaded, labels))
