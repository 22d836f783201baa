"""What does a DataLoader worker forked inside a slice pay for tpkit after the slice? A module
called in ``__getitem__`` (a transform written as an ``nn.Module``, as torchvision's v2 transforms
are) is timed in the persistent workers of two loaders over one dataset:

- ``forked inside a slice``: the loader's workers start in ``iter(loader)`` inside
  ``tp.profile``; they are timed in later epochs, after the slice ended;
- ``forked outside`` (the peer): a loader whose workers start with no slice running.

The two loaders' epochs take turns, ``--rounds`` times; each epoch's figure is the median
nanoseconds per module call over its samples. Prints both medians and their ratio (1.00x: the
worker runs as without tpkit; before session 50 the route stayed in the worker: 4.6 us against
2.1).

    python benchmarks/forked_workers.py [--rounds 15] [--calls 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import tpkit as tp


class Timed(torch.utils.data.Dataset):
    """Samples of one value: the mean nanoseconds of ``calls`` calls of an ``nn.Identity``."""

    def __init__(self, n: int, calls: int) -> None:
        self.n, self.calls = n, calls
        self.augment = torch.nn.Identity()
        self.x = torch.zeros(4)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        t0 = time.perf_counter_ns()
        for _ in range(self.calls):
            self.augment(self.x)
        return torch.tensor([(time.perf_counter_ns() - t0) / self.calls])


def epoch_ns(loader: torch.utils.data.DataLoader) -> float:
    """The median nanoseconds a module call took in the workers over one epoch."""
    return statistics.median(float(v) for batch in loader for v in batch.flatten())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    ds = Timed(64, args.calls)

    def loader() -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(ds, batch_size=8, num_workers=2, persistent_workers=True)

    inside, outside = loader(), loader()
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with tp.profile(steps=4, warmup=1, progress=False, clock_hz=0, stop=False):
        for batch in inside:  # its workers are forked here
            model(batch).sum().backward()
            opt.step()
            opt.zero_grad()
    epoch_ns(outside)  # its workers are forked here, with no slice running
    a, b = [], []
    for _ in range(args.rounds):
        a.append(epoch_ns(inside))
        b.append(epoch_ns(outside))
    ratio = statistics.median(x / y for x, y in zip(a, b))
    print(f"module call in a worker forked inside a slice, after it: {statistics.median(a):.0f} ns")
    print(f"module call in a worker forked outside (peer):           {statistics.median(b):.0f} ns")
    print(f"ratio (median of {args.rounds} paired epochs): {ratio:.2f}x")


if __name__ == "__main__":
    main()
