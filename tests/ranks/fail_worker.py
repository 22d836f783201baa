"""One of two DDP ranks raises at its 4th step; the other, waiting in the all-reduce, gets
gloo's error when the first exits, and torchrun stops it with SIGTERM at that moment. argv:
where each rank saves its run. Used by ``test_ranks_faults.py``."""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

import tpkit as tp

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
with tp.profile(steps=5, warmup=2, name="fails", progress=False, clock_hz=0, save_dir=sys.argv[1]):
    for i in range(100):
        if rank == 1 and i == 4:
            raise RuntimeError("rank 1 fails at step 4")
        time.sleep(0.03)
        model(torch.randn(8, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
