"""One rank of a small DDP launch on gloo (tests/ranks/test_ranks_launches.py, test_ranks_faults.py).
argv: where each rank saves its run, the mode, and for "job" the slice's name.

- ``job NAME``: 6 measured steps after 1 warmup, every rank alike (a launch; run twice into one
  folder with different sizes, a rerun).
- ``uneven``: the last rank has 5 batches, the others 9, no ``Join``: the others' all-reduce after
  the last rank's loop ended fails (a closed connection).
- ``two_late``: 3 ranks; rank 1 sleeps ``LATE_S[1]`` before each batch (its own code, before DDP's
  all-reduce), rank 0 ``LATE_S[0]`` after each step, before an all_gather of the loss.
- ``hang``: the last rank sleeps ``HANG_S`` in its own code (no collective) at iteration 3; the
  others block in DDP's all-reduce waiting for it (``TPKIT_RANK_TIMEOUT_S`` set by the test).

Each rank writes the losses its loop computed (``loss.item()``, what DDP logs per rank) to
``<save dir>/loss<rank>.json``: the tests' truth.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import tpkit as tp

HANG_S = 8.0
LATE_S = {0: 0.030, 1: 0.040}  # two_late: rank -> its sleep

out, mode = sys.argv[1], sys.argv[2]
os.makedirs(out, exist_ok=True)
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
last = world - 1
torch.manual_seed(0)
ddp = nn.parallel.DistributedDataParallel(nn.Linear(16, 1))
opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
g = torch.Generator().manual_seed(rank + 10 * world)
n = 5 if (mode == "uneven" and rank == last) else 14 if mode == "two_late" else 9
data = [(torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)) for _ in range(n)]
steps = 12 if mode == "two_late" else 6
name = sys.argv[3] if mode == "job" else mode
losses: list[float] = []
try:
    with tp.profile(steps=steps, warmup=2 if mode == "two_late" else 1, name=name, progress=False, clock_hz=0, memory=False, save_dir=out):
        for i, (x, y) in enumerate(data):
            if mode == "hang" and rank == last and i == 3:
                time.sleep(HANG_S)  # the hang: this rank's own code
            if mode == "two_late" and rank == 1:
                time.sleep(LATE_S[1])
            loss = nn.functional.mse_loss(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            losses.append(loss.item())
            opt.step()
            if mode == "two_late":
                if rank == 0:
                    time.sleep(LATE_S[0])
                dist.all_gather([torch.zeros(1) for _ in range(world)], loss.detach().reshape(1))
except BaseException as e:  # noqa: BLE001 - the watchdog's KeyboardInterrupt included
    print(f"rank {rank}: {type(e).__name__}: {str(e)[:600]}", flush=True)
    with open(os.path.join(out, f"loss{rank}.json"), "w") as f:
        json.dump(losses, f)
    os._exit(2)  # a broken process group can hang at interpreter exit
with open(os.path.join(out, f"loss{rank}.json"), "w") as f:
    json.dump(losses, f)
dist.destroy_process_group()
