"""What does watching cost? Step time of a small MLP and of the built-in transformer,
plain vs under tpkit vs under torch.profiler (CPU activities), measured in one run.

Rounds interleave the three so that a noisy neighbour hits all of them alike; each figure
is the median over every step of every round. Prints the ratios against the plain loop.

    python benchmarks/overhead.py [--rounds 5] [--steps 30]
"""

from __future__ import annotations

import argparse
import statistics
from contextlib import nullcontext

import torch
from common import machine, quantiles, step_times, training_step, versions, write_rows

import tpkit as tp
from tpkit.demo import make_training


def mlp_setup():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, 512), torch.randn(64, 512)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x.repeat(50, 1), y.repeat(50, 1)), batch_size=64)
    return model, data, opt, lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])


def transformer_setup():
    model, loader, opt = make_training()
    return model, loader, opt, lambda m, b: m(b["x"], b["y"])


MODES = {
    "plain": lambda n: nullcontext(),
    "tpkit (phases)": lambda n: tp.profile(steps=n, warmup=0, stop=False, progress=False, memory=False, clock_hz=0),
    "tpkit (default)": lambda n: tp.profile(steps=n, warmup=0, stop=False, progress=False),
    "torch.profiler (CPU)": lambda n: torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    rows = []
    for workload, setup in [("mlp 512-1024-512 b64", mlp_setup), ("tiny transformer", transformer_setup)]:
        step = training_step(*setup())
        step_times(step, 10)  # warm caches and the allocator
        times: dict[str, list[float]] = {m: [] for m in MODES}
        for _ in range(args.rounds):
            for mode, ctx in MODES.items():
                with ctx(args.steps):
                    times[mode] += step_times(step, args.steps)
        base = statistics.median(times["plain"])
        print(f"\n{workload}: plain step {base * 1e3:.2f} ms (median of {len(times['plain'])})")
        for mode, ts in times.items():
            p20, p50, p80 = quantiles(ts)
            print(f"  {mode:22s} {p50 * 1e3:8.2f} ms   ratio {p50 / base:.3f}x")
            rows.append({"op": "train_step", "workload": workload, "peer": mode, "p20_ms": p20 * 1e3,
                         "p50_ms": p50 * 1e3, "p80_ms": p80 * 1e3, "ratio_vs_plain": p50 / base,
                         "machine": machine(), "versions": versions()})
    print(f"\nrows written to {write_rows('overhead', rows)}")


if __name__ == "__main__":
    main()
