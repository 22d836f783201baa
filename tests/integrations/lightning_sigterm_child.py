"""Lightning's ``fit`` receiving SIGTERM at its 4th step, under ``tp.profile`` or not; used by
``test_lightning.py`` in a process of its own. argv: "tpkit" or "plain", the store folder.
Lightning installs its own SIGTERM handler at fit (over tpkit's): it ends the fit its own way,
and with tpkit the slice keeps the run."""

from __future__ import annotations

import contextlib
import os
import signal
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
import lightning.pytorch as pl  # noqa: E402
import truth  # noqa: E402

import tpkit as tp  # noqa: E402

mode, store = sys.argv[1], sys.argv[2]
tp.set_store(store)


class Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = truth.SleepyNet()

    def training_step(self, batch, _):  # noqa: ANN001, ANN201
        if self.global_step == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return F.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.SGD(self.parameters(), lr=0.01)


trainer = pl.Trainer(max_steps=40, accelerator="cpu", logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False)
profile = tp.profile(steps=20, warmup=1, name="pl-sigterm", progress=False, clock_hz=0) if mode == "tpkit" \
    else contextlib.nullcontext()
with profile:
    trainer.fit(Module(), torch.utils.data.DataLoader(truth.Regression(), batch_size=8))
print("after fit", flush=True)
