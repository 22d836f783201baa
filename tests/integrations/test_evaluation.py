"""Evaluation inside the slice: a loop, a Hugging Face Trainer (``eval_strategy="steps"``) and
Lightning (``val_check_interval``) that evaluate every few steps. The evaluation's model calls
and the waits for its batches are ``eval``, not ``forward`` / ``data_wait``, and its batches are
not the steps' samples; a model only ever called without grad (a teacher) and the trained
model called without grad in train mode on the batches it trains on (targets for itself) stay
``forward``, while its calls in train mode on a validation loader's batches are evaluation.

Truth: the loop's own clocks; for the frameworks, forward hooks on the model that time each
outermost call by its grad mode, the known sleeps of ``truth``'s parts, and the framework's own
logged losses and step counters.
"""

from __future__ import annotations

import re
import time
from collections import defaultdict

import pytest
import torch
import torch.nn.functional as F
import truth
from truth import STEPS, TOLERANCE, WARMUP

import tpkit as tp

BATCH, EVAL_BATCH, EVERY = 8, 16, 3
N = STEPS + WARMUP


def close(got: float, want: float, what: str) -> None:
    assert abs(got - want) <= TOLERANCE * want, f"{what}: tpkit {got * 1e3:.1f} ms, truth {want * 1e3:.1f} ms"


def train_and_val() -> tuple:
    """The training loader (BATCH) and the validation loader (EVAL_BATCH), each batch collated
    after truth's known sleep."""
    return (torch.utils.data.DataLoader(truth.Regression(), batch_size=BATCH, collate_fn=truth.sleepy_collate),
            torch.utils.data.DataLoader(truth.Regression(), batch_size=EVAL_BATCH, collate_fn=truth.sleepy_collate))


def evaluate_two(model: torch.nn.Module, val: torch.utils.data.DataLoader) -> float:
    """The loop's evaluation: ``model.eval()``, no grad, its loss on two validation batches
    (``if k == 1: break``), ``model.train()``; returns its seconds by the loop's clock."""
    model.eval()
    with torch.no_grad():
        t = time.perf_counter()
        for k, (vx, vy) in enumerate(val):
            F.mse_loss(model(vx), vy)
            if k == 1:
                break
        seconds = time.perf_counter() - t
    model.train()
    return seconds


class CallClock:
    """Times each outermost call of ``model`` by its grad mode (forward hooks: inside the call)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._t = 0.0
        model.register_forward_pre_hook(self._pre)
        model.register_forward_hook(self._post)

    def _pre(self, *_: object) -> None:
        self._t = time.perf_counter()

    def _post(self, *_: object) -> None:
        kind = "train" if torch.is_grad_enabled() else "eval"
        self.seconds[kind] += time.perf_counter() - self._t
        self.calls[kind] += 1


# -- a plain loop -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def plain():
    torch.manual_seed(0)
    model, teacher = truth.SleepyNet(), truth.SleepyNet().eval()
    opt = truth.SleepySGD(model.parameters(), lr=0.01)
    train, val = train_and_val()
    clock: dict[str, float] = defaultdict(float)
    evals = 0
    before = truth.hook_state()
    with tp.profile(steps=STEPS, warmup=WARMUP, name="evaluating", progress=False, clock_hz=0) as prof:
        it = iter(train)
        for step in range(N):
            t = time.perf_counter()
            x, y = next(it)
            clock["data_wait"] += time.perf_counter() - t
            with torch.no_grad():  # a teacher: never trained here, its calls are the step's forward
                t = time.perf_counter()
                target = teacher(x)
                clock["forward"] += time.perf_counter() - t
            t = time.perf_counter()
            loss = F.mse_loss(model(x), y) + 0.0 * target.sum()
            clock["forward"] += time.perf_counter() - t
            loss.backward()
            opt.step()
            opt.zero_grad()
            if step % EVERY == EVERY - 1:  # evaluate: model.eval(), no grad, two val batches
                clock["eval"] += evaluate_two(model, val)
                evals += 2
    return dict(run=prof.run, before=before, clock=clock, evals=evals)


def test_evaluation_is_its_own_phase(plain):
    run, clock = plain["run"], plain["clock"]
    truth.assert_hooks_removed(plain["before"])
    assert len(run.steps) == N
    close(float(run.steps["forward_s"].sum()), clock["forward"], "forward (training and teacher)")
    close(float(run.steps["data_wait_s"].sum()), clock["data_wait"], "data_wait (training batches)")
    close(float(run.steps["eval_s"].sum()), clock["eval"], "eval (its model calls and its batches)")
    assert run.meta["evaluation"] == {"calls": plain["evals"], "helper_calls": 0, "batches": plain["evals"],
                                      "samples": plain["evals"] * EVAL_BATCH, "runs": {}}
    assert any(note.startswith(f"evaluation ran inside the slice: {plain['evals']} call(s)")
               for note in run.meta["notes"]), run.meta["notes"]


def test_evaluation_batches_are_not_training_samples(plain):
    run = plain["run"]
    assert (run.steps["samples"] == BATCH).all(), run.steps["samples"].tolist()
    m = run.steps[~run.steps["warmup"]]
    assert run.summary().throughput == pytest.approx(BATCH * len(m) / m["duration_s"].sum())


def test_memory_at_evaluation_is_labelled_eval(plain):
    mem = plain["run"].memory
    at_eval = mem[mem["phase"] == "eval"]
    assert len(at_eval), "no memory row at an evaluation boundary"
    # every evaluation step has its eval rows; the other steps none
    eval_steps = set(plain["run"].steps.loc[plain["run"].steps["eval_s"] > 0, "step"])
    assert set(at_eval["step"]) == eval_steps


def test_memory_held_between_evaluation_calls_is_one_category():
    """An evaluation under inference_mode keeping ``out = model(vx)`` (64 x 4096 float32 =
    1,048,576 B): the previous call's output is alive at the wait for the next batch and at the
    next call's enter. Inside an evaluation what is beyond the known sets is ``other`` at every
    boundary (the output had read other at the wait and activations at the next enter: the
    activations bar jumped by one output). Truth: the output's exact bytes."""
    out_bytes = 64 * 4096 * 4
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 4096)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    train = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8 * 20, 64)), batch_size=8)
    val = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64 * 3, 64)), batch_size=64)
    with tp.profile(steps=4, warmup=1, name="eval-memory", progress=False, clock_hz=0) as prof:
        for i, (x,) in enumerate(train):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            if i == 1:
                model.eval()
                with torch.inference_mode():
                    for (vx,) in val:
                        out = model(vx)
                del out
                model.train()
    m = prof.run.memory
    ev = m[(m["phase"] == "eval") & (m["device"] == "cpu") & (m["event"] != "peak")]
    beyond = ev[ev["category"].isin(["activations", "temporaries", "other"])]
    assert (beyond.loc[beyond["category"] != "other", "bytes"] == 0).all(), beyond[beyond["bytes"] > 0]
    other = beyond[beyond["category"] == "other"].sort_values("t_s")
    held = other["bytes"].tolist()
    first = held.index(out_bytes)  # the first call's exit: its output
    assert held[first:] == [out_bytes] + [out_bytes, out_bytes, out_bytes, 2 * out_bytes] * 2, held


