"""A Hugging Face ``accelerate`` loop profiled unchanged: ``Accelerator`` on the CPU,
``prepare``, ``accelerator.accumulate``, ``accelerator.backward`` (which divides the loss by
the accumulation count before backward).

Truth: the self-timed parts of ``truth``, the loop's own losses (the step's loss is the mean
of its micro-batches' losses: the sum of what ``accelerator.backward`` backpropagates), and
the number of updates the optimizer made.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import truth
from truth import STEPS, WARMUP

import tpkit as tp

accelerate = pytest.importorskip("accelerate")
from accelerate.state import AcceleratorState  # noqa: E402

BATCH = 4


def run_loop(ga: int, mixed_precision: str = "no") -> dict:
    torch.manual_seed(0)
    AcceleratorState._reset_state(reset_partial_state=True)  # a process-wide singleton: new settings per loop
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=ga, mixed_precision=mixed_precision)
    model = truth.SleepyNet()
    opt = truth.SleepySGD(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(truth.Regression(), batch_size=BATCH, collate_fn=truth.sleepy_collate)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    micro_losses: list[float] = []
    before = truth.hook_state()
    with tp.profile(steps=STEPS, warmup=WARMUP, name=f"accelerate-ga{ga}", progress=False, clock_hz=0) as prof, \
            truth.TRUTH.recording():
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = F.mse_loss(model(x).float(), y)
                micro_losses.append(loss.item())
                accelerator.backward(loss)
                opt.step()
                opt.zero_grad()
    step_losses = [sum(micro_losses[i:i + ga]) / ga for i in range(0, len(micro_losses), ga)]
    return dict(run=prof.run, before=before, micro=micro_losses, step_losses=step_losses,
                truth=truth.snapshot())


@pytest.fixture(scope="module", params=[1, 2], ids=["ga1", "ga2"])
def sliced(request):
    return dict(ga=request.param, **run_loop(request.param))


def test_loop_runs_and_hooks_are_removed(sliced):
    truth.assert_hooks_removed(sliced["before"])
    run, ga = sliced["run"], sliced["ga"]
    assert len(run.steps) == STEPS + WARMUP and run.complete
    assert len(sliced["micro"]) == ga * (STEPS + WARMUP)  # stopped right after the 7th update
    assert sliced["truth"].calls["optimizer"] == STEPS + WARMUP  # updates the optimizer made
    assert (run.steps[~run.steps["warmup"]]["samples"] == BATCH * ga).all()


def test_samples_are_the_batches_trained_on(sliced):
    assert (sliced["run"].steps["samples"] == BATCH * sliced["ga"]).all()


def test_phases_match_the_truth(sliced):
    truth.assert_phases(sliced["run"], sliced["truth"])


def test_loss_is_the_steps_loss(sliced, request):
    truth.assert_losses(sliced["run"].steps["loss"].tolist(), sliced["step_losses"])


def test_bf16_mixed_precision_loss_and_phases():
    """``mixed_precision="bf16"``: autocast on the CPU; the loss recorded is the loop's."""
    out = run_loop(1, mixed_precision="bf16")
    truth.assert_hooks_removed(out["before"])
    truth.assert_losses(out["run"].steps["loss"].tolist(), out["step_losses"])
    truth.assert_phases(out["run"], out["truth"])


def test_loss_of_an_epochs_last_partial_accumulation_window():
    """Three batches an epoch with ``gradient_accumulation_steps=2``: every second step is one
    micro-batch, which ``accelerator.backward`` still divides by 2. The step's loss is the
    window's mean loss (what the loop logs), not half of it, and the run says why."""
    torch.manual_seed(0)
    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = truth.SleepyNet()
    opt = truth.SleepySGD(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(torch.utils.data.Subset(truth.Regression(), range(3 * BATCH)),
                                         batch_size=BATCH, collate_fn=truth.sleepy_collate)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    windows: list[list[float]] = [[]]
    with tp.profile(steps=STEPS, warmup=WARMUP, name="accelerate-partial", progress=False, clock_hz=0) as prof:
        for _ in range(STEPS + WARMUP):  # epochs
            for x, y in loader:
                with accelerator.accumulate(model):
                    loss = F.mse_loss(model(x).float(), y)
                    windows[-1].append(loss.item())
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        windows.append([])
                    opt.step()  # the slice ends inside the last update
                    opt.zero_grad()
    AcceleratorState._reset_state(reset_partial_state=True)
    run = prof.run
    assert [len(w) for w in windows[:STEPS + WARMUP]] == [2, 1, 2, 1, 2, 1, 2]
    truth.assert_losses(run.steps["loss"].tolist(), [sum(w) / len(w) for w in windows[:STEPS + WARMUP]])
    assert any(n.startswith("3 step(s) had fewer micro-batches than the 2 that accelerator.backward") for n in
               run.meta["notes"]), run.meta["notes"]


def test_a_prepared_loader_that_ends_at_the_slices_last_step_ends_its_loop():
    """A prepared loader whose last batch is the slice's last step: the loop ends by itself and
    the code after it runs (accelerate reads one batch ahead, so it knows its last batch; the
    stop had come at the read that ends the epoch). A loop of epochs is still stopped at its
    next epoch's first read."""
    for epochs in (1, 3):
        torch.manual_seed(0)
        AcceleratorState._reset_state(reset_partial_state=True)
        accelerator = accelerate.Accelerator(cpu=True)
        model = torch.nn.Linear(8, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        data = torch.utils.data.TensorDataset(torch.randn(8 * (WARMUP + STEPS), 8), torch.randn(8 * (WARMUP + STEPS), 1))
        model, opt, loader = accelerator.prepare(model, opt, torch.utils.data.DataLoader(data, batch_size=8))
        after, steps = [], 0
        with tp.profile(steps=STEPS, warmup=WARMUP, progress=False, clock_hz=0) as prof:
            for _ in range(epochs):
                for x, y in loader:
                    accelerator.backward(F.mse_loss(model(x), y))
                    opt.step()
                    opt.zero_grad()
                    steps += 1
            after.append("after the loop")
        assert steps == WARMUP + STEPS and len(prof.run.steps) == WARMUP + STEPS, epochs
        assert after == (["after the loop"] if epochs == 1 else []), epochs
        assert prof.run.complete and prof.run.meta["stopped_by"] == "slice"
