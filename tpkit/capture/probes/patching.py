"""Attribute patches that come off exactly: what a class held itself is put back, and an
attribute it only inherited is deleted again (so the base class shows through as before)."""

from __future__ import annotations

import math
import os
import sys
import weakref
from typing import Any

#: While any object here is alive (tpkit's offload optimizers add themselves), torch's in-place
#: rescale of the gradients by exactly 1 is skipped (``skip_unit_rescale``).
UNIT_RESCALE_SKIPPERS: "weakref.WeakSet[Any]" = weakref.WeakSet()


def skip_unit_rescale() -> None:
    """``clip_grad_norm_(params, inf)`` (a Hugging Face Trainer does it at every step to log the
    gradients' norm) scales every gradient in place by exactly 1: the values stay, but the
    version counters move, and ``tp.offload.CPUOffloadAdamW``, which takes each gradient when
    backward finishes it, refused the step (GradientChangedError under a default Trainer).
    While one is alive (``UNIT_RESCALE_SKIPPERS``), that rescale (an infinite bound, a finite
    norm: the result is the same) is skipped; any other call goes on as before. Set on torch's
    module, which ``clip_grad_norm_`` reads at each call; idempotent, and put back by a phase
    probe that restored torch's own function under it (``PhaseProbe.remove``)."""
    clip_grad = sys.modules.get("torch.nn.utils.clip_grad")
    current = vars(clip_grad).get("_clip_grads_with_norm_") if clip_grad is not None else None
    if current is None or getattr(current, "_tpkit_skips_one", False):
        return
    import torch

    def _clip_grads_with_norm_(parameters: Any, max_norm: float, total_norm: Any, foreach: bool | None = None) -> Any:
        if UNIT_RESCALE_SKIPPERS and float(max_norm) == math.inf and bool(torch.isfinite(total_norm)):
            return None
        return current(parameters, max_norm, total_norm, foreach)

    for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
        setattr(_clip_grads_with_norm_, attr, getattr(current, attr, None))
    _clip_grads_with_norm_._tpkit_skips_one = True  # type: ignore[attr-defined]
    clip_grad._clip_grads_with_norm_ = _clip_grads_with_norm_  # type: ignore[union-attr]


#: Every ``Patches`` with a patch in place, by id, held strongly: a probe dropped without its
#: ``restore`` still has its patches found here (``in_place``), not lost with it.
_IN_PLACE: dict[int, "Patches"] = {}


def in_place() -> list[tuple[Any, str]]:
    """``(owner, attribute)`` of every patch of tpkit's in place now, whichever probe made it:
    none outside a slice (the test suite checks it after every test)."""
    return [(owner, attr) for patches in list(_IN_PLACE.values()) for owner, attr, _ in patches._done]


class Patches:
    """Attribute patches that are undone exactly, in reverse order, however often ``restore`` is called."""
    def __init__(self) -> None:
        self._done: list[tuple[Any, str, Any]] = []  # (owner, attribute, original or None)

    def __bool__(self) -> bool:
        return bool(self._done)

    def set(self, owner: Any, attr: str, new: Any) -> None:
        orig = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr)
        self._done.append((owner, attr, orig))
        _IN_PLACE[id(self)] = self
        setattr(owner, attr, new)

    def restore(self) -> None:
        """Undo every patch, newest first. Idempotent."""
        while self._done:
            owner, attr, orig = self._done.pop()
            if orig is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, orig)
        _IN_PLACE.pop(id(self), None)


def _restore_in_child() -> None:
    """A process forked while patches are in (a DataLoader's workers started inside the slice,
    Lightning's ``ddp_fork`` ranks) is not the loop, and no slice of its own ends there: its copy
    of every patch comes off at once. Persistent workers had kept the module-call route for their
    whole life, after the slice too: a module call in ``__getitem__`` (a transform written as an
    ``nn.Module``, as torchvision's v2 transforms are) took 1.98x what it takes in a worker forked
    with no slice running, 1.02x now (benchmarks/forked_workers.py)."""
    for patches in list(_IN_PLACE.values()):
        try:
            patches.restore()
        except Exception:  # noqa: BLE001 - a fork's child must never fail for tpkit
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_restore_in_child)
