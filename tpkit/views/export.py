"""Exports: a Chrome/Perfetto trace, PNG of any chart, CSV and Parquet of every table.

The trace follows the Trace Event Format (JSON object form, timestamps in microseconds):
one process per run; a ``steps`` track with one complete ("X") event per step; one track per
span depth (``depth 0`` holds the outermost phases, nested phases below) with one "X" event
per span; counters ("C") for every clock metric and for memory by category. Open it at
https://ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..schema import MIB, TABLES, jsonable

if TYPE_CHECKING:
    import altair as alt

    from ..run import Run

US_PER_S = 1e6
PID = 1
STEPS_TID = 0
#: Span depth d goes on thread id ``SPAN_TID0 + d`` (the steps track is 0).
SPAN_TID0 = 1


def _us(seconds: float) -> float:
    return round(float(seconds) * US_PER_S, 3)


def trace_events(run: "Run") -> list[dict[str, Any]]:
    """The run as Trace Event Format events (see the module docstring for the layout)."""

    events: list[dict[str, Any]] = [
        {"ph": "M", "pid": PID, "tid": STEPS_TID, "name": "process_name", "args": {"name": f"tpkit {run.name}"}},
        {"ph": "M", "pid": PID, "tid": STEPS_TID, "name": "thread_name", "args": {"name": "steps"}},
        {"ph": "M", "pid": PID, "tid": STEPS_TID, "name": "thread_sort_index", "args": {"sort_index": 0}},
    ]
    phase_cols = [c for c in run.steps.columns if c.endswith("_s") and c not in ("start_s", "end_s", "duration_s")]
    for r in run.steps.to_dict("records"):
        args = {"step": int(r["step"]), "warmup": bool(r["warmup"]), "samples": int(r["samples"]),
                **{c: r[c] for c in phase_cols}}
        if "loss" in r and r["loss"] == r["loss"]:
            args["loss"] = r["loss"]
        events.append({"ph": "X", "pid": PID, "tid": STEPS_TID, "cat": "step",
                       "name": f"step {int(r['step'])}" + (" (warmup)" if r["warmup"] else ""),
                       "ts": _us(r["start_s"]), "dur": _us(r["duration_s"]), "args": jsonable(args)})
    for depth in sorted({int(d) for d in run.spans["depth"]}) if not run.spans.empty else []:
        tid = SPAN_TID0 + depth
        events.append({"ph": "M", "pid": PID, "tid": tid, "name": "thread_name", "args": {"name": f"depth {depth}"}})
        events.append({"ph": "M", "pid": PID, "tid": tid, "name": "thread_sort_index", "args": {"sort_index": tid}})
    for r in run.spans.to_dict("records"):
        events.append({"ph": "X", "pid": PID, "tid": SPAN_TID0 + int(r["depth"]), "cat": "span",
                       "name": str(r["phase"]), "ts": _us(r["start_s"]), "dur": _us(r["duration_s"]),
                       "args": {"step": int(r["step"]), "source": str(r["source"])}})
    for r in run.clocks.to_dict("records"):
        v = float(r["value"])
        if math.isfinite(v):
            events.append({"ph": "C", "pid": PID, "name": f"{r['device']} {r['metric']}", "cat": "clocks",
                           "ts": _us(r["t_s"]), "args": {str(r["metric"]): v}})
    if not run.memory.empty:
        mem = run.memory[run.memory["event"] != "peak"]  # levels at boundaries; peaks are between them
        for (device, t_s), g in mem.groupby(["device", "t_s"], sort=True):
            events.append({"ph": "C", "pid": PID, "name": f"{device} memory (MiB)", "cat": "memory", "ts": _us(t_s),
                           "args": {str(c): float(b) / MIB for c, b in zip(g["category"], g["bytes"])}})
    return events


def to_perfetto(run: "Run", path: str | Path) -> Path:
    """Write the run as a Chrome/Perfetto trace (JSON) and return the path."""

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"traceEvents": trace_events(run), "displayTimeUnit": "ms",
           "otherData": jsonable({"tpkit_run": run.name, "meta": run.meta})}
    out.write_text(json.dumps(doc, allow_nan=False))
    return out


def to_png(chart: "alt.TopLevelMixin", path: str | Path, scale_factor: float = 2.0) -> Path:
    """A chart as PNG, rendered offline by vl-convert (no browser, no network)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    chart.save(str(out), format="png", scale_factor=scale_factor)
    return out


def to_csv(run: "Run", folder: str | Path) -> list[Path]:
    """Every table as ``<table>.csv`` plus ``meta.json`` into ``folder``; returns the paths."""

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for table in TABLES:
        p = out / f"{table}.csv"
        getattr(run, table).to_csv(p, index=False)
        paths.append(p)
    meta = out / "meta.json"
    meta.write_text(json.dumps(jsonable(run.meta), indent=2))
    return [*paths, meta]


def to_parquet(run: "Run", folder: str | Path) -> list[Path]:
    """Every table as ``<table>.parquet`` plus ``meta.json`` (the folder ``tp.load`` reads)."""

    out = run.save(folder)
    return [*(out / f"{t}.parquet" for t in TABLES), out / "meta.json"]
