"""tpkit: profile a slice of your PyTorch training loop from a notebook, see where the time,
memory and clock cycles went, change one knob, compare.

    import tpkit as tp
    with tp.profile(steps=20, warmup=3, name="baseline") as prof:
        train()
    prof.run.steps

In a notebook: ``%load_ext tpkit`` then ``%%tp_profile --steps 20``.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

from .compare import Comparison, compare
from .errors import MissingExtraError, ProfileActiveError, RunFormatError, TpkitError
from .probes.phases import watch
from .profiler import Profile, SliceConfig, last_run, phase, profile, profile_fn, step
from .run import Run
from .store import load, runs, set_store

#: Subpackages imported on first use: ``tp.data``, ``tp.offload``, ``tp.kernels`` (triton is
#: heavy), ``tp.datasets``, ``tp.widgets``.
_LAZY = {"data", "offload", "kernels", "datasets", "widgets", "charts", "analysis", "store", "demo", "models"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return importlib.import_module(f".{name}", __name__)
    if name in ("dashboard", "tune"):
        return getattr(importlib.import_module(".widgets", __name__), name)
    if name == "load_ranks":
        return importlib.import_module(".ranks", __name__).load_ranks
    raise AttributeError(f"module 'tpkit' has no attribute {name!r}")


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext tpkit``: registers the magics (IPython is imported only here) and sets up
    offline chart rendering."""
    from .magic import load_ipython_extension as _load

    _load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    from .magic import unload_ipython_extension as _unload

    _unload(ipython)


__all__ = [
    "Comparison", "MissingExtraError", "Profile", "ProfileActiveError", "Run", "RunFormatError",
    "SliceConfig", "TpkitError", "compare", "dashboard", "last_run", "load", "phase", "profile",
    "profile_fn", "runs", "set_store", "step", "tune", "watch",
]
