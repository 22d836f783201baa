"""One rank of the comm probe's own tests (tests/ranks/test_ranks_comm.py), launched by torchrun
on CPU gloo. The probe is used directly, without tpkit's profile: it is loaded from its file.

Modes (rank DELAY_RANK sleeps DELAY_S before its collective in each iteration):
- ``sync``: ``dist.all_reduce`` (synchronous); the others wait for the late rank in ``Work.wait``.
- ``async``: ``all_reduce(async_op=True)``, then OVERLAP_S of "compute" on every rank, then
  ``wait()``: the collective runs behind the compute, the wait is short.
- ``ddp``: DDP's gradient all-reduce; the others wait at the end of backward.
- ``fsdp2``: ``fully_shard``; the others wait in the first all-gather of forward.
- ``zero2``: a DeepSpeed ZeRO-2 engine (slow: DeepSpeed's CPU ops are built on first use).

MODES is a comma-separated list, run one after the other in the same process group. Writes
``OUT/<mode>/rank<k>.json``: every exposed span, the overlapped intervals and the totals.
"""

from __future__ import annotations

import faulthandler
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
DELAY_S = 0.15
OVERLAP_S = 0.10
DELAY_RANK = 1
ITERS = 4


def load_comm():
    """tpkit's comm probe."""
    from tpkit.capture.probes import comm

    return comm


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def build(mode: str, rank: int) -> tuple[object, object, torch.Tensor]:
    net = model()
    if mode == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(net)
    elif mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in (net[0], net[2]):
            fully_shard(layer)
        fully_shard(net)
    elif mode == "zero2":
        import deepspeed

        cfg = {"train_batch_size": 8 * dist.get_world_size(), "train_micro_batch_size_per_gpu": 8,
               "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True}
        engine, _, _, _ = deepspeed.initialize(model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                                               config=cfg)
        return engine, None, torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    return net, opt, torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))


def run_mode(comm: object, out: Path, mode: str, rank: int) -> None:
    late = rank == DELAY_RANK
    spans: list[dict] = []
    iters: list[tuple[int, int]] = []

    def on_span(phase: str, start_ns: int, end_ns: int, detail: dict) -> None:
        spans.append({"phase": phase, "start_ns": start_ns, "end_ns": end_ns, "kind": detail["kind"],
                      "op": detail["op"], "ops": detail["ops"], "bytes": detail["bytes"]})

    net, opt, x = build(mode, rank) if mode in ("ddp", "fsdp2", "zero2") else (None, None, None)
    dist.barrier()
    probe = comm.CommProbe(on_span).install()
    try:
        for _ in range(ITERS):
            t0 = time.perf_counter_ns()
            if late:
                time.sleep(DELAY_S)
            if mode == "sync":
                dist.all_reduce(torch.ones(1024))
            elif mode == "async":
                work = dist.all_reduce(torch.ones(1024), async_op=True)
                time.sleep(OVERLAP_S)  # "compute" behind the collective
                work.wait()
            elif mode == "zero2":
                loss = net(x).pow(2).mean()
                net.backward(loss)
                net.step()
            else:
                loss = net(x).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
            iters.append((t0, time.perf_counter_ns()))
    finally:
        probe.remove()
    over = [{"start_ns": s, "end_ns": e, **d} for s, e, d in probe.overlapped()]
    (out / mode).mkdir(parents=True, exist_ok=True)
    (out / mode / f"rank{rank}.json").write_text(json.dumps({
        "rank": rank, "late": late, "iters": iters, "spans": spans, "overlapped": over,
        "totals": probe.totals(), "meta": probe.meta()}))
    dist.barrier()


def main() -> None:
    faulthandler.enable(all_threads=True)  # an abort prints every thread's Python stack
    out, modes = Path(sys.argv[1]), sys.argv[2].split(",")
    torch.set_num_threads(1)
    if "zero2" in modes:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    comm = load_comm()
    for mode in modes:
        run_mode(comm, out, mode, rank)
    gc.collect()  # the modes' DDP and FSDP objects release the group before it is destroyed
    dist.destroy_process_group()
    # Every result is written: Python's finalization is skipped. A rank aborted after writing
    # all its files ("terminate called without an active exception"), once in CI and in 3 of
    # ~140 launches here under load, never reproduced at will. One known way to end like that:
    # a gloo thread still holding a finished collective's tensors asks for the GIL while the
    # interpreter is torn down. If it comes back, faulthandler above prints every stack.
    # tpkit's own exit is tested by train_worker.py, which exits normally.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
