"""Clock, power and energy analysis: pure functions over ``run.clocks`` and ``run.steps``.

Nothing here measures or draws. Conventions, chosen once:

- A metric between two samples is the straight line between them; nothing is extrapolated
  beyond the first or last sample. A step's mean clock is the time-weighted mean of that line
  over the part of the step the samples cover, so a step shorter than the sampling period
  still gets the value the trace had at that moment.
- Energy comes from the device's ``energy_j`` counter when it has one (exact to the
  counter's resolution) and otherwise from integrating ``power_w`` / ``cpu_power_w``. A step
  whose samples cover under ``MIN_COVER`` of it gets NaN; one covered in part is scaled by its
  covered share (the edges of the slice, before the first and after the last sample).
- A step is throttled when a sample inside it (or, if none, the last one before it) had an
  NVML slowdown bit set (``SLOWDOWN_MASK``: power cap, thermal, HW slowdown, power brake, sync
  boost); idle and clock-setting bits are drawn as bands but do not count as throttling.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
import pandas as pd

from ..schema import SLOWDOWN_MASK, decode_throttle

#: Clock metrics in order of preference for "the" clock of a run.
PRIMARY_CLOCKS: tuple[str, ...] = ("sm_clock_mhz", "cpu_freq_mhz")
#: Power metrics integrated into energy when a device has no energy counter.
POWER_METRICS: tuple[str, ...] = ("power_w", "cpu_power_w")
#: Metrics that are not levels to average or draw as lines.
NOT_LEVELS: tuple[str, ...] = ("throttle_reasons", "energy_j")
MIN_COVER = 0.5
#: What the summary says of a clock that did not move, by where it was read (``flat_clock_note``).
FLAT_CLOCK = "did not change during the slice: no DVFS to see on this host"
FLAT_CPUINFO_CLOCK = ("constant in /proc/cpuinfo, the only frequency this host reports (no cpufreq "
                      "driver): a change of speed may not show in it")
FLAT_VM_CLOCK = ("constant: a virtual machine's /proc/cpuinfo gives a fixed figure, so a host "
                 "that slows the core for other guests' work does not show in it; read an uneven "
                 "step time with that in mind")


def _series(clocks: pd.DataFrame, device: str, metric: str) -> tuple[np.ndarray, np.ndarray]:
    s = clocks[(clocks["device"] == device) & (clocks["metric"] == metric)].sort_values("t_s", kind="stable")
    return s["t_s"].to_numpy(dtype="float64"), s["value"].to_numpy(dtype="float64")


def _integral(t: np.ndarray, v: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Exact integral from ``t[0]`` to each ``x`` (clipped into [t0, t_last]) of the straight
    lines between samples."""
    x = np.clip(np.asarray(x, dtype="float64"), t[0], t[-1])
    if len(t) == 1:
        return np.zeros_like(x)
    dt = np.diff(t)
    knots = np.concatenate([[0.0], np.cumsum(0.5 * (v[1:] + v[:-1]) * dt)])
    i = np.clip(np.searchsorted(t, x, side="right") - 1, 0, len(t) - 2)
    h = x - t[i]
    slope = np.divide(v[i + 1] - v[i], dt[i], out=np.zeros_like(h), where=dt[i] > 0)
    return knots[i] + v[i] * h + 0.5 * slope * h * h


