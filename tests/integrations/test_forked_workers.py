"""A process forked during a slice (a DataLoader's workers, started by ``iter(loader)`` inside
it) is not the loop: it gets torch as it was, at once, with no patch of tpkit's and no slice.
Persistent workers forked inside a slice had kept tpkit's module-call route for their whole
life, after the slice too (an ``nn.Module`` called in ``__getitem__``, as torchvision's v2
transforms are, cost 4.6 us a call against torch's 2.1), and a copy of the loop's Recorder
that ``tp.phase`` there wrote into.

Truth: what each worker sees of torch and tpkit, reported in the batches it makes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from truth import STEPS, WARMUP

import tpkit as tp
from tpkit.capture import recorder
from tpkit.capture.probes import patching

TORCH_CALL = torch.nn.Module.__call__  # torch's own (tpkit installs nothing at import)
SEEN = ("torch's module call", "no patch of tpkit's", "no slice")


class Reporting(torch.utils.data.Dataset):
    """Samples whose last three values say what the worker making them sees (``SEEN``)."""

    def __init__(self) -> None:
        self.x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
        self.augment = torch.nn.Identity()  # a transform written as a module

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> torch.Tensor:
        seen = [torch.nn.Module.__call__ is TORCH_CALL, patching.in_place() == [], recorder.active() is None]
        return torch.cat([self.augment(self.x[i]), torch.tensor(seen, dtype=torch.float32)])


def test_workers_forked_inside_the_slice_run_torch_as_it_was_during_and_after_it():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(Reporting(), batch_size=4, num_workers=2, persistent_workers=True)
    inside, after = [], []
    with tp.profile(steps=STEPS, warmup=WARMUP, name="forked", progress=False, clock_hz=0, stop=False) as prof:
        for batch in loader:  # the workers are forked here, inside the slice
            inside.append(batch[:, -3:])
            F.mse_loss(model(batch[:, :8]), batch[:, :1]).backward()
            opt.step()
            opt.zero_grad()
    for batch in loader:  # the same workers, after the slice
        after.append(batch[:, -3:])
    assert len(prof.run.steps) == len(inside) == len(after) == 16
    for when, flags in (("inside the slice", inside), ("after it", after)):
        seen = torch.cat(flags).bool().all(dim=0).tolist()
        assert seen == [True, True, True], f"{when}, the workers saw: " + ", ".join(
            f"{what} {'yes' if ok else 'NO'}" for what, ok in zip(SEEN, seen))
    # the loop's own process still had its patches while the slice ran (the workers' came off alone)
    assert torch.nn.Module.__call__ is TORCH_CALL and patching.in_place() == []
