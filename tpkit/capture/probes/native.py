"""Build and load tpkit's one-file C extensions that need only Python's own headers.

Why not torch's extension builder (which the allocation counter needs, for torch's C++
headers): importing ``torch.utils.cpp_extension`` alone takes ~1.4 s on a 2-core VM (it imports
setuptools), every process, before the cache is even looked at. A file of plain CPython API
compiles in ~0.5 s with the compiler and flags Python itself was built with (``sysconfig``), and
a cached build loads in a millisecond.

The cache: ``$TPKIT_CACHE_DIR`` or ``$XDG_CACHE_HOME/tpkit`` (``~/.cache/tpkit``), one file per
source, Python version and compile command (their hash is in the name), so an edited source or
another Python builds anew. A build goes to a temporary file that is renamed into place: ranks
or notebooks building at once each load a whole file.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shlex
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from threading import Lock
from types import ModuleType

#: Seconds a compile may take before it counts as failed.
BUILD_TIMEOUT_S = 120

_lock = Lock()
_loaded: dict[str, tuple[ModuleType | None, str | None]] = {}  # name -> (module, why not); once per process


def cache_dir() -> Path:
    """Where built extensions are kept (see the module docstring)."""
    own = os.environ.get("TPKIT_CACHE_DIR")
    if own:
        return Path(own)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tpkit"


def compile_command(source: Path, out: Path) -> list[str]:
    """The command that builds ``source`` into the shared object ``out``: Python's own compiler
    and linker settings, as setuptools would use them. ValueError when this Python has none."""
    ldshared, ccshared = sysconfig.get_config_var("LDSHARED"), sysconfig.get_config_var("CCSHARED")
    if not ldshared:
        raise ValueError("this Python has no C compiler settings (sysconfig LDSHARED)")
    include = sysconfig.get_paths()["include"]
    return [*shlex.split(ldshared), *shlex.split(ccshared or ""), "-O2", f"-I{include}", str(source),
            "-o", str(out)]


def load(name: str, source: Path) -> tuple[ModuleType | None, str | None, float]:
    """The extension ``name`` built from ``source`` (its init function ``PyInit_<name>``), or
    None and why not; and the seconds this call spent building (0.0 when it loaded a cached
    build, or once the process has it). A failure is remembered: no second compile."""
    with _lock:
        if name in _loaded:
            module, why = _loaded[name]
            return module, why, 0.0
        t0 = time.perf_counter()
        built = False
        try:
            path, built = _built(name, source)
            spec = importlib.util.spec_from_file_location(name, path)
            if spec is None or spec.loader is None:
                raise ImportError(f"cannot load {path}")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        except Exception as e:  # noqa: BLE001 - no compiler, no headers, a read-only cache: say why
            why = failure_text(e)
            _loaded[name] = (None, why)
            return None, why, 0.0
        _loaded[name] = (module, None)
        return module, None, (time.perf_counter() - t0) if built else 0.0


def failure_text(e: BaseException) -> str:
    """Why a build or load failed, in one line: the exception's type and its first line (the
    run's notes quote it)."""
    first = str(e).strip().splitlines()[:1]
    return f"{type(e).__name__}: {first[0] if first else ''}".strip()


def _built(name: str, source: Path) -> tuple[Path, bool]:
    """The cached build of ``source`` (built now if missing) and whether it was built now."""
    folder = cache_dir()
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    probe_cmd = compile_command(source, Path("OUT"))
    key = hashlib.sha256(source.read_bytes() + sys.version.encode() + "\0".join(probe_cmd).encode())
    path = folder / f"{name}-{key.hexdigest()[:16]}{suffix}"
    if path.exists():
        return path, False
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{name}-{os.getpid()}-{time.monotonic_ns()}{suffix}"
    cmd = compile_command(source, tmp)
    try:
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)
        except FileNotFoundError:
            raise RuntimeError(f"no C compiler: {cmd[0]!r}, the one this Python was built with, is not "
                               f"installed") from None
        if done.returncode != 0:
            lines = [ln.strip() for ln in (done.stderr or done.stdout).splitlines() if ln.strip()]
            first = next((ln for ln in lines if "error" in ln.lower()), lines[0] if lines else None)
            raise RuntimeError(f"the compiler failed ({first or f'exit {done.returncode}'})")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path, True
