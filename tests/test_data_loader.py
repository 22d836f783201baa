"""tpkit.data.Loader against torch's DataLoader: same batches, same order; exact resume;
slots never overwritten while viewed; nothing left behind."""

from __future__ import annotations

import dataclasses
import gc
import itertools
import time
from typing import Any

import pytest
import torch
from data_helpers import Mixed, RandomAug, Shards, as_lists, live_children, shm_files
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, RandomSampler

from tpkit.data import Loader
from tpkit.data.loader import permuted_batches


@pytest.mark.parametrize("workers", [0, 1, 2])
def test_map_style_shuffle_seed_matches_torch_over_two_epochs(workers):
    ours = Loader(Mixed(), batch_size=4, shuffle=True, seed=11, num_workers=workers)
    ref = DataLoader(Mixed(), batch_size=4, shuffle=True, num_workers=workers,
                     generator=torch.Generator().manual_seed(11))
    for _ in range(2):
        assert as_lists(list(ours)) == as_lists(list(ref))
    assert not shm_files() and not live_children()


@pytest.mark.parametrize("workers", [0, 2])
def test_global_rng_and_given_sampler_match_torch(workers):
    torch.manual_seed(5)
    a = [b.tolist() for b in Loader(RandomAug(), batch_size=5, shuffle=True, num_workers=workers)]
    torch.manual_seed(5)
    b = [b.tolist() for b in DataLoader(RandomAug(), batch_size=5, shuffle=True, num_workers=workers)]
    assert a == b  # same permutation and same torch RNG in each worker
    s1 = RandomSampler(range(24), generator=torch.Generator().manual_seed(3))
    s2 = RandomSampler(range(24), generator=torch.Generator().manual_seed(3))
    torch.manual_seed(6)
    a = [b.tolist() for b in Loader(RandomAug(), batch_size=5, sampler=s1, drop_last=True,
                                    num_workers=workers, seed=1)]
    torch.manual_seed(6)
    b = [b.tolist() for b in DataLoader(RandomAug(), batch_size=5, sampler=s2, drop_last=True,
                                        num_workers=workers, generator=torch.Generator().manual_seed(1))]
    assert a == b and len(a) == 4


@pytest.mark.parametrize("workers", [0, 1, 2])
@pytest.mark.parametrize("drop_last", [False, True])
def test_iterable_matches_torch(workers, drop_last):
    ours = list(Loader(Shards(), batch_size=4, num_workers=workers, drop_last=drop_last))
    ref = list(DataLoader(Shards(), batch_size=4, num_workers=workers, drop_last=drop_last))
    assert as_lists(ours) == as_lists(ref)
    assert sum(len(b["i"]) for b in ours) == (23 if not drop_last else sum(len(b["i"]) for b in ref))


def test_a_long_iterable_stream_of_small_batches_matches_torch():
    """Long enough for the small-batch workers' queues to be refilled several tasks at a time
    (process_pool.REFILL_TASKS): the round robin over workers still gives each its turn as
    torch's does, so the batches come in torch's order."""
    ours = list(Loader(Shards(800), batch_size=2, num_workers=2))
    ref = list(DataLoader(Shards(800), batch_size=2, num_workers=2))
    assert as_lists(ours) == as_lists(ref)


def test_batch_size_none_batch_sampler_and_custom_collate_match_torch():
    kw = dict(batch_size=None, num_workers=2)
    assert as_lists(list(Loader(Mixed(7), **kw))) == as_lists(list(DataLoader(Mixed(7), **kw)))
    bs = [[0, 5], [3], [1, 2, 4, 6]]
    assert as_lists(list(Loader(Mixed(7), batch_sampler=bs, num_workers=2))) == \
        as_lists(list(DataLoader(Mixed(7), batch_sampler=bs, num_workers=2)))

    def cat_x(samples):
        return torch.cat([s["x"] for s in samples]), [s["name"] for s in samples]
    kw = dict(batch_size=3, collate_fn=cat_x, num_workers=2)
    assert as_lists(list(Loader(Mixed(8), **kw))) == as_lists(list(DataLoader(Mixed(8), **kw)))


def test_thread_mode_and_out_of_order_yield_the_same_batches():
    ref = as_lists(list(DataLoader(Mixed(), batch_size=3)))
    assert as_lists(list(Loader(Mixed(), batch_size=3, num_workers=2, mode="thread"))) == ref
    got = as_lists(list(Loader(Mixed(), batch_size=3, num_workers=2, in_order=False)))
    assert sorted(map(repr, got)) == sorted(map(repr, ref))
    for kw in (dict(mode="thread"), dict(in_order=False)):
        got = as_lists(list(Loader(Shards(), batch_size=4, num_workers=2, **kw)))
        assert sorted(v for b in got for v in b["i"][3]) == list(range(23))


def test_persistent_workers_match_torch_over_epochs():
    ours = Loader(RandomAug(), batch_size=4, shuffle=True, seed=2, num_workers=2, persistent_workers=True)
    ref = DataLoader(RandomAug(), batch_size=4, shuffle=True, num_workers=2, persistent_workers=True,
                     generator=torch.Generator().manual_seed(2))
    for _ in range(3):
        assert [b.tolist() for b in ours] == [b.tolist() for b in ref]
    it = iter(Loader(Shards(), batch_size=4, num_workers=2, persistent_workers=True))
    assert len(list(it)) == 6 and len(list(it.loader)) == 6  # second epoch of the same workers
    ours.close()
    del ref, it
    gc.collect()
    assert not live_children() and not shm_files()


