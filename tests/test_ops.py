"""Ops per phase (``ops=``/``--ops``, issue 18): a model whose forward is one big matmul and
whose backward runs one known, costly operator (a sort): the top operator of each phase is
that one, with its input shapes; only the requested steps are traced; nothing is left on."""

from __future__ import annotations

import leftovers
import pandas as pd
import pytest
import torch
from factories import table

import tpkit as tp
from tpkit.analysis.ops import assign_phases, ops_by_phase, top_ops
from tpkit.run import Run
from tpkit.schema import CPU_SOURCE_COUNTER, ENV_CPU_ALLOCATIONS
from tpkit.views import html as report

B, D_IN, D_OUT = 128, 256, 2048


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
        for _ in range(2):
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
    run = traced_run(ops=2, steps=4, warmup=1)
    assert leftovers.diff(before, leftovers.snapshot()) == {}  # the profiler is off, every hook out
    assert not torch.autograd.profiler._is_profiler_enabled
    # only the last 2 measured steps (2, 3) were traced, and every event lies inside them
    assert run.meta["ops"]["steps"] == [2, 3]
    assert sorted(run.ops["step"].unique()) == [2, 3]
    s = run.steps.set_index("step")
    assert run.ops["start_s"].min() >= s.loc[2, "start_s"] and run.ops["start_s"].max() <= s.loc[3, "end_s"]
    # (an event still open when the slice stopped counts up to the last step's end only)
    assert run.ops["end_s"].max() <= s.loc[3, "end_s"]
    # the profiler's cost touches the traced steps only: its start is tpkit time of step 2, its
    # stop came after the slice
    cost = run.spans[run.spans["source"] == "ops profiler"]
    assert cost["step"].tolist() == [2] and cost["phase"].tolist() == ["tpkit"]
    top = top_ops(run.ops, run.spans, n=3)
    fwd = top[top["phase"] == "forward"].iloc[0]
    assert fwd["op"] == "aten::addmm" and fwd["calls"] == 2  # one per traced step
    assert fwd["input_shapes"] == str([[D_OUT], [B, D_IN], [D_IN, D_OUT], [], []])
    bwd = top[top["phase"] == "backward"].iloc[0]
    assert bwd["op"] == "aten::sort" and bwd["calls"] == 2 * 2
    assert bwd["input_shapes"] == str([[B, D_OUT], [], []])  # the gradient, dim, descending
    assert not (top["op"] == "aten::sort").loc[top["phase"] != "backward"].any()
    # self times add up: what the phase's ops spent is within the phase's own time
    by = ops_by_phase(run.ops, run.spans)
    fwd_s = by[by["phase"] == "forward"]["self_cpu_s"].sum()
    assert 0 < fwd_s <= run.steps[run.steps["step"].isin([2, 3])]["forward_s"].sum() * 1.05
    assert any("traced measured steps 2-3" in n for n in run.meta["notes"])
    # tpkit's CPU allocation counter (not a profiler session) counted on through the traced steps
    assert run.meta["memory"]["cpu_source"] == CPU_SOURCE_COUNTER
    assert not any("one profiler session" in n or "not measured" in n for n in run.meta["notes"])
    assert (_activations_at_forward_exit(run) > 0).all()
    # the dashboard (a tab per section) and the report get an Ops section
    assert "Ops" in [t for t, _ in report.section_charts(run)]
    assert "aten::sort" in report.dashboard_html(run, include_js=False)


def _activations_at_forward_exit(run: Run) -> pd.Series:
    m = run.memory
    sel = m[(m["phase"] == "forward") & (m["event"] == "exit") & (m["category"] == "activations")]
    return sel.set_index("step")["bytes"]


def test_with_torch_s_allocator_stream_the_trace_takes_the_one_profiler_session_and_says_so(one_thread, monkeypatch):
    monkeypatch.setenv(ENV_CPU_ALLOCATIONS, "stream")
    run = traced_run(ops=2, steps=4, warmup=1)
    assert sorted(run.ops["step"].unique()) == [2, 3]
    assert any("one profiler session" in n for n in run.meta["notes"])
    assert "activations" not in set(run.memory["category"])  # the known sets only, said so


def test_ops_true_traces_three_steps_and_a_run_without_ops_has_none(one_thread, tmp_path):
    run = traced_run(ops=True, steps=4, warmup=1)
    assert run.meta["ops"]["steps"] == [1, 2, 3] and sorted(run.ops["step"].unique()) == [1, 2, 3]
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


