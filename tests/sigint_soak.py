"""Real SIGINTs at random instants over many slices (run as a subprocess by test_faults.py).

Each slice gets one Ctrl-C from a timer thread, at a random moment between its start and a
little after its usual end, so it lands in setup, steps, teardown, building the Run or after.
After each slice: nothing tpkit installed may remain, and the last run is kept. Prints
``interrupted=N clean=M`` last.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from leftovers import diff, snapshot  # noqa: E402
from test_faults import make, train  # noqa: E402

import tpkit as tp  # noqa: E402


def one_slice() -> None:
    model, loader, opt = make()
    with tp.profile(steps=4, warmup=1, progress=False, clock_hz=50):
        train(model, loader, opt)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--slices", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    one_slice()  # one-time costs paid
    t0 = time.perf_counter()
    one_slice()  # the usual length of a slice
    usual_s = time.perf_counter() - t0
    before = snapshot()
    interrupted = clean = 0
    for i in range(args.slices):
        timer = threading.Timer(rng.uniform(0.0, 1.3 * usual_s), os.kill, (os.getpid(), signal.SIGINT))
        try:
            try:
                timer.start()
                one_slice()
                time.sleep(0.2 * usual_s)  # a late Ctrl-C lands here, outside the slice
            finally:
                timer.cancel()
                timer.join()
        except KeyboardInterrupt:
            interrupted += 1
        left = diff(before, snapshot())
        if left:
            print(f"slice {i}: left behind {left}", flush=True)
            return 1
        if tp.last_run() is None:
            print(f"slice {i}: no run kept", flush=True)
            return 1
        clean += 1
    print(f"interrupted={interrupted} clean={clean} usual_s={usual_s:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
