"""What the main process's cheaper slot read is worth (session 34): each tensor or array of a
batch handed out from a worker's slot is now one numpy array made straight over the slot's
buffer (``np.ndarray(shape, dtype, buffer, offset)``), where it was a slice of the lease, a
dtype view and a reshape; and a batch handed out as a copy reads the mapping itself, with no
lease array made for it.

tpkit's loader as it is against the same loader with ``read_slot`` as session 33 left it
(``before_read_slot``, rebuilt here), switched block by block inside one loader on the tiny
workload of ``benchmarks/loader.py`` (64 samples of 8 floats and an int a batch, 2 workers):
the pool looks ``read_slot`` up in its module at every batch (``loader_blocks.py``: > 1, the
current one is faster). A warm loop (best of 7, one tiny batch in a slot) prints each version
alone, as a view and as a copy.

    python benchmarks/loader_read.py [--cycles 300] [--block 150]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from loader_blocks import best_us, block_args, compare  # noqa: E402

from tpkit.data import process_pool, slots  # noqa: E402


def before_read_slot(mm: Any, slot: int, slot_bytes: int, skel: Any, copy: bool,
                     on_release: Callable[[Any], Any] | None) -> Any:
    """``slots.read_slot`` as session 33 left it (the peer)."""
    if mm is None:
        return slots.unflatten(skel, slots._no_leaf)
    lease = np.frombuffer(mm, dtype=np.uint8, count=slot_bytes, offset=slot * slot_bytes)

    def make(node: tuple) -> Any:
        _, kind, off, n, dtype, shape = node
        raw = lease[off: off + n]
        if kind == "torch":
            twin = slots._numpy_twin(dtype)
            if twin is not None:
                t = torch.from_numpy(raw.view(twin).reshape(shape))
            else:
                t = torch.from_numpy(raw).view(slots._torch_dtype(dtype)).view(shape)
            return t.clone() if copy else t
        a = raw.view(np.dtype(dtype)).reshape(shape)
        return a.copy() if copy else a

    batch = slots.unflatten(skel, make)
    if not copy and on_release is not None:
        on_release(lease)
    return batch


def warm_reads() -> None:
    from tpkit.data.collate import deferred_collate
    from tpkit.datasets import TinySamples

    ds = TinySamples(64)
    prefix = slots.segment_prefix(os.getpid(), 990_101)
    ring = slots.WorkerRing(prefix, 0, 0, 2)
    try:
        skel, _, slot_bytes = ring.write(1, deferred_collate([ds[i] for i in range(64)]))
        mm = ring._mm

        def best(read: Any, copy: bool) -> float:
            return best_us(lambda: read(mm, 1, slot_bytes, skel, copy, None), 5000)

        for label, copy in (("view", False), ("copy", True)):
            now, before = best(slots.read_slot, copy), best(before_read_slot, copy)
            print(f"warm, one process: a tiny batch read from its slot as a {label} {now:.2f} us "
                  f"(peer {before:.2f} us; current / peer {now / before:.3f}x)")
    finally:
        ring.close()
        slots.remove_segments(prefix)


def main() -> None:
    args = block_args(__doc__)
    warm_reads()
    now = process_pool.read_slot

    def peer() -> None:
        process_pool.read_slot = before_read_slot

    def current() -> None:
        process_pool.read_slot = now

    compare("loader_read", "the main process's slot read as now (current) against as after session 33 (peer)",
            args.cycles, args.block, peer=peer, current=current)


if __name__ == "__main__":
    main()
