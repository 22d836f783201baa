"""Does merging many ranks stay quick and small? 256 synthetic per-rank runs (``tp.datasets.
synthetic_run``, one seed per rank, rank facts added to ``meta`` as a launch would), one of them
a straggler (its data_wait is longer by ``--late-ms`` in every step), saved like
``tp.profile(save_dir=...)`` saves them; then, in a fresh process, ``tp.load_ranks(dir)`` and
what the merged view needs, each timed, and the loading process's peak RSS.

    python benchmarks/ranks_scale.py [--ranks 256] [--steps 50] [--dir DIR] [--keep]

``stragglers_of(ranks)`` is the one place that asks for the straggler table (``None`` with a
tpkit that has no ``RankRuns.stragglers()``). Each piece is timed on its own, before the merged
Run (which reuses the cached frames) is built: stragglers, the merged timeline, memory peaks.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import machine, versions, write_rows

LATE_RANK = 37


def stragglers_of(ranks: Any) -> Any:
    """The straggler table of a RankRuns ([step, rank, phase, excess_s]), or None where this
    tpkit has none yet."""
    fn = getattr(ranks, "stragglers", None)
    return fn() if callable(fn) else None


def make(root: Path, n_ranks: int, steps: int, clock_rows: int, memory_rows: int, late_s: float) -> float:
    """Write ``n_ranks`` runs under ``root/rank<k>``; returns the seconds it took."""
    from tpkit.datasets.synthetic_run import synthetic_run

    t = time.perf_counter()
    for k in range(n_ranks):
        run = synthetic_run(steps=steps, clock_rows=clock_rows, memory_rows=memory_rows, seed=k)
        if k == LATE_RANK:  # the straggler: longer data waits, the whole step later
            run.steps["data_wait_s"] += late_s
            run.steps["duration_s"] += late_s
            run.steps["end_s"] += late_s * (run.steps["step"] + 1).to_numpy()
            run.steps["start_s"] += late_s * run.steps["step"].to_numpy()
        run.meta.update(name="scale", rank=k, world_size=n_ranks, local_rank=k % 8)
        run.save(root / f"rank{k}")
    return time.perf_counter() - t


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def load(root: str) -> dict[str, Any]:
    """In a fresh process: time each piece of the merged view; peak RSS before and after."""
    import tpkit as tp

    out: dict[str, Any] = {"rss_after_import_mb": rss_mb()}
    timings: dict[str, float] = {}
    errors: dict[str, str] = {}

    def timed(name: str, fn: Any) -> Any:
        """Time ``fn``; a failure is a finding, kept with its message, not the end of the run."""
        t = time.perf_counter()
        try:
            return fn()
        except Exception as e:
            errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            return None
        finally:
            timings[name] = time.perf_counter() - t

    ranks = timed("load_ranks", lambda: tp.load_ranks(root))
    steps = timed("steps", lambda: ranks.steps)
    skew = timed("skew", lambda: ranks.skew)
    st = timed("stragglers", lambda: stragglers_of(ranks))
    if hasattr(ranks, "timeline"):
        timed("timeline", ranks.timeline)
        timed("memory_peaks", lambda: ranks.memory_peaks)
    summary = timed("summary", ranks.summary)
    merged = timed("merged_run", lambda: ranks.run)
    html = Path(root) / "merged.html"
    timed("first_html", lambda: ranks.runs[min(ranks.runs)].to_html(html))  # imports the renderers once
    timed("to_html", lambda: merged.to_html(html))
    out.update(timings=timings, errors=errors, rss_peak_mb=rss_mb(), ranks=len(ranks.runs),
               world_size=ranks.world_size, missing=ranks.missing, step_rows=len(steps), skew_rows=len(skew),
               slowest_rank=summary.get("slowest_rank"),
               html_mb=html.stat().st_size / 1e6 if "to_html" not in errors else None,
               stragglers=None if st is None else {"rows": len(st), "verdict": summary.get("straggler"),
                                                   "top_ranks": {int(k): int(v) for k, v in
                                                                 st["rank"].value_counts().head(3).items()}})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=256)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--clock-rows", type=int, default=2_000)
    ap.add_argument("--memory-rows", type=int, default=3_000)
    ap.add_argument("--late-ms", type=float, default=40.0)
    ap.add_argument("--dir", help="where the runs go (default: a temporary folder, removed after)")
    ap.add_argument("--keep", action="store_true", help="keep the runs")
    ap.add_argument("--load", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.load:
        print(json.dumps(load(a.load)))
        return
    root = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="tpkit-ranks-scale-"))
    try:
        made_s = make(root, a.ranks, a.steps, a.clock_rows, a.memory_rows, a.late_ms / 1e3)
        size_mb = sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) / 1e6
        print(f"{a.ranks} ranks x {a.steps} steps ({a.clock_rows:,} clock, {a.memory_rows:,} memory rows each) "
              f"written in {made_s:.1f} s, {size_mb:.0f} MB on disk")
        p = subprocess.run([sys.executable, __file__, "--load", str(root)], capture_output=True, text=True,
                           cwd=Path(__file__).parent, env=dict(os.environ, TPKIT_RUNS="off"))
        if p.returncode != 0:
            sys.exit(p.stdout + p.stderr)
        r = json.loads(p.stdout.strip().splitlines()[-1])
    finally:
        if not (a.keep or a.dir):
            shutil.rmtree(root, ignore_errors=True)
    for name, s in r["timings"].items():
        print(f"  {name:12s} {s:7.2f} s" + (f"   FAILED {r['errors'][name]}" if name in r["errors"] else ""))
    st = r["stragglers"]
    html = f"{r['html_mb']:.1f} MB" if r["html_mb"] is not None else "not written"
    print(f"  loaded {r['ranks']}/{r['world_size']} ranks, {r['step_rows']:,} step rows; slowest rank by "
          f"step time: {r['slowest_rank']} (the straggler is {LATE_RANK}); merged HTML {html}")
    print(f"  peak RSS of the loading process {r['rss_peak_mb']:.0f} MB ({r['rss_after_import_mb']:.0f} MB "
          f"after importing tpkit)")
    print("  stragglers(): " + ("not available in this tpkit" if st is None else
                                f"{st['rows']} rows; most often named (rank: steps) {st['top_ranks']}; "
                                f"verdict: {st['verdict']}"))
    rows = [{"op": f"ranks_{name}", "ranks": a.ranks, "steps": a.steps, "seconds": s, "rss_peak_mb": r["rss_peak_mb"],
             "error": r["errors"].get(name, ""), "machine": machine(), "versions": versions()}
            for name, s in r["timings"].items()]
    print(f"rows written to {write_rows('ranks_scale', rows)}")


if __name__ == "__main__":
    main()
