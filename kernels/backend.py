"""Which implementation a kernel call runs: the one place that decides.

Three backends, chosen per call from the tensors' device and the environment:

- ``"triton"``:      compiled Triton, when the tensors live on a CUDA device.
- ``"interpreter"``: Triton's interpreter, when ``TRITON_INTERPRET=1`` was set before triton
  was imported (exact but thousands of times slower than torch: for tests and CPU machines).
- ``"reference"``:   the plain torch implementation in ``reference.py``, otherwise. A notice
  (``warnings.warn``, once per reason) says why, so a CPU user never meets Triton's
  "0 active drivers" error, and a user without triton is told ``pip install tpkit[triton]``.

``TPKIT_KERNELS=reference`` (or :func:`force_backend`) forces the reference path, which is
what an A/B run's "off" arm and the tests' expected values use.

Why "before triton was imported": triton.language jits its own helpers (``tl.sigmoid``,
``tl.cdiv``, ...) at import, compiled or interpreted per ``TRITON_INTERPRET`` at that moment,
and a kernel of the other mode cannot call them ("Cannot call @triton.jit'd outside of the
scope of a kernel"). :func:`triton_mode` probes that mode from the helpers themselves, and
kernels are jitted lazily in that same mode (:class:`LazyKernel`), whatever the environment
says later; setting the variable too late gets the reference path and a notice saying so.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any, Callable, Iterator

import torch

from .errors import KernelArgumentError, KernelBackendError

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
    """Issued with ``warnings.warn`` (once per reason) when tpkit.kernels falls back to torch."""


def _notice(key: str, message: str) -> None:
    if key in _noticed:
        return
    _noticed.add(key)
    warnings.warn(message, KernelBackendNotice, stacklevel=3)


def triton_available() -> bool:
    """Whether triton could be imported."""
    return triton is not None


def interpret_requested() -> bool:
    """True when ``TRITON_INTERPRET`` is set to a true value now, as Triton reads it."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def triton_mode() -> str | None:
    """"interpreted" or "compiled": the mode triton.language was imported in (probed from its
    own jitted helper ``tl.sigmoid``); None without triton."""
    if tl is None:
        return None
    helper = getattr(tl, "sigmoid", None)
    return "interpreted" if type(helper).__name__ == "InterpretedFunction" else "compiled"


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
    if triton_mode() == "interpreted":
        return "interpreter"  # on any device: Triton's interpreter copies CUDA tensors itself
    if any(t.is_cuda for t in tensors):
        return "triton"
    if interpret_requested():
        _notice(
            "late-interpret",
            "tpkit.kernels: TRITON_INTERPRET=1 was set after triton was imported, so Triton's "
            "interpreter is not active; using the torch reference implementations. Set it "
            "before importing tpkit or triton (e.g. restart the notebook kernel, then "
            "`%env TRITON_INTERPRET=1` first).",
        )
        return "reference"
    _notice(
        "no-gpu",
        "tpkit.kernels: no GPU for these tensors and TRITON_INTERPRET=1 is not set; using the "
        "torch reference implementations (to run the kernels through Triton's interpreter, "
        "very slowly, set TRITON_INTERPRET=1 before importing tpkit or triton).",
    )
    return "reference"


def use_kernel(*tensors: torch.Tensor) -> bool:
    """Whether a public op should launch its Triton kernel (else: the torch reference)."""
    return select_backend(*tensors) != "reference"


def force_backend(name: str | None) -> None:
    """Force ``"reference"`` for every call (``None`` restores automatic selection)."""
    global _forced
    if name not in (None, "reference"):
        raise KernelArgumentError(f"only 'reference' or None can be forced, got {name!r}")
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
        """The jitted kernel, in the mode triton.language itself runs in (see triton_mode)."""
        if triton is None:
            from tpkit.errors import MissingExtraError

            raise MissingExtraError("triton", "triton", "tpkit's Triton kernels") from TRITON_IMPORT_ERROR
        interpreted = triton_mode() == "interpreted"
        if interpreted not in self._jitted:
            with _mode_scope(interpreted):
                self._jitted[interpreted] = triton.jit(self.fn)
        return self._jitted[interpreted]

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        kernel = self.jitted()
        interpreted = triton_mode() == "interpreted"
        name = self.__name__

        def launch(*args: Any, **kwargs: Any) -> Any:
            # Triton launches on the *current* device's current stream: make that the
            # tensors' device, or a tensor on cuda:1 runs on cuda:0's stream (issue 17, 7).
            with device_guard(launch_device(args)), _mode_scope(interpreted):
                try:
                    return kernel[grid](*args, **kwargs)
                except triton_errors() as exc:
                    raise KernelBackendError(
                        f"tpkit.kernels: Triton could not compile or launch {name} "
                        f"({type(exc).__name__}: {exc}). TPKIT_KERNELS=reference (or "
                        f"tpkit.kernels.force_backend('reference')) runs the torch reference instead."
                    ) from exc

        return launch


