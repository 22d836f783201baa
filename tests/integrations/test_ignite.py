"""PyTorch-Ignite's own loop (``create_supervised_trainer``, an evaluator run from a handler)
under ``tp.profile``: tpkit sees it as a plain loop (no trainer switch) and stops it with
``StopSlice`` at its next training action, which ignite's engine catches, logs and passes to
its ``Events.EXCEPTION_RAISED`` handlers before re-raising. Truth: the loop's clocks around
the evaluator's runs, the known sleeps (``truth``), what the handlers saw."""

from __future__ import annotations

import logging
import time

import pytest
import torch
import truth
from truth import STEPS, TOLERANCE, WARMUP

import tpkit as tp

ignite_engine = pytest.importorskip("ignite.engine")
Events = ignite_engine.Events
N = STEPS + WARMUP


def _trainer() -> tuple:
    torch.manual_seed(0)
    model = truth.SleepyNet()
    opt = truth.SleepySGD(model.parameters(), lr=0.01)
    trainer = ignite_engine.create_supervised_trainer(model, opt, torch.nn.MSELoss())
    train = torch.utils.data.DataLoader(truth.Regression(), batch_size=8, collate_fn=truth.sleepy_collate)
    return model, trainer, train


def test_an_evaluators_validation_loader_shutting_its_workers_down_is_eval():
    """Every other iteration a handler runs an evaluator over a 2-worker validation loader of two
    batches: ignite drops its iterator at the epoch's length (``_dataloader_iter = None``), and its
    workers shut down there, inside ``evaluator.run``. That wait is the evaluation's: it had been
    training's data_wait (0.056 s of 0.064 s, the run 9% data_wait, just under INPUT-LIMITED),
    and eval_s 0.162 s for 0.227 s by the loop's clock around ``evaluator.run``."""
    model, trainer, train = _trainer()
    evaluator = ignite_engine.create_supervised_evaluator(model)
    val = torch.utils.data.DataLoader(torch.utils.data.Subset(truth.Regression(), range(16)), batch_size=8,
                                      num_workers=2)
    clock: list[float] = []

    @trainer.on(Events.ITERATION_COMPLETED(every=2))
    def validate(_engine) -> None:  # noqa: ANN001
        t = time.perf_counter()
        evaluator.run(val)
        clock.append(time.perf_counter() - t)

    with (tp.profile(steps=STEPS, warmup=WARMUP, name="ignite-val", progress=False, clock_hz=0) as prof,
          truth.TRUTH.recording()):
        trainer.run(train, max_epochs=1)
    known, run = truth.snapshot(), prof.run
    assert len(run.steps) == N and len(clock) == N // 2
    shutdowns = run.spans[run.spans["source"] == "DataLoader._shutdown_workers"]
    assert len(shutdowns) == len(clock) and set(shutdowns["phase"]) == {"eval"}, shutdowns
    truth.assert_phases(run, known, phases=("data_wait",))  # the training loader's own reads alone
    eval_s, want = float(run.steps["eval_s"].sum()), sum(clock)
    assert abs(eval_s - want) <= TOLERANCE * want, f"eval {eval_s * 1e3:.1f} ms, truth {want * 1e3:.1f} ms"


def test_an_exception_raised_handler_that_does_not_reraise_swallows_the_stop_and_the_run_says_so(caplog):
    """A handler on ``Events.EXCEPTION_RAISED`` that saves an "interrupted" checkpoint and does
    not re-raise: ignite then ends ``trainer.run`` quietly, the code after it runs, and a second
    ``trainer.run`` is stopped again at its first read, swallowed again. The Run says what
    happened and what to do (it had read stopped_by=slice, complete, no note); ignite's ERROR
    line says what the stop is (it had ended in an empty message)."""
    model, trainer, train = _trainer()
    seen: list[str] = []

    @trainer.on(Events.EXCEPTION_RAISED)
    def on_error(_engine, e: BaseException) -> None:  # noqa: ANN001
        seen.append(type(e).__name__)
        torch.save(model.state_dict(), __import__("io").BytesIO())

    after: list[int] = []
    with caplog.at_level(logging.ERROR), tp.profile(steps=STEPS, warmup=WARMUP, progress=False, clock_hz=0) as prof:
        trainer.run(train, max_epochs=1)
        after.append(trainer.state.iteration)
        trainer.run(train, max_epochs=2)
        after.append(trainer.state.iteration)
    run = prof.run
    assert seen == ["StopSlice", "StopSlice"] and after == [N, N]
    assert len(run.steps) == N and run.complete and run.meta["stopped_by"] == "slice"
    assert any(n.startswith("tpkit stopped the loop after the slice's last step with StopSlice") and
               "caught it and went on (tpkit stopped it again at its next training action (1 time); the body then "
               "returned without the stop)" in n and "Events.EXCEPTION_RAISED" in n for n in run.meta["notes"]), \
        run.meta["notes"]
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors and all(m.startswith("Engine run is terminating due to exception: tpkit's profiling slice is full "
                                       "and recorded") for m in errors), errors


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
def test_an_evaluator_over_the_training_loader_after_the_slices_last_step(grad):
    """The slice ends on an epoch's last batch; at ``EPOCH_COMPLETED`` a handler runs an
    evaluator over the training loader itself (ignite's canonical ``train_evaluator.run``). Its
    first read is of the last step's loader, with grad, the model still in train mode (the
    evaluator's step calls ``model.eval()`` after it): the loop stops there, the evaluation cut,
    and the run says so (the README had said such a read goes on in eval mode). Under
    ``torch.no_grad()`` it runs whole and the trainer stops at its next epoch's first read.
    Truth: the handler's own log."""
    model, trainer, _ = _trainer()
    train = torch.utils.data.DataLoader(torch.utils.data.Subset(truth.Regression(), range(8 * N)), batch_size=8)
    evaluator = ignite_engine.create_supervised_evaluator(model)
    log: list[str] = []

    @trainer.on(Events.EPOCH_COMPLETED)
    def results(engine) -> None:  # noqa: ANN001
        log.append(f"epoch {engine.state.epoch}")
        with torch.enable_grad() if grad else torch.no_grad():
            evaluator.run(train)
        log.append(f"evaluated {evaluator.state.iteration} batches")

    with tp.profile(steps=STEPS, warmup=WARMUP, progress=False, clock_hz=0) as prof:
        trainer.run(train, max_epochs=3)
    run = prof.run
    assert log == (["epoch 1"] if grad else ["epoch 1", f"evaluated {N} batches"])
    assert len(run.steps) == N and trainer.state.iteration == N and run.meta["stopped_by"] == "slice"
    said = [n for n in run.meta["notes"] if n.startswith("the loop was stopped where an ignite Engine run from inside")]
    assert len(said) == grad, run.meta["notes"]
