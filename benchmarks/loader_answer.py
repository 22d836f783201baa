"""What pickling a worker's skeleton once is worth (session 34): a worker answers every batch
with a small tuple that carries the batch's skeleton (where each tensor lies in the slot) as
pickle bytes of its own. Since a slot keeps the layout of its last batch (session 34,
``loader_write.py``), a batch of the same layout sends the same skeleton object again, and
``worker_loop.done_to_wire`` now pickles a skeleton object once (held by identity; session 28
measured such a reuse at +1.3% [0.4-1.9], but had no safe key for it then).

tpkit's loader as it is against the same loader with ``done_to_wire`` pickling the skeleton
every time (as before), switched block by block inside one loader on the tiny workload of
``benchmarks/loader.py`` (64 samples of 8 floats and an int a batch, 2 workers): the worker reads
which one to run from a flag in shared memory, inherited when the loader forks it
(``loader_blocks.py``: > 1, the current one is faster).

    python benchmarks/loader_answer.py [--cycles 300] [--block 150]
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from loader_blocks import block_args, compare, worker_switch  # noqa: E402

from tpkit.data import worker_loop  # noqa: E402


def before_done_to_wire(done: Any) -> bytes:
    """``worker_loop.done_to_wire`` before session 34: the skeleton pickled for every batch."""
    return pickle.dumps((*done[:4], pickle.dumps(done.skeleton, pickle.HIGHEST_PROTOCOL), *done[5:]),
                        pickle.HIGHEST_PROTOCOL)


def main() -> None:
    args = block_args(__doc__)
    peer_on, peer, current = worker_switch()
    now = worker_loop.done_to_wire

    def done_to_wire(done: Any) -> bytes:
        return (before_done_to_wire if peer_on.value else now)(done)

    worker_loop.done_to_wire = done_to_wire

    compare("loader_answer", "a worker's skeleton pickled once (current) against for every batch (peer)",
            args.cycles, args.block, peer=peer, current=current)


if __name__ == "__main__":
    main()
