"""How the slice stops a plain loop: at the loop's next training action after its last step, so
that what each iteration runs after ``optimizer.step()`` (a scheduler's step, a step counter, a
log line, an evaluation) runs for the last step too. The truth is the same loop stopped by a
``break`` at the end of its N-th iteration, run without tpkit."""

from __future__ import annotations

import contextlib
import time

import pytest
import torch
import torch.nn.functional as F
from truth import STEPS, WARMUP

import tpkit as tp

N = WARMUP + STEPS


class Data(torch.utils.data.Dataset):
    """64 samples with a random transform (it draws from torch's RNG as each batch is made)."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(8) + i / 64, torch.tensor([float(i % 3)])


def _setup(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    loader = torch.utils.data.DataLoader(Data(), batch_size=8, shuffle=True)
    return model, opt, sched, loader


def _train(state: dict, limit: int | None = None, epochs: int = 100) -> None:
    """The loop under test (its objects and counts go into ``state``): its tail after
    ``opt.step()`` counts, logs and steps the scheduler."""
    model, opt, sched, loader = _setup()
    state.update(steps=0, log=[], updates=0)
    opt.register_step_post_hook(lambda *_: state.__setitem__("updates", state["updates"] + 1))
    state.update(model=model, opt=opt, sched=sched, loader=loader)
    for _ in range(epochs):
        for x, y in loader:
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            state["steps"] += 1
            state["log"].append(f"step {state['steps']} loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.5f}")
            opt.zero_grad()
            sched.step()
            if limit is not None and state["steps"] >= limit:
                return


def test_the_iteration_after_the_last_optimizer_step_runs_whole():
    """After a 7-step slice the scheduler, the loop's counter, the optimizer's updates and the log
    all read 7, as the same loop stopped by itself after 7 iterations: the stop raised inside the
    last ``optimizer.step()`` had left ``StepLR.last_epoch`` and the counter at 6 and the log a
    line short. The parameters, the RNG and the loader's next epoch agree too (no batch was read
    past the slice)."""
    truth: dict = {}
    _train(truth, limit=N)
    truth_rng = torch.get_rng_state()
    got: dict = {}
    with tp.profile(steps=STEPS, warmup=WARMUP, progress=False, clock_hz=0) as prof:
        _train(got)
    got_rng = torch.get_rng_state()
    assert len(prof.run.steps) == N and prof.run.complete and prof.run.meta["stopped_by"] == "slice"
    assert got["sched"].last_epoch == got["steps"] == got["updates"] == len(got["log"]) == N
    assert got["log"] == truth["log"]
    assert got["sched"].get_last_lr() == truth["sched"].get_last_lr()
    for a, b in zip(got["model"].parameters(), truth["model"].parameters(), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(got_rng, truth_rng)
    assert all(p.grad is None for p in got["model"].parameters())  # the loop's own zero_grad() ran


def test_a_loop_that_ends_with_its_loader_after_the_last_step_lets_the_cell_go_on():
    """A finite loop whose last batch is the slice's last step ends by itself: nothing is raised,
    the code after it runs, and the Run is complete."""
    after, got = [], {}
    with tp.profile(steps=8 - WARMUP, warmup=WARMUP, progress=False, clock_hz=0) as prof:
        _train(got, epochs=1)  # 64 samples, 8 a batch: 8 steps
        after.append("after the loop")
    assert after == ["after the loop"]
    assert got["steps"] == got["sched"].last_epoch == 8
    assert len(prof.run.steps) == 8 and prof.run.complete and prof.run.meta["stopped_by"] == "slice"


class Slow(torch.nn.Module):
    """A model whose evaluation calls take a known time."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            time.sleep(0.02)
        return self.lin(x)


