"""The Run: one profiled slice as plain pandas DataFrames (column names in DESIGN.md).

Built once from the Recorder when the slice ends; saved as Parquet + ``meta.json`` (never
pickle) and loaded back losslessly.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import pandas as pd

from .errors import RunFormatError
from .schema import ADDED_TABLES, DEFAULTS, FORMAT_VERSION, SCHEMAS, TABLES, frame, jsonable

if TYPE_CHECKING:
    from .analysis.steps import Summary

class Run:
    """One profiled slice. Tables: ``steps, spans, memory, clocks, loader, ops``; ``meta`` dict."""

    def __init__(self, steps: pd.DataFrame | None = None, spans: pd.DataFrame | None = None,
                 memory: pd.DataFrame | None = None, clocks: pd.DataFrame | None = None,
                 loader: pd.DataFrame | None = None, meta: dict | None = None,
                 ops: pd.DataFrame | None = None) -> None:
        self.steps = steps if steps is not None else frame("steps")
        self.spans = spans if spans is not None else frame("spans")
        self.memory = memory if memory is not None else frame("memory")
        self.clocks = clocks if clocks is not None else frame("clocks")
        self.loader = loader if loader is not None else frame("loader")
        self.ops = ops if ops is not None else frame("ops")  # operator events (``--ops``), else empty
        self.meta: dict[str, Any] = meta or {}
        self._summary_kept: tuple | None = None  # (key, where, Summary): see summary()

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
        from .analysis.steps import measured

        return measured(self.steps)

    def summary(self, where: bool = True) -> "Summary":
        """The slice in numbers and words (``tpkit.analysis.steps.summarize``). ``where=False``:
        without saying where time outside every phase sits (the figures and the verdict's kind
        are the same; a tuner's table needs no more).

        Kept for the tables and meta it was made from (compared by their content's hash, so a
        column assigned in place makes a new one): a notebook's display asks three times and a
        tuner's refresh once per run, and on 3,000 steps each had cost ~100 ms. A copy is
        returned, so a caller's edits never reach the next caller."""
        import copy

        from .analysis.steps import summarize

        key = self._summary_key()
        kept = getattr(self, "_summary_kept", None)
        if kept is not None and kept[0] == key and (kept[1] or not where):
            return copy.deepcopy(kept[2])
        s = summarize(self.steps, self.meta, clocks=self.clocks, memory=self.memory, spans=self.spans, where=where)
        self._summary_kept = (key, where, s)
        return copy.deepcopy(s)

    def _summary_key(self) -> tuple:
        """What ``summary`` is made of: each table's content hash and the meta as JSON."""
        from pandas.util import hash_pandas_object

        def digest(df: pd.DataFrame) -> tuple:
            if df.empty:
                return (tuple(df.columns), 0)
            try:
                return (tuple(df.columns), len(df), int(hash_pandas_object(df, index=False).to_numpy().sum()))
            except TypeError:  # a cell that cannot be hashed (a list): the frame itself
                return (tuple(df.columns), len(df), id(df))

        return (tuple(digest(t) for t in (self.steps, self.spans, self.clocks, self.memory)),
                json.dumps(self.meta, sort_keys=True, default=str))

    def memory_peak(self, device: str | None = None) -> pd.DataFrame:
        """What was alive at the memory peak: one row per (device, category) with ``bytes``, and
        the ``step`` and ``phase`` of the peak (see ``tpkit.analysis.memory.memory_peak``)."""
        from .analysis.memory import memory_peak

        approximate = ((self.meta or {}).get("memory") or {}).get("approximate_mix")
        return memory_peak(self.memory, device, approximate=approximate)

    def __repr__(self) -> str:
        s = self.summary()
        state = "" if self.complete else ", incomplete"
        return f"<tpkit.Run '{self.name}': {s.steps} steps, {s.throughput:,.1f} samples/s{state}>"

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        from .views.html import dashboard_html

        return {"text/plain": self.summary().to_text(), "text/html": dashboard_html(self)}

    def to_html(self, path: str | Path, compare_with: "Sequence[Run]" = ()) -> Path:
        """A self-contained HTML report (charts interactive, no network needed); with
        ``compare_with``, the comparison of those runs and this one (against the first)."""
        from .views.html import write_report

        return write_report(self, path, compare_with)

    def to_perfetto(self, path: str | Path) -> Path:
        """A Chrome/Perfetto trace (JSON): steps, spans by depth, clock and memory counters."""
        from .views.export import to_perfetto

        return to_perfetto(self, path)

    def to_csv(self, folder: str | Path) -> list[Path]:
        """Every table as ``<table>.csv`` (and ``meta.json``) into ``folder``."""
        from .views.export import to_csv

        return to_csv(self, folder)

    # -- storage ----------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Write every table as ``<table>.parquet`` and the meta as ``meta.json`` into ``path``.

        Atomic as a whole: the files are written into a hidden sibling folder that then takes
        ``path``'s place, so a save that fails part-way (a full disk, a Ctrl-C) leaves the old
        run whole, or nothing; never old steps beside new spans.
        """
        out = Path(path)
        if out.exists() and not out.is_dir():
            raise RunFormatError(f"cannot save a run to {out}: it is a file, not a folder")
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.saving-", dir=out.parent))
        try:
            for table in TABLES:
                getattr(self, table).to_parquet(tmp / f"{table}.parquet", index=False)
            meta = {"tpkit_format": FORMAT_VERSION, **self.meta}
            (tmp / "meta.json").write_text(json.dumps(jsonable(meta), indent=2))
            _replace_folder(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
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
            if not f.is_file() and table in ADDED_TABLES:
                tables[table] = frame(table)  # saved before the table existed: empty
                continue
            if not f.is_file():
                raise RunFormatError(f"{src} is incomplete: {f.name} is missing")
            try:
                df = pd.read_parquet(f)
            except Exception as e:  # pyarrow raises several types for a damaged file
                raise RunFormatError(f"{f} is damaged and cannot be read: {e}") from None
            later = DEFAULTS.get(table, {})  # columns added since: an older run has their default
            missing = [c for c in SCHEMAS[table] if c not in df.columns and c not in later]
            if missing:
                raise RunFormatError(f"{f} lacks the columns {missing}: not a tpkit {table} table")
            try:
                tables[table] = frame(table, df[[c for c in SCHEMAS[table] if c in df.columns]])
            except (TypeError, ValueError) as e:
                raise RunFormatError(f"{f} has a column of the wrong type ({e}): not a tpkit {table} table") from None
        _check_meta(meta, meta_path)
        return cls(meta=meta, **tables)


#: meta.json fields tpkit reads, and the types they must have.
_META_TYPES: dict[str, tuple[type, ...]] = {
    "name": (str,), "knobs": (dict,), "notes": (list,), "complete": (bool,), "warmup_steps": (int,),
    "devices": (list,), "versions": (dict,), "start_time": (str,), "model": (dict,), "memory": (dict,),
    "clocks": (dict,), "ranks": (dict,), "error": (str,), "stopped_by": (str,), "loader": (dict,), "name_requested": (str,),
}


def _check_meta(meta: dict, path: Path) -> None:
    """Wrong-typed fields would crash the summary or the report later: refuse them on load."""
    for key, types in _META_TYPES.items():
        if key in meta and meta[key] is not None and not isinstance(meta[key], types):
            want = " or ".join(t.__name__ for t in types)
            raise RunFormatError(f"{path}: '{key}' is a {type(meta[key]).__name__}, not a {want}: "
                                 "the file was edited or written by something else")


def _replace_folder(new: Path, target: Path) -> None:
    """Put the folder ``new`` at ``target`` (same parent): the old folder is moved aside first
    and removed only once the new one is in place."""
    if not target.exists():
        os.replace(new, target)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    os.replace(target, old / "run")
    try:
        os.replace(new, target)
    except BaseException:
        os.replace(old / "run", target)  # put the old run back whole
        raise
    finally:
        shutil.rmtree(old, ignore_errors=True)
