"""Lightning ``Trainer.fit`` profiled unchanged, automatic optimization (Lightning's default:
``training_step`` runs inside ``optimizer.step(closure)``) and manual optimization (the same
model, stepping itself), under ``tp.profile``, under ``%%tp_profile`` in IPython's shell, and
in a real kernel.

Truth: the self-timed parts of ``truth`` (forward, backward, the optimizer's own work, the
collation), the loss each ``training_step`` returned (recorded by a callback), the trainer's
``global_step``, and its end state (``TrainerStatus.FINISHED``, ``on_train_end`` called,
``on_exception`` not).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
import torch
import torch.nn.functional as F
import truth
from IPython.utils.capture import capture_output
from truth import STEPS, WARMUP

import tpkit as tp

L = pytest.importorskip("lightning")

BATCH = 4


class Model(L.LightningModule):
    def __init__(self, manual: bool = False) -> None:
        super().__init__()
        self.net = truth.SleepyNet()
        self.automatic_optimization = not manual

    def training_step(self, batch, batch_idx):  # noqa: ANN001
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
        return loss

    def configure_optimizers(self):
        return truth.SleepySGD(self.parameters(), lr=0.01)


class Record(L.Callback):
    """The loss Lightning logged for every batch (``self.log("train_loss", ...)``; not
    ``outputs["loss"]``, which Lightning has divided by ``accumulate_grad_batches``) and the end
    hooks the trainer called."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.events: list[str] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # noqa: ANN001
        self.losses.append(float(trainer.callback_metrics["train_loss"]))

    def on_train_end(self, trainer, pl_module):  # noqa: ANN001
        self.events.append("train_end")

    def on_exception(self, trainer, pl_module, exception):  # noqa: ANN001
        self.events.append(f"exception {type(exception).__name__}")


def make(manual: bool = False, max_steps: int = 40, ga: int = 1) -> tuple:
    torch.manual_seed(0)
    model, record = Model(manual), Record()
    trainer = L.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        log_every_n_steps=1, callbacks=[record], num_sanity_val_steps=0,
                        accumulate_grad_batches=ga)
    loader = torch.utils.data.DataLoader(truth.Regression(), batch_size=BATCH, collate_fn=truth.sleepy_collate)
    return trainer, model, loader, record


@pytest.fixture(scope="module", params=["automatic", "manual", "automatic-ga2"])
def sliced(request):
    """``fit()`` under ``tp.profile``; ``automatic-ga2``: ``accumulate_grad_batches=2`` (Lightning
    divides each micro-batch's loss by 2 before its backward)."""
    manual = request.param == "manual"
    ga = 2 if request.param.endswith("ga2") else 1
    trainer, model, loader, record = make(manual, ga=ga)
    before = truth.hook_state()
    error = None
    with tp.profile(steps=STEPS, warmup=WARMUP, name=f"pl-{request.param}", progress=False, clock_hz=0) as prof, \
            truth.TRUTH.recording():
        try:
            trainer.fit(model, loader)
        except Exception as e:  # noqa: BLE001
            error = e
    losses = record.losses  # one per micro-batch: the step's loss is their mean
    step_losses = [sum(losses[i:i + ga]) / ga for i in range(0, len(losses), ga)]
    return dict(manual=manual, ga=ga, run=prof.run, trainer=trainer, model=model, record=record, before=before,
                error=error, truth=truth.snapshot(), step_losses=step_losses)


def test_loss_of_an_epochs_last_partial_accumulation_window():
    """Five batches an epoch with ``accumulate_grad_batches=2``: every third step is one
    micro-batch, which Lightning still divides by 2 before its backward. The step's loss is the
    window's mean loss (what Lightning logs), not half of it, and the run says why."""
    trainer, model, loader, record = make(ga=2)
    windows: list[int] = []  # the optimizer step each micro-batch belongs to

    class Window(L.Callback):
        def on_train_batch_start(self, trainer, *_):  # noqa: ANN001
            windows.append(trainer.global_step)

    trainer.callbacks.append(Window())
    loader = torch.utils.data.DataLoader(torch.utils.data.Subset(truth.Regression(), range(5 * BATCH)),
                                         batch_size=BATCH, collate_fn=truth.sleepy_collate)
    with tp.profile(steps=STEPS, warmup=WARMUP, name="pl-partial", progress=False, clock_hz=0) as prof:
        trainer.fit(model, loader)
    run = prof.run
    by_step: dict[int, list[float]] = {}
    for step, loss in zip(windows, record.losses):
        by_step.setdefault(step, []).append(loss)
    means = [sum(v) / len(v) for _, v in sorted(by_step.items())]
    assert [len(v) for _, v in sorted(by_step.items())][:6] == [2, 2, 1, 2, 2, 1]  # the partial windows
    truth.assert_losses(run.steps["loss"].tolist(), means[:STEPS + WARMUP])
    assert (run.steps["samples"] == [2 * BATCH, 2 * BATCH, BATCH] * 2 + [2 * BATCH]).all()
    assert any(n.startswith("2 step(s) had fewer micro-batches than the 2 that Lightning (accumulate_grad_batches=2)")
               for n in run.meta["notes"]), run.meta["notes"]


