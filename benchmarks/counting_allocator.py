"""What exact CPU memory costs a step from tpkit's CPU allocation counter against torch's
profiler stream, per allocator event.

tpkit counted CPU memory from torch's profiler memory stream until session 29: the CPU
allocator reports every allocation and free to the profiler, about 0.2 us each inside a real
step (docs/OVERHEAD.md), most of what the default profile cost a short step. Since then the
default is tpkit's allocation counter (``tpkit/capture/probes/allocator_counter.py``: a C++
allocator in front of torch's that keeps each block's size in a header and lists every
allocation and free of the recording thread), built at first use. Session 17 measured the idea
with a prototype in this script; it now measures the counter tpkit ships.

Modes, switched on and off inside one training run (benchmarks/interleave.py, blocks of 3 + 12
steps), on the bare step of a GPT-2 (forward, backward, AdamW; no Trainer):

  none              nothing
  profiler stream   tpkit's CpuAllocatorStream (the default before, and where the counter
                    cannot be built or an accelerator is present)
  counting          tpkit's CpuAllocatorCounter recording (in front of the CPU allocator for
                    the whole run once it first went in: every mode's calls pass through it,
                    so only the recording is compared)

    python benchmarks/counting_allocator.py [--layers 2] [--threads 1] [--budget 240]

Prints each mode's ratio to none (median of paired blocks, 95% interval), their quotient, the
events a step each saw (the same count: both see every CPU allocation and free) and the cost
per event.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import interleave  # noqa: E402

MODES = ("profiler stream", "counting")
GPT2: dict[str, Any] = dict(vocab_size=1000, n_positions=64, n_embd=64, n_head=4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steadier on a 2-core VM)")
    ap.add_argument("--budget", type=float, default=240.0, help="seconds of blocks")
    ap.add_argument("--skip", type=int, default=3)
    ap.add_argument("--block", type=int, default=12)
    args = ap.parse_args()

    from transformers import GPT2Config, GPT2LMHeadModel

    from tpkit.capture.probes import allocator_counter
    from tpkit.capture.probes.memory import CpuAllocatorStream

    t0 = time.perf_counter()
    ext, why, _ = allocator_counter.load()
    if ext is None:  # no compiler, no ninja: say so and stop
        sys.exit(f"could not build tpkit's allocation counter ({why}); it needs a C++ compiler and ninja")
    counter = allocator_counter.CpuAllocatorCounter(ext)
    print(f"built or loaded in {time.perf_counter() - t0:.1f} s; torch {torch.__version__}, {args.threads} thread(s), "
          f"GPT-2 {args.layers} layers, blocks of {args.skip} + {args.block} steps, {args.budget:.0f} s")
    torch.set_num_threads(args.threads)
    counter.start()  # in front from now on
    counter.stop()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=args.layers, **GPT2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, GPT2["vocab_size"], (8, 64))

    def step() -> float:
        t = time.perf_counter()
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - t

    for _ in range(10):
        step()
    events: dict[str, list[float]] = {m: [] for m in MODES}
    blocks: list[interleave.Block] = []
    t_end = time.perf_counter() + args.budget
    cycle_len = 2 * len(MODES)
    for i, mode in enumerate(interleave.schedule(MODES, 10_000)):
        if i > 1 and (i - 1) % cycle_len == 0 and time.perf_counter() > t_end:
            break  # a whole cycle ended (its closing none block) past the budget
        cycle = max(i - 1, 0) // cycle_len
        stream = None
        if mode == "profiler stream":
            stream = CpuAllocatorStream()
            stream.start()
        elif mode == "counting":
            counter.start()
        block = interleave.Block(mode, cycle)
        for k in range(args.skip + args.block):
            dt = step()
            if k >= args.skip:
                block.steps.append(dt)
        n_steps = args.skip + args.block
        if stream is not None:
            events[mode].append(len(stream.stop()) / n_steps)
        elif mode == "counting":
            events[mode].append(len(counter.stop()) / n_steps)
        blocks.append(block)
    cycles = (len(blocks) - 1) // cycle_len
    pairs = interleave.paired_ratios(blocks)
    none_ms = statistics.median(s for b in blocks if b.mode == interleave.BASE for s in b.steps) * 1e3
    print(f"{cycles} cycles; none {none_ms:.2f} ms/step")
    for mode in MODES:
        est = interleave.estimate([r for _, r in pairs[mode]])
        ev = statistics.median(events[mode])
        assert est is not None
        per_event_ns = (est.value - 1) * none_ms * 1e6 / ev
        print(f"  {mode:16s} {est.text()} vs none; {ev:,.0f} events a step; ~{per_event_ns:.0f} ns an event")
    q = interleave.quotient(pairs["counting"], pairs["profiler stream"])
    if q is not None:
        print(f"  counting / profiler stream, cycle by cycle: {q.text()}")


if __name__ == "__main__":
    main()
