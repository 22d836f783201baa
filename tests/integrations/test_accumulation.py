"""Gradient accumulation in plain loops: ``loss / accum`` per micro-batch, one optimizer step
per ``accum`` micro-batches; and a nanoGPT-style loop (``get_batch`` with random ints, no
DataLoader, ``loss / gradient_accumulation_steps``, a disabled GradScaler, clipping).

Truth: the step's loss is what the loop means by it, the mean of its micro-batches' losses
(= the sum of what went through backward); nanoGPT itself prints ``loss.item() * gas`` of the
*last* micro-batch only, an estimate of that mean.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F
import truth
from truth import STEPS, WARMUP

import tpkit as tp

BATCH = 4
ACCUM = 2


@pytest.fixture(scope="module")
def plain():
    torch.manual_seed(0)
    model = truth.SleepyNet()
    opt = truth.SleepySGD(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(truth.Regression(), batch_size=BATCH, collate_fn=truth.sleepy_collate)
    micro = []
    before = truth.hook_state()
    with tp.profile(steps=STEPS, warmup=WARMUP, name="accum", progress=False, clock_hz=0) as prof, \
            truth.TRUTH.recording():
        for i, (x, y) in enumerate(loader, start=1):
            loss = F.mse_loss(model(x), y)
            micro.append(loss.item())
            (loss / ACCUM).backward()
            if i % ACCUM == 0:
                opt.step()
                opt.zero_grad()
    steps = [sum(micro[i:i + ACCUM]) / ACCUM for i in range(0, len(micro), ACCUM)]
    return dict(run=prof.run, before=before, micro=micro, step_losses=steps, truth=truth.snapshot())


def test_accumulation_steps_phases_and_hooks(plain):
    run = plain["run"]
    truth.assert_hooks_removed(plain["before"])
    assert len(run.steps) == STEPS + WARMUP and len(plain["micro"]) == ACCUM * (STEPS + WARMUP)
    assert (run.steps["samples"] == ACCUM * BATCH).all()
    truth.assert_phases(run, plain["truth"])


def test_accumulation_loss_is_the_steps_loss(plain):
    truth.assert_losses(plain["run"].steps["loss"].tolist(), plain["step_losses"])


# -- nanoGPT ------------------------------------------------------------------------------
def get_batch(data: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """nanoGPT's get_batch: random windows of a token stream. (B, T), (B, T)."""
    ix = torch.randint(len(data) - truth.SEQ, (BATCH,), generator=gen)
    x = torch.stack([data[i:i + truth.SEQ] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + truth.SEQ] for i in ix])
    return x, y


@pytest.fixture(scope="module")
def nanogpt():
    torch.manual_seed(0)
    data = torch.randint(0, truth.VOCAB, (10_000,), generator=torch.Generator().manual_seed(1))
    gen = torch.Generator().manual_seed(2)
    model = truth.NanoGPT()
    optimizer = truth.SleepyAdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", enabled=False)  # nanoGPT: enabled only for float16
    ctx = nullcontext()  # nanoGPT on the CPU
    gas, grad_clip = ACCUM, 1.0
    micro, printed = [], []
    before = truth.hook_state()
    with tp.profile(steps=STEPS, warmup=WARMUP, name="nanogpt", progress=False, clock_hz=0) as prof, \
            truth.TRUTH.recording():
        X, Y = get_batch(data, gen)
        for _iter_num in range(100):
            for _micro_step in range(gas):
                with ctx:
                    logits, loss = model(X, Y)
                    micro.append(loss.item())
                    loss = loss / gas
                X, Y = get_batch(data, gen)
                scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            printed.append(loss.item() * gas)
    steps = [sum(micro[i:i + gas]) / gas for i in range(0, len(micro), gas)]
    return dict(run=prof.run, before=before, micro=micro, step_losses=steps, truth=truth.snapshot(),
                model=model)


def test_nanogpt_steps_phases_and_hooks(nanogpt):
    run = nanogpt["run"]
    truth.assert_hooks_removed(nanogpt["before"])
    assert len(run.steps) == STEPS + WARMUP and len(nanogpt["micro"]) == ACCUM * (STEPS + WARMUP)
    truth.assert_phases(run, nanogpt["truth"], phases=("forward", "backward", "optimizer"))
    assert run.meta["model"]["parameters"] == sum(p.numel() for p in nanogpt["model"].parameters())


def test_nanogpt_loss_is_the_steps_loss(nanogpt):
    truth.assert_losses(nanogpt["run"].steps["loss"].tolist(), nanogpt["step_losses"])


def test_a_shorter_last_window_keeps_what_went_through_backward_and_says_what_it_is():
    """Ten batches an epoch, an update every third and one at the epoch's end: the fourth step
    has one micro-batch where the others have three. The loop divides by 3 whatever the window,
    as loops of their own usually do; tpkit cannot tell that from a loop dividing by the window's
    own count, so the step's loss stays the sum that went through backward, and the run says how
    that sum relates to the window's mean either way. Full windows get no such note (``plain``)."""
    torch.manual_seed(0)
    model = truth.SleepyNet()
    opt = truth.SleepySGD(model.parameters(), lr=0.01)
    data = torch.utils.data.Subset(truth.Regression(), range(10 * BATCH))
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, collate_fn=truth.sleepy_collate)
    through_backward: list[float] = []
    window = 0.0
    with tp.profile(steps=STEPS, warmup=WARMUP, name="accum-short", progress=False, clock_hz=0) as prof:
        while True:
            for i, (x, y) in enumerate(loader, start=1):
                loss = F.mse_loss(model(x), y) / 3
                window += loss.item()
                loss.backward()
                if i % 3 == 0 or i == len(loader):
                    opt.step()
                    opt.zero_grad()
                    through_backward.append(window)
                    window = 0.0
    run = prof.run
    assert run.steps["samples"].tolist()[:5] == [3 * BATCH, 3 * BATCH, 3 * BATCH, BATCH, 3 * BATCH]
    truth.assert_losses(run.steps["loss"].tolist(), through_backward[:STEPS + WARMUP])
    said = [n for n in run.meta["notes"] if "fewer micro-batches" in n]
    assert len(said) == 1 and said[0].startswith("1 step(s) had fewer micro-batches (1) than most steps' 3")


def test_full_windows_get_no_note_on_micro_batches(plain):
    assert not any("micro-batches" in n for n in plain["run"].meta["notes"])
