"""The memory probe against numbers known by hand: parameters, gradients and Adam state to the
byte, tied weights once, activations of a model whose saved tensors are known, a leak flagged;
mixed precision and no_grad; the CUDA boundary through a stand-in; analysis and chart specs."""

from __future__ import annotations

import dataclasses
from collections import UserDict
from collections.abc import Iterator, Mapping
from types import SimpleNamespace
from typing import Any

import pandas as pd
import pytest
import torch
from graph_store import Storage, StoredAttributes
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from IPython.utils.capture import capture_output

import tpkit as tp
from tpkit import charts
from tpkit.analysis import memory as ma
from tpkit.capture.probes import memory as mem
from tpkit.capture.recorder import Recorder
from tpkit.schema import CPU_SOURCE_COUNTER, CPU_SOURCE_STREAM, ENV_CPU_ALLOCATIONS, MEMORY_CATEGORIES

B, D, H = 64, 32, 512


class MLP(torch.nn.Module):
    """Saved for backward at forward exit: relu outputs r1, r2 [B, H] (each is also the next
    linear's input, saved once) and the output y [B, 1] (saved by pow); plus the loss scalar."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = torch.nn.Linear(D, H)
        self.l2 = torch.nn.Linear(H, H)
        self.l3 = torch.nn.Linear(H, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r1 = torch.relu(self.l1(x))
        r2 = torch.relu(self.l2(r1))
        return self.l3(r2).pow(2).mean()


def saved_bytes(itemsize: int = 4) -> int:
    return 2 * B * H * itemsize + B * itemsize + itemsize


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def rows(run: tp.Run, phase: str, event: str, category: str, device: str = "cpu") -> pd.Series:
    m = run.memory
    sel = m[(m["phase"] == phase) & (m["event"] == event) & (m["category"] == category) & (m["device"] == device)]
    return sel.set_index("step")["bytes"]


def train_mlp(steps: int = 3, warmup: int = 1, **kwargs):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(B, D)

    def step():
        model(x).backward()
        opt.step()
        opt.zero_grad()

    run = tp.profile_fn(step, steps=steps, warmup=warmup, progress=False, clocks=False, **kwargs)
    return run, model, opt


LOOP = """
import torch
torch.manual_seed(0)
model = MLP()
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
data = torch.utils.data.TensorDataset(torch.randn(20 * B, D))
loader = torch.utils.data.DataLoader(data, batch_size=B)
for (x,) in loader:
    model(x).backward()
    opt.step()
    opt.zero_grad()
"""


def test_mlp_adam_exact_bytes_through_the_magic(ip):
    ip.user_ns.update(MLP=MLP, B=B, D=D)
    with capture_output() as cap:
        ip.run_cell_magic("tp_profile", "--steps 3 --warmup 1 --clock-hz 0 --name mem", LOOP)
    run = ip.user_ns["_tp"]
    model, opt = ip.user_ns["model"], ip.user_ns["opt"]
    P = n_params(model)
    m = run.memory[run.memory["device"] == "cpu"]
    assert set(m["category"]) == set(MEMORY_CATEGORIES) and set(m["event"]) == {"enter", "exit", "peak"}
    assert (m[m["category"] == "parameters"]["bytes"] == 4 * P).all()
    # gradients after every backward, none after zero_grad(set_to_none)
    assert (rows(run, "backward", "exit", "gradients") == 4 * P).all()
    assert (rows(run, "forward", "enter", "gradients") == 0).all()
    # Adam: exp_avg + exp_avg_sq per parameter, plus a scalar fp32 step counter on the CPU each
    counters = [s["step"] for s in opt.state.values()]
    assert all(c.dtype == torch.float32 and c.numel() == 1 and c.device.type == "cpu" for c in counters)
    adam = 8 * P + 4 * len(counters)
    opt_exit = run.memory[(run.memory["phase"] == "optimizer") & (run.memory["event"] == "exit")
                          & (run.memory["category"] == "optimizer_state")]
    assert opt_exit["bytes"].iloc[0] == adam  # right after the first step
    assert (opt_exit["bytes"] == adam).all()
    # the batch the loader yielded is data from the data_wait exit on; there the previous batch,
    # still held by the loop's variable, is alive too (the first data_wait is iter(loader): no batch yet)
    assert rows(run, "data_wait", "exit", "data").tolist() == [0, B * D * 4] + [2 * B * D * 4] * 3
    assert (rows(run, "forward", "exit", "data") == B * D * 4).all()
    # what was alive at the peak
    peak = run.memory_peak()
    assert set(peak["category"]) == set(MEMORY_CATEGORIES)
    peaks = ma.wide(run.memory, ("peak",))
    assert peak["total_bytes"].iloc[0] == peaks[peaks["device"] == "cpu"]["total_bytes"].max()
    assert peak["bytes"].sum() == peak["total_bytes"].iloc[0]
    assert peak.set_index("category")["bytes"]["parameters"] == 4 * P
    assert run.meta["memory"]["capacity_bytes"]["cpu"] > 0
    assert cap.outputs  # the dashboard was displayed; its Memory section:
    from tpkit.views.html import section_charts

    memory = dict(section_charts(run))["Memory"].to_dict()
    title = str(memory["hconcat"][0]["title"])
    assert "Memory waterfall" in title and f"step {ma.peak_step(run.memory, 'cpu')}" in title


class Encoding(UserDict):
    """A batch that is a Mapping but no dict, as HF's ``BatchEncoding`` (``DataCollatorWithPadding``)."""


def test_a_mapping_batch_that_is_no_dict_is_data():
    """A ``UserDict`` batch's tensors are ``data`` to the byte, as a dict's (its bytes had read
    other, data 0)."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(torch.randn(20 * B, D), batch_size=B,
                                         collate_fn=lambda xs: Encoding(x=torch.stack(xs)))
    with tp.profile(steps=3, warmup=1, progress=False, clocks=False) as prof:
        for batch in loader:
            model(batch["x"]).backward()
            opt.step()
            opt.zero_grad()
    assert rows(prof.run, "forward", "exit", "data").tolist() == [B * D * 4] * 4


class GraphBatch(StoredAttributes):
    """A batch of graphs, as PyG's ``Batch``: its tensors in a ``_store``, read as attributes."""

    def __init__(self, x: torch.Tensor, graphs: int) -> None:
        nodes = x.shape[0] // graphs
        self.__dict__["_store"] = Storage(
            x=x, edge_index=torch.zeros(2, 3 * x.shape[0], dtype=torch.long), y=torch.zeros(graphs, dtype=torch.long),
            batch=torch.arange(graphs).repeat_interleave(nodes), ptr=torch.arange(graphs + 1) * nodes)

    @property
    def num_graphs(self) -> int:
        return int(self.y.shape[0])


def test_a_batch_that_keeps_its_tensors_in_a_store_is_data():
    """A graph batch's tensors, kept in a ``MutableMapping`` store as PyG's ``Batch`` keeps them,
    are ``data`` to the byte (they had read 0 B: the walk looked at dicts, sequences and
    dataclasses only). Truth: the bytes of its five tensors."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(torch.randn(20 * B, D), batch_size=B,
                                         collate_fn=lambda xs: GraphBatch(torch.stack(xs), B // 4))
    truth = []
    with tp.profile(steps=3, warmup=1, progress=False, clocks=False) as prof:
        for batch in loader:
            truth.append(sum(t.numel() * t.element_size() for t in batch._store.values()))
            model(batch.x).backward()
            opt.step()
            opt.zero_grad()
    assert rows(prof.run, "forward", "exit", "data").tolist() == truth[:4]
    assert prof.run.steps["samples"].tolist() == [B // 4] * 4


class LazyColumns(Mapping):
    """A mapping that makes each value at its first read, as a datasets ``LazyBatch`` formats a
    column: what it holds is the dict of values made so far."""

    def __init__(self) -> None:
        self.data: dict[str, Any] = {"x": None, "y": None}
        self.made = 0

    def __getitem__(self, key: str) -> Any:
        if self.data[key] is None:
            self.made += 1
            self.data[key] = torch.zeros(B, D)
        return self.data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.data)

    def __len__(self) -> int:
        return len(self.data)


def test_a_lazy_mapping_is_read_without_making_its_values():
    """The walk reads what a mapping holds, never through its ``__getitem__``: a lazy one's
    values are not made for tpkit (a column the loop never reads would be formatted)."""
    batch = LazyColumns()
    assert mem._batch_tensors(batch) == [] and batch.made == 0
    x = batch["x"]
    assert [t is x for t in mem._batch_tensors(batch)] == [True] and batch.made == 1
    assert [t is x for t in mem._batch_tensors((batch,))] == [True] and batch.made == 1


@dataclasses.dataclass
class Pair:
    """A dataclass batch, as ``batch_size_of`` reads them."""

    x: torch.Tensor
    label: str = "a"


def test_a_dataclass_batch_is_data():
    """A dataclass batch's tensors are ``data`` to the byte (they had read other, data 0)."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(torch.randn(20 * B, D), batch_size=B,
                                         collate_fn=lambda xs: Pair(x=torch.stack(xs)))
    with tp.profile(steps=3, warmup=1, progress=False, clocks=False) as prof:
        for batch in loader:
            model(batch.x).backward()
            opt.step()
            opt.zero_grad()
    assert rows(prof.run, "forward", "exit", "data").tolist() == [B * D * 4] * 4


def test_activations_match_the_saved_tensors_within_10_percent():
    run, _, _ = train_mlp()
    act = rows(run, "forward", "exit", "activations")
    want = saved_bytes()
    assert len(act) == 4
    assert ((act - want).abs() <= 0.10 * want).all(), (act.tolist(), want)
    # backward frees them: only the loss scalar or so is left
    assert (rows(run, "backward", "exit", "activations") < 64).all()
    # the forward peak holds at least the saved tensors; the backward peak is above its exit
    assert (rows(run, "forward", "peak", "activations") >= want - 8).all()