@pytest.mark.parametrize("every", [N, 3])
def test_an_evaluation_after_the_last_step_runs_whole_and_is_none_of_the_run(every):
    """The loop evaluates on a loader of its own after its N-th step (every 3rd step, or only
    the last): that evaluation runs whole, the model ends in train mode, the loop stops at its
    next training batch, and nothing of the evaluation past the slice enters the Run (no step, no
    span, no eval time, no samples)."""
    torch.manual_seed(0)
    model = Slow()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    train_loader = torch.utils.data.DataLoader(Data(), batch_size=8)
    val_loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(40, 8), torch.randn(40, 1)), batch_size=8)
    evals, steps = [], 0

    def evaluate() -> None:
        model.eval()
        n = 0
        with torch.no_grad():
            for x, y in val_loader:
                F.mse_loss(model(x), y)
                n += 1
        model.train()
        evals.append(n)

    with tp.profile(steps=STEPS, warmup=WARMUP, progress=False, clock_hz=0) as prof:
        for _ in range(100):
            for x, y in train_loader:
                F.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
                steps += 1
                if steps % every == 0:
                    evaluate()
    run = prof.run
    assert steps == N and evals == [5] * (N // every) and model.training
    assert len(run.steps) == N and run.complete
    in_slice = (N - 1) // every  # evaluations that ran before the last step ended
    assert run.meta.get("evaluation", {}).get("batches", 0) == 5 * in_slice
    assert run.steps["samples"].tolist() == [8] * N
    last_end = float(run.steps["end_s"].iloc[-1])
    assert (run.spans["end_s"] <= last_end + 1e-6).all()  # no span of the evaluation after the slice


def test_a_watched_iterable_and_tpkits_loader_stop_before_their_next_batch():
    """``tp.watch`` over a generator and ``tp.data.Loader``: the loop stops before it takes the
    next batch (the generator is not advanced), after its iteration's tail ran."""
    from tpkit.data import Loader

    for how in ("watch", "tp.data.Loader"):
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        made, tail = [], []

        def source(made: list = made):
            while True:
                made.append(1)
                yield torch.randn(8, 8), torch.randn(8, 1)

        data = torch.utils.data.TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
        batches = tp.watch(source()) if how == "watch" else iter(Loader(data, batch_size=8))
        with tp.profile(steps=STEPS, warmup=WARMUP, progress=False, clock_hz=0) as prof:
            for x, y in batches:
                F.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
                tail.append(1)
        assert len(prof.run.steps) == N and len(tail) == N, how
        assert (len(made) if how == "watch" else batches.batches_done) == N, how


@pytest.mark.parametrize("loss", ["F.mse_loss", "nn.MSELoss"])
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad_left_on"])
@pytest.mark.parametrize("split", ["samplers", "train_accuracy"])
def test_an_evaluation_on_its_own_loader_over_the_training_dataset_runs_whole(split, grad, loss):
    """The loop evaluates every 3rd step (the last one's too) in eval mode, without grad or
    with grad left on (``torch.no_grad()`` forgotten), on a DataLoader of its own over the
    training Dataset (a train/val split by samplers; a train-accuracy loader over the whole
    set): after the last step that evaluation runs whole and the model is back in train mode,
    as in the same loop stopped by ``break``. The evaluation's ``iter()`` had stopped the loop
    after ``model.eval()``: one evaluation short and the model left in eval mode (without grad,
    sharing the Dataset with the training loader, until 6bb5575; with grad, its batches
    training by the forward's rule, until the stop waited for a trained model in train mode).
    A loss module (``nn.MSELoss()``, called with grad in train mode, never put in eval mode) is
    no trained model: with one, the evaluation with grad left on had been stopped at its first
    read all the same."""
    ds = Data()
    loss_fn = F.mse_loss if loss == "F.mse_loss" else torch.nn.MSELoss()

    def loop(limit: int | None = None) -> tuple[int, list, bool]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        if split == "samplers":
            loader = torch.utils.data.DataLoader(ds, batch_size=8, sampler=torch.utils.data.SubsetRandomSampler(range(48)))
            eval_loader = torch.utils.data.DataLoader(ds, batch_size=8, sampler=range(48, 64))
        else:
            loader = torch.utils.data.DataLoader(ds, batch_size=8, shuffle=True)
            eval_loader = torch.utils.data.DataLoader(ds, batch_size=32)
        steps, evals = 0, []
        box["model"] = model
        for _ in range(100):
            for x, y in loader:
                loss_fn(model(x), y).backward()
                opt.step()
                opt.zero_grad()
                steps += 1
                box["steps"], box["evals"] = steps, evals
                if steps % 3 == 1:  # (the 7th step's too)
                    model.eval()
                    with contextlib.nullcontext() if grad else torch.no_grad():
                        evals.append(sum(1 for a, b in eval_loader if loss_fn(model(a), b) is not None))
                    model.train()
                if limit is not None and steps >= limit:
                    return steps, evals, model.training
        raise AssertionError("the loop ran past 100 epochs")

    box: dict = {}
    truth = loop(N)
    with tp.profile(steps=STEPS, warmup=WARMUP, progress=False, clock_hz=0) as prof:
        loop()
    assert (box["steps"], box["evals"], box["model"].training) == truth == (N, [2, 2, 2], True)
    assert len(prof.run.steps) == N and prof.run.complete and prof.run.meta["stopped_by"] == "slice"


@pytest.mark.parametrize("train_in_eval_mode", [False, True], ids=["train()-at-the-top", "trains-in-eval-mode"])
def test_a_read_of_the_last_steps_loader_stops_the_loop_with_the_model_in_eval_mode(train_in_eval_mode):
    """A loop that calls ``model.train()`` at the top of each iteration and looks at its batch
    in eval mode without grad after ``opt.step()`` (or one that trains in eval mode): its next
    read of the training loader is the next iteration's, with the model in eval mode, and
    stops it there, as the loop stopped by ``break`` (no batch more made, the model left in eval
    mode). Taking every read in eval mode for an evaluation's had let the loop read one batch
    more and run its forward and backward (56 samples made for 48, the model in train mode).
    Truth: the Dataset's count of samples made and the model's mode, against ``break``."""

    class Counted(Data):
        made = 0

        def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
            Counted.made += 1
            return super().__getitem__(i)

    def loop(state: dict, limit: int | None = None) -> None:
        Counted.made = 0
        torch.manual_seed(0)
        state["model"] = model = torch.nn.Linear(8, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        state["steps"] = 0
        for x, y in torch.utils.data.DataLoader(Counted(), batch_size=8):
            if not train_in_eval_mode:
                model.train()
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
            state["steps"] += 1
            model.eval()
            with torch.no_grad():
                model(x[:2])  # a look at the batch in eval mode
            if limit is not None and state["steps"] >= limit:
                break

    def seen(state: dict) -> tuple[int, int, bool]:
        return state["steps"], Counted.made, state["model"].training

    plain: dict = {}
    loop(plain, N)
    truth = seen(plain)
    profiled: dict = {}
    with tp.profile(steps=STEPS, warmup=WARMUP, progress=False, clock_hz=0) as prof:
        loop(profiled)
    assert seen(profiled) == truth == (N, 8 * N, False)
    assert len(prof.run.steps) == N and prof.run.meta["stopped_by"] == "slice"
    # a read in the middle of an epoch is no evaluation's first: no note says it may have been
    assert not any(n.startswith("the loop was stopped where it began a new pass") for n in prof.run.meta["notes"])


@pytest.mark.parametrize("model_mode", ["eval", "train"])
def test_an_evaluation_with_grad_over_the_last_steps_loader_is_cut_at_its_first_read(model_mode):
    """The slice ends on an epoch's last batch; the loop then evaluates over its training loader
    itself with grad enabled (no ``torch.no_grad()``; ignite's ``train_evaluator.run(train_loader)``
    at ``EPOCH_COMPLETED`` reads so, before its step's ``model.eval()``). That read is the loader
    of the last step's batch, with grad: the next iteration's as far as tpkit can tell, so the loop
    stops there, in eval mode too (README, "How the loop is stopped"). With the model in eval mode
    at that read, the run notes that an evaluation over the training loader may have been cut
    (the README had said such a read goes on). Truth: the loop's own log."""
    log: list[str] = []

    def loop() -> None:
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        loader = torch.utils.data.DataLoader(torch.utils.data.Subset(Data(), range(8 * N)), batch_size=8)
        loss_fn = torch.nn.MSELoss()
        for epoch in range(3):
            model.train()
            for x, y in loader:
                loss_fn(model(x), y).backward()
                opt.step()
                opt.zero_grad()
            log.append(f"epoch {epoch} trained")
            if model_mode == "eval":
                model.eval()
            n = 0
            for x, _ in loader:  # grad enabled
                with torch.no_grad():
                    model(x)
                n += 1
            log.append(f"epoch {epoch} evaluated {n} batches")

    with tp.profile(steps=STEPS, warmup=WARMUP, progress=False, clock_hz=0) as prof:
        loop()
    assert log == ["epoch 0 trained"]
    assert len(prof.run.steps) == N and prof.run.complete and prof.run.meta["stopped_by"] == "slice"
    said = [n for n in prof.run.meta["notes"] if n.startswith("the loop was stopped where it began a new pass")]
    assert len(said) == (model_mode == "eval"), prof.run.meta["notes"]
    if said:
        assert said[0] == (
            "the loop was stopped where it began a new pass over the loader of its last step's batch, with grad "
            "enabled, while the trained model was in eval mode: if that pass was an evaluation over the training "
            "loader (model.eval(), then for batch in train_loader), it was cut at its first batch "
            "and did not run; run such an evaluation under torch.no_grad() for it to run whole, or profile with "
            "stop=False")


def test_a_loader_whose_sampler_has_a_freed_loaders_id_is_a_source_of_its_own():
    """A loader key is the id of the loader's index sampler: a loader made after another was
    freed can get its id (a validation loader made after the training loader of the epoch
    before: the two had been one source, the training loader's settings replaced by the
    validation loader's). ``Recorder.source_key`` gives it a key of its own; the same loader
    keeps its key."""
    from tpkit.capture.recorder import Recorder

    rec = Recorder()
    a = torch.utils.data.DataLoader(Data(), batch_size=8)
    b = torch.utils.data.DataLoader(Data(), batch_size=4)
    key_a = rec.source_key(123, a)
    assert key_a == 123 and rec.source_key(123, a) == 123  # a's epochs: one key
    del a
    key_b = rec.source_key(123, b)  # b's sampler has the id a's had (its id forced here)
    assert key_b != 123 and rec.key_alias[123] == key_b and rec.source_key(123, b) == key_b


def test_a_loop_that_makes_its_loader_anew_each_epoch_stops_before_the_new_loaders_first_batch():
    """A loop that builds a new DataLoader over the same Dataset each epoch (a curriculum, a
    sampler rebuilt per epoch): the slice full at an epoch's last batch, the loop stops at the
    next epoch's ``iter()`` as the same loop stopped by ``break`` after its N-th step: no
    sample of the next epoch made, no forward or backward past the slice. The new loader is
    one the slice never read: it is the training loader because its Dataset is the training
    batches'. Truth: the Dataset's own count of samples made and the model's gradients."""

    class Counted(Data):
        made = 0

        def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
            Counted.made += 1
            return super().__getitem__(i)

    ds = Counted()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    steps = 0
    with tp.profile(steps=8 - WARMUP, warmup=WARMUP, progress=False, clock_hz=0) as prof:  # 8 batches an epoch
        for _epoch in range(3):
            for x, y in torch.utils.data.DataLoader(ds, batch_size=8, shuffle=True):
                opt.zero_grad()
                F.mse_loss(model(x), y).backward()
                opt.step()
                steps += 1
    assert (steps, Counted.made) == (8, 64)
    assert len(prof.run.steps) == 8 and prof.run.complete and prof.run.meta["stopped_by"] == "slice"


def test_after_a_loop_that_ended_by_itself_a_no_grad_read_of_its_loader_runs_and_a_training_one_stops():
    """A finite loop whose last batch is the slice's last step ends by itself; the cell then
    evaluates on the training loader without grad (it runs: the stop had come at its first read)
    and then trains another epoch on it with grad (a training read: the loop stops there, so a
    loop of epochs is still stopped at its next epoch)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(Data(), batch_size=8)  # 8 batches
    done: list[str] = []
    with tp.profile(steps=8 - WARMUP, warmup=WARMUP, progress=False, clock_hz=0) as prof:
        for x, y in loader:
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        done.append("loop ended")
        with torch.no_grad():
            n = sum(1 for x, y in loader if model(x) is not None)
        done.append(f"evaluated {n}")
        for x, y in loader:
            F.mse_loss(model(x), y).backward()
            opt.step()
        done.append("second epoch")
    assert done == ["loop ended", "evaluated 8"]
    assert len(prof.run.steps) == 8 and prof.run.complete and prof.run.meta["stopped_by"] == "slice"


def test_a_loop_whose_last_batch_came_from_no_source_tpkit_saw_stops_before_its_next_forward():
    """``itertools.cycle`` over a DataLoader hands out its first epoch's batches again without
    reading the loader, so past that epoch tpkit sees no read: the loop stops at its next trained
    forward. It had waited for the lead optimizer's next step, running a forward and backward
    past the slice (BatchNorm's ``num_batches_tracked`` 8 for 7, gradients left filled where the
    loop's ``zero_grad`` had cleared them). The model's state equals the same loop stopped by
    ``break`` after 7 iterations."""
    import itertools

    def loop(limit: int | None = None) -> torch.nn.Module:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 1))
        box["model"] = model
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        steps = 0
        for x, y in itertools.cycle(torch.utils.data.DataLoader(Data(), batch_size=16, shuffle=True)):  # 4 a pass
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            steps += 1
            if limit is not None and steps >= limit:
                break
        return model

    box: dict = {}
    truth = loop(N)
    with tp.profile(steps=STEPS, warmup=WARMUP, progress=False, clock_hz=0) as prof:
        loop()
    got = box["model"]
    assert len(prof.run.steps) == N and prof.run.complete
    assert int(got[1].num_batches_tracked) == int(truth[1].num_batches_tracked) == N
    assert all(p.grad is None for p in got.parameters())
    for a, b in zip(list(got.parameters()) + list(got.buffers()), list(truth.parameters()) + list(truth.buffers()),
                    strict=True):
        assert torch.equal(a, b)


def test_a_loop_stopped_at_its_optimizer_step_runs_none_of_its_own_step_hooks_for_it():
    """A closure loop whose batches come from no source tpkit sees stops inside the lead
    optimizer's next ``step()``, before its update: its own step hooks, global (registered before
    the slice) and the optimizer's, fire as often as in the same loop stopped by ``break`` after 7
    iterations, and the parameters agree. tpkit's global pre-hook, where the stop is raised, had
    run after the loop's global pre-hook, which fired once more (8 for 7)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    def run(profiled: bool) -> tuple[dict, torch.nn.Module]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        fires: dict = {}

        def count(name: str):  # noqa: ANN202
            return lambda *_: fires.__setitem__(name, fires.get(name, 0) + 1)

        handles = [register_optimizer_step_pre_hook(count("global pre")),
                   register_optimizer_step_post_hook(count("global post")),
                   opt.register_step_pre_hook(count("pre")), opt.register_step_post_hook(count("post"))]

        def loop(limit: int | None = None) -> None:
            steps = 0
            while limit is None or steps < limit:
                x, y = torch.randn(8, 8), torch.randn(8, 1)

                def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
                    opt.zero_grad()
                    loss = F.mse_loss(model(x), y)
                    loss.backward()
                    return loss

                opt.step(closure)
                steps += 1

        try:
            if profiled:
                with tp.profile(steps=STEPS, warmup=WARMUP, progress=False, clock_hz=0) as prof:
                    loop()
                assert len(prof.run.steps) == N and prof.run.complete and prof.run.meta["stopped_by"] == "slice"
            else:
                loop(N)
        finally:
            for h in handles:
                h.remove()
        return fires, model

    truth_fires, truth = run(profiled=False)
    fires, model = run(profiled=True)
    assert truth_fires == {"global pre": N, "global post": N, "pre": N, "post": N}
    assert fires == truth_fires
    for a, b in zip(model.parameters(), truth.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("then", ["returns", "trains-again"])
def test_a_stop_the_loop_catches_and_does_not_reraise_is_said(then):
    """A training function whose ``except BaseException:`` saves an "interrupted" checkpoint and
    returns (as an ignite handler on ``Events.EXCEPTION_RAISED`` that does not re-raise): it
    swallows tpkit's stop, and the code after it runs. The Run says so, with what to do; it had
    read ``stopped_by=slice``, complete, with no note. A second training call after it is stopped
    again at its first read (``trains-again``: that stop ends the body). The stop's own message
    says what it is (ignite had logged "Engine run is terminating due to exception: " and
    nothing). Truth: the loop's own record of what it caught and what ran after it."""
    caught: list[str] = []
    after: list[int] = []

    def train(state: dict) -> None:
        try:
            _train(state)
        except BaseException as e:  # noqa: BLE001 - the swallowing handler under test
            caught.append(str(e))

    got: dict = {}
    with tp.profile(steps=STEPS, warmup=WARMUP, progress=False, clock_hz=0) as prof:
        train(got)
        after.append(got["steps"])
        if then == "trains-again":
            _train({})  # no handler: the stop ends the body here
            after.append(-1)  # never runs
    run = prof.run
    assert after == [N] and len(caught) == 1
    assert "slice is full and recorded" in caught[0] and "not an error" in caught[0]
    assert len(run.steps) == N and run.complete and run.meta["stopped_by"] == "slice"
    again = "tpkit stopped it again at its next training action (1 time); " if then == "trains-again" else ""
    end = "the last stop ended the body" if then == "trains-again" else "the body then returned without the stop"
    note = ("tpkit stopped the loop after the slice's last step with StopSlice (tpkit.errors.StopSlice), and the loop "
            f"caught it and went on ({again}{end}): an except BaseException: or bare except:")
    assert any(n.startswith(note) for n in run.meta["notes"]), run.meta["notes"]
    assert any("tp.profile(stop=False)" in n for n in run.meta["notes"])


def test_a_stop_that_propagates_is_not_said_to_be_caught():
    """The stop unwinding through a ``finally`` and an ``except BaseException: ... raise`` is no
    swallowed stop: no note."""
    seen: list[str] = []
    with tp.profile(steps=STEPS, warmup=WARMUP, progress=False, clock_hz=0) as prof:
        try:
            _train({})
        except BaseException:
            seen.append("re-raised")
            raise
    assert seen == ["re-raised"]
    assert not any("caught it" in n for n in prof.run.meta["notes"]), prof.run.meta["notes"]


def test_a_step_listener_taken_out_by_one_before_it_is_not_told_of_that_step():
    """Where a trainer runs on past the slice (Lightning's ``validate``, DDP's Join), the slice's
    own step listener takes the probes out in place: a probe's listener after it, told of that
    step all the same, had put its hooks back (the compile probe's dynamo callbacks, left behind)."""
    from tpkit.capture.recorder import Recorder

    rec = Recorder()
    told: list[tuple[str, int]] = []

    def later(step: int, _end_ns: int) -> None:
        told.append(("later", step))

    def takes_later_out(step: int, _end_ns: int) -> None:
        told.append(("first", step))
        if step == 1:
            rec.step_listeners.remove(later)

    rec.step_listeners += [takes_later_out, later]
    for _ in range(3):
        rec.end_step()
    assert told == [("first", 0), ("later", 0), ("first", 1), ("first", 2)]
