"""One rank of a training whose process group is created inside the slice, as Lightning's
``fit()`` and accelerate's ``prepare()`` create theirs (tests/ranks/test_ranks_late_group.py).

    python -m torch.distributed.run --nproc-per-node 2 tests/ranks/late_group_worker.py OUT MODE

MODE ``wrapped``: the loop calls ``torch.distributed.init_process_group`` inside ``tp.profile``;
``alias``: it calls the same function through a name it imported before the slice (tpkit cannot
wrap that one); ``lightning``: ``Trainer(strategy="ddp", accelerator="cpu", devices=2).fit`` under
torchrun. Rank 1 sleeps DELAY_S in every forward; every rank's Run lands in ``OUT/rank<k>``.
"""

from __future__ import annotations

import faulthandler
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed import init_process_group as start_group  # before any slice
from train_worker import Delay  # (this folder: torchrun runs the script from it)

import tpkit as tp

DELAY_S = 0.1
STEPS, WARMUP = 4, 1


def net(rank: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(Delay(DELAY_S if rank == 1 else 0.0), torch.nn.Linear(16, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 4))


def batches(rank: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(rank)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(n)]


def plain_loop(mode: str, rank: int) -> None:
    if mode == "wrapped":
        dist.init_process_group("gloo")
    else:
        start_group("gloo")
    model = torch.nn.parallel.DistributedDataParallel(net(rank))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for x, y in batches(rank, STEPS + WARMUP + 4):
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def lightning_fit(rank: int) -> None:
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net(rank)

        def training_step(self, batch, _):  # noqa: ANN001, ANN201
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self):  # noqa: ANN201
            return torch.optim.SGD(self.parameters(), lr=0.05)

    data = torch.utils.data.TensorDataset(torch.randn(256, 16), torch.randn(256, 4))
    trainer = L.Trainer(strategy="ddp", accelerator="cpu", devices=2, max_steps=40, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0)
    trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=8))
    assert trainer.global_step == STEPS + WARMUP, trainer.global_step


def main() -> None:
    faulthandler.dump_traceback_later(240, exit=True)
    out, mode = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    with tp.profile(steps=STEPS, warmup=WARMUP, name=mode, progress=False, clocks=False, memory=False,
                    save_dir=out):
        if mode == "lightning":
            lightning_fit(rank)
        else:
            plain_loop(mode, rank)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