def test_kept_batches_are_never_overwritten():
    """list(loader) holds every batch: slots must not be reused under live views."""
    kept = list(Loader(Mixed(200), batch_size=4, num_workers=2, prefetch=1))
    assert [int(b["i"][0]) for b in kept] == list(range(0, 200, 4))
    assert all(torch.equal(b["x"][:, 0, 0], b["i"].float()) for b in kept)
    # Views that are dropped at once let slots recycle: the zero-copy path is actually used.
    loader = Loader(Mixed(200), batch_size=4, num_workers=2)
    seen = sum(int(b["i"].sum()) for b in loader)
    assert seen == sum(range(200))


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("stop_after", [0, 3])
def test_resume_from_state_dict_yields_exactly_the_rest(workers, stop_after):
    def make():
        return Loader(Mixed(41), batch_size=4, shuffle=True, seed=7, num_workers=workers)
    full = make()
    first_epoch = as_lists(list(full))
    second_epoch = as_lists(list(full))
    loader = make()
    it = iter(loader)
    head = as_lists(list(itertools.islice(it, stop_after)))
    state = loader.state_dict()
    del it
    loader.close()
    resumed = make()
    resumed.load_state_dict(state)
    tail = as_lists(list(resumed))
    assert head + tail == first_epoch
    assert as_lists(list(resumed)) == second_epoch  # later epochs continue the same sequence


def test_resume_global_rng_shuffle_and_iterable():
    torch.manual_seed(0)
    loader = Loader(Mixed(30), batch_size=4, shuffle=True, num_workers=2)
    it = iter(loader)
    head = [next(it)["i"].tolist() for _ in range(2)]
    state = loader.state_dict()
    rest = [b["i"].tolist() for b in it]
    other = Loader(Mixed(30), batch_size=4, shuffle=True, num_workers=2)
    other.load_state_dict(state)
    assert [b["i"].tolist() for b in other] == rest and len(head + rest) == 8

    for workers in (0, 2):
        ref = [b["i"].tolist() for b in Loader(Shards(), batch_size=3, num_workers=workers)]
        loader = Loader(Shards(), batch_size=3, num_workers=workers)
        it = iter(loader)
        head = [next(it)["i"].tolist() for _ in range(3)]
        state = loader.state_dict()
        loader.close()
        again = Loader(Shards(), batch_size=3, num_workers=workers)
        again.load_state_dict(state)
        assert head + [b["i"].tolist() for b in again] == ref


def test_gc_and_end_of_iteration_leave_nothing_behind():
    loader = Loader(Mixed(100), batch_size=2, num_workers=2)
    it = iter(loader)
    next(it), next(it)
    assert len(live_children()) == 2
    del it, loader
    gc.collect()
    assert not live_children() and not shm_files()
    list(Loader(Mixed(9), batch_size=2, num_workers=2))
    assert not live_children() and not shm_files()


def test_len_matches_torch():
    for kw in (dict(batch_size=4), dict(batch_size=4, drop_last=True), dict(batch_size=None)):
        assert len(Loader(Mixed(), **kw)) == len(DataLoader(Mixed(), **kw))


def test_state_saved_between_epochs_resumes_the_next_epoch():
    ref = Loader(Mixed(20), batch_size=4, shuffle=True, seed=9, num_workers=2)
    epochs = [as_lists(list(ref)) for _ in range(2)]
    loader = Loader(Mixed(20), batch_size=4, shuffle=True, seed=9, num_workers=2)
    assert as_lists(list(loader)) == epochs[0]
    state = loader.state_dict()
    again = Loader(Mixed(20), batch_size=4, shuffle=True, seed=9, num_workers=2)
    again.load_state_dict(state)
    assert as_lists(list(again)) == epochs[1]


@pytest.mark.slow  # a spawned worker imports torch: seconds
def test_spawn_context_works_too():
    """Workers started by spawn get the dataset pickled once and attach to segments by name."""
    got = list(Loader(Mixed(9), batch_size=4, num_workers=1, multiprocessing_context="spawn"))
    assert as_lists(got) == as_lists(list(DataLoader(Mixed(9), batch_size=4)))
    assert not live_children() and not shm_files()


def test_persistent_workers_survive_many_abandoned_epochs():
    """Breaking out of epochs must not leak slots: the next epochs still run to the end."""
    loader = Loader(Mixed(40), batch_size=2, num_workers=2, persistent_workers=True, prefetch=1)
    for _ in range(6):
        it = iter(loader)
        next(it)
    assert [int(b["i"][0]) for b in loader] == list(range(0, 40, 2))
    loader.close()


