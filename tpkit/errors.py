"""tpkit's exceptions, in one place."""

from __future__ import annotations


class TpkitError(Exception):
    """Base of every error tpkit raises on purpose."""


class ProfileActiveError(TpkitError):
    """A slice was started while another one is running."""


class RunFormatError(TpkitError):
    """A folder given to ``tp.load`` is not a saved Run, or is damaged."""


class MissingExtraError(TpkitError, ImportError):
    """An optional dependency is missing; the message names the extra to install."""

    def __init__(self, package: str, extra: str, feature: str) -> None:
        super().__init__(f"{feature} needs the '{package}' package: pip install 'tpkit[{extra}]'")
        self.package, self.extra = package, extra


class StopSlice(BaseException):
    """Raised at a plain loop's first training action after its slice is full (its next batch,
    trained forward, backward, optimizer step or ``tp.step()``: ``capture/slice.py``,
    ``Profile._stopping``); caught by ``tp.profile`` and the magic.

    A BaseException so that a user's ``except Exception`` in the loop does not swallow it. Its
    message says what it is: a framework that logs what ended its run (ignite's "Engine run is
    terminating due to exception: ") had logged an empty ERROR line with every profile.
    """

    MESSAGE = ("tpkit's profiling slice is full and recorded: tpkit stopped the training loop here on purpose, "
               "this is not an error (tp.profile catches it; a handler that catches BaseException should "
               "re-raise it, or profile with tp.profile(stop=False))")

    def __init__(self, message: str = MESSAGE) -> None:
        super().__init__(message)
        # set where tpkit's own code ended the loop's code with it and goes on (the magic's inner
        # run_cell, %run): no stop the loop swallowed (capture/slice.py, Profile._swallowed_note)
        self.handled_by_tpkit = False


class NvmlError(TpkitError):
    """An NVML call failed. Every ``pynvml.NVMLError`` becomes this one class, in one place
    (``tpkit.probes.clock_backends._nvml_call``); ``kind`` keeps NVML's own error name
    (e.g. ``NVMLError_NotSupported``) and ``code`` its number."""

    def __init__(self, message: str, code: int | None = None, kind: str = "NVMLError") -> None:
        super().__init__(message)
        self.code, self.kind = code, kind


class OutputPathError(TpkitError, OSError):
    """A folder tpkit was asked to write into cannot be written (a file, a read-only place)."""
