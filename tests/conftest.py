import atexit
import os
import shutil
import tempfile
import threading

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
# Runs kept by the store during tests go to a temporary folder, not the checkout, removed when
# this test process ends (not by a forked child leaving: the folder is the parent's).
_RUNS = tempfile.mkdtemp(prefix="tpkit-test-runs-")
os.environ["TPKIT_RUNS"] = _RUNS


def _remove_runs(pid: int = os.getpid()) -> None:
    if os.getpid() == pid:
        shutil.rmtree(_RUNS, ignore_errors=True)


atexit.register(_remove_runs)


@pytest.fixture(scope="session")
def ip():
    """A real IPython shell with the extension loaded."""
    from IPython.testing.globalipapp import start_ipython

    shell = start_ipython()
    shell.run_line_magic("load_ext", "tpkit")
    return shell


@pytest.fixture
def one_thread():
    """Pin torch to one thread: with two, a tiny op after a sleep can wait ~10 ms for the
    pool to wake (measured, docs/MEASURED.md), which would blur ground-truth timings."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def fresh_store(tmp_path, monkeypatch):
    """Each test keeps its runs in a store of its own, so run names never collide; a test that
    called tp.set_store leaves no store setting to the next."""
    from tpkit import store

    monkeypatch.setenv("TPKIT_RUNS", str(tmp_path / "tpkit_runs"))
    store.reset_store()
    yield
    store.reset_store()


def _remove_new_deepspeed_shm(before: set[str]) -> None:
    shm = "/dev/shm"
    if os.path.isdir(shm):
        for name in set(os.listdir(shm)) - before:
            if name.startswith("deepspeed_"):
                try:
                    os.unlink(os.path.join(shm, name))
                except OSError:
                    pass


def _shm_names() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


@pytest.fixture(autouse=True)
def deepspeed_shm_cleanup():
    """DeepSpeed's CPU accelerator leaves a ~64 MiB /dev/shm/deepspeed_allreduce_buffer_* per
    engine (its shm_comm op never unlinks it); remove the ones a test created, or every run of
    the suite would keep ~400 MiB of RAM-backed files."""
    before = _shm_names()
    yield
    _remove_new_deepspeed_shm(before)


@pytest.fixture(scope="session", autouse=True)
def deepspeed_shm_cleanup_at_the_end():
    """The same for the session: a buffer made while a module's fixture set DeepSpeed up comes
    before any one test's look (each full run left one ~66 MiB file in /dev/shm)."""
    before = _shm_names()
    yield
    _remove_new_deepspeed_shm(before)


@pytest.fixture(autouse=True)
def no_leftovers():
    """Every test leaves no slice running, no extra thread and no hook or patch of tpkit's in
    torch's global places behind (``leftovers.tpkit_hooks``: a probe's listener that put dynamo's
    compile callbacks back after the slice had ended was found only by the next test's numbers)."""
    from leftovers import tpkit_hooks

    from tpkit.capture import recorder

    before = {t.ident for t in threading.enumerate()}
    yield
    assert recorder.active() is None, "a slice was left running"
    hooks = tpkit_hooks()
    assert not hooks, f"tpkit's hooks left behind: {hooks}"
    extra = [t for t in threading.enumerate() if t.ident not in before and t.is_alive()
             and t.name.startswith("tpkit")]
    assert not extra, f"tpkit threads left behind: {extra}"


@pytest.fixture(scope="module")
def single_process_env():
    """One rank over gloo, as a ``deepspeed`` launch would set it; afterwards the environment is
    as before. The process group DeepSpeed makes stays (DeepSpeed caches it): the modules that
    use this fixture run last (``pytest_collection_modifyitems``)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
               LOCAL_SIZE="1")
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


#: Modules whose tests start DeepSpeed in this process: it leaves a default process group that
#: DeepSpeed keeps using, so they run after every test that starts a group of its own.
IN_PROCESS_DEEPSPEED = ("tests/integrations/test_deepspeed.py", "tests/test_offload_deepspeed.py")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.nodeid.startswith(IN_PROCESS_DEEPSPEED))