def _covered(t: np.ndarray, start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return np.maximum(start, t[0]), np.minimum(end, t[-1])


def window_mean(t: np.ndarray, v: np.ndarray, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Time-weighted mean of the sampled line over each [start, end] (its covered part);
    NaN where no part of the window lies between the first and last sample."""
    start, end = np.asarray(start, dtype="float64"), np.asarray(end, dtype="float64")
    if len(t) == 0:
        return np.full(start.shape, np.nan)
    a, b = _covered(t, start, end)
    span = b - a
    out = np.full(start.shape, np.nan)
    ok = span > 0
    out[ok] = (_integral(t, v, b[ok]) - _integral(t, v, a[ok])) / span[ok]
    point = (span == 0) & (start >= t[0]) & (start <= t[-1])  # a zero-length window: the value there
    out[point] = np.interp(start[point], t, v)
    return out


def step_clocks(clocks: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """Mean of every level metric per step and device: ``step, device, metric, mean``."""
    rows = []
    if clocks.empty or steps.empty:
        return pd.DataFrame(columns=["step", "device", "metric", "mean"])
    start, end = steps["start_s"].to_numpy(), steps["end_s"].to_numpy()
    for (device, metric), _ in clocks.groupby(["device", "metric"], sort=True):
        if metric in NOT_LEVELS:
            continue
        t, v = _series(clocks, device, metric)
        means = window_mean(t, v, start, end)
        rows.append(pd.DataFrame({"step": steps["step"].to_numpy(), "device": device, "metric": metric,
                                  "mean": means}))
    return pd.concat(rows, ignore_index=True) if rows else pd.DataFrame(columns=["step", "device", "metric", "mean"])


def energy_sources(clocks: pd.DataFrame) -> dict[str, tuple[str, str]]:
    """device -> (metric, "counter" or "power") for every device whose energy can be known."""
    out: dict[str, tuple[str, str]] = {}
    if clocks.empty:
        return out
    have = set(zip(clocks["device"], clocks["metric"]))
    for device in sorted({d for d, _ in have}):
        if (device, "energy_j") in have:
            out[device] = ("energy_j", "counter")
        else:
            for m in POWER_METRICS:
                if (device, m) in have:
                    out[device] = (m, "power")
                    break
    return out


def step_energy(clocks: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """Joules per step and per sample for every device with an energy counter or a power
    reading: ``step, device, energy_j, energy_per_sample_j, source``."""
    cols = ["step", "device", "energy_j", "energy_per_sample_j", "source"]
    if clocks.empty or steps.empty:
        return pd.DataFrame(columns=cols)
    start, end = steps["start_s"].to_numpy(dtype="float64"), steps["end_s"].to_numpy(dtype="float64")
    samples = steps["samples"].to_numpy(dtype="float64")
    rows = []
    for device, (metric, source) in energy_sources(clocks).items():
        t, v = _series(clocks, device, metric)
        a, b = _covered(t, start, end)
        span = np.maximum(b - a, 0.0)
        if source == "counter":
            joules = np.interp(b, t, v) - np.interp(a, t, v)
        else:
            joules = _integral(t, v, b) - _integral(t, v, a)
        dur = end - start
        share = np.divide(span, dur, out=np.zeros_like(span), where=dur > 0)
        energy = np.where(share >= MIN_COVER, joules * np.divide(1.0, share, out=np.zeros_like(share),
                                                                   where=share > 0), np.nan)
        per_sample = np.divide(energy, samples, out=np.full_like(energy, np.nan), where=samples > 0)
        rows.append(pd.DataFrame({"step": steps["step"].to_numpy(), "device": device, "energy_j": energy,
                                  "energy_per_sample_j": per_sample, "source": source}))
    return pd.concat(rows, ignore_index=True) if rows else pd.DataFrame(columns=cols)


def step_throttle(clocks: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """Clock-event bits per step and GPU: ``step, device, mask, throttled, reasons``."""
    cols = ["step", "device", "mask", "throttled", "reasons"]
    if clocks.empty or steps.empty:
        return pd.DataFrame(columns=cols)
    rows = []
    for device in sorted(clocks.loc[clocks["metric"] == "throttle_reasons", "device"].unique()):
        t, v = _series(clocks, device, "throttle_reasons")
        masks = v.astype("int64")
        for step, a, b in zip(steps["step"], steps["start_s"], steps["end_s"]):
            inside = masks[(t >= a) & (t <= b)]
            if inside.size == 0:
                before = np.searchsorted(t, a, side="right") - 1
                inside = masks[before:before + 1] if before >= 0 else inside
            mask = int(np.bitwise_or.reduce(inside)) if inside.size else 0
            rows.append((int(step), device, mask, bool(mask & SLOWDOWN_MASK), ", ".join(decode_throttle(mask))))
    return pd.DataFrame(rows, columns=cols)


def throttle_bands(clocks: pd.DataFrame) -> pd.DataFrame:
    """Intervals where a GPU reported any clock-event reason: ``device, start_s, end_s, mask,
    reasons, slowdown``. A sample's reasons hold until the next sample; equal neighbours merge."""
    cols = ["device", "start_s", "end_s", "mask", "reasons", "slowdown"]
    rows: list[tuple] = []
    if clocks.empty:
        return pd.DataFrame(columns=cols)
    for device in sorted(clocks.loc[clocks["metric"] == "throttle_reasons", "device"].unique()):
        t, v = _series(clocks, device, "throttle_reasons")
        masks = v.astype("int64")
        gap = float(np.median(np.diff(t))) if len(t) > 1 else 0.0
        ends = np.append(t[1:], t[-1] + gap)
        for i, mask in enumerate(masks):
            if mask == 0:
                continue
            if rows and rows[-1][0] == device and rows[-1][3] == mask and rows[-1][2] == t[i]:
                rows[-1] = (*rows[-1][:2], float(ends[i]), *rows[-1][3:])
            else:
                rows.append((device, float(t[i]), float(ends[i]), int(mask), ", ".join(decode_throttle(mask)),
                             bool(mask & SLOWDOWN_MASK)))
    return pd.DataFrame(rows, columns=cols)


def primary_clock(clocks: pd.DataFrame) -> tuple[str, str] | None:
    """(device, metric) of the clock that speaks for the run: the first GPU's SM clock, else
    the host's mean CPU frequency."""
    if clocks.empty:
        return None
    for metric in PRIMARY_CLOCKS:
        devices = sorted(clocks.loc[clocks["metric"] == metric, "device"].unique())
        if devices:
            return ("cpu" if "cpu" in devices and metric == "cpu_freq_mhz" else devices[0]), metric
    return None


def clock_correlation(duration_s: np.ndarray, clock: np.ndarray) -> float:
    """Pearson r of step time with clock; NaN with under 3 steps or when either is constant
    (a host whose reported clock never moves tells nothing here)."""
    d, c = np.asarray(duration_s, dtype="float64"), np.asarray(clock, dtype="float64")
    ok = ~(np.isnan(d) | np.isnan(c))
    d, c = d[ok], c[ok]
    if d.size < 3:
        return float("nan")
    # "constant" within float noise: per-step means of a flat 2596.13 MHz differ in the 13th digit
    flat = np.ptp(c) <= 1e-9 * max(1.0, float(np.abs(c).max(initial=0.0)))
    if d.size < 3 or np.ptp(d) == 0 or flat:
        return float("nan")
    return float(np.corrcoef(d, c)[0, 1])


def slowest_steps(steps: pd.DataFrame, per_step: pd.DataFrame, device: str, metric: str, n: int = 3) -> pd.DataFrame:
    """The ``n`` slowest measured steps with the clock they ran at: ``step, duration_s, clock``."""
    m = steps[~steps["warmup"].astype(bool)] if not steps.empty else steps
    clock = per_step[(per_step["device"] == device) & (per_step["metric"] == metric)].set_index("step")["mean"]
    out = m.nlargest(n, "duration_s")[["step", "duration_s"]].copy()
    out["clock"] = out["step"].map(clock).astype("float64")
    return out.reset_index(drop=True)


@dataclass
class ClockSummary:
    """What the summary says about clocks, power and energy over the measured steps."""
    device: str | None = None
    metric: str | None = None
    mean_clock: float = float("nan")
    clock_moved: bool = False
    correlation: float = float("nan")
    slowest: list[dict] = field(default_factory=list)  # [{step, duration_s, clock}]
    energy: dict[str, dict] = field(default_factory=dict)  # device -> {per_step_j, per_sample_j, source}
    throttled_steps: int = 0
    throttle_reasons: list[str] = field(default_factory=list)
    steps: int = 0
    flat_note: str = FLAT_CLOCK  # what a clock that did not move can and cannot tell
    # where no reading of the clock lies inside the measured steps (``mean_clock`` NaN: a slice
    # shorter than the sampling period): the nearest reading and its distance from them, in
    # seconds, negative before them (NaN: no reading at all)
    nearest_clock: float = float("nan")
    nearest_gap_s: float = float("nan")

    def clock_text(self, unit: str) -> str:
        """The clock's figure as words: its mean over the measured steps, or, where no reading
        lies inside them, the nearest one and how far it is (it had printed "mean nan MHz")."""
        if self.mean_clock == self.mean_clock:
            return f"mean {self.mean_clock:,.0f} {unit}".rstrip()
        if self.nearest_clock != self.nearest_clock:
            return "no reading inside the measured steps"
        where = "before" if self.nearest_gap_s < 0 else "after"
        return (f"no reading inside the measured steps; the nearest, {abs(self.nearest_gap_s):.2f} s {where} "
                f"them: {self.nearest_clock:,.0f} {unit}").rstrip()

    def to_dict(self) -> dict:
        return asdict(self)

    def lines(self) -> list[str]:
        """One line for the clock, one per device with energy, one for throttling."""
        out = []
        if self.metric is not None:
            unit = "MHz" if self.metric.endswith("_mhz") else ""
            line = f"clock: {self.device} {self.metric} {self.clock_text(unit)}"
            if not self.clock_moved:
                line += f" ({self.flat_note})"
            elif self.correlation == self.correlation:
                line += f", step time vs clock r = {self.correlation:+.2f}"
                if self.slowest:
                    worst = self.slowest[0]
                    line += f"; slowest step {worst['step']} ({worst['duration_s'] * 1e3:.1f} ms) at {worst['clock']:,.0f} {unit}"
            out.append(line)
        for device, e in self.energy.items():
            out.append(f"energy: {device} {e['per_step_j']:.3g} J/step, {e['per_sample_j']:.3g} J/sample "
                       f"({'energy counter' if e['source'] == 'counter' else 'integrated power'})")
        if self.throttled_steps:
            out.append(f"throttled: {self.throttled_steps} of {self.steps} steps ({', '.join(self.throttle_reasons)})")
        return out


def flat_clock_note(metric: str, clock_meta: dict | None) -> str:
    """What a clock that did not move during the slice means, from where it was read
    (``run.meta["clocks"]``): a cpufreq driver's figure moves with DVFS, so a flat one says the
    frequency held; /proc/cpuinfo without such a driver, and above all a virtual machine's,
    gives a fixed figure that would not move if the host slowed the core."""
    if metric != "cpu_freq_mhz" or not clock_meta:
        return FLAT_CLOCK
    source = str(clock_meta.get("sources", {}).get("cpu_freq_mhz", ""))
    if not source.startswith("/proc/cpuinfo"):
        return FLAT_CLOCK
    if clock_meta.get("virtual_machine"):
        return FLAT_VM_CLOCK
    return FLAT_CPUINFO_CLOCK


def clock_summary(clocks: pd.DataFrame, steps: pd.DataFrame, clock_meta: dict | None = None) -> ClockSummary | None:
    """What the summary says about clocks, power and energy over the measured steps; None
    when the run has no clock rows or no measured steps. ``clock_meta``: ``run.meta["clocks"]``,
    where the frequency was read from (what a flat clock means, ``flat_clock_note``)."""
    m = steps[~steps["warmup"].astype(bool)] if not steps.empty else steps
    if clocks.empty or m.empty:
        return None
    out = ClockSummary(steps=len(m))
    per_step = step_clocks(clocks, m)
    prim = primary_clock(clocks)
    if prim is not None:
        device, metric = prim
        t, v = _series(clocks, device, metric)
        clock = per_step[(per_step["device"] == device) & (per_step["metric"] == metric)].set_index("step")["mean"]
        out.device, out.metric = device, metric
        out.mean_clock = float(np.nanmean(clock.to_numpy())) if clock.notna().any() else float("nan")
        if out.mean_clock != out.mean_clock and t.size:  # every reading before or after the measured steps
            first, last = float(m["start_s"].min()), float(m["end_s"].max())
            gaps = np.where(t < first, t - first, np.where(t > last, t - last, 0.0))
            near = int(np.argmin(np.abs(gaps)))
            out.nearest_clock, out.nearest_gap_s = float(v[near]), float(gaps[near])
        out.clock_moved = bool(v.size and np.ptp(v) > 0)
        out.flat_note = flat_clock_note(metric, clock_meta)
        out.correlation = clock_correlation(m["duration_s"].to_numpy(), m["step"].map(clock).to_numpy())
        out.slowest = slowest_steps(m, per_step, device, metric).to_dict("records")
    energy = step_energy(clocks, m)
    for device, g in energy.groupby("device", sort=True):
        if g["energy_j"].notna().any():
            known = g["energy_j"].notna().to_numpy()
            samples = int(m["samples"].to_numpy()[known].sum())  # same step order as m
            out.energy[device] = {"per_step_j": float(g["energy_j"].mean()),
                                  "per_sample_j": float(g["energy_j"].sum() / samples) if samples else float("nan"),
                                  "source": str(g["source"].iloc[0])}
    thr = step_throttle(clocks, m)
    if not thr.empty:
        hit = thr[thr["throttled"]]
        out.throttled_steps = int(hit["step"].nunique())
        out.throttle_reasons = sorted({r for s in hit["reasons"] for r in s.split(", ") if r})
    return out


def trace_frame(clocks: pd.DataFrame, max_rows: int = 4000) -> pd.DataFrame:
    """The level metrics for the trace panels, thinned to about ``max_rows`` rows by averaging
    equal time bins per (device, metric) series; short runs pass through untouched."""
    levels = clocks[~clocks["metric"].isin(NOT_LEVELS)] if not clocks.empty else clocks
    # energy_j is a counter: drawn as a level it is just a ramp; power shows the same, better.
    if len(levels) <= max_rows:
        return levels.reset_index(drop=True)
    nseries = levels.groupby(["device", "metric"]).ngroups
    bins = max(2, max_rows // max(1, nseries))
    parts = []
    for (device, metric), g in levels.groupby(["device", "metric"], sort=True):
        if len(g) <= bins:
            parts.append(g)
            continue
        t = g["t_s"].to_numpy()
        edges = np.linspace(t.min(), t.max(), bins + 1)
        idx = np.clip(np.searchsorted(edges, t, side="right") - 1, 0, bins - 1)
        agg = g.assign(_bin=idx).groupby("_bin", sort=True)[["t_s", "value"]].mean()
        parts.append(agg.assign(device=device, metric=metric)[["t_s", "device", "metric", "value"]])
    return pd.concat(parts, ignore_index=True)


#: Per-core series within this many units (MHz, %) of their mean at every sample are drawn as
#: the mean alone: one line, one legend entry.
CORE_FOLD_TOLERANCE = 5.0


def fold_cores(trace: pd.DataFrame, tolerance: float = CORE_FOLD_TOLERANCE) -> pd.DataFrame:
    """``trace_frame`` rows without the per-core series (``cpu0``, ``cpu1``...) of a metric
    whose cores never strayed more than ``tolerance`` from their mean (``cpu``): a VM's flat
    clock is one line, not three. Cores that differ are kept, so a busy core still shows."""
    if trace.empty:
        return trace
    core = trace["device"].astype(str).str.fullmatch(r"cpu\d+")
    keep = ~core
    for metric, g in trace[core].groupby("metric", sort=False):
        mean = trace[(trace["device"] == "cpu") & (trace["metric"] == metric)]
        if mean.empty:
            keep |= core & (trace["metric"] == metric)
            continue
        ref = np.interp(g["t_s"].to_numpy(dtype="float64"), mean["t_s"].to_numpy(dtype="float64"),
                        mean["value"].to_numpy(dtype="float64"))
        if float(np.abs(g["value"].to_numpy(dtype="float64") - ref).max()) > tolerance:
            keep |= core & (trace["metric"] == metric)
    return trace[keep].reset_index(drop=True)


#: The host counts as loaded by others when it was at least this busy on average...
HOST_BUSY_PCT = 80.0
#: ...while this process used at most this share of what the host used.
PROCESS_SHARE_MAX = 0.5


def host_load(clocks: pd.DataFrame) -> dict | None:
    """Whether other processes loaded the host during the slice: the mean ``cpu_util_pct`` of
    the whole host (device ``cpu``) against this process's own (device ``process``, on the
    same 0-100 scale). ``{"host_pct", "process_pct", "others_pct", "loaded", "text"}``;
    None without both series. ``loaded`` when the host was >= ``HOST_BUSY_PCT`` busy while
    this process used <= ``PROCESS_SHARE_MAX`` of it: step times then say more about the
    neighbours than about the training loop."""
    if clocks.empty:
        return None
    util = clocks[clocks["metric"] == "cpu_util_pct"]
    host, proc = util[util["device"] == "cpu"]["value"], util[util["device"] == "process"]["value"]
    if host.empty or proc.empty:
        return None
    h, p = float(host.mean()), float(proc.mean())
    others = max(0.0, h - p)
    loaded = h >= HOST_BUSY_PCT and p <= PROCESS_SHARE_MAX * h
    text = (f"host {h:.0f}% busy, this process {p:.0f}%: other processes used ~{others:.0f}% of the CPUs "
            "(step times may suffer)" if loaded else f"host {h:.0f}% busy, this process {p:.0f}%")
    return {"host_pct": h, "process_pct": p, "others_pct": others, "loaded": bool(loaded), "text": text}