def test_tensors_made_outside_the_forward_are_other_not_activations():
    """An EMA copy of the weights made inside the slice, after the optimizer step (under no_grad,
    outside every phase), is alive at every forward and backward boundary but saved nothing for
    backward: it is ``other``, to the byte, and the activations are the forward's alone (it had
    read as activations, backward exit included). The loss made between forward and backward
    stays an activation."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(B, D)
    ema: list[torch.Tensor] = []

    def step():
        out = model(x)
        (out.pow(2).mean() if ema else out).backward()  # the loss: made after the forward's exit
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            if not ema:
                ema.extend(p.detach().clone() for p in model.parameters())
            for e, p in zip(ema, model.parameters()):
                e.mul_(0.99).add_(p, alpha=0.01)

    run = tp.profile_fn(step, steps=3, warmup=1, progress=False, clocks=False)
    copy = 4 * sum(p.numel() for p in model.parameters())  # made at the end of the warmup step
    assert rows(run, "forward", "enter", "other").tolist() == [0, copy, copy, copy]
    assert rows(run, "backward", "exit", "other").tolist() == [0, copy, copy, copy]
    assert rows(run, "backward", "enter", "other").tolist() == [0, copy, copy, copy]  # the loss is no 'other'
    assert (rows(run, "backward", "exit", "activations") < 64).all()
    act = rows(run, "forward", "exit", "activations")
    want = saved_bytes()
    assert ((act - want).abs() <= 0.10 * want).all(), (act.tolist(), want)
    # the loss's saved input (out, [B, 1]) and its result count with the activations at backward's enter
    assert (rows(run, "backward", "enter", "activations") >= act).all()


def test_second_slice_with_leftover_grads_counts_the_same():
    """Blocks allocated before the slice (or in an earlier one) must not shift the rest."""
    run1, model, opt = train_mlp()
    model(torch.randn(B, D)).backward()  # leave gradients behind, made outside any slice
    x = torch.randn(B, D)

    def step():
        model(x).backward()
        opt.step()
        opt.zero_grad()

    run2 = tp.profile_fn(step, steps=3, warmup=1, progress=False, clocks=False)
    a1, a2 = rows(run1, "forward", "exit", "activations"), rows(run2, "forward", "exit", "activations")
    assert (a2 - a1.iloc[-1]).abs().max() <= 64
    P = n_params(model)
    assert (rows(run2, "backward", "exit", "gradients") == 4 * P).all()
    assert (rows(run2, "optimizer", "enter", "activations").fillna(0) == 0).all()
    assert (rows(run2, "optimizer", "exit", "other") < 1024).all()


@pytest.mark.parametrize("accumulate", [1, 2])
def test_gradients_exact_on_steps_whose_gradients_were_not_looked_at(accumulate):
    """The probe looks at .grad after the first backward passes and then every 8th; the other
    passes' gradients come from the replay's pattern and must be as exact, with accumulation too."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(B, D)

    def step():
        for _ in range(accumulate):
            (model(x) / accumulate).backward()
        opt.step()
        opt.zero_grad()

    steps = mem.GRAD_LOOKS_FIRST + mem.GRAD_LOOK_EVERY + 2
    run = tp.profile_fn(step, steps=steps, warmup=0, progress=False, clocks=False)
    P = n_params(model)
    g = run.memory.query("device == 'cpu' and category == 'gradients' and event != 'peak'")
    at_exit = g.query("phase == 'backward' and event == 'exit'").groupby("step")["bytes"].apply(list)
    assert len(at_exit) == steps and all(v == [4 * P] * accumulate for v in at_exit), at_exit.tolist()
    assert (g.query("phase == 'forward' and event == 'enter'").groupby("step")["bytes"].first() == 0).all()
    assert not any("could not be told" in n for n in run.meta["notes"])


def test_the_counter_answers_the_looks_between_looks_at_the_gradients(monkeypatch):
    """Where the allocation counter notes the boundaries and nothing the look reads changes, the
    probe's Python runs only at the looks at the gradients: the first GRAD_LOOKS_FIRST (steps
    0-2), then every GRAD_LOOK_EVERY-th (step 16); the counter answers the others and tells the
    next look how many it answered. A layer frozen at step 20, a look the counter would answer,
    sends that look to the probe, and each after it until ``_trainable_changed``'s next full read
    (every TRAINABLE_FULL_EVERY-th look: step 23) takes the freezing in and the first looks
    start again (steps 23-25); then every GRAD_LOOK_EVERY-th (step 39), the counter answering
    between with the new ``requires_grad``. The gradients stay exact throughout."""
    calls: list[tuple[int, int]] = []  # (the step, the looks it stands for)
    at_boundary = mem.MemoryProbe._at_boundary
    done = [0]

    def spy(self, phase, event, raw_step, k, looks):  # noqa: ANN001
        if looks:
            calls.append((done[0], int(looks)))
        return at_boundary(self, phase, event, raw_step, k, looks)

    monkeypatch.setattr(mem.MemoryProbe, "_at_boundary", spy)
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(B, D)

    def step():
        if done[0] == 20:
            model.l2.requires_grad_(False)
        model(x).backward()
        opt.step()
        opt.zero_grad()
        done[0] += 1

    run = tp.profile_fn(step, steps=40, warmup=0, progress=False, clocks=False)
    assert run.meta["memory"]["cpu_source"] == CPU_SOURCE_COUNTER
    assert (mem.GRAD_LOOKS_FIRST, mem.GRAD_LOOK_EVERY, mem.TRAINABLE_FULL_EVERY) == (3, 16, 4)
    assert [at for at, _ in calls] == [0, 1, 2, 16, 20, 21, 22, 23, 24, 25, 39]
    # each call stands for its own look and those the counter answered since the last
    assert [looks for _, looks in calls] == [1, 1, 1, 14, 4, 1, 1, 1, 1, 1, 14]
    # the gradients at each step()'s enter (the step's last optimizer enter: zero_grad's is the next step's first)
    m = run.memory
    at = m[(m["phase"] == "optimizer") & (m["event"] == "enter") & (m["device"] == "cpu") & (m["category"] == "gradients")]
    grads = at[at["t_s"] == at.groupby("step")["t_s"].transform("max")].groupby("step")["bytes"].sum()
    l2 = (model.l2.weight.numel() + model.l2.bias.numel()) * 4
    assert grads.tolist() == [4 * n_params(model)] * 20 + [4 * n_params(model) - l2] * 20


def test_letting_the_counter_answer_makes_a_few_tracked_objects_whatever_the_parameter_count():
    """What the probe hands the counter after a look is a few flat tuples, the parameters' made
    once a full read of their ``requires_grad``: a pair per parameter (300 here) had started
    young collections inside a 12-layer GPT-2's steps, where none ran before."""
    import gc

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(150)])  # 300 parameters
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(2, 4)
    made = []
    with tp.profile(steps=6, warmup=0, progress=False, clock_hz=0) as prof:
        probe = next(p for p in prof._probes if isinstance(p, mem.MemoryProbe))
        for i in range(6):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
            if i >= 3:
                gc.disable()
                try:
                    before = gc.get_count()[0]
                    probe._let_counter_answer()
                    made.append(gc.get_count()[0] - before)
                finally:
                    gc.enable()
    assert len(list(model.parameters())) == 300 and probe._watched_params[0]  # the parameters are watched
    assert len(made) == 3 and max(made) <= 3, made


def test_optimizer_state_replaced_between_looks_counts_from_its_allocation():
    """Between two looks at the gradients the known sets are observed only when a count grew
    (a model, an optimizer, a state). ``load_state_dict`` of a deep copy swaps Adam's state
    tensors for new ones of the same count at a step that is not a look: the next look finds
    them alive, and the replay counts them as optimizer_state from their allocation, so every
    boundary after the swap is exact to the byte (and the old tensors' bytes are gone)."""
    import copy

    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(B, D)
    swap_after = mem.GRAD_LOOKS_FIRST + 1  # the step whose optimizer boundary is not a look
    done = [0]

    def step():
        model(x).backward()
        opt.step()
        opt.zero_grad()
        done[0] += 1
        if done[0] == swap_after:
            opt.load_state_dict(copy.deepcopy(opt.state_dict()))

    steps = mem.GRAD_LOOKS_FIRST + mem.GRAD_LOOK_EVERY + 2
    run = tp.profile_fn(step, steps=steps, warmup=0, progress=False, clocks=False)
    state = sum(v.untyped_storage().nbytes() for st in opt.state.values() for v in st.values())
    assert state == 2 * 4 * n_params(model) + 4 * len(list(model.parameters()))  # moments + step counters
    at_forward = rows(run, "forward", "enter", "optimizer_state")
    assert (at_forward.iloc[1:] == state).all(), at_forward.tolist()
    other = rows(run, "forward", "enter", "other")
    assert (other.iloc[1:] < 1024).all(), other.tolist()  # the copies are not 'other', the old state gone


def test_walked_gradients_are_walked_again_whenever_one_changed():
    """Where boundaries walk the known sets (a CUDA device, no stream), the gradients are walked
    again only when a gradient tensor or its address changed: a gradient replaced by a view of a
    larger storage counts that storage, set to None counts nothing, the same tensors count the
    same."""
    model = MLP()
    rec = Recorder("walk")
    rec.models.add(model)
    probe = mem.MemoryProbe(rec)
    params = list(model.parameters())
    for p in params:
        p.grad = torch.zeros_like(p)
    grads = lambda: probe._known_sets().get(("cpu", "gradients"), 0)  # noqa: E731
    assert grads() == 4 * n_params(model) and grads() == 4 * n_params(model)
    big = torch.zeros(params[0].numel() + 1000)
    params[0].grad = big[: params[0].numel()].view_as(params[0])
    assert grads() == 4 * n_params(model) + 4 * 1000
    for p in params:
        p.grad = None
    assert grads() == 0
    assert probe._known_sets()[("cpu", "parameters")] == 4 * n_params(model)


def test_loop_in_another_thread_gets_the_known_sets_walked():
    """The profiler reports only the starting thread's allocations: a loop tpkit follows into
    another thread gets exact known sets at its boundaries, and its mix is said approximate."""
    import threading

    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(B, D)
    stopped: list[str] = []

    def loop() -> None:
        try:
            for _ in range(20):
                model(x).backward()
                opt.step()
                opt.zero_grad()
        except BaseException as e:  # the slice's stop reaches the loop's thread
            stopped.append(type(e).__name__)

    with tp.profile(steps=3, warmup=1, progress=False, clocks=False) as prof:
        t = threading.Thread(target=loop)
        t.start()
        t.join()
    run = prof.run
    assert len(run.steps) == 4
    assert (rows(run, "backward", "exit", "gradients") == 4 * n_params(model)).all()
    assert (rows(run, "forward", "enter", "gradients") == 0).all()
    assert run.meta["memory"]["approximate_mix"] == ["cpu"]


def test_tied_weights_count_once():
    run = tp.profile_fn(_tied_step(), steps=2, warmup=0, progress=False, clocks=False)
    V, C = 100, 16
    unique = V * C + C  # embedding weight (shared with the head) + a norm weight
    assert (run.memory[run.memory["category"] == "parameters"]["bytes"] == 4 * unique).all()
    assert (rows(run, "backward", "exit", "gradients") == 4 * unique).all()


