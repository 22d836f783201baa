"""Flat host arenas: many tensors as views into a few large buffers.

Why: torch's pinned-memory allocator rounds every block up to a power of two, so pinning one
buffer per parameter can pin almost twice what it holds (a 2.1 GB fp32 master pinned 4 GiB).
Here every buffer asked of the allocator is itself a power of two, so what is requested is what
gets pinned, and tensors are packed into it at aligned offsets: the only slack is the unused
tail of each buffer (below one buffer's size in all, reported as ``slack_bytes``).

The layout (``plan_arena``) is plain arithmetic and the same with or without pinning; the
buffers are pinned only when asked (``pin_memory=True``, which needs CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

ALIGN_BYTES = 512  # offsets: a multiple of every dtype's size and of the DMA-friendly 512 B
MIN_BUFFER_BYTES = 1 << 26  # 64 MiB: few buffers, and little tail slack against a multi-GB master

__all__ = ["ALIGN_BYTES", "ArenaLayout", "HostArena", "Placement", "plan_arena"]


def _align_up(n: int, align: int) -> int:
    return -(-n // align) * align


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class Placement:
    """Where one tensor lives: buffer index, byte offset, its bytes (unaligned)."""

    buffer: int
    offset_bytes: int
    nbytes: int


@dataclass(frozen=True)
class ArenaLayout:
    """Buffers to allocate and where each tensor goes."""

    buffer_bytes: tuple[int, ...]  # each a power of two: the allocator adds nothing to it
    placements: tuple[Placement, ...]  # one per requested tensor, in request order
    align_bytes: int

    @property
    def requested_bytes(self) -> int:
        """What is asked of the allocator (and pinned, when pinned)."""
        return sum(self.buffer_bytes)

    @property
    def used_bytes(self) -> int:
        """Bytes the tensors occupy, each rounded up to the alignment."""
        return sum(_align_up(p.nbytes, self.align_bytes) for p in self.placements)

    @property
    def slack_bytes(self) -> int:
        return self.requested_bytes - self.used_bytes


def plan_arena(sizes_bytes: Sequence[int], align_bytes: int = ALIGN_BYTES,
               min_buffer_bytes: int = MIN_BUFFER_BYTES) -> ArenaLayout:
    """Pack tensors of ``sizes_bytes`` first-fit, in order, into buffers of capacity
    max(min_buffer_bytes, the largest aligned tensor rounded up to a power of two); each buffer
    is then sized to the power of two that holds what it got."""
    aligned = [_align_up(max(0, int(n)), align_bytes) for n in sizes_bytes]
    cap = _pow2_at_least(max([min_buffer_bytes, *aligned]))
    used: list[int] = []
    where: list[Placement] = []
    for n, a in zip(sizes_bytes, aligned):
        k = next((i for i, u in enumerate(used) if u + a <= cap), len(used))
        if k == len(used):
            used.append(0)
        where.append(Placement(k, used[k], int(n)))
        used[k] += a
    sizes = tuple(_pow2_at_least(max(u, align_bytes)) for u in used)
    return ArenaLayout(buffer_bytes=sizes, placements=tuple(where), align_bytes=align_bytes)


class HostArena:
    """Host tensors of the given shapes and dtypes as views into a few flat buffers.

    >>> arena = HostArena([(p.shape, torch.float32) for p in params], pin_memory=True)
    >>> master = arena.views  # one tensor per request, in order

    ``requested_bytes`` is exactly what was asked of the (pinned) allocator.
    """

    def __init__(self, specs: Sequence[tuple[torch.Size | Sequence[int], torch.dtype]],
                 pin_memory: bool = False, align_bytes: int = ALIGN_BYTES,
                 min_buffer_bytes: int = MIN_BUFFER_BYTES) -> None:
        shapes = [torch.Size(shape) for shape, _ in specs]
        dtypes = [dtype for _, dtype in specs]
        sizes = [s.numel() * torch.empty((), dtype=d).element_size() for s, d in zip(shapes, dtypes)]
        self.layout = plan_arena(sizes, align_bytes, min_buffer_bytes)
        self.pin_memory = bool(pin_memory)
        self.buffers = [torch.empty(n, dtype=torch.uint8, pin_memory=self.pin_memory)
                        for n in self.layout.buffer_bytes]
        self.views: list[torch.Tensor] = [
            self.buffers[w.buffer][w.offset_bytes:w.offset_bytes + w.nbytes].view(dtype).view(shape)
            for w, shape, dtype in zip(self.layout.placements, shapes, dtypes)]

    @property
    def requested_bytes(self) -> int:
        return self.layout.requested_bytes

    @property
    def pinned_bytes(self) -> int:
        """Bytes pinned for this arena (0 when not pinned)."""
        return self.layout.requested_bytes if self.pin_memory else 0
