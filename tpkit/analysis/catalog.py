"""``tp.runs()``: the run store as a table, one row per stored run, damaged ones flagged.

Reads each folder's ``meta.json`` and ``steps.parquet``, and of ``spans.parquet`` only the
collector's pauses and the spans of the steps they fell in (never the big tables whole), so a
store of hundreds of runs lists quickly and its verdict is ``run.summary()``'s.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow.parquet as pq

from ..schema import BUILTIN_PHASES, GC_PHASE
from ..store import handles, store_path, stored_folders
from .steps import gc_free_steps, gc_pauses, summarize

#: Columns of ``tp.runs()``, in order.
RUNS_COLUMNS: tuple[str, ...] = ("name", "stored_as", "start_time", "steps", "throughput", "step_p50_ms", "verdict",
                                 "complete", "damaged", "path", "knobs", "problem")


def _verdict_spans(path: Path, steps: pd.DataFrame) -> pd.DataFrame | None:
    """What of ``spans.parquet`` the verdict reads (``steps.gc_pauses``, ``steps.gc_free_steps``):
    the collector's ``gc`` spans in the steps that waited for data and those steps' built-in spans
    (the phase each pause interrupted), or None where there are none. A filtered read: the
    ``phase`` column scanned, the rest only for those steps. Without it a full collection inside
    ``next()`` read "input-bound" here while ``run.summary()`` counted it as other. Only the
    verdict's kind is taken from it (where ``other`` sits, ``steps.other_parts``, needs every span
    and names no kind)."""
    waited = set(steps.loc[steps["data_wait_s"] > 0, "step"].astype(int)) if "data_wait_s" in steps else set()
    if not waited:
        return None
    gcs = pq.read_table(path, columns=["step"], filters=[("phase", "=", GC_PHASE)]).column("step").to_pylist()
    hit = sorted(waited.intersection(int(k) for k in gcs))
    if not hit:
        return None
    return pd.read_parquet(path, filters=[("step", "in", hit), ("phase", "in", [*BUILTIN_PHASES, GC_PHASE])])


def _row(folder: Path, handle: str | None = None) -> dict[str, Any]:
    """One ``tp.runs()`` row, read from meta.json, steps.parquet and the spans the verdict needs;
    ``handle``: the name that loads exactly this run (``store.handles``)."""
    row: dict[str, Any] = dict.fromkeys(RUNS_COLUMNS)
    row.update(name=folder.name, stored_as=folder.name, path=str(folder), damaged=True, complete=False, knobs="",
               problem="")
    try:
        meta = json.loads((folder / "meta.json").read_text())
        if not isinstance(meta, dict) or "tpkit_format" not in meta:
            raise ValueError("meta.json is not tpkit run metadata")
        steps = pd.read_parquet(folder / "steps.parquet")
        missing = [t for t in ("spans", "memory", "clocks", "loader") if not (folder / f"{t}.parquet").is_file()]
        if missing:
            raise FileNotFoundError(f"missing {', '.join(t + '.parquet' for t in missing)}")
        for t in ("spans", "memory", "clocks", "loader"):  # a footer read: cheap, and catches empty files
            try:
                pq.read_metadata(folder / f"{t}.parquet")
            except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a damaged file
                raise ValueError(f"{t}.parquet is damaged: {e}") from None
        spans = _verdict_spans(folder / "spans.parquet", steps)
        # run.summary()'s verdict: the collector's pauses in data_wait judged as other
        s = summarize(gc_free_steps(steps, gc_pauses(spans, steps)) if spans is not None else steps, meta)
    except FileNotFoundError as e:
        row["problem"] = f"incomplete folder: {Path(e.filename).name if e.filename else e}"
        return row
    except Exception as e:  # noqa: BLE001 - a damaged folder is listed, never raised
        row["problem"] = f"{type(e).__name__}: {e}"[:300]
        return row
    knobs = meta.get("knobs") or {}
    if isinstance(meta.get("name"), str):
        row["name"] = row["stored_as"] = meta["name"]  # the user's name; the folder's may be sanitised
    if handle is not None:
        row["name"] = handle
    ns = meta.get("start_unix_ns")
    row["_start_ns"] = ns if isinstance(ns, int) and not isinstance(ns, bool) else None
    row.update(start_time=meta.get("start_time"), steps=s.steps, throughput=s.throughput,
               step_p50_ms=s.step_p50_s * 1e3, verdict=s.verdict.kind, complete=s.complete, damaged=False,
               knobs=", ".join(f"{k}={v}" for k, v in knobs.items()) if isinstance(knobs, dict) else str(knobs))
    return row


def runs(store: str | os.PathLike | None = None) -> pd.DataFrame:
    """Every run in the store, oldest first: ``name`` (what ``tp.load`` / ``tp.compare`` /
    ``%tp_compare`` take for exactly this run now: the name it was given where it is the newest
    run given it, else ``<given>~<k>``, k newer runs given that name), ``stored_as`` (its name in
    the store, ``<given>-2`` for a rerun), ``start_time, steps, throughput`` (samples/s),
    ``step_p50_ms, verdict, complete, damaged, path, knobs`` (as text) and ``problem`` (why a
    damaged one cannot be read). Empty when the store is off or empty."""
    root = Path(store).expanduser() if store is not None else store_path()
    names = handles(root) if root is not None else {}
    rows = [_row(f, names.get(f)) for f in stored_folders(root)] if root is not None else []
    df = pd.DataFrame(rows, columns=[*RUNS_COLUMNS, "_start_ns"])
    df = df.astype({"steps": "Int64", "throughput": "float64", "step_p50_ms": "float64",
                    "complete": "bool", "damaged": "bool", "_start_ns": "float64"})
    # oldest first: by start time (to the second), then the exact start, then the stored name
    df = df.sort_values(["start_time", "_start_ns", "stored_as"], na_position="last", kind="stable")
    return df.drop(columns="_start_ns").reset_index(drop=True)