def test_parameters_that_are_views_of_one_flat_buffer_count_it_once():
    """Two weights that are views of one flat buffer made before the slice (a flat-parameter
    layout), one of them made a new Parameter over the same data mid-slice: the buffer is held
    all along and counts once at every boundary. The first Parameter's death had ended the
    buffer, which the next look found again and counted from the slice's start beside the
    ended one (1,050,624 B of parameters for 526,336 up to the replacement)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(H, H), torch.nn.ReLU(), torch.nn.Linear(H, H))
    flat = torch.zeros(2 * H * H)
    model[0].weight = torch.nn.Parameter(flat[: H * H].view(H, H))
    model[2].weight = torch.nn.Parameter(flat[H * H:].view(H, H))
    del flat
    x = torch.randn(B, H)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    i = 0

    def step():
        nonlocal opt, i
        if i == 3:
            model[0].weight = torch.nn.Parameter(model[0].weight.data)
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
        i += 1
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    run = tp.profile_fn(step, steps=5, warmup=1, progress=False, clocks=False)
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    assert sum(storages.values()) == 4 * (2 * H * H + 2 * H) == 2 * 1024 * 1024 + 4096
    params = run.memory[(run.memory["category"] == "parameters") & (run.memory["device"] == "cpu")]
    assert len(params) > 40 and (params["bytes"] == sum(storages.values())).all(), params["bytes"].value_counts()


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
@pytest.mark.parametrize("cast_at", [1, 3])
def test_a_model_cast_mid_slice_reads_its_new_parameters_only(dtype, cast_at):
    """``model.half()`` / ``.double()`` between two steps replaces each parameter's ``.data``;
    the Parameters live on, so no weakref tells. From that step on the parameters are the new
    storages only: the fp32 ones (from before the slice, no free event in the stream) had never
    ended (half: 789,504 B for 263,168 of a 256-wide two-layer MLP). Cast at the second call,
    the look at the gradients after it finds the move; at the fourth, between two looks at the
    gradients, the slice's end does."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(H, H), torch.nn.ReLU(), torch.nn.Linear(H, H))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(B, H)
    i = 0

    def step():
        nonlocal i, x
        if i == cast_at:
            model.to(dtype)
            x = x.to(dtype)
        i += 1
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()

    run = tp.profile_fn(step, steps=5, warmup=1, progress=False, clocks=False)
    fp32 = 4 * (2 * H * H + 2 * H)
    after = sum(p.untyped_storage().nbytes() for p in model.parameters())
    assert after == fp32 * dtype.itemsize // 4
    params = run.memory[(run.memory["category"] == "parameters") & (run.memory["device"] == "cpu")]
    # cast at the top of a call, before its forward (a step ends at opt.step(), so the
    # zero_grad before the cast is in the cast's step)
    forwards = params[(params["phase"] == "forward") & (params["event"] == "enter")]["t_s"].sort_values()
    cast_s = forwards.iloc[cast_at]
    before_cast = params[params["t_s"] < cast_s]["bytes"]
    after_cast = params[params["t_s"] >= cast_s]["bytes"]
    assert len(before_cast) > 5 and (before_cast == fp32).all(), before_cast.value_counts()
    assert len(after_cast) > 10 and (after_cast == after).all(), after_cast.value_counts()


@pytest.mark.parametrize("cast_at", [1, 3])
def test_a_cast_parameter_ends_at_the_cast_when_its_address_comes_back_before_the_move_is_found(monkeypatch, cast_at):
    """The fp32 storage a cast replaced was made before the slice: glibc may hand its address
    to a block of the loop's before a look finds the move, and the address coming back had
    ended it there instead (one fp32 bias, 2,048 B, read parameters from the cast to that block
    in one run of the suite). The block is put in the stream here, right after the cast step's
    backward, so that it happens in every run."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(H, H), torch.nn.ReLU(), torch.nn.Linear(H, H))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(B, H)
    old_bias = model[0].bias.untyped_storage().data_ptr()
    i = 0

    def step():
        nonlocal i, x
        if i == cast_at:
            model.to(torch.float16)
            x = x.to(torch.float16)
        i += 1
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()

    replay = mem.MemoryProbe._replay

    def address_comes_back(self: mem.MemoryProbe, events: list[tuple[int, int]]) -> Any:
        exits = [m for m in self.marks if m[2] == mem._BOUND and self.bounds[m[3]][:2] == ("backward", "exit")]
        at = events.index((exits[cast_at][0], -exits[cast_at][1])) + 1
        return replay(self, events[:at] + [(old_bias, 16), (old_bias, -16)] + events[at:])

    monkeypatch.setattr(mem.MemoryProbe, "_replay", address_comes_back)
    run = tp.profile_fn(step, steps=5, warmup=1, progress=False, clocks=False)
    half = 2 * (2 * H * H + 2 * H)
    params = run.memory[(run.memory["category"] == "parameters") & (run.memory["device"] == "cpu")]
    forwards = params[(params["phase"] == "forward") & (params["event"] == "enter")]["t_s"].sort_values()
    after_cast = params[params["t_s"] >= forwards.iloc[cast_at]]["bytes"]
    assert len(after_cast) > 10 and (after_cast == half).all(), after_cast.value_counts()


def test_parameters_found_through_the_optimizer_when_no_module_runs():
    w = torch.randn(D, H, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1)
    x = torch.randn(B, D)

    def step():
        with tp.phase("forward"):
            loss = (x @ w).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()

    run = tp.profile_fn(step, steps=2, warmup=1, progress=False, clocks=False)
    assert (run.memory[run.memory["category"] == "parameters"]["bytes"] == 4 * D * H).all()  # backfilled
    # the optimizer is known before its first step is entered, where the gradients are looked
    # at: its parameters' gradients count from the first backward on (they read 0 there)
    assert rows(run, "backward", "exit", "gradients").tolist() == [4 * D * H] * 3


def _tied_step():
    V, C = 100, 16
    torch.manual_seed(0)
    emb = torch.nn.Embedding(V, C)
    head = torch.nn.Linear(C, V, bias=False)
    head.weight = emb.weight

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.head, self.scale = emb, head, torch.nn.Parameter(torch.ones(C))

        def forward(self, t: torch.Tensor) -> torch.Tensor:
            return self.head(self.emb(t) * self.scale).logsumexp(-1).mean()

    model = Tied()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    t = torch.randint(0, V, (8, 4))

    def step():
        model(t).backward()
        opt.step()
        opt.zero_grad()

    return step


def test_deliberate_leak_is_flagged_and_steady_loop_is_not():
    steady, _, _ = train_mlp(steps=6, warmup=1)
    assert not ma.growth(steady.memory)["leak"].any()
    assert not any("grew by" in n for n in steady.summary().notes)

    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(B, D)
    kept = []

    def leaky():
        out = torch.relu(model.l1(x))  # [B, H] kept with its graph
        kept.append(out)
        (model(x) + out.mean()).backward()
        opt.step()
        opt.zero_grad()

    run = tp.profile_fn(leaky, steps=6, warmup=1, progress=False, clocks=False)
    g = ma.growth(run.memory)
    assert g["leak"].all() and g["per_step_bytes"].iloc[0] >= B * H * 4
    notes = run.summary().notes
    assert any("grew by" in n and "cpu" in n for n in notes), notes


def test_no_memory_gives_an_empty_table(ip):
    ip.user_ns.update(MLP=MLP, B=B, D=D)
    with capture_output():
        ip.run_cell_magic("tp_profile", "--steps 2 --warmup 0 --quiet --no-memory --clock-hz 0", LOOP)
    run = ip.user_ns["_tp"]
    assert run.memory.empty and list(run.memory.columns) == ["step", "phase", "event", "t_s", "device",
                                                             "category", "bytes"]
    assert "memory" not in run.meta
    run2, _, _ = train_mlp(steps=1, warmup=0, memory=False)
    assert run2.memory.empty


def test_probe_leaves_nothing_behind():
    from torch.autograd import profiler as autograd_profiler

    run, _, _ = train_mlp(steps=1, warmup=0)
    assert not run.memory.empty
    assert not autograd_profiler._is_profiler_enabled
    # a torch profiler can run again after the slice
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        torch.ones(3).sum()


def test_a_running_torch_profiler_leaves_the_known_sets_and_a_note():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run, model, _ = train_mlp(steps=1, warmup=0)
    assert any(e.name == "aten::addmm" for e in prof.events())  # the user's profiler kept its session
    assert set(run.memory["category"]) == {"parameters", "gradients", "optimizer_state", "data"}
    assert (rows(run, "backward", "exit", "gradients") == 4 * n_params(model)).all()
    # Adam's state appears in the step: walked again once its fingerprint changed
    adam = 8 * n_params(model) + 4 * len(list(model.parameters()))
    assert rows(run, "optimizer", "enter", "optimizer_state").iloc[0] == 0
    assert rows(run, "optimizer", "exit", "optimizer_state").iloc[0] == adam
    assert any("could not start" in n for n in run.meta["notes"])
    assert run.meta["memory"]["cpu_source"] == "known sets only"


def test_a_torch_profiler_inside_the_slice_runs_and_is_noted():
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(B, D)

    seen: list[str] = []

    def step():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            model(x).backward()
        seen.extend(e.name for e in prof.events())
        opt.step()
        opt.zero_grad()

    run = tp.profile_fn(step, steps=1, warmup=0, progress=False, clocks=False)
    # the user's profiler saw every op, though the stream had RecordFunction off when it started
    assert "aten::addmm" in seen and "autograd::engine::evaluate_function: AddmmBackward0" in seen, seen
    assert (rows(run, "backward", "exit", "gradients") == 4 * n_params(model)).all()
    assert "activations" not in set(run.memory["category"])
    assert any("another profiler" in n for n in run.meta["notes"]), run.meta["notes"]


def test_bf16_parameters_are_two_bytes_each():
    torch.manual_seed(0)
    model = MLP().to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(B, D, dtype=torch.bfloat16)

    def step():
        model(x).backward()
        opt.step()
        opt.zero_grad()

    run = tp.profile_fn(step, steps=2, warmup=1, progress=False, clocks=False)
    P = n_params(model)
    assert (run.memory[run.memory["category"] == "parameters"]["bytes"] == 2 * P).all()
    assert (rows(run, "backward", "exit", "gradients") == 2 * P).all()
    act = rows(run, "forward", "exit", "activations")
    assert ((act - saved_bytes(2)).abs() <= 0.10 * saved_bytes(2)).all(), act.tolist()


def test_autocast_keeps_fp32_parameters_and_counts_the_casts_as_activations():
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(B, D)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x)
        loss.backward()
        opt.step()
        opt.zero_grad()

    run = tp.profile_fn(step, steps=2, warmup=1, progress=False, clocks=False)
    P = n_params(model)
    assert (run.memory[run.memory["category"] == "parameters"]["bytes"] == 4 * P).all()
    assert (rows(run, "backward", "exit", "gradients") == 4 * P).all()  # fp32 master grads
    act = rows(run, "forward", "exit", "activations")
    # bf16 saved activations and the bf16 weight copies autocast keeps for backward
    low, high = saved_bytes(2), saved_bytes(2) + 2 * P + B * D * 2 + 4096
    assert ((act >= low * 0.9) & (act <= high * 1.1)).all(), (act.tolist(), low, high)
    assert (act < saved_bytes(4) + 2 * P).all()


def test_no_grad_forward_saves_nothing():
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(B, D)

    def evaluate():
        with torch.no_grad():
            model(x)
        tp.step()

    run = tp.profile_fn(evaluate, steps=2, warmup=0, progress=False, clocks=False)
    act = rows(run, "forward", "exit", "activations")
    assert len(act) == 2 and (act <= 64).all(), act.tolist()
    # the peak inside forward still saw the [B, H] temporaries
    assert (rows(run, "forward", "peak", "activations") >= B * H * 4).all()


def test_a_forward_without_grad_neither_opens_nor_ends_the_loss_stretch():
    """A forward run without grad makes no loss to backpropagate. An evaluation at the top of
    the step (``model.eval()``, ``torch.no_grad()``) followed by the loop's own batch copy (a
    loader tpkit does not see): the copy is ``other`` at the training forward's enter, to the
    byte (it had read activations, the stretch after a forward being where the loss is made).
    A teacher's forward without grad between the student's forward and the loss: the loss made
    after it (kl_div saves the log-softmax and the teacher's probabilities, [B, C] each) is
    still activations at backward's enter."""
    torch.manual_seed(0)
    C = 1024
    student, teacher = torch.nn.Linear(D, C), torch.nn.Linear(D, C).eval()
    opt = torch.optim.SGD(student.parameters(), lr=0.01)
    batches = iter([torch.randn(B, D, dtype=torch.float64) for _ in range(4)])
    xv = torch.randn(8, D)

    def step():
        student.eval()
        with torch.no_grad():
            student(xv)
        student.train()
        x = next(batches).float()  # B x D x 4 bytes, made by the loop
        s = student(x)
        with torch.no_grad():
            t = teacher(x)
        loss = torch.nn.functional.kl_div(s.log_softmax(-1), t.softmax(-1), reduction="batchmean")
        loss.backward()
        opt.step()
        opt.zero_grad()

    run = tp.profile_fn(step, steps=3, warmup=1, progress=False, clocks=False)
    m = run.memory
    enters = m[(m["phase"] == "forward") & (m["event"] == "enter") & (m["device"] == "cpu")].sort_values("t_s")

    def at_student_forward(category: str) -> list[int]:
        """Each step's first forward enter: the student's (the evaluation's reads eval, the teacher's comes after)."""
        return enters[enters["category"] == category].groupby("step")["bytes"].nth(0).tolist()

    assert at_student_forward("activations") == [0] * 4
    assert at_student_forward("other") == [B * D * 4] * 4
    exits = m[(m["phase"] == "forward") & (m["event"] == "exit") & (m["device"] == "cpu")
              & (m["category"] == "activations")].sort_values("t_s")
    at_teacher_exit = exits.groupby("step")["bytes"].last()
    loss_made = rows(run, "backward", "enter", "activations") - at_teacher_exit
    assert (loss_made >= 2 * B * C * 4).all(), loss_made.tolist()


def test_peak_early_in_backward_is_split_at_its_instant():
    """Linear 1024 -> 4096 + GELU, loss ``out.pow(2).mean()``, batch 512. Forward saves h = xW^T+b
    (for GELU) and g = gelu(h) (for pow): 2 x [512, 4096] fp32. The slice's peak is in
    PowBackward, before any ``.grad`` exists: the incoming gradient, ``g.pow(1)``, ``2 * that``
    and the product are alive at once (4 x [512, 4096]) beside h and g."""
    torch.manual_seed(0)
    n, d, h = 512, 1024, 4096
    model = torch.nn.Sequential(torch.nn.Linear(d, h), torch.nn.GELU())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4 * n, d)), batch_size=n)
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        saved[st.data_ptr()] = st.nbytes()
        return t

    with tp.profile(steps=2, warmup=1, progress=False, clocks=False) as prof:
        for _ in range(2):
            for (x,) in loader:
                saved.clear()
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    loss = model(x).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
    run = prof.run
    # the independent truth: storages saved for backward, less the parameters and the batch
    not_activations = {p.untyped_storage().data_ptr() for p in model.parameters()} | {x.untyped_storage().data_ptr()}
    saved_bytes_ = sum(nb for ptr, nb in saved.items() if ptr not in not_activations)
    assert saved_bytes_ == 2 * n * h * 4
    peak = run.memory_peak("cpu")
    assert (peak["step"] >= 0).all() and peak["phase"].iloc[0] == "backward" and peak["mix_exact"].all()
    at = peak.set_index("category")["bytes"]
    assert at["gradients"] == 0  # no .grad yet
    assert at["parameters"] == 4 * (d * h + h)
    assert at["data"] == n * d * 4  # exactly the batch
    assert 0 <= at["activations"] - saved_bytes_ <= 64  # the saved tensors (+ the loss scalar)
    assert abs(at["temporaries"] - 4 * n * h * 4) <= 64
    assert at["optimizer_state"] == 0 and at["other"] == 0
    # the mix is that of the instant, not of a boundary: backward's exit holds the gradients
    exit_ = rows(run, "backward", "exit", "gradients")
    assert (exit_ == 4 * (d * h + h)).all()


