"""Statistics for comparing runs: seeded percentile bootstrap intervals over measured steps.

Ratio metrics (throughput, phase shares) and phase times per step are ratios of totals and are bootstrapped by
resampling whole steps, so a step's samples and its duration stay together. numpy only, so
results are reproducible.
"""

from __future__ import annotations

import zlib
from typing import Callable, Iterator, Union

import numpy as np

Stat = Union[str, Callable[[np.ndarray], np.ndarray]]

# -- judging a change (``analysis.compare``'s rule; views read the words from here) ----------
SIGNIFICANT = "significant"
NO_DIFFERENCE = "no meaningful difference"
NOT_ENOUGH_DATA = "not enough data"
BASELINE = "baseline"
NOT_TESTED = "n/a"
#: Fewer measured steps than this in either run: "not enough data".
MIN_STEPS = 5
#: Smallest change in a time or a rate called significant: 2% (as ``|ln(b / a)| >= ln 1.02``).
REL_THRESHOLD = 0.02
#: Smallest change in a phase's time per step called significant: 1 percentage point of the
#: step time (of the longer mean step of the two runs). Shares of step time are shown, not judged.
SHARE_THRESHOLD_PP = 1.0
#: A change is called only beyond this many times the larger drift either run shows between the
#: first and second halves of its own measured steps. The halves are half a run apart, two runs
#: at least a whole run: a machine's load that drifts with time moves runs further apart than
#: halves (twice, not once: one pair of halves is a rough estimate of it).
DRIFT_FACTOR = 2.0
#: The most run-to-run drift may excuse: a change larger than this (10%, as ``ln 1.10``; for a
#: phase, 10% of the longer mean step) is called whatever a run's halves show. A run whose own
#: steps trend (a loader's queue draining, a device throttling, a setup in one half) had its
#: halves 40-130% apart, and a real +34% throughput or -85% data wait read "no meaningful
#: difference"; the comparison warns about such a run instead.
DRIFT_CAP = 0.10

BOOTSTRAP_N = 2000
BOOTSTRAP_SEED = 0
CI_LEVEL = 0.95
#: Resampled step indices a run's comparison may draw in all (n x steps): long runs get fewer
#: resamples (never under ``BOOTSTRAP_MIN_N``), which their narrow intervals can afford.
BOOTSTRAP_WORK = 4_000_000
BOOTSTRAP_MIN_N = 400
#: Resampled elements held in memory at once by ``bootstrap_ci`` (keeps 10k-step runs cheap).
CHUNK_ELEMENTS = 2_000_000

def bootstrap_ci(values: np.ndarray | list, stat: Stat = "median", n: int = BOOTSTRAP_N, seed: int = BOOTSTRAP_SEED,
                 level: float = CI_LEVEL) -> tuple[float, float]:
    """Percentile bootstrap confidence interval of ``stat`` over ``values``.

    ``values`` has one observation per row (shape ``[k]`` or ``[k, m]``: a row keeps
    several numbers of one step together). Each of the ``n`` resamples draws ``k`` rows
    with replacement from ``numpy.random.default_rng(seed)``, in order, ``integers(0, k,
    size=(rows, k))``; ``stat`` is ``"median"``, ``"mean"`` or a function from the
    resampled batch ``[b, k, ...]`` to ``[b]``. Returns ``(low, high)``, the
    ``(1 - level) / 2`` and ``(1 + level) / 2`` percentiles (numpy's linear rule).
    NaN bounds for no values; both bounds equal the statistic for a single value.
    """
    v = np.asarray(values, dtype="float64")
    k = v.shape[0] if v.ndim else 0
    if k == 0:
        return float("nan"), float("nan")
    fn = _stat_fn(stat)
    if k == 1:
        x = float(fn(v[None, ...])[0])
        return x, x
    stats = np.empty(n, dtype="float64")
    for lo, idx in _resample_indices(k, n, seed, int(np.prod(v.shape[1:]))):
        stats[lo:lo + len(idx)] = fn(v[idx])
    low, high = _percentiles(stats, level)
    return float(low), float(high)


