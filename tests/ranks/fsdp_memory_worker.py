"""FSDP2 on the ranks of a torchrun launch, ``reshard_after_forward`` True then False, each with
a slice under the memory probe; each rank writes what tpkit read at the forward's exit and the
truth measured from FSDP2's own storages: ``python -m torch.distributed.run ... fsdp_memory_worker.py OUT``.

Truth: with ``reshard_after_forward=False`` FSDP2 keeps each block's all-gathered (unsharded)
parameters from its forward to its backward, in storages it allocates at the all-gather
(``FSDPParam.all_gather_outputs``); their bytes after a forward are read here directly.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import tpkit as tp

STEPS, WARMUP = 4, 2


def build(reshard: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(13, 61), torch.nn.ReLU(), torch.nn.Linear(61, 123), torch.nn.ReLU(),
                              torch.nn.Linear(123, 1))
    for i in (0, 2, 4):
        fully_shard(net[i], reshard_after_forward=reshard)
    fully_shard(net, reshard_after_forward=reshard)
    return net, torch.optim.Adam(net.parameters(), lr=1e-3)


def unsharded_bytes(net: torch.nn.Module) -> int:
    """The bytes of the all-gather outputs alive now (after a forward: those FSDP2 kept)."""
    total = 0
    for m in net.modules():
        state = getattr(m, "_get_fsdp_state", None)
        group = state()._fsdp_param_group if state is not None else None
        for fp in (group.fsdp_params if group is not None else ()):
            total += sum(t.untyped_storage().nbytes() for t in fp.all_gather_outputs)
    return total


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(rank)
    result: dict[str, dict] = {}
    for reshard in (True, False):
        net, opt = build(reshard)
        shard = sum(p.to_local().untyped_storage().nbytes() for p in net.parameters())
        kept: list[int] = []
        with tp.profile(steps=STEPS, warmup=WARMUP, name=f"fsdp-{reshard}", progress=False, clock_hz=0) as prof:
            for _ in range(STEPS + WARMUP + 4):
                x, y = torch.randn(8, 13, generator=g), torch.randn(8, 1, generator=g)
                loss = torch.nn.functional.mse_loss(net(x), y)
                kept.append(unsharded_bytes(net))
                loss.backward()
                opt.step()
                opt.zero_grad()
        m = prof.run.memory
        exits = m[(m["step"] >= 0) & (m["phase"] == "forward") & (m["event"] == "exit")]
        by_cat = exits.groupby("category")["bytes"].median()
        result[str(reshard)] = {"shard": shard, "kept": kept[WARMUP:WARMUP + STEPS],
                                "parameters": int(by_cat.get("parameters", 0)),
                                "activations": int(by_cat.get("activations", 0)),
                                "notes": prof.run.meta["notes"]}
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