def test_memory_peak_never_takes_a_warmup_step():
    m = hand_memory()
    warm = m.assign(step=m["step"] - 1)  # step 0 becomes warmup (-1)
    warm.loc[(warm["step"] == -1) & (warm["category"] == "other"), "bytes"] += 10_000  # the highest
    p = ma.memory_peak(warm)
    assert p["step"].iloc[0] == 0 and p["total_bytes"].iloc[0] == 260
    assert ma.memory_peak(warm[warm["step"] < 0]).empty
    assert not ma.memory_peak(m, approximate=["cpu"])["mix_exact"].any()


# -- CUDA boundary, through a stand-in --------------------------------------------------------
class FakeCuda(mem.CudaAllocator):
    """Plays a CUDA allocator: (allocated, process peak) per read, scripted."""

    def __init__(self, script: list[tuple[int, int]], history_running: bool = False) -> None:
        self.script = list(script)
        self.reads: list[tuple[int, int]] = []
        self.history = history_running
        self.user_history = history_running
        self.stopped = False

    def available(self) -> bool:
        return True

    def read(self, index: int) -> tuple[int, int]:
        self.reads.append(self.script.pop(0))
        return self.reads[-1]

    def capacity(self, index: int) -> int:
        return 80 * 2**30

    def history_running(self) -> bool:
        return self.history

    def start_history(self) -> None:
        self.history = True

    def snapshot(self) -> dict:
        frames = [{"filename": "train.py", "line": 12, "name": "forward"}]
        return {"device_traces": [[
            {"action": "alloc", "addr": 1, "size": 100, "frames": frames},
            {"action": "alloc", "addr": 2, "size": 300, "frames": frames},
            {"action": "free_requested", "addr": 1, "size": 100},
            {"action": "alloc", "addr": 3, "size": 50, "frames": []},
            {"action": "free_completed", "addr": 1, "size": 100},
        ]]}

    def stop_history(self) -> dict:
        self.history, self.stopped = False, True
        return self.snapshot()


