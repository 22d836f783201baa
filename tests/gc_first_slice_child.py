"""A fresh process's first slice (tests/test_api.py): the loop counts, with its own gc.callbacks,
the full (gen2) collections that run inside its measured iterations, and prints them as JSON."""
import gc
import json
import os
import sys
import time

os.environ.setdefault("TPKIT_RUNS", "off")
import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import tpkit as tp  # noqa: E402

torch.set_num_threads(1)
WARMUP, STEPS = 3, 20
where = [-1]  # the loop's iteration; -1 before it, -2 after it
full: list[tuple[int, float]] = []
started = [0.0]


def on_gc(phase: str, info: dict) -> None:
    if phase == "start":
        started[0] = time.perf_counter()
    elif info["generation"] == 2:
        full.append((where[0], time.perf_counter() - started[0]))


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = torch.nn.Linear(32, 64), torch.nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.005)
        return self.l2(torch.relu(self.l1(x)))


before = len(gc.get_objects())
prof = tp.profile(steps=STEPS, warmup=WARMUP, progress=False)  # (imports the capture)
gc.callbacks.append(on_gc)
with prof:
    start = {"objects": len(gc.get_objects()) - before, "pandas": "pandas" in sys.modules}
    torch.manual_seed(0)
    loader = DataLoader(TensorDataset(torch.randn(1024, 32), torch.randint(0, 10, (1024,))), batch_size=16)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        for i, (x, y) in enumerate(loader):
            where[0] = i
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            time.sleep(0.02)  # the loop's logger
    finally:
        where[0] = -2  # the slice's stop and end (building the Run) are no iteration's
gc.callbacks.remove(on_gc)
run = prof.run
print(json.dumps({"full": full, "start": start, "measured": [WARMUP, WARMUP + STEPS - 1],
                  "spans": [[int(s.step), s.duration_s] for s in run.spans[run.spans["phase"] == "gc"].itertuples()
                            if s.step >= 0 and s.duration_s > 0.05]}))
