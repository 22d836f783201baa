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


class StalledGpuChunk:
    """Stands in for a CUDA chunk of ``LossSums`` on a stalled rank: reading it never returns."""

    is_cuda = True

    def tolist(self) -> list[float]:
        raise AssertionError("the watchdog read a loss sum on a stalled GPU (would block forever)")


def test_watchdog_leaves_the_loss_sums_on_a_stalled_gpu_unread(tmp_path, monkeypatch):
    """The losses as the phase probe keeps them (``LossSums`` slots, read by ``float`` after the
    slice): a slot whose chunk is on the GPU says so, as a tensor would (its chunk had been read,
    and the watchdog's thread blocked on the stalled stream: no run saved)."""
    import torch

    from tpkit.capture.probes.loss_sums import LossSums

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    rec = Recorder("stalled")
    sums = LossSums(rec)
    sums.add(0, torch.tensor(2.5, device="meta"))  # a device's chunk (a CPU loss is summed in host floats)
    rec.end_step()
    sums._chunks[0] = StalledGpuChunk()  # type: ignore[assignment] - the chunk now "on a stalled GPU"
    dog = RankWatchdog(rec, tmp_path, timeout_s=0.05, poll_s=0.01)
    with pytest.raises(KeyboardInterrupt):
        dog.install()
        time.sleep(5)
    dog.remove()
    run = tp.load(tmp_path / "rank1")
    assert run.meta["stopped_by"] == "stalled" and run.steps["loss"].isna().all()
    assert any("1 losses were on the GPU" in n for n in run.meta["notes"])