def _resample_indices(k: int, n: int, seed: int, width: int = 1) -> Iterator[tuple[int, np.ndarray]]:
    """The resamples of ``bootstrap_ci``, in chunks: ``(first resample, indices [b, k])``.
    Chunking keeps memory bounded and does not change the stream (numpy draws them in order)."""
    rng = np.random.default_rng(seed)
    rows = max(1, CHUNK_ELEMENTS // (k * max(1, width)))
    for lo in range(0, n, rows):
        yield lo, rng.integers(0, k, size=(min(rows, n - lo), k))


def _percentiles(stats: np.ndarray, level: float = CI_LEVEL) -> tuple[np.ndarray, np.ndarray]:
    tail = (1.0 - level) / 2 * 100
    low, high = np.percentile(stats, [tail, 100 - tail], axis=0)
    return low, high


def resamples_for(steps: int, n: int = BOOTSTRAP_N) -> int:
    """Resamples used for a run of ``steps`` measured steps: ``n``, fewer for long runs."""
    return int(min(n, max(BOOTSTRAP_MIN_N, BOOTSTRAP_WORK // max(1, steps))))


def step_resamples(samples: np.ndarray, duration_s: np.ndarray, parts_s: np.ndarray, n: int = BOOTSTRAP_N,
                   seed: int = BOOTSTRAP_SEED) -> dict[str, np.ndarray]:
    """The bootstrap draws of a run's step statistics from one shared set of resamples (the
    same resamples ``bootstrap_ci`` draws for this seed): ``throughput [n]`` (sum samples /
    sum duration), ``median_s [n]`` (median step time) and ``shares [n, P]`` (sum of each
    column of ``parts_s [k, P]`` / sum duration). Sums over a resample come from its index
    counts times the values (one matrix product), so a 10,000-step run takes well under a
    second. Kept whole so that two runs' draws can be subtracted (``diff_interval``). Also
    ``means [n, P]``: each column's mean per step (sum / k), a phase's time per step."""
    k = len(duration_s)
    x = np.column_stack([samples, duration_s, parts_s]).astype("float64")  # [k, 2 + P]
    thr, med = np.empty(n), np.empty(n)
    shares = np.empty((n, x.shape[1] - 2))
    means = np.empty_like(shares)
    for lo, idx in _resample_indices(k, n, seed):
        b = len(idx)
        counts = np.bincount((idx + (np.arange(b) * k)[:, None]).ravel(), minlength=b * k).reshape(b, k)
        sums = counts.astype("float64") @ x  # [b, 2 + P]
        with np.errstate(divide="ignore", invalid="ignore"):
            thr[lo:lo + b] = sums[:, 0] / sums[:, 1]
            shares[lo:lo + b] = sums[:, 2:] / sums[:, 1:2]
        means[lo:lo + b] = sums[:, 2:] / k
        med[lo:lo + b] = np.median(duration_s[idx], axis=1)
    return {"throughput": thr, "median_s": med, "shares": shares, "means": means}


def step_bootstrap(samples: np.ndarray, duration_s: np.ndarray, parts_s: np.ndarray, n: int = BOOTSTRAP_N,
                   seed: int = BOOTSTRAP_SEED, level: float = CI_LEVEL) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Percentile intervals of ``step_resamples``' statistics (each equals what
    ``bootstrap_ci`` gives for that statistic alone, up to rounding)."""
    d = step_resamples(samples, duration_s, parts_s, n, seed)
    return {"throughput": _percentiles(d["throughput"], level), "median_s": _percentiles(d["median_s"], level),
            "shares": _percentiles(d["shares"], level)}


def diff_interval(a: np.ndarray, b: np.ndarray, level: float = CI_LEVEL) -> tuple[float, float]:
    """Interval of ``b - a`` from two runs' independent bootstrap draws, paired in order (the
    first ``min(len)`` of each). Order statistics ``k`` and ``m - 1 - k`` of the sorted
    differences, so swapping ``a`` and ``b`` gives exactly the negated interval. NaN draws are
    left out; NaN bounds when fewer than 2 remain."""
    m = min(len(a), len(b))
    d = np.asarray(b[:m], dtype="float64") - np.asarray(a[:m], dtype="float64")
    d = np.sort(d[np.isfinite(d)])
    if len(d) < 2:
        return float("nan"), float("nan")
    k = int(np.floor((1.0 - level) / 2 * (len(d) - 1)))
    return float(d[k]), float(d[len(d) - 1 - k])


def content_seed(seed: int, values: np.ndarray) -> int:
    """A seed from ``seed`` and the bytes of ``values``: a run's resamples then depend on its
    data only, not on where it stands in a comparison (identical runs draw identical
    resamples; comparing a with b mirrors comparing b with a)."""
    return (int(seed) * 1_000_003 + zlib.crc32(np.ascontiguousarray(values, dtype="float64").tobytes())) % 2**32


def _stat_fn(stat: Stat) -> Callable[[np.ndarray], np.ndarray]:
    if stat == "median":
        return lambda a: np.median(a, axis=1)
    if stat == "mean":
        return lambda a: np.mean(a, axis=1)
    if callable(stat):
        return stat
    raise ValueError(f"stat must be 'median', 'mean' or a function, got {stat!r}")


def ratio_of_sums(a: np.ndarray) -> np.ndarray:
    """Bootstrap statistic for ``[b, k, 2]`` batches: ``sum(col 0) / sum(col 1)`` per resample."""
    den = a[:, :, 1].sum(axis=1)
    return np.divide(a[:, :, 0].sum(axis=1), den, out=np.full(den.shape, np.nan), where=den > 0)


def cis_overlap(a: tuple[float, float], b: tuple[float, float]) -> bool | None:
    """Whether two intervals share a point; None when either is unknown (NaN)."""
    if any(np.isnan(x) for x in (*a, *b)):
        return None
    return bool(a[0] <= b[1] and b[0] <= a[1])


# -- per-run metrics ---------------------------------------------------------------------------

#: Two-sided 95% Student t quantiles by degrees of freedom (1..10); 1.96 beyond 30.
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def mean_interval(values: np.ndarray | list) -> tuple[float, float, float]:
    """Mean of a few replicate values (e.g. one throughput per slice) with its 95% Student t
    interval: ``(mean, low, high)``; NaN bounds for fewer than 2 finite values. Replicates
    are few, so the bootstrap (which needs many) is not used here."""
    v = np.asarray(values, dtype="float64")
    v = v[np.isfinite(v)]
    if not len(v):
        return float("nan"), float("nan"), float("nan")
    mean = float(v.mean())
    if len(v) < 2:
        return mean, float("nan"), float("nan")
    df = len(v) - 1
    t = _T95.get(df, 2.042 if df <= 30 else 1.96)
    half = t * float(v.std(ddof=1)) / np.sqrt(len(v))
    return mean, mean - half, mean + half


def fmt_num(x: float | None) -> str:
    """A figure for people: 4 significant digits, thousands separated, ``n/a`` for NaN."""
    if x is None or not np.isfinite(x):
        return "n/a"
    return f"{x:,.4g}" if abs(x) < 1000 else f"{x:,.1f}"


def fmt_signed(x: float | None) -> str:
    """``fmt_num`` with a sign."""
    if x is None or not np.isfinite(x):
        return "n/a"
    return f"{x:+,.4g}" if abs(x) < 1000 else f"{x:+,.1f}"
