"""tpkit.data.Loader vs torch's DataLoader, same worker count, three workloads, one run.

    python benchmarks/loader.py [--workers 2] [--repeats 3] [--workloads tiny,numpy_1ms,images]

Each measurement runs in a fresh subprocess (so peak memory and start-up are its own):
time to first batch from constructing the loader, then samples/s over the following batches, while
the loop touches one byte per 4 KiB page of every tensor (as training would read it).
Peak memory is the largest sum of PSS (proportional set size: a shared page counts once in
total) over the main process and its workers, sampled every 20 ms; the CSV also keeps the
peak sum of RSS (which counts a shared page once per process mapping it).
CPU ms per 1,000 samples (main + workers) is printed too: on a shared machine it is the
steadier measure of what each loader costs. Prints ratios (tpkit / torch, medians over repeats) and writes long-format rows to
benchmarks/results/loader.csv.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

WORKLOADS = {
    # name: (dataset factory args, batch_size, batches timed)
    "tiny": ("TinySamples", {"n": 200_000}, 64, 1500),
    "numpy_1ms": ("NumpyWork", {"n": 20_000, "cpu_ms": 1.0}, 32, 50),
    "images": ("Images", {"n": 20_000}, 32, 60),
}
GOALS = {"tiny": 2.0, "numpy_1ms": 1.0, "images": 1.5}


def _touch(obj) -> None:
    import torch
    if isinstance(obj, torch.Tensor):
        flat = obj.reshape(-1).view(torch.uint8) if obj.numel() else obj
        if flat.numel():
            step = 4096
            flat[::step].sum()
    elif isinstance(obj, dict):
        for v in obj.values():
            _touch(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _touch(v)


def _rss_tree_bytes(proc) -> int:
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except Exception:
            pass
    return total


def _cpu_tree_s(proc) -> float:
    """User + system CPU seconds of the process and its live workers."""
    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except Exception:
            pass
    return total


def _pss_tree_bytes(proc) -> int:
    """Proportional set size of the process and its workers: shared pages (shared-memory
    batches, pages shared since fork) are split between the processes that map them, so
    the sum counts each page once."""
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            with open(f"/proc/{p.pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) * 1024
                        break
        except OSError:
            pass
    return total


def measure_one(workload: str, peer: str, workers: int) -> dict:
    """Runs in the child process."""
    import psutil
    import torch
    import tpkit.datasets as tds

    torch.set_num_threads(1)
    cls, kw, bs, n_batches = WORKLOADS[workload]
    ds = getattr(tds, cls)(**kw)
    me = psutil.Process()
    peak = [_pss_tree_bytes(me)]
    peak_rss = [_rss_tree_bytes(me)]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.02):
            peak[0] = max(peak[0], _pss_tree_bytes(me))
            peak_rss[0] = max(peak_rss[0], _rss_tree_bytes(me))

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    from torch.utils.data import DataLoader
    from tpkit.data import Loader
    t0 = time.perf_counter()  # first batch counted from construction: nothing starts earlier
    if peer == "torch":
        loader = DataLoader(ds, batch_size=bs, shuffle=True, num_workers=workers,
                            generator=torch.Generator().manual_seed(0))
    elif peer == "tpkit":
        loader = Loader(ds, batch_size=bs, shuffle=True, num_workers=workers, seed=0)
    else:
        raise ValueError(peer)
    it = iter(loader)
    b = next(it)
    _touch(b)
    first_s = time.perf_counter() - t0
    del b
    t1 = time.perf_counter()
    cpu0 = _cpu_tree_s(me)
    n = 0
    for i, b in enumerate(it):
        _touch(b)
        n += bs
        if i + 1 >= n_batches:
            break
    dt = time.perf_counter() - t1
    cpu_s = _cpu_tree_s(me) - cpu0  # workers still alive: their CPU time is still readable
    del b, it
    stop.set()
    th.join()
    peak[0] = max(peak[0], _pss_tree_bytes(me))
    peak_rss[0] = max(peak_rss[0], _rss_tree_bytes(me))
    return {"samples_per_s": n / dt, "first_batch_s": first_s,
            "cpu_ms_per_ksample": 1e6 * cpu_s / n, "peak_pss_bytes": peak[0],
            "peak_rss_bytes": peak_rss[0]}


def _versions() -> str:
    import torch
    return f"torch={torch.__version__};python={platform.python_version()}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--one", nargs=2, metavar=("WORKLOAD", "PEER"))
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "loader.csv"))
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure_one(args.one[0], args.one[1], args.workers)))
        return

    machine = f"{platform.machine()} {os.cpu_count()} cpus {platform.node()}"
    rows = []
    results: dict = {}
    for wl in args.workloads.split(","):
        for r in range(args.repeats):
            for peer in (("torch", "tpkit") if r % 2 == 0 else ("tpkit", "torch")):
                out = subprocess.run([sys.executable, __file__, "--one", wl, peer,
                                      "--workers", str(args.workers)],
                                     capture_output=True, text=True, timeout=600)
                if out.returncode != 0:
                    print(out.stderr, file=sys.stderr)
                    raise SystemExit(f"{wl}/{peer} failed")
                m = json.loads(out.stdout.strip().splitlines()[-1])
                results.setdefault((wl, peer), []).append(m)
                rows.append({"op": "loader", "workload": wl, "peer": peer, "workers": args.workers,
                             "repeat": r, **m, "machine": machine, "versions": _versions()})

    def med(xs):
        xs = sorted(xs)
        return xs[len(xs) // 2]

    print(f"{'workload':<10} {'torch/s':>10} {'tpkit/s':>10} {'ratio':>6} {'goal':>5} "
          f"{'first torch':>11} {'first tpkit':>11} {'cpu ms/1k torch':>15} {'tpkit':>6} "
          f"{'PSS torch':>10} {'PSS tpkit':>10}")
    for wl in args.workloads.split(","):
        t, k = results[(wl, "torch")], results[(wl, "tpkit")]
        rt, rk = med([m["samples_per_s"] for m in t]), med([m["samples_per_s"] for m in k])
        ft, fk = med([m["first_batch_s"] for m in t]), med([m["first_batch_s"] for m in k])
        pt, pk = med([m["peak_pss_bytes"] for m in t]), med([m["peak_pss_bytes"] for m in k])
        ct, ck = med([m["cpu_ms_per_ksample"] for m in t]), med([m["cpu_ms_per_ksample"] for m in k])
        print(f"{wl:<10} {rt:>10,.0f} {rk:>10,.0f} {rk / rt:>5.2f}x {GOALS[wl]:>4.1f}x "
              f"{ft * 1e3:>9.1f}ms {fk * 1e3:>9.1f}ms {ct:>15.1f} {ck:>6.1f} "
              f"{pt / 2**20:>8.0f}MB {pk / 2**20:>8.0f}MB")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {len(rows)} rows to {args.out}")


if __name__ == "__main__":
    main()
