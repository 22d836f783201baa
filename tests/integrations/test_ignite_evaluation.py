"""pytorch-ignite's own loop under ``tp.profile``: a trainer from ``create_supervised_trainer``
that runs an evaluator (``create_supervised_evaluator``) from one of its handlers every few
iterations, and a logging handler of the loop's own on the same event.

The evaluator's ``Engine.run``, called inside the trainer's run, is an evaluation as a whole
(its batches, its metrics, its handlers) and ends where it returns: what the trainer's other
handlers do after it is the step's other, not the evaluation's. Truth: the handler's clock
around ``evaluator.run``, the logging handler's known sleep, the model's training calls' own
clock (forward hooks), ignite's own iteration counter and its batches' size.
"""

from __future__ import annotations

import time

import pytest
import torch
import truth
from truth import STEPS, TOLERANCE, WARMUP

import tpkit as tp

BATCH, EVAL_BATCH, EVERY = 8, 16, 3
#: The evaluator's handler sleeps this each of its iterations (its metrics' work); the loop's
#: logging handler this after every trainer iteration.
EVAL_ITER_S, LOG_S = 0.025, 0.040


def ignite_loop(log_first: bool) -> tuple:
    """The trainer, its loader, and the clocks: ``evaluator.run`` (two batches) every EVERY
    iterations, a LOG_S logging handler every iteration, registered after the evaluation
    (``log_first``: before it)."""
    engine = pytest.importorskip("ignite.engine")
    torch.manual_seed(0)
    model = truth.SleepyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    train = torch.utils.data.DataLoader(truth.Regression(), batch_size=BATCH)
    val = torch.utils.data.DataLoader(torch.utils.data.Subset(truth.Regression(), range(2 * EVAL_BATCH)),
                                      batch_size=EVAL_BATCH)
    clock: dict[str, dict[int, float]] = {"eval": {}, "log": {}, "forward": {}}
    started: list[float] = []
    model.register_forward_pre_hook(lambda *_: started.append(time.perf_counter()))

    def forward_done(*_: object) -> None:  # the training calls' own clock (with grad)
        if torch.is_grad_enabled():
            clock["forward"][len(clock["forward"]) + 1] = time.perf_counter() - started[-1]

    model.register_forward_hook(forward_done)
    trainer = engine.create_supervised_trainer(model, opt, torch.nn.MSELoss())
    evaluator = engine.create_supervised_evaluator(model)
    evaluator.add_event_handler(engine.Events.ITERATION_COMPLETED, lambda _: time.sleep(EVAL_ITER_S))

    def validate(e) -> None:  # noqa: ANN001 - ignite's Engine
        t = time.perf_counter()
        evaluator.run(val)
        clock["eval"][e.state.iteration] = time.perf_counter() - t

    def log(e) -> None:  # noqa: ANN001
        t = time.perf_counter()
        time.sleep(LOG_S)
        clock["log"][e.state.iteration] = time.perf_counter() - t

    handlers = [(engine.Events.ITERATION_COMPLETED(every=EVERY), validate), (engine.Events.ITERATION_COMPLETED, log)]
    for event, handler in (handlers[::-1] if log_first else handlers):
        trainer.add_event_handler(event, handler)
    return trainer, train, clock


@pytest.mark.parametrize("log_first", [False, True], ids=["logging after the evaluation", "logging before it"])
def test_an_evaluator_run_from_a_trainer_handler_is_the_evaluation(log_first):
    """The evaluation is ``evaluator.run`` by its own clock, whatever the order of the handlers:
    with the logging handler registered after the evaluator's, its 40 ms had been the
    evaluation's tail (eval_s 0.393 s for evaluator.run's 0.229 s, the verdict EVAL-BOUND "up to
    1.61x faster" where the logging is half the step). The trainer's own run stays training: its forward
    is the model's known sleep, its batches the steps' samples."""
    trainer, train, clock = ignite_loop(log_first)
    with tp.profile(steps=STEPS, warmup=WARMUP, name="ignite-eval", progress=False, clock_hz=0) as prof:
        trainer.run(train, max_epochs=1)
    run = prof.run
    steps = run.steps[~run.steps["warmup"]]
    # a step ends at the optimizer's step: the handlers after iteration k (from 1) are in the next
    # step, and the slice stops inside the last one's
    measured = range(WARMUP, WARMUP + STEPS)
    evals = [k for k in clock["eval"] if k in measured]
    assert trainer.state.iteration == WARMUP + STEPS and len(steps) == STEPS
    assert run.meta["evaluation"]["runs"] == {"ignite.Engine.run": len(evals)}
    assert run.meta["evaluation"]["batches"] == 2 * len(evals)
    assert (run.steps["samples"] == BATCH).all(), run.steps["samples"].tolist()
    want = sum(clock["eval"][k] for k in evals)
    got = float(steps["eval_s"].sum())
    assert abs(got - want) <= TOLERANCE * want, f"eval: tpkit {got:.3f} s, evaluator.run {want:.3f} s"
    logged = sum(v for k, v in clock["log"].items() if k in measured)
    assert float(steps["other_s"].sum()) >= 0.9 * logged, (steps["other_s"].sum(), logged)
    forward, want = float(steps["forward_s"].sum()), sum(v for k, v in clock["forward"].items() if k - 1 in measured)
    assert abs(forward - want) <= TOLERANCE * want, f"forward: tpkit {forward:.3f} s, the model's calls {want:.3f} s"


def test_a_trainer_run_from_an_outer_engine_is_training():
    """A cross-validation (or curriculum) loop driven by an outer Engine, each of whose
    iterations trains on one fold (``trainer.run(folds[k])``): the trainer's run is called while
    another Engine runs, as an evaluator's is, but the model trains in it (a backward, an
    optimizer step), so it is training. It had been one evaluation: forward 0.0 for the model's
    0.2 s, eval_s over the whole step time, and the verdict "EVAL-BOUND: 125% of step time ...
    up to -3.94x faster". Truth: the model's training calls' own clock; no evaluation runs."""
    engine = pytest.importorskip("ignite.engine")
    torch.manual_seed(0)
    model = truth.SleepyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    folds = [torch.utils.data.DataLoader(torch.utils.data.Subset(truth.Regression(), range(4 * BATCH * k, 4 * BATCH * (k + 1))),
                                         batch_size=BATCH) for k in range(3)]
    forward: list[float] = []

    def step(_e, batch) -> None:  # noqa: ANN001 - ignite's Engine
        x, y = batch
        t = time.perf_counter()
        out = model(x)
        forward.append(time.perf_counter() - t)
        torch.nn.functional.mse_loss(out, y).backward()
        opt.step()
        opt.zero_grad()

    trainer = engine.Engine(step)
    outer = engine.Engine(lambda _e, k: trainer.run(folds[k], max_epochs=1))
    with tp.profile(steps=STEPS, warmup=WARMUP, name="ignite-folds", progress=False, clock_hz=0) as prof:
        outer.run([0, 1, 2], max_epochs=1)
    run = prof.run
    steps = run.steps[~run.steps["warmup"]]
    assert len(steps) == STEPS and "evaluation" not in run.meta
    assert float(run.steps["eval_s"].sum()) == 0.0
    got, want = float(steps["forward_s"].sum()), sum(forward[WARMUP:WARMUP + STEPS])
    assert abs(got - want) <= TOLERANCE * want, f"forward: tpkit {got:.3f} s, the loop's clock {want:.3f} s"
    assert run.summary().verdict.kind == "compute-bound", run.summary().verdict
