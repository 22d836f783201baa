"""What a phase boundary costs the memory probe where it walks the known sets: on a GPU (the CUDA
path reads the allocator's counters and walks the tensors at every boundary) and wherever no
CPU stream can be replayed. GPT-2 small's shape from a config (12 layers, 148 parameters, all
with gradients, AdamW's state), on the CPU: the walk is the same Python whatever the device.

Peer: the walk as it was until session 28 (``before_known_sets``, rebuilt here): every gradient's storage
walked at every boundary. Now the gradients are walked again only when a gradient tensor or
its address changed (``MemoryProbe._known_sets``). Both run on the same probe in turns,
``--repeats`` rounds of ``--calls`` calls; printed: the median time of a call of each, and the
ratio. A warm loop: inside a training step the caches are cold and both cost more.

    python benchmarks/memory_walk.py [--calls 200] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import load_avg, machine, versions, write_rows  # noqa: E402


def before_known_sets(probe: Any) -> dict:
    """The walk until session 28: parameters, optimizer state, buffers and tpkit's tensors when
    they changed, the gradients and the batch at every call."""
    from tpkit.capture.probes import memory as mem

    probe._refresh_params()
    key = (probe._params_version, probe._opt_fingerprint(), len(probe.rec.own_tensors))
    if probe._static_key != key:
        probe._static_key = key
        items: list = [(p, "parameters") for p in probe._live_params()]
        items += [(t, "optimizer_state") for t in probe._opt_state_tensors()]
        items += [(b, None) for b in probe._live_buffers()]
        items += [(t, mem._OWN) for t in probe.rec.own_tensors]
        probe._static_seen = set()
        probe._static_known = probe._count(items, probe._static_seen, {})
        probe._grads_key = ()  # the current walk's cache is built on these
    items = [(g, "gradients") for p in probe._live_params() if (g := p.grad) is not None]
    items += [(t, "data") for r in probe._batch if (t := r()) is not None]
    return probe._count(items, set(probe._static_seen) if items else probe._static_seen,
                        dict(probe._static_known))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    from tpkit.capture.probes import memory as mem
    from tpkit.capture.recorder import Recorder

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=12, n_embd=768, n_head=12))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, 50257, (1, 16))
    model(x, labels=x).loss.backward()
    opt.step()
    rec = Recorder("walk")
    rec.models[id(model)] = model
    probe = mem.MemoryProbe(rec)
    probe.optimizers[id(opt)] = opt
    assert probe._known_sets() == before_known_sets(probe)  # the same bytes either way
    print(f"{machine()};", f"load average at start {' / '.join(f'{x:.2f}' for x in load_avg())};", versions())
    print(f"GPT-2 small from a config: {len(probe._live_params())} parameters with gradients, AdamW state; "
          f"{args.repeats} rounds of {args.calls} calls each, in turns")
    walks = {"before (every gradient at every boundary)": lambda: before_known_sets(probe),
             "now (gradients again only when one changed)": probe._known_sets}
    times: dict[str, list[float]] = {name: [] for name in walks}
    for r in range(args.repeats):
        for name in (list(walks) if r % 2 else list(walks)[::-1]):
            fn = walks[name]
            fn()  # the first call of a turn builds what the other one dropped
            t0 = time.perf_counter_ns()
            for _ in range(args.calls):
                fn()
            times[name].append((time.perf_counter_ns() - t0) / args.calls / 1e3)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    for name, us in med.items():
        print(f"  {name:46s} {us:7.1f} us a boundary (rounds {min(times[name]):.1f}-{max(times[name]):.1f})")
    (b, n) = med.values()
    print(f"  now / before: {n / b:.2f}x")
    rows = [{"walk": name, "round": i, "us_per_call": t} for name, ts in times.items() for i, t in enumerate(ts)]
    path = write_rows("memory_walk", rows)
    print(f"wrote {len(rows)} rows to {path}")


if __name__ == "__main__":
    main()
