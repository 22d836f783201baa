"""How fast does tpkit collate a batch's plain numbers? ``tpkit.data.collate.fast_default_collate``
against torch's ``default_collate`` (the peer) on the same batches, in turns, best of rounds:
a field of 64 ints, one of 64 floats, and a whole 64-sample ``(float[8], int)`` batch (the
loader benchmark's tiny workload). The two give the same tensors (tests/test_data_collate.py).

    python benchmarks/collate.py [--rounds 7] [--calls 20000]
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable

import torch
from common import machine, versions, write_rows
from torch.utils.data import default_collate

from tpkit.data.collate import fast_default_collate

CASES: dict[str, Callable[[], Any]] = {
    "64 ints": lambda: [k % 10 for k in range(64)],
    "64 floats": lambda: [k * 0.25 for k in range(64)],
    "64 (float[8], int) samples": lambda: [(torch.full((8,), float(k)), k % 10) for k in range(64)],
}
PEERS = {"torch default_collate": default_collate, "tpkit fast_default_collate": fast_default_collate}


def per_call_us(fn: Callable[[Any], Any], batch: Any, calls: int) -> float:
    t = time.perf_counter()
    for _ in range(calls):
        fn(batch)
    return (time.perf_counter() - t) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=20_000)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"{machine()}; {versions()}; best of {args.rounds} rounds x {args.calls:,} calls, the two in turns")
    rows = []
    for case, make in CASES.items():
        batch = make()
        best = {name: float("inf") for name in PEERS}
        for r in range(args.rounds):
            for name in (PEERS if r % 2 == 0 else reversed(list(PEERS))):
                best[name] = min(best[name], per_call_us(PEERS[name], batch, args.calls))
        peer, ours = best["torch default_collate"], best["tpkit fast_default_collate"]
        print(f"  {case:28s} torch {peer:7.2f} us   tpkit {ours:7.2f} us   {ours / peer:.2f}x torch's time")
        for name, us in best.items():
            rows.append({"op": "collate", "case": case, "peer": name, "us_per_call": us,
                         "ratio_vs_torch": us / peer, "machine": machine(), "versions": versions()})
    print(f"wrote {len(rows)} rows to {write_rows('collate', rows)}")


if __name__ == "__main__":
    main()
