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
    start, micro, held = engine.global_steps, [], []
    before = truth.hook_state()
    with tp.profile(steps=STEPS, warmup=WARMUP, name=f"zero{stage}-ga{ga}", progress=False, clock_hz=0) as prof, \
            truth.TRUTH.recording():
        for x, y in loader:
            loss = F.mse_loss(engine(x), y)
            micro.append(loss.item())
            engine.backward(loss)
            held.append(held_gradient_bytes(engine))
            engine.step()
    steps = [sum(micro[i:i + ga]) / ga for i in range(0, len(micro), ga)]
    return dict(run=prof.run, before=before, engine_steps=engine.global_steps - start, micro=micro,
                step_losses=steps, truth=truth.snapshot(), ga=ga, stage=stage, held=held)


def held_gradient_bytes(engine) -> int:
    """Bytes of the gradient storages the engine holds now: its ZeRO optimizer's accumulators
    (``all_grad_tensors``, between micro-batches), the partition it hands its step
    (``averaged_gradients``), and the model's ``.grad`` (ZeRO-1's first micro-batch leaves them
    there); each storage once."""
    zero, seen, stack = engine.optimizer, {}, []
    stack += [getattr(zero, "all_grad_tensors", None), getattr(zero, "averaged_gradients", None),
              [p.grad for p in engine.module.parameters()]]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            seen[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return sum(seen.values())


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


def test_the_engines_gradients_are_gradients(sliced):
    """ZeRO-1/2 keep a micro-batch's gradients in their own buffers from its backward to the
    step (ZeRO-1's first micro-batch of an accumulation in ``.grad``): they are gradients at
    every backward's exit and the step's enter. They had read temporaries there and other at
    the step (ZeRO-2: gradients 0 beside 160,800 B the engine held), and
    ``meta["deepspeed"]["gradient_bytes"]`` 0. Truth: the engine's gradient storages read in the
    loop right after each ``engine.backward``."""
    run, ga, held = sliced["run"], sliced["ga"], sliced["held"]
    measured = held[WARMUP * ga:(WARMUP + STEPS) * ga]
    assert min(measured) > 0
    m = run.memory
    m = m[(m["device"] == "cpu") & (m["step"] >= 0) & (m["event"] != "peak")]
    wide = m.pivot_table(index=["t_s", "phase", "event"], columns="category", values="bytes", aggfunc="sum",
                         fill_value=0).reset_index().sort_values("t_s")
    exits = wide[(wide["phase"] == "backward") & (wide["event"] == "exit")]
    assert list(exits["gradients"]) == measured  # to the byte, each micro-batch's
    steps = wide[(wide["phase"] == "optimizer") & (wide["event"] == "enter")]
    assert list(steps["gradients"]) == measured  # engine.step is entered once per micro-batch
    assert run.meta["deepspeed"]["gradient_bytes"] == max(held)
