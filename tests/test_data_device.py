"""The accelerator path at its boundary: one-batch-ahead logic with a stand-in prefetcher
(no CUDA here), and the CPU fallback of pin_memory / device="cuda"."""

from __future__ import annotations

import pytest
import torch

from tests.data_helpers import Mixed, as_lists, live_children
from tpkit.capture import recorder
from tpkit.data import Loader


class FakePrefetcher:
    """Records what the loader asks of a DevicePrefetcher."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []

    def start(self, batch):
        self.log.append(("start", int(batch["i"][0])))
        return ("handle", batch)

    def finish(self, handle):
        self.log.append(("finish", int(handle[1]["i"][0])))
        return handle[1], 0.001


@pytest.mark.parametrize("workers", [0, 2])
def test_copies_run_one_batch_ahead_and_every_batch_is_finished(workers):
    loader = Loader(Mixed(10), batch_size=4, num_workers=workers)
    it = iter(loader)
    it._prefetcher = fake = FakePrefetcher()
    rec = recorder.Recorder("t")
    recorder.set_active(rec)
    try:
        got = list(it)
    finally:
        recorder.set_active(None)
    assert as_lists(got) == as_lists(list(Loader(Mixed(10), batch_size=4)))
    # batch k+1's copy starts before batch k is handed out
    assert fake.log == [("start", 0), ("start", 4), ("finish", 0), ("start", 8), ("finish", 4),
                        ("finish", 8)]
    assert [s[0] for s in rec.spans].count("h2d") == 3
    assert all(row[5] >= 0.001 for row in rec.loader)  # the wait counts as transfer time
    assert not live_children()


def test_pin_memory_without_cuda_warns_and_gives_cpu_tensors():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.warns(RuntimeWarning, match="CUDA is not available"):
        loader = Loader(Mixed(6), batch_size=3, pin_memory=True, num_workers=1)
    with pytest.warns(RuntimeWarning, match="CUDA is not available"):
        Loader(Mixed(6), batch_size=3, device="cuda")
    got = list(loader)
    assert as_lists(got) == as_lists(list(Loader(Mixed(6), batch_size=3)))
    assert got[0]["x"].device.type == "cpu"
