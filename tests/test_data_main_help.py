"""The main process makes batches itself while it would wait for the workers (main_helps)."""

from __future__ import annotations

import os
import random
import time

import numpy as np
import pandas as pd
import pytest
import torch
from data_helpers import live_children, shm_files
from torch.utils.data import DataLoader, Dataset, get_worker_info

from tpkit.capture import recorder
from tpkit.data import Loader, WorkerError
from tpkit.data.main_help import HELP_MAX_S, OWN_BATCHES_JUDGED, RETRY_S

#: A main-process stall in one batch: over the limit by far (a descheduled timeslice or two).
SLOW_ONCE_S = 8 * HELP_MAX_S


class SlowInWorkers(Dataset):
    """Sample i is ``[i, pid, draw]``. In a worker process a sample takes ``worker_s`` (a
    sleep), in the main process nothing (``everywhere``: there too): the main process finds its
    next batch missing every time and helps. ``draw_from``: samples from this index on add ``torch.rand`` (None: no
    sample draws). ``fail_in_main``: the main process's first sample from that index on raises
    (once); ``interrupt_in_main``: raises KeyboardInterrupt there instead, as a Ctrl-C would;
    ``main_s``: a sample made in the main process takes that long (a sleep); ``main_cpu_s``:
    that long of this thread's CPU (a busy loop);
    ``slow_once_in_main``: the main process's first sample from that index on takes
    ``SLOW_ONCE_S`` (once), as when the host takes its core away in the middle of a batch."""

    def __init__(self, n: int = 120, worker_s: float = 0.0003, draw_from: int | None = None,
                 fail_in_main: int | None = None, everywhere: bool = False,
                 interrupt_in_main: int | None = None, main_s: float = 0.0,
                 slow_once_in_main: int | None = None, main_cpu_s: float = 0.0) -> None:
        self.n, self.worker_s, self.draw_from, self.fail_in_main = n, worker_s, draw_from, fail_in_main
        self.everywhere, self.interrupt_in_main, self.main_s = everywhere, interrupt_in_main, main_s
        self.slow_once_in_main, self.main_cpu_s = slow_once_in_main, main_cpu_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.everywhere or get_worker_info() is not None:
            time.sleep(self.worker_s)
        elif self.main_s:
            time.sleep(self.main_s)
        elif self.main_cpu_s:
            end = time.thread_time() + self.main_cpu_s
            while time.thread_time() < end:
                pass
        elif self.slow_once_in_main is not None and i >= self.slow_once_in_main:
            self.slow_once_in_main = None
            time.sleep(SLOW_ONCE_S)
        elif self.interrupt_in_main is not None and i >= self.interrupt_in_main:
            raise KeyboardInterrupt
        elif self.fail_in_main is not None and i >= self.fail_in_main:
            self.fail_in_main = None
            raise ValueError(f"sample {i} cannot be read here")
        draw = float(torch.rand(1)) if self.draw_from is not None and i >= self.draw_from else 0.0
        return torch.tensor([float(i), float(os.getpid()), draw], dtype=torch.float64)


def _recorded(make_batches) -> tuple[list, pd.DataFrame]:
    """Run ``make_batches()`` with a recorder active: (its result, the loader rows)."""
    rec = recorder.Recorder("t")
    recorder.set_active(rec)
    try:
        out = make_batches()
    finally:
        recorder.set_active(None)
    return out, pd.DataFrame(rec.loader, columns=["batch", "worker", "fetch_s", "collate_s",
                                                  "queue_wait_s", "transfer_s"])


def _rng_draws() -> tuple[float, float, float]:
    return float(torch.rand(1)), float(np.random.rand()), random.random()


def test_the_main_process_makes_batches_it_would_wait_for_and_they_are_torchs():
    """A dataset that draws nothing: the batches, in order, are torch's DataLoader's; some were
    made in this process (their samples carry its pid; recorded as worker -1), and no batch
    made here waited in a queue or crossed a process."""
    ref = [b[:, 0].tolist() for b in DataLoader(SlowInWorkers(), batch_size=2, shuffle=True, num_workers=2,
                                                generator=torch.Generator().manual_seed(4))]
    loader = Loader(SlowInWorkers(), batch_size=2, shuffle=True, seed=4, num_workers=2)
    batches, rows = _recorded(lambda: list(loader))
    assert [b[:, 0].tolist() for b in batches] == ref
    here = [bool((b[:, 1] == os.getpid()).all()) for b in batches]
    assert sum(here[1:]) >= 10  # batch 0 is made here anyway (as worker 0 would make it)
    main_rows = rows[rows["worker"] == -1]
    assert len(main_rows) == sum(here[1:])
    assert (main_rows[["queue_wait_s", "transfer_s"]] == 0).all().all()
    assert not live_children() and not shm_files()


