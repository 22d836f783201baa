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
ratio of each step time to the no-probe one. ``--gpt2`` also sets a phases-only profile of the
2-layer GPT-2 step of benchmarks/overhead.py (no Trainer) on the plain model against the same
profile on the model wrapped in DDP, with and without the probe (``comm=True`` / ``False``: at one
rank a slice leaves collectives untimed by default, since session 22), each paired with its own
model's unprofiled blocks (``--find-unused``: wrapped as the Hugging Face Trainer wraps it).

    python benchmarks/comm_probe.py [--budget 60] [--gpt2 [--find-unused]]
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

import tpkit as tp
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


def _phases_only(with_comm: bool) -> Callable[[], Callable[[], Any]]:
    """A phases-only slice (``tp.profile``, memory and clocks off), timing collectives or not
    (``comm``: at one rank a slice does not by default); returns what ends it."""

    def start() -> Callable[[], Any]:
        prof = tp.profile(steps=10**9, warmup=0, memory=False, clocks=False, stop=False, progress=False,
                          comm=with_comm)
        prof.__enter__()
        return lambda: prof.__exit__(None, None, None)

    return start


def _gpt2_steps(find_unused: bool) -> dict[str, Callable[[], None]]:
    """One training step of the 2-layer GPT-2 of benchmarks/overhead.py (no Trainer), plain and
    wrapped in DistributedDataParallel (``find_unused``: as the Hugging Face Trainer wraps it)."""
    import transformers
    from overhead import GPT2, HF_BATCH, SEQ_LEN
    from transformers import GPT2Config, GPT2LMHeadModel

    transformers.logging.set_verbosity_error()
    x = torch.randint(0, GPT2["vocab_size"], (HF_BATCH, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    out = {}
    for name in ("plain", "DDP"):
        torch.manual_seed(0)
        model: torch.nn.Module = GPT2LMHeadModel(GPT2Config(n_layer=2, **GPT2))
        if name == "DDP":
            model = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=find_unused)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(model: torch.nn.Module = model, opt: torch.optim.Optimizer = opt) -> None:
            model(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        out[name] = step
    return out


def paired_blocks(steps: dict[str, Callable[[], None]], variants: dict[str, tuple[str, Callable[[], Callable[[], Any]]]],
                  budget_s: float, kept: int, skip: int) -> tuple[dict[str, list[float]], dict[str, list[float]], list[float], int]:
    """Blocks of ``skip`` + ``kept`` steps of each variant (``(model, start)``: ``start()`` sets it
    up and returns what undoes it), each between two blocks of the same model with nothing set
    up, the order rotating each cycle. Per variant: us added a step and the ratio to the blocks
    around it; the baselines' us a step; the cycles run."""

    def block(model: str, start: Callable[[], Callable[[], Any]] | None) -> float:
        undo = start() if start else None
        try:
            for i in range(skip + kept):
                if i == skip:
                    t0 = time.perf_counter_ns()
                steps[model]()
            return (time.perf_counter_ns() - t0) / kept / 1e3
        finally:
            if undo:
                undo()

    for model in steps:
        block(model, None)
    names = list(variants)
    added: dict[str, list[float]] = {m: [] for m in names}
    ratio: dict[str, list[float]] = {m: [] for m in names}
    base: list[float] = []
    end, c = time.time() + budget_s, 0
    while time.time() < end:
        for name in names[c % len(names):] + names[:c % len(names)]:
            model, start = variants[name]
            a, b, d = block(model, None), block(model, start), block(model, None)
            added[name].append(b - (a + d) / 2)
            ratio[name].append(b / ((a + d) / 2))
            base.append((a + d) / 2)
        c += 1
    return added, ratio, base, c


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=60.0, help="seconds of blocks")
    ap.add_argument("--gpt2", action="store_true",
                    help="also the 2-layer GPT-2 step, plain and DDP-wrapped, profiled phases only with and "
                         "without the probe (blocks of 3 + 8 steps; --budget again)")
    ap.add_argument("--find-unused", action="store_true", help="with --gpt2: DDP(find_unused_parameters=True), "
                                                               "as the Hugging Face Trainer wraps its model")
    args = ap.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    rows = []
    try:
        torch.manual_seed(0)
        net = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 16))
        opt = torch.optim.SGD(net.parameters(), lr=0.0)
        x = torch.randn(8, 16)

        def tiny() -> None:
            net(x).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        added, ratio, base, c = paired_blocks({"tiny": tiny}, {m: ("tiny", f) for m, f in MODES.items()},
                                              args.budget, STEPS_PER_BLOCK, SKIP)
        print(f"{machine()}; {versions()}; DDP(Linear(16, 16)) at one rank, gloo: one all-reduce a step")
        print(f"no probe: {statistics.median(base):.0f} us a step; {c} cycles of blocks of {STEPS_PER_BLOCK} steps")
        for mode in MODES:
            e, r = estimate(added[mode]), estimate(ratio[mode])
            print(f"  {mode:42s} +{e.value:6.1f} us a collective [{e.lo:.1f}-{e.hi:.1f}]  "
                  f"{r.value:.3f}x no probe [{r.lo:.3f}-{r.hi:.3f}]  ({e.n} blocks)")
            rows.append({"part": "per collective", "mode": mode, "us_per_collective": e.value, "us_lo": e.lo,
                         "us_hi": e.hi, "ratio_vs_no_probe": r.value, "blocks": e.n})
        if args.gpt2:
            variants = {"plain, phases only": ("plain", _phases_only(True)),
                        "DDP, phases only": ("DDP", _phases_only(True)),
                        "DDP, phases only without the comm probe": ("DDP", _phases_only(False))}
            _, ratio, base, c = paired_blocks(_gpt2_steps(args.find_unused), variants, args.budget, 8, 3)
            print(f"\n2-layer GPT-2 step (forward, backward, AdamW; no Trainer), DDP at one rank"
                  f"{' with find_unused_parameters=True' if args.find_unused else ''}: "
                  f"{statistics.median(base) / 1e3:.2f} ms a step without a profile; {c} cycles")
            for name in variants:
                r = estimate(ratio[name])
                print(f"  {name:42s} {r.value:.3f}x its model without a profile [{r.lo:.3f}-{r.hi:.3f}]")
                rows.append({"part": "gpt2" + (" find_unused" if args.find_unused else ""), "mode": name,
                             "ratio_vs_no_probe": r.value, "ratio_lo": r.lo, "ratio_hi": r.hi, "blocks": r.n})
            names = list(variants)
            for num, den in ((names[1], names[0]), (names[2], names[0]), (names[1], names[2])):
                q = estimate([a / b for a, b in zip(ratio[num], ratio[den])])
                print(f"  {num} / {den}: {q.value:.3f} [{q.lo:.3f}-{q.hi:.3f}]")
    finally:
        dist.destroy_process_group()
    for row in rows:
        row.update(machine=machine(), versions=versions())
    print(f"rows written to {write_rows('comm_probe', rows)}")


if __name__ == "__main__":
    main()
