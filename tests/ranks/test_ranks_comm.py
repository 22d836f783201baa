"""The communication probe on its own (tpkit/capture/probes/comm.py, loaded from its file, not
through tp.profile): install/remove leave torch exactly as they found it, interval arithmetic
on hand-made numbers, and on 2 gloo ranks under torchrun the exposed wait of the on-time rank
matches the delay injected on the other (150 ms) within 25%, for a synchronous all_reduce,
an async one (the compute behind it is overlapped, not exposed), DDP's bucket all-reduce
(waited at the end of backward) and FSDP2's all-gather; DeepSpeed ZeRO-2 is slow-marked."""

from __future__ import annotations

import json
import socket
import statistics
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from ranks_launch import ROOT, torchrun

COMM_PY = ROOT / "tpkit" / "capture" / "probes" / "comm.py"
DELAY_S, OVERLAP_S, TOL = 0.15, 0.10, 0.25  # as in comm_worker.py


from tpkit.capture.probes import comm  # noqa: E402


# -- one process ----------------------------------------------------------------------------------
def _state() -> dict:
    from torch._C import _distributed_c10d as c10d

    ops = ["c10d::allreduce_", "c10d::_allgather_base_", "c10d::barrier", "_c10d_functional::wait_tensor"]
    return {"wait": c10d.Work.__dict__["wait"], "bc": dist._broadcast_coalesced,
            "rebuild": c10d.Reducer.__dict__["_rebuild_buckets"],
            "dispatch": {op: torch._C._dispatch_dump(op) for op in ops}}


def test_install_remove_restore_exactly_and_twice():
    before = _state()
    probe = comm.CommProbe(lambda *a: None)
    probe.install().install()  # a second install is a no-op
    during = _state()
    assert during["wait"] is not before["wait"] and during["bc"] is not before["bc"]
    assert "ADInplaceOrView" in during["dispatch"]["c10d::allreduce_"]
    assert {"c10d::allreduce_", "Work.wait", "Reducer._rebuild_buckets"} <= set(probe.hooked)
    with pytest.raises(RuntimeError, match="already installed"):
        comm.CommProbe().install()
    probe.remove()
    probe.remove()
    assert _state() == before and comm._ACTIVE is None


def test_failure_mid_install_leaves_nothing(monkeypatch):
    before = _state()
    real = torch.library.Library.impl
    calls = []

    def flaky(self, *args, **kwargs):
        calls.append(args[0])
        if len(calls) == 5:
            raise RuntimeError("boom")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.library.Library, "impl", flaky)
    with pytest.raises(RuntimeError, match="boom"):
        comm.CommProbe().install()
    monkeypatch.undo()
    assert _state() == before and comm._ACTIVE is None


def test_interval_arithmetic():
    from tpkit.intervals import merge, subtract

    assert merge([(5, 7), (1, 3), (2, 4), (7, 8)]) == [(1, 4), (5, 8)]
    assert subtract(0, 10, [(2, 3), (5, 12)]) == [(0, 2), (3, 5)]
    assert subtract(0, 10, [(-5, 0), (10, 20)]) == [(0, 10)]
    assert subtract(4, 6, [(0, 10)]) == []


@pytest.fixture
def one_rank():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_one_rank_collectives_and_ddp_unchanged(one_rank, one_thread):
    """Sync and async collectives are seen with their op and bytes; DDP trains to the same
    parameters with the probe as without it; the end-of-backward window is reported."""

    def train(with_probe: bool) -> tuple[list[torch.Tensor], list, comm.CommProbe]:
        torch.manual_seed(0)
        net = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 4))
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        spans: list = []
        probe = comm.CommProbe(lambda *a: spans.append(a))
        if with_probe:
            probe.install()
        try:
            for i in range(3):
                net(torch.full((2, 8), float(i))).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
            dist.all_reduce(torch.ones(16))
            dist.all_reduce(torch.ones(4), async_op=True).wait()
        finally:
            probe.remove()
        return [p.detach().clone() for p in net.parameters()], spans, probe

    plain, _, _ = train(False)
    probed, spans, probe = train(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, probed))
    kinds = [(d["kind"], d["op"], d["bytes"]) for _, _, _, d in spans]
    assert [k for k in kinds if k[0] == "end_of_backward"] == [("end_of_backward", "all_reduce", 4 * 36)] * 3
    assert ("blocking_call", "broadcast", 16) in kinds  # DDP's bucket-order broadcast, 2nd iteration
    assert kinds[-2:] == [("wait", "all_reduce", 64), ("wait", "all_reduce", 16)]
    assert all(phase == "comm" and e >= s for phase, s, e, _ in spans)
    # One rank: no collective has a peer, so none gets a completion callback (each would cost the
    # loop ~75 us); in-flight time is at most a bound up to its wait, and the run says so.
    assert len(probe.ops) == 7 and all(c.done_ns is None for c in probe.ops)
    assert {d["end"] for _, _, d in probe.overlapped()} == {"waited"}  # the async all_reduce's
    assert any(n.startswith("one rank: collectives have no peer") for n in probe.meta()["comm"]["notes"])