class SlowFirst(torch.utils.data.Dataset):
    """Sample 0 takes 0.6 s; the rest are instant."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == 0:
            import time
            time.sleep(0.6)
        return torch.tensor([i])


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_out_of_order_lets_batches_pass_a_slow_sample(mode):
    got = [int(b[0]) for b in Loader(SlowFirst(), batch_size=2, num_workers=2, in_order=False, mode=mode)]
    assert got[0] != 0 and sorted(got) == list(range(0, 16, 2))
    assert [int(b[0]) for b in Loader(SlowFirst(), batch_size=2, num_workers=2, mode=mode)] == list(range(0, 16, 2))


def test_resume_in_thread_mode():
    full = [b["i"].tolist() for b in Loader(Mixed(30), batch_size=4, shuffle=True, seed=1, num_workers=2, mode="thread")]
    loader = Loader(Mixed(30), batch_size=4, shuffle=True, seed=1, num_workers=2, mode="thread")
    it = iter(loader)
    head = [next(it)["i"].tolist() for _ in range(3)]
    state = loader.state_dict()
    loader.close()
    again = Loader(Mixed(30), batch_size=4, shuffle=True, seed=1, num_workers=2, mode="thread")
    again.load_state_dict(state)
    assert head + [b["i"].tolist() for b in again] == full


class Growing(torch.utils.data.Dataset):
    """Sample i has i+1 values: later batches outgrow the slots sized on the first."""

    def __len__(self) -> int:
        return 60

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.arange(i + 1, dtype=torch.float64)


def pad_collate(samples: list) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence(samples, batch_first=True)


def test_batches_larger_than_the_first_regrow_the_ring():
    kept = list(Loader(Growing(), batch_size=6, num_workers=2, collate_fn=pad_collate))
    ref = list(DataLoader(Growing(), batch_size=6, collate_fn=pad_collate))
    assert [b.shape for b in kept] == [b.shape for b in ref] and kept[-1].shape == (6, 60)
    assert all(torch.equal(a, b) for a, b in zip(kept, ref))
    assert not shm_files() and not live_children()


@pytest.mark.parametrize("in_order", [True, False])
def test_fast_start_splits_the_first_batch_and_changes_nothing_else(in_order):
    plain = Loader(Mixed(), batch_size=5, shuffle=True, seed=4, num_workers=2)  # == torch's
    fast = Loader(Mixed(), batch_size=5, shuffle=True, seed=4, num_workers=2, fast_start=True,
                  in_order=in_order)
    for _ in range(2):  # each epoch's first batch is split again
        ref, got = as_lists(list(plain)), as_lists(list(fast))
        if in_order:
            assert got == ref
        else:
            assert sorted(map(repr, got)) == sorted(map(repr, ref))
    assert not live_children() and not shm_files()


def test_fast_start_failure_in_one_part_names_the_sample():
    from test_data_faults import Fails

    from tpkit.data import WorkerError
    it = iter(Loader(Fails(), batch_size=10, num_workers=2, fast_start=True))
    with pytest.raises(WorkerError, match="sample index 7"):
        next(it)
    assert next(it).flatten().tolist() == list(range(10, 20))


def test_random_mix_of_options_breaks_and_kept_batches():
    """Seeded mix of worker counts, prefetch, order, persistence, fast start and early breaks:
    every full epoch covers the dataset once, kept batches stay intact, nothing leaks."""
    import random
    rnd = random.Random(0)
    for trial in range(8):
        kw = dict(batch_size=rnd.choice([1, 3, 8]), num_workers=rnd.choice([1, 2, 3]),
                  persistent_workers=rnd.random() < 0.5, in_order=rnd.random() < 0.7,
                  prefetch=rnd.choice([1, 2, 3]), timeout=30)
        iterable = rnd.random() < 0.3
        ds = Shards(29) if iterable else Mixed(50)
        if not iterable:
            kw.update(shuffle=True, seed=trial, fast_start=rnd.random() < 0.3)
        loader, kept = Loader(ds, **kw), []
        for _ in range(3):
            stop, seen = rnd.choice([None, 0, 2, 5]), []
            for n, b in enumerate(loader):
                seen += b["i"].reshape(-1).tolist()
                if rnd.random() < 0.2:
                    kept.append(b)
                if stop is not None and n >= stop:
                    break
            else:
                assert sorted(seen) == list(range(29 if iterable else 50)), kw
        for b in kept:
            first = b["v"][:, 0] if iterable else b["x"][:, 0, 0]
            assert torch.equal(first, b["i"].float()), kw
        loader.close()
    assert not live_children() and not shm_files()


class Words(torch.utils.data.Dataset):
    """Samples with no tensor at all: strings only."""

    def __len__(self) -> int:
        return 11

    def __getitem__(self, i: int) -> str:
        return f"w{i}"


@dataclasses.dataclass
class Tag:
    """A user's own picklable class inside a batch."""

    name: str
    weight: float


def tags_collate(samples: list) -> dict:
    return {"x": torch.stack([s["x"] for s in samples]), "tags": [Tag(s["name"], s["f"]) for s in samples],
            "sparse": torch.eye(3).to_sparse()}


