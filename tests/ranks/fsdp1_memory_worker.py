"""FSDP1 (``FullyShardedDataParallel``) on the ranks of a torchrun launch, SHARD_GRAD_OP then
FULL_SHARD (``use_orig_params`` False, then True), each with a slice under the memory probe; each
rank writes what tpkit read at the forward's exit and the truth measured from FSDP1's own
storages: ``python -m torch.distributed.run ... fsdp1_memory_worker.py OUT``.

Truth: FSDP1 all-gathers each FlatParameter into its padded unsharded flat parameter
(``_full_param_padded``); SHARD_GRAD_OP keeps every unit's from its forward to its backward,
FULL_SHARD only the root's. Their storages' bytes after a forward, and the local shards'
bytes, are read here directly.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

import tpkit as tp

STEPS, WARMUP = 4, 2


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = torch.nn.Linear(32, 96), torch.nn.Linear(96, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.l2(torch.relu(self.l1(x)))


def build(strategy: ShardingStrategy, orig: bool) -> tuple[FSDP, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(13, 32), Block(), Block(), torch.nn.Linear(32, 1))
    model = FSDP(net, auto_wrap_policy=ModuleWrapPolicy({Block}), sharding_strategy=strategy,
                 use_orig_params=orig, device_id=torch.device("cpu"))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def flat_params(model: FSDP) -> list[torch.Tensor]:
    return [m._handle.flat_param for m in model.modules() if isinstance(m, FSDP) and m._handle is not None]


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(rank)
    result: dict[str, dict] = {}
    for strategy, orig in ((ShardingStrategy.SHARD_GRAD_OP, False), (ShardingStrategy.FULL_SHARD, True)):
        model, opt = build(strategy, orig)
        flat = flat_params(model)
        shard = sum(f.untyped_storage().nbytes() for f in flat)  # sharded, outside forward
        kept: list[int] = []
        with tp.profile(steps=STEPS, warmup=WARMUP, name=f"fsdp1-{strategy.name}", progress=False,
                        clock_hz=0) as prof:
            for _ in range(STEPS + WARMUP + 4):
                x, y = torch.randn(8, 13, generator=g), torch.randn(8, 1, generator=g)
                loss = torch.nn.functional.mse_loss(model(x), y)
                kept.append(sum(f._full_param_padded.untyped_storage().nbytes() for f in flat))
                loss.backward()
                opt.step()
                opt.zero_grad()
        m = prof.run.memory
        exits = m[(m["step"] >= 0) & (m["phase"] == "forward") & (m["event"] == "exit")]
        by_cat = exits.groupby("category")["bytes"].median()
        result[strategy.name] = {"shard": shard, "kept": kept[WARMUP:WARMUP + STEPS],
                                 "parameters": int(by_cat.get("parameters", 0)),
                                 "activations": int(by_cat.get("activations", 0)),
                                 "notes": prof.run.meta["notes"]}
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
