"""fastai's ``Learner.fit``, unchanged, under ``tp.profile``.

fastai is not installable beside the CPU torch of CI (it imports torchvision): these tests skip
there. What they check is documented in the README's "Works with" table and in
docs/DESIGN_CHANGES.md; the generic parts (a loader sharing its index sampler, the note on an
optimizer tpkit does not see) are tested in plain torch (test_evaluation.py, test_compile.py).

Truth: fastai's own events (``after_step``, ``before_validate`` .. ``after_validate``, the end
events of its own ``CancelFitException``), its optimizer's state tensors, the loop's clocks.
"""

from __future__ import annotations

import time

import pytest
import torch
from truth import STEPS, TOLERANCE, WARMUP

import tpkit as tp

fastai_basics = pytest.importorskip("fastai.basics")
from fastai.basics import (  # noqa: E402
    Callback,
    CancelFitException,
    CrossEntropyLossFlat,
    DataLoaders,
    Learner,
    OptimWrapper,
    nn,
    partial,
    set_seed,
)
from fastai.callback.progress import ProgressCallback  # noqa: E402,F401 (Learner.no_bar)
from fastai.optimizer import Adam  # noqa: E402

N_TRAIN, N_VALID, BS = 256, 96, 32  # 8 training batches an epoch, 3 validation batches
STEP_SLEEP_S = 0.01  # per parameter, in fastai's optimizer's step (a Linear: 2 parameters)


def data() -> DataLoaders:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N_TRAIN, 16, generator=g)
    y = (x[:, 0] > 0).long()
    return DataLoaders.from_dsets(list(zip(x, y)), list(zip(x[:N_VALID], y[:N_VALID])), bs=BS)


class Events(Callback):
    """fastai's own clocks and events."""

    order = 100

    def before_fit(self) -> None:
        self.steps, self.step_s, self.valid_s, self.ends = 0, [], [], []

    def before_step(self) -> None:
        self.t = time.perf_counter()

    def after_step(self) -> None:
        self.step_s.append(time.perf_counter() - self.t)
        self.steps += 1

    def before_validate(self) -> None:
        self.v = time.perf_counter()

    def after_batch(self) -> None:
        if not self.training:
            time.sleep(0.02)  # a metric after each validation batch

    def after_validate(self) -> None:
        self.valid_s.append(time.perf_counter() - self.v)

    def after_cancel_fit(self) -> None:
        self.ends.append("after_cancel_fit")

    def after_fit(self) -> None:
        self.ends.append("after_fit")


def sleepy(p: torch.Tensor, **_: object) -> None:
    """A fastai optimizer callback (run per parameter at each step): a known cost."""
    time.sleep(STEP_SLEEP_S)


def learner(opt_func: object = Adam) -> Learner:
    set_seed(0)  # (the loaders' shuffling draws from Python's random)
    return Learner(data(), nn.Linear(16, 2), loss_func=CrossEntropyLossFlat(), cbs=[Events()], opt_func=opt_func)


def test_fastais_own_optimizer_ends_the_steps_its_time_is_optimizer_and_its_state_optimizer_state():
    """A Learner's default ``opt_func=Adam`` is fastai's ``Optimizer``, no ``torch.optim`` one: a
    fit had recorded no step ("NO STEPS"); with ``tp.step()``, optimizer 0 s and its state other.
    Each of its steps ends a step, its time (a 20 ms callback of its own per step) is optimizer,
    its state (``opt.state``, keyed by parameter) optimizer_state to the byte."""
    learn = learner(_sleepy_adam)
    with learn.no_logging(), learn.no_bar():
        with tp.profile(steps=STEPS, warmup=WARMUP, progress=False, clock_hz=0) as prof:
            learn.fit(1)
    run, ev = prof.run, learn.events
    assert len(run.steps) == STEPS + WARMUP == ev.steps
    measured = run.steps[~run.steps.warmup]
    # before_step .. after_step: the step, and fastai's dispatch of the other callbacks' events
    truth_s = sum(ev.step_s[WARMUP:STEPS + WARMUP])
    got = float(measured["optimizer_s"].sum())  # (its zero_grad too: a few us)
    assert STEPS * 2 * STEP_SLEEP_S <= got and abs(got - truth_s) <= TOLERANCE * truth_s, (got, truth_s)
    state = sum(v.numel() * v.element_size() for s in learn.opt.state.values() for v in s.values()
                if torch.is_tensor(v) and v.dim() > 0)
    assert state > 0 and int(run.memory.groupby("category").bytes.max()["optimizer_state"]) == state
    assert run.meta["optimizers"], run.meta


