"""``%tp_profile`` as a line magic too (IPython's ``%timeit``/``%%timeit`` convention), through
a real IPython shell: the statement after the options is profiled, with the steps and names
asked for; ``%tp_profile?`` lists every option with an example; ``--ops`` works from both."""

from __future__ import annotations

import io
from contextlib import redirect_stdout

import pytest
from IPython.core.error import UsageError

import tpkit as tp

SETUP = """
import torch
torch.manual_seed(0)
lm_model = torch.nn.Linear(64, 8)
lm_opt = torch.optim.SGD(lm_model.parameters(), lr=0.1)
lm_losses = []
def lm_train(model, opt, n):
    x = torch.randn(16, 64)
    for _ in range(n):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        lm_losses.append(float(loss.detach()))
"""


def test_line_magic_profiles_the_statement(ip):
    ip.run_cell(SETUP)
    with redirect_stdout(io.StringIO()) as out:
        ip.run_line_magic("tp_profile", "--steps 4 --warmup 1 --name lm --quiet lm_train(lm_model, lm_opt, 50)")
    run = tp.last_run()
    assert run.name == "lm" and ip.user_ns["_tp"] is run
    assert len(run.steps) == 5 and run.steps["warmup"].sum() == 1  # 1 warmup + 4 steps, then it stopped
    # the statement was stopped by the slice at its 6th forward (its 5th iteration ran whole, as
    # a loop stopped by break after 5 would), not run 50 times; the losses it logged are the run's
    assert len(ip.user_ns["lm_losses"]) == 5
    assert ip.user_ns["lm_losses"] == pytest.approx(run.steps["loss"].tolist(), rel=1e-6)
    assert "tpkit run 'lm'" in out.getvalue()  # --quiet prints the summary
    # --ops from the line, with and without its number; the statement starts after the options
    with redirect_stdout(io.StringIO()):
        ip.run_line_magic("tp_profile", "--steps 3 --warmup 0 --ops 2 --quiet --name lmops lm_train(lm_model, lm_opt, 9)")
    assert tp.last_run().meta["ops"]["steps"] == [1, 2] and "aten::addmm" in set(tp.last_run().ops["op"])
    with redirect_stdout(io.StringIO()):
        ip.run_line_magic("tp_profile", "--steps 3 --warmup 0 --quiet --ops lm_train(lm_model, lm_opt, 9)")
    assert tp.last_run().meta["ops"]["steps"] == [0, 1, 2]


def test_line_magic_without_a_statement_or_with_a_bad_option_is_refused(ip):
    with pytest.raises(UsageError, match="no statement"):
        ip.run_line_magic("tp_profile", "--steps 4")
    with pytest.raises(UsageError):
        ip.run_line_magic("tp_profile", "--steps zero lm_train(lm_model, lm_opt, 9)")


def test_help_lists_every_option_with_an_example(ip):
    doc = ip.find_line_magic("tp_profile").__doc__
    assert "%tp_profile --steps 20 train(model, loader)" in doc and "%%tp_profile" in doc
    for option in ("--steps", "--warmup", "--name", "--no-stop", "--quiet", "--save", "--no-memory",
                   "--memory-detail", "--clock-hz", "--samples-per-step", "--kernels", "--ops", "--comm"):
        assert option in doc, option
    assert ip.find_cell_magic("tp_profile").__doc__ == doc  # one magic, both forms


def test_tp_compare_takes_a_baseline(ip):
    import factories

    ip.user_ns["fast"] = factories.make_run("fast", [0.10] * 8)
    ip.user_ns["slow"] = factories.make_run("slow", [0.20] * 8)
    ip.run_line_magic("tp_compare", "--baseline slow fast slow")
    assert ip.user_ns["_tp_compare"].baseline == "slow"
    from IPython.core.error import UsageError

    with pytest.raises(UsageError, match="not one of the runs"):
        ip.run_line_magic("tp_compare", "--baseline other fast slow")
