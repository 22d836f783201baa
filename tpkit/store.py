"""The run store: every finished slice is kept as a folder of Parquet + ``meta.json``.

    tp.load("baseline")     # a store name, or the path of any folder run.save() wrote
    tp.set_store("/data/my_runs")   # or TPKIT_RUNS=/data/my_runs; None or "off" turns it off

Where runs go, first match wins: ``set_store(...)``, the ``TPKIT_RUNS`` environment variable,
then ``./tpkit_runs``. A store name is the run's name; a rerun under a name already taken gets
the first free ``<name>-2``, ``<name>-3``... and ``run.meta["name"]`` is changed to match, while
``run.meta["name_requested"]`` keeps the name the slice was given.

A name given to ``tp.load`` / ``tp.compare`` / ``%tp_compare`` means the NEWEST run (by its start
time) stored under that requested name: rerun ``--name baseline`` and ``"baseline"`` is the run
just measured (stored as ``baseline-2``), not the one before it. A stored name no run was given
(``"baseline-2"``) still names that one run exactly, and so does a folder path.
``resolve(name)`` says which folder a name means and which other runs share it; ``tp.compare``
puts that in the comparison's warnings whenever several runs share a name.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import OutputPathError, RunFormatError
from .run import Run

DEFAULT_STORE = "tpkit_runs"
ENV_VAR = "TPKIT_RUNS"
_OFF = {"", "off", "none", "0", "false"}

_UNSET: Any = object()
_configured: list[Any] = [_UNSET]  # what set_store() was given, if anything

def set_store(path: str | os.PathLike | None) -> Path | None:
    """Keep runs under ``path`` from now on; ``None`` or ``"off"`` stops keeping them.
    Returns the store folder in use (None when off)."""
    _configured[0] = path
    return store_path()


def reset_store() -> Path | None:
    """Forget what ``set_store`` said: the ``TPKIT_RUNS`` variable, else ``./tpkit_runs``, decide
    again. Returns the store folder in use (None when off)."""
    _configured[0] = _UNSET
    return store_path()


def store_path() -> Path | None:
    """The store folder in use, or None when the store is off. Not created until a save."""
    value = _configured[0]
    if value is _UNSET:
        value = os.environ.get(ENV_VAR, DEFAULT_STORE)
    if value is None or (isinstance(value, str) and value.strip().lower() in _OFF):
        return None
    return Path(value).expanduser()


def _require_store(store: str | os.PathLike | None) -> Path:
    root = Path(store).expanduser() if store is not None else store_path()
    if root is None:
        raise RunFormatError(f"the run store is off (tp.set_store(None) or {ENV_VAR}=off): "
                             "turn it on with tp.set_store('./tpkit_runs'), or pass a folder")
    return root


def safe_name(name: str) -> str:
    """A run name as a folder name: letters and digits of any script, ``.``, ``_`` and ``-``;
    the rest becomes ``_`` (so a name never escapes the store or hides as a dot-folder). Only
    the folder is named so: the run keeps the name the user gave."""
    cleaned = re.sub(r"[^\w.-]+", "_", str(name)).strip("._") or "run"
    return cleaned[:120]


def save(run: Run, store: str | os.PathLike | None = None) -> Path:
    """Keep ``run`` in the store under a folder of its own and return that folder.

    The folder is claimed with an exclusive ``mkdir`` before anything is written, so two
    saves of the same name never share a folder; ``meta.json`` is written last by
    ``Run.save``, so a save cut short leaves a folder that lists as damaged, not a wrong run.
    """
    root = _require_store(store)
    root.mkdir(parents=True, exist_ok=True)
    base = safe_name(run.name)
    n = 1
    while True:
        folder = root / (base if n == 1 else f"{base}-{n}")
        try:
            folder.mkdir()
            break
        except FileExistsError:
            n += 1
    run.meta.setdefault("name_requested", run.name)  # kept through a later save elsewhere
    if n > 1:
        run.meta["name"] = f"{run.name}-{n}"
    run.save(folder)
    return folder


def autosave(run: Run) -> Path | None:
    """Keep a finished slice in the store, if the store is on. Never raises: a full disk or a
    read-only folder must not cost the user the run they just measured; the reason is
    warned and noted in ``run.meta["notes"]`` instead. Returns the folder, or None."""
    if store_path() is None:
        return None
    try:
        return save(run)
    except Exception as e:  # noqa: BLE001 - any failure here is reported, never raised
        msg = f"the run was not saved to the store ({store_path()}): {type(e).__name__}: {e}"
        run.meta.setdefault("notes", []).append(msg)
        warnings.warn(f"tpkit: {msg}", RuntimeWarning, stacklevel=2)
        return None


def writable_folder(path: str | os.PathLike, what: str = "the folder") -> Path:
    """``path`` as a folder tpkit can write into, made if missing; a TpkitError that says what to
    do otherwise. Called before a slice starts (``--save``, the CLI's ``--out``), so a bad path
    never costs the run just measured."""
    folder = Path(path).expanduser()
    if folder.exists() and not folder.is_dir():
        raise OutputPathError(f"{what} {folder} is a file: give a folder (it is made if missing)")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=folder, prefix=".tpkit-write-check-", delete=True)
        probe.close()
    except OSError as e:
        raise OutputPathError(f"{what} {folder} cannot be written ({e.strerror or e}): choose a folder you can write to") from None
    return folder


def stored_folders(root: Path) -> list[Path]:
    """The run folders under a store root, sorted by name (hidden folders left out)."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


def names(store: str | os.PathLike | None = None) -> list[str]:
    """Names of the runs in the store (damaged ones included), sorted."""
    root = Path(store).expanduser() if store is not None else store_path()
    return [p.name for p in stored_folders(root)] if root is not None else []


def load(name_or_path: str | os.PathLike | Run, store: str | os.PathLike | None = None) -> Run:
    """A stored run by name (``tp.load("baseline")``) or any folder ``run.save()`` wrote.

    A plain name is looked up in the store first (``resolve``: the newest run given that
    name, else the run stored under it), then as a folder; anything with a path separator is a
    folder (and ``Run.load``'s errors say what is wrong with it). A name found nowhere raises
    ``RunFormatError`` listing the names the store has. A Run passes through unchanged (so
    ``compare`` takes names and Runs alike).
    """
    return load_resolved(name_or_path, store)[0]


def load_resolved(name_or_path: str | os.PathLike | Run,
                  store: str | os.PathLike | None = None) -> tuple[Run, Resolved | None]:
    """``load``, and what a store name resolved to (None for a Run or a folder)."""
    if isinstance(name_or_path, Run):
        return name_or_path, None
    text = os.fspath(name_or_path)
    root = Path(store).expanduser() if store is not None else store_path()
    plain = isinstance(name_or_path, str) and os.sep not in text and "/" not in text
    if isinstance(name_or_path, str) and root is not None:
        found = resolve(text, root, plain)
        if found is not None:
            return Run.load(found.folder), found
    if not plain or _exists(Path(text).expanduser()):
        return Run.load(Path(text).expanduser()), None  # Run.load says what is wrong with a folder
    known = names(root) if root is not None else []
    where = f"the store {root}" if root is not None else "the store (it is off)"
    listing = ", ".join(known) if known else "none"
    raise RunFormatError(f"no run named {text!r} in {where} and no such folder; known runs: {listing}")


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # a name too long to be a path is not one
        return False


@dataclass(frozen=True)
class Resolved:
    """What a store name means: ``folder`` holds the run ``name`` (its stored name) that the
    name ``asked`` resolved to; ``others``: the older runs given the same name, newest first,
    as (stored name, folder) (empty when the name is the run's own alone)."""

    asked: str
    folder: Path
    name: str
    others: tuple[tuple[str, Path], ...] = ()

    def describe(self) -> str:
        """One sentence for a comparison, when several runs share the name; "" otherwise."""
        if not self.others:
            return ""
        older = ", ".join(f"{name!r} in {folder}" for name, folder in self.others)
        return (f"{self.asked!r} is the run stored as {self.name!r}, the newest of the {len(self.others) + 1} runs "
                f"given that name (older: {older}; to compare an older one, give its folder)")


def resolve(name: str, store: str | os.PathLike | None = None, plain: bool = True) -> Resolved | None:
    """The stored run a name means (None when the store holds none): the newest run (by its
    ``start_unix_ns``, else when its ``meta.json`` was written) whose requested name is
    ``name``; when no run was given that name, the run stored under it (its folder, or the run
    whose ``meta["name"]`` it is). ``plain``: ``name`` may be taken as a folder name."""
    root = Path(store).expanduser() if store is not None else store_path()
    if root is None:
        return None
    stored = [(folder, meta) for folder in stored_folders(root) if (meta := _stored_meta(folder)) is not None]
    named = {str(meta["name"]) for _, meta in stored}
    given = [(folder, meta) for folder, meta in stored if _requested_name(meta, named) == name]
    if given:
        given.sort(key=lambda fm: _started_ns(*fm), reverse=True)
        return Resolved(name, given[0][0], str(given[0][1]["name"]),
                        tuple((str(meta["name"]), folder) for folder, meta in given[1:]))
    found = _find_stored(root, name, plain, stored)
    return Resolved(name, found, _stored_name(found) or found.name) if found is not None else None


def _requested_name(meta: dict[str, Any], named: set[str]) -> str:
    """The name a stored run's slice was given: ``meta["name_requested"]``; for a run saved
    before tpkit kept it, a stored ``<name>-<k>`` (k >= 2) beside a run called ``<name>`` was
    that name's rerun (the store's own suffix)."""
    requested = meta.get("name_requested")
    if isinstance(requested, str):
        return requested
    name = str(meta["name"])
    m = re.fullmatch(r"(.+)-([2-9]|[1-9]\d+)", name)
    return m.group(1) if m is not None and m.group(1) in named else name


def _started_ns(folder: Path, meta: dict[str, Any]) -> tuple[int, int]:
    """When a stored run started, for "newest": ``start_unix_ns``, else its ``meta.json``'s
    write time; then its store suffix, for runs that tie."""
    start = meta.get("start_unix_ns")
    if not isinstance(start, int) or isinstance(start, bool):
        try:
            start = (folder / "meta.json").stat().st_mtime_ns
        except OSError:
            start = 0
    m = re.search(r"-(\d+)$", folder.name)
    return start, int(m.group(1)) if m is not None else 1


def _find_stored(root: Path, name: str, plain: bool, stored: list[tuple[Path, dict[str, Any]]]) -> Path | None:
    """The store folder of the run called ``name``: its folder by name (as given, when that is a
    plain folder name, or sanitised, when the run there carries that name), else any folder
    whose run carries that name."""
    if plain and name not in (".", "..") and _exists(root / name) and (root / name).is_dir():
        return root / name
    folder = root / safe_name(name)
    if _exists(folder) and folder.is_dir() and _stored_name(folder) == name:
        return folder
    for folder, meta in stored:
        if meta["name"] == name:
            return folder
    return None


def _stored_meta(folder: Path) -> dict[str, Any] | None:
    """A stored folder's ``meta.json`` when it reads and names its run (None otherwise)."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and isinstance(meta.get("name"), str) else None


def _stored_name(folder: Path) -> str | None:
    """The run name in a stored folder's ``meta.json`` (None when it cannot be read)."""
    meta = _stored_meta(folder)
    return meta["name"] if meta is not None else None