def test_fit_runs_and_hooks_are_removed(sliced):
    assert sliced["error"] is None, sliced["error"]
    truth.assert_hooks_removed(sliced["before"])
    run = sliced["run"]
    assert len(run.steps) == STEPS + WARMUP and run.complete
    assert (run.steps["samples"] == BATCH * sliced["ga"]).all()


def test_loss_matches_training_step(sliced):
    truth.assert_losses(sliced["run"].steps["loss"].tolist(), sliced["step_losses"])


def test_fit_ends_normally_after_exactly_the_slice(sliced):
    trainer, record = sliced["trainer"], sliced["record"]
    assert trainer.global_step == STEPS + WARMUP
    assert trainer.state.status == L.pytorch.trainer.states.TrainerStatus.FINISHED
    assert record.events == ["train_end"]
    assert len(record.losses) == sliced["ga"] * (STEPS + WARMUP)


def test_phases_match_the_truth(sliced):
    truth.assert_phases(sliced["run"], sliced["truth"])


def test_model_identified(sliced):
    assert sliced["run"].meta["model"]["parameters"] == sum(p.numel() for p in sliced["model"].parameters())


def test_verdict_follows_the_truth(sliced):
    """Forward (30 ms) outweighs the optimizer's own work (10 ms): never OPTIMIZER-BOUND."""
    s = sliced["run"].summary()
    assert s.phase_share["optimizer_s"] < s.phase_share["forward_s"]
    assert s.verdict.kind != "optimizer-bound"


def test_fit_under_the_magic(ip):
    trainer, model, loader, record = make(manual=True)
    ip.user_ns.update(trainer=trainer, model=model, loader=loader)
    before = truth.hook_state()
    with capture_output(), truth.TRUTH.recording() as known:
        ip.run_cell_magic("tp_profile", f"--steps {STEPS} --warmup {WARMUP} --name pl-magic --clock-hz 0 --quiet",
                          "trainer.fit(model, loader)")
    run = ip.user_ns["_tp"]
    truth.assert_hooks_removed(before)
    assert run.complete and len(run.steps) == STEPS + WARMUP
    truth.assert_phases(run, known)
    assert trainer.state.status == L.pytorch.trainer.states.TrainerStatus.FINISHED
    assert trainer.global_step == STEPS + WARMUP
    assert record.events == ["train_end"]


KERNEL_CELLS = [
    f"import sys; sys.path.insert(0, {truth.HERE!r})\n"
    "%load_ext tpkit\nimport tpkit as tp\nimport test_lightning as t\n"
    "trainer, model, loader, record = t.make(manual=False)",
    f"%%tp_profile --steps {STEPS} --warmup {WARMUP} --name pl-kernel --clock-hz 0\ntrainer.fit(model, loader)",
    "print(len(_tp.steps), _tp.complete, trainer.global_step, trainer.state.status.name, record.events)",
]


@pytest.mark.slow
def test_fit_under_the_magic_in_a_real_kernel():
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in KERNEL_CELLS])
    NotebookClient(nb, timeout=180, kernel_name="python3", allow_errors=True).execute()
    errors = [o for c in nb.cells for o in c.outputs if o.get("output_type") == "error"]
    assert not errors, [(e["ename"], e["evalue"]) for e in errors]
    shown = [o for o in nb.cells[1].outputs if o.get("output_type") == "display_data"
             and "tpkit run 'pl-kernel'" in o["data"].get("text/plain", "")]
    assert len(shown) == 1 and "text/plain" in shown[0]["data"]
    assert nb.cells[2].outputs[0]["text"].strip() == f"{STEPS + WARMUP} True {STEPS + WARMUP} FINISHED ['train_end']"


