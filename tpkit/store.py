"""The run store: every finished slice is kept as a folder of Parquet + ``meta.json``.

    tp.load("baseline")     # a store name, or the path of any folder run.save() wrote
    tp.set_store("/data/my_runs")   # or TPKIT_RUNS=/data/my_runs; None or "off" turns it off

Where runs go, first match wins: ``set_store(...)``, the ``TPKIT_RUNS`` environment variable,
then ``./tpkit_runs``. A store name is the run's name; a rerun under a name already taken gets
the first free ``<name>-2``, ``<name>-3``... and ``run.meta["name"]`` is changed to match, while
``run.meta["name_requested"]`` keeps the name the slice was given. One rank of a multi-process
launch is stored as ``<name>.rank<k>`` (its reruns ``<name>.rank<k>-2``...).

A name given to ``tp.load`` / ``tp.compare`` / ``%tp_compare`` means, first match wins:

- the NEWEST run (by its start time) given that name: rerun ``--name baseline`` and
  ``"baseline"`` is the run just measured (stored as ``baseline-2``), not the one before it;
- ``"baseline~1"``: the run given that name before the newest (``~2`` the one before that);
- the run stored under that name (``"baseline-2"`` where no run was given that name);
- a folder path, any run.

``tp.runs()`` lists, for every stored run, the name that loads exactly it now (``name``) and
the name it is stored under (``stored_as``). Two names meaning one run in a comparison raise
an error saying what each meant. A text that names a stored run and is also the path of a
folder holding another run takes the stored run, with a warning naming the folder. Runs stored
before ``name_requested`` was kept answer to their stored name exactly (no rerun is inferred
from a ``-<k>`` suffix: it may be the user's own, ``resnet-50``). ``resolve(name)`` says which
folder a name means and which other runs share it; ``tp.compare`` puts that in the comparison's
warnings whenever several runs share a name.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import warnings
from dataclasses import dataclass, replace
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
    suffix = rank_suffix(run.meta)  # one rank of a launch: x.rank1, never a rerun of x
    stem = run.name + suffix if suffix and not run.name.endswith(suffix) else run.name
    base = safe_name(stem)
    n = 1
    while True:
        folder = root / (base if n == 1 else f"{base}-{n}")
        try:
            folder.mkdir()
            break
        except FileExistsError:
            n += 1
    run.meta.setdefault("name_requested", run.name)  # kept through a later save elsewhere
    if n > 1 or stem != run.name:
        run.meta["name"] = stem if n == 1 else f"{stem}-{n}"
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

    A name is looked up in the store first (``resolve``: the newest run given that name,
    ``name~k`` the k-th before it, else the run stored under it), then as a folder; anything
    with a path separator that names no stored run is a folder (and ``Run.load``'s errors say
    what is wrong with it). Where the text names a stored run and is also the path of a folder
    holding another run, the stored run is taken and a ``UserWarning`` says how to give the
    folder. A name found nowhere raises ``RunFormatError`` listing the names ``tp.runs()``
    shows. A Run passes through unchanged (so ``compare`` takes names and Runs alike).
    """
    run, found = load_resolved(name_or_path, store)
    if found is not None and found.also_folder is not None:
        warnings.warn(f"tpkit: {found.describe_folder()}", UserWarning, stacklevel=2)
    return run


def load_resolved(name_or_path: str | os.PathLike | Run,
                  store: str | os.PathLike | None = None) -> tuple[Run, Resolved | None]:
    """``load``, and what the name or folder resolved to (None for a Run)."""
    if isinstance(name_or_path, Run):
        return name_or_path, None
    text = os.fspath(name_or_path)
    root = Path(store).expanduser() if store is not None else store_path()
    plain = isinstance(name_or_path, str) and os.sep not in text and "/" not in text
    path = Path(text).expanduser()
    if isinstance(name_or_path, str) and root is not None:
        found = resolve(text, root, plain)
        if found is not None:
            if _holds_run(path) and not _same_folder(path, found.folder):
                found = replace(found, also_folder=path)
            return Run.load(found.folder), found
    if not plain or _exists(path):
        try:
            run = Run.load(path)  # Run.load says what is wrong with a folder
        except RunFormatError as e:
            inside = [f for f in stored_folders(path) if (f / "meta.json").is_file()] if _is_dir(path) else []
            if not inside:
                raise
            listing = ", ".join(str(f) for f in inside[:8]) + (", ..." if len(inside) > 8 else "")
            raise RunFormatError(f"{e}; it holds saved runs in its folders: {listing} (tp.profile(save_dir=DIR) "
                                 "saves a run in DIR/<name>, a rank's in DIR/rank<k>: load one of those, or "
                                 "tp.load_ranks(DIR) for a launch's ranks)") from None
        return run, Resolved(text, path, run.name, by_folder=True)
    known = sorted(handles(root).values()) if root is not None else []
    where = f"the store {root}" if root is not None else "the store (it is off)"
    listing = ", ".join(known) if known else "none"
    raise RunFormatError(f"no run named {text!r} in {where} and no such folder; known runs: {listing}")


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # a name too long to be a path is not one
        return False


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:
        return False


