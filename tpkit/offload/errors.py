"""Exceptions of tpkit.offload. Each derives from ``tpkit.errors.TpkitError`` and keeps the
builtin base a caller would catch (ValueError for bad arguments, RuntimeError otherwise)."""

from __future__ import annotations

from ..errors import TpkitError


class OffloadError(TpkitError, RuntimeError):
    """The offloading optimizer could not do what the loop asked (its worker failed, or the
    loop does something a host update cannot follow); the message says what to change."""


class OffloadArgumentError(TpkitError, ValueError):
    """An argument of ``CPUOffloadAdamW`` or ``select_kernel`` that cannot work."""


class StateDictLayoutError(TpkitError, ValueError):
    """A state dict whose parameter layout differs from the optimizer's; nothing was loaded."""


class GradientChangedError(OffloadError):
    """A gradient changed between ``backward()`` and ``step()`` (e.g. ``clip_grad_norm_``),
    after the optimizer had already taken it."""


class ExtraBackwardError(OffloadError):
    """More ``backward()`` calls reached a parameter before one ``step()`` than
    ``accumulation_steps`` says, while its update had already run."""


__all__ = ["OffloadError", "OffloadArgumentError", "StateDictLayoutError", "GradientChangedError",
           "ExtraBackwardError"]
