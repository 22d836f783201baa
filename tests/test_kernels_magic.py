"""%%tp_profile --kernels on|off|ab through a real IPython shell, kernels under Triton's
interpreter: the same starting state and batches for A and B, the loss checked, models left
as they were."""

from __future__ import annotations

import pytest
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

SETUP = """
import torch
from tpkit.demo.models import TinyConfig, TinyTransformer
from tpkit.datasets import SyntheticTokens
from tpkit.kernels import patched
torch.manual_seed(0)
cfg = TinyConfig(vocab_size=64, seq_len=8, n_layer=1, n_head=2, d_model=32)
model = TinyTransformer(cfg)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
loader = torch.utils.data.DataLoader(SyntheticTokens(n=256, seq_len=8, vocab_size=64), batch_size=4, shuffle=True,
                                     generator=torch.Generator().manual_seed(1))
"""
LOOP = "for b in loader:\n    model(b['x'], b['y']).backward()\n    opt.step()\n    opt.zero_grad()\n"


@pytest.mark.slow
def test_kernels_ab_same_start_same_batches_loss_checked(ip):
    ip.run_cell(SETUP)
    w0 = ip.user_ns["model"].embed.weight.detach().clone()
    with capture_output() as cap:
        ip.run_cell_magic("tp_profile", "--steps 2 --warmup 1 --kernels ab --name kab --quiet", LOOP)
    ab = ip.user_ns["_tp_ab"]
    assert ab.a.meta["knobs"]["kernels"] == "off" and ab.b.meta["knobs"]["kernels"] == "on"
    assert (ab.a.name, ab.b.name) == ("kab-A", "kab-B") and ip.user_ns["_tp"] is ab.b
    assert len(ab.a.steps) == len(ab.b.steps) == 3
    kinds = {s.rsplit("(", 1)[1] for s in ab.swapped}
    assert kinds >= {"rms_norm)", "swiglu)"}
    assert ab.verdict.ok and ab.verdict.n_steps == 3, ab.verdict.message
    # the same start: the first losses agree to float rounding, not just within tolerance
    assert abs(ab.losses["loss_a"].iloc[0] - ab.losses["loss_b"].iloc[0]) < 1e-4
    assert ab.losses["loss_a"].iloc[0] != ab.losses["loss_a"].iloc[1]  # and the model did train
    assert not ip.user_ns["patched"](ip.user_ns["model"])  # kernels taken out again
    assert not ip.user_ns["model"].embed.weight.detach().equal(w0)
    assert "loss matches" in cap.stdout
    # A and B run one after the other: their step times' middle halves say whether they differ,
    # and under Triton's interpreter B's speed is no GPU's (a bare 0.03x had been printed)
    assert "ms (p25-p75): " in cap.stdout
    assert "B's kernels ran in Triton's interpreter" in cap.stdout


def test_kernels_flag_needs_a_model_and_a_valid_mode(ip):
    with pytest.raises(UsageError, match="invalid choice"):
        ip.run_cell_magic("tp_profile", "--kernels maybe", "x = 1")
    # every name of the user's out (earlier tests' objects may hold a model inside a dict or an
    # object, which the walk finds since the A/B restores state wherever the loop keeps it)
    saved = {k: v for k, v in ip.user_ns.items() if not k.startswith("_") and k not in ip.user_ns_hidden}
    for k in saved:
        del ip.user_ns[k]
    try:
        with pytest.raises(UsageError, match="no torch.nn.Module"):
            ip.run_cell_magic("tp_profile", "--kernels ab --quiet", "x = 1")
    finally:
        ip.user_ns.update(saved)


def test_kernels_on_and_off_are_in_the_run_and_say_when_nothing_changed(ip):
    """``--kernels on`` is in the run as ``--kernels ab``'s B is: ``knobs["kernels"]`` and the
    modules swapped for the slice in ``meta["kernels"]`` (the loop's own modules inside it are
    the truth); where no module matches a kernel the run says so. It had left ``knobs`` {} and
    no word (``--kernels ab`` said "no module matched a kernel")."""
    ip.run_cell(SETUP)
    loop = LOOP.replace("for b in loader:\n", "for b in loader:\n"
                        "    inside = [n for n, m in model.named_modules() if 'Kernel' in type(m).__name__]\n")
    with capture_output():
        ip.run_cell_magic("tp_profile", "--steps 1 --warmup 0 --kernels on --quiet", loop)
    run = ip.user_ns["_tp"]
    inside = ip.user_ns["inside"]
    assert inside and run.meta["knobs"] == {"kernels": "on"}
    assert [s.split(" (")[0] for s in run.meta["kernels"]["swapped"]] == [f"TinyTransformer.{n}" for n in inside]
    assert run.meta["kernels"]["mode"] == "on" and not any("kernel" in n for n in run.meta["notes"])
    assert not ip.user_ns["patched"](ip.user_ns["model"])  # taken out again
    with capture_output():
        ip.run_cell_magic("tp_profile", "--steps 1 --warmup 0 --kernels off --quiet", loop)
    assert ip.user_ns["_tp"].meta["kernels"] == {"mode": "off", "swapped": []}
    assert "--kernels off: no model had tpkit's kernels in" in " ".join(ip.user_ns["_tp"].meta["notes"])
    ip.run_cell("model = torch.nn.Sequential(torch.nn.Linear(8, 8)); opt = torch.optim.SGD(model.parameters(), lr=0.1)")
    with capture_output() as cap:
        ip.run_cell_magic("tp_profile", "--steps 1 --warmup 0 --kernels on --quiet",
                          "while True:\n    model(torch.randn(2, 8)).sum().backward()\n    opt.step()\n")
    run = ip.user_ns["_tp"]
    assert run.meta["knobs"] == {"kernels": "on"} and run.meta["kernels"]["swapped"] == []
    assert "--kernels on: no module matched a kernel" in cap.stdout
