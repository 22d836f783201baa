"""Memory truths on plain CPU loops (issue 13's table), each against an independent truth:
the storages autograd saves (``saved_tensors_hooks``), parameter and gradient bytes counted
from the tensors, and allocations of a known size made at a known moment.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from truth import STEPS, WARMUP

import tpkit as tp
from tpkit.analysis.memory import across_steps

MiB = 1 << 20


def _activations_at_forward_exit(run) -> "list[int]":  # noqa: ANN001
    m = run.memory
    fe = m[(m["phase"] == "forward") & (m["event"] == "exit") & (m["device"] == "cpu")
           & (m["category"] == "activations") & (m["step"] >= 0)]
    return fe.groupby("step")["bytes"].sum().tolist()


@pytest.fixture(scope="module")
def mse_loop():
    """``loss = F.mse_loss(m(x), y)``: its 0-dim loss is a view of the (512, 128) element-wise
    buffer, 262,144 B."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 128))
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    x, y = torch.randn(512, 64), torch.randn(512, 128)
    with tp.profile(steps=STEPS, warmup=WARMUP, name="mse", progress=False, clock_hz=0) as prof:
        for _ in range(100):
            loss = F.mse_loss(m(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
    return prof.run


def test_mse_loss_storage_is_the_element_wise_buffer():
    """The premise of the next test, checked: the scalar loss shares a 262,144 B storage."""
    loss = F.mse_loss(torch.randn(512, 128), torch.randn(512, 128))
    assert loss.dim() == 0 and loss.untyped_storage().nbytes() == 512 * 128 * 4


def test_plain_loop_memory_is_flat(mse_loop):
    levels = _activations_at_forward_exit(mse_loop)
    assert len(levels) == STEPS
    assert max(levels) - min(levels) == 0, levels
    assert not any("leak" in n for n in mse_loop.summary().notes), mse_loop.summary().notes


# -- the peak --------------------------------------------------------------------------------
TEMP_BYTES = 32 * MiB


class BigTemp(torch.autograd.Function):
    """Identity whose backward holds a TEMP_BYTES temporary: the step's peak is inside the
    first backward node, before any parameter has a gradient (``zero_grad`` sets them to
    None)."""

    @staticmethod
    def forward(ctx, x):  # noqa: ANN001
        return x.clone()

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001
        t = torch.ones(TEMP_BYTES // 4)
        s = t.sum()
        del t
        return g * (s / s)


def _peak_model():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 512))
    x, y = torch.randn(512, 1024), torch.randn(512, 512)
    return m, x, y


def _saved_activation_bytes(m, x, y) -> int:  # noqa: ANN001
    """Unique storages autograd saves in one forward, beyond parameters and the batch."""
    saved: dict[int, int] = {}

    def pack(t):  # noqa: ANN001
        s = t.untyped_storage()
        saved[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = F.mse_loss(BigTemp.apply(m(x)), y)
    del loss
    known = {p.untyped_storage().data_ptr() for p in m.parameters()}
    known |= {x.untyped_storage().data_ptr(), y.untyped_storage().data_ptr()}
    return sum(n for ptr, n in saved.items() if ptr not in known)


@pytest.fixture(scope="module")
def peak_run():
    m, x, y = _peak_model()
    saved = _saved_activation_bytes(m, x, y)
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    with tp.profile(steps=3, warmup=1, name="peak", progress=False, clock_hz=0) as prof:
        for _ in range(100):
            loss = F.mse_loss(BigTemp.apply(m(x)), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
    params = sum(p.numel() * p.element_size() for p in m.parameters())
    return dict(run=prof.run, saved=saved, params=params)


def _peak(run) -> dict:  # noqa: ANN001
    p = run.memory_peak("cpu")
    return {"step": int(p["step"].iloc[0]), "phase": p["phase"].iloc[0], "total": int(p["total_bytes"].iloc[0]),
            **dict(zip(p["category"], p["bytes"].astype(int)))}


def test_peak_is_in_backward_with_the_parameters(peak_run):
    peak = _peak(peak_run["run"])
    assert peak["phase"] == "backward" and peak["parameters"] == peak_run["params"], peak


def test_peak_categories_are_those_at_the_peak_instant(peak_run):
    peak = _peak(peak_run["run"])
    assert peak["gradients"] == 0, peak  # no .grad exists yet inside the first backward node
    assert abs(peak["activations"] - peak_run["saved"]) <= 64 * 1024, (peak, peak_run["saved"])
    assert peak.get("temporaries", 0) >= TEMP_BYTES, peak


def test_peak_total_is_what_was_alive(peak_run):
    """Alive at the peak instant: parameters (from before the slice), saved activations, the
    temporary, and the incoming gradient of the loss' input (512x512 fp32 = 1 MiB)."""
    peak = _peak(peak_run["run"])
    want = peak_run["params"] + peak_run["saved"] + TEMP_BYTES + 1 * MiB
    assert abs(peak["total"] - want) <= 64 * 1024, (peak["total"], want)


def test_memory_peak_uses_measured_steps_only():
    """The first (warmup) step builds a 64 MiB cache in forward and drops it: the slice's
    measured peak is elsewhere."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    x, y = torch.randn(256, 64), torch.randn(256, 1)
    first = [True]

    def forward(inp):  # noqa: ANN001
        if first[0]:
            first[0] = False
            cache = torch.ones(16 * MiB)  # 64 MiB, warmup only
            del cache
        return m(inp)

    with tp.profile(steps=STEPS, warmup=WARMUP, name="warm-peak", progress=False, clock_hz=0) as prof:
        for _ in range(100):
            with tp.phase("forward"):
                out = forward(x)
            F.mse_loss(out, y).backward()
            opt.step()
            opt.zero_grad()
    peak = _peak(prof.run)
    assert peak["step"] >= 0 and peak["total"] < 16 * MiB, peak


def test_maml_adapted_weights_are_not_parameters():
    """MAML through ``torch.func.functional_call``: inside the call the module holds the adapted
    weights (``w - lr * g``, tensors with a graph), and ``model.parameters()`` returns them.
    Parameters are the model's 1 MiB (they read 2 MiB, tpkit read ``.grad`` of a non-leaf,
    warned, and held an adapted weight and its graph to the slice's end)."""
    import gc
    import warnings
    import weakref

    from torch.func import functional_call

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512, bias=False))
    opt = torch.optim.SGD(model.parameters(), lr=0.001)
    adapted: list[weakref.ref] = []
    alive: list[int] = []  # earlier iterations' adapted weights alive at each iteration's start
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a .grad of a non-leaf read would fail the test
        with tp.profile(steps=STEPS, warmup=WARMUP, name="maml", progress=False, clock_hz=0) as prof:
            for _ in range(STEPS + WARMUP + 1):
                xs, xq = torch.randn(4, 512), torch.randn(4, 512)
                params = dict(model.named_parameters())
                gc.collect()
                alive.append(sum(r() is not None for r in adapted))
                for _ in range(2):
                    inner = functional_call(model, params, (xs,)).pow(2).mean()
                    grads = torch.autograd.grad(inner, list(params.values()), create_graph=True)
                    params = {k: p - 0.01 * g for (k, p), g in zip(params.items(), grads)}
                adapted += [weakref.ref(p) for p in params.values()]
                functional_call(model, params, (xq,)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
    m = prof.run.memory
    per_row = m[m["category"] == "parameters"].groupby(["step", "phase", "event", "t_s", "device"])["bytes"].sum()
    assert set(per_row) == {512 * 512 * 4}, sorted(set(per_row))
    assert set(alive) == {0}, alive


def _at_optimizer_enter(run, category: str) -> "list[int]":  # noqa: ANN001
    m = run.memory
    at = m[(m["phase"] == "optimizer") & (m["event"] == "enter") & (m["device"] == "cpu") & (m["category"] == category)]
    # step()'s enter: a step ends at step(), so the zero_grad() that follows is the next step's first
    first = at[at["t_s"] == at.groupby("step")["t_s"].transform("max")]
    return first.groupby("step")["bytes"].sum().tolist()


def test_master_gradients_made_after_backward_are_gradients():
    """A half model with an fp32 master copy: after ``backward()`` the loop sets each master
    parameter's ``.grad = p.grad.float()`` by hand, then steps the master's optimizer. At every
    ``step()`` the gradients are the half ones and the master's (those made after the backward
    read as other at every step but the second and third, where tpkit looks at the gradients:
    at the first it did not know the master's optimizer yet)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256)).half()
    master = [torch.nn.Parameter(p.detach().float().clone()) for p in model.parameters()]
    opt = torch.optim.Adam(master, lr=1e-3)
    x, y = torch.randn(64, 256).half(), torch.randn(64, 256)
    with tp.profile(steps=6, warmup=0, name="master", progress=False, clock_hz=0) as prof:
        for _ in range(100):
            loss = F.mse_loss(model(x).float(), y)
            loss.backward()
            for p, mp in zip(model.parameters(), master):
                mp.grad = p.grad.float()
            opt.step()
            with torch.no_grad():
                for p, mp in zip(model.parameters(), master):
                    p.copy_(mp)
            opt.zero_grad()
            model.zero_grad()
    want = sum(p.numel() * 2 for p in model.parameters()) + sum(p.numel() * 4 for p in master)
    assert _at_optimizer_enter(prof.run, "gradients") == [want] * 6


@pytest.mark.parametrize("at", [3, 4, 5])
def test_a_layer_added_mid_slice_has_its_gradients_counted(at: int):
    """A layer grown at step ``at`` and added to the optimizer (``add_param_group``): from then
    on the gradients are the old and the new layer's (the new ones read as temporaries / other:
    no look's pattern fitted them until the 16th backward pass). Step 4's look is one at the
    gradients (the first looks start again once the optimizer's groups are counted), which had
    left the group uncounted: steps 4 and 5 read 2 layers. Step 5's look is one the allocation
    counter answers itself while nothing changed: the new group is what sends it to the probe."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(32, 256)
    with tp.profile(steps=8, warmup=0, name="grown", progress=False, clock_hz=0) as prof:
        for i in range(100):
            if i == at:
                model.append(torch.nn.Linear(256, 256))
                opt.add_param_group({"params": model[2].parameters()})
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    layer = 256 * 256 * 4 + 256 * 4
    assert _at_optimizer_enter(prof.run, "gradients") == [2 * layer] * at + [3 * layer] * (8 - at)


def _grad_bytes(model: torch.nn.Module) -> int:
    return sum({p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes()
                for p in model.parameters() if p.grad is not None}.values())


@pytest.mark.parametrize("how", ["requires_grad", "new_optimizer", "freeze"])
def test_a_backbone_unfrozen_or_frozen_mid_slice_has_its_gradients_counted(how: str):
    """Fine-tuning's next stage at step 8: a frozen backbone unfrozen, by ``requires_grad_(True)``
    on parameters its optimizer holds already or with a new Adam over the whole model (or a
    trained backbone frozen). At every ``step()`` the gradients are the ``.grad`` storages alive
    after that step's backward: the unfrozen backbone's had read temporaries until the next
    periodic look (10,280 B of 570,408, no note); a frozen one's absence left the head's read
    0 B. Unfrozen, the 600 x 600 weights (1.44 MB) get tpkit's grad hook (a frozen parameter
    cannot have one): at the peak the gradients are all of them, in backward's from the first pass."""
    torch.manual_seed(0)
    w = 600 if how == "new_optimizer" else 256
    backbone = torch.nn.Sequential(torch.nn.Linear(32, w), torch.nn.ReLU(), torch.nn.Linear(w, w), torch.nn.ReLU(),
                                   torch.nn.Linear(w, w), torch.nn.ReLU())
    model = torch.nn.Sequential(backbone, torch.nn.Linear(w, 10))
    backbone.requires_grad_(how == "freeze")
    opt = torch.optim.Adam(model[1].parameters() if how == "new_optimizer" else model.parameters(), lr=1e-3)
    x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
    truth = []
    with tp.profile(steps=14, warmup=0, name="unfreeze", progress=False, clock_hz=0) as prof:
        for i in range(100):
            if i == 8:
                backbone.requires_grad_(how != "freeze")
                if how == "new_optimizer":
                    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
            F.cross_entropy(model(x), y).backward()
            truth.append(_grad_bytes(model))
            opt.step()
            opt.zero_grad()
    assert len(set(truth[:8])) == len(set(truth[8:14])) == 1 and truth[7] != truth[8]
    assert _at_optimizer_enter(prof.run, "gradients") == truth[:14]
    assert not any("could not be told" in n for n in prof.run.meta["notes"])
    if how == "new_optimizer":
        peak = prof.run.memory_peak()
        assert dict(zip(peak["category"], peak["bytes"]))["gradients"] == truth[13] == 2_988_040
        # at backward's peak too, from the first unfrozen pass: the weights' hooks, made at the
        # look after it, are the next pass's (their gradients had read temporaries there)
        m = prof.run.memory
        at = m[(m["phase"] == "backward") & (m["event"] == "peak") & (m["device"] == "cpu")
               & (m["category"] == "gradients")]
        assert at.groupby("step")["bytes"].sum().tolist() == truth[:14]


def _backbone_and_head(w: int, deep: bool = False) -> tuple:
    """A backbone of two (``deep``: three) ``w``-wide layers and a 10-way head, with a batch."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(32, w), torch.nn.ReLU(), torch.nn.Linear(w, w), torch.nn.ReLU()]
    if deep:
        layers += [torch.nn.Linear(w, w), torch.nn.ReLU()]
    backbone = torch.nn.Sequential(*layers)
    return backbone, torch.nn.Sequential(backbone, torch.nn.Linear(w, 10)), torch.randn(16, 32), torch.randint(0, 10, (16,))


@pytest.mark.parametrize("at", [9, 10, 11, 12])
def test_layers_frozen_between_full_reads_or_in_the_last_passes_keep_their_gradients_exact(at: int):
    """Which parameters require grad is read in full every 4th look only (the looks between read
    the frozen ones: a loop training everything reads none); a layer frozen between two full
    reads is found at the next (the look it sets off gives the pattern that also fits the
    passes before it), and one frozen 1-3 passes before the slice's end, after the last full
    read, by the parameters that require grad at the end (2 and 1 passes had read as
    temporaries, with a note)."""
    torch.manual_seed(0)
    backbone, model, x, y = _backbone_and_head(256)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    truth = []
    with tp.profile(steps=14, warmup=0, name="frozen-late", progress=False, clock_hz=0) as prof:
        for i in range(100):
            if i == at:
                backbone[2].requires_grad_(False)
            F.cross_entropy(model(x), y).backward()
            truth.append(_grad_bytes(model))
            opt.step()
            opt.zero_grad()
    assert truth[at - 1] - truth[at] == 256 * 256 * 4 + 256 * 4
    assert _at_optimizer_enter(prof.run, "gradients") == truth[:14]
    assert not any("could not be told" in n for n in prof.run.meta["notes"])


def test_the_first_backward_after_an_unfreezing_keeps_its_gradients_when_they_are_zeroed_in_place():
    """``zero_grad(set_to_none=False)``: the unfrozen weights' gradients are made at the first
    backward after the unfreezing and never freed; tpkit's grad hook on them is made at the look
    after that backward, so the first marker after their allocation is the next pass's: at that
    first backward's peak they had read temporaries (2,918,404 B, gradients 108,040 for
    2,988,040). Truth: the ``.grad`` storages alive after each backward."""
    torch.manual_seed(0)
    backbone, model, x, y = _backbone_and_head(600, deep=True)
    backbone.requires_grad_(False)
    opt = torch.optim.Adam(model[1].parameters(), lr=1e-3)
    truth = []
    with tp.profile(steps=12, warmup=0, name="unfreeze-zeroed", progress=False, clock_hz=0) as prof:
        for i in range(100):
            if i == 6:
                backbone.requires_grad_(True)
                opt = torch.optim.Adam(model.parameters(), lr=1e-4)
            F.cross_entropy(model(x), y).backward()
            truth.append(_grad_bytes(model))
            opt.step()
            opt.zero_grad(set_to_none=False)
    assert truth[5] != truth[6] == 2_988_040
    m = prof.run.memory
    at = m[(m["phase"] == "backward") & (m["event"] == "peak") & (m["device"] == "cpu")
           & (m["category"] == "gradients")]
    assert at.groupby("step")["bytes"].sum().tolist() == truth[:12]


@pytest.mark.parametrize("freeze_at", [None, 11])
def test_a_second_backward_that_makes_no_parameter_gradient_leaves_the_gradients_counted(freeze_at):
    """Two backward passes a step, the second making no parameter gradient (an input gradient's,
    a penalty on the inputs): the look after both finds the first's gradients; between looks
    they had read 0 B at every ``step()`` from the 4th look on, no note (a pattern was taken
    from the second pass alone, which made none). With a layer frozen late too. Truth: the
    ``.grad`` storages alive at each ``step()``."""
    torch.manual_seed(0)
    backbone, model, x, y = _backbone_and_head(256)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    truth = []
    with tp.profile(steps=14, warmup=0, name="two-backwards", progress=False, clock_hz=0) as prof:
        for i in range(100):
            if i == freeze_at:
                backbone[2].requires_grad_(False)
            F.cross_entropy(model(x), y).backward()
            (x.clone().requires_grad_(True) * 2).sum().backward()
            truth.append(_grad_bytes(model))
            opt.step()
            opt.zero_grad()
    assert _at_optimizer_enter(prof.run, "gradients") == truth[:14]
    assert not any("could not be told" in n for n in prof.run.meta["notes"])


def test_sets_trained_by_turns_keep_their_gradients_exact_without_a_look_at_each_switch():
    """An encoder and a decoder trained by turns (``requires_grad_`` switched every step): after
    each set's first look the replay has its pattern of gradient sizes, so a switch back to a
    set seen before needs no look of its own (a look at every switch had made every step a full
    look: tpkit_s 0.25 ms a step for 0.033); the gradients stay the ``.grad`` storages alive
    after each step's backward, with sizes that differ by set."""
    torch.manual_seed(0)
    encoder = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256))
    decoder = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(256, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    model = torch.nn.Sequential(encoder, decoder)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
    truth = []
    with tp.profile(steps=16, warmup=0, name="by-turns", progress=False, clock_hz=0) as prof:
        for i in range(100):
            encoder.requires_grad_(i % 2 == 0)
            decoder.requires_grad_(i % 2 == 1)
            F.cross_entropy(model(x), y).backward()
            truth.append(_grad_bytes(model))
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert len(set(truth[:16])) == 2
    assert _at_optimizer_enter(prof.run, "gradients") == truth[:16]
    assert not any("could not be told" in n for n in prof.run.meta["notes"])


class _Momentum(torch.optim.Optimizer):
    """Heavy-ball SGD keeping its buffers outside ``opt.state``: in its parameter groups (as
    some Muon/Shampoo ports do) or in a dict attribute keyed by parameter."""

    def __init__(self, params, where: str) -> None:  # noqa: ANN001
        super().__init__(params, {"lr": 0.01})
        self.where, self.bufs = where, {}

    @torch.no_grad()
    def step(self, closure=None) -> None:  # noqa: ANN001
        for g in self.param_groups:
            if self.where == "group" and "bufs" not in g:
                g["bufs"] = [torch.zeros_like(p) for p in g["params"]]
            for j, p in enumerate(g["params"]):
                b = g["bufs"][j] if self.where == "group" else self.bufs.setdefault(p, torch.zeros_like(p))
                b.mul_(0.9).add_(p.grad)
                p.add_(b, alpha=-g["lr"])


@pytest.mark.parametrize("where", ["group", "attr"])
def test_optimizer_state_kept_outside_opt_state_is_optimizer_state(where: str):
    """The buffers an optimizer keeps in its parameter groups or in an attribute of its own are
    its state: at the end of every step, exactly their bytes (they had read other, 546,856 B,
    optimizer_state 0)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
    opt = _Momentum(model.parameters(), where)
    x, y = torch.randn(16, 256), torch.randint(0, 10, (16,))
    with tp.profile(steps=6, warmup=0, name="outside", progress=False, clock_hz=0) as prof:
        for _ in range(100):
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    bufs = opt.param_groups[0]["bufs"] if where == "group" else list(opt.bufs.values())
    truth = sum(b.untyped_storage().nbytes() for b in bufs)
    assert truth == 546_856
    ends = across_steps(prof.run.memory, "cpu")
    assert ends[ends["category"] == "optimizer_state"]["bytes"].tolist() == [truth] * 6
    assert ends[ends["category"] == "other"]["bytes"].max() < truth


def test_sparse_gradients_are_their_indices_and_values():
    """``nn.Embedding(sparse=True)`` with ``SparseAdam``: each step's gradient is a sparse
    tensor, its bytes those of its indices and its values (it has no storage of its own: it read
    0, its 2 MiB other)."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(20000, 64, sparse=True)
    opt = torch.optim.SparseAdam(emb.parameters(), lr=1e-3)
    idx = torch.randint(0, 20000, (256, 32))
    sizes = []
    with tp.profile(steps=6, warmup=0, name="sparse", progress=False, clock_hz=0) as prof:
        for _ in range(100):
            emb(idx).pow(2).mean().backward()
            g = emb.weight.grad
            sizes.append(g._indices().untyped_storage().nbytes() + g._values().untyped_storage().nbytes())
            opt.step()
            opt.zero_grad()
    assert sizes[0] == 256 * 32 * (8 + 64 * 4)  # uncoalesced: an index and a row per lookup
    assert _at_optimizer_enter(prof.run, "gradients") == sizes[:6]
    assert _at_optimizer_enter(prof.run, "parameters") == [20000 * 64 * 4] * 6


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    state = next(iter(opt.state.values()))
    tensors = [v for v in state.values() if torch.is_tensor(v)]
    tensors += [t for v in state.values() if isinstance(v, list) for t in v if torch.is_tensor(t)]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def test_an_optimizer_that_makes_its_state_anew_each_step():
    """LBFGS keeps a history of directions, made anew at each step (as many states, new
    tensors): at every step its state is the tensors it holds (after the first looks they read
    as other, up to 23 of 25 MB)."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256))
    opt = torch.optim.LBFGS(m.parameters(), lr=0.1, max_iter=1, history_size=3)
    x, y = torch.randn(32, 256), torch.randn(32, 256)
    held = []

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = F.mse_loss(m(x), y)
        loss.backward()
        return loss

    with tp.profile(steps=20, warmup=0, name="lbfgs", progress=False, clock_hz=0) as prof:
        for _ in range(100):
            opt.step(closure)
            held.append(_state_bytes(opt))  # (in a function: the loop holds no popped tensor)
    ends = across_steps(prof.run.memory, "cpu")
    state = ends[ends["category"] == "optimizer_state"]
    assert len(held) == 20  # the 20th step() returns too: the loop stops at its next one
    assert state["bytes"].tolist() == held


def test_what_a_step_keeps_for_later_steps_is_not_their_activations():
    """A loop that keeps each step's loss tensor (``losses.append(loss)``, not ``.item()``):
    each keeps its 262,144 B element-wise buffer. At each later step that is memory held across
    steps (other, growing by exactly that), not the step's activations (they had grown with it:
    7 MiB of a leak read as activations at the peak)."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 128))
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    x, y = torch.randn(512, 64), torch.randn(512, 128)
    losses = []
    with tp.profile(steps=STEPS, warmup=WARMUP, name="kept", progress=False, clock_hz=0) as prof:
        for _ in range(100):
            loss = F.mse_loss(m(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss)
    levels = _activations_at_forward_exit(prof.run)
    assert len(levels) == STEPS and len(set(levels)) == 1, levels
    mem = prof.run.memory
    other = mem[(mem["phase"] == "forward") & (mem["event"] == "exit") & (mem["category"] == "other")
                & (mem["step"] >= 0)].groupby("step")["bytes"].sum().tolist()
    assert [b - a for a, b in zip(other, other[1:])] == [512 * 128 * 4] * (STEPS - 1), other


def test_a_gan_generators_graph_across_the_step_boundary_stays_activations():
    """PyTorch's DCGAN order: ``fake = G(z)`` before D's ``step()`` (where tpkit's step ends),
    G's backward through it after: G's graph made in one step is consumed by a backward in the
    next. At that step's first forward what G's backward will free is activations (2 MiB), not
    memory held across steps (the whole graph had moved to other at every step)."""
    torch.manual_seed(0)
    G = torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 128))
    D = torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    oG, oD = torch.optim.SGD(G.parameters(), lr=0.01), torch.optim.SGD(D.parameters(), lr=0.01)
    real, z = torch.randn(512, 128), torch.randn(512, 64)
    with tp.profile(steps=4, warmup=1, name="gan", progress=False, clock_hz=0) as prof:
        for _ in range(50):
            D.zero_grad()
            D(real).mean().backward()
            fake = G(z)
            (-D(fake.detach()).mean()).backward()
            oD.step()
            G.zero_grad()
            D(fake).mean().backward()
            oG.step()
    m = prof.run.memory
    enter = m[(m["phase"] == "forward") & (m["event"] == "enter") & (m["step"] >= 0)]
    first = enter[enter["t_s"] == enter.groupby("step")["t_s"].transform("min")]
    acts = first[first["category"] == "activations"].groupby("step")["bytes"].sum().tolist()
    other = first[first["category"] == "other"].groupby("step")["bytes"].sum().tolist()
    assert acts == [512 * 1024 * 4] * 4  # G's saved ReLU output, which its backward frees (it read 0)
    assert other == [512 * 128 * 4] * 4  # fake, the loop's variable: made last step, held into this one


