"""The Run: one profiled slice as plain pandas DataFrames (column names in DESIGN.md).

Built once from the Recorder when the slice ends; saved as Parquet + ``meta.json`` (never
pickle) and loaded back losslessly.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from . import analysis
from .errors import RunFormatError
from .recorder import Recorder

#: Column name -> dtype, per table. The order is the public column order.
SCHEMAS: dict[str, dict[str, str]] = {
    "steps": {
        "step": "int64", "warmup": "bool", "start_s": "float64", "end_s": "float64",
        "duration_s": "float64", "samples": "int64", "data_wait_s": "float64", "h2d_s": "float64",
        "forward_s": "float64", "backward_s": "float64", "optimizer_s": "float64",
        "offload_s": "float64", "tpkit_s": "float64", "other_s": "float64", "throughput": "float64", "loss": "float64",
    },
    "spans": {
        "step": "int64", "phase": "object", "start_s": "float64", "end_s": "float64",
        "duration_s": "float64", "depth": "int64", "source": "object",
    },
    "memory": {
        "step": "int64", "phase": "object", "event": "object", "t_s": "float64",
        "device": "object", "category": "object", "bytes": "int64",
    },
    "clocks": {"t_s": "float64", "device": "object", "metric": "object", "value": "float64"},
    "loader": {
        "batch": "int64", "worker": "int64", "fetch_s": "float64", "collate_s": "float64",
        "queue_wait_s": "float64", "transfer_s": "float64",
    },
}
TABLES: tuple[str, ...] = tuple(SCHEMAS)
FORMAT_VERSION = 1


def _frame(table: str, rows: Any = None) -> pd.DataFrame:
    """A frame with the table's columns and dtypes (strings as plain Python objects, so a
    Parquet round trip gives back the same frame)."""
    schema = SCHEMAS[table]
    df = pd.DataFrame(rows if rows is not None else [], columns=list(schema))
    for col, dtype in schema.items():
        if dtype == "object":
            df[col] = df[col].astype(object)
        else:
            df[col] = df[col].astype(dtype)
    return df


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating, float)):
        return None if math.isnan(float(x)) else float(x)
    if isinstance(x, (np.bool_,)):
        return bool(x)
    if x is None or isinstance(x, (str, int, bool)):
        return x
    return repr(x)


class Run:
    """One profiled slice. Tables: ``steps, spans, memory, clocks, loader``; ``meta`` dict."""

    def __init__(self, steps: pd.DataFrame | None = None, spans: pd.DataFrame | None = None,
                 memory: pd.DataFrame | None = None, clocks: pd.DataFrame | None = None,
                 loader: pd.DataFrame | None = None, meta: dict | None = None) -> None:
        self.steps = steps if steps is not None else _frame("steps")
        self.spans = spans if spans is not None else _frame("spans")
        self.memory = memory if memory is not None else _frame("memory")
        self.clocks = clocks if clocks is not None else _frame("clocks")
        self.loader = loader if loader is not None else _frame("loader")
        self.meta: dict[str, Any] = meta or {}

    # -- construction -----------------------------------------------------------------------
    @classmethod
    def from_recorder(cls, rec: Recorder, warmup_steps: int, meta: dict | None = None) -> "Run":
        t0 = rec.t0_ns
        timer = rec.cuda_timer
        if timer is not None:
            timer.finish()

        def at(ns: int, ev: Any) -> float:
            return ((timer.resolve(ev) if (timer is not None and ev is not None) else ns) - t0) / 1e9

        spans = _frame("spans", [
            (step - warmup_steps, phase, at(s, sev), at(e, eev), 0.0, depth, source)
            for phase, s, e, depth, source, step, sev, eev in rec.spans
        ])
        spans["duration_s"] = spans["end_s"] - spans["start_s"]
        spans = spans.sort_values(["start_s", "depth"], kind="stable").reset_index(drop=True)

        # Step bounds: a step runs from the end of the previous one (slice start for the
        # first) to the end of its optimizer step. On a GPU, the end is the GPU's.
        ends = [(e - t0) / 1e9 for e, _ in rec.step_ends]
        if timer is not None:
            ends = _gpu_step_ends(spans, ends, warmup_steps)
        losses: dict[int, list[float]] = {}
        for raw, value in rec.losses:
            losses.setdefault(raw, []).append(float(value))  # a tensor: one sync, after the slice
        bounds = pd.DataFrame({
            "step": np.arange(len(ends), dtype="int64") - warmup_steps,
            "warmup": np.arange(len(ends)) < warmup_steps,
            "start_s": [0.0, *ends[:-1]] if ends else [],
            "end_s": ends,
            "samples": np.array([n for _, n in rec.step_ends], dtype="int64"),
            "loss": [float(np.mean(losses[i])) if i in losses else float("nan") for i in range(len(ends))],
        })
        steps = _frame("steps", analysis.step_breakdown(spans, bounds)[list(SCHEMAS["steps"])])

        memory = _frame("memory", [
            (step - warmup_steps, phase, event, (t - t0) / 1e9, device, category, nbytes)
            for step, phase, event, t, device, category, nbytes in rec.memory
        ])
        clocks = _frame("clocks", [((t - t0) / 1e9, d, m, v) for t, d, m, v in rec.clocks])
        loader = _frame("loader", rec.loader)
        full_meta = {**rec.meta, **(meta or {})}
        full_meta.setdefault("name", rec.name)
        full_meta["warmup_steps"] = warmup_steps
        full_meta["notes"] = list(rec.notes) + list(full_meta.get("notes", []))
        return cls(steps, spans, memory, clocks, loader, _jsonable(full_meta))

    # -- views ------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return str(self.meta.get("name", "run"))

    @property
    def complete(self) -> bool:
        return bool(self.meta.get("complete", True))

    @property
    def measured_steps(self) -> pd.DataFrame:
        """``steps`` without the warmup rows."""
        return analysis.measured(self.steps)

    def summary(self) -> analysis.Summary:
        return analysis.summarize(self.steps, self.meta, clocks=self.clocks, memory=self.memory)

    def memory_peak(self, device: str | None = None) -> pd.DataFrame:
        """What was alive at the memory peak: one row per (device, category) with ``bytes``, and
        the ``step`` and ``phase`` of the peak (see ``tpkit.memory_analysis.memory_peak``)."""
        from .memory_analysis import memory_peak

        return memory_peak(self.memory, device)

    def __repr__(self) -> str:
        s = self.summary()
        state = "" if self.complete else ", incomplete"
        return f"<tpkit.Run '{self.name}': {s.steps} steps, {s.throughput:,.1f} samples/s{state}>"

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        from .report import dashboard_html

        return {"text/plain": self.summary().to_text(), "text/html": dashboard_html(self)}

    def to_html(self, path: str | Path) -> Path:
        """A self-contained HTML report (charts interactive, no network needed)."""
        from .report import write_report

        return write_report(self, path)

    def to_perfetto(self, path: str | Path) -> Path:
        """A Chrome/Perfetto trace (JSON): steps, spans by depth, clock and memory counters."""
        from .export import to_perfetto

        return to_perfetto(self, path)

    def to_csv(self, folder: str | Path) -> list[Path]:
        """Every table as ``<table>.csv`` (and ``meta.json``) into ``folder``."""
        from .export import to_csv

        return to_csv(self, folder)

    # -- storage ----------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Write every table as ``<table>.parquet`` and the meta as ``meta.json`` into ``path``."""
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        for table in TABLES:
            getattr(self, table).to_parquet(out / f"{table}.parquet", index=False)
        meta = {"tpkit_format": FORMAT_VERSION, **self.meta}
        (out / "meta.json").write_text(json.dumps(_jsonable(meta), indent=2))
        return out

    @classmethod
    def load(cls, path: str | Path) -> "Run":
        """Read a Run written by ``save``; a clear error names the missing or damaged file."""
        src = Path(path)
        meta_path = src / "meta.json"
        if not src.is_dir():
            raise RunFormatError(f"{src} is not a folder: tp.load wants the folder that run.save() wrote")
        if not meta_path.is_file():
            raise RunFormatError(f"{src} is not a saved tpkit Run: {meta_path.name} is missing")
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, ValueError) as e:
            raise RunFormatError(f"{meta_path} is damaged: {e}") from None
        if not isinstance(meta, dict) or "tpkit_format" not in meta:
            raise RunFormatError(f"{meta_path} is not tpkit run metadata (no 'tpkit_format' key)")
        meta.pop("tpkit_format")
        tables: dict[str, pd.DataFrame] = {}
        for table in TABLES:
            f = src / f"{table}.parquet"
            if not f.is_file():
                raise RunFormatError(f"{src} is incomplete: {f.name} is missing")
            try:
                df = pd.read_parquet(f)
            except Exception as e:  # pyarrow raises several types for a damaged file
                raise RunFormatError(f"{f} is damaged and cannot be read: {e}") from None
            missing = [c for c in SCHEMAS[table] if c not in df.columns]
            if missing:
                raise RunFormatError(f"{f} lacks the columns {missing}: not a tpkit {table} table")
            tables[table] = _frame(table, df[list(SCHEMAS[table])])
        return cls(meta=meta, **tables)


def _gpu_step_ends(spans: pd.DataFrame, host_ends: list[float], warmup_steps: int) -> list[float]:
    """On a GPU, step k ends when its last optimizer span ends on the GPU."""
    opt = spans[spans["phase"] == "optimizer"].groupby("step")["end_s"].max()
    return [float(max(h, opt.get(i - warmup_steps, h))) for i, h in enumerate(host_ends)]