def _sleepy_adam(params: object, **kwargs: object) -> object:
    """fastai's Adam with a 10 ms callback of its own per parameter (``sleepy``)."""
    opt = Adam(params, **kwargs)
    opt.cbs = opt.cbs + [sleepy]
    return opt


def test_a_fit_ends_after_a_full_slice_as_fastais_own_cancel_ends_it():
    """After a full slice the fit ends as a callback's ``CancelFitException`` at the next batch
    ends it: ``after_cancel_fit`` and ``after_fit`` run, ``learn.loss`` and ``pred`` are let go,
    ``fit`` returns and the body goes on. tpkit's ``StopSlice`` had passed through fastai's
    handlers: no end event, the last batch held. Caught by fit as fastai's cancel is, it is no
    stop the loop swallowed. Truth: the same fit cancelled by fastai's own exception before its
    (STEPS + WARMUP + 1)-th batch."""

    class StopAt(Callback):
        def before_batch(self) -> None:
            if self.training and self.learn.events.steps == STEPS + WARMUP:
                raise CancelFitException()

    plain = learner(partial(OptimWrapper, opt=torch.optim.Adam))
    with plain.no_logging(), plain.no_bar():
        plain.fit(5, cbs=[StopAt()])
    learn = learner(partial(OptimWrapper, opt=torch.optim.Adam))
    returned = False
    with learn.no_logging(), learn.no_bar():
        with tp.profile(steps=STEPS, warmup=WARMUP, progress=False, clock_hz=0) as prof:
            learn.fit(5)
            returned = True
    run = prof.run
    assert learn.events.ends == plain.events.ends == ["after_cancel_fit", "after_fit"]
    assert learn.events.steps == plain.events.steps == len(run.steps) == STEPS + WARMUP
    assert returned and learn.loss is None and learn.pred is None
    assert run.meta["stopped_by"] == "slice" and run.meta["stopped_through"] == "fastai.Learner"
    assert not any("swallowed the stop" in n for n in run.meta["notes"])  # fastai catches it as meant
    assert all(torch.equal(a, b) for a, b in zip(plain.model.parameters(), learn.model.parameters()))


def test_a_fits_validation_loader_is_evaluation_data():
    """Every fastai DataLoader's torch iterator has the same index sampler (its ``_FakeLoader``'s
    class attribute): keyed by it, the validation loader was the training source, its batches
    no evaluation data, and the time between the validation's calls other (eval_s 0.13 s of
    0.23 s). Its batches are evaluation data, and eval_s holds the whole validation. Truth:
    fastai's ``before_validate`` .. ``after_validate``."""
    learn = learner(partial(OptimWrapper, opt=torch.optim.Adam))
    with learn.no_logging(), learn.no_bar():
        with tp.profile(steps=8, warmup=2, progress=False, clock_hz=0) as prof:  # 10: one validation inside
            learn.fit(3)
    run = prof.run
    assert run.meta["evaluation"]["batches"] == N_VALID // BS
    truth_s = learn.events.valid_s[0]
    assert float(run.steps["eval_s"].sum()) >= truth_s * (1 - TOLERANCE), (run.steps["eval_s"].sum(), truth_s)
