"""The stall watchdog never reads a loss that lives on a stalled GPU: reading it would wait for
the stream, which a rank stuck in NCCL never drains."""

from __future__ import annotations

import time

import pytest

import tpkit as tp
from tpkit.capture.ranks import RankWatchdog
from tpkit.capture.recorder import Recorder


class StalledGpuLoss:
    """Stands in for a CUDA loss tensor whose stream never drains: reading it never returns."""

    is_cuda = True

    def __float__(self) -> float:
        raise AssertionError("the watchdog read a loss on a stalled GPU (would block forever)")


def test_watchdog_saves_the_stalled_rank_without_reading_gpu_losses(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    rec = Recorder("stalled")
    rec.losses = [(0, 2.5), (1, StalledGpuLoss())]
    rec.end_step()
    rec.end_step()
    dog = RankWatchdog(rec, tmp_path, timeout_s=0.05, poll_s=0.01)
    with pytest.raises(KeyboardInterrupt):  # the watchdog interrupts the main thread when it fires
        dog.install()
        time.sleep(5)
    dog.remove()
    run = tp.load(tmp_path / "rank1")
    assert run.meta["stopped_by"] == "stalled" and not run.complete
    assert run.steps["loss"].iloc[0] == 2.5 and run.steps["loss"].isna().iloc[1]
    assert any("on the GPU" in n for n in run.meta["notes"])
