"""What sending a small-batch worker its tasks several to a message is worth: tpkit's loader with
``REFILL_TASKS`` tasks a message against the same loader with one task a message (as before
session 27), switched block by block inside one loader, on the tiny workload of
``benchmarks/loader.py`` (64 samples of 8 floats and an int a batch, 2 workers).

``tpkit.data.process_pool.REFILL_TASKS`` is read at every dispatch, so one loader runs both,
in turns (``loader_blocks.py``: > 1, refilling is faster). Printed: the median of the cycles'
ratios with its 95% bootstrap interval, with the main process helping (the default) and
waiting.

    python benchmarks/loader_refill.py [--cycles 300] [--block 150]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from loader_blocks import block_args, compare  # noqa: E402


def main() -> None:
    args = block_args(__doc__)
    import tpkit.data.process_pool as pool

    refill = pool.REFILL_TASKS

    def one_task() -> None:
        pool.REFILL_TASKS = 1

    def refilled() -> None:
        pool.REFILL_TASKS = refill

    compare("loader_refill", f"REFILL_TASKS = {refill} (current) against 1 (peer)", args.cycles, args.block,
            peer=one_task, current=refilled)


if __name__ == "__main__":
    main()