def test_sigterm_mid_fit_ends_as_lightning_ends_it_and_the_run_is_kept(tmp_path):
    """Lightning puts its own SIGTERM handler over tpkit's at fit and ends the fit its own way;
    under a slice it ends the same (the same exit code, nothing after fit runs), and the run of
    the steps before is kept."""
    child = Path(__file__).with_name("lightning_sigterm_child.py")
    ends = {}
    for mode in ("plain", "tpkit"):
        out = subprocess.run([sys.executable, str(child), mode, str(tmp_path / mode)], capture_output=True,
                             text=True, timeout=180, cwd=tmp_path)
        ends[mode] = (out.returncode, "after fit" in out.stdout)
    assert ends["tpkit"] == ends["plain"], ends
    run = tp.load(str(tmp_path / "tpkit" / "pl-sigterm"))
    assert len(run.steps) == 4 and not run.complete


class Validations(L.Callback):
    """How many validation loops ran, and at which global step."""

    def __init__(self) -> None:
        self.at: list[int] = []

    def on_validation_start(self, trainer, pl_module):  # noqa: ANN001
        self.at.append(trainer.global_step)


class Validating(Model):
    def validation_step(self, batch, batch_idx):  # noqa: ANN001
        loss = F.mse_loss(self.net(batch[0]), batch[1])
        self.log("val_loss", loss)
        return loss


@pytest.mark.parametrize("limit", ["min_epochs", "min_steps", "validation"])
def test_the_slice_ends_the_fit_as_its_max_steps_would(limit):
    """The slice full, the fit ends as at ``max_steps`` = the slice's steps, without tpkit:
    - with ``min_epochs`` / ``min_steps`` not yet met, Lightning refuses ``should_stop`` (its early
      stop): tpkit's StopSlice had then ended the fit INTERRUPTED, with ``on_exception``;
    - with a validation set, an early stop first runs one more whole validation (minutes on a real
      one); a fit that reaches its ``max_steps`` between validations runs none.
    The trainer's own ``max_steps`` is back once the slice is over."""
    limits = {"min_epochs": dict(min_epochs=1), "min_steps": dict(min_steps=20), "validation": {}}[limit]
    N = STEPS + WARMUP
    val = torch.utils.data.DataLoader(torch.utils.data.Subset(truth.Regression(), range(8)), batch_size=BATCH)

    def fit(max_steps: int, profiled: bool) -> tuple:
        torch.manual_seed(0)
        model, record, validations = Validating(), Record(), Validations()
        trainer = L.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            callbacks=[record, validations], num_sanity_val_steps=0, val_check_interval=100,
                            **limits)
        loader = torch.utils.data.DataLoader(truth.Regression(), batch_size=BATCH)
        if not profiled:
            trainer.fit(model, loader, val)
            return trainer, record, validations, None
        with tp.profile(steps=STEPS, warmup=WARMUP, name=f"pl-{limit}", progress=False, clock_hz=0) as prof:
            trainer.fit(model, loader, val)
        return trainer, record, validations, prof.run

    plain, plain_record, plain_validations, _ = fit(N, profiled=False)
    trainer, record, validations, run = fit(40, profiled=True)
    assert plain.state.status.value == "finished" and plain.global_step == N
    assert trainer.state.status.value == "finished", record.events
    assert record.events == plain_record.events == ["train_end"]
    assert trainer.global_step == N == len(run.steps)
    assert validations.at == plain_validations.at == []
    assert run.meta["stopped_through"] == "lightning.Trainer"
    assert trainer.fit_loop.max_steps == 40


