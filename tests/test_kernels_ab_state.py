"""--kernels ab starts run B from run A's starting state wherever the loop keeps it: an
optimizer in a dict or on an object, a hand LR warmup's step counter, a GradScaler. With no
module matching a kernel (a Linear-Dropout-Linear model) A and B run the same code, so the
truth is B's losses = A's, exactly; and after the cell the user's state is a plain slice's.
State that tpkit cannot put back is named, never called a loss drift."""

from __future__ import annotations

import pytest
from IPython.utils.capture import capture_output

SETUP = """
import numpy as np
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1))
_opt = torch.optim.Adam(model.parameters(), lr=1e-2)
data = torch.utils.data.TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
loader = torch.utils.data.DataLoader(data, batch_size=16, shuffle=True)
{extra}
"""
LOOP = """
for x, y in loader:
    {before}
    loss = torch.nn.functional.mse_loss({model}(x), y){plus}
    {backward}
    {opt}.zero_grad()
    {after}
"""
WARMUP = "for g in _opt.param_groups: g['lr'] = 1e-2 * min(1.0, (global_step + 1) / 10)"
CASES = {  # the loop's state where users keep it: (setup, LOOP's fields)
    "optimizer in a dict": ("state = {'opt': _opt}", {"opt": "state['opt']"}),
    "optimizer as an attribute": ("class S: pass\nstate = S(); state.opt = _opt", {"opt": "state.opt"}),
    "hand LR warmup from a counter": ("global_step = 0", {"before": WARMUP, "after": "global_step += 1"}),
    "model, optimizer and counter on a trainer object": (
        "class Trainer: pass\ntr = Trainer(); tr.model, tr.opt, tr.step = model, _opt, 0\ndel model",
        {"model": "tr.model", "opt": "tr.opt", "before": WARMUP.replace("global_step", "tr.step"),
         "after": "tr.step += 1"}),
}


def loop(**fields: str) -> str:
    base = {"before": "", "model": "model", "plus": "", "backward": "loss.backward()\n    {opt}.step()",
            "opt": "_opt", "after": ""}
    base.update(fields)
    return LOOP.format(**{**base, "backward": base["backward"].format(opt=base["opt"])})


def fresh(ip, setup: str) -> None:
    ip.run_line_magic("reset", "-f")  # no state left by another test: what is restored is counted
    ip.run_cell(SETUP.format(extra=setup))


def run_ab(ip, setup: str, cell: str):
    fresh(ip, setup)
    with capture_output():
        ip.run_cell_magic("tp_profile", "--steps 4 --warmup 1 --kernels ab --quiet", cell)
    return ip.user_ns.pop("_tp_ab")


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_run_b_starts_from_run_a_state_wherever_the_loop_keeps_it(ip, case):
    setup, fields = CASES[case]
    ab = run_ab(ip, setup, loop(**fields))
    assert ab.swapped == [] and "runs A and B ran the same code" in " ".join(ab.notes)
    assert ab.verdict.ok and ab.verdict.message.startswith("loss matches"), ab.verdict.message
    assert ab.losses["abs_diff"].max() == 0.0 and len(ab.losses) == 5
    assert ab.losses["loss_a"].nunique() == 5  # five different batches: the model did train


@pytest.mark.slow
def test_a_grad_scaler_starts_run_b_at_run_a_starting_scale(ip):
    setup = "opt = _opt\nscaler = torch.amp.GradScaler('cpu', init_scale=4.0, growth_interval=1)\nscales = []"
    cell = loop(backward="scaler.scale(loss).backward()\n    scaler.step(opt)\n    scaler.update()", opt="opt",
                after="scales.append(scaler.get_scale())")  # the scale doubles at every finite step
    fresh(ip, setup)
    with capture_output():
        ip.run_cell_magic("tp_profile", "--steps 4 --warmup 1 --quiet", cell)  # the truth: one plain slice
    plain = (ip.user_ns["scaler"].get_scale(), list(ip.user_ns["scales"]))
    ab = run_ab(ip, setup, cell)
    assert ab.verdict.ok and ab.losses["abs_diff"].max() == 0.0, ab.verdict.message
    assert plain[1][0] == 8.0  # a plain slice starts at init_scale 4 and doubles
    assert (ip.user_ns["scaler"].get_scale(), ip.user_ns["scales"]) == plain  # B started at 4, as A did


