"""Own-process contenders taking turns (benchmarks/turns.py) without TraceML's launcher: checks
the method and takes a slice's cost apart by length. Each contender is ``name=flags`` (flags of
overhead.py's child, separated by ``|``; empty: a second baseline, an A/A check), paired with a
baseline process (no profiler) in interleave.schedule's rotating order.

    python benchmarks/turns_check.py hf_gpt2_2l 120 "aa="                      # A/A: should read 1.000x
    python benchmarks/turns_check.py hf_gpt2_2l 200 "slices=--mode|tpkit default|--slice-per-block" \\
        "one=--mode|tpkit default" "stream=--mode|tpkit memory off + stream"

Prints each contender's paired ratio [95% interval], and its ratios over the run in windows of
10 cycles (a cost that grows with a profile's length shows there)."""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
from pathlib import Path

import overhead as ov
from interleave import BASE, estimate, paired_ratios
from turns import Turns


def main() -> None:
    loop, budget_s, contenders = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
    base = [sys.executable, str(ov.HERE), "--child", "--loops", loop, "--skip", "3", "--block", "8",
            "--threads", str(ov.torch.get_num_threads())]
    cmds, names = {"baseline": base}, []
    for c in contenders:
        name, flags = c.split("=", 1)
        cmds[name] = base + (flags.split("|") if flags else [])
        names.append(name)
    who = {BASE: "baseline", **{n: n for n in names}}
    logs = Path(tempfile.mkdtemp(prefix="tpkit-turns-check-"))
    with Turns(cmds, {**os.environ, "PYTHONPATH": str(ov.HERE.parent)}, ov.HERE.parent, logs) as turns:
        turns.wait_ready(timeout_s=600)
        blocks, _, took_s = turns.run(who, budget_s)
    pairs = paired_ratios(blocks)
    print(f"{loop}, {ov.machine()}, {len(blocks)} blocks in {took_s:.0f} s (logs: {logs})")
    for n in names:
        p = [r for _, r in pairs[n]]
        print(f"{n:<10} {estimate(p).text()}  by 10 cycles: "
              + " ".join(f"{statistics.median(p[i:i + 10]):.3f}" for i in range(0, len(p), 10)))


if __name__ == "__main__":
    main()
