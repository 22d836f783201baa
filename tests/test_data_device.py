"""The accelerator path at its boundary: one-batch-ahead logic with a stand-in prefetcher
(no CUDA here), and the CPU fallback of pin_memory / device="cuda"."""

from __future__ import annotations

import pytest
import torch
from data_helpers import Mixed, as_lists, live_children

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


class _FakeStream:
    def __init__(self, device=None, priority=0) -> None:
        self.device = device

    def wait_event(self, ev) -> None:
        pass


class _FakeEvent:
    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass


def test_prefetch_copies_are_not_charged_as_h2d(monkeypatch):
    """Issue 17 item 3: the prefetcher's side-stream copies went through Tensor.to, which the
    phase probe times as exposed h2d on the loop's thread (a false COPY-BOUND). With stand-in
    streams and the meta device for the GPU, the only h2d spans are the loop's own Tensor.to
    and the loader's wait for the copy (source "tpkit.data"), one each per batch."""
    import contextlib

    import tpkit as tp
    import tpkit.data.loader as loader_mod

    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: _FakeStream(d))
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: None)
    monkeypatch.setattr(loader_mod, "resolve_device", lambda device, pin: (torch.device("meta"), False))
    from tpkit.capture.probes import phases

    monkeypatch.setattr(phases, "has_accelerator", lambda: True)

    loader = Loader(Mixed(64), batch_size=4, device="cuda")
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    devices = []
    with tp.profile(steps=5, warmup=1, progress=False, clocks=False, memory=False) as prof:
        for batch in loader:
            devices.append(batch["x"].device.type)
            torch.ones(2, 3).to("meta")  # the loop's own copy: the probe still times it
            model(torch.ones(2, 3)).sum().backward()
            opt.step()
            opt.zero_grad()
    spans = prof.run.spans
    h2d = spans[spans["phase"] == "h2d"]
    steps = len(devices)
    assert set(devices) == {"meta"} and steps == 6
    # one of each per batch handed out (warmup included)
    assert sorted(h2d["source"].value_counts().items()) == [("Tensor.to", steps), ("tpkit.data", steps)]
