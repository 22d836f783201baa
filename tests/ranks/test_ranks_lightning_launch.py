"""Lightning launching its ranks itself, from a script run by plain ``python`` under
``tp.profile`` (tests/ranks/lightning_launch_worker.py: 2 CPU ranks, ``max_steps`` 12, a slice
of 2 steps).

Truth: Lightning's own ``global_step`` in every process that trained and the losses its
``training_step`` returned.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from lightning_launch_worker import MAX_STEPS, STEPS
from ranks_launch import python_script

pytest.importorskip("lightning")


RANKS_WARMUP = 5


def _facts(out: Path, prefix: str) -> list[dict]:
    return [json.loads(f.read_text()) for f in sorted(out.glob(f"{prefix}_*.json"))]


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


@pytest.mark.parametrize("strategy", ["ddp_fork", "ddp_spawn"])
def test_ranks_lightning_starts_in_processes_of_its_own_train_as_without_tpkit(strategy, tmp_path):
    """``ddp_spawn`` and ``ddp_fork`` (what ``ddp_notebook`` is) train in worker processes the
    launcher starts, which tpkit does not profile. Forked workers had inherited the live probes:
    each stopped its fit after the slice's steps (global_step 7 of 40), its run never kept; and
    the profiling process's run read 0 steps with the advice to call tp.step(). The workers now
    train to ``max_steps`` and the run says where the training ran and how to profile it."""
    shm = _shm()
    python_script("lightning_launch_worker.py", str(tmp_path), strategy, "1", timeout_s=150)
    trained = _facts(tmp_path, "trained")
    assert sorted(t["rank"] for t in trained) == [0, 1]
    assert all(t["global_step"] == MAX_STEPS == len(t["losses"]) for t in trained), trained
    # forked inside the slice, the training processes had kept the probes' copies: the module-call
    # route, every patch, a Recorder, and the comm probe, which timed each collective into it
    assert all(t["tpkit_in"] == [] for t in trained), trained
    (run,) = _facts(tmp_path, "run")
    assert run["steps"] == 0
    how = "forked" if strategy == "ddp_fork" else "started"
    assert any(n.startswith(f"lightning ran the training in processes it {how}") and "torchrun" in n
               for n in run["notes"]), run["notes"]
    assert not any("tp.step()" in n for n in run["notes"]), run["notes"]
    assert _shm() <= shm  # (the launch's processes are checked gone by python_script)


def test_warmup_auto_with_a_process_group_made_inside_fit_is_a_fixed_warmup_on_every_rank(tmp_path):
    """``strategy="ddp"`` from a script: Lightning runs it again for rank 1 and makes the process
    group inside ``fit``, after the slice started, where tpkit refuses ``warmup="auto"`` had not
    looked. Each rank had settled after its own count (11 and 12 steps here, rank 1's first steps
    jittering), stopped at its own step, and rank 0 died with gloo's "Connection closed by peer".
    Now every rank takes the same fixed warmup once the group is up (5 steps,
    tpkit.capture.slice.RANKS_WARMUP), and both stop at its end."""
    python_script("lightning_launch_worker.py", str(tmp_path), "ddp", "auto", timeout_s=150)
    trained = _facts(tmp_path, "trained")
    assert sorted(t["rank"] for t in trained) == [0, 1]
    assert all(t["global_step"] == RANKS_WARMUP + STEPS == len(t["losses"]) for t in trained), trained
    runs = _facts(tmp_path, "run")
    assert len(runs) == 2
    for run in runs:
        assert run["steps"] == RANKS_WARMUP + STEPS and run["warmup"] == RANKS_WARMUP, run
        assert run["global_step"] == RANKS_WARMUP + STEPS < MAX_STEPS
        assert any(n.startswith("warmup auto: not used, as the process group came up inside the slice with 2 ranks")
                   for n in run["notes"]), run["notes"]
