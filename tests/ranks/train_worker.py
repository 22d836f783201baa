"""One rank of a multi-rank training launched by torchrun on CPU gloo (tests/ranks/test_ranks_train.py).

    python -m torch.distributed.run --nproc-per-node N tests/ranks/train_worker.py OUT \\
        --framework ddp,fsdp2 --delay-phase data_wait,forward --delay-rank 1 --delay-ms 150

For each framework in turn (ddp, fsdp2 or zero2; the delay phases pair with them in order), each
rank trains the same tiny MLP twice from the same seed on the same batches: once plain, once
inside ``tp.profile(steps=..., warmup=..., save_dir=OUT/<framework>)`` (the public API; the Run
lands in ``OUT/<framework>/rank<k>``). One rank sleeps ``delay-ms`` in one phase of every step:
in ``data_wait`` (the DataLoader's collate) or in ``forward`` (a module at the front of the
model), so the other ranks wait for it at their next collective. Writes
``OUT/<framework>/losses/rank<k>.json`` with both runs' losses.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

import tpkit as tp


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--framework", default="ddp", help="comma-separated: ddp, fsdp2, zero2")
    ap.add_argument("--delay-rank", type=int, default=1)
    ap.add_argument("--delay-phase", default="data_wait", help="comma-separated, one per framework: "
                    "data_wait, forward or none")
    ap.add_argument("--delay-ms", type=float, default=150.0)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--memory", default="", help="comma-separated on/off, one per framework: "
                    "tp.profile(memory=...) (default: on for every framework)")
    return ap.parse_args()


class Delay(torch.nn.Module):
    """Sleeps in forward when ``seconds`` > 0 (the injected straggler on one rank)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.seconds > 0:
            time.sleep(self.seconds)
        return x


class Batches(torch.utils.data.Dataset):
    """Per-rank deterministic samples, the first ``n`` of one fixed pool: ``x`` [16], ``y`` [4]."""

    POOL = 512

    def __init__(self, rank: int, n: int) -> None:
        g = torch.Generator().manual_seed(1000 + rank)
        x, y = torch.randn(self.POOL, 16, generator=g), torch.randn(self.POOL, 4, generator=g)
        self.x, self.y = x[:n], y[:n]

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def loader(rank: int, n_batches: int, collate_sleep_s: float) -> torch.utils.data.DataLoader:
    def collate(items: list) -> tuple[torch.Tensor, torch.Tensor]:
        if collate_sleep_s > 0:
            time.sleep(collate_sleep_s)
        return torch.stack([a for a, _ in items]), torch.stack([b for _, b in items])

    return torch.utils.data.DataLoader(Batches(rank, 8 * n_batches), batch_size=8, collate_fn=collate)


def build(framework: str, forward_sleep_s: float) -> tuple[object, object]:
    """(model, optimizer); for zero2 the DeepSpeed engine and None."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(Delay(forward_sleep_s), torch.nn.Linear(16, 64), torch.nn.ReLU(),
                              torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    if framework == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(net)
        return model, torch.optim.SGD(model.parameters(), lr=0.05)
    if framework == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for i in (1, 3, 5):
            fully_shard(net[i])
        fully_shard(net)
        return net, torch.optim.SGD(net.parameters(), lr=0.05)
    import deepspeed

    cfg = {"train_batch_size": 8 * dist.get_world_size(), "train_micro_batch_size_per_gpu": 8,
           "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True}
    engine, _, _, _ = deepspeed.initialize(model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.05),
                                           config=cfg)
    return engine, None


def train(framework: str, model: object, opt: object, batches: object, losses: list[float]) -> None:
    """The user's loop, unchanged by tpkit: it runs until the data ends or tpkit stops it."""
    for x, y in batches:
        loss = torch.nn.functional.mse_loss(model(x), y)
        losses.append(float(loss.detach()))
        if framework == "zero2":
            model.backward(loss)
            model.step()
        else:
            loss.backward()
            opt.step()
            opt.zero_grad()


def run_case(framework: str, delay_phase: str, memory: bool, a: argparse.Namespace, rank: int) -> None:
    delay_s = a.delay_ms / 1e3 if rank == a.delay_rank else 0.0
    collate_s = delay_s if delay_phase == "data_wait" else 0.0
    forward_s = delay_s if delay_phase == "forward" else 0.0
    n = a.warmup + a.steps
    out = Path(a.out) / framework

    model, opt = build(framework, forward_s)
    plain: list[float] = []
    train(framework, model, opt, loader(rank, n, collate_s), plain)
    dist.barrier()

    model, opt = build(framework, forward_s)
    batches = loader(rank, n + 4, collate_s)  # more than the slice: tpkit stops the loop
    profiled: list[float] = []
    with tp.profile(steps=a.steps, warmup=a.warmup, name=framework, progress=False, clocks=False,
                    memory=memory, save_dir=str(out)) as prof:
        train(framework, model, opt, batches, profiled)
    recorded = [float(v) for v in prof.run.steps["loss"]]
    (out / "losses").mkdir(parents=True, exist_ok=True)
    (out / "losses" / f"rank{rank}.json").write_text(json.dumps({
        "rank": rank, "framework": framework, "plain": plain, "profiled": profiled, "recorded": recorded,
        "delay_s": delay_s, "delay_phase": delay_phase, "pid": os.getpid()}))
    dist.barrier()


def main() -> None:
    faulthandler.enable(all_threads=True)  # an abort prints every thread's Python stack
    a = parse()
    frameworks, phases = a.framework.split(","), a.delay_phase.split(",")
    memory = [m == "on" for m in a.memory.split(",")] if a.memory else [True] * len(frameworks)
    if not len(phases) == len(memory) == len(frameworks):
        raise SystemExit("--delay-phase and --memory need one value per framework")
    torch.set_num_threads(1)  # a tiny op after a sleep waits for the pool otherwise (docs/MEASURED.md)
    if "zero2" in frameworks:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    for framework, phase, mem in zip(frameworks, phases, memory):
        run_case(framework, phase, mem, a, rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
