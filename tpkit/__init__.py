"""tpkit: profile a slice of your PyTorch training loop from a notebook, see where the time,
memory and clock cycles went, change one knob, compare.

    import tpkit as tp
    with tp.profile(steps=20, warmup=3, name="baseline") as prof:
        train()
    prof.run.steps

In a notebook: ``%load_ext tpkit`` then ``%%tp_profile --steps 20``.
"""

__version__ = "0.1.0"

from .errors import MissingExtraError, ProfileActiveError, RunFormatError, TpkitError
from .probes.phases import watch
from .profiler import Profile, SliceConfig, last_run, phase, profile, profile_fn, step
from .run import Run

load = Run.load


def load_ipython_extension(ipython):  # noqa: ANN001 - IPython's API
    """``%load_ext tpkit``: registers ``%%tp_profile`` (IPython is imported only here)."""
    from .magic import load_ipython_extension as _load

    _load(ipython)


def unload_ipython_extension(ipython):  # noqa: ANN001
    from .magic import unload_ipython_extension as _unload

    _unload(ipython)


__all__ = [
    "MissingExtraError", "Profile", "ProfileActiveError", "Run", "RunFormatError", "SliceConfig",
    "TpkitError", "last_run", "load", "phase", "profile", "profile_fn", "step", "watch",
]
