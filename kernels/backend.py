"""Which implementation a kernel call runs: the one place that decides.

Three backends, chosen per call from the tensors' device and the environment:

- ``"triton"``:      compiled Triton, when the tensors live on a CUDA device.
- ``"interpreter"``: Triton's interpreter, when the tensors are on the CPU and
  ``TRITON_INTERPRET=1`` is set (exact but thousands of times slower than torch: for tests).
- ``"reference"``:   the plain torch implementation in ``reference.py``, otherwise. A notice
  (``warnings.warn``, once per reason) says why, so a CPU user never meets Triton's
  "0 active drivers" error, and a user without triton is told ``pip install tpkit[triton]``.

``TPKIT_KERNELS=reference`` (or :func:`force_backend`) forces the reference path, which is
what an A/B run's "off" arm and the tests' expected values use.

Kernels are jitted lazily (:class:`LazyKernel`): Triton decides between compiling and
interpreting when ``triton.jit`` runs, so jitting at first launch makes ``TRITON_INTERPRET``
effective whenever it is set, not only if it was set before ``import tpkit.kernels``.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any, Callable, Iterator

import torch

try:  # triton is an optional extra: tpkit[triton]
    import triton
    import triton.language as tl

    TRITON_IMPORT_ERROR: ImportError | None = None
except ImportError as exc:  # pragma: no cover - exercised in a subprocess by the tests
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    TRITON_IMPORT_ERROR = exc

BACKENDS = ("triton", "interpreter", "reference")
INSTALL_HINT = "pip install tpkit[triton]"

_forced: str | None = None
_noticed: set[str] = set()


class KernelBackendNotice(UserWarning):
    """Raised as a warning (once per reason) when tpkit.kernels falls back to torch."""


def _notice(key: str, message: str) -> None:
    if key in _noticed:
        return
    _noticed.add(key)
    warnings.warn(message, KernelBackendNotice, stacklevel=3)


def triton_available() -> bool:
    return triton is not None


def interpret_requested() -> bool:
    """True when ``TRITON_INTERPRET`` is set to a true value, as Triton reads it."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def select_backend(*tensors: torch.Tensor) -> str:
    """The backend for a call on ``tensors`` (their device decides GPU vs CPU)."""
    forced = _forced or os.environ.get("TPKIT_KERNELS", "").strip().lower() or None
    if forced == "reference":
        return "reference"
    if triton is None:
        _notice(
            "no-triton",
            f"tpkit.kernels: triton is not installed ({TRITON_IMPORT_ERROR}); using the torch "
            f"reference implementations. To run the Triton kernels: {INSTALL_HINT}",
        )
        return "reference"
    on_cuda = any(t.is_cuda for t in tensors)
    if interpret_requested() and not on_cuda:
        return "interpreter"
    if on_cuda:
        return "triton"
    _notice(
        "no-gpu",
        "tpkit.kernels: no GPU for these tensors and TRITON_INTERPRET=1 is not set; using the "
        "torch reference implementations (set TRITON_INTERPRET=1 to run the kernels through "
        "Triton's interpreter, very slowly).",
    )
    return "reference"


def use_kernel(*tensors: torch.Tensor) -> bool:
    """Whether a public op should launch its Triton kernel (else: the torch reference)."""
    return select_backend(*tensors) != "reference"


def force_backend(name: str | None) -> None:
    """Force ``"reference"`` for every call (``None`` restores automatic selection)."""
    global _forced
    if name not in (None, "reference"):
        raise ValueError(f"only 'reference' or None can be forced, got {name!r}")
    _forced = name


@contextlib.contextmanager
def reference_only() -> Iterator[None]:
    """``with reference_only(): ...`` runs every tpkit kernel through its torch reference."""
    global _forced
    before = _forced
    _forced = "reference"
    try:
        yield
    finally:
        _forced = before


class LazyKernel:
    """A ``@triton.jit`` kernel jitted at first launch, once per mode (compiled/interpreted).

    Use as a decorator on a kernel function; launch it like a jitted kernel:
    ``kernel[grid](*args, BLOCK=...)``.
    """

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.__name__ = fn.__name__
        self.__doc__ = fn.__doc__
        self._jitted: dict[bool, Any] = {}

    def jitted(self) -> Any:
        if triton is None:
            raise ImportError(f"triton is not installed: {INSTALL_HINT}") from TRITON_IMPORT_ERROR
        mode = interpret_requested()
        if mode not in self._jitted:
            self._jitted[mode] = triton.jit(self.fn)  # Triton reads TRITON_INTERPRET here
        return self._jitted[mode]

    def __getitem__(self, grid: Any) -> Any:
        return self.jitted()[grid]


def lazy_jit(fn: Callable[..., Any]) -> LazyKernel:
    return LazyKernel(fn)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def num_programs_cap(device: torch.device) -> int:
    """How many persistent programs a reduction-over-rows kernel should launch at most."""
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # the interpreter: few programs, each vectorised over many rows, is fastest


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
