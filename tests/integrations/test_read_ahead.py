"""A loop that reads one batch ahead of the one it trains on (timm's ``PrefetchLoader`` and the
CUDA-prefetcher recipes keep the next batch while the model trains on this one): its first step
is handed two batches and every later step one. The second batch of the first step is the next
step's: counted as the first step's samples, a slice with no warmup read 20% more samples/s than
the loop trained.

Truth: the batches the loop trained on (8 samples each).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import truth

import tpkit as tp
from tpkit.capture.read_ahead import read_ahead

BATCH = 8


def prefetching(loader):  # noqa: ANN001, ANN201
    """timm's ``PrefetchLoader`` shape: read the next batch, then hand over the previous one."""
    first, prev = True, None
    for batch in loader:
        if not first:
            yield prev
        first, prev = False, batch
    if prev is not None:
        yield prev


def test_a_prefetching_loop_counts_the_batches_it_trains_on():
    torch.manual_seed(0)
    model = truth.SleepyNet()
    opt = truth.SleepySGD(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(truth.Regression(), batch_size=BATCH, collate_fn=truth.sleepy_collate)
    trained = []
    with tp.profile(steps=5, warmup=0, name="prefetching", progress=False, clock_hz=0) as prof:
        for x, y in prefetching(loader):
            trained.append(len(x))
            F.mse_loss(model(x), y).backward()
            opt.step()  # the slice ends inside the fifth
            opt.zero_grad()
    run = prof.run
    assert run.steps["samples"].tolist() == trained == [BATCH] * 5
    assert run.summary().throughput == pytest.approx(sum(trained) / run.steps["duration_s"].sum())
    assert any(n.startswith("the first step was handed 1 batch(es) more than each later step")
               for n in run.meta["notes"]), run.meta["notes"]


def flat(*steps: list[int]) -> list[int]:
    """Recorder.handouts (t, samples, raw step) from each step's batch sizes."""
    out: list[int] = []
    for step, sizes in enumerate(steps):
        for n in sizes:
            out += [len(out), n, step]
    return out


@pytest.mark.parametrize("steps,evals,want", [
    (([8, 8], [8], [8], [8]), set(), (1, 8)),          # one batch ahead
    (([8, 8, 8], [8], [8]), set(), (2, 16)),           # two ahead
    (([8], [8], [8], [8]), set(), (0, 0)),             # no read-ahead
    (([8, 8], [8, 8], [8, 8]), set(), (0, 0)),         # two loaders, every step alike
    (([8, 8], [8], [8, 8]), set(), (0, 0)),            # later steps differ: nothing to go by
    (([8, 8], [8]), set(), (0, 0)),                    # too few steps to tell
    (([8, 16], [8], [8]), {1}, (0, 0)),                # the first step's second batch was evaluation's
])
def test_read_ahead_rule(steps, evals, want):
    assert read_ahead(flat(*steps), evals, len(steps)) == want
