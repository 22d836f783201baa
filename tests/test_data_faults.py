"""Faults in tpkit.data: clear errors, nothing lost, nothing left behind."""

from __future__ import annotations

import _thread
import gc
import glob
import itertools
import os
import signal
import threading
import time

import pytest
import torch
from data_helpers import Mixed, live_children, shm_files
from torch.utils.data import Dataset

from tpkit.data import Loader, UnsupportedBatchError, WorkerDiedError, WorkerError


class Fails(Dataset):
    def __len__(self) -> int:
        return 20

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == 7:
            raise_on_seven(i)
        return torch.tensor([i])


def raise_on_seven(i: int) -> None:
    raise KeyError(f"no label for {i}")


class KillsItself(Dataset):
    """Worker making sample ``at`` dies by SIGKILL, once (a marker file remembers)."""

    def __init__(self, marker: str, at: int = 9, n: int = 40) -> None:
        self.marker, self.at, self.n = marker, at, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.at and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return torch.tensor([i])


class Slow(Dataset):
    def __len__(self) -> int:
        return 1000

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(0.01)
        return torch.tensor([i])


@pytest.mark.parametrize("workers,mode", [(0, "process"), (2, "process"), (2, "thread")])
def test_worker_exception_carries_traceback_and_sample_index(workers, mode):
    loader = Loader(Fails(), batch_size=4, num_workers=workers, mode=mode)
    it = iter(loader)
    assert next(it).tolist() == [[0], [1], [2], [3]]
    with pytest.raises(WorkerError) as e:
        next(it)
    err = e.value
    assert err.index == 7 and err.batch == 1 and err.exc_type == "KeyError"
    assert "raise_on_seven" in err.worker_traceback and "sample index 7" in str(err)
    # the dataset's own type too, as torch's DataLoader re-raises it: a loop's except KeyError
    # still catches it (it did not); its message reads as written, not quoted as KeyError's
    assert isinstance(err, KeyError) and str(err).startswith("KeyError in ")
    assert ("the loader's main process" in str(err)) == (workers == 0)
    assert next(it).tolist() == [[8], [9], [10], [11]]  # the loader goes on, like torch's
    loader.close()
    assert not live_children() and not shm_files()


class FailsAt(Dataset):
    """``n`` one-int samples; the samples in ``at`` raise."""

    def __init__(self, n: int, at: set[int]) -> None:
        self.n, self.at = n, at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if i in self.at:
            raise_on_seven(i)
        return torch.tensor([i])


def test_a_failing_batch_inside_a_several_task_message_spares_the_others():
    """A small-batch worker gets its tasks several to a message (process_pool.REFILL_TASKS);
    a batch that fails inside one is reported as itself, and the batches before and after it
    in the same message are handed out, in order, as in torch. (Every 20th batch fails from
    the 30th on: which batches share a message depends on timing, so several are tried.)"""
    from unittest import mock

    from tpkit.data.process_pool import ProcessPool

    bundled: list[list[int]] = []
    send = ProcessPool._send

    def watched(w, msg):
        if isinstance(msg, list):
            bundled.append([t.batch_id for t in msg])
        send(w, msg)

    with mock.patch.object(ProcessPool, "_send", staticmethod(watched)):
        bad = list(range(30, 200, 20))
        loader = Loader(FailsAt(400, at={2 * b + 1 for b in bad}), batch_size=2, num_workers=2,
                        main_helps=False)
        got, failures = [], []
        it = iter(loader)
        while True:
            try:
                got.append(next(it).flatten().tolist())
            except WorkerError as e:
                failures.append((e.batch, e.index))
            except StopIteration:
                break
    assert failures == [(b, 2 * b + 1) for b in bad]
    assert got == [[2 * b, 2 * b + 1] for b in range(200) if b not in bad]
    # batch ids here are the epoch's (its first is 0): a failed batch with others on both sides
    assert any(ids[0] < b < ids[-1] for ids in bundled for b in bad if b in ids), bundled
    assert not live_children() and not shm_files()