@pytest.mark.parametrize("eval_mode", [False, True], ids=["train-mode", "eval-mode"])
def test_targets_the_model_makes_for_itself(eval_mode):
    """The trained model called without grad on the batch it then trains on (pseudo-labels for
    itself). In train mode it is training; in eval mode its call is counted as eval (the run says
    so), but the batch also fed a training forward: its samples and its wait stay the step's."""
    torch.manual_seed(0)
    model = truth.SleepyNet()
    opt = truth.SleepySGD(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(truth.Regression(), batch_size=BATCH, collate_fn=truth.sleepy_collate)
    with tp.profile(steps=STEPS, warmup=WARMUP, name="self-targets", progress=False, clock_hz=0) as prof:
        for x, _ in loader:
            model.train(not eval_mode)
            with torch.no_grad():
                target = model(x)
            model.train()
            F.mse_loss(model(x), target + 1.0).backward()
            opt.step()
            opt.zero_grad()
    run = prof.run
    assert (run.steps["samples"] == BATCH).all()
    assert float(run.steps["data_wait_s"].sum()) >= N * truth.DATA_S
    if eval_mode:
        assert run.meta["evaluation"] == {"calls": N, "helper_calls": 0, "batches": 0, "samples": 0, "runs": {}}
        assert float(run.steps["forward_s"].sum()) >= N * truth.FORWARD_S
    else:
        assert float(run.steps["eval_s"].sum()) == 0.0 and "evaluation" not in run.meta
        assert float(run.steps["forward_s"].sum()) >= 2 * N * truth.FORWARD_S


@pytest.mark.parametrize("from_step", [4, 0], ids=["labels-from-step-4", "every-other-step"])
def test_self_training_labelling_its_own_unlabelled_batch_in_train_mode_is_training(from_step):
    """Self-training (FixMatch-like): the student reads an unlabelled batch, labels it without
    grad in train mode, reads the labelled batch, then trains on both, from step 4 on (or every
    other step). The unlabelled batch's stretch holds only the call without grad (its training
    comes after the next read), but it is trained on: training, no evaluation, its samples the
    step's. One such batch between training reads had been taken for an evaluation (eval 0.163 s,
    the labelling steps' samples 8 for 16); an evaluation reads two batches or more in a row.
    Truth: the loop's own batches trained on each step."""
    torch.manual_seed(0)
    model = truth.SleepyNet()
    opt = truth.SleepySGD(model.parameters(), lr=0.01)
    labelled = torch.utils.data.DataLoader(truth.Regression(), batch_size=BATCH, collate_fn=truth.sleepy_collate)
    unlabelled = torch.utils.data.DataLoader(truth.Regression(), batch_size=BATCH, collate_fn=truth.sleepy_collate)
    trained: list[int] = []
    with tp.profile(steps=STEPS + 3, warmup=WARMUP, name="self-training", progress=False, clock_hz=0) as prof:
        il, iu = iter(labelled), iter(unlabelled)
        for step in range(WARMUP + STEPS + 3):  # (a loop that ends with the slice)
            pseudo = step >= from_step if from_step else step % 2 == 0
            if pseudo:
                u, _ = next(iu)
                with torch.no_grad():
                    target = model(u)  # the student labels its own batch, in train mode
            x, y = next(il)
            loss = F.mse_loss(model(x), y)
            if pseudo:
                loss = loss + F.mse_loss(model(u), target)
            loss.backward()
            opt.step()
            opt.zero_grad()
            trained.append(2 * BATCH if pseudo else BATCH)
    run = prof.run
    assert run.steps["samples"].tolist() == trained[: len(run.steps)]
    assert float(run.steps["eval_s"].sum()) == 0.0 and run.meta.get("evaluation") is None


def test_an_evaluation_without_model_eval():
    """``with torch.no_grad():`` over a validation DataLoader every few steps, no ``model.eval()``
    (nothing in the model depends on the mode, as many small loops write it), a metric (20 ms)
    between the calls. The calls are in train mode, but the validation loader's batches feed no
    forward with grad: it is evaluation, read as with ``model.eval()``. Counted as training,
    eval_s had read 0, the validation's forwards were forward_s, and its batches the step's
    samples (8 + 32 after every third step). Truth: the loop's clocks."""
    torch.manual_seed(0)
    model = truth.SleepyNet()
    opt = truth.SleepySGD(model.parameters(), lr=0.01)
    train, val = train_and_val()
    clock: dict[str, float] = defaultdict(float)
    evals = 0
    with tp.profile(steps=STEPS, warmup=WARMUP, name="no-eval-mode", progress=False, clock_hz=0) as prof:
        it = iter(train)
        for step in range(N):
            t = time.perf_counter()
            x, y = next(it)
            clock["data_wait"] += time.perf_counter() - t
            t = time.perf_counter()
            loss = F.mse_loss(model(x), y)
            clock["forward"] += time.perf_counter() - t
            loss.backward()
            opt.step()
            opt.zero_grad()
            if step % EVERY == EVERY - 1:
                with torch.no_grad():  # and no model.eval()
                    t = time.perf_counter()
                    for k, (vx, vy) in enumerate(val):
                        F.mse_loss(model(vx), vy)
                        evals += 1
                        if k == 1:
                            break
                        time.sleep(0.02)  # the metric
                    clock["eval"] += time.perf_counter() - t
    run = prof.run
    assert (run.steps["samples"] == BATCH).all(), run.steps["samples"].tolist()
    close(float(run.steps["eval_s"].sum()), clock["eval"], "eval (its waits, its calls, the metric between)")
    close(float(run.steps["forward_s"].sum()), clock["forward"], "forward (training calls)")
    close(float(run.steps["data_wait_s"].sum()), clock["data_wait"], "data_wait (training batches)")
    assert run.meta["evaluation"] == {"calls": evals, "helper_calls": 0, "batches": evals,
                                      "samples": evals * EVAL_BATCH, "runs": {}}
    m = run.steps[~run.steps["warmup"]]
    assert run.summary().throughput == pytest.approx(BATCH * len(m) / m["duration_s"].sum())


def test_generate_in_train_mode_on_validation_prompts():
    """A GPT-2 trained in a plain loop; every few steps ``generate()`` on prompts from a
    validation DataLoader, the model left in train mode (no ``model.eval()``; generate() runs
    under no_grad). Its model calls and the waits for its prompts are eval, as in eval mode:
    they had been forward and data_wait (eval_s 0), the prompts the step's samples (12 for 4),
    and the verdict COMPUTE-BOUND with the evaluation inside. Truth: the loop's clocks; the
    model's calls by grad mode (forward hooks)."""
    truth.import_transformers()
    model = truth.tiny_gpt2()
    calls = CallClock(model)
    opt = truth.SleepyAdamW(model.parameters(), lr=1e-3)
    train = torch.utils.data.DataLoader(truth.Tokens(), batch_size=4, collate_fn=truth.sleepy_collate)
    val = torch.utils.data.DataLoader(torch.utils.data.Subset(truth.Tokens(), range(8)), batch_size=4,
                                      collate_fn=truth.sleepy_collate)
    clock: dict[str, float] = defaultdict(float)
    evaluations = 0
    with tp.profile(steps=STEPS, warmup=WARMUP, name="generate-train-mode", progress=False, clock_hz=0) as prof:
        for step, batch in zip(range(N), train):
            model(**batch).loss.backward()
            opt.step()
            opt.zero_grad()
            if step % EVERY == EVERY - 1:
                t = time.perf_counter()
                for prompts in val:
                    ids = prompts["input_ids"][:, :8]
                    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                                   pad_token_id=0)
                clock["eval"] += time.perf_counter() - t
                evaluations += 1
    run = prof.run
    assert (run.steps["samples"] == 4).all(), run.steps["samples"].tolist()
    close(float(run.steps["eval_s"].sum()), clock["eval"], "eval (the prompts' waits and generate())")
    close(float(run.steps["forward_s"].sum()), calls.seconds["train"], "forward (training calls)")
    assert run.meta["evaluation"]["calls"] == calls.calls["eval"] == 2 * 3 * evaluations, run.meta["evaluation"]
    assert run.meta["evaluation"]["batches"] == 2 * evaluations, run.meta["evaluation"]


def test_evaluating_the_model_inside_its_wrapper():
    """Trained through a wrapper (DataParallel here; DDP and torch.compile's wrapper alike),
    evaluated by calling the model inside it."""
    torch.manual_seed(0)
    model = truth.SleepyNet()
    wrapped = torch.nn.DataParallel(model)  # no GPU: it calls the model in this thread
    opt = truth.SleepySGD(model.parameters(), lr=0.01)
    x, y = torch.randn(BATCH, 8), torch.randn(BATCH, 1)
    with tp.profile(steps=STEPS, warmup=WARMUP, name="wrapped", progress=False, clock_hz=0) as prof:
        for _ in range(N):
            F.mse_loss(wrapped(x), y).backward()
            opt.step()
            opt.zero_grad()
            model.eval()
            with torch.no_grad():
                model(x)
            model.train()
    # each after its step: the last one comes after the slice's last step, not the slice's
    assert prof.run.meta["evaluation"]["calls"] == N - 1
    assert float(prof.run.steps["eval_s"].sum()) >= (N - 1) * truth.FORWARD_S



@pytest.mark.filterwarnings("ignore:Dynamo does not know how to trace")  # (SleepyNet reads a clock)
def test_evaluating_through_a_compiled_wrapper_of_the_eagerly_trained_model():
    """Trained eagerly, evaluated through ``eval_model = torch.compile(model)`` (compiled for
    evaluation before the slice) on held validation tensors (no loader: no batch of its own to
    tell it by): the wrapper is the trained model. Its calls had been the steps' forward (eval_s 0
    for 0.49 s of evaluation, forward 5x its truth). Truth: the loop's clocks around the training
    forward and around each evaluation."""
    torch.manual_seed(0)
    model = truth.SleepyNet()
    eval_model = torch.compile(model, backend="eager")
    opt = truth.SleepySGD(model.parameters(), lr=0.01)
    train, _ = train_and_val()
    held = [torch.randn(EVAL_BATCH, 8) for _ in range(2)]

    def evaluate() -> float:
        model.eval()
        with torch.no_grad():
            t = time.perf_counter()
            for vx in held:
                eval_model(vx)
            seconds = time.perf_counter() - t
        model.train()
        return seconds

    evaluate()  # its compilation for evaluation, before the slice
    clock: dict[str, float] = defaultdict(float)
    with tp.profile(steps=STEPS, warmup=WARMUP, name="eval-wrapper", progress=False, clock_hz=0) as prof:
        for step, (x, y) in enumerate(train):
            t = time.perf_counter()
            out = model(x)
            clock["forward"] += time.perf_counter() - t
            F.mse_loss(out, y).backward()
            opt.step()
            opt.zero_grad()
            if step % EVERY == EVERY - 1 and step < N - 1:  # (one after the slice's last step is no step's)
                clock["eval"] += evaluate()
    run = prof.run
    assert len(run.steps) == N and run.steps["compile_s"].sum() == 0
    close(float(run.steps["eval_s"].sum()), clock["eval"], "eval (the wrapper's calls)")
    close(float(run.steps["forward_s"].sum()), clock["forward"], "forward (training)")
    assert run.meta["evaluation"]["calls"] == 2 * len(range(EVERY - 1, N - 1, EVERY))


class EncoderDecoder(torch.nn.Module):
    """Trained whole; evaluated part by part, as ``generate()`` runs an encoder once and its
    decoder token by token."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder, self.decoder = truth.SleepyNet(), torch.nn.Linear(1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))


def test_evaluating_the_parts_of_the_trained_model():
    """Calls of the trained model's parts on their own, without grad in eval mode, are its
    evaluation: the batch read for them is not the step's (it was: 24 samples a step for 8)."""
    torch.manual_seed(0)
    model = EncoderDecoder()
    opt = truth.SleepySGD(model.parameters(), lr=0.01)
    train = torch.utils.data.DataLoader(truth.Regression(), batch_size=BATCH)
    val = torch.utils.data.DataLoader(truth.Regression(), batch_size=EVAL_BATCH)
    with tp.profile(steps=STEPS, warmup=WARMUP, name="parts", progress=False, clock_hz=0) as prof:
        for x, y in train:
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            model.eval()
            with torch.no_grad():
                vx, _ = next(iter(val))
                h = model.encoder(vx)
                for _ in range(3):  # token by token
                    h = model.decoder(h)
            model.train()
    run = prof.run
    assert (run.steps["samples"] == BATCH).all(), run.steps["samples"].tolist()
    # each after its step: the last one comes after the slice's last step, not the slice's
    assert run.meta["evaluation"]["calls"] == 4 * (N - 1)
    assert float(run.steps["eval_s"].sum()) >= (N - 1) * truth.FORWARD_S
    assert float(run.steps["forward_s"].sum()) < (N + 1) * truth.FORWARD_S * (1 + TOLERANCE)