@pytest.mark.parametrize("kw", [dict(batch_size=3), dict(batch_size=None), dict(batch_size=4, shuffle=True)])
def test_batches_without_tensors_match_torch_in_process_workers(kw):
    """Strings-only samples: no ring is needed; the batches equal torch's DataLoader's."""
    seed = dict(generator=torch.Generator().manual_seed(3)) if kw.get("shuffle") else {}
    ref = list(DataLoader(Words(), num_workers=2, **kw, **seed))
    for workers, mode in ((2, "process"), (1, "process"), (0, "process"), (2, "thread")):
        ours = list(Loader(Words(), num_workers=workers, mode=mode, seed=3 if seed else None, **kw))
        assert ours == ref, (workers, mode)
    assert sorted(w for b in ref for w in ([b] if isinstance(b, str) else b)) == sorted(Words()[i] for i in range(11))
    assert not shm_files() and not live_children()


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")  # torch's own DataLoader, rebuilding the sparse batch
def test_objects_a_slot_cannot_hold_are_pickled_like_torch():
    """A user's class and a sparse tensor ride along pickled; tensors still go through slots."""
    kw = dict(batch_size=4, collate_fn=tags_collate, num_workers=2)
    ours, ref = list(Loader(Mixed(10), **kw)), list(DataLoader(Mixed(10), **kw))
    assert [b["tags"] for b in ours] == [b["tags"] for b in ref]
    assert ours[0]["tags"][1] == Tag("s1", 0.5)
    assert all(torch.equal(a["x"], b["x"]) for a, b in zip(ours, ref))
    assert all(a["sparse"].is_sparse and torch.equal(a["sparse"].to_dense(), torch.eye(3)) for a in ours)
    assert not shm_files() and not live_children()


class ThreeRngs(torch.utils.data.Dataset):
    """Each sample draws from torch's, numpy's and Python's global RNGs."""

    def __len__(self) -> int:
        return 18

    def __getitem__(self, i: int) -> torch.Tensor:
        import os
        import random

        import numpy as np
        return torch.tensor([float(i), float(torch.rand(1)), float(np.random.rand()), random.random(),
                             float(os.getpid())], dtype=torch.float64)


@pytest.mark.parametrize("workers", [1, 2])
def test_first_batch_made_in_process_draws_like_worker_0(workers):
    """The epoch's first batch is made in this process (its samples carry this pid), with
    worker 0's seeds; worker 0 goes on from the state it left: every random draw equals torch's
    DataLoader's, over two epochs, and this process's own RNGs are untouched."""
    import os
    import random

    import numpy as np

    def draws():
        return float(torch.rand(1)), float(np.random.rand()), random.random()

    def epochs(make):
        torch.manual_seed(3), np.random.seed(3), random.seed(3)
        loader, out = make(), []
        for _ in range(2):
            batches = list(loader)
            pids = [{int(p) for p in b[:, 4].tolist()} for b in batches]
            out.append((pids[0] == {os.getpid()} and os.getpid() not in set().union(*pids[1:]),
                        [b[:, :4].tolist() for b in batches]))
        return out, draws()

    ours, after_ours = epochs(lambda: Loader(ThreeRngs(), batch_size=4, shuffle=True, seed=5, num_workers=workers))
    ref, after_ref = epochs(lambda: DataLoader(ThreeRngs(), batch_size=4, shuffle=True, num_workers=workers,
                                               generator=torch.Generator().manual_seed(5)))
    assert [b for _, b in ours] == [b for _, b in ref]
    assert [here for here, _ in ours] == [True, True]  # first batch made here, the rest by workers
    assert after_ours == after_ref  # the main process's RNGs are where torch leaves them
    assert not live_children() and not shm_files()


class Paced(torch.utils.data.Dataset):
    """Samples that take ``sample_s`` each to fetch (a sleep: a known time)."""

    def __init__(self, sample_s: float, n: int = 64) -> None:
        self.sample_s, self.n = sample_s, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        import time
        time.sleep(self.sample_s)
        return torch.tensor([i])


def test_a_cheap_first_batch_is_handed_out_before_any_worker_forks():
    """A batch that looks cheap (second sample's time x batch size < 50 ms) comes straight
    from this process; both workers fork at the next next(), and batch 1 is worker 1's."""
    loader = Loader(Paced(0.0), batch_size=4, num_workers=2)
    it = iter(loader)
    first = next(it)
    assert live_children() == []  # nothing forked yet: the first batch cost no fork
    assert next(it).tolist() == [[4], [5], [6], [7]]
    assert len(live_children()) == 2
    assert first.tolist() == [[0], [1], [2], [3]]
    loader.close()
    assert not live_children() and not shm_files()


def test_a_first_batch_under_50_ms_forks_no_worker_while_it_is_made():
    """2 ms x 8 samples = 16 ms: over the old 10 ms threshold, under the 50 ms one (with room for a
    loaded host's late wake-ups), so no worker forks during it (the fork and the copy-on-write
    faults after it would add more than half to such a batch); both fork at the next next(), and
    the batches are the same as ever."""
    loader = Loader(Paced(0.002), batch_size=8, num_workers=2)
    it = iter(loader)
    first = next(it)
    assert live_children() == []
    assert first.flatten().tolist() == list(range(8))
    assert next(it).flatten().tolist() == list(range(8, 16))
    assert len(live_children()) == 2
    loader.close()
    assert not live_children() and not shm_files()