def test_killed_worker_is_reported_quickly(tmp_path):
    loader = Loader(KillsItself(str(tmp_path / "m")), batch_size=4, num_workers=2)
    t0 = time.monotonic()
    with pytest.raises(WorkerDiedError, match="SIGKILL.*restart_workers=True"):
        list(loader)
    assert time.monotonic() - t0 < 5.0
    assert not live_children() and not shm_files()


@pytest.mark.parametrize("in_order", [True, False])
def test_restart_workers_replaces_a_killed_worker_without_loss_or_repeat(tmp_path, in_order):
    loader = Loader(KillsItself(str(tmp_path / "m")), batch_size=4, num_workers=2,
                    restart_workers=True, in_order=in_order)
    with pytest.warns(RuntimeWarning, match="restarted"):
        got = [b.flatten().tolist() for b in loader]
    if in_order:
        assert got == [list(range(i, i + 4)) for i in range(0, 40, 4)]
    else:
        assert sorted(got) == [list(range(i, i + 4)) for i in range(0, 40, 4)]
    assert not live_children() and not shm_files()


def test_a_worker_killed_amid_a_several_task_message_is_replaced_without_loss_or_repeat(tmp_path):
    """Deep in an epoch of small batches a worker holds several tasks from one message when it
    dies; the new worker gets each of them again, one message each, and the epoch is whole."""
    from unittest import mock

    from tpkit.data.process_pool import ProcessPool

    bundles: list[int] = []
    send = ProcessPool._send

    def watched(w, msg):
        if isinstance(msg, list):
            bundles.append(len(msg))
        send(w, msg)

    with mock.patch.object(ProcessPool, "_send", staticmethod(watched)):
        loader = Loader(KillsItself(str(tmp_path / "m"), at=301, n=400), batch_size=2, num_workers=2,
                        restart_workers=True, main_helps=False)
        with pytest.warns(RuntimeWarning, match="restarted"):
            got = [b.flatten().tolist() for b in loader]
    assert got == [[i, i + 1] for i in range(0, 400, 2)]
    assert bundles and max(bundles) >= 3
    assert not live_children() and not shm_files()


def test_restart_workers_with_an_iterable_dataset(tmp_path):
    from data_helpers import Shards

    class KillingShards(Shards):
        def __iter__(self):
            for s in super().__iter__():
                if int(s["i"]) == 9 and not os.path.exists(marker):
                    open(marker, "w").close()
                    os.kill(os.getpid(), signal.SIGKILL)
                yield s

    marker = str(tmp_path / "m")
    ref = [b["i"].tolist() for b in Loader(Shards(), batch_size=2, num_workers=2)]
    with pytest.warns(RuntimeWarning):
        got = [b["i"].tolist() for b in Loader(KillingShards(), batch_size=2, num_workers=2,
                                               restart_workers=True)]
    assert got == ref


def test_ctrl_c_stops_workers_and_removes_segments():
    loader = Loader(Slow(), batch_size=2, num_workers=2)
    timer = threading.Timer(0.3, _thread.interrupt_main)
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        for _ in loader:
            pass
    timer.join()
    assert not live_children() and not shm_files()


def test_unfinished_loader_collected_leaves_nothing():
    it = iter(Loader(Slow(), batch_size=2, num_workers=2, persistent_workers=True))
    next(it)
    del it
    gc.collect()
    assert not live_children() and not shm_files()


