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
from typing import TYPE_CHECKING, Any

from ._version import __version__
from .errors import MissingExtraError, ProfileActiveError, RunFormatError, TpkitError

if TYPE_CHECKING:  # what the lazy names below resolve to, for type checkers and editors
    from .analysis.catalog import runs
    from .analysis.compare import Comparison
    from .capture.probes.watch import watch
    from .capture.slice import Profile, SliceConfig, last_run, phase, profile, profile_fn, step
    from .ranks import RankRuns, load_ranks
    from .run import Run
    from .store import load, set_store

#: Subpackages imported on first use: ``tp.data``, ``tp.offload``, ``tp.kernels`` (triton is
#: heavy), ``tp.datasets``, ``tp.views``, ``tp.charts``.
_LAZY = {"data", "offload", "kernels", "datasets", "views", "charts", "analysis", "capture", "store", "demo"}
#: Names imported from their module on first use. ``import tpkit.data`` (a user of the loader
#: alone) must not import pandas and pyarrow with the Run: 0.3 s and ~36 MB of mapped
#: libraries in the training process, shared with every worker it forks.
_LAZY_NAMES = {
    "runs": ".analysis.catalog", "Comparison": ".analysis.compare", "watch": ".capture.probes.watch",
    **dict.fromkeys(("Profile", "SliceConfig", "last_run", "phase", "profile", "profile_fn", "step"),
                    ".capture.slice"),
    "RankRuns": ".ranks", "load_ranks": ".ranks", "Run": ".run", "load": ".store", "set_store": ".store",
}

#: The widgets, taken from their submodule only when asked for (ipywidgets is imported there;
#: once imported, ``tpkit.views.dashboard`` is the module, so not through ``_LAZY_NAMES``).
_WIDGETS = {"dashboard": ".views.dashboard", "tune": ".views.tuner"}


def __dir__() -> list[str]:
    """The lazy names too: a notebook's tab completion on ``tp.`` lists what ``__getattr__`` gives."""
    return sorted(set(globals()) | set(_LAZY_NAMES) | _LAZY | set(_WIDGETS))


def __getattr__(name: str) -> Any:
    if name in _LAZY_NAMES:
        value = getattr(importlib.import_module(_LAZY_NAMES[name], __name__), name)
        globals()[name] = value  # found directly from now on (tp.step in a hot loop)
        return value
    if name in _LAZY:
        return importlib.import_module(f".{name}", __name__)
    if name in _WIDGETS:
        return getattr(importlib.import_module(_WIDGETS[name], __name__), name)
    raise AttributeError(f"module 'tpkit' has no attribute {name!r}")


def compare(*runs: Any, baseline: Any = None, **kwargs: Any) -> Comparison:
    """Compare runs (Runs, store names or saved folders) against a baseline (default: the
    first): ``tp.compare("base", "workers4", baseline="base")``. See
    ``tpkit.analysis.compare`` for the statistics and when a change is called significant."""
    from .analysis.compare import compare as _compare
    from .store import check_distinct, load_resolved

    if len(runs) == 1 and isinstance(runs[0], (list, tuple)):
        runs = tuple(runs[0])
    pairs = [load_resolved(r) for r in runs]
    check_distinct([r for _, r in pairs])  # two names of one stored run: an error saying what each meant
    loaded = [run for run, _ in pairs]
    if isinstance(baseline, str):
        baseline = _baseline_index(baseline, pairs)
    comparison = _compare(*loaded, baseline=baseline, **kwargs)
    # a name several stored runs were given means the newest, a folder of the same path was not
    # taken: say so
    comparison.warnings[:0] = list(dict.fromkeys(d for _, r in pairs if r is not None and (d := r.describe())))
    return comparison


def _baseline_index(baseline: str, pairs: list) -> int | str:
    """Which of the compared runs ``baseline`` means: the one given by that text, else the one
    its store name or folder resolves to (as the runs' own names were: ``"baseline"`` after a
    rerun is the newest, stored as baseline-2, not the older run whose stored name it is),
    else the text itself (a run's name or label, for ``analysis.compare``)."""
    from .errors import TpkitError
    from .store import load_resolved

    for i, (_, r) in enumerate(pairs):
        if r is not None and r.asked == baseline:
            return i
    try:
        run, found = load_resolved(baseline)
    except TpkitError:
        return baseline
    for i, (_, r) in enumerate(pairs):
        if r is not None and found is not None and r.folder.resolve() == found.folder.resolve():
            return i
    return run.name


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext tpkit``: registers the magics (IPython is imported only here) and sets up
    offline chart rendering."""
    from .views.magic import load_ipython_extension as _load

    _load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    from .views.magic import unload_ipython_extension as _unload

    _unload(ipython)


__all__ = [
    "Comparison", "MissingExtraError", "Profile", "ProfileActiveError", "RankRuns", "Run", "RunFormatError",
    "SliceConfig", "TpkitError", "__version__", "compare", "dashboard", "last_run", "load", "load_ranks", "phase", "profile",
    "profile_fn", "runs", "set_store", "step", "tune", "watch",
]
