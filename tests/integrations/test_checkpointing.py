"""Activation checkpointing (``torch.utils.checkpoint``, Hugging Face's
``gradient_checkpointing=True``): a checkpointed block runs its forward again inside
``backward()``. tpkit recommends it when memory is short, so a loop that uses it must read right:
the recomputation is part of the backward (the time ``loss.backward()`` takes), the forward
is the outermost model call once a step, and the loss is the loop's.

Truth: the loop's own clock around ``model(x)`` and ``loss.backward()`` (plain loops), and for
the Trainer its ``log_history`` and the known sleeps of ``truth.tiny_gpt2`` /
``truth.SleepyAdamW`` / ``truth.sleepy_collate``, with the checkpointed block sleeping
``RECOMPUTE_S`` each time it runs (once in the forward, once more in the backward).
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
import truth
from torch.utils.checkpoint import checkpoint
from truth import STEPS, TOLERANCE, WARMUP

import tpkit as tp

#: What the checkpointed block's forward sleeps, each time it runs.
RECOMPUTE_S = 0.020


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(RECOMPUTE_S)
        return torch.relu(self.lin(x))


class CheckpointedNet(torch.nn.Module):
    """(B, 8) -> (B, 1), its block checkpointed: the block runs again in the backward."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.block, self.head, self.reentrant = Block(), torch.nn.Linear(8, 1), reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(checkpoint(self.block, x, use_reentrant=self.reentrant))


@pytest.fixture(scope="module", params=[False, True], ids=["non-reentrant", "reentrant"])
def plain(request):
    reentrant = request.param
    torch.manual_seed(0)
    model = CheckpointedNet(reentrant)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    # the reentrant variant needs an input that requires grad to recompute at all
    x, y = torch.randn(4, 8, requires_grad=reentrant), torch.randn(4, 1)
    forward_s = backward_s = 0.0
    losses = []
    before = truth.hook_state()
    with tp.profile(steps=STEPS, warmup=WARMUP, name="ckpt-reentrant" if reentrant else "ckpt", progress=False,
                    clock_hz=0) as prof:
        for _ in range(STEPS + WARMUP):
            t = time.perf_counter()
            loss = F.mse_loss(model(x), y)
            forward_s += time.perf_counter() - t
            t = time.perf_counter()
            loss.backward()
            backward_s += time.perf_counter() - t
            losses.append(loss.item())
            opt.step()
            opt.zero_grad()
    return dict(run=prof.run, before=before, forward_s=forward_s, backward_s=backward_s, losses=losses)


def test_recomputation_is_backward_not_forward(plain):
    run = plain["run"]
    truth.assert_hooks_removed(plain["before"])
    assert len(run.steps) == STEPS + WARMUP
    n = STEPS + WARMUP
    # the truth holds its sleeps: once in the forward, once more in the backward (a check of the check)
    assert plain["forward_s"] >= n * RECOMPUTE_S and plain["backward_s"] >= n * RECOMPUTE_S
    for phase in ("forward", "backward"):
        got, want = float(run.steps[f"{phase}_s"].sum()), plain[f"{phase}_s"]
        assert abs(got - want) <= TOLERANCE * want, (phase, got, want)
    # one forward span a step: the recomputed block is no second forward
    spans = run.spans
    assert (spans["phase"] == "forward").sum() == n
    # and the run says what happened (the block is the outermost call recomputed, once a step)
    assert any(f"modules ran inside backward ({n} outermost call(s))" in note for note in run.meta["notes"]), \
        run.meta["notes"]


def test_loss_is_the_loops(plain):
    truth.assert_losses(plain["run"].steps["loss"].tolist(), plain["losses"])


# -- Hugging Face Trainer, gradient_checkpointing=True ----------------------------------------
transformers = truth.import_transformers()


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory):
    pytest.importorskip("accelerate")
    model = truth.tiny_gpt2()
    # the first block's attention sleeps each time it runs: in the forward, and again in the
    # backward (Hugging Face checkpoints a block's ``forward``, so a hook on the block itself
    # would stay outside the recomputation; one on a module inside it is recomputed)
    model.transformer.h[0].attn.register_forward_pre_hook(lambda module, args: time.sleep(RECOMPUTE_S))
    opt = truth.SleepyAdamW(model.parameters(), lr=1e-3)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path_factory.mktemp("hf-ckpt")), per_device_train_batch_size=4, max_steps=40,
        logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True, use_cpu=True,
        dataloader_num_workers=0, seed=0, max_grad_norm=0.0, gradient_checkpointing=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=truth.Tokens(),
                                   data_collator=truth.sleepy_collate, optimizers=(opt, None))
    before = truth.hook_state()
    with tp.profile(steps=STEPS, warmup=WARMUP, name="hf-ckpt", progress=False, clock_hz=0) as prof, \
            truth.TRUTH.recording():
        trainer.train()
    return dict(run=prof.run, trainer=trainer, before=before, truth=truth.snapshot())


def test_trainer_with_gradient_checkpointing(trainer_run):
    run, trainer = trainer_run["run"], trainer_run["trainer"]
    assert trainer.model.is_gradient_checkpointing  # the Trainer did turn it on
    truth.assert_hooks_removed(trainer_run["before"])
    assert trainer.state.global_step == STEPS + WARMUP == len(run.steps)
    # the truth's backward runs from the loss's first node to the end of the pass: the
    # recomputed block's sleep is inside it
    known = trainer_run["truth"]
    assert known.seconds["backward"] >= (STEPS + WARMUP) * (truth.BACKWARD_S + RECOMPUTE_S)
    truth.assert_phases(run, known)
    assert (run.spans["phase"] == "forward").sum() == STEPS + WARMUP
    assert any("activation checkpointing recomputes the forward" in note for note in run.meta["notes"])
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    truth.assert_losses(run.steps["loss"].tolist(), logged)
