"""Where a loader's CPU goes, process by process: how busy the main process and each worker are
over the timed batches, and what the whole tree spends per 1,000 samples, against one plain
loop doing the same work alone (no loader) and two at once (loader.py's ceiling).

It answers why a workload stays under its ceiling: a loader whose workers are busy all the
time and whose main process is near idle hands batches over for almost nothing; what is left
then is the work itself running slower beside another process (shared caches, memory
bandwidth, the host), which two plain loops at once pay too.

    python benchmarks/loader_cpu_split.py [--workload numpy_1ms] [--rounds 3] [--workers 2]

Each measurement runs in a fresh process (the peers in turn, round by round); prints medians
over the rounds and writes benchmarks/results/loader_cpu_split.csv.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
PEERS = ("torch", "tpkit", "tpkit main waits", "plain x1", "plain parallel")


def _cpu_by_process(me) -> dict[int, float]:
    """User + system CPU seconds of this process and each live child, by pid (loader.py's
    ``_cpu_tree_s`` is their sum)."""
    import loader as lb

    out = {}
    for p in lb._tree(me):
        try:
            t = p.cpu_times()
            out[p.pid] = t.user + t.system
        except Exception:  # noqa: BLE001 - a child that exits while listed is simply gone
            pass
    return out


def measure(workload: str, peer: str, workers: int) -> dict:
    """In the child: the timed batches of one loader (or plain loop), with each process's CPU."""
    import loader as lb
    import psutil
    import torch

    import tpkit.datasets as tds

    torch.set_num_threads(1)
    cls, kw, bs, n_batches = lb.WORKLOADS[workload]
    ds = getattr(tds, cls)(**kw)
    if peer.startswith("plain"):
        m = lb.measure_plain(ds, bs, workers if peer == "plain parallel" else 1, n_batches, 5.0, 1e9)
        return {"samples_per_s": m["samples_per_s"], "cpu_ms_per_ksample": m["cpu_ms_per_ksample"],
                "main_busy": None, "worker_busy": []}
    me = psutil.Process()
    lb.import_peer(peer)
    loader, shutdown = lb.make_loader(peer, ds, bs, workers)
    it = iter(loader)
    lb._touch(next(it))
    before, t0, n = _cpu_by_process(me), time.perf_counter(), 0
    for i, b in enumerate(it):
        lb._touch(b)
        n += len(b[1]) if isinstance(b, (list, tuple)) else len(b["y"])
        if i + 1 >= n_batches:
            break
    wall = time.perf_counter() - t0
    after = _cpu_by_process(me)
    shutdown()
    used = {pid: after[pid] - before.get(pid, 0.0) for pid in after}
    return {"samples_per_s": n / wall, "cpu_ms_per_ksample": 1e6 * sum(used.values()) / n,
            "main_busy": used.pop(me.pid) / wall, "worker_busy": sorted(v / wall for v in used.values())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="numpy_1ms")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--one", nargs=2, metavar=("WORKLOAD", "PEER"))
    args = ap.parse_args()
    sys.path.insert(0, str(HERE))
    if args.one:
        print(json.dumps(measure(args.one[0], args.one[1], args.workers)), flush=True)
        return
    from common import load_avg, machine, write_rows

    from tpkit.datasets import cost

    iters = cost.calibrate(trials=40)  # one calibration for every child: the same work everywhere
    env = {**os.environ, cost.ENV_VAR: f"{iters:.3f}"}
    print(f"{machine()}; load average {load_avg()[0]:.2f}; {args.workload}, {args.workers} workers, "
          f"{args.rounds} rounds; {iters:.1f} work iterations per ms", flush=True)
    got: dict[str, list[dict]] = {p: [] for p in PEERS}
    for r in range(args.rounds):
        for peer in PEERS:
            out = subprocess.run([sys.executable, __file__, "--workers", str(args.workers), "--one",
                                  args.workload, peer], env=env, capture_output=True, text=True, timeout=300)
            if out.returncode != 0:
                sys.exit(f"{peer} failed:\n{out.stderr[-3000:]}")
            got[peer].append({**json.loads(out.stdout.strip().splitlines()[-1]), "round": r})
    med = statistics.median
    torch_rate = med(m["samples_per_s"] for m in got["torch"])
    alone = med(m["cpu_ms_per_ksample"] for m in got["plain x1"])
    print(f"\n{'peer':18s} {'samples/s':>10s} {'vs torch':>8s} {'cpu ms/1k':>9s} {'vs alone':>8s} "
          f"{'main busy':>9s}  workers busy")
    rows = []
    for peer in PEERS:
        ms = got[peer]
        rate, cpu = med(m["samples_per_s"] for m in ms), med(m["cpu_ms_per_ksample"] for m in ms)
        main_busy = [m["main_busy"] for m in ms if m["main_busy"] is not None]
        busy = [med(w) for w in zip(*(m["worker_busy"] for m in ms))] if ms[0]["worker_busy"] else []
        print(f"{peer:18s} {rate:10,.0f} {rate / torch_rate:7.2f}x {cpu:9.0f} {cpu / alone:7.2f}x "
              f"{(f'{med(main_busy):.2f}' if main_busy else '-'):>9s}  {' '.join(f'{b:.2f}' for b in busy) or '-'}")
        rows += [{"workload": args.workload, "peer": peer, "workers": args.workers, "round": m["round"],
                  "samples_per_s": m["samples_per_s"], "cpu_ms_per_ksample": m["cpu_ms_per_ksample"],
                  "main_busy": m["main_busy"], "worker_busy": " ".join(f"{b:.4f}" for b in m["worker_busy"]),
                  "machine": machine()} for m in ms]
    print("  busy: CPU time over the timed batches' wall time (1.00: a whole core); cpu ms/1k: the main "
          "process and its workers per 1,000 samples; vs alone: over one plain loop alone")
    write_rows("loader_cpu_split", rows)


if __name__ == "__main__":
    main()