class SleepyMetric(torch.nn.Module):
    """A metric as a module without parameters (a running sum in a buffer, as torchmetrics
    keeps its state), sleeping ``SLEEP_S`` a call: known time that is the evaluation's."""

    SLEEP_S = 0.005

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("total", torch.zeros(()))

    def forward(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        time.sleep(self.SLEEP_S)
        err = F.mse_loss(out, y)
        self.total += err
        return err


def test_loss_and_metric_modules_of_an_evaluation():
    """The loop's loss is a module (``nn.MSELoss()``, never put in eval mode) that training and
    evaluation share, and evaluation also calls a metric module. Called without grad right after
    an evaluation call, both are the evaluation's: its batches are still not the steps' samples
    (they were: 40 samples a step instead of 8) and their time is eval. The same loss called
    without grad in a training step (a figure for the log) stays the step's forward."""
    torch.manual_seed(0)
    model, loss_fn, metric = truth.SleepyNet(), torch.nn.MSELoss(), SleepyMetric()
    opt = truth.SleepySGD(model.parameters(), lr=0.01)
    train, val = train_and_val()
    clock: dict[str, float] = defaultdict(float)
    evals = 0
    with tp.profile(steps=STEPS, warmup=WARMUP, name="loss-modules", progress=False, clock_hz=0) as prof:
        it = iter(train)
        for step in range(N):
            x, y = next(it)
            t = time.perf_counter()
            out = model(x)
            loss = loss_fn(out, y)
            with torch.no_grad():  # a figure for the log: part of the step
                metric(out, y)
            clock["forward"] += time.perf_counter() - t
            loss.backward()
            opt.step()
            opt.zero_grad()
            if step % EVERY == EVERY - 1:
                model.eval()
                with torch.no_grad():
                    t = time.perf_counter()
                    for k, (vx, vy) in enumerate(val):
                        vout = model(vx)
                        loss_fn(vout, vy)
                        metric(vout, vy)
                        if k == 1:
                            break
                    clock["eval"] += time.perf_counter() - t
                model.train()
                evals += 2
    run = prof.run
    assert run.meta["evaluation"] == {"calls": evals, "helper_calls": 2 * evals, "batches": evals,
                                      "samples": evals * EVAL_BATCH, "runs": {}}
    assert (run.steps["samples"] == BATCH).all(), run.steps["samples"].tolist()
    close(float(run.steps["eval_s"].sum()), clock["eval"], "eval (model, loss and metric calls, batches)")
    close(float(run.steps["forward_s"].sum()), clock["forward"], "forward (with the logged metric)")
    assert any(f"{2 * evals} call(s) of a loss or metric" in n for n in run.meta["notes"]), run.meta["notes"]


def test_a_torchmetrics_metric_called_in_a_training_step_is_not_the_forward():
    """``train_mae(out, y)`` in every training step, torchmetrics' documented form (an update,
    and a compute on the batch), is the metric's work, not the model's forward: its time is
    other (``metric_call`` spans), and a note says how much. A metric whose compute sleeps 40 ms
    had been counted as forward (forward_s 527 ms for the model's 113) and the verdict read
    COMPUTE-BOUND. Its output carries grad (a differentiable metric on the model's output) and
    is only logged; a metric module the backward runs through (``MeanSquaredError`` as the loss)
    is part of computing the loss: forward, as a loss module's. Truth: the loop's clocks."""
    torchmetrics = pytest.importorskip("torchmetrics")
    torch.manual_seed(0)
    model, loss_fn, train_mae = truth.SleepyNet(), torchmetrics.MeanSquaredError(), truth.sleepy_torchmetric(torchmetrics)
    opt = truth.SleepySGD(model.parameters(), lr=0.01)
    train, _ = train_and_val()
    clock: dict[str, float] = defaultdict(float)
    logged: list[float] = []
    with tp.profile(steps=STEPS, warmup=WARMUP, name="metric-in-step", progress=False, clock_hz=0) as prof:
        for x, y in train:
            t = time.perf_counter()
            loss = loss_fn(model(x), y)
            t1 = time.perf_counter()
            mae = train_mae(model.lin(x), y)  # (the model's output again, with no sleep: the metric's input)
            t2 = time.perf_counter()
            clock["forward"] += t1 - t
            clock["metric"] += t2 - t1
            logged.append(float(mae.detach()))
            loss.backward()
            opt.step()
            opt.zero_grad()
    run = prof.run
    assert len(logged) == N and len(run.steps) == N
    spans = run.spans
    metric = spans[spans["phase"] == "metric_call"]
    assert set(metric["source"]) == {"SleepyMAE"} and len(metric) == N, metric
    close(float(metric["duration_s"].sum()), clock["metric"], "metric_call spans (train_mae(out, y))")
    close(float(run.steps["forward_s"].sum()), clock["forward"], "forward (the model, and the loss made by a metric)")
    assert len(spans[(spans["phase"] == "forward") & (spans["source"] == "MeanSquaredError")]) == N
    assert float(run.steps["other_s"].sum()) >= clock["metric"] * (1 - TOLERANCE)
    assert run.summary().verdict.kind != "compute-bound"
    said = [n for n in run.meta["notes"] if n.startswith(f"metric modules were called {STEPS} time(s) in the measured steps")]
    assert said and "counted in other, not forward" in said[0], run.meta["notes"]


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_an_ema_teacher_evaluated_on_validation_batches(mode):
    """BYOL / DINO style: the teacher is an EMA copy of the student, never called with grad. On
    the training batch (its targets) it is the step's forward; evaluated on validation batches
    (eval mode, no grad, batches that feed no training forward) it is evaluation: its calls and
    batches had been forward, data_wait and samples (+32% forward, 16 samples a step for 8).
    The evaluation loop breaks at the top (``if k == 2: break``): the third batch it reads is
    dropped, and its wait is the evaluation's too (it had been the next step's data_wait).
    ``train``: the copy left in train mode (``AveragedModel(model)`` copies the student's mode,
    and the loop puts only the student in eval mode), as a trained model evaluated without
    ``model.eval()`` is: its calls on a validation loader's batches had stayed forward and the
    batches the steps' samples (24 a step for 8), with no note."""
    torch.manual_seed(0)
    model, teacher = truth.SleepyNet(), truth.SleepyNet().train(mode == "train")
    teacher.load_state_dict(model.state_dict())
    opt = truth.SleepySGD(model.parameters(), lr=0.01)
    train, val = train_and_val()
    clock: dict[str, float] = defaultdict(float)
    evals = 0
    with tp.profile(steps=STEPS, warmup=WARMUP, name="ema-teacher", progress=False, clock_hz=0) as prof:
        it = iter(train)
        for step in range(N):
            t = time.perf_counter()
            x, y = next(it)
            clock["data_wait"] += time.perf_counter() - t
            t = time.perf_counter()
            with torch.no_grad():
                target = teacher(x)  # the teacher's view: part of the step
            loss = F.mse_loss(model(x), y) + F.mse_loss(model(x), target)
            clock["forward"] += time.perf_counter() - t
            loss.backward()
            opt.step()
            opt.zero_grad()
            with torch.no_grad():  # the EMA update
                for pt, ps in zip(teacher.parameters(), model.parameters()):
                    pt.mul_(0.9).add_(ps, alpha=0.1)
            if step % EVERY == EVERY - 1:
                t = time.perf_counter()
                with torch.no_grad():
                    for k, (vx, vy) in enumerate(val):
                        if k == 2:
                            break
                        F.mse_loss(teacher(vx), vy)
                        evals += 1
                clock["eval"] += time.perf_counter() - t
    run = prof.run
    close(float(run.steps["eval_s"].sum()), clock["eval"], "eval (the teacher's calls and 3 batches read)")
    close(float(run.steps["forward_s"].sum()), clock["forward"], "forward (the teacher's targets included)")
    close(float(run.steps["data_wait_s"].sum()), clock["data_wait"], "data_wait (training batches)")
    assert (run.steps["samples"] == BATCH).all(), run.steps["samples"].tolist()
    reads = 3 * (N // EVERY)
    assert run.meta["evaluation"] == {"calls": evals, "helper_calls": 0, "batches": reads,
                                      "samples": reads * EVAL_BATCH, "runs": {}}


@pytest.mark.parametrize("labeller", ["teacher", "student"])
def test_a_mean_teacher_labelling_its_own_batch_is_training(labeller):
    """Mean Teacher: each step reads an unlabelled batch, the frozen teacher (eval mode, no grad)
    makes its targets, then the labelled batch is read and the student trains on both. The
    teacher's batch feeds no forward with grad before the next batch is read, but such batches
    come in every step: training (they had been taken as the teacher's evaluation, its forward
    and wait eval and 8 samples a step lost). So where the student labels it itself, in train
    mode without grad (pseudo-labels on a batch of their own)."""
    torch.manual_seed(0)
    model, teacher = truth.SleepyNet(), truth.SleepyNet().eval()
    if labeller == "student":
        teacher = model
    opt = truth.SleepySGD(model.parameters(), lr=0.01)
    lab = torch.utils.data.DataLoader(truth.Regression(), batch_size=BATCH, collate_fn=truth.sleepy_collate)
    unlab = torch.utils.data.DataLoader(truth.Regression(), batch_size=BATCH, collate_fn=truth.sleepy_collate)
    clock: dict[str, float] = defaultdict(float)
    with tp.profile(steps=STEPS, warmup=WARMUP, name="mean-teacher", progress=False, clock_hz=0) as prof:
        il, iu = iter(lab), iter(unlab)
        for _ in range(N):
            t = time.perf_counter()
            u, _ = next(iu)
            clock["data_wait"] += time.perf_counter() - t
            t = time.perf_counter()
            with torch.no_grad():
                targets = teacher(u)
            clock["forward"] += time.perf_counter() - t
            t = time.perf_counter()
            x, y = next(il)
            clock["data_wait"] += time.perf_counter() - t
            t = time.perf_counter()
            loss = F.mse_loss(model(x), y) + F.mse_loss(model(u), targets)
            clock["forward"] += time.perf_counter() - t
            loss.backward()
            opt.step()
            opt.zero_grad()
    run = prof.run
    assert float(run.steps["eval_s"].sum()) == 0 and "evaluation" not in run.meta
    assert (run.steps["samples"] == 2 * BATCH).all(), run.steps["samples"].tolist()
    close(float(run.steps["forward_s"].sum()), clock["forward"], "forward (the teacher's targets included)")
    close(float(run.steps["data_wait_s"].sum()), clock["data_wait"], "data_wait (both batches)")


def test_batches_gathered_before_one_forward_after_an_evaluation_stay_training():
    """A step that reads two batches and trains on both at once: the first one's stretch holds
    no call. Right after an evaluation it is still training (it had been taken as a batch the
    evaluation read and dropped, chaining: 8 samples in a step for 16): only a batch from the
    evaluation's own iterator is."""
    torch.manual_seed(0)
    model = truth.SleepyNet()
    opt = truth.SleepySGD(model.parameters(), lr=0.01)
    train, val = train_and_val()
    with tp.profile(steps=STEPS, warmup=WARMUP, name="gathered", progress=False, clock_hz=0) as prof:
        it = iter(train)
        for step in range(N):
            (x1, y1), (x2, y2) = next(it), next(it)
            F.mse_loss(model(torch.cat([x1, x2])), torch.cat([y1, y2])).backward()
            opt.step()
            opt.zero_grad()
            if step % EVERY == EVERY - 1:
                evaluate_two(model, val)
    run = prof.run
    assert (run.steps["samples"] == 2 * BATCH).all(), run.steps["samples"].tolist()
    assert run.meta["evaluation"]["batches"] == 2 * (N // EVERY)



@pytest.mark.parametrize("every", [1, EVERY])
def test_an_evaluation_after_the_steps_batch_was_read(every):
    """``for x, y in train: if ...: evaluate(); train on x``: the evaluation's last batch's
    stretch runs on into the step's training forward. Its samples and its wait are the
    evaluation's (the step read 8 + 16 samples for 8, the wait was data_wait); the training
    batch, read before, keeps its own."""
    torch.manual_seed(0)
    model = truth.SleepyNet()
    opt = truth.SleepySGD(model.parameters(), lr=0.01)
    train, val = train_and_val()
    clock: dict[str, float] = defaultdict(float)
    with tp.profile(steps=STEPS, warmup=WARMUP, name="top-eval", progress=False, clock_hz=0) as prof:
        it = iter(train)
        for step in range(N):
            t = time.perf_counter()
            x, y = next(it)
            clock["data_wait"] += time.perf_counter() - t
            if step % every == 0:
                clock["eval"] += evaluate_two(model, val)
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    run = prof.run
    assert (run.steps["samples"] == BATCH).all(), run.steps["samples"].tolist()
    evaluations = len(range(0, N, every))
    assert run.meta["evaluation"]["batches"] == 2 * evaluations
    close(float(run.steps["data_wait_s"].sum()), clock["data_wait"], "data_wait (training batches)")
    close(float(run.steps["eval_s"].sum()), clock["eval"], "eval (its model calls and its batches)")


#: What the evaluation's metric ``compute()`` sleeps, after its last model call.
COMPUTE_S = 0.060


@pytest.mark.parametrize("where", ["after the optimizer step", "after the step's batch was read"])
def test_an_evaluations_metric_compute_after_its_last_call_is_eval(where):
    """``evaluate()``: ``model.eval()``, no grad, the model on every batch of a validation loader
    (two, then its end), then its metric's ``compute()`` (COMPUTE_S), ``model.train()``. The time
    after its last call, up to the loop's next training work (the next training batch's wait, or
    the forward with grad on the batch read before it), is eval: it had been training's other, and
    the verdict's speed-up and the "outside every phase" of its recommendations had read it as
    training (eval_s 184 ms of a 357 ms evaluate(), 170 ms of metric compute in other, "up to 1.58x"
    for 3.48x). Truth: the loop's clock around the whole ``evaluate()``."""
    torch.manual_seed(0)
    model = truth.SleepyNet()
    opt = truth.SleepySGD(model.parameters(), lr=0.01)
    train = train_and_val()[0]
    val = torch.utils.data.DataLoader(torch.utils.data.Subset(truth.Regression(), range(2 * EVAL_BATCH)),
                                      batch_size=EVAL_BATCH, collate_fn=truth.sleepy_collate)
    clock: dict[str, float] = defaultdict(float)

    def evaluate() -> None:
        t = time.perf_counter()
        model.eval()
        with torch.no_grad():
            losses = [F.mse_loss(model(vx), vy) for vx, vy in val]
        time.sleep(COMPUTE_S)  # the metric's compute(), after the last call
        float(torch.stack(losses).mean())
        model.train()
        clock["eval"] += time.perf_counter() - t

    top = where == "after the step's batch was read"
    evaluated = [s for s in range(N) if (s % EVERY == 0 if top else s % EVERY == EVERY - 1 and s < N - 1)]
    with tp.profile(steps=STEPS, warmup=WARMUP, name="eval-tail", progress=False, clock_hz=0) as prof:
        it = iter(train)
        for step in range(N):
            x, y = next(it)
            if top and step in evaluated:
                evaluate()
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            if not top and step in evaluated:  # none after the last step: it would be in none
                evaluate()
    run = prof.run
    assert run.meta["evaluation"]["batches"] == 2 * len(evaluated)
    close(float(run.steps["eval_s"].sum()), clock["eval"], "eval (evaluate() whole)")
    # the compute is no longer training's other: what is left there is the loop's own
    assert float(run.steps["other_s"].sum()) < 0.25 * COMPUTE_S * len(evaluated), run.steps["other_s"].tolist()
    assert (run.spans["source"] == "after an evaluation's last call").sum() == len(evaluated)
    note = next(n for n in run.meta["notes"] if n.startswith("evaluation ran inside the slice"))
    assert ("so is the time after an evaluation's last call up to the loop's next training work (the next "
            "training batch's wait, a forward with grad, a backward, an optimizer step, the step's end) where the "
            f"evaluation read its batches ({len(evaluated)} stretch(es)") in note, note



#: What the loop's own work after an evaluation sleeps (a tracker upload, a log shipped).
UPLOAD_S = 0.050


@pytest.mark.parametrize("after", ["tp.phase", "torch.save", "torch.jit.trace"])
def test_the_loops_own_work_after_an_evaluation_ends_its_tail(after):
    """After ``evaluate()`` (two validation batches, its metric's compute, ``model.train()``) the
    loop does work of its own before the next step: a tracker upload inside
    ``tp.phase("upload")``, as the notes advise, or a checkpoint ``torch.save`` followed by an
    unwrapped upload, or a ``torch.jit.trace`` (TensorBoard's ``add_graph``) followed by one. That
    work ends the evaluation's tail (a user's phase around each of its batches, closing right
    after its last call, does not: the compute after it is eval): the user's phase keeps its time
    (the tail had covered it, a user phase takes none from a built-in span: eval ~2x the evaluation's
    clock, and "upload" named nowhere), and after a save the loop's upload is other, not eval. A
    collection (``gc.collect()``) in the tail before it is cut out of the tail: the collector's,
    other. Truth: the loop's clock around ``evaluate()``, the upload's known sleep."""
    import gc
    import io

    torch.manual_seed(0)
    model = truth.SleepyNet()
    opt = truth.SleepySGD(model.parameters(), lr=0.01)
    train = train_and_val()[0]
    val = torch.utils.data.DataLoader(torch.utils.data.Subset(truth.Regression(), range(2 * EVAL_BATCH)),
                                      batch_size=EVAL_BATCH, collate_fn=truth.sleepy_collate)
    clock: dict[str, float] = defaultdict(float)

    def evaluate() -> None:
        t = time.perf_counter()
        model.eval()
        losses = []
        with torch.no_grad():
            for vx, vy in val:
                with tp.phase("val_batch"):  # closes right after the last call: the tail goes on
                    losses.append(F.mse_loss(model(vx), vy))
        time.sleep(0.02)  # the metric's compute(), after the last call
        float(torch.stack(losses).mean())
        model.train()
        clock["eval"] += time.perf_counter() - t

    evaluated = [s for s in range(N - 1) if s % EVERY == EVERY - 1]
    gc.freeze()  # the process's objects out of the collections: each pause is of the containers below
    young = [[] for _ in range(200_000)]  # a full collection walks these: a few ms
    try:
        with tp.profile(steps=STEPS, warmup=WARMUP, name="eval-then-upload", progress=False, clock_hz=0) as prof:
            it = iter(train)
            for step in range(N):
                x, y = next(it)
                F.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
                if step in evaluated:
                    evaluate()
                    gc.collect()
                    t = time.perf_counter()
                    if after == "tp.phase":
                        with tp.phase("upload"):
                            time.sleep(UPLOAD_S)
                    elif after == "torch.save":
                        torch.save(model.state_dict(), io.BytesIO())
                        time.sleep(UPLOAD_S)
                    else:  # TensorBoard's add_graph traces a model
                        torch.jit.trace(torch.nn.Linear(8, 1), torch.randn(2, 8))
                        time.sleep(UPLOAD_S)
                    clock["upload"] += time.perf_counter() - t
    finally:
        gc.unfreeze()
        del young
    run = prof.run
    measured = [s - WARMUP for s in evaluated if s >= WARMUP - 1]  # an evaluation falls in the next step
    assert run.meta["evaluation"]["batches"] == 2 * len(measured)
    close(float(run.steps["eval_s"].sum()), clock["eval"], "eval (evaluate() whole)")
    # the upload is the loop's own, outside every built-in phase (save's few ms aside)
    assert float(run.steps["other_s"].sum()) >= 0.9 * UPLOAD_S * len(measured), run.steps["other_s"].tolist()
    spans = run.spans
    if after == "tp.phase":
        close(float(spans.loc[spans["phase"] == "upload", "duration_s"].sum()), clock["upload"], "the user's phase")
        assert "your phase 'upload'" in run.summary().to_text()
    tails = spans[spans["source"] == "after an evaluation's last call"]
    pauses = spans[spans["phase"] == "gc"]
    assert len(tails) >= len(measured) and len(pauses) >= len(measured)
    for p in pauses.itertuples():
        assert not ((tails["start_s"] < p.end_s) & (tails["end_s"] > p.start_s)).any(), "a gc pause inside a tail"


def test_the_evaluations_metric_called_with_grad_after_its_batches_is_the_evaluations():
    """``evaluate()`` collects its predictions under ``no_grad``, then calls its torchmetrics metric
    on all of them outside that block, then ``compute()``: the metric call is the evaluation's tail,
    not the loop's own work ending it (a first version of that rule read eval 0.003 s for the
    evaluations' 0.369, OVERHEAD-BOUND "after evaluation"). Truth: the loop's clock around
    ``evaluate()``."""
    torchmetrics = pytest.importorskip("torchmetrics")

    class SlowAccuracy(torchmetrics.Metric):
        def __init__(self) -> None:
            super().__init__()
            self.add_state("hits", default=torch.tensor(0.0), dist_reduce_fx="sum")

        def update(self, pred: torch.Tensor, target: torch.Tensor) -> None:
            time.sleep(0.03)
            self.hits += (pred - target).abs().lt(1.0).float().sum()

        def compute(self) -> torch.Tensor:
            time.sleep(0.03)
            return self.hits

    torch.manual_seed(0)
    model = truth.SleepyNet()
    opt = truth.SleepySGD(model.parameters(), lr=0.01)
    train = train_and_val()[0]
    val = torch.utils.data.DataLoader(torch.utils.data.Subset(truth.Regression(), range(2 * EVAL_BATCH)),
                                      batch_size=EVAL_BATCH, collate_fn=truth.sleepy_collate)
    metric = SlowAccuracy()
    clock = {"eval": 0.0}

    def evaluate() -> None:
        t = time.perf_counter()
        model.eval()
        preds, targets = [], []
        with torch.no_grad():
            for vx, vy in val:
                preds.append(model(vx))
                targets.append(vy)
        metric(torch.cat(preds), torch.cat(targets))  # outside no_grad, on all the predictions
        float(metric.compute())
        metric.reset()
        model.train()
        clock["eval"] += time.perf_counter() - t

    evaluated = [s for s in range(N - 1) if s % EVERY == EVERY - 1]
    with tp.profile(steps=STEPS, warmup=WARMUP, name="eval-metric-after", progress=False, clock_hz=0) as prof:
        it = iter(train)
        for step in range(N):
            x, y = next(it)
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            if step in evaluated:
                evaluate()
    close(float(prof.run.steps["eval_s"].sum()), clock["eval"], "eval (evaluate() whole)")


def unseen_batches(size: int = BATCH):
    """Training batches from a plain generator tpkit does not see (no loader, no ``tp.watch``)."""
    while True:
        yield torch.randn(size, 8), torch.randn(size, 1)


def test_a_teacher_evaluated_next_to_the_student():
    """Distillation, training batches unseen: the teacher (never trained, eval mode) makes each
    step's targets; every few steps the evaluation calls the student and then the teacher on
    held validation batches (a list), a metric (20 ms) after each pair. The teacher's calls
    inside the evaluation are eval, not the step's forward (forward had read 1.7x its truth:
    they were taken for training calls, and as another forward they kept the evaluation's
    time between calls out of it); its calls for the targets stay forward. The time between the
    calls stays other: no evaluation batch was seen (the list). Truth: the loop's clocks."""
    torch.manual_seed(0)
    model, teacher = truth.SleepyNet(), truth.SleepyNet().eval()
    opt = truth.SleepySGD(model.parameters(), lr=0.01)
    held = [(torch.randn(EVAL_BATCH, 8), torch.randn(EVAL_BATCH, 1)) for _ in range(3)]
    clock: dict[str, float] = defaultdict(float)
    evaluations = 0
    with tp.profile(steps=STEPS, warmup=WARMUP, name="teacher-eval", progress=False, clock_hz=0) as prof:
        batches = unseen_batches()
        for step in range(N):
            x, y = next(batches)
            t = time.perf_counter()
            with torch.no_grad():
                target = teacher(x)
            loss = F.mse_loss(model(x), y) + F.mse_loss(model(x), target)
            clock["forward"] += time.perf_counter() - t
            loss.backward()
            if step % EVERY == EVERY - 1:
                model.eval()
                with torch.no_grad():
                    for vx, _ in held:
                        t = time.perf_counter()
                        model(vx)
                        clock["eval"] += time.perf_counter() - t
                        t = time.perf_counter()
                        teacher(vx)
                        clock["eval"] += time.perf_counter() - t
                        time.sleep(0.02)  # the metric
                model.train()
                evaluations += 1
            opt.step()
            opt.zero_grad()
    run = prof.run
    close(float(run.steps["forward_s"].sum()), clock["forward"], "forward (the teacher's targets included)")
    close(float(run.steps["eval_s"].sum()), clock["eval"], "eval (the student's and the teacher's calls)")
    assert run.meta["evaluation"]["calls"] == 6 * evaluations, run.meta["evaluation"]


def test_a_teacher_evaluated_next_to_the_student_on_validation_batches():
    """As above, the evaluation reading its batches from a validation DataLoader: everything
    from the first batch's wait to the last call is eval (it had been 0.233 s of 0.394 s: the
    teacher's calls were forward, and no time between calls was counted) but the metric after
    the last call."""
    torch.manual_seed(0)
    model, teacher = truth.SleepyNet(), truth.SleepyNet().eval()
    opt = truth.SleepySGD(model.parameters(), lr=0.01)
    _, val = train_and_val()
    clock: dict[str, float] = defaultdict(float)
    with tp.profile(steps=STEPS, warmup=WARMUP, name="teacher-val", progress=False, clock_hz=0) as prof:
        batches = unseen_batches()
        for step in range(N):
            x, y = next(batches)
            t = time.perf_counter()
            with torch.no_grad():
                target = teacher(x)
            loss = F.mse_loss(model(x), y) + F.mse_loss(model(x), target)
            clock["forward"] += time.perf_counter() - t
            loss.backward()
            if step % EVERY == EVERY - 1:
                model.eval()
                with torch.no_grad():
                    t = time.perf_counter()
                    for k, (vx, _) in enumerate(val):
                        model(vx)
                        teacher(vx)
                        if k == 2:
                            break
                        time.sleep(0.02)  # the metric
                    clock["eval"] += time.perf_counter() - t
                model.train()
            opt.step()
            opt.zero_grad()
    run = prof.run
    close(float(run.steps["forward_s"].sum()), clock["forward"], "forward (the teacher's targets included)")
    close(float(run.steps["eval_s"].sum()), clock["eval"], "eval (its waits, both models' calls, the metric)")


def test_validation_batches_are_not_trained_samples_where_the_training_batches_are_unseen():
    """Training batches from a generator tpkit does not see; every few steps an evaluation reads
    two batches from a validation DataLoader (after the step's unseen read: its last batch's
    stretch runs on into the training forward). Both are the evaluation's: its samples are no
    step's and its waits are eval (one batch an evaluation had been the step's samples, 16 a
    step, its wait data_wait, and the note said half the batches read)."""
    torch.manual_seed(0)
    model = truth.SleepyNet()
    opt = truth.SleepySGD(model.parameters(), lr=0.01)
    _, val = train_and_val()
    clock: dict[str, float] = defaultdict(float)
    with tp.profile(steps=STEPS, warmup=WARMUP, name="unseen-train", progress=False, clock_hz=0) as prof:
        batches = unseen_batches()
        for step in range(N):
            x, y = next(batches)
            if step % EVERY == 0:
                clock["eval"] += evaluate_two(model, val)
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    run = prof.run
    evaluations = len(range(0, N, EVERY))
    assert (run.steps["samples"] == 0).all(), run.steps["samples"].tolist()
    assert float(run.steps["data_wait_s"].sum()) == 0
    assert run.meta["evaluation"]["batches"] == 2 * evaluations, run.meta["evaluation"]
    assert run.meta["evaluation"]["samples"] == 2 * evaluations * EVAL_BATCH, run.meta["evaluation"]
    # no training batch was seen, as the verdict's advice reads it (the validation loader's batches
    # had counted: "no loader was seen" was silenced)
    assert run.meta["batches_seen"] == 0
    close(float(run.steps["eval_s"].sum()), clock["eval"], "eval (its model calls and its batches)")



# -- an evaluation that fetches its batches or samples between calls by itself -------------------
FETCH_S, EVAL_ITERS = 0.03, 3


def get_batch(split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """nanoGPT's ``get_batch``: random rows of a memmap, no loader; here a known sleep."""
    time.sleep(FETCH_S)
    return torch.randn(BATCH, 8), torch.randn(BATCH, 1)


@pytest.mark.parametrize("watched", [False, True], ids=["get_batch", "tp.watch(get_batch)"])
def test_an_evaluation_that_fetches_its_batches_itself(watched):
    """nanoGPT: ``estimate_loss()`` under no_grad, in eval mode, calls ``get_batch('val')`` and
    the model EVAL_ITERS times. With ``get_batch = tp.watch(get_batch)`` every fetch of the
    evaluation is eval (the time between its model calls too: it had been training's other), and
    the training fetches, nanoGPT's between forward and backward, are data_wait. Unwatched, tpkit
    sees no evaluation data: the time between its calls is like a rollout's (no batch read) and
    stays other, eval_s holds the model calls alone, and the note says to wrap the function in
    tp.watch. Truth: the loop's clocks and the model's calls by grad mode (forward hooks)."""
    fetch = tp.watch(get_batch) if watched else get_batch
    torch.manual_seed(0)
    model = truth.SleepyNet()
    calls = CallClock(model)
    opt = truth.SleepySGD(model.parameters(), lr=0.01)
    clock: dict[str, float] = defaultdict(float)

    @torch.no_grad()
    def estimate_loss() -> None:
        t0 = time.perf_counter()
        model.eval()
        for k in range(EVAL_ITERS):
            x, y = fetch("val")
            t = time.perf_counter()
            F.mse_loss(model(x), y)
            if k == 0:
                first = t
        clock["between_first_and_last_call"] += time.perf_counter() - first
        model.train()
        clock["eval"] += time.perf_counter() - t0

    with tp.profile(steps=STEPS, warmup=WARMUP, name="estimate-loss", progress=False, clock_hz=0) as prof:
        x, y = fetch("train")
        for step in range(N):
            if step % EVERY == 1:
                estimate_loss()
            loss = F.mse_loss(model(x), y)
            t = time.perf_counter()
            x, y = fetch("train")  # nanoGPT fetches the next batch before the backward
            clock["train_fetch"] += time.perf_counter() - t
            loss.backward()
            opt.step()
            opt.zero_grad()
    run = prof.run
    evaluations = len([s for s in range(N) if s % EVERY == 1])
    assert run.meta["evaluation"]["calls"] == EVAL_ITERS * evaluations
    glue = run.spans[run.spans["source"] == "between evaluation calls"]
    note = next(n for n in run.meta["notes"] if n.startswith("evaluation ran inside the slice"))
    stretches = (EVAL_ITERS - 1) * evaluations
    if watched:
        assert len(glue) == stretches
        close(float(run.steps["eval_s"].sum()), clock["eval"], "eval (estimate_loss() whole)")
        close(float(run.steps["data_wait_s"].sum()), clock["train_fetch"], "data_wait (the training fetches)")
        assert run.meta["evaluation"]["batches"] == EVAL_ITERS * evaluations
        assert (run.steps["samples"] == BATCH).all(), run.steps["samples"].tolist()
        assert f"so is the time between consecutive calls with no training work between them where the " \
               f"evaluation read its batches there ({stretches} stretch(es)" in note, note
    else:
        assert glue.empty
        close(float(run.steps["eval_s"].sum()), calls.seconds["eval"], "eval (estimate_loss()'s model calls alone)")
        other = float(run.steps["other_s"].sum())
        assert other >= clock["train_fetch"] + EVAL_ITERS * evaluations * FETCH_S, "the unseen fetches are other"
        assert f"the time between consecutive calls where no evaluation batch was read ({stretches} stretch(es)" \
               in note and "wrap the function in tp.watch" in note, note
    assert "Before an evaluation's first call" in note, note
    if watched:
        assert "so is the time after an evaluation's last call up to the loop's next training work" in note, note
    else:  # what follows the calls is left other, and the note says the verdict counts it as training
        assert f"so does the time after the last call of {evaluations} evaluation(s) that read no batch tpkit saw" \
               in note and "the verdict's and recommendations' figures then count it as training" in note, note


def _train_evaluating(train, val, name: str, metric_s: float) -> tuple:  # noqa: ANN001
    """A sleepy model trained on ``train``, evaluated on all of ``val`` every EVERY-th measured
    step (a ``metric_s`` metric after each call): the Run and the loop's clock around the
    evaluations."""
    torch.manual_seed(0)
    model = truth.SleepyNet()
    opt = truth.SleepySGD(model.parameters(), lr=0.01)
    evaluation_s = 0.0
    with tp.profile(steps=STEPS, warmup=WARMUP, name=name, progress=False, clock_hz=0) as prof:
        for step, (x, y) in enumerate(train):
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            if step % EVERY == 1 and step >= WARMUP:
                t = time.perf_counter()
                model.eval()
                with torch.no_grad():
                    for vx, vy in val:
                        F.mse_loss(model(vx), vy)
                        time.sleep(metric_s)  # the metric, between the calls
                model.train()
                evaluation_s += time.perf_counter() - t
    run = prof.run
    return run, evaluation_s


def test_a_validation_loader_split_from_the_training_dataset_by_samplers_is_evaluation_data():
    """A train/val split by samplers: the validation DataLoader reads the training loader's
    Dataset (``SubsetRandomSampler``s over one Dataset, as many tutorials split). Its batches
    are evaluation data, so the time between the evaluation's model calls (a 20 ms metric after
    each) is eval, and eval_s holds the whole evaluation. Telling sources by their Dataset, the
    two loaders were one source, which fed training batches: the metric's time read as other
    (eval_s 154 ms for 215). Truth: the loop's clock around the
    evaluation."""
    metric_s = 0.02
    data = truth.Regression()
    train = torch.utils.data.DataLoader(data, batch_size=BATCH, collate_fn=truth.sleepy_collate,
                                        sampler=torch.utils.data.SubsetRandomSampler(range(800)))
    val = torch.utils.data.DataLoader(data, batch_size=EVAL_BATCH, collate_fn=truth.sleepy_collate,
                                      sampler=torch.utils.data.SubsetRandomSampler(range(800, 848)))  # 3 batches
    run, evaluation_s = _train_evaluating(train, val, "sampler-split", metric_s)
    assert run.meta["evaluation"]["batches"] == 3 * len([s for s in range(WARMUP, N) if s % EVERY == 1])
    close(float(run.steps["eval_s"].sum()), evaluation_s, "eval (the whole evaluation, its metric too)")


def test_a_validation_loader_sharing_the_training_loaders_index_sampler_is_evaluation_data():
    """Two DataLoaders given one index sampler object (``batch_sampler=``) over different
    Datasets: fastai hands every loader's torch iterator the same ``_index_sampler`` (its
    ``_FakeLoader``'s class attribute). Keyed by that sampler alone, the validation loader was
    the training loader's source: its batches were no evaluation data and the time between the
    evaluation's calls (a 20 ms metric after each) read other. Each loader is its own source:
    eval_s holds the whole evaluation. Truth: the loop's clock around the evaluation."""
    metric_s = 0.02
    shared = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(range(8 * BATCH)), BATCH, False)
    train = torch.utils.data.DataLoader(truth.Regression(), batch_sampler=shared, collate_fn=truth.sleepy_collate)
    val = torch.utils.data.DataLoader(TensorDatasetOf(8 * BATCH), batch_sampler=shared)  # 8 batches too
    assert val._index_sampler is train._index_sampler
    run, evaluation_s = _train_evaluating(train, val, "shared-sampler", metric_s)
    assert run.meta["evaluation"]["batches"] == 8 * len([s for s in range(WARMUP, N) if s % EVERY == 1])
    close(float(run.steps["eval_s"].sum()), evaluation_s, "eval (the whole evaluation, its metric too)")


class TensorDatasetOf(torch.utils.data.TensorDataset):
    """``n`` (x (8,), y (1,)) pairs held in tensors: a Dataset other than ``truth.Regression``."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(1)
        super().__init__(torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g))


def test_a_metric_called_with_grad_keeps_no_graph_alive():
    """An evaluation written with ``model.eval()`` but no ``torch.no_grad()``, a differentiable
    torchmetrics metric called on each batch's output: tpkit keeps none of those outputs' autograd
    graphs (each holds its 1 MiB input, saved for the backward): as many are alive at the
    evaluation's end as without tpkit (the metric's own state keeps the last, if any). Holding the outputs' nodes (to tell a metric used as
    the loss) had kept 16 of 20 alive. Truth: weak references to each input."""
    import gc
    import weakref

    torchmetrics = pytest.importorskip("torchmetrics")

    def loop(alive: list[int]) -> None:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        mse = torchmetrics.MeanSquaredError()
        refs: list = []
        for step in range(WARMUP + STEPS):
            x, y = torch.randn(8, 256), torch.randn(8, 1)
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            if step == WARMUP + 1:
                model.eval()
                for _ in range(20):  # torch.no_grad() forgotten
                    vx = torch.randn(1024, 256)
                    refs.append(weakref.ref(vx))
                    mse(model(vx), torch.randn(1024, 1))
                    del vx
                gc.collect()
                alive.append(sum(r() is not None for r in refs))
                model.train()

    plain: list[int] = []
    loop(plain)
    profiled: list[int] = []
    with tp.profile(steps=STEPS, warmup=WARMUP, name="metric-graphs", progress=False, clock_hz=0, memory=False):
        loop(profiled)
    assert profiled == plain and plain[0] <= 1


def test_sampling_between_the_calls_of_generate_stays_other():
    """minGPT's callback after a step: ``generate()`` in eval mode without grad, the model called
    once a token with the sampling (argmax, cat; here 20 ms) between calls. No evaluation batch
    is read between the calls: to tpkit it is a rollout (below), and the sampling stays other,
    eval_s its model calls alone, and the note says so. Truth: the model's calls by grad mode
    (forward hooks) and the loop's clock of the sampling."""
    torch.manual_seed(0)
    model = truth.SleepyNet()
    calls = CallClock(model)
    opt = truth.SleepySGD(model.parameters(), lr=0.01)
    train, _ = train_and_val()
    clock: dict[str, float] = defaultdict(float)

    @torch.no_grad()
    def generate(x: torch.Tensor, tokens: int) -> None:
        for _ in range(tokens):
            out = model(x)
            t = time.perf_counter()
            time.sleep(0.02)  # sample the next token and append it
            clock["sampling"] += time.perf_counter() - t
            x = x + out

    with tp.profile(steps=STEPS, warmup=WARMUP, name="generate", progress=False, clock_hz=0) as prof:
        for step, (x, y) in zip(range(N), train):
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            if step % EVERY == EVERY - 1:
                model.eval()
                generate(x[:1], 3)
                model.train()
    run = prof.run
    assert not (run.spans["source"] == "between evaluation calls").any()
    close(float(run.steps["eval_s"].sum()), calls.seconds["eval"], "eval (generate's model calls alone)")
    assert float(run.steps["other_s"].sum()) >= clock["sampling"]
    note = next(n for n in run.meta["notes"] if n.startswith("evaluation ran inside the slice"))
    assert "where no evaluation batch was read (" in note and "stays other" in note, note


def test_an_rl_rollout_is_not_evaluation():
    """An RL loop: a rollout of 5 environment steps (20 ms each) calling the trained policy in
    eval mode without grad, then a training update on what it collected. No evaluation batch is
    read: the 80 ms of environment between the policy's calls are the step's other, not eval (it
    had read eval_s 0.081 s a step of 0.116, EVAL-BOUND 70%, "evaluate less often"), and the
    verdict is not EVAL-BOUND. Truth: the loop's clock of the environment, the policy's calls
    by grad mode (forward hooks)."""
    torch.manual_seed(0)
    policy = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1))
    calls = CallClock(policy)
    opt = truth.SleepySGD(policy.parameters(), lr=0.01)
    env = 0.0
    with tp.profile(steps=STEPS, warmup=WARMUP, name="rollout", progress=False, clock_hz=0) as prof:
        for _ in range(N):
            obs, seen = torch.randn(1, 8), []
            policy.eval()
            with torch.no_grad():
                for _t in range(5):
                    action = policy(obs)
                    t = time.perf_counter()
                    time.sleep(0.02)  # the environment's step
                    env += time.perf_counter() - t
                    seen.append(obs)
                    obs = torch.randn(1, 8) + 0 * action.sum()
            policy.train()
            F.mse_loss(policy(torch.cat(seen)), torch.zeros(5, 1)).backward()
            opt.step()
            opt.zero_grad()
    run = prof.run
    assert not (run.spans["source"] == "between evaluation calls").any()
    eval_s = float(run.steps["eval_s"].sum())  # the policy's calls alone (well under 1 ms each)
    assert 0 < eval_s <= calls.seconds["eval"] + 0.002 * N, (eval_s, calls.seconds["eval"])
    assert float(run.steps["other_s"].sum()) >= 0.8 * env
    assert not run.summary().verdict.text.startswith("EVAL-BOUND"), run.summary().verdict.text
    note = next(n for n in run.meta["notes"] if n.startswith("evaluation ran inside the slice"))
    assert f"where no evaluation batch was read ({4 * N} stretch(es)" in note, note