def cuda_model(device: str = "cuda:0") -> torch.nn.Module:
    """A module whose one parameter (4 x 4 fp32, 64 B) lives on a CUDA device, on a machine
    without one: a fake tensor has the device and the storage size, and no memory."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        w = torch.empty(4, 4, device=device)
    m = torch.nn.Module()
    m.w = torch.nn.Parameter(w, requires_grad=False)
    return m


#: the probe reads a fake tensor's storage address (0) to count a storage shared by two
#: parameters once; torch warns about that on fake tensors
fake_ptr = pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")


def frame_of(rec: Recorder) -> pd.DataFrame:
    return pd.DataFrame(rec.memory, columns=["step", "phase", "event", "t_ns", "device", "category", "bytes"])


@fake_ptr
def test_cuda_rows_peaks_and_detail_through_a_stand_in():
    # install (the baseline), forward enter, h2d enter, h2d exit, forward exit
    fake = FakeCuda([(1000, 1500), (2000, 2500), (3000, 2500), (4000, 4500), (5000, 5500)])
    rec = Recorder("fake")
    model = cuda_model()
    rec.models.add(model)
    probe = mem.MemoryProbe(rec, detail=True, cuda=fake).install()
    assert fake.history and fake.reads == [(1000, 1500)]
    rec.enter("forward", "test")
    tok = rec.enter("h2d", "test")
    rec.exit(tok)
    rec.exit(0)
    probe.remove()
    probe.remove()  # idempotent
    assert fake.stopped  # tpkit started that history, so it stops it
    cuda = frame_of(rec).query("device == 'cuda:0'")
    enter = cuda.query("phase == 'forward' and event == 'enter'").set_index("category")["bytes"]
    # what is held beyond the known sets as a forward begins is not the forward's
    assert enter["parameters"] == 64 and enter["activations"] == 0 and enter["other"] == 2000 - 64
    exit_ = cuda.query("phase == 'forward' and event == 'exit'").set_index("category")["bytes"]
    assert exit_["activations"] == 5000 - 2000 and exit_["other"] == 2000 - 64
    # the process peak rose to 5,500 in the last stretch: forward's peak
    assert cuda.query("phase == 'forward' and event == 'peak'")["bytes"].sum() == 5500
    # inside h2d the process peak rose from 2,500 to 4,500: a new high, exact
    h2d_peak = cuda.query("phase == 'h2d' and event == 'peak'").set_index("category")["bytes"]
    assert h2d_peak.sum() == 4500 and h2d_peak["other"] == 4500 - 64
    meta = probe.meta()["memory"]
    assert meta["capacity_bytes"]["cuda:0"] == 80 * 2**30
    assert meta["approximate_mix"] == ["cuda:0"]
    top = meta["top_at_peak"]["cuda:0"]
    assert top["peak_bytes"] == 400
    assert [a["bytes"] for a in top["allocations"]] == [300, 100]
    assert top["allocations"][0]["stack"] == ["train.py:12 forward"]


@fake_ptr
def test_cuda_stretch_without_a_new_high_gives_its_boundary_maximum():
    """The process peak (8,000, from before the slice) never rises: no stretch can be read
    exactly, so each peak is the higher of its two boundary levels (said approximate)."""
    fake = FakeCuda([(1000, 8000), (2000, 8000), (3000, 8000), (2500, 8000)])
    rec = Recorder("fake")
    model = cuda_model()
    rec.models.add(model)
    probe = mem.MemoryProbe(rec, cuda=fake).install()
    rec.enter("forward", "test")
    tok = rec.enter("h2d", "test")
    rec.exit(tok)
    probe.remove()
    cuda = frame_of(rec).query("device == 'cuda:0'")
    assert cuda.query("phase == 'h2d' and event == 'peak'")["bytes"].sum() == 3000
    # and the run says those peaks are lower bounds, with what makes them exact
    bound = probe.meta()["memory"]["peak_lower_bound"]["cuda:0"]
    assert bound.startswith("3 of 3 stretches") and "new high" in bound
    assert any("cuda:0 peaks are lower bounds" in n for n in rec.notes)


class HeardStream(mem.CpuAllocatorStream):
    """Plays the allocator stream of a GPU machine: the marker storages the probe made and
    freed, in order, and the CUDA caching allocator's reports to the profiler (cuda:0's level
    with each), scripted per stretch: ``reports[k]`` are heard between boundary k - 1 (the
    install for k = 0) and boundary k."""

    def __init__(self, reports: dict[int, list[int]]) -> None:
        super().__init__()
        self.reports = reports
        self.probe: mem.MemoryProbe | None = None

    def start(self) -> None:
        self.active = True

    def stop(self) -> list[tuple[int, int]]:
        assert self.probe is not None
        self.active = False
        pool = self.probe._pool_flat
        cpu = [(pool[2 * i], pool[2 * i + 1]) for i in range(len(pool) // 2)]
        self.cuda_levels = []
        for ptr, size, kind, idx, _ in self.probe.marks:
            if kind == mem._BOUND:
                self.cuda_levels += [(len(cpu), 0, level) for level in self.reports.get(idx, [])]
            cpu.append((ptr, -size))
        return cpu


def heard_slice(reports: dict[int, list[int]], reads: list[tuple[int, int]]) -> tuple[Recorder, mem.MemoryProbe]:
    """forward enter (boundary 0), h2d enter (1), h2d exit (2), forward exit (3) on a model on
    cuda:0; ``reads``: (allocated, process peak) at the install and at each boundary."""
    stream = HeardStream(reports)
    rec = Recorder("heard")
    model = cuda_model()
    rec.models.add(model)
    probe = stream.probe = mem.MemoryProbe(rec, cpu=stream, cuda=FakeCuda(reads)).install()
    rec.enter("forward", "test")
    tok = rec.enter("h2d", "test")
    rec.exit(tok)
    rec.exit(0)
    probe.remove()
    return rec, probe


#: the process's peak counter stands at 8,000 from before the slice and never rises in it
NO_NEW_HIGH = [(1000, 8000), (2000, 8000), (3000, 8000), (2500, 8000), (2200, 8000)]


@fake_ptr
def test_cuda_peaks_come_from_the_allocators_own_reports_in_the_stream():
    """Inside h2d the allocator went 3,000 -> 4,100 -> 5,200 -> 2,500: its boundaries read 3,000
    and 2,500, and the process's peak counter (8,000 from before the slice, never reset) did
    not move, so the counters alone gave 3,000 and called it a lower bound. The allocator's
    reports in the stream give the peak itself, and every stretch was heard: exact."""
    rec, probe = heard_slice({0: [2000], 1: [3000], 2: [4100, 5200, 2500], 3: [2200]}, NO_NEW_HIGH)
    cuda = frame_of(rec).query("device == 'cuda:0'")
    h2d = cuda.query("phase == 'h2d' and event == 'peak'").set_index("category")["bytes"]
    assert h2d.sum() == 5200 and h2d["parameters"] == 64
    assert cuda.query("phase == 'forward' and event == 'peak'")["bytes"].sum() == 5200
    assert "peak_lower_bound" not in probe.meta()["memory"]
    assert not any("lower bounds" in n for n in rec.notes)


@fake_ptr
def test_a_cuda_stretch_not_heard_keeps_its_lower_bound():
    """Between h2d's exit and forward's exit the level fell from 2,500 to 2,200 with no report
    of the allocator in the stream (a thread the profiler does not hear freed it): that
    stretch cannot be read, so it keeps the higher boundary level and the run says it is a
    lower bound; the stretches that were heard are exact."""
    rec, probe = heard_slice({0: [2000], 1: [3000], 2: [4100, 5200, 2500]}, NO_NEW_HIGH)
    bound = probe.meta()["memory"]["peak_lower_bound"]["cuda:0"]
    assert bound.startswith("1 of 4 stretches")
    cuda = frame_of(rec).query("device == 'cuda:0'")
    assert cuda.query("phase == 'h2d' and event == 'peak'")["bytes"].sum() == 5200


@fake_ptr
def test_cuda_reports_never_lower_a_peak_the_counter_saw():
    """A stretch that set a new high for the process is read exactly by its peak counter (6,000
    inside h2d); reports that heard less (a transient in a thread the profiler does not hear)
    do not lower it."""
    reads = [(1000, 1500), (2000, 2500), (3000, 3500), (2500, 6000), (2200, 6000)]
    rec, _ = heard_slice({0: [2000], 1: [3000], 2: [4100, 2500], 3: [2200]}, reads)
    cuda = frame_of(rec).query("device == 'cuda:0'")
    assert cuda.query("phase == 'h2d' and event == 'peak'")["bytes"].sum() == 6000


@fake_ptr
def test_cuda_stretch_peaks_are_the_true_peaks_for_any_history():
    """For any history of CUDA allocations and frees inside the four stretches of a forward with
    an h2d inside it, with any high the process's peak counter reached before the slice, and
    whether the allocator reports the level after each event or before it, every phase's peak
    is the highest level the device held in it, and no stretch is called a lower bound (the
    allocator reported at least once in the slice)."""
    deltas = st.lists(st.integers(-3000, 3000), max_size=6)

    @settings(max_examples=150, deadline=None)
    @given(st.lists(deltas, min_size=4, max_size=4), st.integers(0, 20_000), st.booleans())
    def check(stretches: list[list[int]], high_before: int, after: bool) -> None:
        assume(any(stretches))  # an allocator that never reported is not trusted (test above)
        level = 5000
        high = max(high_before, level)
        reads = [(level, high)]  # at install
        reports: dict[int, list[int]] = {}
        held: list[list[int]] = []  # levels each stretch went through, its two ends included
        for k, changes in enumerate(stretches):
            seen = [level]
            for d in changes:
                d = max(d, 100 - level)  # the model's parameters stay allocated
                reports.setdefault(k, []).append(level + d if after else level)
                level += d
                seen.append(level)
                high = max(high, level)
            held.append(seen)
            reads.append((level, high))
        rec, probe = heard_slice(reports, reads)
        peaks = frame_of(rec).query("device == 'cuda:0' and event == 'peak'").groupby("phase")["bytes"].sum()
        assert peaks["h2d"] == max(held[2])
        assert peaks["forward"] == max(max(h) for h in held[1:])
        assert "peak_lower_bound" not in probe.meta()["memory"]

    check()


@fake_ptr
def test_cuda_first_seen_mid_slice_does_not_trust_the_old_peak():
    fake = FakeCuda([(1000, 1500), (2000, 2500), (3000, 3500)])
    rec = Recorder("fake")
    probe = mem.MemoryProbe(rec, cuda=fake).install()
    rec.enter("forward", "test")  # no model known yet: no CUDA device in use, nothing read
    model = cuda_model()
    rec.models.add(model)
    tok = rec.enter("h2d", "test")  # the model is found: first reading (1000, 1500), the baseline
    rec.exit(tok)  # (2000, 2500): a new high inside h2d
    rec.exit(0)
    probe.remove()
    cuda = frame_of(rec).query("device == 'cuda:0'")
    assert set(cuda["phase"]) == {"h2d", "forward"}
    assert cuda.query("phase == 'h2d' and event == 'peak'")["bytes"].sum() == 2500
    assert cuda.query("phase == 'forward' and event == 'peak'").empty  # its enter had no reading


class CudaStandIn:
    """torch.cuda's functions that the probe calls, played on a machine without CUDA: 8 visible
    devices, each with an allocated level and a process peak, and one memory history."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, history: bool = False) -> None:
        from types import SimpleNamespace

        self.allocated = dict.fromkeys(range(8), 0)
        self.peak = dict.fromkeys(range(8), 0)
        self.read: set[int] = set()
        self.resets: list[int] = []
        self.history = history
        self.history_calls: list[Any] = []
        mp = monkeypatch
        mp.setattr(torch.cuda, "is_available", lambda: True)
        mp.setattr(torch.cuda, "is_initialized", lambda: True)
        mp.setattr(torch.cuda, "device_count", lambda: 8)
        mp.setattr(torch.cuda, "memory_allocated", self.memory_allocated)
        mp.setattr(torch.cuda, "max_memory_allocated", self.max_memory_allocated)
        mp.setattr(torch.cuda, "memory_stats_as_nested_dict", self.nested_stats)
        mp.setattr(torch.cuda, "reset_peak_memory_stats", self.resets.append)
        mp.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=80 * 2**30))
        mp.setattr(torch.cuda.memory, "_snapshot", self.snapshot)
        mp.setattr(torch.cuda.memory, "_record_memory_history", self.record_history)

    def alloc(self, nbytes: int, device: int = 0) -> None:
        self.allocated[device] += nbytes
        self.peak[device] = max(self.peak[device], self.allocated[device])

    def memory_allocated(self, device: int = 0) -> int:
        self.read.add(device)
        return self.allocated[device]

    def max_memory_allocated(self, device: int = 0) -> int:
        self.read.add(device)
        return self.peak[device]

    def nested_stats(self, device: int = 0) -> dict:
        self.read.add(device)
        return {"allocated_bytes": {"all": {"current": self.allocated[device], "peak": self.peak[device]}}}

    def snapshot(self, *args: Any, **kwargs: Any) -> dict:
        entry = {"action": "alloc", "addr": 1, "size": 512, "frames": []}
        return {"segments": [], "device_traces": [[entry] if self.history else [] for _ in range(8)]}

    def record_history(self, enabled: Any = "all", *args: Any, **kwargs: Any) -> None:
        self.history_calls.append(enabled)
        self.history = enabled is not None


def cuda_slice(stand: CudaStandIn, detail: bool = False) -> Recorder:
    """A forward and a backward on a model on cuda:0, through the real ``CudaAllocator``."""
    rec = Recorder("stand-in")
    model = cuda_model("cuda:0")
    rec.models.add(model)
    probe = mem.MemoryProbe(rec, detail=detail).install()
    rec.enter("forward", "test")
    stand.alloc(3000)
    stand.alloc(-1000)
    rec.exit(0)
    rec.enter("backward", "test")
    stand.alloc(500)
    stand.alloc(-2500)
    rec.exit(0)
    probe.remove()
    return rec


@fake_ptr
def test_cuda_slice_leaves_the_users_peak_counter_alone(monkeypatch):
    stand = CudaStandIn(monkeypatch)
    stand.alloc(10_000)
    stand.alloc(-10_000)  # the user's own peak before the slice
    rec = cuda_slice(stand)
    assert stand.resets == []  # never reset: the process-global counter is the user's
    assert torch.cuda.max_memory_allocated(0) == 10_000  # as without tpkit
    # only the device holding the model was read, though 8 are visible
    assert stand.read == {0}
    cuda = frame_of(rec).query("device == 'cuda:0'")
    assert set(frame_of(rec)["device"]) == {"cpu", "cuda:0"}
    # no stretch set a new high for the process (10,000 before the slice): the peaks are the
    # boundary levels, the forward's exit at 2,000
    assert cuda.query("phase == 'forward' and event == 'peak'")["bytes"].sum() == 2000


@fake_ptr
def test_cuda_user_history_stays_on_and_tpkit_stops_only_its_own(monkeypatch):
    stand = CudaStandIn(monkeypatch, history=True)  # the user recorded a history before the slice
    rec = cuda_slice(stand, detail=True)
    assert stand.history and stand.history_calls == []  # neither restarted nor switched off
    assert any("already recording" in n for n in rec.notes)

    stand = CudaStandIn(monkeypatch, history=False)
    cuda_slice(stand, detail=True)
    assert stand.history_calls == ["all", None] and not stand.history  # tpkit's own: started, stopped


def test_top_allocations_at_peak_replays_frees():
    trace = [{"action": "alloc", "addr": a, "size": s} for a, s in [(1, 10), (2, 20)]]
    trace += [{"action": "free_requested", "addr": 2}, {"action": "alloc", "addr": 3, "size": 5}]
    out = mem.top_allocations_at_peak(trace, n=1)
    assert out["peak_bytes"] == 30 and [a["bytes"] for a in out["allocations"]] == [20]


