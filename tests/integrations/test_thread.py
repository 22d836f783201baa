"""A training loop run in a background thread while the slice is open in the caller's
thread (a notebook keeping its kernel free, a GUI, a serving process).

Truth: the loop calls ``optimizer.step()`` a known number of times.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
import truth
from truth import STEPS, WARMUP

import tpkit as tp
from tpkit.schema import STOPPED_BY

BATCH = 4


@pytest.fixture(scope="module")
def threaded():
    torch.manual_seed(0)
    model = truth.SleepyNet()
    opt = truth.SleepySGD(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(truth.Regression(), batch_size=BATCH, collate_fn=truth.sleepy_collate)
    iterations, errors = [], []

    def train() -> None:  # exactly warmup + steps iterations: no stop is needed
        try:
            for i, (x, y) in zip(range(STEPS + WARMUP), loader):
                loss = F.mse_loss(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                iterations.append(i)
        except BaseException as e:  # noqa: BLE001 - whatever reaches the thread is checked
            errors.append(e)

    before = truth.hook_state()
    with tp.profile(steps=STEPS, warmup=WARMUP, name="thread", progress=False, clock_hz=0) as prof:
        worker = threading.Thread(target=train, name="training-loop")
        worker.start()
        worker.join(timeout=60)
    return dict(run=prof.run, before=before, iterations=iterations, errors=errors, alive=worker.is_alive())


def test_thread_loop_ends_and_hooks_are_removed(threaded):
    assert not threaded["alive"] and not threaded["errors"], threaded["errors"]
    assert len(threaded["iterations"]) == STEPS + WARMUP
    truth.assert_hooks_removed(threaded["before"])


def test_thread_loop_steps_are_counted(threaded):
    run = threaded["run"]
    assert len(run.steps) == STEPS + WARMUP
    assert run.steps["forward_s"].gt(0).all()
    assert not any("tp.step()" in n for n in run.meta.get("notes", []))


def _loop_for_a_thread(n: int) -> tuple[Callable[[], None], list[int], list[BaseException]]:
    """A training loop of ``n`` iterations to run in a thread of its own: the function, the
    iterations it finished, and what it raised (nothing may be raised into it)."""
    torch.manual_seed(0)
    model = truth.SleepyNet()
    opt = truth.SleepySGD(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(truth.Regression(), batch_size=BATCH, collate_fn=truth.sleepy_collate)
    iterations: list[int] = []
    errors: list[BaseException] = []

    def train() -> None:
        try:
            for i, (x, y) in zip(range(n), loader):
                F.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
                iterations.append(i)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    return train, iterations, errors


def test_thread_loop_longer_than_the_slice_runs_on():
    """A loop that goes on after the slice: 7 steps recorded, nothing raised into its thread
    (no one there could catch a stop), and the run says the loop ran on."""
    n = STEPS + WARMUP + 3
    train, iterations, errors = _loop_for_a_thread(n)

    before = truth.hook_state()
    with tp.profile(steps=STEPS, warmup=WARMUP, name="thread-long", progress=False, clock_hz=0) as prof:
        worker = threading.Thread(target=train, name="long-loop")
        worker.start()
        worker.join(timeout=60)
    run = prof.run
    assert not worker.is_alive() and not errors, errors
    assert len(iterations) == n
    assert len(run.steps) == STEPS + WARMUP and run.complete
    assert any("long-loop" in note for note in run.meta["notes"]), run.meta["notes"]
    truth.assert_hooks_removed(before)


def test_a_body_that_starts_the_loop_and_returns_says_the_loop_ran_on():
    """A cell (a with block) that starts its training thread and returns without joining it: the
    slice ends as the body returns, the loop runs on to its own end unharmed, and the run says
    what happened: the steps until then, incomplete, ``stopped_by: "body_returned"``, a note that
    tells to join the thread. It had said the loop ended (``loop_end``, complete, "the loop ended
    after 2 steps") and that the slice's thread waited for the loop, while it trained on."""
    n = STEPS + WARMUP + 3
    train, iterations, errors = _loop_for_a_thread(n)

    before = truth.hook_state()
    with tp.profile(steps=STEPS, warmup=WARMUP, name="thread-nojoin", progress=False, clock_hz=0) as prof:
        worker = threading.Thread(target=train, name="background-loop")
        worker.start()
        while len(iterations) < 2 and worker.is_alive():  # the cell's other work; it never joins
            time.sleep(0.005)
        returned_at = len(iterations)
    worker.join(timeout=60)
    run = prof.run
    assert not worker.is_alive() and not errors, errors
    assert len(iterations) == n  # the loop trained on to its own end after the body returned
    assert returned_at <= len(run.steps) <= returned_at + 1 < STEPS + WARMUP, (returned_at, len(run.steps))
    assert not run.complete and run.meta["stopped_by"] == "body_returned" and "body_returned" in STOPPED_BY
    notes = run.meta["notes"]
    assert any("returned after" in t and "'background-loop' ran on" in t and "join" in t for t in notes), notes
    assert not any("the loop ended" in t or "waits for it" in t for t in notes), notes
    truth.assert_hooks_removed(before)


def _short_loop(iterations: list[int], n: int):
    """A SleepyNet loop of exactly ``n`` iterations, fewer than the slice's steps."""
    torch.manual_seed(0)
    model = truth.SleepyNet()
    opt = truth.SleepySGD(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(truth.Regression(), batch_size=BATCH, collate_fn=truth.sleepy_collate)

    def train() -> str:
        for i, (x, y) in zip(range(n), loader):
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            iterations.append(i)
        return "done"

    return train


def test_a_loop_run_to_its_end_in_a_long_lived_pool_ended_inside_the_slice():
    """The body waits for the whole loop, run by a pool made before the slice
    (``pool.submit(train).result()``); the pool's worker thread lives on, idle in its queue. The
    loop ended inside the slice: ``stopped_by: "loop_end"``, complete, every iteration a step. It
    had read ``body_returned``, incomplete, with a note that the loop ran on unprofiled."""
    import concurrent.futures

    iterations: list[int] = []
    n = STEPS + WARMUP - 3
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pool")
    try:
        with tp.profile(steps=STEPS, warmup=WARMUP, name="pool", progress=False, clock_hz=0) as prof:
            assert pool.submit(_short_loop(iterations, n)).result(timeout=60) == "done"
        run = prof.run
        assert len(iterations) == n and len(run.steps) == n
        assert run.meta["stopped_by"] == "loop_end" and run.complete
        assert not any("ran on" in t for t in run.meta["notes"]), run.meta["notes"]
        assert any(t.startswith(f"the loop ended after {n} steps") for t in run.meta["notes"]), run.meta["notes"]
    finally:
        pool.shutdown()


def test_a_loop_whose_thread_signals_its_end_ended_inside_the_slice():
    """The body waits on an Event the training thread sets once its loop is over, then the thread
    takes 10 ms to finish (closing its log): it is still alive as the body returns, but its loop
    ended inside the slice. Every trial: ``loop_end``, complete. It had read ``body_returned``,
    incomplete (and 2 of 6 times with nothing after the ``set()``)."""
    for trial in range(3):
        iterations: list[int] = []
        n = 2
        done = threading.Event()
        train = _short_loop(iterations, n)

        def signalled(train=train, done=done) -> None:
            train()
            done.set()  # the loop is over
            time.sleep(0.01)  # the thread's last moments: no training

        with tp.profile(steps=STEPS, warmup=WARMUP, name="event", progress=False, clock_hz=0, memory=False) as prof:
            worker = threading.Thread(target=signalled, name="signalled-loop")
            worker.start()
            assert done.wait(timeout=60)
        worker.join(timeout=60)
        run = prof.run
        assert len(run.steps) == n, (trial, len(run.steps))
        assert run.meta["stopped_by"] == "loop_end" and run.complete, (trial, run.meta["stopped_by"])