def test_a_loss_made_after_zero_grad_is_activations():
    """``out = model(x); opt.zero_grad(); loss = F.cross_entropy(out, y); loss.backward()``
    (Lightning's closure zeroes there too): the loss's saved log-softmax (2 MiB here) is
    activations at backward's start, as in the same loop zeroing before the forward (it read
    other, at the peak too)."""
    def loop(zero_between: bool) -> list[int]:
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1024))
        opt = torch.optim.SGD(m.parameters(), lr=0.01)
        x, y = torch.randn(512, 64), torch.randint(0, 1024, (512,))
        with tp.profile(steps=4, warmup=1, name="zero-between", progress=False, clock_hz=0) as prof:
            for _ in range(100):
                if not zero_between:
                    opt.zero_grad()
                out = m(x)
                if zero_between:
                    opt.zero_grad()
                F.cross_entropy(out, y).backward()
                opt.step()
        mem = prof.run.memory
        at = mem[(mem["phase"] == "backward") & (mem["event"] == "enter") & (mem["category"] == "activations")
                 & (mem["step"] >= 0)]
        return at.groupby("step")["bytes"].sum().tolist()

    between, before = loop(True), loop(False)
    assert len(between) == 4 and between == before, (between, before)
    assert min(between) >= 512 * 1024 * 4  # the log-softmax output the loss saves


