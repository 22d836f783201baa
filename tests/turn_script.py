"""A script that takes turns (benchmarks/turns.py) with a known step: it sleeps ``step_ms`` a step,
or exits with code 3 at its second block when ``step_ms`` is negative (a script that dies)."""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from turns import TurnTaker  # noqa: E402

args = dict(zip(sys.argv[2::2], sys.argv[3::2]))  # after the step: --turns DIR --turn-name NAME
step_s = float(sys.argv[1]) / 1e3
runner = TurnTaker(args["--turns"], args["--turn-name"], skip=1, block=4, clock=time.perf_counter)
runner.start()
while True:
    if step_s < 0 and runner.blocks == 1:
        sys.exit(3)
    time.sleep(abs(step_s))
    if not runner.step_end():
        break
