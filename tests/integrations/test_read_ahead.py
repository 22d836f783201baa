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
from truth import STEPS, WARMUP

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


@pytest.mark.parametrize("pattern", ["zip-short", "break", "break-loader-made-anew"])
def test_batches_read_and_dropped_before_an_epoch_restart_are_not_samples(pattern):
    """``zip(loader_a, loader_b)`` where b runs out first reads a batch of a and drops it; a
    ``break`` at the top of an epoch's loop reads one more than it trains on, also where the
    loop makes its DataLoader anew each epoch (over the same Dataset: a restart of the loop's
    loader, which a key per loader had missed: 16 samples in each epoch's last step). Truth:
    the rows the model's forward got (they had counted the dropped batch: +13% and +60%
    samples/s)."""
    torch.manual_seed(0)
    model = truth.SleepyNet()
    opt = truth.SleepySGD(model.parameters(), lr=0.01)
    rows: list[int] = []
    model.register_forward_pre_hook(lambda _m, args: rows.append(int(args[0].shape[0])))
    a = torch.utils.data.DataLoader(truth.Regression(), batch_size=8, collate_fn=truth.sleepy_collate)
    b = torch.utils.data.DataLoader(torch.utils.data.Subset(truth.Regression(), range(24)), batch_size=8)

    def train(x: torch.Tensor, y: torch.Tensor) -> None:
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    with tp.profile(steps=STEPS, warmup=WARMUP, name=f"dropped-{pattern}", progress=False, clock_hz=0) as prof:
        while True:  # epochs until the slice ends
            if pattern == "zip-short":
                for (x1, y1), (x2, y2) in zip(a, b):  # b has 3 batches: the 4th of a is dropped
                    train(torch.cat([x1, x2]), torch.cat([y1, y2]))
            else:
                epoch = a if pattern == "break" else \
                    torch.utils.data.DataLoader(a.dataset, batch_size=8, collate_fn=truth.sleepy_collate)
                for i, (x, y) in enumerate(epoch):
                    if i == 2:
                        break
                    train(x, y)
    run = prof.run
    assert run.steps["samples"].tolist() == rows[: len(run.steps)]
    assert any("were read and dropped before any forward" in n
               for n in run.meta["notes"]), run.meta["notes"]


def test_another_loader_starting_again_drops_no_batch():
    """FixMatch style: the shorter unlabelled loader starts again (``iter()``) after the
    labelled batch was read and before the forward: that batch is trained on, not dropped (a rule
    that looked at any loader's restart had counted it out, 8, 8, 4 for 8 a step)."""
    torch.manual_seed(0)
    model = truth.SleepyNet()
    opt = truth.SleepySGD(model.parameters(), lr=0.01)
    labelled = torch.utils.data.DataLoader(truth.Regression(), batch_size=BATCH)
    unlabelled = torch.utils.data.DataLoader(torch.utils.data.Subset(truth.Regression(), range(8)), batch_size=4)
    with tp.profile(steps=STEPS, warmup=WARMUP, name="fixmatch", progress=False, clock_hz=0) as prof:
        u_it = iter(unlabelled)
        for x, y in labelled:
            try:
                u, _ = next(u_it)
            except StopIteration:
                u_it = iter(unlabelled)
                u, _ = next(u_it)
            (F.mse_loss(model(x), y) + model(u).pow(2).mean()).backward()
            opt.step()
            opt.zero_grad()
    run = prof.run
    assert (run.steps["samples"] == BATCH + 4).all(), run.steps["samples"].tolist()
    assert not any("were read and dropped" in n for n in run.meta["notes"])


