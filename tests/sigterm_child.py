"""A loop under ``tp.profile`` that receives SIGTERM (as torchrun sends every surviving rank
when one fails) in the loop or while tpkit takes its probes out and builds the run; used by
``tests/test_faults.py`` in a process of its own. argv: where ("loop", "teardown", or "reused":
in the loop of a Profile that ran a slice before), the
store folder. Prints the steps recorded so far before each SIGTERM."""

from __future__ import annotations

import os
import signal
import sys

import torch

import tpkit as tp
from tpkit.capture import build

where, store = sys.argv[1], sys.argv[2]
tp.set_store(store)
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)

if where == "teardown":  # the signal lands inside build_run, after the probes came out
    real_build = build.build_run

    def build_run(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        os.kill(os.getpid(), signal.SIGTERM)
        return real_build(*args, **kwargs)

    build.build_run = build_run
    import tpkit.capture.slice as slice_module

    slice_module.build_run = build_run

prof = tp.profile(steps=50, warmup=1, name=f"sigterm-{where}", progress=False, clock_hz=0, stop=where == "teardown")
if where == "reused":  # the same Profile ran a slice before: SIGTERM in the next is as in a first one
    with prof:
        for _ in range(3):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
    where = "loop"
with prof:
    for i in range(60 if where == "loop" else 3):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
        if where == "loop" and i == 3:
            print("sending", flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
print("not reached: SIGTERM ends the process", flush=True)