@pytest.mark.slow
@pytest.mark.parametrize("change, named", [("np_shift += 0.1", None), ("t_shift.add_(0.1)", "tensor t_shift")])
def test_state_tpkit_cannot_restore_is_not_a_loss_drift(ip, change, named):
    """A numpy array or a tensor the loop changes in place (tpkit copies neither) feeds the
    loss: B starts 0.1 * steps higher. Same code in A and B: the verdict says the start was
    not the same, what tpkit restored and, where it saw it, what it could not."""
    setup = "np_shift = np.zeros(1)\nt_shift = torch.zeros(())"
    ab = run_ab(ip, setup, loop(plus=" + float(np_shift[0]) + t_shift", after=change))
    message = ab.verdict.message
    assert not ab.verdict.ok and "LOSS DRIFT" not in message
    assert message.startswith("NOT THE SAME START: runs A and B ran the same code"), message
    assert "tpkit restored 1 model, 1 optimizer, " in message and "the RNGs (torch CPU, numpy, random" in message
    if named:
        assert named in message and any(n.startswith(named) for n in ab.notes)
    else:
        assert "numpy array changed in place" in message


@pytest.mark.slow
def test_with_kernels_swapped_what_could_not_be_restored_is_named_not_the_kernels(ip):
    """An RMSNorm that the rms_norm kernel replaces in B, and a tensor the loop shifts in place
    (tpkit does not copy it): the verdict names the tensor instead of calling it a drift."""
    setup = ("from tpkit.demo.models import RMSNorm\nt_shift = torch.zeros(())\n"
             "model = torch.nn.Sequential(torch.nn.Linear(8, 32), RMSNorm(32), torch.nn.Linear(32, 1))\n"
             "_opt = torch.optim.Adam(model.parameters(), lr=1e-2)")
    ab = run_ab(ip, setup, loop(plus=" + t_shift", after="t_shift.add_(0.1)"))
    assert [s.rsplit("(", 1)[1] for s in ab.swapped] == ["rms_norm)"]
    message = ab.verdict.message
    assert not ab.verdict.ok and "LOSS DRIFT" not in message
    assert message.startswith("NOT THE SAME START: run A changed what tpkit could not put back (tensor t_shift"), message
    assert "the kernels need not be the cause" in message


@pytest.mark.slow
@pytest.mark.parametrize("setup, cell_model, named", [
    ("class Counted(torch.nn.Module):\n"
     "    def __init__(s): super().__init__(); s.l = torch.nn.Linear(8, 1)\n"
     "    def forward(s, x):\n"
     "        if not hasattr(s, 'seen'): s.register_buffer('seen', torch.zeros(()))\n"
     "        s.seen += 1\n"
     "        return s.l(x)\n"
     "model = Counted()\n_opt = torch.optim.Adam(model.parameters(), lr=1e-2)",
     "model", "model (Counted) gained state in run A (seen: "),
    ("lazy = torch.nn.LazyLinear(1)", "(lambda x: model(x) + 0 * lazy(x))",
     "lazy (Linear) could not be put back: its load_state_dict() raised RuntimeError (Can't access the shape"),
    ("class EMA:\n"
     "    def __init__(self): self.n, self.loaded = 0, True\n"
     "    def state_dict(self): return {'n': self.n}\n"
     "    def load_state_dict(self, sd):\n"
     "        if self.loaded: raise RuntimeError('already loaded')\n"
     "        self.n, self.loaded = sd['n'], True\n"
     "ema = EMA()", "model", "ema (EMA) could not be put back: its load_state_dict() raised RuntimeError (already loaded)"),
], ids=["buffer-registered-in-forward", "lazy-module-materialised", "load-refused"])
def test_state_that_cannot_be_loaded_back_is_said_and_the_ab_goes_on(ip, setup, cell_model, named):
    """A module that registers a buffer in its first forward (its state before A lacks the key:
    "Missing key(s) in state_dict"), an nn.LazyLinear materialised in run A, a user's object
    whose load_state_dict refuses: the A/B had died after run A with no result. It runs B and
    says what it could not put back (the first loaded with strict=False, its new key keeping A's
    value). Truth: A and B run the same code; from the same state their losses are equal. The
    lazy module's materialisation drew from torch's RNG in A and not in B (the loader's shuffle
    differs): the verdict says the start was not the same and names it, no drift."""
    ab = run_ab(ip, setup, loop(model=cell_model))
    assert any(n.startswith(named) for n in ab.notes), ab.notes
    assert len(ab.losses) == 5
    if "lazy" in named:
        assert ab.verdict.message.startswith("NOT THE SAME START") and named in ab.verdict.message, ab.verdict.message
    else:
        assert ab.verdict.ok and ab.losses["abs_diff"].max() == 0.0, ab.verdict.message