class StandInProfiler:
    """torch.profiler at its boundary, for the GPU path on a CPU machine: a CPU op that launched
    a 500 us kernel, and the kernel itself (CUDA device type: counted through the op only)."""

    def __init__(self, activities: list) -> None:
        self.activities = activities
        self.calls: list[str] = []

    def start(self) -> None:
        import time
        from types import SimpleNamespace

        self.calls.append("start")
        wall = time.time_ns()
        self.profiler = SimpleNamespace(kineto_results=SimpleNamespace(trace_start_ns=lambda: wall))

    def stop(self) -> None:
        self.calls.append("stop")

    def events(self) -> list:
        from types import SimpleNamespace as E

        return [E(name="aten::mm", time_range=E(start=50.0, end=80.0), self_cpu_time_total=30.0,
                  self_device_time_total=500.0, input_shapes=[[2, 3], [3, 4]], device_type="DeviceType.CPU"),
                E(name="ampere_sgemm_32x32", time_range=E(start=60.0, end=560.0), self_cpu_time_total=0.0,
                  self_device_time_total=500.0, input_shapes=[], device_type="DeviceType.CUDA")]


def test_gpu_path_through_a_stand_in_profiler(monkeypatch):
    import time

    from tpkit.capture.probes.ops import OpsProbe
    from tpkit.capture.recorder import Recorder

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    made: list[StandInProfiler] = []
    rec = Recorder("standin")
    probe = OpsProbe(rec, 2, warmup=1, steps=None,  # a slice that runs on: the first 2 measured steps
                     profiler_factory=lambda acts: made.append(StandInProfiler(acts)) or made[-1])
    probe.install()
    stopped_after = None
    for _ in range(4):  # raw steps 0 (warmup), 1, 2 (traced), 3
        time.sleep(0.002)
        rec.end_step()
        if stopped_after is None and made and made[0].calls == ["start", "stop"]:
            stopped_after = rec.step_index
    probe.remove()
    assert stopped_after == 3  # stopped at the end of the 2nd traced step, not at the slice's end
    (prof,) = made
    assert prof.calls == ["start", "stop"]
    assert torch.profiler.ProfilerActivity.CUDA in prof.activities
    rows = probe.table_rows(warmup=1)
    assert len(rows) == 1  # the kernel is not an op row: its time is the op's self device time
    step, op, start_s, end_s, cpu_s, dev_s, shapes = rows[0]
    assert (step, op, shapes) == (0, "aten::mm", "[[2, 3], [3, 4]]")
    assert cpu_s == pytest.approx(30e-6) and dev_s == pytest.approx(500e-6)
    assert end_s - start_s == pytest.approx(30e-6, abs=1e-6)
    assert probe.meta()["ops"]["steps"] == [0, 1] and probe.meta()["ops"]["activities"] == ["cpu", "cuda"]


def test_ops_chart_spec():
    from tpkit.charts.ops import ops_per_phase

    top = pd.DataFrame({"phase": ["forward", "forward", "backward"], "op": ["aten::addmm", "aten::gelu", "aten::mm"],
                        "input_shapes": ["[[8], [4, 2], [2, 8], [], []]", "", "[[8, 4], [4, 2]]"], "calls": [2, 2, 4],
                        "self_cpu_s": [0.004, 0.001, 0.002], "self_device_s": [0.0] * 3, "self_s": [0.004, 0.001, 0.002],
                        "self_ms_per_step": [2.0, 0.5, 1.0], "share_of_phase": [0.6, 0.15, 0.5]})
    spec = ops_per_phase(top, steps=[3, 4]).to_dict()
    assert spec["title"]["text"] == "Ops per phase (steps 3-4, torch.profiler)"
    fwd, bwd = spec["vconcat"]
    assert fwd["title"]["text"] == "forward: top operators by self time (75% of the phase's operator time)"
    labels = [v["label"] for v in spec["datasets"][fwd["data"]["name"]]]
    assert labels == ["aten::addmm  [[8], [4, 2], [2, 8], [], []]", "aten::gelu"]  # shapes with the op
    assert fwd["encoding"]["x"]["field"] == "self_ms_per_step" and fwd["encoding"]["y"]["sort"] == "-x"
    assert bwd["encoding"]["color"]["scale"]["range"][bwd["encoding"]["color"]["scale"]["domain"].index("backward")] \
        == "#6a51a3"
