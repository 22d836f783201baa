"""A loop under ``tp.profile`` that receives SIGTERM (as torchrun sends every surviving rank
when one fails) in the loop or while tpkit takes its probes out and builds the run; used by
``tests/test_faults.py`` in a process of its own. argv: where ("loop", "teardown", "reused":
in the loop of a Profile that ran a slice before, or "start": after a Ctrl-C while the probes
went in, in the code that runs next), the
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

if where == "start":  # a Ctrl-C lands while the probes go in; later, unprofiled code gets SIGTERM
    import tpkit.capture.slice as slice_module

    real_timer = slice_module.maybe_cuda_timer

    def maybe_cuda_timer():  # noqa: ANN202 - the first thing installed
        os.kill(os.getpid(), signal.SIGINT)
        return real_timer()

    slice_module.maybe_cuda_timer = maybe_cuda_timer
    try:
        with tp.profile(steps=5, warmup=0, name="sigterm-start", progress=False, clock_hz=0):
            print("not reached: the Ctrl-C is raised as the slice starts", flush=True)
    except KeyboardInterrupt:
        pass
    slice_module.maybe_cuda_timer = real_timer
    print("sending", flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    print("not reached: SIGTERM ends the process", flush=True)
    sys.exit(0)

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
