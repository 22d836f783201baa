"""Ops per phase (``ops=``/``--ops``, issue 18): a model whose forward is one big matmul and
whose backward runs one known, costly operator (a sort): the top operator of each phase is
that one, with its input shapes; only the requested steps are traced; nothing is left on."""

from __future__ import annotations

import leftovers
import pandas as pd
import torch
from factories import table

import tpkit as tp
from tpkit.analysis.ops import assign_phases, ops_by_phase, top_ops
from tpkit.run import Run
from tpkit.views import html as report

B, D_IN, D_OUT = 256, 512, 2048


class SortInBackward(torch.autograd.Function):
    """Forward: ``x * w`` (cheap); backward: sorts the gradient along its rows (costly, and an
    operator nothing else in the step runs)."""

    @staticmethod
    def forward(ctx, x, w):  # type: ignore[override]
        ctx.save_for_backward(x)
        return x * w

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        for _ in range(4):
            order = torch.sort(grad, dim=1).values  # [B, D_OUT]
        return None, (order * x).sum().reshape(1)


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.big = torch.nn.Linear(D_IN, D_OUT).requires_grad_(False)  # frozen: no backward through it
        self.w = torch.nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return SortInBackward.apply(self.big(x), self.w)  # [B, D_OUT]


def traced_run(ops: int | bool = 2, steps: int = 5, warmup: int = 2) -> Run:
    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    x = torch.randn(B, D_IN)

    def step() -> None:
        model(x).mean().backward()
        opt.step()
        opt.zero_grad()

    return tp.profile_fn(step, steps=steps, warmup=warmup, progress=False, clocks=False, ops=ops)


def test_top_op_per_phase_with_shapes_only_in_the_requested_steps(one_thread):
    before = leftovers.snapshot()
    run = traced_run(ops=2)
    assert leftovers.diff(before, leftovers.snapshot()) == {}  # the profiler is off, every hook out
    assert not torch.autograd.profiler._is_profiler_enabled
    # only measured steps 0 and 1 were traced, and every event lies inside them
    assert run.meta["ops"]["steps"] == [0, 1]
    assert sorted(run.ops["step"].unique()) == [0, 1]
    s = run.steps.set_index("step")
    assert run.ops["start_s"].min() >= s.loc[0, "start_s"] and run.ops["start_s"].max() <= s.loc[1, "end_s"]
    # (torch's "Optimizer.step" annotation closes just after tpkit stamps the step's end)
    assert run.ops["end_s"].max() <= s.loc[1, "end_s"] + 0.002
    top = top_ops(run.ops, run.spans, n=3)
    fwd = top[top["phase"] == "forward"].iloc[0]
    assert fwd["op"] == "aten::addmm" and fwd["calls"] == 2  # one per traced step
    assert fwd["input_shapes"] == str([[D_OUT], [B, D_IN], [D_IN, D_OUT], [], []])
    bwd = top[top["phase"] == "backward"].iloc[0]
    assert bwd["op"] == "aten::sort" and bwd["calls"] == 2 * 4
    assert bwd["input_shapes"] == str([[B, D_OUT], [], []])  # the gradient, dim, descending
    assert not (top["op"] == "aten::sort").loc[top["phase"] != "backward"].any()
    # self times add up: what the phase's ops spent is within the phase's own time
    by = ops_by_phase(run.ops, run.spans)
    fwd_s = by[by["phase"] == "forward"]["self_cpu_s"].sum()
    assert 0 < fwd_s <= run.steps[run.steps["step"].isin([0, 1])]["forward_s"].sum() * 1.05
    assert any("traced measured steps 0-1" in n for n in run.meta["notes"])
    # the memory probe's allocator stream had to give torch's one profiler session up: said so
    assert any("one profiler session" in n for n in run.meta["notes"])
    # the dashboard and the report get an Ops section
    assert "Ops" in [t for t, _ in report.section_charts(run)]


def test_ops_true_traces_three_steps_and_a_run_without_ops_has_none(one_thread, tmp_path):
    run = traced_run(ops=True, steps=4, warmup=1)
    assert run.meta["ops"]["steps"] == [0, 1, 2] and sorted(run.ops["step"].unique()) == [0, 1, 2]
    back = Run.load(run.save(tmp_path / "r"))
    pd.testing.assert_frame_equal(back.ops, run.ops)
    (tmp_path / "r" / "ops.parquet").unlink()  # a run saved before the ops table existed
    assert Run.load(tmp_path / "r").ops.empty
    plain = traced_run(ops=False, steps=2, warmup=0)
    assert plain.ops.empty and "ops" not in plain.meta
    assert "Ops" not in [t for t, _ in report.section_charts(plain)]


def test_ops_go_to_the_innermost_phase_by_hand():
    spans = table("spans", step=[0, 0, 0, 0], phase=["forward", "attention", "backward", "optimizer"],
                  start_s=[0.0, 0.2, 1.0, 2.0], end_s=[1.0, 0.4, 2.0, 2.5], duration_s=[1.0, 0.2, 1.0, 0.5],
                  depth=[0, 1, 0, 0], source=["t"] * 4)
    ops = table("ops", step=[0] * 5, op=["a", "b", "c", "d", "e"], start_s=[0.1, 0.25, 1.5, 2.1, 3.0],
                end_s=[0.15, 0.3, 1.6, 2.2, 3.1], self_cpu_s=[0.05, 0.05, 0.1, 0.1, 0.1],
                self_device_s=[0.0] * 5, input_shapes=["[[2, 3]]", "", "", "", ""])
    assert assign_phases(ops, spans)["phase"].tolist() == ["forward", "attention", "backward", "optimizer", "other"]
    by = ops_by_phase(ops, spans)
    assert by["phase"].tolist() == ["forward", "backward", "optimizer", "other", "attention"]  # step order, user last
    assert by.set_index("op").loc["a", "self_ms_per_step"] == 50.0
    # device time ranks ops when the run has any (a GPU run)
    gpu = ops.assign(self_device_s=[0.0, 0.0, 0.0, 0.3, 0.0])
    assert ops_by_phase(gpu, spans).set_index("op").loc["d", "self_s"] == 0.3