@pytest.mark.filterwarnings("ignore")  # torch.jit.trace is deprecated; the sleep is a Python call it warns about
def test_a_jit_trace_of_the_model_is_neither_forward_nor_evaluation():
    """``torch.jit.trace(model, x)`` in eval mode at one step, as TensorBoard's ``add_graph``
    (tensorboardX's, Lightning's ``log_graph=True``) does: a span of its own in other with a note,
    and its calls of the model (the trace's and its check's) no forward and no evaluation. They
    had read as an evaluation ("evaluation ran inside the slice: 2 call(s)", eval_s a few ms of
    a 72 ms add_graph) and the verdict OVERHEAD-BOUND between evaluation calls. Truth: the loop's
    clock around the trace."""
    torch.manual_seed(0)
    model = truth.SleepyNet()
    opt = truth.SleepySGD(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(truth.Regression(), batch_size=BATCH, collate_fn=truth.sleepy_collate)
    at, traced = 4, 0.0
    with tp.profile(steps=STEPS, warmup=WARMUP, name="jit-trace", progress=False, clock_hz=0) as prof:
        for i, (x, y) in enumerate(loader):
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            if i == at:  # after the step's update: the next step's
                model.eval()
                t = time.perf_counter()
                torch.jit.trace(model, x)
                traced = time.perf_counter() - t
                model.train()
    run = prof.run
    assert traced > 2 * truth.FORWARD_S  # the trace and its check each ran the forward's sleep
    steps = run.steps
    assert float(steps["eval_s"].sum()) == 0.0
    assert not any(n.startswith("evaluation ran inside the slice") for n in run.meta["notes"]), run.meta["notes"]
    k = at + 1  # the step the trace ran in (rows: the warmup's, then the measured ones)
    assert float(steps["forward_s"].iloc[k]) < 1.5 * float(steps["forward_s"].drop(index=steps.index[k]).median())
    assert float(steps["other_s"].iloc[k]) >= 0.9 * traced
    spans = run.spans[run.spans["phase"] == "jit_trace"]
    assert len(spans) == 1 and spans["source"].iloc[0] == "torch.jit.trace"
    close(float(spans["duration_s"].iloc[0]), traced, "the trace")
    note = next(n for n in run.meta["notes"] if n.startswith("torch.jit.trace ran inside the slice 1 time(s)"))
    assert f"{float(spans['duration_s'].iloc[0]):.3f} s" in note, note
    assert "evaluation" not in run.summary().verdict.text, run.summary().verdict.text


SAMPLED = re.compile(r"(\d+) call\(s\) of the trained model without grad in train mode, in (\d+) run\(s\) "
                     r"of 3 or more .*\(([\d.]+) s\), are counted as training's forward")


@pytest.mark.parametrize("how", ["train-mode", "eval-mode", "pseudo-label"])
def test_sampling_in_train_mode_is_forward_and_said(how):
    """A loop that samples from the model it trains every few updates, as diffusers'
    train_unconditional.py does: 4 denoising calls without grad in a row, no batch read, no
    backward. Left in train mode nothing tells them from an RL rollout's policy calls (training):
    they stay forward, and the run says so with their count and time and how to make them eval
    (it had said nothing: sampling read as 55% of the forward, COMPUTE-BOUND). In eval mode they
    are eval, with no such note; one call on the step's batch before training on it (a
    pseudo-label) is no run. Truth: the model's calls by grad mode (forward hooks)."""
    torch.manual_seed(0)
    model = truth.SleepyNet()
    calls = CallClock(model)
    opt = truth.SleepySGD(model.parameters(), lr=0.01)
    train, _ = train_and_val()
    with tp.profile(steps=STEPS, warmup=WARMUP, name="sampling", progress=False, clock_hz=0) as prof:
        for step, (x, y) in zip(range(N), train):
            if how == "pseudo-label":
                with torch.no_grad():
                    y = model(x)
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            if step % EVERY == EVERY - 1 and how != "pseudo-label":
                model.train(how == "train-mode")
                with torch.no_grad():
                    z = x[:2]
                    for _ in range(4):
                        z = z - 0.1 * model(z)
                model.train()
    run = prof.run
    said = [m for m in map(SAMPLED.search, run.meta["notes"]) if m]
    eval_s, forward_s = float(run.steps["eval_s"].sum()), float(run.steps["forward_s"].sum())
    if how != "train-mode":
        assert not said, run.meta["notes"]
        if how == "eval-mode":
            close(eval_s, calls.seconds["eval"], "eval (the sampling's calls)")
        return
    assert len(said) == 1 and said[0].group(1, 2) == (str(calls.calls["eval"]), "2"), run.meta["notes"]
    close(float(said[0].group(3)), calls.seconds["eval"], "the note's seconds (the sampling's calls)")
    close(forward_s, calls.seconds["train"] + calls.seconds["eval"], "forward (training and sampling)")
    assert eval_s == 0
    assert "put model.eval() or tp.phase(\"eval\") around them" in said[0].string


@pytest.mark.parametrize("made", ["before", "inside"])
def test_a_diffusion_pipelines_sampling_is_eval(made):
    """diffusers' train_unconditional.py: every few updates it samples images with a
    ``DDPMPipeline`` over the UNet it trains, left in train mode. The pipeline's ``__call__`` is
    eval whole (its denoising calls had been training's forward: 3.8 s for 1.7 s of training
    and 2.1 s of sampling), and the forward is the training's; so for a pipeline class made
    inside the slice (diffusers imports a pipeline's module at its first use). Truth: the
    loop's clock of the pipeline's call, the model's calls by grad mode (forward hooks)."""
    diffusers = pytest.importorskip("diffusers")
    pipeline_base = diffusers.DiffusionPipeline  # the loop imports diffusers' pipelines before the slice
    if made == "before":
        pipeline_class = diffusers.DDPMPipeline
    torch.manual_seed(0)
    model = diffusers.UNet2DModel(sample_size=8, in_channels=3, out_channels=3, layers_per_block=1,
                                  block_out_channels=(8, 16), down_block_types=("DownBlock2D", "DownBlock2D"),
                                  up_block_types=("UpBlock2D", "UpBlock2D"), norm_num_groups=4)
    sched = diffusers.DDPMScheduler(num_train_timesteps=100)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(torch.randn(64, 3, 8, 8), batch_size=4)
    calls = CallClock(model)
    clock = 0.0
    with tp.profile(steps=STEPS, warmup=WARMUP, name="diffusion", progress=False, clock_hz=0) as prof:
        if made == "inside":
            class Sampler(pipeline_base):  # a pipeline of the loop's own, made inside the slice
                def __init__(self, unet: torch.nn.Module, scheduler: object) -> None:
                    super().__init__()
                    self.register_modules(unet=unet, scheduler=scheduler)

                @torch.no_grad()
                def __call__(self, batch_size: int, num_inference_steps: int, **_: object) -> torch.Tensor:
                    z = torch.randn(batch_size, 3, 8, 8)
                    self.scheduler.set_timesteps(num_inference_steps)
                    for t in self.scheduler.timesteps:
                        z = self.scheduler.step(self.unet(z, t).sample, t, z).prev_sample
                    return z

                def set_progress_bar_config(self, **_: object) -> None:
                    pass

            pipeline_class = Sampler
        for step, clean in zip(range(N), loader):
            noise, ts = torch.randn_like(clean), torch.randint(0, 100, (4,))
            pred = model(sched.add_noise(clean, noise, ts), ts).sample
            F.mse_loss(pred, noise).backward()
            opt.step()
            opt.zero_grad()
            if step % EVERY == EVERY - 1 and step < N - 1:  # (after the last step's end: in no step)
                pipe = pipeline_class(unet=model, scheduler=sched)
                pipe.set_progress_bar_config(disable=True)
                t = time.perf_counter()
                pipe(batch_size=2, num_inference_steps=5, output_type="np", generator=torch.Generator().manual_seed(0))
                clock += time.perf_counter() - t
    run = prof.run
    close(float(run.steps["eval_s"].sum()), clock, "eval (the pipeline's sampling)")
    close(float(run.steps["forward_s"].sum()), calls.seconds["train"], "forward (training's calls alone)")
    assert not any(SAMPLED.search(n) for n in run.meta["notes"]), run.meta["notes"]


def test_a_metric_in_eval_mode_every_micro_batch_leaves_training_alone():
    """A loop that computes a metric with the model in eval mode without grad after each
    micro-batch's backward (two a step, gradient accumulation): between two such calls run a
    training forward and backward, so nothing between them is eval; the logging after each
    (20 ms) stays other. Truth: the model's calls by grad mode (forward hooks)."""
    torch.manual_seed(0)
    model = truth.SleepyNet()
    calls = CallClock(model)
    opt = truth.SleepySGD(model.parameters(), lr=0.01)
    train, _ = train_and_val()
    logged = 0.0
    with tp.profile(steps=STEPS, warmup=WARMUP, name="metric", progress=False, clock_hz=0) as prof:
        it = iter(train)
        for _ in range(N):
            for _micro in range(2):
                x, y = next(it)
                F.mse_loss(model(x), y).backward()
                model.eval()
                with torch.no_grad():
                    F.mse_loss(model(x), y)
                model.train()
                t = time.perf_counter()
                time.sleep(0.02)  # log the metric
                logged += time.perf_counter() - t
            opt.step()
            opt.zero_grad()
    run = prof.run
    assert not (run.spans["source"] == "between evaluation calls").any()
    close(float(run.steps["eval_s"].sum()), calls.seconds["eval"], "eval (the metric's model calls alone)")
    assert float(run.steps["other_s"].sum()) >= logged


def test_a_batch_pseudo_labelled_in_eval_mode_every_step_is_training():
    """Self-training (FixMatch written with ``model.eval()``): each step reads a labelled and an
    unlabelled batch, the model labels the unlabelled one in eval mode without grad, then trains
    on both. Every unlabelled batch has an evaluation call in its stretch, but none feeds
    evaluation alone: it is training's (its samples and wait had been taken as evaluation's:
    16 samples a step for 48)."""
    torch.manual_seed(0)
    model = truth.SleepyNet()
    opt = truth.SleepySGD(model.parameters(), lr=0.01)
    labelled, unlabelled = train_and_val()  # BATCH and EVAL_BATCH rows, both trained on here
    with tp.profile(steps=STEPS, warmup=WARMUP, name="pseudo", progress=False, clock_hz=0) as prof:
        for (xl, yl), (xu, _) in zip(labelled, unlabelled):
            model.eval()
            with torch.no_grad():
                pseudo = model(xu)
            model.train()
            (F.mse_loss(model(xl), yl) + F.mse_loss(model(xu), pseudo)).backward()
            opt.step()
            opt.zero_grad()
    run = prof.run
    assert (run.steps["samples"] == BATCH + EVAL_BATCH).all(), run.steps["samples"].tolist()
    assert run.meta.get("evaluation", {}).get("batches", 0) == 0


# -- Hugging Face Trainer -------------------------------------------------------------------
transformers = truth.import_transformers()


def test_trainer_evaluating_every_few_steps(tmp_path):
    pytest.importorskip("accelerate")
    model = truth.tiny_gpt2()
    calls = CallClock(model)
    opt = truth.SleepyAdamW(model.parameters(), lr=1e-3)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), per_device_train_batch_size=4, per_device_eval_batch_size=4, max_steps=40,
        logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True, use_cpu=True,
        dataloader_num_workers=0, seed=0, max_grad_norm=0.0, eval_strategy="steps", eval_steps=EVERY)
    eval_set = torch.utils.data.Subset(truth.Tokens(), range(8))
    trainer = transformers.Trainer(model=model, args=args, train_dataset=truth.Tokens(), eval_dataset=eval_set,
                                   data_collator=truth.sleepy_collate, optimizers=(opt, None))
    with tp.profile(steps=STEPS, warmup=WARMUP, name="hf-eval", progress=False, clock_hz=0) as prof:
        trainer.train()
    run = prof.run
    evals = [h for h in trainer.state.log_history if "eval_loss" in h]
    assert len(evals) == N // EVERY and calls.calls["eval"] == 2 * len(evals)  # 8 samples, batches of 4
    assert trainer.state.global_step == N == len(run.steps)
    assert (run.steps["samples"] == 4).all(), run.steps["samples"].tolist()
    close(float(run.steps["forward_s"].sum()), calls.seconds["train"], "forward (training calls)")
    # eval: its calls and the waits for its batches (each collate sleeps DATA_S)
    assert float(run.steps["eval_s"].sum()) >= calls.seconds["eval"] + calls.calls["eval"] * truth.DATA_S
    assert run.meta["evaluation"]["calls"] == calls.calls["eval"]
    truth.assert_losses(run.steps["loss"].tolist(), [h["loss"] for h in trainer.state.log_history if "loss" in h])



