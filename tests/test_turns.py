"""benchmarks/turns.py: processes that take turns block by block, the others frozen, so that
their blocks pair like the in-process modes of benchmarks/overhead.py. Known sleeps are the
truth; nothing may be left behind, and a script that dies is named."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "tests" / "turn_script.py")


@pytest.fixture
def turns(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    sys.modules.pop("turns", None)
    import turns

    return turns


def cmd(step_ms: float) -> list[str]:
    return [sys.executable, SCRIPT, str(step_ms)]


def test_blocks_come_back_with_their_own_steps_and_the_others_frozen(turns, tmp_path):
    with turns.Turns({"base": cmd(4), "slow": cmd(6)}, env={}, cwd=ROOT, log_dir=tmp_path) as t:
        t.wait_ready(timeout_s=60)
        trees = {name: [p.pid for p in turns._tree(proc.pid)] for name, proc in t.procs.items()}
        assert all(psutil.Process(pid).status() == psutil.STATUS_STOPPED for pids in trees.values() for pid in pids)
        base = [t.block("base") for _ in range(6)]
        slow = [t.block("slow") for _ in range(6)]
        assert all(psutil.Process(pid).status() == psutil.STATUS_STOPPED for pids in trees.values() for pid in pids)
    # skip 1 + block 4 steps: 4 kept step times a block, each a sleep of the script's own length
    assert all(len(b) == 4 for b in base + slow)
    ratio = statistics.median(x for b in slow for x in b) / statistics.median(x for b in base for x in b)
    assert ratio == pytest.approx(1.5, abs=0.1)
    assert statistics.median(x for b in base for x in b) == pytest.approx(0.004, abs=0.0015)
    # every script stopped when told, its folder of pipes gone
    assert all(p.returncode == 0 for p in t.procs.values())
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
                   for pids in trees.values() for pid in pids)
    assert not t.dir.exists()


def test_a_script_that_dies_is_named_and_the_others_are_ended(turns, tmp_path):
    with pytest.raises(RuntimeError, match="dies ended with exit code 3"):
        with turns.Turns({"ok": cmd(1), "dies": cmd(-1)}, env={}, cwd=ROOT, log_dir=tmp_path) as t:
            t.wait_ready(timeout_s=60)
            for _ in range(3):
                t.block("ok")
                t.block("dies")
    assert t.procs["ok"].returncode == 0  # thawed and told to stop, not left frozen
    assert not t.dir.exists()
