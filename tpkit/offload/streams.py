"""Copy streams for offload, one per CUDA device the parameters live on, and the events
that order them against the compute streams without host synchronisation.

Every stream and event is made and recorded with its own device current
(``torch.cuda.device(dev)``): a stream made on the current device while the parameters are on
``cuda:k`` would order nothing against their work, and would open a stray context on GPU 0.

Sync points (the only ones): ``wait_host`` blocks the calling thread until copies already
queued have run; CPUOffloadAdamW calls it on its worker thread, right before the host writes a
buffer those copies read (see tpkit/offload/adamw.py). Everything else is a stream waiting on
an event, on the GPU.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

__all__ = ["CopyStreams", "wait_host"]


class CopyStreams:
    """One side stream per device in ``devices`` (CUDA devices)."""

    def __init__(self, devices: Iterable[torch.device]) -> None:
        self.streams: dict[torch.device, Any] = {}
        for dev in dict.fromkeys(devices):
            with torch.cuda.device(dev):
                self.streams[dev] = torch.cuda.Stream(device=dev)

    def stream(self, dev: torch.device) -> Any:
        """The copy stream of ``dev``."""
        return self.streams[dev]

    def compute_event(self, dev: torch.device) -> Any:
        """An event recorded now on ``dev``'s current (compute) stream: work queued so far there."""
        with torch.cuda.device(dev):
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(dev))
        return ev

    def after_compute(self) -> None:
        """Each copy stream waits (on the GPU) for the work queued so far on its device's
        compute stream: copies into weights that a queued backward may still read come after it."""
        for dev, s in self.streams.items():
            with torch.cuda.device(dev):
                s.wait_stream(torch.cuda.current_stream(dev))

    def publish(self) -> list[Any]:
        """Copies queued so far on the copy streams (weights back to the device) must land
        before the next forward: each compute stream waits for its copy stream on the GPU (no
        host sync). Returns the events, for ``wait_host`` where the host must wait too."""
        events = []
        for dev, s in self.streams.items():
            with torch.cuda.device(dev):
                ev = torch.cuda.Event()
                ev.record(s)
                torch.cuda.current_stream(dev).wait_event(ev)
            events.append(ev)
        return events


def wait_host(events: Iterable[Any]) -> None:
    """Sync point: block this thread until every event has completed."""
    for ev in events:
        ev.synchronize()