# -- analysis and charts on a hand-made frame ------------------------------------------------
def hand_memory() -> pd.DataFrame:
    """Two steps on the CPU: forward adds 100 of activations, backward frees them and adds 40 of
    gradients, the optimizer frees the gradients; 'other' grows 10 per step."""
    out = []
    t = 0.0
    for step in (0, 1):
        base = {"parameters": 40, "optimizer_state": 80, "other": 10 * step}
        seq = [("forward", "enter", {}), ("forward", "exit", {"activations": 100}),
               ("forward", "peak", {"activations": 130}),
               ("backward", "enter", {"activations": 100}), ("backward", "exit", {"gradients": 40}),
               ("backward", "peak", {"activations": 40, "temporaries": 20, "gradients": 40}),
               ("optimizer", "enter", {"gradients": 40}), ("optimizer", "exit", {"other": 10 * step + 10})]
        for phase, event, extra in seq:
            t += 0.01
            levels = {**base, **extra}
            for c in MEMORY_CATEGORIES:
                out.append((step, phase, event, t, "cpu", c, levels.get(c, 0)))
    return pd.DataFrame(out, columns=["step", "phase", "event", "t_s", "device", "category", "bytes"])


def test_waterfall_frame_by_hand():
    wf = ma.waterfall(hand_memory(), step=0)
    start = wf[wf["phase"] == "step start"].set_index("category")["delta_bytes"]
    assert start.to_dict() == {"parameters": 40, "optimizer_state": 80}
    fwd = wf[wf["phase"] == "forward"]
    assert fwd[["category", "delta_bytes", "y0_bytes", "y1_bytes", "total_bytes"]].values.tolist() == [
        ["activations", 100, 120, 220, 220]]
    bwd = wf[wf["phase"] == "backward"].set_index("category")
    assert bwd.loc["gradients", "delta_bytes"] == 40 and bwd.loc["activations", "delta_bytes"] == -100
    assert (bwd["total_bytes"] == 160).all()
    assert wf[wf["phase"] == "optimizer"]["total_bytes"].iloc[-1] == 130
    assert ma.step_peak(hand_memory(), 0)["total_bytes"] == 250
    assert ma.step_peak(hand_memory(), 0)["phase"] == "forward"


def test_across_steps_growth_and_headroom_by_hand():
    m = hand_memory()
    a = ma.across_steps(m)
    assert a[a["category"] == "other"]["bytes"].tolist() == [10, 20]
    assert a.drop_duplicates("step")["peak_bytes"].tolist() == [250, 260]
    g = ma.growth(m)
    assert g["growth_bytes"].iloc[0] == 10 and not g["leak"].iloc[0]  # 2 steps: too few to call
    r = ma.headroom(m, {"memory": {"capacity_bytes": {"cpu": 1000}}})
    assert r["headroom_bytes"].iloc[0] == 740 and r["peak_share"].iloc[0] == pytest.approx(0.26)
    p = ma.memory_peak(m)
    assert p["step"].iloc[0] == 1 and p["phase"].iloc[0] == "forward" and p["total_bytes"].iloc[0] == 260


def test_chart_specs():
    m = hand_memory()
    chart = charts.memory_waterfall(ma.waterfall(m, 0), ma.step_peak(m, 0), headroom_bytes=2**30,
                                    capacity_bytes=2 * 2**30, step=0)
    spec = chart.to_dict()
    marks = [layer["mark"]["type"] if isinstance(layer["mark"], dict) else layer["mark"] for layer in spec["layer"]]
    assert marks == ["bar", "line", "tick", "text", "tick"]  # the peak: a tick in its bar (+ transients)
    bar = spec["layer"][0]["encoding"]
    assert bar["y"]["field"] == "y0_mib" and bar["y2"]["field"] == "y1_mib"
    assert bar["xOffset"]["field"] == "kind"  # rises and falls side by side
    assert bar["color"]["scale"]["domain"] == list(MEMORY_CATEGORIES)
    texts = [d for d in spec["datasets"].values() if d and "text" in d[0]]
    assert texts and texts[0][0]["text"] == "peak 0.00 MiB"
    assert spec["title"]["subtitle"][0].startswith("step 0: peak 0.00 MiB during forward (activations")
    assert "headroom" in spec["title"]["subtitle"][1]
    across = charts.memory_by_step(ma.across_steps(m)).to_dict()
    assert [layer["mark"]["type"] for layer in across["layer"]] == ["bar", "line"]
    assert across["layer"][0]["encoding"]["y"]["stack"] == "zero"


def many_stretches_memory(micro: int = 60) -> pd.DataFrame:
    """One step of ``micro`` forward/backward pairs (gradient accumulation): each forward holds
    100 B of activations, each backward frees them and adds 1 B of gradients; the highest level
    (130 B + the micro-step's gradients) is inside the last forward."""
    out, t = [], 0.0
    grads = 0
    seq = [("step", "enter", {})]
    for _ in range(micro):
        seq += [("forward", "enter", {}), ("forward", "exit", {"activations": 100}),
                ("backward", "enter", {"activations": 100}), ("backward", "exit", {"grads+": 1})]
    seq += [("step", "exit", {})]
    for phase, event, extra in seq:
        t += 0.01
        grads += extra.pop("grads+", 0)
        levels = {"parameters": 30, "gradients": grads, **extra}
        for c in MEMORY_CATEGORIES:
            out.append((0, phase, event, t, "cpu", c, levels.get(c, 0)))
    return pd.DataFrame(out, columns=["step", "phase", "event", "t_s", "device", "category", "bytes"])


def test_a_step_of_many_stretches_is_drawn_in_at_most_max_bars_with_the_same_totals_and_peak():
    m = many_stretches_memory(60)
    full = ma.waterfall(m, 0, max_bars=10_000)
    merged = ma.waterfall(m, 0, max_bars=12)
    assert full["order"].nunique() == 1 + 2 * 60 and merged["order"].nunique() <= 12
    # the totals at the ends of merged bars are totals of the unmerged waterfall; the end is the same
    assert set(merged["total_bytes"]) <= set(full["total_bytes"])
    assert merged["total_bytes"].iloc[-1] == full["total_bytes"].iloc[-1] == 30 + 60
    assert merged["peak_bytes"].max() == full["peak_bytes"].max() == 30 + 59 + 100
    # a merged bar's net change per category adds up to its running total
    for _, bar in merged[merged["order"] > 0].groupby("order"):
        assert bar["y1_bytes"].max() - bar["y0_bytes"].min() >= abs(bar["delta_bytes"]).max()
    labels = merged.drop_duplicates("order")["label"].tolist()
    assert labels[0] == "start of step" and any("stretches)" in lb for lb in labels), labels
    # the chart of many merged steps stays under altair's row limit
    wfs = ma.waterfalls(pd.concat([m.assign(step=s) for s in range(40)]), device="cpu")
    assert len(wfs) < 5000
    charts.memory_waterfall(wfs).to_dict()


