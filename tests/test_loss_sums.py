"""A step's loss as the phase probe keeps it (``LossSums``): on the CPU, each loss is read when it
is backpropagated and summed in host floats; the sums are the ones a float64 tensor accumulates
(the device path), to the bit."""

from __future__ import annotations

import pytest
import torch

from tpkit.capture.probes.loss_sums import LossSums
from tpkit.capture.recorder import Recorder


def device_sum(losses: list[torch.Tensor]) -> float:
    """What the device path computes: in-place adds into a float64 slot, read after."""
    slot = torch.zeros((), dtype=torch.float64)
    for loss in losses:
        slot.add_(loss.detach().reshape(()))
    return float(slot)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_cpu_sums_are_the_float64_sums_to_the_bit(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    rec = Recorder()
    sums = LossSums(rec)
    steps = [[(torch.rand((), generator=gen) * 10).to(dtype).requires_grad_() for _ in range(k)]
             for k in (1, 3, 2, 4)]  # micro-batches per step (gradient accumulation)
    for step, losses in enumerate(steps):
        for loss in losses:
            sums.add(step, loss * 1)  # (a loss with a graph, as backward sees it)
    assert [s for s, _ in rec.losses] == [0, 1, 2, 3]
    assert [float(slot) for _, slot in rec.losses] == [device_sum([x * 1 for x in losses]) for losses in steps]
    assert rec.loss_counts == {0: 1, 1: 3, 2: 2, 3: 4}
    assert rec.own_tensors == []  # nothing allocated for them: no tensor the memory probe must leave out


def test_a_one_element_loss_of_shape_one_and_many_chunks() -> None:
    rec = Recorder()
    sums = LossSums(rec)
    n = LossSums.CHUNK * 2 + 5  # three host chunks
    for step in range(n):
        sums.add(step, torch.tensor([step + 0.5]))
    assert [float(slot) for _, slot in rec.losses] == [step + 0.5 for step in range(n)]
    assert not any(slot.is_cuda for _, slot in rec.losses)


def test_a_parameter_whose_detach_is_a_tensor_sums_with_the_step() -> None:
    rec = Recorder()
    sums = LossSums(rec)
    sums.add(0, torch.nn.Parameter(torch.tensor(2.0)))
    sums.add(0, torch.tensor(0.5))
    assert [(s, float(slot)) for s, slot in rec.losses] == [(0, 2.5)]


def test_a_tensor_subclass_loss_is_kept_as_a_copy_of_its_own() -> None:
    class Marked(torch.Tensor):
        pass

    rec = Recorder()
    sums = LossSums(rec)
    loss = torch.tensor(2.0).as_subclass(Marked)
    sums.add(0, loss)
    assert len(rec.losses) == 1 and float(rec.losses[0][1]) == 2.0 and rec.losses[0][1] is not loss
