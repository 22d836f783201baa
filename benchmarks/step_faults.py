"""Page faults inside a loop's steps, without a profiler and under tpkit: what a step pays for
memory touched for the first time (docs/OVERHEAD.md, "Instructions, caches and pages").

A page touched for the first time costs a minor fault (the kernel maps and zeroes it): 1.8-4.3 us on
this project's 2-core VM, against 0.09 us for a second touch. Each mode runs in fresh processes,
taking turns (a process's heap decides whether the loop's own frees give pages back between steps,
so the spread across processes is printed, not only the median), and each counts the faults
(``getrusage``) and the time of its steps after the first ``--skip``. The cost of one fault is
measured in the parent first, on an anonymous mapping.

    python benchmarks/step_faults.py [--loop hf_gpt2_2l] [--processes 6] [--steps 200]
"""

from __future__ import annotations

import argparse
import json
import mmap
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODES = ("none", "tpkit phases only", "tpkit default")


def fault_cost_us(pages: int = 8192) -> tuple[float, float]:
    """(first touch, second touch) of a page, in us: one byte written per page of a fresh
    anonymous mapping, by numpy (no Python loop in the timing)."""
    import numpy as np

    with mmap.mmap(-1, pages * mmap.PAGESIZE) as m:
        every_page = np.frombuffer(m, dtype=np.uint8)[::mmap.PAGESIZE]
        t0 = time.perf_counter()
        every_page[:] = 1
        t1 = time.perf_counter()
        every_page[:] = 2
        t2 = time.perf_counter()
        del every_page  # (the mapping closes only once no view of it is left)
    return (t1 - t0) / pages * 1e6, (t2 - t1) / pages * 1e6


def child(loop_name: str, mode: str, steps: int, skip: int) -> None:
    """One process: the loop under ``mode`` (``overhead.py``'s loops and modes); prints JSON with
    the faults and ms a step from step ``skip`` on."""
    sys.path.insert(0, str(HERE))
    import overhead

    faults: list[int] = []
    end_step = overhead.Record.end_step

    def counted_end_step(self: "overhead.Record") -> None:
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
        end_step(self)

    overhead.Record.end_step = counted_end_step  # type: ignore[method-assign]
    loop = overhead.LOOPS[loop_name]()
    rec = loop.run(steps + skip, overhead._mode_factory(mode)(steps + skip, 0))
    n = len(rec.ends) - 1 - skip
    print(json.dumps({"faults": (faults[-1] - faults[skip]) / n, "ms": (rec.ends[-1] - rec.ends[skip]) / n * 1e3}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loop", default="hf_gpt2_2l")
    ap.add_argument("--processes", type=int, default=6, help="fresh processes per mode")
    ap.add_argument("--steps", type=int, default=200, help="steps counted per process")
    ap.add_argument("--skip", type=int, default=30, help="steps left out at the start")
    ap.add_argument("--child", nargs=2, metavar=("LOOP", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child[0], args.child[1], args.steps, args.skip)
        return
    sys.path.insert(0, str(HERE))
    from common import load_avg, machine

    print(f"{machine()}; load average at start {' / '.join(f'{x:.2f}' for x in load_avg())}")
    first, second = fault_cost_us()
    print(f"a page's first touch {first:.2f} us, a second touch {second:.2f} us")
    got: dict[str, list[dict]] = {m: [] for m in MODES}
    for _ in range(args.processes):
        for mode in MODES:  # (in turn: the host's speed moves over minutes)
            out = subprocess.run([sys.executable, __file__, "--child", args.loop, mode, "--steps", str(args.steps),
                                  "--skip", str(args.skip)], capture_output=True, text=True, check=True)
            got[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"{args.loop}, {args.processes} processes a mode, steps {args.skip}-{args.skip + args.steps}:")
    print(f"{'mode':<20} {'faults a step: median':>22} {'[min-max]':>16} {'ms a step':>10} {'faults x first touch':>22}")
    for mode in MODES:
        faults = sorted(r["faults"] for r in got[mode])
        ms = statistics.median(r["ms"] for r in got[mode])
        med = statistics.median(faults)
        print(f"{mode:<20} {med:>22.1f} {f'[{faults[0]:.1f}-{faults[-1]:.1f}]':>16} {ms:>10.2f} "
              f"{med * first / 1e3 / ms * 100:>20.2f} %")


if __name__ == "__main__":
    main()