def test_timeout_raises_with_advice():
    from tpkit.data import LoaderTimeoutError

    class Hangs(Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            time.sleep(30)

    with pytest.raises(LoaderTimeoutError, match="timeout="):
        next(iter(Loader(Hangs(), batch_size=2, num_workers=1, timeout=0.5)))
    assert not live_children() and not shm_files()


def test_bad_arguments_say_what_to_do():
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        Loader(Mixed(), batch_size=0)
    with pytest.raises(ValueError, match="num_workers must be an int >= 0"):
        Loader(Mixed(), num_workers=-1)
    with pytest.raises(ValueError, match="'process' or 'thread'"):
        Loader(Mixed(), mode="fiber")
    with pytest.raises(ValueError, match="not both"):
        Loader(Mixed(), shuffle=True, sampler=[0, 1])
    from data_helpers import Shards
    with pytest.raises(ValueError, match="iterable dataset"):
        Loader(Shards(), shuffle=True)


def test_unsupported_collate_output_names_the_place_and_the_fix():
    class Box:  # a local class cannot be pickled (a module-level one is: test_data_loader.py)
        pass

    loader = Loader(Mixed(8), batch_size=4, num_workers=1,
                    collate_fn=lambda s: {"x": torch.zeros(2), "meta": Box()})
    with pytest.raises(WorkerError, match=r"batch\['meta'\].*collate_fn") as e:
        next(iter(loader))
    assert e.value.exc_type == "UnsupportedBatchError"
    loader.close()
    assert issubclass(UnsupportedBatchError, TypeError)


@pytest.mark.slow  # a fresh interpreter imports torch: seconds
def test_workers_of_a_killed_main_process_exit_and_clean_up(tmp_path):
    """SIGKILL of the training process: its workers notice within seconds, exit, and remove
    any segment the dead process had not mapped yet."""
    import subprocess
    import sys

    import psutil

    script = tmp_path / "main.py"
    script.write_text(
        "import os, signal, sys\n"
        "sys.path.insert(0, %r)\n"
        "from tpkit.data import Loader\n"
        "from test_data_faults import Slow\n"
        "it = iter(Loader(Slow(), batch_size=2, num_workers=2))\n"
        "next(it), next(it)\n"  # the second next() has forked both workers
        "print(' '.join(str(p.pid) for p in __import__('psutil').Process().children()), flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n" % os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=60)
    pids = [int(p) for p in out.split()]
    assert len(pids) == 2 and proc.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(psutil.pid_exists(p) for p in pids):
        time.sleep(0.1)
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not alive
    from tpkit.data.slots import SHM_DIR
    assert not glob.glob(os.path.join(SHM_DIR, f"tpk-{proc.pid}-*"))


def _bad_init(worker_id: int) -> None:
    raise RuntimeError("cannot open the shard")


def test_worker_init_failure_is_reported_and_stops_the_loader():
    loader = Loader(Mixed(8), batch_size=2, num_workers=2, worker_init_fn=_bad_init, restart_workers=True)
    with pytest.raises(WorkerError, match="while starting.*cannot open the shard") as e:
        list(loader)
    assert "_bad_init" in e.value.worker_traceback
    assert not live_children() and not shm_files()


def _tpkit_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("tpkit")]


def test_ctrl_c_while_workers_start_leaves_nothing(monkeypatch):
    """Ctrl-C while the workers start (in the second next(): worker 1 was forked by the first,
    whose 6 samples of 10 ms are slow enough to fork ahead, and worker 0 has just been forked and
    is being handed its tasks): the started workers and their segments go too."""
    from tpkit.data import process_pool

    real, calls = process_pool.ProcessPool._dispatch, []

    def interrupted(self):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self)
    monkeypatch.setattr(process_pool.ProcessPool, "_dispatch", interrupted)
    loader = Loader(Slow(), batch_size=6, num_workers=2)
    it = iter(loader)
    assert calls == [] and not live_children()  # nothing forked before the first next()
    next(it)
    assert calls == [1] and len(live_children()) == 1  # worker 1, forked by the first next()
    with pytest.raises(KeyboardInterrupt):
        next(it)
    assert len(calls) == 2 and not live_children() and not shm_files()


def test_ctrl_c_during_shutdown_is_delivered_after_it():
    """A SIGINT that lands while the workers are being stopped waits for the stop to finish,
    then raises where it landed: nothing is left half shut down."""
    from tpkit.data import process_pool

    loader = Loader(Slow(), batch_size=2, num_workers=2)
    it = iter(loader)
    next(it)
    real = process_pool._stop_workers

    def stop_with_sigint(workers, prefix):
        signal.raise_signal(signal.SIGINT)  # handled now, by the held handler
        real(workers, prefix)

    process_pool._stop_workers = stop_with_sigint
    try:
        with pytest.raises(KeyboardInterrupt):
            loader.close()
    finally:
        process_pool._stop_workers = real
    assert not live_children() and not shm_files()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_worker_dying_between_making_its_ring_and_reporting_it_leaves_no_segment(monkeypatch):
    """The segment file exists before the main process hears of it; the worker's death must
    not leave it in /dev/shm."""
    from tpkit.data import slots

    real = slots.WorkerRing.write

    def write_then_die(self, slot, batch):  # runs in the forked worker
        out = real(self, slot, batch)
        assert glob.glob(self.prefix + "*")  # the segment is there, not yet reported
        os.kill(os.getpid(), signal.SIGKILL)
        return out
    monkeypatch.setattr(slots.WorkerRing, "write", write_then_die)
    with pytest.raises(WorkerDiedError, match="SIGKILL"):
        list(Loader(Mixed(8), batch_size=2, num_workers=2))
    assert not live_children() and not shm_files()