def _holds_run(path: Path) -> bool:
    """Whether ``path`` is a folder a run was saved in (its ``meta.json`` is there)."""
    try:
        return (path / "meta.json").is_file()
    except OSError:
        return False


def _same_folder(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return False


def rank_suffix(meta: dict[str, Any]) -> str:
    """``".rank<k>"`` for the run of one rank of a multi-process launch (``world_size`` > 1 in its
    meta, written by capture/ranks.py ``finish_rank_run`` before the store saves it), else "".
    Each rank of a launch saves its own run: without it, the ranks of ``--name x`` had been
    stored as ``x``, ``x-2``... as reruns of one name, ``tp.load("x")`` the rank that happened to
    start last and a comparison calling the other ranks older runs."""
    world, rank = meta.get("world_size"), meta.get("rank")
    if isinstance(world, int) and not isinstance(world, bool) and world > 1 \
            and isinstance(rank, int) and not isinstance(rank, bool):
        return f".rank{rank}"
    return ""


def given_name(meta: dict[str, Any]) -> str:
    """The name a stored run answers to as "the newest run given it": the name its slice was
    given (``meta["name_requested"]``), a launch's rank's with its ``.rank<k>``; for a run saved
    before tpkit kept that key, its stored name exactly (a user's own ``resnet-50`` is not a
    rerun of ``resnet``: the folder's suffix cannot tell, so no rerun is inferred)."""
    requested = meta.get("name_requested")
    name = requested if isinstance(requested, str) else str(meta["name"])
    suffix = rank_suffix(meta)
    return name + suffix if suffix and not name.endswith(suffix) else name


@dataclass(frozen=True)
class Resolved:
    """What a name meant: ``folder`` holds the run stored as ``name``, which the text ``asked``
    resolved to. ``given``: the name the run was given when ``asked`` meant it by that name
    (``older`` = k for ``given~k``), and ``shared``: every run given that name, newest first, as
    (stored name, folder); ``by_folder``: ``asked`` was a folder; ``also_folder``: a folder at the
    path ``asked`` that holds another run (the stored run named so was taken)."""

    asked: str
    folder: Path
    name: str
    given: str | None = None
    older: int = 0
    shared: tuple[tuple[str, Path], ...] = ()
    by_folder: bool = False
    also_folder: Path | None = None

    @property
    def others(self) -> tuple[tuple[str, Path], ...]:
        """The other runs given the same name, newest first, as (stored name, folder)."""
        return tuple(sf for i, sf in enumerate(self.shared) if i != self.older)

    def handle(self, i: int) -> str:
        """The name that means the ``i``-th newest run given ``given`` (0: the newest)."""
        return str(self.given) if i == 0 else f"{self.given}~{i}"

    def means(self) -> str:
        """How ``asked`` came to mean this run, in a few words."""
        if self.by_folder:
            return f"{self.asked!r} is its folder"
        if self.given is None:
            return f"{self.asked!r} is its stored name"
        n = len(self.shared)
        if self.older:
            return f"{self.asked!r} is the run {self.older} before the newest of the {n} runs given {self.given!r}"
        return f"{self.asked!r} means the newest of the {n} runs given that name" if n > 1 \
            else f"{self.asked!r} is the name it was given"

    def older_names(self) -> str:
        """The other runs given the same name, each with the name that loads it."""
        return ", ".join(f"{self.handle(i)!r} (stored as {name!r} in {folder})"
                         for i, (name, folder) in enumerate(self.shared) if i != self.older)

    def describe(self) -> str:
        """What a comparison says of this name: which stored run it took when several runs were
        given it, and a folder of the same path it did not take; "" when there is nothing to say."""
        parts = []
        if self.given is not None and not self.older and len(self.shared) > 1:
            parts.append(f"{self.asked!r} is the run stored as {self.name!r}, the newest of the {len(self.shared)} "
                         f"runs given that name (the others: {self.older_names()})")
        elif self.older:  # explicit, but its label is the stored name, which may be another name's
            parts.append(f"{self.asked!r} is the run stored as {self.name!r}, {self.older} before the newest of the "
                         f"{len(self.shared)} runs given {self.given!r}")
        if self.also_folder is not None:
            parts.append(self.describe_folder())
        return "; ".join(parts)

    def describe_folder(self) -> str:
        """The text names a stored run and the path of a folder holding another: the name won."""
        if self.also_folder is None:
            return ""
        there = self.also_folder.resolve() if _exists(self.also_folder) else self.also_folder
        return (f"{self.asked!r} names the stored run {self.name!r} (in {self.folder}), which was taken; the folder "
                f"{self.also_folder} holds another run: give it as {str(there)!r} to load that one")


def check_distinct(found: list[Resolved | None]) -> None:
    """Raise ``RunFormatError`` where two of the names given to a comparison mean one stored run
    (``tp.compare("baseline", "baseline-2")`` after a rerun had compared baseline-2 with itself,
    "no meaningful difference"): what each name resolved to, and the names of the others."""
    by_folder: dict[Path, list[Resolved]] = {}
    for r in found:
        if r is not None:
            try:
                key = r.folder.resolve()
            except OSError:
                key = r.folder
            by_folder.setdefault(key, []).append(r)
    for same in by_folder.values():
        if len(same) < 2:
            continue
        asked = " and ".join(repr(r.asked) for r in same)
        msg = (f"{asked} are the same run, stored as {same[0].name!r} in {same[0].folder}: "
               + "; ".join(r.means() for r in same))
        shared = next((r for r in same if r.given is not None and len(r.shared) > 1), None)
        if shared is not None:
            msg += f". The other runs given {shared.given!r}: {shared.older_names()}"
        raise RunFormatError(msg + ". tp.runs() lists the name that loads each run")


def handles(store: str | os.PathLike | None = None) -> dict[Path, str]:
    """For every readable stored run, the name that loads exactly it now (``tp.runs()``'s
    ``name``): the name it was given when it is the newest run given it, else ``given~k`` (k runs
    given that name are newer)."""
    root = Path(store).expanduser() if store is not None else store_path()
    if root is None:
        return {}
    out = {}
    for given, runs in _given_groups(_stored(root)).items():
        for i, (folder, _) in enumerate(runs):
            out[folder] = given if i == 0 else f"{given}~{i}"
    return out


def resolve(name: str, store: str | os.PathLike | None = None, plain: bool = True) -> Resolved | None:
    """The stored run a name means (None when the store holds none), first match wins:

    1. the newest run (by its ``start_unix_ns``, else when its ``meta.json`` was written) given
       ``name`` (``given_name``: the name its slice was given; a launch's rank's ``<name>.rank<k>``);
    2. ``<given>~<k>``: the run k before the newest given ``<given>``;
    3. the run stored under ``name`` (its folder, or the run whose ``meta["name"]`` it is);
       ``plain``: ``name`` may be taken as a folder name.

    A name given only to the ranks of a launch raises ``RunFormatError`` naming their runs:
    no rank is picked silently."""
    root = Path(store).expanduser() if store is not None else store_path()
    if root is None:
        return None
    stored = _stored(root)
    groups = _given_groups(stored)
    shared = {g: tuple((str(meta["name"]), folder) for folder, meta in runs) for g, runs in groups.items()}
    if name in groups:
        return Resolved(name, shared[name][0][1], shared[name][0][0], name, 0, shared[name])
    m = re.fullmatch(r"(.+)~([1-9]\d*)", name)
    if m is not None and m.group(1) in groups:
        given, k = m.group(1), int(m.group(2))
        if k >= len(shared[given]):
            raise RunFormatError(f"{name!r}: only {len(shared[given])} run(s) were given {given!r} "
                                 f"({', '.join(repr(given if i == 0 else f'{given}~{i}') for i in range(len(shared[given])))})")
        return Resolved(name, shared[given][k][1], shared[given][k][0], given, k, shared[given])
    found = _find_stored(root, name, plain, stored)
    if found is not None:
        return Resolved(name, found, _stored_name(found) or found.name)
    ranks = sorted({g for g, runs in groups.items() for _, meta in runs
                    if meta.get("name_requested") == name and rank_suffix(meta)})
    if ranks:
        raise RunFormatError(f"{name!r} was given to the ranks of a multi-process launch, each stored as a run of its "
                             f"own: name one ({', '.join(map(repr, ranks))}), or load a launch's ranks together with "
                             "tp.load_ranks(DIR) (tp.profile(save_dir=DIR) or TPKIT_SAVE_DIR)")
    return None


def _stored(root: Path) -> list[tuple[Path, dict[str, Any]]]:
    """The store's readable runs: (folder, meta)."""
    return [(folder, meta) for folder in stored_folders(root) if (meta := _stored_meta(folder)) is not None]


def _given_groups(stored: list[tuple[Path, dict[str, Any]]]) -> dict[str, list[tuple[Path, dict[str, Any]]]]:
    """given name -> the runs given it, newest first."""
    groups: dict[str, list[tuple[Path, dict[str, Any]]]] = {}
    for folder, meta in stored:
        groups.setdefault(given_name(meta), []).append((folder, meta))
    for runs in groups.values():
        runs.sort(key=lambda fm: _started_ns(*fm), reverse=True)
    return groups


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