def test_the_fork_during_a_slow_first_batch_is_not_charged_to_fetching(monkeypatch):
    """A batch that looks slow (8 ms x 8 samples = 64 ms, over the 50 ms threshold) forks worker
    1 after its second sample; the fork is not the batch's fetch time. The fork is made 150 ms
    slower here, so the check tells "charged" from a slow host's noise (a real fork costs 10-15
    ms, and the sleeps of a loaded 2-core host overshoot by about as much)."""
    from tpkit.data import process_pool
    from tpkit.data.process_pool import FORK_AHEAD_MIN_S
    assert FORK_AHEAD_MIN_S == 0.050
    real_start = process_pool.ProcessPool._start_worker

    def slow_start(self, w, skip):
        time.sleep(0.150)
        real_start(self, w, skip)

    monkeypatch.setattr(process_pool.ProcessPool, "_start_worker", slow_start)
    loader = Loader(Paced(0.008), batch_size=8, num_workers=2)
    it = iter(loader)
    next(it)
    assert len(live_children()) == 1  # worker 1, forked during the first batch
    made_s = it.last_make_s  # fetch + collate of that batch
    loader.close()
    assert not live_children() and not shm_files()
    assert 8 * 0.008 <= made_s < 8 * 0.008 + 0.100  # charged, it would be >= 214 ms


def test_the_in_process_first_batch_leaves_the_gpu_generators_alone():
    """torch.manual_seed in the main process would also seed every GPU's generator (queued
    until CUDA starts, on a machine without one yet), which no restore of the CPU state
    undoes: the loop's GPU dropout would draw from the loader's seed. The first batch seeds
    only the CPU generator (torch's DataLoader never seeds the main process at all)."""
    from torch.cuda import _lazy_seed_tracker

    torch.manual_seed(123)  # the user's seed: queued for every GPU
    queued = _lazy_seed_tracker.get_calls()
    batches = [b for b in Loader(ThreeRngs(), batch_size=4, shuffle=True, seed=5, num_workers=2)]
    assert len(batches) == 5
    assert _lazy_seed_tracker.get_calls() == queued  # still the user's seed, not the loader's
    assert not live_children() and not shm_files()


def test_a_fork_that_fails_during_the_first_batch_is_its_own_error_not_the_datasets(monkeypatch):
    """The fork made while a slow first batch is fetched can fail (no memory, a process limit):
    that error comes out as itself, not as a dataset failure of worker 0, and nothing is left."""
    from tpkit.data import process_pool
    from tpkit.data.errors import WorkerError

    def no_fork(self, w, skip):
        raise OSError("[Errno 11] Resource temporarily unavailable (fork)")

    monkeypatch.setattr(process_pool.ProcessPool, "_start_worker", no_fork)
    loader = Loader(Paced(0.008), batch_size=8, num_workers=2)
    with pytest.raises(OSError, match="fork") as info:
        next(iter(loader))
    assert not isinstance(info.value, WorkerError)
    loader.close()
    assert not live_children() and not shm_files()


class SlowThreeRngs(ThreeRngs):
    """ThreeRngs at 15 ms a sample: a batch of 4 looks slow enough (60 ms) to fork ahead."""

    def __getitem__(self, i: int) -> torch.Tensor:
        import time
        time.sleep(0.015)
        return super().__getitem__(i)


@pytest.mark.parametrize("workers", [2, 3])
def test_a_slow_first_batch_forks_one_worker_and_the_second_next_forks_the_rest(workers):
    """A slow first batch forks worker 1 only, while it is made (worker 1 makes batch 1
    meanwhile; worker 0 goes on from the in-process batch's random state): ``next(iter(loader))``
    costs one fork. The second next() forks the rest; batch 1 comes from worker 1."""
    import os

    loader = Loader(SlowThreeRngs(), batch_size=4, shuffle=True, seed=5, num_workers=workers)
    it = iter(loader)
    first = next(it)
    assert {int(p) for p in first[:, 4].tolist()} == {os.getpid()} and len(live_children()) == 1
    forked = live_children()[0].pid
    second = next(it)
    assert {int(p) for p in second[:, 4].tolist()} == {forked} and len(live_children()) == workers
    loader.close()
    assert not live_children() and not shm_files()


class Logged(torch.utils.data.Dataset):
    """Samples of ``nbytes`` bytes; each fetch appends a line to ``path`` (any process)."""

    def __init__(self, path: str, nbytes: int) -> None:
        self.path, self.nbytes = path, nbytes

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        with open(self.path, "a") as f:
            f.write(f"{i}\n")
        return torch.full((self.nbytes,), i % 100, dtype=torch.uint8)


@pytest.mark.parametrize("nbytes, ahead", [(64, (3 + 2 * 7, 3 + 2 * 8 + 2)), (400_000, (3 + 2, 3 + 2 * 2 + 2))])
def test_small_batches_get_a_deeper_queue(tmp_path, nbytes, ahead):
    """Default prefetch: batches of <= 256 KiB get 8 in flight per worker (the round trip, not
    the work, limits their rate), larger ones torch's 2. Counted by what the workers fetched
    while the loop, holding its third batch, waits."""
    import time

    from tpkit.data.process_pool import DEEP_PREFETCH, SMALL_SLOT_BYTES
    assert (DEEP_PREFETCH, SMALL_SLOT_BYTES) == (8, 256 * 1024)
    log = tmp_path / "fetched.txt"
    # main_helps=False: each worker's queue is what is counted (a helping main process on 2
    # cores would give one worker's share to itself)
    loader = Loader(Logged(str(log), nbytes), batch_size=1, num_workers=2, main_helps=False)
    it = iter(loader)
    held = [next(it) for _ in range(3)]
    time.sleep(1.0)
    fetched = len(log.read_text().split())
    lo, hi = ahead
    assert lo <= fetched <= hi, fetched
    assert [int(b[0, 0]) for b in held] == [0, 1, 2]
    loader.close()