def test_auto_leaves_a_dataset_that_draws_to_the_workers_and_its_draws_are_torchs():
    """Every sample draws from torch's RNG: "auto" never makes a batch here after the first, so
    every draw equals torch's DataLoader's, and this process's RNGs end where torch's do."""
    def run(make):
        torch.manual_seed(1), np.random.seed(1), random.seed(1)
        out = [b.tolist() for b in make()]
        return [[row[0] for row in b] for b in out], [[row[2] for row in b] for b in out], \
            [{row[1] for row in b} for b in out[1:]], _rng_draws()

    ours = run(lambda: Loader(SlowInWorkers(draw_from=0), batch_size=2, shuffle=True, seed=2, num_workers=2))
    ref = run(lambda: DataLoader(SlowInWorkers(draw_from=0), batch_size=2, shuffle=True, num_workers=2,
                                 generator=torch.Generator().manual_seed(2)))
    assert ours[0] == ref[0] and ours[1] == ref[1]
    assert all(os.getpid() not in pids for pids in ours[2])
    assert ours[3] == ref[3]


def test_auto_stops_helping_at_the_first_batch_that_draws_and_puts_the_rngs_back():
    """The first batch draws nothing, later samples do: "auto" helps, the first batch made here
    that draws is given to a worker instead (nothing of it reaches the loop), helping stops,
    and this process's RNGs are untouched. Every batch comes, in order."""
    torch.manual_seed(7), np.random.seed(7), random.seed(7)
    list(DataLoader(SlowInWorkers(n=80, draw_from=10), batch_size=2, num_workers=2))
    expected = _rng_draws()  # where torch's loader leaves them (it draws the workers' base seed)
    torch.manual_seed(7), np.random.seed(7), random.seed(7)
    loader = Loader(SlowInWorkers(n=80, draw_from=10), batch_size=2, num_workers=2)
    batches = list(loader)
    assert [b[:, 0].tolist() for b in batches] == [[2.0 * k, 2.0 * k + 1] for k in range(40)]
    assert _rng_draws() == expected
    drew_here = [b for b in batches if (b[:, 1] == os.getpid()).all() and (b[:, 2] != 0).any()]
    assert drew_here == []


def test_true_helps_a_dataset_that_draws_from_its_own_stream():
    """main_helps=True: batches made here draw from their own seeded stream, not from this
    process's RNGs (which end as they would without the loader); the batches are all there, in
    order."""
    torch.manual_seed(5), np.random.seed(5), random.seed(5)
    list(Loader(SlowInWorkers(draw_from=0), batch_size=2, num_workers=2, seed=9, main_helps=False))
    expected = _rng_draws()
    torch.manual_seed(5), np.random.seed(5), random.seed(5)
    first = list(Loader(SlowInWorkers(draw_from=0), batch_size=2, num_workers=2, seed=9, main_helps=True))
    after = _rng_draws()
    assert after == expected
    assert [b[:, 0].tolist() for b in first] == [[2.0 * k, 2.0 * k + 1] for k in range(60)]
    here = [b for b in first[1:] if (b[:, 1] == os.getpid()).all()]
    assert len(here) >= 10 and all((b[:, 2] != 0).all() for b in here)
    assert len({float(v) for b in here for v in b[:, 2]}) == 2 * len(here)  # a stream, not one draw repeated


def test_a_failure_in_a_batch_made_here_names_the_main_process_and_the_epoch_goes_on():
    loader = Loader(SlowInWorkers(n=60, fail_in_main=10), batch_size=2, num_workers=2)
    got, errors = [], []
    it = iter(loader)
    while True:
        try:
            got.append(next(it)[:, 0].tolist())
        except StopIteration:
            break
        except WorkerError as e:
            errors.append(e)
    assert len(errors) == 1 and errors[0].worker == -1
    assert "the loader's main process" in str(errors[0]) and "cannot be read here" in str(errors[0])
    lost = errors[0].batch
    assert got == [[2.0 * k, 2.0 * k + 1] for k in range(30) if k != lost]
    assert not live_children() and not shm_files()


def test_no_help_for_expensive_batches_timeouts_worker_init_or_false():
    """"auto" leaves batches that take longer than HELP_MAX_S to the workers; so do a timeout
    (a batch made here could not be timed out), a worker_init_fn (it never ran here) and
    main_helps=False."""
    slow = SlowInWorkers(n=16, worker_s=HELP_MAX_S, everywhere=True)  # 2 samples: twice the limit
    cases = [Loader(slow, batch_size=2, num_workers=2),
             Loader(SlowInWorkers(n=40), batch_size=2, num_workers=2, timeout=30),
             Loader(SlowInWorkers(n=40), batch_size=2, num_workers=2, worker_init_fn=lambda k: None),
             Loader(SlowInWorkers(n=40), batch_size=2, num_workers=2, main_helps=False)]
    for case, loader in enumerate(cases):
        batches, rows = _recorded(lambda loader=loader: list(loader))
        assert len(rows) == len(batches)
        assert (rows["worker"] >= 0).all(), case
        assert len(batches) == len(loader)