def test_validate_with_steps_marked_runs_to_its_end():
    """``trainer.validate`` with ``tp.step()`` at each batch's end: outside ``fit`` Lightning has
    no switch that ends it early, so the slice ends and the validation runs on, unprofiled, to
    its own end and results (StopSlice had ended it INTERRUPTED, returning nothing). The probes
    come out inside the step's own listeners there, and none is put back by a listener after the
    slice's (the compile probe's had put dynamo's compile callbacks back in, left behind)."""
    import torch._dynamo  # noqa: F401 - imported as in a process that compiled before: the compile probe attaches

    from tpkit.capture import recorder

    active: list[bool] = []

    class Step(L.Callback):
        def on_validation_batch_end(self, *_):  # noqa: ANN002
            tp.step()
            active.append(recorder.active() is not None)

    def validate() -> tuple:
        torch.manual_seed(0)
        model, record = Validating(), Record()
        trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, callbacks=[record, Step()])
        val = torch.utils.data.DataLoader(torch.utils.data.Subset(truth.Regression(), range(40)), batch_size=BATCH)
        return trainer, record, trainer.validate(model, val)

    _, _, plain = validate()
    before = truth.hook_state()
    with tp.profile(steps=3, warmup=1, name="pl-validate", progress=False, clock_hz=0) as prof:
        trainer, record, results = validate()
    truth.assert_hooks_removed(before)
    assert trainer.state.status.value == "finished" and record.events == []
    assert results == plain and "val_loss" in results[0]
    assert len(prof.run.steps) == 4
    # the probes came out as the slice ended: nothing recorded while validate ran on
    assert active[-10:] == [True, True, True, False] + [False] * 6
    assert any(n.startswith("the slice ended after 4 steps; lightning.Trainer runs on") for n in prof.run.meta["notes"])


def test_a_training_step_that_returns_none_is_said():
    """Lightning skips the backward and the update of a batch whose ``training_step`` returns None
    (and, with automatic optimization, still steps: the closure returns no loss). That step's loss
    reads NaN, and the run says why."""
    class Skipping(Model):
        def training_step(self, batch, batch_idx):  # noqa: ANN001
            return None if batch_idx == 3 else super().training_step(batch, batch_idx)

    torch.manual_seed(0)
    trainer, _, loader, record = make()
    with tp.profile(steps=STEPS, warmup=WARMUP, name="pl-none", progress=False, clock_hz=0) as prof:
        trainer.fit(Skipping(), loader)
    losses = prof.run.steps["loss"]
    assert losses.isna().sum() == 1, losses.tolist()
    assert any(n.startswith("1 step(s) had no loss go through backward") for n in prof.run.meta["notes"])


def test_a_fit_that_ends_before_the_slice_is_full_is_said_to_have_stopped_by_itself():
    trainer, model, loader, record = make(max_steps=4)
    with tp.profile(steps=STEPS, warmup=WARMUP, name="pl-short", progress=False, clock_hz=0) as prof:
        trainer.fit(model, loader)
    run = prof.run
    assert len(run.steps) == trainer.global_step == 4 and run.meta["stopped_by"] == "loop_end"
    assert any(n.startswith("lightning.Trainer stopped by itself (its max_steps, max_time, early stopping or a "
                            "callback) after 4 steps, before the slice was full") for n in run.meta["notes"])


def test_a_validation_after_the_last_step_is_in_no_step_and_not_said_to_be():
    """``max_epochs=1`` with fewer batches than the slice: Lightning validates at the epoch's end,
    after the last step, so no step holds any of it. The run had still noted "evaluation ran inside
    the slice: 0 call(s) ... 0.000 s in all", and ``meta["evaluation"]`` read all zeros. Truth:
    Lightning's own count of steps and of validations, and where they ran."""
    torch.manual_seed(0)
    model, record, validations = Validating(), Record(), Validations()
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[record, validations],
                        num_sanity_val_steps=0)
    loader = torch.utils.data.DataLoader(torch.utils.data.Subset(truth.Regression(), range(4 * BATCH)),
                                         batch_size=BATCH)
    val = torch.utils.data.DataLoader(torch.utils.data.Subset(truth.Regression(), range(2 * BATCH)), batch_size=BATCH)
    with tp.profile(steps=STEPS, warmup=WARMUP, name="pl-last-validation", progress=False, clock_hz=0) as prof:
        trainer.fit(model, loader, val)
    run = prof.run
    assert trainer.global_step == 4 == len(run.steps) < STEPS + WARMUP
    assert validations.at == [4]  # after the 4th and last step
    assert run.steps["eval_s"].sum() == 0
    assert "evaluation" not in run.meta
    assert not any(n.startswith("evaluation ran inside the slice") for n in run.meta["notes"]), run.meta["notes"]