def shuffled_by_workers(loader_class: Any, ds: Any, seed: int, **kwargs: Any) -> list:
    """A shuffled epoch of ``ds`` in batches of 4 from 2 workers, as plain lists."""
    loader = loader_class(ds, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(seed),
                          num_workers=2, **kwargs)
    return as_lists(list(loader))


def test_small_batch_workers_get_their_tasks_four_at_a_time():
    """A worker of small batches (8 in flight) is refilled when 4 of its queue are free, its
    tasks in one message: after the first answers a message carries 3-4 tasks where it
    carried one (a message a batch cost both processes a pipe round, a tenth of a ~150 us
    batch). The batches are torch's all the same, in order."""
    from unittest import mock

    from tpkit.data.process_pool import DEEP_PREFETCH, REFILL_TASKS, ProcessPool

    assert REFILL_TASKS == 4
    sizes: list[int] = []
    send = ProcessPool._send

    def counted(w, msg):
        sizes.append(len(msg) if isinstance(msg, list) else 1)
        send(w, msg)

    ds = Mixed(400)
    with mock.patch.object(ProcessPool, "_send", staticmethod(counted)):
        got = shuffled_by_workers(Loader, ds, seed=3, main_helps=False)
    assert got == shuffled_by_workers(DataLoader, ds, seed=3)
    assert sum(sizes) == 100 - 1  # the first batch is made in this process, before the fork
    steady = sizes[4:-2]  # after each worker's first tasks (its batches' size not known yet)
    # in order, batch b goes to worker b % 2: one worker is a task behind the other; where the
    # main process comes late to a refill (a loaded CI host: one message of 6), more of the
    # queue is free and the message carries all of it, never more than the queue holds
    assert steady and min(steady) >= REFILL_TASKS - 1 and max(steady) <= DEEP_PREFETCH, sizes
    assert sum(steady) / len(steady) >= REFILL_TASKS - 0.5, sizes


def test_tasks_travel_as_plain_tuples():
    """What the main process writes to a worker's pipe for its tasks is plain tuples of ints
    and index lists: a ``Task`` named tuple cost pickle a class lookup and a Python call on
    each side, ~10 us of a four-task message here. The batches are torch's all the same."""
    import pickle
    import pickletools
    from multiprocessing.connection import Connection
    from unittest import mock

    written: list[bytes] = []
    send_bytes = Connection.send_bytes

    def kept(self, buf, *args):
        written.append(bytes(buf))
        return send_bytes(self, buf, *args)

    ds = Mixed(200)
    with mock.patch.object(Connection, "send_bytes", kept):
        got = shuffled_by_workers(Loader, ds, seed=5, main_helps=False)
    assert got == shuffled_by_workers(DataLoader, ds, seed=5)  # torch's pipes are not watched
    tasks = [pickle.loads(raw) for raw in written]
    tasks = [t for msg in tasks if msg is not None for t in (msg if isinstance(msg, list) else [msg])]
    assert len(tasks) == 50 - 1 and all(type(t) is tuple and len(t) == 3 for t in tasks)
    for raw in written:
        ops = {op.name for op, _, _ in pickletools.genops(raw)}
        assert not ops & {"GLOBAL", "STACK_GLOBAL", "REDUCE", "NEWOBJ"}, ops


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 300), batch_size=st.integers(1, 70), drop_last=st.booleans(),
       seed=st.one_of(st.none(), st.integers(0, 2**31)), taken=st.integers(0, 400),
       chunk=st.integers(1, 400))
def test_shuffled_batches_are_torchs_and_leave_the_generator_where_torch_does(n, batch_size, drop_last, seed,
                                                                              taken, chunk):
    """permuted_batches slices one permutation tensor instead of listing the whole epoch (a
    chunk of indices at a time; small chunks drawn here so that batches straddle them): the
    same batches as BatchSampler(RandomSampler), the generator (or, without one, the global
    RNG) in the same state after any number of batches, the whole epoch included."""
    from unittest import mock

    from torch.utils.data import BatchSampler

    import tpkit.data.loader as loader_mod

    def gen():
        return None if seed is None else torch.Generator().manual_seed(seed)

    torch.manual_seed(7)
    g_ours = gen()
    ours = permuted_batches(n, batch_size, drop_last, g_ours)
    with mock.patch.object(loader_mod, "PERMUTATION_CHUNK", chunk):
        got = list(itertools.islice(ours, taken))
    state_ours = (g_ours or torch.default_generator).get_state()
    torch.manual_seed(7)
    g_ref = gen()
    ref = iter(BatchSampler(RandomSampler(range(n), generator=g_ref), batch_size, drop_last))
    want = list(itertools.islice(ref, taken))
    assert got == want
    assert torch.equal(state_ours, (g_ref or torch.default_generator).get_state())
    if seed is not None:  # the rest of the epoch and the next one from the same generator
        assert list(ours) == list(ref)
        assert torch.equal(g_ours.get_state(), g_ref.get_state())