@pytest.mark.parametrize("work", ["waits", "computes"])
def test_auto_stops_helping_while_its_own_batches_are_slow(work):
    """Batches are cheap in the workers but take twice HELP_MAX_S in the main process (as a
    large batch does there on a busy host). When that time is this thread's own work
    ("computes": a large batch's new memory and copies), "auto" stops after one such batch;
    when it only waited ("waits": a sleep here, as a core shared with the workers reads), after
    OWN_BATCHES_JUDGED whose median is over the limit. Either way it leaves the batches to the
    workers for RETRY_S, and the epoch keeps its order."""
    ds = SlowInWorkers(n=400, worker_s=0.0, **{"main_s" if work == "waits" else "main_cpu_s": 2 * HELP_MAX_S})
    loader = Loader(ds, batch_size=2, num_workers=2)
    t0 = time.perf_counter()
    batches, rows = _recorded(lambda: list(loader))
    elapsed_s = time.perf_counter() - t0
    assert [b[:, 0].tolist() for b in batches] == [[2.0 * k, 2.0 * k + 1] for k in range(200)]
    made_here = int((rows["worker"] == -1).sum())
    per_try = 1 if work == "computes" else OWN_BATCHES_JUDGED
    assert per_try <= made_here <= per_try * (1 + int(elapsed_s / RETRY_S)), (made_here, elapsed_s)


def test_one_slow_batch_in_the_main_process_does_not_stop_its_help():
    """One batch made here stalls (8x HELP_MAX_S: the host took the core away mid-batch); the
    batches before and after it are quick. "auto" goes on helping at once: it judges the median
    of its last OWN_BATCHES_JUDGED batches, not the one (an average jumped over the limit and
    left the epoch's next second to the workers alone)."""
    loader = Loader(SlowInWorkers(n=600, worker_s=0.0003, slow_once_in_main=100), batch_size=2,
                    num_workers=2)
    t0 = time.perf_counter()
    batches, rows = _recorded(lambda: list(loader))
    elapsed_s = time.perf_counter() - t0
    assert [b[:, 0].tolist() for b in batches] == [[2.0 * k, 2.0 * k + 1] for k in range(300)]
    here = rows.loc[rows["worker"] == -1, "batch"].tolist()
    after = [b for b in here if b > 50]  # the stalled batch is the first made here from sample 100
    assert elapsed_s < RETRY_S and len(after) >= 20, (len(after), elapsed_s)


def test_main_helps_takes_auto_true_or_false():
    with pytest.raises(ValueError, match="main_helps must be 'auto', True or False"):
        Loader(SlowInWorkers(), batch_size=2, num_workers=2, main_helps="yes")


def test_a_loop_the_workers_keep_up_with_gets_every_batch_from_them():
    """The loop takes longer per batch than the workers: past the start, the main process
    never waits, so it makes no batch and no worker rests (both make batches)."""
    loader = Loader(SlowInWorkers(n=200, worker_s=0.0), batch_size=2, num_workers=2)

    def slow_loop():
        out = []
        for b in loader:
            time.sleep(0.004)
            out.append(b)
        return out

    batches, rows = _recorded(slow_loop)
    assert len(batches) == 100
    later = rows.iloc[50:]
    assert set(later["worker"]) == {0, 1}


def test_ctrl_c_while_the_main_process_makes_a_batch_leaves_nothing_behind():
    torch.manual_seed(3), np.random.seed(3), random.seed(3)
    list(Loader(SlowInWorkers(n=60), batch_size=2, num_workers=2, main_helps=False))
    expected = _rng_draws()
    torch.manual_seed(3), np.random.seed(3), random.seed(3)
    loader = Loader(SlowInWorkers(n=60, interrupt_in_main=20), batch_size=2, num_workers=2, main_helps=True)
    got = []
    with pytest.raises(KeyboardInterrupt):
        for b in loader:
            got.append(b[:, 0].tolist())
    assert got == [[2.0 * k, 2.0 * k + 1] for k in range(len(got))]
    assert not live_children() and not shm_files()
    del loader
    # the interrupted batch's own stream was swapped out again: this process's RNGs are where
    # an epoch of the same length leaves them (only the base seed was drawn from them)
    assert _rng_draws() == expected