def test_every_marker_size_is_odd_and_a_glibc_small_bin_request():
    """Marker allocations cut the CPU stream at each boundary. Their sizes are odd (no float,
    half or int64 tensor has an odd byte size) and, with torch's 64-byte alignment (glibc adds
    the alignment and a minimum chunk to the request, rounded to 16 bytes with 8 of header),
    under glibc's 1024-byte large-bin threshold: a large request first consolidates every small
    chunk freed so far (67 us right after a 12-layer backward)."""
    sizes = [mem.MARKER_BASE_BYTES + 2 * k for k in range(mem.MARKER_SIZES)]
    assert all(s % 2 == 1 for s in sizes)
    chunk = max((s + 8 + 15) // 16 * 16 for s in sizes)
    assert chunk + 64 + 32 < 1024, chunk
    assert len(set(sizes)) >= 128  # consecutive markers differ in size: no stale match in order


def test_a_phase_entered_inside_itself_is_one_boundary_for_the_probes():
    """An optimizer wrapper whose step() calls the wrapped optimizer's (DeepSpeed's engine
    around DeepSpeedCPUAdam or FusedAdam) opens an optimizer span inside an optimizer span: both are recorded, but the phase does not
    change at the inner one, so the probes hear the outer boundaries only (each one costs the
    memory probe a marker and ~10 us); a span left open by an exception closes with its outer."""
    rec = Recorder("t")
    heard: list[tuple[str, str]] = []
    rec.phase_listeners.append(lambda phase, event, step: heard.append((phase, event)))
    outer = rec.enter("optimizer", "Wrapper")
    inner = rec.enter("optimizer", "AdamW")
    rec.exit(inner)
    rec.exit(outer)
    assert heard == [("optimizer", "enter"), ("optimizer", "exit")]
    assert sorted((s[0], s[3], s[4]) for s in rec.spans if s[0] == "optimizer") == [
        ("optimizer", 0, "Wrapper"), ("optimizer", 1, "AdamW")]
    heard.clear()
    outer = rec.enter("optimizer", "Wrapper")
    rec.enter("optimizer", "AdamW")
    rec.enter("forward", "closure")  # another phase inside is a boundary of its own
    rec.exit(outer)  # the inner spans were left open (an exception skipped their exits)
    assert heard == [("optimizer", "enter"), ("forward", "enter"), ("forward", "exit"), ("optimizer", "exit")]
    assert not rec.is_open("optimizer") and not rec.is_open("forward")


@pytest.mark.parametrize("pool, ahead", [(1, 0), (3, 0), (3, 5)])
def test_marker_storages_made_ahead_count_nowhere_whenever_they_are_made(monkeypatch, pool, ahead):
    """With torch's stream, each boundary's marker is the free of a storage the probe allocated
    earlier: enough for the slice's steps when the stream starts (at most MARKERS_AHEAD_MAX),
    then MARKER_POOL at a time (a free costs a boundary less than an allocation). Where the pool
    runs out (at any boundary, inside a backward pass too) must not show: the memory table is
    the same byte for byte as with every marker made ahead."""
    monkeypatch.setenv(ENV_CPU_ALLOCATIONS, "stream")
    def table(run: tp.Run) -> list:
        m = run.memory[run.memory["device"] == "cpu"]
        return m[["step", "phase", "event", "category", "bytes"]].astype(str).values.tolist()

    want, _, _ = train_mlp(steps=6)
    monkeypatch.setattr(mem, "MARKERS_AHEAD_MAX", ahead)
    monkeypatch.setattr(mem, "MARKER_POOL", pool)
    got, model, _ = train_mlp(steps=6)
    assert table(got) == table(want)
    assert (rows(got, "backward", "exit", "gradients") == 4 * n_params(model)).all()


def test_a_slice_makes_its_markers_before_its_first_step(monkeypatch):
    """The markers for the steps asked for (warm-up included) are made when the stream starts:
    none is allocated inside a step (a pool made there cost ~92 us every few steps). With
    torch's stream: tpkit's counter needs no marker storage (the next test)."""
    monkeypatch.setenv(ENV_CPU_ALLOCATIONS, "stream")
    made: list[tuple[int, int]] = []  # (markers made, boundaries seen so far)
    real = mem.MemoryProbe._refill

    def refill(self, count=None):
        made.append((mem.MARKER_POOL if count is None else count, len(self._bounds_flat) // 4))
        real(self, count)

    monkeypatch.setattr(mem.MemoryProbe, "_refill", refill)
    run, _, _ = train_mlp(steps=6, warmup=1)
    assert made == [((6 + 1) * mem.MARKERS_PER_STEP_AHEAD, 0)]
    assert len(run.memory) > 0


def test_with_the_counter_a_boundary_frees_no_storage_and_the_table_is_the_streams(monkeypatch):
    """With tpkit's counter a boundary's marker is an event written into its list where the
    boundary is (no storage made ahead, none freed at the boundary), and a slice longer than any
    pool made ahead makes none either; the memory table is the one torch's stream gives, byte for
    byte, with its storage markers."""
    def table(run: tp.Run) -> list:
        m = run.memory[run.memory["device"] == "cpu"]
        return m[["step", "phase", "event", "category", "bytes"]].astype(str).values.tolist()

    monkeypatch.setenv(ENV_CPU_ALLOCATIONS, "stream")
    want, _, _ = train_mlp(steps=6)
    assert want.meta["memory"]["cpu_source"] == CPU_SOURCE_STREAM
    monkeypatch.delenv(ENV_CPU_ALLOCATIONS)
    made: list[int | None] = []
    monkeypatch.setattr(mem.MemoryProbe, "_refill", lambda self, count=None: made.append(count))
    monkeypatch.setattr(mem, "MARKERS_AHEAD_MAX", 0)
    got, model, _ = train_mlp(steps=6)
    assert got.meta["memory"]["cpu_source"] == CPU_SOURCE_COUNTER
    assert made == []
    assert table(got) == table(want)
    assert (rows(got, "backward", "exit", "gradients") == 4 * n_params(model)).all()


def test_with_the_counter_a_usual_boundary_runs_no_python_of_the_probe(monkeypatch):
    """With tpkit's counter the recorder's phase listener is the counter's C function: a usual
    boundary is noted and marked there (in Python that cost 4-6 us a boundary inside real steps).
    The probe's Python runs where it has more to do: the boundary after the model was first seen
    (the forward exit of the first step) and the optimizer's first enter after the backward pass
    where that look is one at the gradients (the first GRAD_LOOKS_FIRST of the 7 steps; the
    counter answers the other looks: ``test_the_counter_answers_the_looks_between_looks_at_the_gradients``).
    The boundaries are all there, each with its row."""
    calls: list[tuple[str, str]] = []
    real = mem.MemoryProbe._at_boundary

    def at_boundary(self, phase, event, raw_step, k, look):
        calls.append((phase, event))
        real(self, phase, event, raw_step, k, look)

    monkeypatch.setattr(mem.MemoryProbe, "_at_boundary", at_boundary)
    run, model, _ = train_mlp(steps=6, warmup=1)
    assert run.meta["memory"]["cpu_source"] == CPU_SOURCE_COUNTER
    assert calls == [("forward", "exit")] + [("optimizer", "enter")] * mem.GRAD_LOOKS_FIRST
    cpu = run.memory[run.memory["device"] == "cpu"]
    # each of the 7 steps (one warm-up): enter, exit and peak of forward, backward and optimizer
    assert cpu.groupby(["step", "phase", "event"]).ngroups == 7 * 9
    assert (rows(run, "backward", "exit", "gradients") == 4 * n_params(model)).all()


def _nested_batches() -> Any:
    leaves = st.one_of(st.integers(0, 9).map(lambda n: torch.full((n,), 1.0)), st.integers(), st.text(max_size=3),
                       st.none())
    return st.recursive(leaves, lambda inner: st.one_of(st.lists(inner, max_size=4), st.tuples(inner, inner),
                                                        st.dictionaries(st.text(max_size=2), inner, max_size=4),
                                                        st.dictionaries(st.text(max_size=2), inner, max_size=4).map(Encoding)),
                        max_leaves=12)


def test_a_batch_s_tensors_are_found_the_same_way_on_the_fast_path() -> None:
    """The batch observation's one-pass listing (no generator for a flat batch) finds exactly
    the tensors, in the same order, that the general nested walk finds, for any batch shape."""

    @settings(max_examples=200, deadline=None)
    @given(_nested_batches())
    def check(batch: Any) -> None:
        fast, walk = mem._batch_tensors(batch), list(mem._tensors(batch))
        assert [id(t) for t in fast] == [id(t) for t in walk]

    check()


def _event(t_ns: int, **fields: Any) -> SimpleNamespace:
    return SimpleNamespace(start_time_ns=t_ns, extra_fields=SimpleNamespace(**fields))


def test_the_stream_reads_its_allocations_in_time_order_and_cuda_levels_apart() -> None:
    cpu, cuda, cuda1 = torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)
    events = [_event(30, ptr=7, alloc_size=-64, device=cpu, total_allocated=0),
              _event(10, ptr=7, alloc_size=64, device=cpu, total_allocated=64),
              _event(20, ptr=9, alloc_size=512, device=cuda, total_allocated=4096),
              _event(5, ptr=3, alloc_size=1024, device=cuda1, total_allocated=1024),
              _event(40, ptr=9, alloc_size=-512, device=cuda, total_allocated=3584)]
    # CUDA reports: after how many CPU events each came, its device, the level it reported
    want = ([(7, 64), (7, -64)], [(0, 1, 1024), (1, 0, 4096), (2, 0, 3584)])
    assert mem.allocations(events) == want
    # an event of another kind (an out-of-memory report has no address) is passed over
    oom = _event(15, alloc_size=1 << 40, device=cpu, total_allocated=0)
    assert mem.allocations([*events, oom]) == want
    assert mem.allocations(events[:2]) == ([(7, 64), (7, -64)], [])


def test_the_stream_of_a_real_slice_is_every_allocation_and_free_of_it() -> None:
    stream = mem.CpuAllocatorStream()
    stream.start()
    try:
        a = torch.empty(1000, dtype=torch.uint8)
        b = torch.empty(3000, dtype=torch.uint8)
        pa, pb = a.data_ptr(), b.data_ptr()
        del a
    finally:
        got = stream.stop()
    mine = [e for e in got if e[0] in (pa, pb)]
    assert mine == [(pa, 1000), (pb, 3000), (pa, -1000)]


def _ops_a_profiler_sees() -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.ones(3) + 1
    return {e.name for e in prof.events()}


def test_the_stream_turns_record_functions_off_in_its_thread_and_back_on(monkeypatch) -> None:
    calls = []
    real = torch._C._autograd._enable_record_function
    monkeypatch.setattr(torch._C._autograd, "_enable_record_function", lambda on: (calls.append(on), real(on)))
    enable = torch.autograd.profiler._enable_profiler
    legacy = torch.autograd.profiler_legacy._enable_profiler_legacy
    stream = mem.CpuAllocatorStream()
    stream.start()
    try:
        assert calls == [False]
        assert torch.autograd.profiler._enable_profiler is not enable  # a profiler's start turns it on
    finally:
        stream.stop()
    assert calls == [False, True]
    assert torch.autograd.profiler._enable_profiler is enable
    assert torch.autograd.profiler_legacy._enable_profiler_legacy is legacy
    monkeypatch.undo()
    assert "aten::add" in _ops_a_profiler_sees()


@pytest.mark.parametrize("fail", [False, True])
def test_after_a_slice_a_torch_profiler_sees_every_op(fail) -> None:
    def step():
        torch.ones(4) * 2
        if fail:
            raise ValueError("the cell fails")

    try:
        tp.profile_fn(step, steps=2, warmup=0, progress=False, clocks=False)
    except ValueError:
        assert fail
    assert "aten::add" in _ops_a_profiler_sees()


def test_the_stream_s_cost_is_estimated_from_its_exact_event_count() -> None:
    meta = {"memory": {"stream_events": 8_000, "stream_steps": 10}}
    cost = ma.stream_cost(meta, step_p50_s=0.010)
    assert cost is not None
    assert cost["events_per_step"] == 800
    assert cost["per_step_s"] == pytest.approx(800 * ma.STREAM_EVENT_COST_S)
    assert cost["share"] == pytest.approx(800 * ma.STREAM_EVENT_COST_S / 0.010)
    note = ma.stream_note(meta, 0.010)
    assert note is not None and "800 allocations and frees a step" in note and "memory=False" in note
    # a long step: the same events are not worth a note; no stream (memory=False): no figure
    assert ma.stream_note(meta, 1.0) is None
    assert ma.stream_cost({"memory": {"cpu_source": "known sets only"}}, 0.010) is None
    assert ma.stream_cost({}, 0.010) is None
    assert "held" not in note  # 8,000 events: not a long slice


def test_a_slice_that_held_millions_of_allocator_events_says_it_cost_more_than_the_estimate() -> None:
    meta = {"memory": {"stream_events": 2_400_000, "stream_steps": 2_000}}  # 1,200 a step
    note = ma.stream_note(meta, 0.010)
    assert note is not None and "held 2,400,000 allocator events" in note and "memory=False" in note
    # said even where the estimate alone is under the share worth a note (a long step)
    long_step = ma.stream_note(meta, 1.0)
    assert long_step is not None and "held 2,400,000" in long_step
    just_under = {"memory": {"stream_events": ma.STREAM_LONG_EVENTS - 1, "stream_steps": 2_000}}
    assert ma.stream_note(just_under, 1.0) is None


def _allocating_step(n_allocations: int):
    def step() -> None:
        for _ in range(n_allocations):
            torch.empty(257, dtype=torch.uint8)  # allocated and freed at once: two events
    return step


def test_a_run_counts_every_allocator_event_of_its_steps_and_says_what_they_cost() -> None:
    base = tp.profile_fn(_allocating_step(0), steps=6, warmup=1, progress=False, clocks=False)
    busy = tp.profile_fn(_allocating_step(500), steps=6, warmup=1, progress=False, clocks=False)
    assert base.meta["memory"]["stream_steps"] == busy.meta["memory"]["stream_steps"] == 7
    per_step = [r.meta["memory"]["stream_events"] / 7 for r in (base, busy)]
    # 500 allocations and their frees a step, and nothing else differs between the two loops
    assert per_step[1] - per_step[0] == pytest.approx(1000, abs=2)
    summary = busy.summary()
    expected = ma.stream_cost(busy.meta, summary.step_p50_s)
    assert expected is not None and expected["share"] > ma.STREAM_NOTE_MIN_SHARE  # 1,000 events in a ~1 ms step
    note = [n for n in summary.notes if n.startswith("memory tracking cost")]
    assert len(note) == 1 and f"{expected['events_per_step']:,.0f} allocations and frees a step" in note[0]
    off = tp.profile_fn(_allocating_step(500), steps=6, warmup=1, progress=False, clocks=False, memory=False)
    assert "stream_events" not in (off.meta.get("memory") or {})
    assert not [n for n in off.summary().notes if n.startswith("memory tracking cost")]


def test_a_user_history_started_since_the_last_allocation_is_seen(monkeypatch):
    """A history that has recorded nothing yet leaves no trace in the snapshot; the CUDA
    allocator still says it is on, and tpkit then leaves it running (never starts its own)."""
    import tpkit.capture.probes.memory as mem

    monkeypatch.setattr(torch._C, "_cuda_isHistoryEnabled", lambda: True, raising=False)
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda *a, **k: {"device_traces": [[]], "segments": []})
    assert mem.CudaAllocator().history_running()
    monkeypatch.setattr(torch._C, "_cuda_isHistoryEnabled", lambda: False, raising=False)
    assert not mem.CudaAllocator().history_running()


@fake_ptr
def test_cuda_memory_held_across_steps_is_not_activations():
    """cuBLAS keeps a workspace per thread from its first matmul on (32 MiB each on an H200):
    allocated, no tensor of the loop's. Two steps, 640 B held beyond the parameters as each
    forward begins, 4,000 B of activations at each forward's exit: activations read 4,000,
    the 640 B are other."""
    held = 64 + 640
    reads = [(held, held)]  # install
    for _ in range(2):  # forward enter, forward exit, backward enter, backward exit
        reads += [(held, 9000), (held + 4000, 9000), (held + 4000, 9000), (held, 9000)]
    fake = FakeCuda(reads)
    rec = Recorder("fake")
    model = cuda_model()
    rec.models.add(model)
    probe = mem.MemoryProbe(rec, cuda=fake).install()
    for _ in range(2):
        rec.exit(rec.enter("forward", "test"))
        rec.exit(rec.enter("backward", "test"))
        rec.end_step()
    probe.remove()
    cuda = frame_of(rec).query("device == 'cuda:0'")
    fwd_exit = cuda.query("phase == 'forward' and event == 'exit'")
    assert list(fwd_exit.query("category == 'activations'")["bytes"]) == [4000, 4000]
    assert list(fwd_exit.query("category == 'other'")["bytes"]) == [640, 640]
    bwd_exit = cuda.query("phase == 'backward' and event == 'exit'")
    assert list(bwd_exit.query("category == 'activations'")["bytes"]) == [0, 0]


def test_cuda_reads_take_both_counters_from_one_stats_call(monkeypatch):
    """memory_allocated and max_memory_allocated each flatten the allocator's whole stats dict
    in Python; a boundary reads both from one nested dict instead (the same two numbers)."""
    calls = []

    def nested(device=None):  # noqa: ANN001, ANN202
        calls.append(device)
        return {"allocated_bytes": {"all": {"current": 4096, "peak": 8192, "allocated": 1, "freed": 1},
                                    "large_pool": {"current": 0, "peak": 0}},
                "reserved_bytes": {"all": {"current": 1 << 20, "peak": 1 << 20}}}

    def flattened(device=None):  # noqa: ANN001, ANN202
        raise AssertionError("the flattened stats are not read at a boundary")

    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", nested)
    monkeypatch.setattr(torch.cuda, "memory_stats", flattened)
    assert mem.CudaAllocator().read(0) == (4096, 8192)
    assert calls == [0]


@pytest.mark.parametrize("memory", [True, False])
def test_what_the_loop_lets_go_tpkit_does_not_keep(memory):
    """A copy of the model and an optimizer made anew every iteration (test-time adaptation,
    meta-learning) go as the loop lets them go: tpkit had held every one to the slice's end (7
    copies alive after 7 iterations, memory=False too), and counted them as a growing
    optimizer_state and parameters, flagged as the loop's leak."""
    import copy
    import gc
    import weakref

    torch.manual_seed(0)
    base = torch.nn.Linear(64, 64)
    copies: list[weakref.ref] = []
    with tp.profile(steps=5, warmup=2, progress=False, clock_hz=0, memory=memory) as prof:
        for _ in range(20):
            model = copy.deepcopy(base)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            copies.append(weakref.ref(model))
            model(torch.randn(8, 64)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    del model, opt
    gc.collect()
    assert sum(r() is not None for r in copies) == 0
    if memory:
        m = prof.run.memory
        exits = m[(m["event"] == "exit") & (m["phase"] == "optimizer")]
        state = exits[exits["category"] == "optimizer_state"].groupby("step")["bytes"].max()
        params = exits[exits["category"] == "parameters"].groupby("step")["bytes"].max()
        one = sum(p.numel() * 4 for p in base.parameters())
        assert (state.iloc[1:] <= 2 * one + 64).all(), state.to_dict()  # one AdamW's moments (+ step scalars)
        assert (params.iloc[1:] <= one).all(), params.to_dict()
        assert not any("grew by" in n for n in prof.run.summary().notes), prof.run.summary().notes


class RegrowingBuffer(torch.nn.Module):
    """A scratch buffer registered again, bigger, when the input grows (older HF rotary caches)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)
        self.register_buffer("scratch", torch.zeros(8, 64), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scratch.shape[0] < x.shape[0]:
            self.register_buffer("scratch", torch.zeros(x.shape[0], 64), persistent=False)
        return self.lin(x) + self.scratch[: x.shape[0]]


@pytest.mark.parametrize("profiled", [False, True])
def test_a_buffer_registered_anew_or_a_replaced_head_goes_when_the_loop_lets_it_go(profiled):
    """tpkit held the parameters and buffers it had read until the model set or the parameter
    count changed: a buffer registered again bigger, or a head replaced by a fresh layer of the
    same shape with a new optimizer, stayed alive to the slice's end (25 MB of buffers alive
    against 16 MB without tpkit), and the old head's weights read parameters. The same loop
    without tpkit (profiled=False) is the truth: each is freed at once."""
    import contextlib
    import gc
    import weakref

    torch.manual_seed(0)
    model = torch.nn.Sequential(RegrowingBuffer(), torch.nn.ReLU(), torch.nn.Linear(64, 256))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    old_buffer = old_head = None
    alive = []
    ctx = tp.profile(steps=5, warmup=2, progress=False, clock_hz=0) if profiled else contextlib.nullcontext()
    with ctx:
        for i in range(7):
            if i == 3:
                old_head = weakref.ref(model[2].weight)
                model[2] = torch.nn.Linear(64, 256)
                opt = torch.optim.Adam(model.parameters(), lr=1e-3)
            x = torch.randn(8 if i < 3 else 32, 64)
            if i == 3:
                old_buffer = weakref.ref(model[0].scratch)
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            gc.collect()
            alive.append((old_buffer is not None and old_buffer() is not None,
                          old_head is not None and old_head() is not None))
    assert len(alive) >= 5 and set(alive) == {(False, False)}, alive  # (the slice may stop the loop at its end)
    if profiled:
        params = sum(p.numel() * 4 for p in model.parameters())
        exits = rows(ctx.run, "optimizer", "exit", "parameters")
        assert (exits == params).all(), exits.to_dict()


@pytest.mark.parametrize("keep", [False, True])
def test_batches_from_worker_processes_are_data_while_the_loop_holds_them(keep):
    """A DataLoader's workers hand over batches in shared memory, outside the allocation stream.
    Such a batch is data from the loader's exit (beside the batch before, which the loop still
    holds there: it read one batch there, and none for the first) until the loop lets it go. A
    loop that keeps every batch (a real leak, 1 MiB a step) had read flat: the next batch's
    arrival was taken to end the one before."""
    B, D = 256, 1024
    data = torch.utils.data.TensorDataset(torch.randn(40 * B, D), torch.randn(40 * B, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=B, num_workers=2)
    model = torch.nn.Linear(D, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    kept = []
    with tp.profile(steps=5, warmup=2, progress=False, clock_hz=0) as prof:
        for x, y in loader:
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            if keep:
                kept.append(x)
    batch = B * D * 4 + B * 4
    m = prof.run.memory
    data_rows = m[(m["category"] == "data") & (m["device"] == "cpu")]
    at_forward = data_rows[(data_rows["phase"] == "forward") & (data_rows["event"] == "enter")]["bytes"].tolist()
    if keep:  # every x kept, the current y: one x more a step
        assert at_forward == [k * B * D * 4 + batch for k in range(7)], at_forward
        notes = prof.run.summary().notes
        assert any("grew by" in n and "mostly data" in n for n in notes), notes
    else:
        assert at_forward == [batch] * 7, at_forward
        exits = data_rows[(data_rows["phase"] == "data_wait") & (data_rows["event"] == "exit")]["bytes"].tolist()
        # iter() starting the workers, then each next(): the first batch alone, then two
        assert exits == [0, batch] + [2 * batch] * 6, exits


def _storage_bytes(*tensors: torch.Tensor) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


@pytest.mark.parametrize("hold", ["zip", "collect"])
def test_worker_batches_held_with_others_are_data_every_step(hold):
    """A worker's batch held together with other batches: zipped with an in-process loader's, or
    n micro-batches collected from a worker loader before their forwards (dynamic
    accumulation). Data at each step's forwards is every batch the loop holds, to the byte. A
    worker batch was taken for one made in another thread when an earlier batch at its address
    had died by the slice's end, and ended at the next hand-out: every other step had read the
    in-process batch alone (144 B of 720 held), 5 micro-batches 1728 B of 2880."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.utils.data.TensorDataset(torch.randn(400, 8), torch.randn(400, 1))
    workers = torch.utils.data.DataLoader(data, batch_size=16, num_workers=1)
    counts = [2, 5, 3, 1, 4, 2, 6, 3, 3]  # micro-batches a step ("collect")
    held: list[int] = []  # bytes of the batches the loop holds at each step's forwards
    with tp.profile(steps=5, warmup=2, progress=False, clock_hz=0) as prof:
        if hold == "zip":
            in_process = torch.utils.data.DataLoader(data, batch_size=4)
            for (x1, y1), (x2, y2) in zip(workers, in_process):
                held.append(_storage_bytes(x1, y1, x2, y2))
                loss = torch.nn.functional.mse_loss(model(x1), y1) + torch.nn.functional.mse_loss(model(x2), y2)
                loss.backward()
                opt.step()
                opt.zero_grad()
        else:
            it = iter(workers)
            for s in range(len(counts)):
                batches = [next(it) for _ in range(counts[s])]
                held.append(_storage_bytes(*(t for b in batches for t in b)))
                for x, y in batches:
                    (torch.nn.functional.mse_loss(model(x), y) / len(batches)).backward()
                opt.step()
                opt.zero_grad()
    m = prof.run.memory
    rows = m[(m["category"] == "data") & (m["device"] == "cpu") & (m["phase"] == "forward") & (m["event"] == "enter")]
    at_forward = rows.groupby("step")["bytes"].max().tolist()
    assert at_forward == held[:7], (at_forward, held[:7])


class Settings:
    """What a collate may hand out beside the tensors: class weights made once, a vocabulary."""

    def __init__(self) -> None:
        self.weights = torch.ones(256 * 1024)
        self.vocab = [f"w{i}" for i in range(5000)]


def test_an_object_beside_the_batch_tensors_is_no_data():
    """``(x, y, settings)``: the settings object's tensor (1 MiB of class weights, made once) and
    its vocabulary are no batch: data is x and y to the byte (they had read 1,050,752 B for 2,176,
    and walking the object cost milliseconds a batch). Truth: the bytes of x and y."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    settings = Settings()
    loader = torch.utils.data.DataLoader(torch.randn(20 * B, D), batch_size=B,
                                         collate_fn=lambda xs: (torch.stack(xs), torch.zeros(len(xs)), settings))
    truth = []
    with tp.profile(steps=3, warmup=1, progress=False, clocks=False) as prof:
        for x, y, _ in loader:
            truth.append(x.untyped_storage().nbytes() + y.untyped_storage().nbytes())
            model(x).backward()
            opt.step()
            opt.zero_grad()
    assert rows(prof.run, "forward", "exit", "data").tolist() == truth[:4]
