"""Many slices in one IPython shell through the magic, default probes, dashboard shown
(run as a subprocess by test_soak.py). Prints one JSON line per checkpoint: slice index, RSS,
threads, open fds, tpkit hooks and /dev/shm segments of this process."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).parent))

from leftovers import diff, snapshot  # noqa: E402

SETUP = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
data = torch.utils.data.TensorDataset(torch.randn(512, 32), torch.randn(512, 1))
loader = torch.utils.data.DataLoader(data, batch_size=16)
"""
LOOP = """
for _ in range(100):
    for x, y in loader:
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
"""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--slices", type=int, default=200)
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--flags", default="", help="extra %%tp_profile options, e.g. ' --quiet'")
    args = ap.parse_args()
    from IPython.testing.globalipapp import start_ipython

    ip = start_ipython()
    ip.run_line_magic("load_ext", "tpkit")
    ip.run_cell(SETUP)
    proc = psutil.Process()
    before = None
    t0 = time.perf_counter()
    for i in range(args.slices):
        result = ip.run_cell(f"%%tp_profile --steps 3 --warmup 1 --name soak{i}{args.flags}\n{LOOP}", silent=True)
        if not result.success:
            print(json.dumps({"error": repr(result.error_in_exec or result.error_before_exec)}), flush=True)
            return 1
        if i == 0:
            before = snapshot()
        if i % args.every == 0 or i == args.slices - 1:
            left = diff(before, snapshot())
            print(json.dumps({"slice": i, "rss_mb": proc.memory_info().rss / 2**20, "threads": proc.num_threads(),
                              "fds": proc.num_fds(), "left": sorted(left), "seconds": time.perf_counter() - t0}),
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
