"""What a worker's cheaper slot write is worth (session 34): tpkit's loader as it is against the
same loader with the worker's write as session 33 left it, switched block by block inside one
loader, on the tiny workload of ``benchmarks/loader.py`` (64 samples of 8 floats and an int a
batch, 2 workers).

What changed, all in the worker, for every batch it makes:

- a slot keeps the layout of its last batch (``WorkerRing._plan``): the next batch of the same
  skeleton, leaf types, dtypes and shapes is copied straight to the same places, with no
  offsets, views or skeleton to make again;
- ``flatten`` tests the usual containers by exact type first, and builds the text of a place
  in the batch only for an error message (it made one f-string per node of every batch);
- one switch of torch's grad mode around the copies, where each stack entered and left a
  ``no_grad`` context (~2 us);
- a batch's Python ints and floats become a tensor viewing numpy's array, copied into the
  slot right after, where they were first copied into memory of torch's own.

The peer (``Before``) is session 33's code of those four, rebuilt here. The worker reads which
one to run from a flag in shared memory (inherited when the loader forks it, read at every
batch, by both versions alike), so one loader runs both, in turns (``loader_blocks.py``: > 1,
the current one is faster). Printed: the median of the cycles' ratios with its 95% bootstrap
interval, with the main process helping (the default) and waiting. A warm loop in one process
(best of 7, the same batch) prints each version's write alone too.

    python benchmarks/loader_write.py [--cycles 300] [--block 150]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from loader_blocks import best_us, block_args, compare, worker_switch  # noqa: E402

from tpkit.data import collate, slots  # noqa: E402
from tpkit.data.collate import Stack  # noqa: E402


class Before:
    """The worker's write as session 33 left it (the peer)."""

    @staticmethod
    def flatten(obj: Any, leaves: list, where: str = "batch") -> Any:
        if isinstance(obj, Stack):
            leaves.append(obj)
            return (slots.LEAF, len(leaves) - 1)
        if isinstance(obj, torch.Tensor):
            if obj.device.type != "cpu":
                raise slots.UnsupportedBatchError(f"{where} is a {obj.device.type} tensor")
            if obj.layout != torch.strided or obj.is_quantized or obj.is_nested:
                return slots._pickled(obj, where)
            leaves.append(obj)
            return (slots.LEAF, len(leaves) - 1)
        if isinstance(obj, np.ndarray):
            if obj.dtype.hasobject:
                return slots._pickled(obj, where)
            leaves.append(obj)
            return (slots.LEAF, len(leaves) - 1)
        if isinstance(obj, slots._SCALARS) or isinstance(obj, np.generic):
            return obj
        flatten = Before.flatten
        if isinstance(obj, slots.Mapping):
            return (slots.MAP, slots._BUILTIN_CODES.get(type(obj), type(obj)),
                    [(k, flatten(v, leaves, f"{where}[{k!r}]")) for k, v in obj.items()])
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):
            return (slots.NAMEDTUPLE, type(obj), [flatten(v, leaves, f"{where}.{f}") for f, v in zip(obj._fields, obj)])
        if isinstance(obj, (list, tuple)):
            return (slots.SEQ, slots._BUILTIN_CODES.get(type(obj), type(obj)),
                    [flatten(v, leaves, f"{where}[{i}]") for i, v in enumerate(obj)])
        return slots._pickled(obj, where)

    @staticmethod
    def write(self: Any, slot: int, batch: Any) -> tuple[Any, int, int]:
        leaves: list = []
        skel = Before.flatten(batch, leaves)
        if not leaves:
            return skel, -1, 0
        need = slots.leaf_nbytes(leaves)
        if need > self.slot_bytes:
            self._grow(need)
        base = slot * self.slot_bytes
        off = 0
        specs = []
        for x in leaves:
            off = slots._round_up(off, slots.ALIGN_BYTES)
            if isinstance(x, Stack):
                n = x.nbytes
                if n:
                    with torch.no_grad():
                        torch.stack(x.tensors, out=self._view(slot, off, n, x.dtype, x.shape))
                specs.append((slots.LEAF, "torch", off, n, str(x.dtype)[6:], x.shape))
            elif isinstance(x, torch.Tensor):
                n = x.numel() * x.element_size()
                shape = tuple(x.shape)
                if n:
                    self._view(slot, off, n, x.dtype, shape).copy_(x.detach())
                specs.append((slots.LEAF, "torch", off, n, str(x.dtype)[6:], shape))
            else:
                n = x.nbytes
                arr = self._u8[base + off: base + off + n].numpy()
                if n:
                    arr.view(x.dtype).reshape(x.shape)[...] = x
                specs.append((slots.LEAF, "numpy", off, n, x.dtype.str, tuple(x.shape)))
            off += n
        return slots._respec(skel, specs), self.gen, self.slot_bytes

    @staticmethod
    def ints(batch: list, *, collate_fn_map: Any = None) -> torch.Tensor:
        return collate._collate_ints(batch)  # a copy owned by torch, then copied into the slot

    @staticmethod
    def floats(batch: list, *, collate_fn_map: Any = None) -> torch.Tensor:
        return collate._collate_floats(batch)


def warm_writes() -> None:
    """Each version's collate and write of one tiny batch in a warm loop, best of 7."""
    from tpkit.datasets import TinySamples

    ds = TinySamples(64)
    samples = [ds[i] for i in range(64)]
    prefix = slots.segment_prefix(os.getpid(), 990_100)
    ring = slots.WorkerRing(prefix, 0, 0, 2)
    before_map = {**collate.SLOT_COLLATE_MAP, int: Before.ints, float: Before.floats}

    try:
        ring.write(1, collate.deferred_collate(samples))
        now = best_us(lambda: ring.write(1, collate.deferred_collate(samples)), 3000)
        before = best_us(lambda: Before.write(ring, 1, collate.collate(samples, collate_fn_map=before_map)), 3000)
        stack = best_us(lambda: torch.stack([s[0] for s in samples]), 3000)
    finally:
        ring.close()
        slots.remove_segments(prefix)
    print(f"warm, one process: a tiny batch's deferred collate and slot write {now:.1f} us "
          f"(peer {before:.1f} us; current / peer {now / before:.3f}x); its torch.stack alone {stack:.1f} us")


def main() -> None:
    args = block_args(__doc__)
    warm_writes()
    peer_on, peer, current = worker_switch()
    now_write, now_ints, now_floats = slots.WorkerRing.write, collate._slot_ints, collate._slot_floats

    def write(self: Any, slot: int, batch: Any) -> Any:
        return (Before.write if peer_on.value else now_write)(self, slot, batch)

    def ints(batch: list, *, collate_fn_map: Any = None) -> torch.Tensor:
        return (Before.ints if peer_on.value else now_ints)(batch)

    def floats(batch: list, *, collate_fn_map: Any = None) -> torch.Tensor:
        return (Before.floats if peer_on.value else now_floats)(batch)

    slots.WorkerRing.write = write  # type: ignore[method-assign]
    collate.SLOT_COLLATE_MAP[int], collate.SLOT_COLLATE_MAP[float] = ints, floats

    compare("loader_write", "a worker's slot write as now (current) against as after session 33 (peer)",
            args.cycles, args.block, peer=peer, current=current)


if __name__ == "__main__":
    main()
