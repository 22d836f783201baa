"""--kernels ab with an iterator made before the cell: run B cannot see run A's batches, and the
A/B says so instead of reporting a false loss drift."""

from __future__ import annotations

import pytest
from IPython.utils.capture import capture_output

SETUP = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
def batches():
    g = torch.Generator().manual_seed(0)
    while True:
        yield torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)
it = {make}
"""
LOOP = ("for x, y in it:\n    torch.nn.functional.mse_loss(model(x), y).backward()\n"
        "    opt.step()\n    opt.zero_grad()\n")


@pytest.mark.slow
@pytest.mark.parametrize("make", ["batches()", "iter(list(zip(torch.randn(64, 16, 4), torch.randn(64, 16, 1))))"])
def test_an_iterator_made_before_the_cell_is_not_comparable_not_a_loss_drift(ip, make):
    ip.run_cell(SETUP.format(make=make))
    with capture_output():
        ip.run_cell_magic("tp_profile", "--steps 3 --warmup 1 --kernels ab --name itab --quiet", LOOP)
    ab = ip.user_ns["_tp_ab"]
    assert not ab.verdict.ok
    assert ab.verdict.message.startswith("NOT COMPARABLE") and "'it'" in ab.verdict.message
    assert any("'it'" in n and "cannot be rewound" in n for n in ab.notes)
