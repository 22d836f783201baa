"""tpkit.kernels' exceptions: each a ``tpkit.errors.TpkitError`` that keeps the builtin base
torch raises for the same mistake, so ``except RuntimeError`` (or ``IndexError``, ...) written
for the plain torch op still catches it (STYLE.md 15).

- ``KernelTensorError`` (RuntimeError): a tensor of the wrong shape, dtype or device, where
  torch's own ops raise RuntimeError ("expected m1 and m2 to have the same dtype", ...).
- ``KernelArgumentError`` (ValueError): an argument of the wrong value, where torch raises
  ValueError (``reduction="max"``, a batch size that does not match the targets').
- ``KernelTypeError`` (TypeError): something that is not a tensor where a tensor goes.
- ``KernelIndexError`` (IndexError): a class index out of range, as ``F.cross_entropy`` on the
  CPU ("Target 99 is out of bounds.").
- ``KernelBackendError`` (RuntimeError): Triton failed to compile or launch a kernel; the
  message says how to run the torch reference instead.

The checks shared by every op (devices, dtypes) are here; each op's file checks its shapes.
They cost a few attribute reads per call, never a host sync.
"""

from __future__ import annotations

from typing import Iterable

import torch

from tpkit.errors import TpkitError


class KernelError(TpkitError):
    """Base of every error tpkit.kernels raises on purpose."""


class KernelTensorError(KernelError, RuntimeError):
    """A tensor whose shape, dtype or device the op cannot take (torch: RuntimeError)."""


class KernelArgumentError(KernelError, ValueError):
    """An argument with a value the op cannot take (torch: ValueError)."""


class KernelTypeError(KernelError, TypeError):
    """Not a tensor where the op takes a tensor (torch: TypeError)."""


class KernelIndexError(KernelError, IndexError):
    """A class index out of range (torch's cross-entropy on the CPU: IndexError)."""


class KernelBackendError(KernelError, RuntimeError):
    """Triton could not compile or launch a kernel."""


def check_same_device(op: str, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """All tensors on one device, in torch's words when they are not."""
    tensors = list(tensors)
    first_name, first = tensors[0]
    for name, t in tensors[1:]:
        if t.device != first.device:
            raise KernelTensorError(
                f"{op}: expected all tensors to be on the same device, but found at least two "
                f"devices, {first.device} ({first_name}) and {t.device} ({name})")


def check_floating(op: str, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Every tensor floating point (the kernels compute in fp32 from fp16/bf16/fp32/fp64)."""
    for name, t in tensors:
        if not t.is_floating_point():
            raise KernelTensorError(f"{op}: {name} must be a floating-point tensor, got {t.dtype}")


def check_tensor(op: str, name: str, t: object) -> torch.Tensor:
    """``t`` itself when it is a tensor; TypeError kind otherwise, as torch's ops."""
    if not isinstance(t, torch.Tensor):
        raise KernelTypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    return t