@pytest.mark.slow
def test_a_librarys_objects_keep_their_attributes_and_their_models_are_put_back(ip, tmp_path, monkeypatch):
    """A library's object (here a module installed in a site-packages folder: a logger run with a
    step counter, as wandb's) is not rolled back: its counter goes on from A's end in B (a
    wandb run's put back had B's logs rejected), while the user's own counter object is; a model
    and optimizer reached only through a library's object (a trainer's) are still put back.
    Truth: the counters' values after the cell; B's losses equal to A's."""
    site = tmp_path / "site-packages"
    site.mkdir()
    (site / "fakelogger.py").write_text(
        "class Run:\n    def __init__(self): self.step = 0\n    def log(self, loss): self.step += 1\n"
        "class Trainer:\n    def __init__(self, model, opt): self.model, self.opt = model, opt\n")
    monkeypatch.syspath_prepend(str(site))
    setup = ("import fakelogger\nrun = fakelogger.Run()\ntr = fakelogger.Trainer(model, _opt)\ndel model\n"
             "class Mine: pass\nmine = Mine(); mine.step = 0")
    ab = run_ab(ip, setup, loop(model="tr.model", opt="tr.opt", after="run.log(loss.item()); mine.step += 1"))
    assert ab.verdict.ok and ab.losses["abs_diff"].max() == 0.0, ab.verdict.message
    steps = ip.user_ns["mine"].step  # one run's: put back before B
    assert steps >= 4 and ip.user_ns["run"].step == 2 * steps  # A's steps, then B's: never put back


def test_a_namespace_of_many_small_user_objects_is_walked_whole():
    """30 lists of 1000 of the user's records (a parsed dataset): the walk had stopped at its
    20,000-object bound every time ("walk cut short" in every A/B) after ~0.4 s. Items of a
    container past the first _MAX_ITEMS are put back with it, not followed, and the restore says
    which containers held state past them (it had said nothing: a model in a dict's 140th entry
    kept run A's state). Truth: the objects built."""
    import torch

    from tpkit.capture.ab import _MAX_ITEMS, Snapshot

    class Rec:
        def __init__(self, i: int) -> None:
            self.i, self.text, self.meta, self.t = i, "x", {"a": i, "b": [i]}, torch.zeros(2)

    ns = {"records": [[Rec(j) for j in range(1000)] for _ in range(30)], "model": torch.nn.Linear(4, 4)}
    snap = Snapshot.take(ns)
    assert not snap.cut_short
    assert len(snap.tensors) == 30 * _MAX_ITEMS  # every followed record's tensor
    ns["records"][0][0].i = -1
    (said,) = snap.restore()
    assert ns["records"][0][0].i == 0
    assert said.startswith(f"only the first {_MAX_ITEMS} items of records[0], records[1], records[2] and 27 more were "
                           "looked into")


def test_state_past_a_containers_first_items_is_said_not_lost_silently():
    """A dict of 150 modules and a list of 300 records, run A changing the 140th module's weight
    and the 250th record: the walk follows a container's first _MAX_ITEMS items, so those kept
    run A's state; the restore says which containers (it had said nothing). Plain values past
    them are no concern (a list of 1,000 floats is not named)."""
    import torch

    from tpkit.capture.ab import _MAX_ITEMS, Snapshot

    class Rec:
        def __init__(self) -> None:
            self.n = 0

    ns = {"recs": [Rec() for _ in range(300)], "mods": {f"m{i}": torch.nn.Linear(2, 2) for i in range(150)},
          "floats": [0.5] * 1000}
    snap = Snapshot.take(ns)
    ns["recs"][5].n = 7
    said = snap.restore()
    assert ns["recs"][5].n == 0  # within the first items: put back
    assert said == [f"only the first {_MAX_ITEMS} items of recs, mods were looked into (each binding is put back; a "
                    "model, optimizer or object of yours past them keeps run A's state)"]

