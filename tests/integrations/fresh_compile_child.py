"""A cell that compiles a model and trains it, in a process where ``torch._dynamo`` was never
imported before the slice; used by ``test_compile.py`` in a process of its own. argv: the way it
compiles, the folder the run is saved to:

- ``call``: ``torch.compile(model)`` inside the slice (it imports dynamo: seconds);
- ``held``: through ``torch.compile`` as a library held it before the slice (tpkit does not see
  the call), dynamo first imported inside the slice by making the optimizer;
- ``thread``: the loop trains eagerly and compiles nothing; a helper thread compiles a function
  through the held reference for several shapes during the loop's first step (before tpkit's
  callbacks go in at its end): none of those compilations is the loop's.
- ``step``: the model eager, the optimizer step compiled inside the slice (``@torch.compile def
  step_fn(): opt.step()``), the loop's clock taken before each forward and its losses.

Prints one JSON line: the truth, from the loop's own clocks (around the ``torch.compile`` call
and around each model call) and dynamo's compilation records (read after the slice)."""

from __future__ import annotations

import json
import sys
import threading
import time

import torch
import torch.nn.functional as F

import tpkit as tp

how, folder = sys.argv[1], sys.argv[2]
assert "torch._dynamo" not in sys.modules
held_compile = torch.compile  # (``held``: a library's reference, taken at its import)
torch.set_num_threads(1)
torch.manual_seed(0)
forward_s: list[float] = []
call_s = 0.0
iterations = 0
losses: list[float] = []
marks: list[float] = []  # the loop's clock before each forward
WARMUP, STEPS = 1, 3
with tp.profile(steps=STEPS, warmup=WARMUP, name=f"fresh-{how}", progress=False, clock_hz=0) as prof:
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    helper = None
    if how == "thread":
        def compile_aside() -> None:
            f = held_compile(lambda v: (v.sin() + v.cos()).sum(), backend="eager")
            for n in range(1, 4):
                f(torch.randn(n * 3))  # a new shape: compiled again

        opt = torch.optim.SGD(model.parameters(), lr=0.01)  # (it imports dynamo, before the helper runs)
        helper = threading.Thread(target=compile_aside)
        helper.start()
        cmodel = model
    elif how == "step":
        cmodel = model
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        @torch.compile(backend="eager")
        def step_fn() -> None:
            opt.step()
    elif how == "held":
        opt = torch.optim.SGD(model.parameters(), lr=0.01)  # (it imports dynamo)
        cmodel = held_compile(model, backend="eager")
    else:
        t = time.perf_counter()
        cmodel = torch.compile(model, backend="eager")
        call_s = time.perf_counter() - t
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(WARMUP + STEPS + (2 if how == "step" else 0)):  # (step: the slice stops it)
        iterations += 1
        x, y = torch.randn(32, 16), torch.randn(32, 1)
        time.sleep(0.03)
        if helper is not None:
            helper.join()  # (in the first step: the loop waits, compiling nothing)
            helper = None
        t = time.perf_counter()
        marks.append(t)
        out = cmodel(x)
        forward_s.append(time.perf_counter() - t)
        loss = F.mse_loss(out, y)
        loss.backward()
        losses.append(loss.item())
        if how == "step":
            step_fn()
        else:
            opt.step()
        opt.zero_grad()
prof.run.save(folder)
from torch._dynamo.utils import get_compilation_metrics  # noqa: E402

records = [dict(forward=r.is_forward is not False, seconds=(r.end_time_us - r.start_time_us) / 1e6)
           for r in get_compilation_metrics() if r.start_time_us and r.end_time_us]
print(json.dumps(dict(call_s=call_s, forward_s=forward_s, records=records, torch_compile_back=torch.compile is held_compile,
                      iterations=iterations, losses=losses, marks=marks, warmup=WARMUP, steps=STEPS)))
