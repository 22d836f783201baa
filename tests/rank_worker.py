"""One rank of the 2-rank tests in test_offload_ranks.py (run as a subprocess with RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT set, like torchrun does).

mode "skew": no collective inside the loop; rank 1 sleeps 20 ms more per step.
mode "die": an all_reduce every step; rank 1 exits abruptly at its 4th step, so rank 0's
collective fails (peer gone) or times out, and its slice ends in an error.
mode "hang": as "die", but rank 1 first hangs for HANG_S (alive, so gloo sees nothing): rank 0's
watchdog (TPKIT_RANK_TIMEOUT_S) must save its partial Run while the collective still blocks.
"""

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

import tpkit as tp

EXTRA_S = 0.02
HANG_S = 8.0


def main() -> None:
    out, mode = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(os.environ.get("TP_TIMEOUT_S", "15"))))
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    k = 0

    def step() -> None:
        nonlocal k
        if mode in ("die", "hang") and rank == 1 and k == 3:
            if mode == "hang":
                time.sleep(HANG_S)
            os._exit(3)  # no cleanup, like a crash
        k += 1
        time.sleep(0.005 + (EXTRA_S if rank == 1 else 0.0))
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        if mode in ("die", "hang"):
            for p in model.parameters():
                dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad()

    try:
        tp.profile_fn(step, steps=6, warmup=1, name="ranks", progress=False, clocks=False, memory=False,
                      save_dir=out)
    except BaseException as e:  # the watchdog's KeyboardInterrupt included
        print(f"rank {rank}: slice failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        os._exit(2)  # a broken process group can hang at interpreter exit
    if mode == "skew":
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
