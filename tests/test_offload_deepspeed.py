"""DeepSpeed engine loops profiled by %%tp_profile unchanged, on the CPU accelerator (gloo,
one process): one step per engine.step, the phases, and the optimizer state DeepSpeed holds
counted as optimizer state. The first run JIT-builds cpu_adam and shm_comm (~1-2 min) into
build/torch_extensions; later runs load them in seconds."""

from __future__ import annotations

import os

import pytest
import torch
from IPython.utils.capture import capture_output

os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(os.path.dirname(__file__), "..", "build",
                                                           "torch_extensions"))

try:  # a DeepSpeed test is skipped only when deepspeed cannot be imported at all
    import deepspeed  # noqa: F401
    DS_ERROR = None
except Exception as e:  # pragma: no cover - depends on the environment
    DS_ERROR = f"deepspeed cannot be imported: {e!r}"

pytestmark = [pytest.mark.slow, pytest.mark.skipif(DS_ERROR is not None, reason=DS_ERROR or "")]


SETUP = """
import torch, deepspeed
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                          torch.nn.ReLU(), torch.nn.Linear(64, 8))
cfg = {{"train_batch_size": 8, "train_micro_batch_size_per_gpu": 8,
        "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3}}}},
        "zero_optimization": {{"stage": {stage}{offload}}}}}
engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)
batches = [torch.randn(8, 32) for _ in range(50)]
"""

LOOP = """
iterations = 0
for x in batches:
    iterations += 1
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()
"""


@pytest.mark.parametrize("stage,offload", [(2, True), (1, False), (3, True)])
def test_deepspeed_engine_loop_profiled(ip, single_process_env, stage, offload):
    off = ', "offload_optimizer": {"device": "cpu"}' if offload else ""
    ip.run_cell(SETUP.format(stage=stage, offload=off)).raise_error()
    engine = ip.user_ns["engine"]
    before = engine.global_steps
    with capture_output() as cap:
        ip.run_cell_magic("tp_profile", f"--steps 4 --warmup 1 --name zero{stage} --clock-hz 0", LOOP)
    run = ip.user_ns["_tp"]
    assert run.complete, run.meta.get("error")
    # one step per engine.step: 5 engine steps, 5 rows; the loop (over a list tpkit does not see)
    # stops at its 6th forward, its counter at the loop's top counting the 6th iteration
    assert ip.user_ns["iterations"] == 6 and engine.global_steps - before == 5
    assert len(run.steps) == 5 and len(run.measured_steps) == 4
    m = run.measured_steps
    assert (m["forward_s"] > 0).all() and (m["backward_s"] > 0).all() and (m["optimizer_s"] > 0).all()
    assert set(run.spans[run.spans["phase"] == "optimizer"]["source"]) >= {"DeepSpeedEngine.step"}
    assert run.meta["model"]["class"] == "DeepSpeedEngine"
    ds = run.meta["deepspeed"]
    assert ds["zero_stage"] == stage and ds["offload_optimizer"] is offload and ds["engine_steps"] == 5
    basic = engine.optimizer.optimizer
    assert ds["basic_optimizer"] == type(basic).__name__
    if offload:  # ZeRO-Offload's host step is the offload phase, inside engine.step
        assert ds["basic_optimizer"] == "DeepSpeedCPUAdam" and ds["optimizer_state_devices"] == ["cpu"]
        assert (m["offload_s"] > 0).all()
        assert set(run.spans[run.spans["phase"] == "offload"]["source"]) == {"DeepSpeedCPUAdam.step"}
    else:
        assert (m["offload_s"] == 0).all()
    # what DeepSpeed holds: Adam's two moments per fp32 partition element
    held = sum(t.untyped_storage().nbytes() for s in basic.state.values() for t in s.values()
               if isinstance(t, torch.Tensor))
    n_params = sum(p.numel() for g in basic.param_groups for p in g["params"])
    assert ds["optimizer_state_bytes"] == held >= 8 * n_params
    assert ds["fp32_master_bytes"] == 4 * n_params or not offload
    # the memory probe counts the same bytes as optimizer state (not the optimizer's private
    # scratch buffers: FusedAdam's 4-byte _dummy_overflow_buf on ZeRO-1)
    opt_mem = run.memory[(run.memory["category"] == "optimizer_state") & (run.memory["step"] >= 0)]
    assert not opt_mem.empty, "the memory probe recorded no optimizer state"
    assert opt_mem.groupby("device")["bytes"].max().sum() == held
    assert (m["samples"] == 8).all()  # the engine's micro batch x accumulation steps
    assert f"zero{stage}" in cap.outputs[-1].data["text/plain"]
