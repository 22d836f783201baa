"""One rank of a DDP loop with uneven inputs under ``model.join()`` (tests/ranks/test_ranks_join.py).

    python -m torch.distributed.run --nproc-per-node 2 tests/ranks/join_worker.py OUT

Rank 1 has SHORT batches, rank 0 LONG; the slice (STEPS + WARMUP) is longer than rank 1's
data, so rank 1 joins early and stands in for rank 0's all-reduces until rank 0 is done. Each
rank prints how many batches it trained and whether tpkit's hooks were out as Join exited.
"""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join
from torch.optim.optimizer import _global_optimizer_pre_hooks

import tpkit as tp

SHORT, LONG, STEPS, WARMUP = 4, 12, 5, 1


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    enter = Join.__dict__["__enter__"]
    trained = 0
    hooks_out = None
    with tp.profile(steps=STEPS, warmup=WARMUP, name="join", progress=False, clock_hz=0, save_dir=out):
        with model.join():
            for _ in range(LONG if rank == 0 else SHORT):
                model(torch.randn(4, 8)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
                trained += 1
        hooks_out = Join.__dict__["__enter__"] is enter and not _global_optimizer_pre_hooks
    dist.barrier()  # every rank's collectives matched: none is left waiting
    print(f"rank {rank}: trained {trained}, hooks out after Join: {hooks_out}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
