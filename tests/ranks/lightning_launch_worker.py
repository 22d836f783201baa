"""A Lightning fit on 2 CPU ranks that Lightning launches itself, started by plain ``python`` (no
torchrun) under ``tp.profile`` (tests/ranks/test_ranks_lightning_launch.py).

    python tests/ranks/lightning_launch_worker.py OUT STRATEGY WARMUP

STRATEGY ``ddp``: Lightning runs this script again for rank 1 and makes the process group inside
``fit``; ``ddp_spawn`` / ``ddp_fork``: it trains in worker processes it starts, this one waiting.
WARMUP: a number, or ``auto``. Rank 1 sleeps 0 / 60 ms in turn before its first optimizer steps (step
times that settle later there than on rank 0). Every process that trains writes
``OUT/trained_<rank>_<pid>.json`` (its ``global_step``, the losses ``training_step`` returned);
every process that profiled writes ``OUT/run_<pid>.json`` (its run's steps, warmup and notes).
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import time
from pathlib import Path

import lightning as L
import torch

import tpkit as tp

MAX_STEPS = 12
STEPS = 2
JITTER_S = 0.06


class Module(L.LightningModule):
    def __init__(self, out: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        self.out = out
        self.losses: list[float] = []

    def training_step(self, batch, _):  # noqa: ANN001, ANN201
        loss = torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
        self.losses.append(float(loss))
        return loss

    def on_before_optimizer_step(self, optimizer) -> None:  # noqa: ANN001
        if self.global_rank == 1 and self.global_step < 9 and self.global_step % 2 == 1:
            time.sleep(JITTER_S)

    def on_train_end(self) -> None:
        facts = {"rank": self.global_rank, "global_step": self.trainer.global_step, "losses": self.losses,
                 "tpkit_in": _tpkit_in()}
        Path(self.out, f"trained_{self.global_rank}_{os.getpid()}.json").write_text(json.dumps(facts))

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _tpkit_in() -> list[str]:
    """What of tpkit's is in this process now: where the training is forked from the profiling
    process (``ddp_fork``), its probes' copies that stayed in the training (none now)."""
    from tpkit.capture import recorder
    from tpkit.capture.probes import comm, patching

    left = [f"{getattr(owner, '__name__', owner)}.{attr}" for owner, attr in patching.in_place()]
    if getattr(torch.nn.Module.__call__, "__module__", None) != "torch.nn.modules.module":
        left.append("nn.Module.__call__ route")
    if recorder.active() is not None:
        left.append("a Recorder")
    if comm._ACTIVE is not None:
        left.append("the comm probe")
    return left


def main() -> None:
    faulthandler.dump_traceback_later(120, exit=True)
    out, strategy, warmup = sys.argv[1], sys.argv[2], sys.argv[3]
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(512, 8, generator=g), torch.randn(512, 1, generator=g))
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=MAX_STEPS, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0)
    with tp.profile(steps=STEPS, warmup=warmup if warmup == "auto" else int(warmup), name=strategy,
                    progress=False, clock_hz=0, memory=False) as prof:
        trainer.fit(Module(out), torch.utils.data.DataLoader(data, batch_size=8))
    run = prof.run
    facts = {"steps": len(run.steps), "warmup": int(run.steps["warmup"].sum()), "notes": run.meta["notes"],
             "global_step": trainer.global_step}
    Path(out, f"run_{os.getpid()}.json").write_text(json.dumps(facts))


if __name__ == "__main__":
    main()