class TimedEvaluate:
    """A Trainer subclass's ``evaluate()`` timed by its caller's clock: what a user would call
    the evaluation's time (the Trainer's ``eval_runtime`` starts later, after the loader is made)."""

    seconds: list[float]

    def evaluate(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        t = time.perf_counter()
        try:
            return super().evaluate(*args, **kwargs)  # type: ignore[misc]
        finally:
            self.seconds.append(time.perf_counter() - t)


METRIC_S = 0.1


def test_trainer_evaluation_with_metrics_is_eval_whole(tmp_path):
    """``compute_metrics`` (and the gathering of predictions for it) runs inside ``evaluate()``
    but in no model call: it had been ``other`` (a 0.5 s metric read OVERHEAD-BOUND 57%). The
    Trainer's evaluation is now eval as a whole."""
    pytest.importorskip("accelerate")

    class Trainer(TimedEvaluate, transformers.Trainer):
        seconds: list[float] = []

    def metrics(_prediction) -> dict:  # noqa: ANN001
        time.sleep(METRIC_S)
        return {"n": 1}

    model = truth.tiny_gpt2()
    opt = truth.SleepyAdamW(model.parameters(), lr=1e-3)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), per_device_train_batch_size=4, per_device_eval_batch_size=4, max_steps=40,
        logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True, use_cpu=True,
        dataloader_num_workers=0, seed=0, max_grad_norm=0.0, eval_strategy="steps", eval_steps=EVERY)
    trainer = Trainer(model=model, args=args, train_dataset=truth.Tokens(),
                      eval_dataset=torch.utils.data.Subset(truth.Tokens(), range(8)),
                      data_collator=truth.sleepy_collate, optimizers=(opt, None), compute_metrics=metrics)
    with tp.profile(steps=STEPS, warmup=WARMUP, name="hf-metrics", progress=False, clock_hz=0) as prof:
        trainer.train()
    run = prof.run
    assert len(Trainer.seconds) == N // EVERY
    close(float(run.steps["eval_s"].sum()), sum(Trainer.seconds), "eval (the whole evaluate())")
    assert float(run.steps["other_s"].iloc[1:].sum()) < METRIC_S  # the first step holds the Trainer's start
    assert run.meta["evaluation"]["runs"] == {"Trainer.evaluate": N // EVERY}
    assert (run.steps["samples"] == 4).all(), run.steps["samples"].tolist()


class Pairs(torch.utils.data.Dataset):
    """Sequence-to-sequence pairs: a source of 12 tokens, a target of 8."""

    def __len__(self) -> int:
        return 1000

    def __getitem__(self, i: int) -> dict:
        x = torch.randint(2, truth.VOCAB, (12,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x.flip(0)[:8].clone()}


def test_seq2seq_evaluation_that_generates(tmp_path):
    """``predict_with_generate``: ``generate()`` calls the model's encoder on its own, a part of the
    trained model that training never calls outermost. Its calls had made each evaluation batch
    a training batch (12 samples a step for 4, the batch's wait data_wait) and its time forward."""
    pytest.importorskip("accelerate")

    class Trainer(TimedEvaluate, transformers.Seq2SeqTrainer):
        seconds: list[float] = []

    cfg = transformers.T5Config(vocab_size=truth.VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                num_decoder_layers=2, num_heads=2, decoder_start_token_id=0, pad_token_id=0,
                                eos_token_id=1)
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(cfg)
    calls = CallClock(model)
    opt = truth.SleepyAdamW(model.parameters(), lr=1e-3)
    args = transformers.Seq2SeqTrainingArguments(
        output_dir=str(tmp_path / "s2s"), per_device_train_batch_size=4, per_device_eval_batch_size=4, max_steps=40,
        logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True, use_cpu=True, dataloader_num_workers=0,
        seed=0, max_grad_norm=0.0, eval_strategy="steps", eval_steps=EVERY, predict_with_generate=True,
        generation_max_length=8)
    trainer = Trainer(model=model, args=args, train_dataset=Pairs(), eval_dataset=torch.utils.data.Subset(Pairs(), range(8)),
                      data_collator=truth.sleepy_collate, optimizers=(opt, None))
    with tp.profile(steps=STEPS, warmup=WARMUP, name="s2s", progress=False, clock_hz=0) as prof:
        trainer.train()
    run = prof.run
    assert trainer.state.global_step == N == len(run.steps)
    assert (run.steps["samples"] == 4).all(), run.steps["samples"].tolist()
    close(float(run.steps["eval_s"].sum()), sum(Trainer.seconds), "eval (evaluate(), generate() included)")
    close(float(run.steps["forward_s"].sum()), calls.seconds["train"], "forward (training calls)")
    assert float(run.steps["data_wait_s"].sum()) < (N + 1) * truth.DATA_S * (1 + TOLERANCE)  # training's batches
    truth.assert_losses(run.steps["loss"].tolist(), [h["loss"] for h in trainer.state.log_history if "loss" in h])


# -- Lightning ----------------------------------------------------------------------------------
def lightning_module(pl):  # noqa: ANN001, ANN201 - Lightning is imported by the tests that use it
    """A LightningModule around ``truth.SleepyNet`` that keeps its training losses."""

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = truth.SleepyNet()
            self.losses: list[float] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch, _):  # noqa: ANN001, ANN201
            loss = F.mse_loss(self(batch[0]), batch[1])
            self.losses.append(float(loss))
            return loss

        def validation_step(self, batch, _):  # noqa: ANN001, ANN201
            return F.mse_loss(self(batch[0]), batch[1])

        def configure_optimizers(self):  # noqa: ANN201
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return Module()


def fit_validating(pl, module, name: str):  # noqa: ANN001, ANN201
    """``trainer.fit`` under a slice, validating two batches every ``EVERY`` steps (no sanity
    check); returns the trainer and the run."""
    train = torch.utils.data.DataLoader(truth.Regression(), batch_size=BATCH)
    val = torch.utils.data.DataLoader(torch.utils.data.Subset(truth.Regression(), range(2 * EVAL_BATCH)),
                                      batch_size=EVAL_BATCH)
    trainer = pl.Trainer(max_steps=40, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, val_check_interval=EVERY,
                         num_sanity_val_steps=0)
    with tp.profile(steps=STEPS, warmup=WARMUP, name=name, progress=False, clock_hz=0) as prof:
        trainer.fit(module, train, val)
    return trainer, prof.run


def test_lightning_validating_every_few_steps():
    pl = pytest.importorskip("lightning.pytorch")
    module = lightning_module(pl)
    calls = CallClock(module)
    trainer, run = fit_validating(pl, module, "pl-eval")
    assert trainer.global_step == N == len(run.steps)
    # validations after steps 3 and 6, two batches each; none more as the fit ends (as at max_steps)
    assert run.meta["evaluation"] == {"calls": 2 * (N // EVERY), "helper_calls": 0, "batches": 2 * (N // EVERY),
                                      "samples": 2 * (N // EVERY) * EVAL_BATCH,
                                      "runs": {"_EvaluationLoop.run": N // EVERY}}
    assert (run.steps["samples"] == BATCH).all(), run.steps["samples"].tolist()
    close(float(run.steps["forward_s"].sum()), calls.seconds["train"], "forward (training calls)")
    assert float(run.steps["eval_s"].sum()) >= 2 * (N // EVERY) * truth.FORWARD_S
    truth.assert_losses(run.steps["loss"].tolist(), module.losses[:N])


def test_lightning_sanity_check_before_training_is_evaluation():
    """Lightning validates a few batches before the model's first training call: decided after
    the slice, those calls are evaluation too, and their batches are not the first step's."""
    pl = pytest.importorskip("lightning.pytorch")
    module = lightning_module(pl)
    train = torch.utils.data.DataLoader(truth.Regression(), batch_size=BATCH)
    val = torch.utils.data.DataLoader(torch.utils.data.Subset(truth.Regression(), range(2 * EVAL_BATCH)),
                                      batch_size=EVAL_BATCH)
    trainer = pl.Trainer(max_steps=40, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=2,
                         val_check_interval=100)
    with tp.profile(steps=STEPS, warmup=WARMUP, name="pl-sanity", progress=False, clock_hz=0) as prof:
        trainer.fit(module, train, val)
    run = prof.run
    assert run.meta["evaluation"] == {"calls": 2, "helper_calls": 0, "batches": 2, "samples": 2 * EVAL_BATCH,
                                      "runs": {"_EvaluationLoop.run": 1}}
    assert (run.steps["samples"] == BATCH).all(), run.steps["samples"].tolist()
    first = run.steps.iloc[0]
    assert first["eval_s"] >= 2 * truth.FORWARD_S and first["forward_s"] < 2 * truth.FORWARD_S


def test_lightning_validation_with_a_torchmetrics_metric():
    """``validation_step`` updates a torchmetrics metric, a child module of the LightningModule
    (put in eval mode with it, never trained): its calls are the validation's, and the
    validation batches still are not the steps' samples."""
    pl = pytest.importorskip("lightning.pytorch")
    torchmetrics = pytest.importorskip("torchmetrics")
    module = lightning_module(pl)
    module.val_mse = torchmetrics.MeanSquaredError()
    plain_validation = module.validation_step

    def validation_step(batch, batch_idx):  # noqa: ANN001, ANN202 - Lightning passes batch_idx by name
        module.val_mse(module(batch[0]), batch[1])
        return plain_validation(batch, batch_idx)

    module.validation_step = validation_step
    _, run = fit_validating(pl, module, "pl-metric")
    validations = 2 * (N // EVERY)  # batches, each with two model calls and one metric call
    assert run.meta["evaluation"] == {"calls": 2 * validations, "helper_calls": validations,
                                      "batches": validations, "samples": validations * EVAL_BATCH,
                                      "runs": {"_EvaluationLoop.run": N // EVERY}}
    assert (run.steps["samples"] == BATCH).all(), run.steps["samples"].tolist()
    truth.assert_losses(run.steps["loss"].tolist(), module.losses[:N])


def test_an_evaluation_inside_tp_phase_eval_is_eval_whole():
    """An evaluation over held tensors with metric work between its calls (no evaluation batch
    tpkit sees: the time between its calls stays other by itself, as an RL rollout's must):
    `with tp.phase("eval"):` around it, as the run's note says, makes all of it eval. Truth: the
    loop's clock around the evaluation (20 ms of metric work after each of its 3 calls)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(800, 8), torch.randn(800, 1)),
                                         batch_size=8)
    held = torch.randn(24, 8)
    evals: list[float] = []
    with tp.profile(steps=STEPS, warmup=WARMUP, name="phase-eval", progress=False, clock_hz=0) as prof:
        for x, y in loader:
            t = time.perf_counter()
            with tp.phase("eval"):
                model.eval()
                with torch.no_grad():
                    for chunk in held.split(8):
                        model(chunk)
                        time.sleep(0.02)
                model.train()
            evals.append(time.perf_counter() - t)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    for step, (got, want) in enumerate(zip(prof.run.steps["eval_s"], evals)):
        assert abs(got - want) <= 0.15 * want + 0.002, f"step {step}: eval {got:.4f} s, truth {want:.4f}"