# -- two ranks under torchrun -----------------------------------------------------------------------
def _load(out: Path, mode: str) -> dict[int, dict]:
    return {r: json.loads((out / mode / f"rank{r}.json").read_text()) for r in (0, 1)}


def _exposed_per_iter(d: dict) -> list[float]:
    return [sum(x["end_ns"] - x["start_ns"] for x in d["spans"] if s <= x["start_ns"] < e) / 1e9
            for s, e in d["iters"]]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("comm")
    torchrun("comm_worker.py", 2, str(out), "sync,async,ddp,fsdp2", timeout_s=240)
    return out


@pytest.mark.parametrize("mode,kind", [("sync", "wait"), ("ddp", "end_of_backward"), ("fsdp2", "wait")])
def test_exposed_wait_matches_injected_delay(two_ranks, mode, kind):
    d = _load(two_ranks, mode)
    on_time, late = d[0], d[1]
    assert not on_time["late"] and late["late"]
    waited = statistics.median(_exposed_per_iter(on_time)[1:])  # the first iteration warms up
    assert waited == pytest.approx(DELAY_S, rel=TOL), _exposed_per_iter(on_time)
    assert statistics.median(_exposed_per_iter(late)[1:]) < TOL * DELAY_S
    assert kind in {s["kind"] for s in on_time["spans"]}
    assert all(s["phase"] == "comm" for s in on_time["spans"])


def test_async_collective_overlapped_behind_compute(two_ranks):
    """rank 0 issues, computes OVERLAP_S, then waits for rank 1 (late by DELAY_S): the compute
    time is overlapped, the rest of the wait exposed."""
    d = _load(two_ranks, "async")
    over0 = d[0]["totals"]["overlapped_s"] / len(d[0]["iters"])
    assert over0 == pytest.approx(OVERLAP_S, rel=TOL)
    first_wait = _exposed_per_iter(d[0])[0]
    assert first_wait == pytest.approx(DELAY_S - OVERLAP_S, rel=TOL, abs=0.01)
    assert d[1]["totals"]["overlapped_s"] / len(d[1]["iters"]) < TOL * OVERLAP_S
    assert all(piece["op"] == "all_reduce" and piece["end"] == "completed" for piece in d[0]["overlapped"])


@pytest.mark.slow
def test_deepspeed_zero2_exposed_wait_matches_injected_delay(tmp_path):
    pytest.importorskip("deepspeed")
    torchrun("comm_worker.py", 2, str(tmp_path), "zero2", timeout_s=600)
    d = _load(tmp_path, "zero2")
    assert statistics.median(_exposed_per_iter(d[0])[1:]) == pytest.approx(DELAY_S, rel=TOL)
    assert {s["op"] for s in d[0]["spans"]} >= {"all_reduce"}


def test_a_failing_consumer_never_breaks_a_collective(one_rank):
    def boom(*args):
        raise ValueError("consumer bug")

    probe = comm.CommProbe(boom).install()
    try:
        t = torch.ones(4)
        dist.all_reduce(t)
        net = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
        net(t[None]).sum().backward()  # the end-of-backward callbacks report through it too
    finally:
        probe.remove()
    assert torch.equal(t, torch.ones(4)) and net.module.weight.grad is not None
    assert any("on_span failed" in n and "consumer bug" in n for n in probe.notes)
    assert {d["kind"] for _, _, d in probe.exposed} >= {"wait", "end_of_backward"}