def _worker_pids(loader: Loader) -> set[int]:
    pool = loader._pool
    return {w.proc.pid for w in pool.workers if w.proc is not None} if pool is not None else set()


@pytest.mark.parametrize("kw", [dict(), dict(in_order=False), dict(mode="thread"), dict(persistent_workers=True)])
def test_an_exception_in_the_loops_body_stops_the_epochs_workers(kw):
    """A Ctrl-C (or any error) in the loop's own body, between two batches, drops the iterator:
    its workers, threads and segments go at once, as torch's do; persistent workers stay for the
    next epoch and go with ``close()``."""
    loader = Loader(Slow(), batch_size=2, num_workers=2, **kw)
    with pytest.raises(KeyboardInterrupt):
        for i, _ in enumerate(loader):
            if i == 3:
                raise KeyboardInterrupt
    if kw.get("persistent_workers"):
        assert {p.pid for p in live_children()} == _worker_pids(loader) and len(_worker_pids(loader)) == 2
        assert [int(b[0]) for b in itertools.islice(loader, 1)] == [0]  # the same workers serve on
        loader.close()
    assert not live_children() and not shm_files() and not _tpkit_threads()
    firsts = sorted(int(b[0]) for b in itertools.islice(loader, 2))  # still usable
    assert firsts == [0, 2] if kw.get("in_order", True) else len(set(firsts)) == 2
    loader.close()
    assert not live_children()


@pytest.mark.parametrize("seed", [0, 1])
def test_ctrl_c_at_random_instants_leaves_nothing_behind(seed):
    """Real interrupts (interrupt_main) at seeded random instants: while workers start, while
    next() waits, while batches are handed out, in every engine. After each: the interrupt came
    through, and no worker process, loader thread or segment file is left."""
    import random

    rnd = random.Random(seed)
    options = [dict(), dict(persistent_workers=True), dict(in_order=False), dict(fast_start=True),
               dict(mode="thread"), dict(restart_workers=True)]
    for trial in range(8):
        kw = options[trial % len(options)]
        loader = Loader(Slow(), batch_size=2, num_workers=2, **kw)
        timer = threading.Timer(rnd.uniform(0.0, 0.25), _thread.interrupt_main)
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            for _ in loader:
                pass
        timer.join()
        if kw.get("persistent_workers"):  # persistent workers outlive an epoch the body left
            assert {p.pid for p in live_children()} <= _worker_pids(loader), (trial, kw)
            loader.close()
        assert not live_children() and not shm_files() and not _tpkit_threads(), (trial, kw)
        firsts = [int(b[0]) for b in itertools.islice(loader, 2)]  # still usable
        assert firsts == [0, 2] if kw.get("in_order", True) else firsts[0] % 2 == 0 and len(set(firsts)) == 2
        loader.close()


def test_loader_errors_are_tpkit_errors_with_their_builtin_base():
    from tpkit.data import LoaderError, LoaderTimeoutError
    from tpkit.errors import TpkitError

    for cls, base in ((LoaderError, RuntimeError), (WorkerError, RuntimeError), (WorkerDiedError, RuntimeError),
                      (LoaderTimeoutError, TimeoutError), (UnsupportedBatchError, TypeError)):
        assert issubclass(cls, TpkitError) and issubclass(cls, base), cls
    with pytest.raises(TpkitError, match="batch_size must be a positive int"):
        Loader(Mixed(), batch_size=0)
    with pytest.raises(ValueError):
        Loader(Mixed(), mode="fiber")
