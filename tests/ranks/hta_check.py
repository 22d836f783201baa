"""Run Holistic Trace Analysis on tpkit's Kineto-style export of a multi-rank run.

HTA is not a tpkit dependency (it brings plotly, pydot, jupyterlab and its own pins), so it
lives in a venv of its own; this script is started with tpkit's interpreter, writes one trace per
rank with ``tpkit/analysis/kineto.py`` and runs HTA with the other interpreter. HolisticTraceAnalysis
0.5.0 ran these three analyses on this export with pandas 2.3.3 and with pandas 3.1.1 alike:

    python3 -m venv /tmp/hta-venv && /tmp/hta-venv/bin/pip install HolisticTraceAnalysis==0.5.0
    .venv/bin/python tests/ranks/hta_check.py [RANKS_DIR] [--out DIR] [--hta-python /tmp/hta-venv/bin/python]

RANKS_DIR is a folder of per-rank runs (``tp.profile(save_dir=...)``); without it, two hand-made
ranks are used (forward/backward/optimizer with exposed and overlapped communication, rank 1
late in data_wait), which exercises every lane. Prints HTA's temporal breakdown, idle-time
breakdown (rank 0) and communication/computation overlap; exits non-zero if any of them fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_kineto():
    """tpkit's trace export (this script runs in tpkit's environment; HTA runs in its own)."""
    from tpkit.analysis import kineto

    return kineto


def hand_made_rank(rank: int, steps: int = 5, late_s: float = 0.15):
    """(steps, spans, meta) of one rank: each 0.3 s step is data_wait, forward, backward with a
    gradient all-reduce in flight behind it and an exposed wait at its end, then optimizer. Rank 1
    waits ``late_s`` for data; rank 0 waits that long in the all-reduce instead."""
    import pandas as pd

    step_rows, span_rows = [], []
    t = 0.0
    for s in range(steps):
        data = 0.01 + (late_s if rank == 1 else 0.0)
        wait = 0.005 + (late_s if rank == 0 else 0.0)
        parts = [("data_wait", data), ("forward", 0.05), ("backward", 0.08 + wait), ("optimizer", 0.02)]
        start = t
        for phase, d in parts:
            span_rows.append((s, phase, t, t + d, d, 0, "hand-made"))
            if phase == "backward":
                span_rows.append((s, "comm_overlapped", t + 0.02, t + 0.08, 0.06, 1, "all_reduce"))
                span_rows.append((s, "comm", t + 0.08, t + d, wait, 1, "end_of_backward:all_reduce"))
            t += d
        step_rows.append((s, False, start, t, t - start))
    steps_df = pd.DataFrame(step_rows, columns=["step", "warmup", "start_s", "end_s", "duration_s"])
    spans_df = pd.DataFrame(span_rows, columns=["step", "phase", "start_s", "end_s", "duration_s", "depth", "source"])
    meta = {"name": "hand-made", "start_unix_ns": 1_800_000_000_000_000_000, "rank": rank, "world_size": 2}
    return steps_df, spans_df, meta


def export(ranks_dir: str | None, out: Path) -> list[Path]:
    kineto = load_kineto()
    out.mkdir(parents=True, exist_ok=True)
    if ranks_dir:
        import tpkit as tp

        return tp.load_ranks(ranks_dir).to_traces(out)  # the public export: out/rank<k>.json
    items = [(k, *hand_made_rank(k), 2) for k in (0, 1)]
    paths = []
    for k, steps, spans, meta, world in items:
        p = out / f"rank{k}.json"
        p.write_text(kineto.kineto_json(kineto.run_to_kineto(steps, spans, meta, k, world)))
        paths.append(p)
    return paths


def analyse(trace_dir: str) -> int:
    """In the HTA venv: the three analyses, printed; 1 if any failed."""
    import logging
    import warnings

    import pandas as pd
    from hta.trace_analysis import TraceAnalysis

    logging.getLogger("hta").setLevel(logging.ERROR)
    warnings.simplefilter("ignore", FutureWarning)  # HTA's own pandas idioms
    pd.set_option("display.width", 200)
    pd.set_option("display.max_columns", 20)
    from importlib.metadata import version

    print(f"HolisticTraceAnalysis {version('HolisticTraceAnalysis')}, pandas {pd.__version__}")
    ta = TraceAnalysis(trace_dir=trace_dir)
    print("ranks:", sorted(ta.t.traces))
    failed = 0
    for title, call in [
        ("temporal breakdown", lambda: ta.get_temporal_breakdown(visualize=False)),
        ("idle time breakdown (rank 0)", lambda: ta.get_idle_time_breakdown(ranks=[0], visualize=False)[0]),
        ("communication/computation overlap", lambda: ta.get_comm_comp_overlap(visualize=False)),
    ]:
        print(f"\n== {title}")
        try:
            print(call().to_string())
        except Exception as e:  # report every analysis, then fail
            failed = 1
            print(f"FAILED: {type(e).__name__}: {e}")
    return failed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ranks_dir", nargs="?")
    ap.add_argument("--out", default=str(ROOT / "build" / "hta_traces"))
    ap.add_argument("--hta-python", default=os.environ.get("HTA_PYTHON", "/tmp/hta-venv/bin/python"))
    ap.add_argument("--analyse", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.analyse:
        sys.exit(analyse(a.analyse))
    paths = export(a.ranks_dir, Path(a.out))
    print("wrote", ", ".join(str(p) for p in paths))
    doc = json.loads(paths[0].read_text())
    print("events per trace:", len(doc["traceEvents"]), "distributedInfo:", doc["distributedInfo"])
    p = subprocess.run([a.hta_python, __file__, "--analyse", a.out], text=True)
    sys.exit(p.returncode)


if __name__ == "__main__":
    main()