def test_an_optimizer_stepped_inside_backward_sees_the_gradient_and_what_backward_holds():
    """One Adam per parameter, stepped and zeroed (``set_to_none``) in a post-accumulate-grad
    hook (PyTorch's recipe): at each such step, inside backward, the gradient being stepped is
    alive and so is what backward still holds. Truth, taken in the hook: that ``.grad``'s bytes,
    and the storages autograd saved (``saved_tensors_hooks``) still alive, less the parameters
    and the batch. tpkit had read the gradient and the saved tensors as other there (gradients
    0, activations 0 at the slice's peak, in an optimizer phase)."""
    import weakref

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024))
    opts = {p: torch.optim.Adam([p], lr=1e-3, foreach=False) for p in model.parameters()}
    x, y = torch.randn(256, 256), torch.randn(256, 1024)
    not_saved = {t.untyped_storage().data_ptr() for t in [*model.parameters(), x, y]}
    saved: list[tuple[weakref.ref, int, int]] = []
    at_hook: list[tuple[int, int]] = []  # (.grad bytes, saved bytes alive) at each parameter's step

    def hook(p: torch.Tensor) -> None:
        alive = {ptr: nb for r, ptr, nb in saved if r() is not None and ptr not in not_saved}
        at_hook.append((p.grad.untyped_storage().nbytes(), sum(alive.values())))
        opts[p].step()
        opts[p].zero_grad(set_to_none=True)

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append((weakref.ref(t), t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()))
        return t

    handles = [p.register_post_accumulate_grad_hook(hook) for p in model.parameters()]
    with tp.profile(steps=4, warmup=1, name="in-backward", progress=False, clock_hz=0) as prof:
        for _ in range(100):
            saved.clear()
            at_hook.clear()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = F.mse_loss(model(x), y)
            loss.backward()
            last = list(at_hook)  # (the next iteration clears it before the loop stops at its forward)
    for h in handles:
        h.remove()
    m = prof.run.memory
    enters = m[(m["phase"] == "optimizer") & (m["event"] == "enter") & (m["device"] == "cpu") & (m["step"] >= 0)]
    steps_seen = enters.pivot_table(index="t_s", columns="category", values="bytes").sort_index()
    # each parameter's step and then its zero_grad enter an optimizer span, the gradient alive at both
    per_step = [g for g, _ in last for _ in (0, 1)]
    assert steps_seen["gradients"].tolist() == per_step * 4
    assert (steps_seen["other"] == 0).all(), steps_seen["other"].tolist()
    # the saved tensors alive, and the loss the loop holds (a view of mse's [256, 1024] element-wise buffer)
    loss_bytes = 256 * 1024 * 4
    truth_saved = [s + loss_bytes for _, s in last for _ in (0, 1)] * 4
    assert steps_seen["activations"].tolist() == truth_saved
    peak = prof.run.memory_peak("cpu").set_index("category")["bytes"]
    assert peak["gradients"] == 1024 * 1024 * 4 and peak["activations"] > 0 and peak["other"] == 0, peak.to_dict()
