"""``for batch in loader`` with worker processes starts them in ``iter(loader)``, every epoch
unless they are persistent: the loop waits for its data there too. That wait is the epoch's
first step's ``data_wait``; it had been ``other`` (a 2-worker loader of two batches an epoch
lost 44% of its data wait). torchdata's ``StatefulDataLoader`` replaces both the ``__iter__``
and the workers' shutdown of torch's: the same holds for it (its start-up had been other: data
wait 304 ms of 687 over a slice).

Truth: the loop's own clock around ``iter()`` and ``next()``.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
import truth
from truth import STEPS, TOLERANCE, WARMUP

import tpkit as tp


def _stateful_loader() -> type:
    return pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader


LOADERS = {"torch": lambda: torch.utils.data.DataLoader, "torchdata-stateful": _stateful_loader}


@pytest.mark.parametrize("loader_class", LOADERS)
@pytest.mark.parametrize("persistent", [False, True], ids=["workers-each-epoch", "persistent-workers"])
def test_starting_the_workers_is_data_wait(persistent, loader_class):
    torch.manual_seed(0)
    model = truth.SleepyNet()
    opt = truth.SleepySGD(model.parameters(), lr=0.01)
    loader = LOADERS[loader_class]()(torch.utils.data.Subset(truth.Regression(), range(16)), batch_size=8,
                                     collate_fn=truth.sleepy_collate, num_workers=2,
                                     persistent_workers=persistent)
    before = truth.hook_state()
    waits: list[float] = []
    with tp.profile(steps=STEPS, warmup=WARMUP, name="worker-start", progress=False, clock_hz=0) as prof:
        for x, y in truth.epochs_timed(loader, waits):  # epochs of two batches, until the slice ends
            F.mse_loss(model(x), y).backward()
            opt.step()  # the slice ends inside the last
            opt.zero_grad()
    run = prof.run
    truth.assert_hooks_removed(before)
    got, want = run.steps["data_wait_s"].tolist(), waits[: len(run.steps)]
    assert len(run.steps) == STEPS + WARMUP == len(want)
    for step, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w) <= TOLERANCE * w + 0.002, f"step {step}: data_wait {g * 1e3:.1f} ms, truth {w * 1e3:.1f} ms"
    # the loader's own settings, as the advice reads them (it had asked a persistent loader for
    # persistent_workers=True: the run did not say)
    assert run.meta["torch_loader"] == {"num_workers": 2, "batches": STEPS + WARMUP, "persistent_workers": persistent,
                                        "pin_memory": False, "prefetch_factor": 2, "batch_size": 8}


@pytest.mark.parametrize("loader_class", LOADERS)
def test_workers_shutting_down_where_an_epoch_is_left_unfinished_is_data_wait(loader_class):
    """An epoch left before its end (``next(iter(loader))`` each step, a ``break``, Lightning,
    which never calls the last ``next()``): the dropped iterator shuts its workers down there,
    and the loop waits for it (30-40 ms here). That wait is data_wait; it had been other, 21-28%
    of a step read as "Python between phases"."""
    torch.manual_seed(0)
    model = truth.SleepyNet()
    opt = truth.SleepySGD(model.parameters(), lr=0.01)
    loader = LOADERS[loader_class]()(truth.Regression(), batch_size=8, collate_fn=truth.sleepy_collate,
                                     num_workers=2)
    before = truth.hook_state()
    waits: list[float] = []
    with tp.profile(steps=STEPS, warmup=WARMUP, name="worker-stop", progress=False, clock_hz=0) as prof:
        while True:
            t = time.perf_counter()
            it = iter(loader)
            batch = next(it)
            del it  # its workers shut down here
            waits.append(time.perf_counter() - t)
            F.mse_loss(model(batch[0]), batch[1]).backward()
            opt.step()
            opt.zero_grad()
    run = prof.run
    truth.assert_hooks_removed(before)
    got = run.steps["data_wait_s"].tolist()
    assert len(got) == STEPS + WARMUP
    for step, (g, w) in enumerate(zip(got, waits)):
        assert abs(g - w) <= TOLERANCE * w + 0.002, f"step {step}: data_wait {g * 1e3:.1f} ms, truth {w * 1e3:.1f} ms"


def test_a_watched_loaders_start_each_epoch_is_data_wait():
    """``tp.watch(loader)`` at each epoch calls ``iter(loader)``, where a loader starts its
    pipeline (here a 50 ms sleep): the loop waits for its data there, as in a DataLoader's
    ``iter()``. It had been other (a torchdata.nodes Loader's ~50 ms each epoch).
    Truth: the loop's own clock around ``tp.watch()`` and ``next()``."""

    class SlowStart:
        def __iter__(self):  # noqa: ANN204
            time.sleep(0.05)
            return iter([torch.zeros(4, 2)] * 2)

    class Watched:  # the loop's `for batch in tp.watch(loader)`, epoch after epoch
        def __iter__(self):  # noqa: ANN204
            return tp.watch(SlowStart())

    waits: list[float] = []
    with tp.profile(steps=4, warmup=0, progress=False, clock_hz=0) as prof:
        for _ in truth.epochs_timed(Watched(), waits):  # epochs of two batches, until the slice ends
            tp.step()
    got = prof.run.steps["data_wait_s"].tolist()
    assert len(got) == 4
    for step, (g, w) in enumerate(zip(got, waits)):
        assert abs(g - w) <= 0.15 * w + 0.002, f"step {step}: data_wait {g * 1e3:.1f} ms, truth {w * 1e3:.1f} ms"
    assert min(got[0::2]) >= 0.05  # each epoch's start



def _slow_collate(samples: list) -> tuple[torch.Tensor, torch.Tensor]:
    """40 ms a batch in its worker."""
    time.sleep(0.04)
    return torch.utils.data.default_collate(samples)


def test_warmup_auto_waits_for_the_loaders_queue_to_drain():
    """One worker queues 8 batches (prefetch_factor=8) while the first step is slow (400 ms): the
    loop then takes ready batches at its own pace (12 ms) until the queue is empty, and only then
    at the loader's (40 ms a batch). ``--warmup auto`` had settled on the drain's steps and
    measured them (758 samples/s for a steady 440, with no word). The measured steps come after
    the queue, at the pace the worker makes batches.
    Truth: the loop's own clock at each step's end and the collate's known sleep."""
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.utils.data.TensorDataset(torch.randn(4096, 4), torch.randn(4096, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=8, num_workers=1, prefetch_factor=8,
                                         collate_fn=_slow_collate)
    clocks: list[float] = []
    with tp.profile(steps=6, warmup="auto", progress=False, clock_hz=0) as prof:
        clocks.append(time.perf_counter())
        for i, (x, y) in enumerate(loader):
            time.sleep(0.4 if i == 0 else 0.012)
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            clocks.append(time.perf_counter())
    run = prof.run
    loop = [b - a for a, b in zip(clocks, clocks[1:])]
    drained = next((i for i in range(8, len(loop)) if loop[i] > 0.03), 8)  # its first step at the loader's pace
    warmup = run.meta["warmup_steps"]
    assert warmup > drained, f"warmup {warmup}, the loop's clocks: {[round(t * 1e3) for t in loop]}"
    measured = run.measured_steps
    assert measured.duration_s.median() > 0.04 * 0.8, measured.duration_s.tolist()
    assert measured.samples.sum() / measured.duration_s.sum() <= 8 / 0.04 * 1.1  # the worker's pace at most
    assert any(n.startswith(f"warmup auto: ended after {warmup} steps") for n in run.meta["notes"])


def test_the_training_loaders_settings_where_another_loader_reads_the_same_dataset():
    """A one-off pass over the training set with a loader of its own (no workers, batches of
    512) before training through a 2-worker persistent loader over the same Dataset object:
    meta['torch_loader'] had described the first one, its num_workers (0) too, and the advice
    reads it ("now 0", persistent_workers). Truth: the training loader's own arguments."""
    ds = torch.utils.data.TensorDataset(torch.randn(1024, 8), torch.randn(1024, 1))
    once = torch.utils.data.DataLoader(ds, batch_size=512)
    train = torch.utils.data.DataLoader(ds, batch_size=16, num_workers=2, persistent_workers=True, prefetch_factor=4)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with tp.profile(steps=STEPS, warmup=WARMUP, name="two-loaders", progress=False, clock_hz=0) as prof:
        model.eval()
        with torch.no_grad():
            for x, _ in once:
                model(x)
        model.train()
        for x, y in train:
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    assert prof.run.meta["torch_loader"] == {"num_workers": 2, "batches": STEPS + WARMUP, "persistent_workers": True,
                                             "pin_memory": False, "prefetch_factor": 4, "batch_size": 16}


@pytest.mark.parametrize("workers, prefetch, batches", [(3, 8, 4096), (2, 8, 10)],
                         ids=["queue-deeper-than-the-cap", "epoch-shorter-than-the-queue"])
def test_warmup_auto_settles_where_nothing_filled_the_queue(workers, prefetch, batches):
    """A loop steady at 30 ms a step from its first, with a loader faster than it: its queue
    (``num_workers`` x ``prefetch_factor``: 24, deeper than the 20-step cap; or 16, deeper than
    an epoch of 10 batches, each ``iter()`` emptying it) distorts nothing, as no slow step let
    the workers run ahead. ``--warmup auto`` had waited for 24 (16) handouts and always run to the
    cap, saying the queue "could still be draining". It settles after a few steps.
    Truth: the loop's own clock around its work."""
    model = torch.nn.Linear(4, 1)
    data = torch.utils.data.TensorDataset(torch.randn(8 * batches, 4), torch.randn(8 * batches, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=8, num_workers=workers, prefetch_factor=prefetch,
                                         persistent_workers=True)
    own: list[float] = []
    with tp.profile(steps=4, warmup="auto", progress=False, clock_hz=0) as prof:
        for _epoch in range(8):
            for x, y in loader:
                t = time.perf_counter()
                time.sleep(0.03)
                F.mse_loss(model(x), y)
                own.append(time.perf_counter() - t)
                tp.step()
    assert max(own) < 0.06, [round(t * 1e3) for t in own]  # steady from the first step
    run = prof.run
    warmup = run.meta["warmup_steps"]
    assert warmup < 12, run.meta["notes"]
    assert f"warmup auto: ended after {warmup} steps (step times settled)" in run.meta["notes"]


def test_a_validation_loaders_workers_shutting_down_after_a_break_are_the_evaluations():
    """An evaluation every other step reads two batches of a 2-worker validation loader and
    ``break``s out: the dropped iterator shuts its workers down inside the evaluation. That wait
    is the evaluation's (``eval``), not training's ``data_wait``: it had been the next training
    batch's (a plain loop's eval_s 0.400 s for 0.492 s by its clock, 0.087 s of shutdowns added to
    data_wait; ignite's evaluator, which drops its iterator at the epoch's length, alike). A
    training loader's own shutdown stays data_wait (the test above). Truth: the loop's clock
    around each ``next()`` of the training loader and around the whole evaluation."""
    torch.manual_seed(0)
    model = truth.SleepyNet()
    opt = truth.SleepySGD(model.parameters(), lr=0.01)
    train = torch.utils.data.DataLoader(truth.Regression(), batch_size=8, collate_fn=truth.sleepy_collate)
    val = torch.utils.data.DataLoader(truth.Regression(), batch_size=8, num_workers=2)
    waits: list[float] = []
    evaluated: list[float] = []
    with tp.profile(steps=STEPS, warmup=WARMUP, name="val-break", progress=False, clock_hz=0) as prof:
        it = iter(train)
        for step in range(STEPS + WARMUP + 1):
            t = time.perf_counter()
            x, y = next(it)
            waits.append(time.perf_counter() - t)
            F.mse_loss(model(x), y).backward()
            opt.step()  # the slice ends inside the last
            opt.zero_grad()
            if step % 2 == 1:
                t = time.perf_counter()
                model.eval()
                with torch.no_grad():
                    for j, (vx, _) in enumerate(val):
                        model(vx)
                        if j == 1:
                            break  # its workers shut down here
                model.train()
                evaluated.append(time.perf_counter() - t)
    run = prof.run
    shutdowns = run.spans[run.spans["source"] == "DataLoader._shutdown_workers"]
    assert len(shutdowns) == len(evaluated) and set(shutdowns["phase"]) == {"eval"}, shutdowns
    got = run.steps["data_wait_s"].tolist()
    assert len(got) == STEPS + WARMUP
    for step, (g, w) in enumerate(zip(got, waits)):
        assert abs(g - w) <= TOLERANCE * w + 0.002, f"step {step}: data_wait {g * 1e3:.1f} ms, truth {w * 1e3:.1f} ms"
    eval_s, want = float(run.steps["eval_s"].sum()), sum(evaluated)
    assert abs(eval_s - want) <= TOLERANCE * want, f"eval {eval_s * 1e3:.1f} ms, truth {want * 1e3:.1f} ms"