def test_a_shuffled_epoch_is_never_listed_whole(monkeypatch):
    """A shuffle by torch's own RandomSampler goes through permuted_batches (no list of every
    index before the first batch); any other sampler (a subclass too) is iterated as it is."""
    import tpkit.data.loader as loader_mod

    calls = []
    real = loader_mod.permuted_batches
    monkeypatch.setattr(loader_mod, "permuted_batches", lambda *a: calls.append(a) or real(*a))
    ours = [b["i"].tolist() for b in Loader(Mixed(30), batch_size=4, shuffle=True, seed=3)]
    ref = [b["i"].tolist() for b in DataLoader(Mixed(30), batch_size=4, shuffle=True,
                                               generator=torch.Generator().manual_seed(3))]
    assert ours == ref and calls and calls[0][:3] == (30, 4, False)
    calls.clear()

    class Reversed(RandomSampler):
        def __iter__(self):
            return iter(reversed(list(super().__iter__())))

    sampler = Reversed(range(30), generator=torch.Generator().manual_seed(3))
    got = [b["i"].tolist() for b in Loader(Mixed(30), batch_size=4, sampler=sampler)]
    order = list(RandomSampler(range(30), generator=torch.Generator().manual_seed(3)))
    assert [i for b in got for i in b] == order[::-1] and not calls


def _minor_faults(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def _faults_per_batch(loader: Loader, warm: int = 30, timed: int = 30) -> list[float]:
    it = iter(loader)
    for _ in range(warm):
        next(it)
    assert loader._pool is not None
    pids = [w.proc.pid for w in loader._pool.workers]
    before = {pid: _minor_faults(pid) for pid in pids}
    for _ in range(timed):
        next(it)
    out = [(_minor_faults(pid) - n) / (timed / len(pids)) for pid, n in before.items()]
    del it
    return out


def test_workers_keep_their_sample_memory_from_batch_to_batch():
    """A batch of 32 images (3x224x224 uint8) needs ~4.8 MB of samples. glibc had one worker give
    that back to the OS after every batch and take it again zero-filled: ~850 page faults a batch
    in that worker, none in the other (which then waited for it). With the thresholds fixed in
    every worker (steady_malloc), no worker faults batch after batch once warm."""
    import tpkit.datasets as tds

    per_worker = _faults_per_batch(Loader(tds.Images(n=2000), batch_size=32, shuffle=True, seed=0, num_workers=2))
    assert len(per_worker) == 2 and max(per_worker) < 50, per_worker
    assert not live_children() and not shm_files()


def test_steady_malloc_leaves_a_users_malloc_tuning_alone(monkeypatch):
    from tpkit.data import worker_loop

    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "100000")
    assert worker_loop.steady_malloc() == "left alone: malloc tuned in the environment"
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=100000")
    assert worker_loop.steady_malloc() == "left alone: malloc tuned in the environment"


def test_an_answer_crosses_the_pipe_as_a_plain_tuple_and_each_layout_is_unpickled_once():
    """A finished batch's answer is written as a plain tuple with its skeleton pickled apart;
    the main process unpickles a skeleton once per distinct layout and rebuilds the same
    BatchDone. Other messages pass through as they are."""
    import pickle

    from tpkit.data.worker_loop import BatchDone, StreamEnded, done_from_wire, done_to_wire

    answer = BatchDone(3, 1, 0, 4096, ("a skeleton", [1, 2.5, None]), 0.1, 0.2, 0.3, 99, 8)
    wire = pickle.loads(done_to_wire(answer))
    assert type(wire) is tuple
    seen: dict = {}
    got = done_from_wire(wire, seen)
    assert type(got) is BatchDone and got == answer
    later = done_from_wire(pickle.loads(done_to_wire(answer._replace(batch_id=4, slot=2))), seen)
    assert later.skeleton is got.skeleton and len(seen) == 1  # the same layout: read once
    assert (later.batch_id, later.slot) == (4, 2)
    assert done_from_wire(StreamEnded(5), seen) == StreamEnded(5)


def test_a_worker_pickles_a_skeleton_object_once_and_keeps_only_small_ones(monkeypatch):
    """A slot that kept its layout sends the same skeleton object with every batch: the worker
    pickles it once, found again by identity (an equal skeleton that is another object is
    pickled afresh: ``1 == True``, so equality would not do), and keeps only small ones."""
    import copy
    import pickle

    from tpkit.data import worker_loop
    from tpkit.data.worker_loop import BatchDone, done_from_wire, done_to_wire

    pickled = []
    real = pickle.dumps
    monkeypatch.setattr(pickle, "dumps", lambda obj, *a: pickled.append(obj) or real(obj, *a))
    monkeypatch.setattr(worker_loop, "_PICKLED_SKELETONS", {})
    skel = (4, 0, [(0, "torch", 0, 2048, "float32", (64, 8)), True])
    twin = copy.deepcopy(skel)
    big = (1, b"x" * 2000)  # a PICKLED node of a large object
    for k, s in enumerate([skel, skel, twin, skel, big, big]):
        answer = BatchDone(k, k % 2, 0, 4096, s, 0.1, 0.2, 0.3, 99, 64)
        assert done_from_wire(pickle.loads(done_to_wire(answer)), {}) == answer
    assert [sum(obj is s for obj in pickled) for s in (skel, twin, big)] == [1, 1, 2]


