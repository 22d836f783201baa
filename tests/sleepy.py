"""A training setup whose phases take known times: ground truth for the phase probes."""

from __future__ import annotations

import time

import torch
from torch.utils.data import Dataset

FORWARD_S = 0.030
BACKWARD_S = 0.025
OPTIMIZER_S = 0.015
SAMPLE_S = 0.010  # per sample in __getitem__
BATCH = 2


class SleepBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # noqa: ANN001
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001
        time.sleep(BACKWARD_S)
        return g


class SleepyModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(FORWARD_S)
        return SleepBackward.apply(self.lin(x)).pow(2).mean()


class SleepySGD(torch.optim.SGD):
    def step(self, closure=None):  # noqa: ANN001
        time.sleep(OPTIMIZER_S)
        return super().step(closure)


class SleepyData(Dataset):
    def __len__(self) -> int:
        return 10_000

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(SAMPLE_S)
        return torch.full((4,), float(i % 7))


def make():
    torch.manual_seed(0)
    model = SleepyModel()
    loader = torch.utils.data.DataLoader(SleepyData(), batch_size=BATCH)
    opt = SleepySGD(model.parameters(), lr=0.01)
    return model, loader, opt


def registries() -> dict:
    """Sizes and identities of every global torch place tpkit hooks into."""
    import torch.nn.modules.module as mm
    import torch.optim.optimizer as oo
    import torch.utils.data.dataloader as dl

    return {
        "fwd_pre": len(mm._global_forward_pre_hooks),
        "fwd": len(mm._global_forward_hooks),
        "fwd_always": len(mm._global_forward_hooks_always_called),
        "opt_pre": len(oo._global_optimizer_pre_hooks),
        "opt_post": len(oo._global_optimizer_post_hooks),
        "backward": torch.autograd.backward,
        "to": torch.Tensor.__dict__.get("to"),
        "cuda": torch.Tensor.__dict__.get("cuda"),
        "opt_zero": torch.optim.Optimizer.__dict__["zero_grad"],
        "mod_zero": torch.nn.Module.__dict__["zero_grad"],
        "next": dl._BaseDataLoaderIter.__dict__["__next__"],
        "iter": dl.DataLoader.__dict__["__iter__"],
        "save": torch.save,
    }


class SlowLinear(torch.nn.Linear):
    """A Linear whose forward sleeps 20 ms (the loops of ``tail_run`` and ``gap_run``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.02)
        return super().forward(x)


def tail_run(named: bool) -> tuple:
    """A slice (4 steps + 1 warmup) with known sleeps: a forward of 20 ms, and 60 ms after each
    optimizer.step() (a logger), inside ``tp.phase("logging")`` or not. Returns the run and the
    loop's own clock around that code."""
    import tpkit as tp

    model = SlowLinear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(torch.randn(64, 4), batch_size=4)
    tail: list[float] = []
    with tp.profile(steps=4, warmup=1, progress=False, clock_hz=0, memory=False) as prof:
        for x in loader:
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
            t = time.perf_counter()
            if named:
                with tp.phase("logging"):
                    time.sleep(0.06)
            else:
                time.sleep(0.06)
            tail.append(time.perf_counter() - t)
    return prof.run, tail


def gap_run(order: str) -> tuple:
    """A slice (4 steps + 1 warmup) with a 20 ms forward and 50 ms of the loop's own code at a
    known place, timed by the loop's clock (returned with the run):

    - ``"zero_grad_top"``: ``zero_grad()`` first in the loop, then 50 ms of batch prep, then the
      forward (the truth: after the batch is read, before the forward);
    - ``"log_before_zero_grad"``: 50 ms of logging between ``optimizer.step()`` and ``zero_grad()``
      (the loop's tail);
    - ``"train_step"``: ``tp.phase("train")`` around the loop and ``tp.phase("train_step")`` around
      30 ms of prep (timed), the forward, 50 ms between forward and backward (timed second),
      backward and the update;
    - ``"get_batch"``: no loader: ``get_batch()`` sleeps 50 ms at the loop's top;
    - ``"phase_gc"``: 50 ms after the update inside the user's own ``tp.phase("gc")``."""
    import contextlib

    import tpkit as tp

    model = SlowLinear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(torch.randn(64, 4), batch_size=4)
    clock: list[list[float]] = [[], []]

    def timed(i: int, s: float) -> None:
        t = time.perf_counter()
        time.sleep(s)
        clock[i].append(time.perf_counter() - t)

    def get_batch() -> torch.Tensor:
        timed(0, 0.05)
        return torch.randn(4, 4)

    with tp.profile(steps=4, warmup=1, progress=False, clock_hz=0, memory=False) as prof:
        outer = tp.phase("train") if order == "train_step" else contextlib.nullcontext()
        with outer:
            for x in (loader if order != "get_batch" else (get_batch() for _ in range(20))):
                if order == "zero_grad_top":
                    opt.zero_grad()
                    timed(0, 0.05)
                    model(x).sum().backward()
                    opt.step()
                elif order == "log_before_zero_grad":
                    model(x).sum().backward()
                    opt.step()
                    timed(0, 0.05)
                    opt.zero_grad()
                elif order == "train_step":
                    with tp.phase("train_step"):
                        timed(0, 0.03)
                        out = model(x).sum()
                        timed(1, 0.05)
                        out.backward()
                        opt.step()
                        opt.zero_grad()
                elif order == "phase_gc":
                    model(x).sum().backward()
                    opt.step()
                    opt.zero_grad()
                    with tp.phase("gc"):
                        timed(0, 0.05)
                else:
                    model(x).sum().backward()
                    opt.step()
                    opt.zero_grad()
    return prof.run, clock
