"""torch's ``default_collate``, with the stacking deferred until the slot is known.

Workers running the default collate_fn call torch's own ``collate`` walker (same rules for
dicts, tuples, namedtuples, numbers, strings) with tensor and numpy-array stacking replaced by
a ``Stack`` placeholder. The ring then stacks each one straight into its slot with
``torch.stack(..., out=slot_view)``: one copy per byte, no temporary batch tensor, and no
per-batch shared-memory segment (torch's default_collate makes one inside workers).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data._utils.collate import collate, default_collate_fn_map


class Stack:
    """Tensors to be stacked along a new first dimension, into memory chosen later."""

    __slots__ = ("tensors", "shape", "dtype")

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        first = tensors[0]
        self.tensors = tensors
        self.shape = (len(tensors), *first.shape)
        self.dtype = first.dtype

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n

    def into(self, out: torch.Tensor) -> None:
        with torch.no_grad():  # samples that require grad still stack into plain memory
            torch.stack(self.tensors, out=out.view(self.dtype).view(self.shape))

    def materialize(self) -> torch.Tensor:
        return torch.stack(self.tensors)


def _stack_tensors(batch: list, *, collate_fn_map: Any = None) -> Stack:
    elem = batch[0]
    if elem.layout != torch.strided or elem.is_nested:
        return torch.stack(batch)  # let torch raise or handle what a slot cannot hold
    return Stack(batch)


def _stack_arrays(batch: list, *, collate_fn_map: Any = None) -> Any:
    elem = batch[0]
    if elem.dtype.hasobject or elem.dtype.kind in "SUV":
        return collate(batch, collate_fn_map=default_collate_fn_map)  # torch's error message
    return Stack([torch.as_tensor(b) for b in batch])


SLOT_COLLATE_MAP = dict(default_collate_fn_map)
SLOT_COLLATE_MAP[torch.Tensor] = _stack_tensors
SLOT_COLLATE_MAP[np.ndarray] = _stack_arrays


def deferred_collate(samples: list) -> Any:
    """default_collate(samples), except that stacks are ``Stack`` placeholders."""
    return collate(samples, collate_fn_map=SLOT_COLLATE_MAP)