def test_batches_replayed_by_itertools_cycle_are_said_to_be_unseen():
    """``itertools.cycle(loader)`` reads the loader once, then replays the batches it kept: the
    steps after the first epoch get no batch tpkit sees. Their samples are 0 and the run says so
    (samples/s had read 22.5 for 112 with no word); ``samples_per_step`` gives the truth."""
    import itertools

    torch.manual_seed(0)
    model = truth.SleepyNet()
    opt = truth.SleepySGD(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(torch.utils.data.Subset(truth.Regression(), range(24)), batch_size=BATCH)

    def run_with(**kw):  # noqa: ANN003, ANN202
        with tp.profile(steps=STEPS, warmup=WARMUP, name="cycle", progress=False, clock_hz=0, **kw) as prof:
            for x, y in itertools.cycle(loader):  # 3 batches an epoch
                F.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
        return prof.run

    run = run_with()
    assert run.steps["samples"].tolist() == [BATCH] * 3 + [0] * (STEPS + WARMUP - 3)
    assert any(n.startswith(f"{STEPS + WARMUP - 3} of {STEPS + WARMUP} steps ran a forward on no batch tpkit saw")
               for n in run.meta["notes"]), run.meta["notes"]
    given = run_with(samples_per_step=BATCH)
    assert (given.steps["samples"] == BATCH).all()
    assert not any("no batch tpkit saw" in n for n in given.meta["notes"])


class Flaky(torch.nn.Module):
    """A model whose forward raises at the given calls (a bad sample, a shape it cannot take)."""

    def __init__(self, fail_at: set[int]) -> None:
        super().__init__()
        self.net, self.calls, self.fail_at = truth.SleepyNet(), 0, fail_at

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls in self.fail_at:
            raise ValueError("bad batch")
        return self.net(x)


@pytest.mark.parametrize(("pattern", "fail_at"), [("middle", {4}), ("first", {1}), ("two in a row", {4, 5}),
                                                  ("two loaders zipped", {3})])
def test_a_batch_whose_forward_raised_and_was_skipped_is_no_sample(pattern, fail_at):
    """The loop catches an error of the forward and goes on to the next batch (``continue``):
    the skipped batch is none of the step's samples (a skip in a middle step had read 8 for 4
    trained, 12 for two in a row, with no word; in the first step the note blamed a prefetcher).
    Two loaders zipped (one forward on each batch, one backward) skip both batches. Truth: the
    samples of the batches the loop trained on in each step."""
    torch.manual_seed(0)
    model = Flaky(fail_at)
    opt = truth.SleepySGD(model.parameters(), lr=0.01)
    loaders = [torch.utils.data.DataLoader(truth.Regression(), batch_size=4)
               for _ in range(2 if pattern == "two loaders zipped" else 1)]
    trained: list[int] = []
    with tp.profile(steps=STEPS, warmup=WARMUP, name="skips", progress=False, clock_hz=0) as prof:
        for batches in zip(*loaders):
            try:
                loss = sum(F.mse_loss(model(x), y) for x, y in batches)
            except ValueError:
                continue
            loss.backward()
            trained.append(sum(len(x) for x, _ in batches))
            opt.step()
            opt.zero_grad()
    run = prof.run
    assert run.steps["samples"].tolist() == trained[: len(run.steps)]
    skipped = len(fail_at) * len(loaders)
    assert f"{skipped} batch(es) ({4 * skipped} samples) went to a forward that raised" in " ".join(run.meta["notes"])
    assert not any("reads ahead" in n for n in run.meta["notes"])


def test_a_batch_tried_again_after_its_forward_raised_is_the_steps():
    """An out-of-memory retry: the forward raises, the loop runs the same batch again in halves
    and backpropagates: the batch was trained on, it stays the step's, and no note says otherwise."""
    torch.manual_seed(0)
    model = Flaky({4})
    opt = truth.SleepySGD(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(truth.Regression(), batch_size=4)
    with tp.profile(steps=STEPS, warmup=WARMUP, name="retry", progress=False, clock_hz=0) as prof:
        for x, y in loader:
            try:
                loss = F.mse_loss(model(x), y)
            except ValueError:
                loss = sum(F.mse_loss(model(x[k:k + 2]), y[k:k + 2]) for k in (0, 2)) / 2
            loss.backward()
            opt.step()
            opt.zero_grad()
    run = prof.run
    assert run.steps["samples"].tolist() == [4] * (STEPS + WARMUP)
    assert not any("forward that raised" in n for n in run.meta["notes"])


def test_a_skipped_batch_in_a_loop_reading_one_ahead_is_the_failed_one():
    """A loop that takes its next batch before the forward on this one (a CUDA prefetcher's
    recipe): when that forward raises, the batch handed out since the last backward is the next
    one. It had been counted out instead of the failed one (a 5-sample batch out, the note said
    5 samples for a skipped 3; the steps read 2 samples fewer than the loop trained). The failed
    batch is told by its first tensor. Truth: the batches the loop trained on, 4 samples each,
    and the one it skipped, 3."""
    torch.manual_seed(0)
    sizes = [4, 4, 4, 4, 3, 5, 4, 4, 4, 4, 4, 4]  # the 5th batch (3 samples) fails, the 6th has 5
    data = [(torch.randn(n, 8), torch.randn(n, 1)) for n in sizes]
    model = Flaky({5})
    opt = truth.SleepySGD(model.parameters(), lr=0.01)
    trained: list[int] = []
    with tp.profile(steps=STEPS, warmup=WARMUP, name="skip-ahead", progress=False, clock_hz=0) as prof:
        batches = iter(torch.utils.data.DataLoader(data, batch_size=None))
        nxt = next(batches)
        while nxt is not None:
            x, y = nxt
            nxt = next(batches, None)  # read ahead, before the forward
            try:
                loss = F.mse_loss(model(x), y)
            except ValueError:
                continue
            loss.backward()
            trained.append(len(x))
            opt.step()
            opt.zero_grad()
    run = prof.run
    samples, want = run.steps["samples"].tolist(), trained[: len(run.steps)]
    assert want == [4, 4, 4, 4, 5, 4, 4]
    # each step counts the batch handed out in it, the next one (read_ahead.py): the skipped
    # 3 was handed out in step 3 and is counted out of step 4, whose forward it failed in
    assert samples == [4, 4, 4, 3, 6, 4, 4] and sum(samples) == sum(want)
    assert "1 batch(es) (3 samples) went to a forward that raised" in " ".join(run.meta["notes"])


@pytest.mark.parametrize("ahead", [False, True])
def test_a_skipped_batch_changed_before_its_forward(ahead):
    """The loop normalizes the batch before the forward (a new tensor, as a move to the GPU
    is): tpkit cannot tell the batch from its first tensor. Taking each batch after the last
    backward, the loop skipped the one handed out since: it is counted out (a guard: as before).
    Reading one batch ahead, that one is the next batch: nothing is counted out and a note says
    tpkit could not tell (it had counted out the next batch, the skipped one staying counted,
    with a note that said it was out). Truth: the samples of the batches the loop trained on,
    4 each; reading ahead, step 3 was handed two batches (the skipped one and the next)."""
    torch.manual_seed(0)
    model = Flaky({4})  # the 4th forward: step 3's first
    opt = truth.SleepySGD(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(truth.Regression(), batch_size=4)
    trained: list[int] = []

    def train(x: torch.Tensor, y: torch.Tensor) -> None:
        try:
            loss = F.mse_loss(model((x - x.mean()) / 2), y)
        except ValueError:
            return
        loss.backward()
        trained.append(len(x))
        opt.step()
        opt.zero_grad()

    with tp.profile(steps=STEPS, warmup=WARMUP, name="skip-changed", progress=False, clock_hz=0) as prof:
        batches = iter(loader)
        nxt = next(batches) if ahead else None
        for _ in range(STEPS + WARMUP + 2):  # a batch skipped, one to spare
            if ahead:
                (x, y), nxt = nxt, next(batches)
            else:
                x, y = next(batches)
            train(x, y)
    run = prof.run
    want = trained[: len(run.steps)]
    notes = " ".join(run.meta["notes"])
    if ahead:
        assert run.steps["samples"].tolist() == [4, 4, 4, 8, 4, 4, 4] and want == [4] * 7
        assert "1 forward(s) raised and the loop went on without a backward" in notes
        assert "went to a forward that raised" not in notes
    else:
        assert run.steps["samples"].tolist() == want == [4] * 7
        assert "1 batch(es) (4 samples) went to a forward that raised" in notes
        assert "tpkit could not tell" not in notes
