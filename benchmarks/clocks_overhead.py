"""What does clock sampling cost? Step time of the built-in tiny transformer under tpkit with
the clock sampler at 20 Hz vs off, in one run (goal: at most 1% of step time).

Rounds alternate the two (ABBA order, so drift and a noisy neighbour hit both alike); the
figure is the median over every step of every round, plus the median of per-round ratios.
Wall time on a shared 2-core VM moves by several percent from round to round, more than the
effect measured, so the script also prints the sampler's own CPU time (``thread_time`` of
the sampler thread, from ``run.meta["clocks"]``): the cost it can put on the machine at most.

    python benchmarks/clocks_overhead.py [--rounds 6] [--steps 20] [--hz 20]
"""

from __future__ import annotations

import argparse
import os
import statistics

from common import machine, quantiles, step_times, transformer_step, versions, write_rows

import tpkit as tp


def make_step():
    return transformer_step()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--hz", type=float, default=20.0)
    args = ap.parse_args()
    on, off = f"clocks {args.hz:g} Hz", "clocks off"
    step = make_step()
    step_times(step, 10)  # warm caches and the allocator
    times: dict[str, list[float]] = {on: [], off: []}
    round_ratios, cpu_shares, samples = [], [], []
    for r in range(args.rounds):
        medians = {}
        for mode in ((on, off) if r % 2 == 0 else (off, on)):
            hz = args.hz if mode == on else 0.0
            with tp.profile(steps=args.steps, warmup=0, stop=False, progress=False, memory=False, clock_hz=hz) as prof:
                ts = step_times(step, args.steps)
            times[mode] += ts
            medians[mode] = statistics.median(ts)
            if mode == on:
                info = prof.run.meta["clocks"]
                cpu_shares.append(info["sampler_cpu_share"])
                samples.append(info["samples"])
        round_ratios.append(medians[on] / medians[off])
    base = statistics.median(times[off])
    ratio = statistics.median(times[on]) / base
    cores = os.cpu_count() or 1
    cpu_share = statistics.median(cpu_shares)
    print(f"tiny transformer, {args.rounds} rounds x {args.steps} steps, {machine()}")
    rows = []
    for mode, ts in times.items():
        p20, p50, p80 = quantiles(ts)
        print(f"  {mode:14s} step p50 {p50 * 1e3:7.2f} ms (p20 {p20 * 1e3:.2f}, p80 {p80 * 1e3:.2f})")
        rows.append({"op": "train_step", "workload": "tiny transformer", "peer": mode, "p20_ms": p20 * 1e3,
                     "p50_ms": p50 * 1e3, "p80_ms": p80 * 1e3, "ratio_vs_off": p50 / base,
                     "machine": machine(), "versions": versions()})
    print(f"  ratio on/off (median step): {ratio:.4f}x ({(ratio - 1) * 100:+.2f}%)")
    print(f"  ratio on/off (median of per-round ratios): {statistics.median(round_ratios):.4f}x "
          f"(rounds {min(round_ratios):.3f}..{max(round_ratios):.3f})")
    print(f"  sampler CPU: {cpu_share * 100:.3f}% of one core = {cpu_share / cores * 100:.3f}% of the "
          f"{cores}-core machine ({statistics.median(samples)} samples per slice)")
    rows.append({"op": "sampler_cpu", "workload": "tiny transformer", "peer": on, "p20_ms": float("nan"),
                 "p50_ms": float("nan"), "p80_ms": float("nan"), "ratio_vs_off": 1 + cpu_share / cores,
                 "machine": machine(), "versions": versions()})
    print(f"rows written to {write_rows('clocks_overhead', rows)}")


if __name__ == "__main__":
    main()