def launch_device(args: tuple[Any, ...]) -> torch.device | None:
    """The CUDA device of a launch: the first CUDA tensor among its arguments (None: none)."""
    for a in args:
        if isinstance(a, torch.Tensor) and a.is_cuda:
            return a.device
    return None


def device_guard(device: torch.device | None) -> contextlib.AbstractContextManager[Any]:
    """``torch.cuda.device(device)`` for a CUDA device, else nothing to do."""
    return torch.cuda.device(device) if device is not None else contextlib.nullcontext()


_TRITON_ERRORS: tuple[type[BaseException], ...] | None = None


def triton_errors() -> tuple[type[BaseException], ...]:
    """Triton's own exception classes (compile errors, out of resources, ...), as this
    triton version has them."""
    global _TRITON_ERRORS
    if _TRITON_ERRORS is None:
        import importlib

        found: list[type[BaseException]] = []
        for module, name in (("triton.errors", "TritonError"), ("triton.runtime.errors", "OutOfResources"),
                             ("triton.compiler.errors", "CompilationError")):
            try:
                found.append(getattr(importlib.import_module(module), name))
            except (ImportError, AttributeError):
                pass
        _TRITON_ERRORS = tuple(found)
    return _TRITON_ERRORS


def _mode_scope(interpreted: bool) -> contextlib.AbstractContextManager[None]:
    """Make Triton's interpret knob agree with triton.language's mode for a moment (it and
    the environment are restored on exit); a no-op when they already agree."""
    knobs = getattr(triton, "knobs", None)
    if knobs is None or bool(knobs.runtime.interpret) == interpreted:
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def scope() -> Iterator[None]:
        with knobs.runtime.scope():
            knobs.runtime.interpret = interpreted
            yield

    return scope()


def lazy_jit(fn: Callable[..., Any]) -> LazyKernel:
    """Decorator: a ``LazyKernel`` (jitted at first launch, in triton.language's mode)."""
    return LazyKernel(fn)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def num_programs_cap(device: torch.device) -> int:
    """How many persistent programs a reduction-over-rows kernel should launch at most."""
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # the interpreter: few programs, each vectorised over many rows, is fastest


def cdiv(a: int, b: int) -> int:
    """Ceiling division of positive ints."""
    return -(-a // b)


def num_warps_for(tile_elements: int, per_thread: int = 8) -> int:
    """Warps for a tile of ``tile_elements`` values per tensor, so each thread holds about
    ``per_thread`` of each (4 to 32 warps). A kernel that keeps several tile-sized tensors
    live at once spills registers when this is too high: at 16 per thread, RMSNorm's backward
    (x, dy, w, xn, dx live together) needed 213 registers at 8192 columns and spilled 464 B
    at 16384 on sm_90 (issue 17, 15; measured with tests/test_kernels_compile.py's
    ahead-of-time compile)."""
    warps = tile_elements // (32 * per_thread)
    return max(4, min(32, next_power_of_2(max(1, warps))))


def eager_only(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Have torch.compile call ``fn`` eagerly (a graph break) rather than trace into it.

    Dynamo cannot trace Triton's interpreter (it fails on numpy uint64 pointer arithmetic),
    and a fused loss that compile silently got wrong is exactly what users of other kernel
    libraries report; so the kernels' autograd Functions are opaque to compile and run as
    written. (Registering them with ``torch.library.triton_op`` would let compile see
    through them on a GPU: not done yet.)"""
    disable = getattr(getattr(torch, "compiler", None), "disable", None)
    return disable(fn) if disable is not None else fn