def test_steps_marked_with_tp_step_in_a_callback_end_the_fit_as_max_steps_would():
    """``tp.step()`` in ``on_train_batch_end``: Lightning has counted the step by then, so the fit
    stops after exactly the slice's steps (one more had been trained, and StopSlice then
    interrupted the fit)."""
    class Step(L.Callback):
        def on_train_batch_end(self, *_):  # noqa: ANN002
            tp.step()

    trainer, model, loader, record = make()
    trainer.callbacks.append(Step())
    with tp.profile(steps=STEPS, warmup=WARMUP, name="pl-tpstep", progress=False, clock_hz=0) as prof:
        trainer.fit(model, loader)
    assert trainer.state.status.value == "finished" and record.events == ["train_end"]
    assert trainer.global_step == STEPS + WARMUP == len(prof.run.steps)


class Tunable(Model):
    def __init__(self) -> None:
        super().__init__()
        self.lr = 0.01

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def test_a_learning_rate_search_before_the_fit_is_not_the_slice():
    """``Tuner(trainer).lr_find(model)`` then ``fit``, in one profile. The search trains steps of
    its own at a rising learning rate: they had been the slice's, tpkit's stop ended the search
    after them (Lightning read a diverging loss and suggested no rate: the fit trained at 0.01
    instead of its suggestion), and the search's own ``max_steps`` stayed on the trainer (a later
    fit ran 100 steps). The search runs unprofiled now, as without tpkit; the slice is the fit's."""
    from lightning.pytorch.tuner import Tuner

    N = STEPS + WARMUP

    def search_and_fit(profiled: bool) -> tuple:
        torch.manual_seed(0)
        model = Tunable()
        trainer = L.Trainer(max_steps=40, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
        loader = torch.utils.data.DataLoader(truth.Regression(), batch_size=BATCH)
        if not profiled:
            found = Tuner(trainer).lr_find(model, loader, num_training=20, min_lr=1e-4, max_lr=1.0)
            return trainer, model, found, None
        with tp.profile(steps=STEPS, warmup=WARMUP, name="pl-lr-find", progress=False, clock_hz=0) as prof:
            found = Tuner(trainer).lr_find(model, loader, num_training=20, min_lr=1e-4, max_lr=1.0)
            trainer.fit(model, loader)
        return trainer, model, found, prof.run

    _, plain_model, plain_found, _ = search_and_fit(profiled=False)
    trainer, model, found, run = search_and_fit(profiled=True)
    assert found.results["lr"] == plain_found.results["lr"] and len(found.results["lr"]) == 20
    assert found.suggestion() == plain_found.suggestion() and model.lr == plain_model.lr != 0.01
    assert trainer.global_step == N == len(run.steps) and trainer.state.status.value == "finished"
    assert trainer.fit_loop.max_steps == 40
    assert run.meta["stopped_through"] == "lightning.Trainer"
    assert any(n.startswith("lightning's lr_find ran inside the slice") for n in run.meta["notes"]), run.meta["notes"]


class CtrlC(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # noqa: ANN001
        if trainer.global_step == 3:
            os.kill(os.getpid(), signal.SIGINT)


def test_ctrl_c_in_a_fit_is_an_interrupt():
    """Lightning ends a fit interrupted by Ctrl-C with ``sys.exit(1)``, raised while it handles
    the KeyboardInterrupt: the run says it was interrupted (it said "error", SystemExit: 1), and
    keeps the 3 steps Lightning counted."""
    trainer, model, loader, _ = make(max_steps=40)
    trainer.callbacks.append(CtrlC())
    before = truth.hook_state()
    with pytest.raises(SystemExit), tp.profile(steps=STEPS, warmup=WARMUP, name="pl-ctrl-c", progress=False,
                                               clock_hz=0) as prof:
        trainer.fit(model, loader)
    truth.assert_hooks_removed(before)
    assert trainer.interrupted and trainer.global_step == 3 == len(prof.run.steps)
    assert prof.run.meta["stopped_by"] == "interrupt" and not prof.run.meta["complete"]



@pytest.mark.parametrize("where", ["loop", "loop-by-name", "lightning"])
def test_gradient_clipping_is_optimizer_time(where, monkeypatch):
    """Clipping is part of the update: its time is optimizer (it had been other, which read as
    "Python between phases"; inside Lightning's closure too), also where the loop bound
    ``clip_grad_norm_`` by name before the slice. Truth: torch's own total-norm half of it made
    to sleep a known 20 ms a call, and the optimizer's known sleep."""
    from torch.nn.utils import clip_grad, clip_grad_norm_  # bound before the slice

    total_norm = clip_grad._get_total_norm

    def slow_total_norm(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        with truth.timed("optimizer"):
            time.sleep(0.02)
            return total_norm(*args, **kwargs)

    monkeypatch.setattr(clip_grad, "_get_total_norm", slow_total_norm)
    trainer, model, loader, _ = make(max_steps=40)
    if where == "lightning":
        trainer.gradient_clip_val = 1.0
        trainer.gradient_clip_algorithm = "norm"
    with tp.profile(steps=STEPS, warmup=WARMUP, name=f"clip-{where}", progress=False, clock_hz=0) as prof, \
            truth.TRUTH.recording() as known:
        if where == "lightning":
            trainer.fit(model, loader)
        else:
            opt = model.configure_optimizers()
            for x, y in loader:
                F.mse_loss(model.net(x), y).backward()
                if where == "loop-by-name":
                    clip_grad_norm_(model.parameters(), 1.0)
                else:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad()
    assert known.calls["optimizer"] >= 2 * (STEPS + WARMUP)  # the optimizer's sleeps and the clips'
    truth.assert_phases(prof.run, known, phases=("optimizer",))


class OwnClipping(Model):
    """A ``configure_gradient_clipping`` override with known work (20 ms a call), which then
    clips through Lightning (``self.clip_gradients``) or does not clip at all."""

    def __init__(self, clips: bool) -> None:
        super().__init__()
        self.clips = clips

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None,  # noqa: ANN001
                                    gradient_clip_algorithm=None) -> None:  # noqa: ANN001
        with truth.timed("optimizer"):
            time.sleep(0.02)
        if self.clips:
            self.clip_gradients(optimizer, gradient_clip_val=0.5, gradient_clip_algorithm="norm")


@pytest.mark.parametrize("clips", [True, False], ids=["clips", "only-its-own-work"])
def test_an_overridden_configure_gradient_clipping_is_optimizer_time(clips):
    """Lightning calls the module's ``configure_gradient_clipping`` inside the closure it passes to
    ``optimizer.step``, after backward: the whole hook is the update's (it had been other: optimizer
    read 81-86 ms of 233-240, other 23-26 ms a step against 2.5). Truth: the hook's known sleep and
    the optimizer's."""
    trainer, _, loader, record = make(max_steps=40)
    torch.manual_seed(0)
    model = OwnClipping(clips)
    with tp.profile(steps=STEPS, warmup=WARMUP, name="pl-own-clip", progress=False, clock_hz=0) as prof, \
            truth.TRUTH.recording() as known:
        trainer.fit(model, loader)
    assert known.calls["optimizer"] == 2 * (STEPS + WARMUP)  # the optimizer's sleeps and the hook's
    truth.assert_phases(prof.run, known, phases=("optimizer", "forward", "backward"))
    truth.assert_losses(prof.run.steps["loss"].tolist(), record.losses[:STEPS + WARMUP])


@torch.library.custom_op("tpkit_test::sleep_forward", mutates_args=())
def _sleep_forward(x: torch.Tensor) -> torch.Tensor:
    """A known forward cost that torch.compile keeps as one opaque op (no graph break)."""
    with truth.timed("forward"):
        time.sleep(truth.FORWARD_S)
        return x.clone()


@_sleep_forward.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class CompiledWhole(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):  # noqa: ANN001
        x, y = batch
        return F.mse_loss(truth.sleep_backward(self.lin(_sleep_forward(x))), y)

    def configure_optimizers(self):
        return truth.SleepySGD(self.parameters(), lr=0.01)


def test_a_lightning_module_compiled_whole_has_its_forward():
    """``trainer.fit(torch.compile(module))``, Lightning's documented way: Lightning compiles the
    module's ``training_step``, so no module call is seen; the compiled step is the forward (it
    read forward 0, the time other, and a note blaming a functional model)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    trainer = L.Trainer(max_steps=40, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    loader = torch.utils.data.DataLoader(truth.Regression(), batch_size=BATCH, collate_fn=truth.sleepy_collate)
    with tp.profile(steps=STEPS, warmup=WARMUP, name="pl-compiled", progress=False, clock_hz=0) as prof, \
            truth.TRUTH.recording() as known:
        trainer.fit(torch.compile(CompiledWhole(), backend="eager"), loader)
    run = prof.run
    assert trainer.global_step == STEPS + WARMUP == len(run.steps)
    measured = run.steps.iloc[1:]  # the first step compiles
    calls = len(measured)
    assert float(measured["forward_s"].sum()) == pytest.approx(calls * truth.FORWARD_S, rel=truth.TOLERANCE)
    assert known.calls["forward"] == STEPS + WARMUP
    assert not any("not called as an nn.Module" in n or "no module's forward" in n for n in run.meta["notes"])


class Stream(torch.utils.data.IterableDataset):
    """Regression samples with no ``__len__``: Lightning's fetcher reads one batch ahead."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):  # noqa: ANN204
        data = truth.Regression()
        return (data[i] for i in range(self.n))


def test_an_iterable_dataset_with_validation_counts_each_steps_batch():
    """Over an ``IterableDataset`` Lightning reads one batch ahead (to know the epoch's end):
    each step's samples are its own batch's (each epoch read 2, 1, 1, 0 batches a step)."""
    torch.manual_seed(0)
    trainer = L.Trainer(max_epochs=3, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    train = torch.utils.data.DataLoader(Stream(4 * BATCH), batch_size=BATCH)  # 4 steps an epoch
    val = torch.utils.data.DataLoader(Stream(2 * BATCH), batch_size=BATCH)
    with tp.profile(steps=10, warmup=0, name="pl-stream", progress=False, clock_hz=0) as prof:
        trainer.fit(Validating(), train, val)
    run = prof.run
    assert trainer.global_step == 10 == len(run.steps)
    assert (run.steps["samples"] == BATCH).all(), run.steps["samples"].tolist()
    assert run.meta["evaluation"]["batches"] == 2 * 2  # the validations after epochs 1 and 2


class Metered(Model):
    """``training_step`` computes a torchmetrics metric the documented way,
    ``self.train_mae(out, y)`` and ``self.log("train_mae", self.train_mae)``, and clocks the
    model's call and the metric's."""

    def __init__(self, torchmetrics: object) -> None:
        super().__init__()
        self.train_mae = truth.sleepy_torchmetric(torchmetrics)
        self.clock: dict[str, float] = {"forward": 0.0, "metric": 0.0}

    def training_step(self, batch, batch_idx):  # noqa: ANN001
        x, y = batch
        t = time.perf_counter()
        out = self.net(x)
        t1 = time.perf_counter()
        self.train_mae(out, y)
        t2 = time.perf_counter()
        self.clock["forward"] += t1 - t
        self.clock["metric"] += t2 - t1
        self.log("train_mae", self.train_mae)
        loss = F.mse_loss(out, y)
        self.log("train_loss", loss)
        return loss


def test_a_torchmetrics_metric_in_training_step_is_not_the_forward():
    """A metric whose compute sleeps 40 ms, called in ``training_step`` (an update and a compute
    on the batch): its time is other, not forward (it had been the model's forward, the verdict
    COMPUTE-BOUND), and the run says how much. Truth: ``training_step``'s clocks."""
    torchmetrics = pytest.importorskip("torchmetrics")
    trainer, _, loader, record = make()
    model = Metered(torchmetrics)
    with tp.profile(steps=STEPS, warmup=WARMUP, name="pl-metric", progress=False, clock_hz=0) as prof:
        trainer.fit(model, loader)
    run = prof.run
    assert trainer.global_step == STEPS + WARMUP == len(run.steps)
    truth.assert_losses(run.steps["loss"].tolist(), record.losses)
    metric = run.spans[run.spans["phase"] == "metric_call"]
    assert len(metric) == STEPS + WARMUP and set(metric["source"]) == {"SleepyMAE"}, metric
    assert float(metric["duration_s"].sum()) == pytest.approx(model.clock["metric"], rel=truth.TOLERANCE)
    assert float(run.steps["forward_s"].sum()) == pytest.approx(model.clock["forward"], rel=truth.TOLERANCE)
    assert float(run.steps["other_s"].sum()) >= model.clock["metric"] * (1 - truth.TOLERANCE)
    assert run.summary().verdict.kind != "compute-bound"
    assert any(n.startswith(f"metric modules were called {STEPS} time(s) in the measured steps (SleepyMAE")
               for n in run.meta["notes"]), run.meta["notes"]