class _FakePoller:
    """A ``select.poll`` stand-in whose answer is there from the ``ready_at``-th look on."""

    def __init__(self, ready_at: int) -> None:
        self.ready_at, self.timeouts = ready_at, []

    def poll(self, timeout=None):
        self.timeouts.append(timeout)
        return [(7, 1)] if len(self.timeouts) >= self.ready_at or timeout != 0 else []


def test_waiting_for_a_batch_looks_without_sleeping_for_the_spin_then_sleeps():
    """An answer that comes within the spin is taken without the main process ever sleeping
    (a worker that writes to a sleeping process pays for waking it); past the spin, or with no
    spin, the wait sleeps with the caller's timeout."""
    from tpkit.data.process_pool import poll_spinning

    quick = _FakePoller(ready_at=4)
    assert poll_spinning(quick, 5.0, spin_s=10.0) == [(7, 1)]
    assert quick.timeouts == [0, 0, 0, 0]  # never a sleeping poll
    late = _FakePoller(ready_at=10**9)
    assert poll_spinning(late, 2.5, spin_s=0.002) == [(7, 1)]
    assert set(late.timeouts[:-1]) == {0} and late.timeouts[-1] == 2500.0
    none = _FakePoller(ready_at=10**9)
    poll_spinning(none, None, spin_s=0.0)
    assert none.timeouts == [0, None]


def test_the_pool_spins_only_after_a_short_wait(monkeypatch):
    """Batches that come quickly are waited for by spinning; after a long wait (slow batches,
    where a wake-up is a negligible share of the batch) the next wait sleeps at once."""
    from tpkit.data import process_pool

    spins = []
    monkeypatch.setattr(process_pool, "poll_spinning",
                        lambda poller, timeout_s, spin_s: spins.append(spin_s) or [])
    pool = process_pool.ProcessPool.__new__(process_pool.ProcessPool)
    pool._poll_key, pool._forks, pool._polling, pool.workers = 0, 0, (None, {}), []
    pool._last_wait_s = 0.0
    assert pool._wait(0.0) is False
    pool._last_wait_s = 10 * process_pool.SPIN_AFTER_WAIT_S
    pool._wait(0.0)
    assert spins == [process_pool.SPIN_S, 0.0]


def test_a_refill_that_waits_keeps_the_workers_turn():
    """An iterable dataset's batches go to the workers in turn, as in torch (worker k's stream
    makes every W-th batch). When the worker whose turn it is may not be refilled yet (a
    small-batch worker waits until 4 of its queue are free), the pass sends nothing, and the
    next batch is still that worker's, whatever room the others have."""
    from tpkit.data.process_pool import DEEP_PREFETCH, REFILL_TASKS, ProcessPool

    pool = ProcessPool(dict(dataset=Shards(), iterable=True, auto_collate=True, batch_size=2,
                            drop_last=False, collate_fn=torch.utils.data.default_collate, base_seed=0,
                            worker_init_fn=None), num_workers=2, prefetch=2, in_order=True,
                       restart_workers=False, timeout_s=0, deep_small=True)
    sent: list[tuple[int, int]] = []

    class Pipe:
        def __init__(self, wid: int) -> None:
            self.wid = wid

        def send_bytes(self, raw: bytes) -> None:
            import pickle
            msg = pickle.loads(raw)
            sent.extend((t[0], self.wid) for t in (msg if isinstance(msg, list) else [msg]))

    for w in pool.workers:  # as if started, their batches known to be small
        w.proc, w.conn, w.slot_bytes = object(), Pipe(w.id), 1024
        w.free = list(range(pool.n_slots))
    pool.epoch_first_id = pool.next_yield = 0
    pool.splits, pool.results, pool.tasks, pool.tasks_done, pool.rr = {}, {}, None, False, 0
    pool._finalizer.detach()  # no process to stop
    pool._dispatch()
    assert [w for _, w in sorted(sent)] == [0, 1] * DEEP_PREFETCH  # the first pass fills both, in turn
    w0, w1 = pool.workers
    for w in (w0, w1):  # answered: w0 two batches, w1 five
        for bid in sorted(w.inflight)[: 2 if w is w0 else 5]:
            w.free.append(w.inflight.pop(bid).slot)
    sent.clear()
    pool._dispatch()  # w0's turn, with room for 2 < REFILL_TASKS: nothing, though w1 has 5
    assert sent == [] and pool.rr == 0
    for bid in sorted(w0.inflight)[:REFILL_TASKS - 2]:
        w0.free.append(w0.inflight.pop(bid).slot)
    pool._dispatch()  # now w0 first, then in turn until w1's queue is full
    sent.sort()
    assert [b for b, _ in sent] == list(range(2 * DEEP_PREFETCH, 2 * DEEP_PREFETCH + 2 * REFILL_TASKS))
    assert [w for _, w in sent] == [0, 1] * REFILL_TASKS
