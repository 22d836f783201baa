"""What does timing collectives cost the loop, per collective? A DDP-wrapped model at one rank
(gloo, in this process: one bucket all-reduce a step) runs blocks of steps with no probe (the
peer: each block is paired with the no-probe blocks on either side) and with each of:

- ``comm probe``: tpkit's communication probe as a slice installs it (at one rank no collective
  gets a completion callback; elsewhere one completed when its call returned gets none);
- ``comm probe, callback on every collective``: the probe as it was before session 21, a Python
  callback on each in-flight collective's future (what a collective still in flight at more
  than one rank pays);
- ``pass-through kernel``: a Python kernel at the probe's dispatch key that only redispatches,
  the floor of seeing collectives from Python.

Prints microseconds added per step (one collective a step) with 95% bootstrap intervals, and the
ratio of each step time to the no-probe one.

    python benchmarks/comm_probe.py [--budget 60]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from common import machine, versions, write_rows
from interleave import estimate

from tpkit.capture.probes import comm

STEPS_PER_BLOCK, SKIP = 40, 5


class _EveryCallback(comm.CommProbe):
    """The probe with a completion callback on every collective still in flight when its call
    returns, as at more than one rank (and, before session 21, at one rank as well)."""

    def install(self) -> "_EveryCallback":
        super().install()
        self._world = None
        return self


def _pass_through() -> Callable[[], Any]:
    """A Python kernel for every c10d collective at the probe's key that only redispatches."""
    lib = torch.library.Library("c10d", "IMPL")
    after = torch._C._after_ADInplaceOrView_keyset
    for name in comm.C10D_OPS:
        packet = getattr(torch.ops.c10d, name, None)
        if packet is not None:
            lib.impl(name, lambda keyset, *a, _op=packet.default, **k: _op.redispatch(keyset & after, *a, **k),
                     comm.DISPATCH_KEY, with_keyset=True)
    return lib._destroy


MODES: dict[str, Callable[[], Callable[[], Any]]] = {
    "comm probe": lambda: comm.CommProbe().install().remove,
    "comm probe, callback on every collective": lambda: _EveryCallback().install().remove,
    "pass-through kernel": _pass_through,
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=60.0, help="seconds of blocks")
    args = ap.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        net = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 16))
        opt = torch.optim.SGD(net.parameters(), lr=0.0)
        x = torch.randn(8, 16)

        def block(mode: str | None) -> float:
            undo = MODES[mode]() if mode else None
            try:
                for i in range(SKIP + STEPS_PER_BLOCK):
                    if i == SKIP:
                        t0 = time.perf_counter_ns()
                    net(x).sum().backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                return (time.perf_counter_ns() - t0) / STEPS_PER_BLOCK / 1e3
            finally:
                if undo:
                    undo()

        for _ in range(3):
            block(None)
        names = list(MODES)
        added: dict[str, list[float]] = {m: [] for m in names}
        ratio: dict[str, list[float]] = {m: [] for m in names}
        base: list[float] = []
        end, c = time.time() + args.budget, 0
        while time.time() < end:
            for mode in names[c % len(names):] + names[:c % len(names)]:
                a, b, d = block(None), block(mode), block(None)
                added[mode].append(b - (a + d) / 2)
                ratio[mode].append(b / ((a + d) / 2))
                base.append((a + d) / 2)
            c += 1
    finally:
        dist.destroy_process_group()
    print(f"{machine()}; {versions()}; DDP(Linear(16, 16)) at one rank, gloo: one all-reduce a step")
    print(f"no probe: {statistics.median(base):.0f} us a step; {c} cycles of blocks of {STEPS_PER_BLOCK} steps")
    rows = []
    for mode in names:
        e, r = estimate(added[mode]), estimate(ratio[mode])
        print(f"  {mode:42s} +{e.value:6.1f} us a collective [{e.lo:.1f}-{e.hi:.1f}]  "
              f"{r.value:.3f}x no probe [{r.lo:.3f}-{r.hi:.3f}]  ({e.n} blocks)")
        rows.append({"mode": mode, "us_per_collective": e.value, "us_lo": e.lo, "us_hi": e.hi,
                     "ratio_vs_no_probe": r.value, "blocks": e.n, "machine": machine(), "versions": versions()})
    print(f"rows written to {write_rows('comm_probe', rows)}")


if __name__ == "__main__":
    main()
