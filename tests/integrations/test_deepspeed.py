"""A DeepSpeed engine loop (ZeRO-1 and ZeRO-2, one process over gloo, DeepSpeed's CPU
accelerator) profiled unchanged, with and without gradient accumulation in the engine.

Truth: the engine's own ``global_steps``, the loop's losses (``engine.backward`` divides by
the accumulation count itself; the step's loss is the mean of its micro-batches'), the
self-timed forward and collation. Slow: the first engine JIT-builds DeepSpeed's CPU ops
(minutes, cached in build/torch_extensions).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
import truth
from truth import STEPS, WARMUP

import tpkit as tp

os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(truth.REPO, "build", "torch_extensions"))

try:
    import deepspeed

    DS_ERROR = None
except Exception as e:  # pragma: no cover - depends on the environment
    DS_ERROR = f"deepspeed cannot be imported: {e!r}"

pytestmark = [pytest.mark.slow, pytest.mark.skipif(DS_ERROR is not None, reason=DS_ERROR or "")]

MICRO = 4


def engine_loop(stage: int, ga: int) -> dict:
    torch.manual_seed(0)
    net = truth.SleepyNet()
    cfg = {"train_batch_size": MICRO * ga, "train_micro_batch_size_per_gpu": MICRO,
           "gradient_accumulation_steps": ga, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": stage}}
    engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)
    loader = torch.utils.data.DataLoader(truth.Regression(), batch_size=MICRO, collate_fn=truth.sleepy_collate)
    start, micro = engine.global_steps, []
    before = truth.hook_state()
    with tp.profile(steps=STEPS, warmup=WARMUP, name=f"zero{stage}-ga{ga}", progress=False, clock_hz=0) as prof, \
            truth.TRUTH.recording():
        for x, y in loader:
            loss = F.mse_loss(engine(x), y)
            micro.append(loss.item())
            engine.backward(loss)
            engine.step()
    steps = [sum(micro[i:i + ga]) / ga for i in range(0, len(micro), ga)]
    return dict(run=prof.run, before=before, engine_steps=engine.global_steps - start, micro=micro,
                step_losses=steps, truth=truth.snapshot(), ga=ga, stage=stage)


@pytest.fixture(scope="module", params=[(1, 1), (2, 2)], ids=["zero1-ga1", "zero2-ga2"])
def sliced(request, single_process_env):
    return engine_loop(*request.param)


def test_engine_steps_phases_and_hooks(sliced):
    run, ga = sliced["run"], sliced["ga"]
    truth.assert_hooks_removed(sliced["before"])
    assert sliced["engine_steps"] == STEPS + WARMUP == len(run.steps) and run.complete
    assert len(sliced["micro"]) == ga * (STEPS + WARMUP)
    assert (run.steps["samples"] == MICRO * ga).all()
    assert run.meta["deepspeed"]["zero_stage"] == sliced["stage"]
    truth.assert_phases(run, sliced["truth"], phases=("forward", "data_wait"))
    # the engine's backward also reduces gradients: at least the autograd pass
    assert run.steps["backward_s"].sum() >= sliced["truth"].seconds["backward"] * (1 - truth.TOLERANCE)


def test_engine_loss(sliced):
    """``engine.backward`` divides by the accumulation count: the step's loss is the sum."""
    truth.assert_losses(sliced["run"].steps["loss"].tolist(), sliced["step_losses"])
