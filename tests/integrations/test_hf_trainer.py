"""Hugging Face ``Trainer`` on a tiny GPT-2 built from a config (no weights), profiled
unchanged: ``trainer.train()`` under ``tp.profile`` and under ``%%tp_profile``.

Truth: the Trainer's own ``log_history`` (``logging_steps=1``: one loss per optimizer step),
its ``state.global_step``, ``on_train_end`` having run, and the known sleeps of
``truth.tiny_gpt2`` / ``truth.sleepy_collate`` / ``truth.SleepyAdamW``.
"""

from __future__ import annotations

import time

import pytest
import torch
import truth
from IPython.utils.capture import capture_output
from truth import STEPS, WARMUP

import tpkit as tp

transformers = truth.import_transformers()
pytest.importorskip("accelerate")

BATCH = 4


class Ends(transformers.TrainerCallback):
    """What the Trainer told its callbacks."""

    def __init__(self) -> None:
        self.events: list[str] = []

    def on_train_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003
        self.events.append("train_end")


def make_trainer(tmp_path, ga: int = 1, max_steps: int = 40) -> tuple:
    model = truth.tiny_gpt2()
    opt = truth.SleepyAdamW(model.parameters(), lr=1e-3)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), per_device_train_batch_size=BATCH, gradient_accumulation_steps=ga,
        max_steps=max_steps, logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True,
        use_cpu=True, dataloader_num_workers=0, seed=0, max_grad_norm=0.0)
    ends = Ends()
    trainer = transformers.Trainer(model=model, args=args, train_dataset=truth.Tokens(),
                                   data_collator=truth.sleepy_collate, optimizers=(opt, None), callbacks=[ends])
    return trainer, ends


def logged_losses(trainer) -> list[float]:  # noqa: ANN001
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.fixture(scope="module", params=[1, 2], ids=["ga1", "ga2"])
def sliced(request, tmp_path_factory):
    """One ``trainer.train()`` under ``tp.profile(steps=5, warmup=2)`` per accumulation."""
    ga = request.param
    trainer, ends = make_trainer(tmp_path_factory.mktemp(f"ga{ga}"), ga=ga)
    before = truth.hook_state()
    t0 = time.perf_counter()
    error = None
    with tp.profile(steps=STEPS, warmup=WARMUP, name=f"hf-ga{ga}", progress=False, clock_hz=0) as prof, \
            truth.TRUTH.recording():
        try:
            trainer.train()
        except Exception as e:  # noqa: BLE001 - the Trainer's own failure is part of what is checked
            error = e
    return dict(ga=ga, run=prof.run, trainer=trainer, ends=ends, before=before, error=error,
                truth=truth.snapshot(), wall_s=time.perf_counter() - t0)


def test_trainer_runs_and_hooks_are_removed(sliced):
    assert sliced["error"] is None, sliced["error"]
    truth.assert_hooks_removed(sliced["before"])
    run = sliced["run"]
    assert len(run.steps) == STEPS + WARMUP and run.steps["warmup"].sum() == WARMUP
    assert (run.steps["samples"] == BATCH * sliced["ga"]).all()  # accelerate's one-batch lookahead not counted
    assert not any("inside backward" in note for note in run.meta["notes"])  # no checkpointing here


def test_trainer_ends_normally_after_exactly_the_slice(sliced):
    trainer, run = sliced["trainer"], sliced["run"]
    assert trainer.state.global_step == STEPS + WARMUP == len(run.steps)
    assert len(logged_losses(trainer)) == STEPS + WARMUP
    assert sliced["ends"].events == ["train_end"]
    assert run.meta["stopped_by"] == "slice" and run.complete


def test_loss_matches_log_history(sliced, request):
    """The loss per step is the Trainer's logged loss (``logging_steps=1``)."""
    logged = logged_losses(sliced["trainer"])
    got = sliced["run"].steps["loss"].tolist()[: len(logged)]
    truth.assert_losses(got, logged)


def test_loss_of_an_epochs_last_partial_accumulation_window(tmp_path):
    """Five batches an epoch with ``gradient_accumulation_steps=2``: the Trainer divides a
    window's losses by the window's own count, so the sum backpropagated in a one-batch step is
    its loss as logged, and tpkit leaves it as it is (Lightning's case: ``test_lightning.py``)."""
    trainer, _ = make_trainer(tmp_path, ga=2)
    trainer.train_dataset = torch.utils.data.Subset(truth.Tokens(), range(5 * BATCH))
    with tp.profile(steps=STEPS, warmup=WARMUP, name="hf-partial", progress=False, clock_hz=0) as prof:
        trainer.train()
    run = prof.run
    assert run.steps["samples"].tolist() == [2 * BATCH, 2 * BATCH, BATCH] * 2 + [2 * BATCH]
    truth.assert_losses(run.steps["loss"].tolist(), logged_losses(trainer)[:STEPS + WARMUP])
    assert not any("micro-batches" in n for n in run.meta["notes"])


def test_phases_match_the_truth(sliced):
    truth.assert_phases(sliced["run"], sliced["truth"])


def test_model_identified(sliced):
    model = sliced["trainer"].model
    assert sliced["run"].meta["model"]["parameters"] == sum(p.numel() for p in model.parameters())


def test_trainer_under_the_magic(ip, tmp_path):
    trainer, ends = make_trainer(tmp_path)
    ip.user_ns.update(trainer=trainer)
    before = truth.hook_state()
    with capture_output(), truth.TRUTH.recording() as known:
        ip.run_cell_magic("tp_profile", f"--steps {STEPS} --warmup {WARMUP} --name hf-magic --clock-hz 0 --quiet",
                          "trainer.train()")
    run = ip.user_ns["_tp"]
    truth.assert_hooks_removed(before)
    assert run.complete and len(run.steps) == STEPS + WARMUP
    truth.assert_phases(run, known)
    assert trainer.state.global_step == STEPS + WARMUP
    assert ends.events == ["train_end"]
    truth.assert_losses(run.steps["loss"].tolist(), logged_losses(trainer))


class SlowStart(transformers.TrainerCallback):
    """A trainer's setup of known length: 0.3 s at the start of its run."""

    def on_train_begin(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003
        time.sleep(0.3)


def test_a_sweep_of_two_trainers_in_one_slice(tmp_path):
    """A sweep's first Trainer stops at its own ``max_steps`` (3) before the slice is full and the
    next one, with an optimizer of its own, trains on: its steps are the slice's next ones (they
    ended none: the run held A's 3 steps, said A "stopped by itself", and B's 10 were missing),
    and the slice stops B through its switch. From A's last step to B's first batch (A's end, the
    cell's 0.2 s, B's setup with its 0.3 s callback) is B's first step's ``setup_s``, left out of
    the verdict (it was other: OVERHEAD-BOUND, "Python between phases")."""
    first, first_ends = make_trainer(tmp_path / "a", max_steps=3)
    second, second_ends = make_trainer(tmp_path / "b", max_steps=10)
    second.add_callback(SlowStart())
    with tp.profile(steps=STEPS, warmup=WARMUP, name="hf-sweep", progress=False, clock_hz=0) as prof:
        first.train()
        time.sleep(0.2)
        second.train()
    run = prof.run
    setup = run.steps.set_index(run.steps["step"] + WARMUP)["setup_s"]
    assert setup[3] >= 0.5 and float(run.steps["other_s"].iloc[3]) < 0.1
    assert setup[0] > 0 and (setup.drop([0, 3]) == 0).all()  # A's setup: the first step's, in warmup
    assert "a trainer's setup" in run.summary().verdict.text
    rest = STEPS + WARMUP - 3
    assert first.state.global_step == 3 and second.state.global_step == rest
    assert first_ends.events == second_ends.events == ["train_end"]
    assert len(run.steps) == STEPS + WARMUP and run.meta["stopped_through"] == "transformers.Trainer"
    truth.assert_losses(run.steps["loss"].tolist(), logged_losses(first) + logged_losses(second))
    assert any(n.startswith("the slice holds the steps of 2 runs of a trainer") for n in run.meta["notes"])
    assert not any("optimizers stepped" in n or "stopped by itself" in n for n in run.meta["notes"])


def test_a_second_train_after_the_slice_runs_as_without_tpkit(tmp_path):
    """The slice full inside the first ``train()``, the cell calls ``train()`` again: it runs to
    its own ``max_steps``, unprofiled (tpkit's StopSlice had ended it after one optimizer step,
    global_step 0, no ``on_train_end``, and skipped the rest of the cell, with no word)."""
    trainer, ends = make_trainer(tmp_path, max_steps=10)
    after = []
    before = truth.hook_state()
    with tp.profile(steps=STEPS, warmup=WARMUP, name="hf-twice", progress=False, clock_hz=0) as prof:
        trainer.train()
        truth.assert_hooks_removed(before)  # out as the stopped run returned
        trainer.train()
        after.append(trainer.state.global_step)
    assert after == [10] and ends.events == ["train_end", "train_end"]
    assert len(prof.run.steps) == STEPS + WARMUP and prof.run.meta["stopped_through"] == "transformers.Trainer"


class Stream(torch.utils.data.IterableDataset):
    """Token sequences with no ``__len__``: a Trainer wraps its loader in accelerate's
    ``DataLoaderDispatcher``, which reads one batch ahead."""

    def __iter__(self):  # noqa: ANN204
        return (Tokens_[i] for i in range(10_000))


Tokens_ = truth.Tokens()


def test_an_iterable_dataset_with_batches_of_varying_size(tmp_path):
    """Packing-style batches (2, 3, 4, 5, 2, ... rows): each step's samples are the rows its
    forward got (they were the next step's: the dispatcher's read ahead was counted as handed)."""
    sizes = iter([2, 3, 4, 5] * 50)

    def packing_collate(items: list) -> dict:
        return truth.sleepy_collate(items[:next(sizes)])

    model = truth.tiny_gpt2()
    rows: list[int] = []
    model.register_forward_pre_hook(lambda _m, _a, kw: rows.append(int(kw["input_ids"].shape[0])), with_kwargs=True)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), per_device_train_batch_size=5, max_steps=40, logging_steps=1, report_to=[],
        save_strategy="no", disable_tqdm=True, use_cpu=True, dataloader_num_workers=0, seed=0, max_grad_norm=0.0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Stream(), data_collator=packing_collate,
                                   optimizers=(truth.SleepyAdamW(model.parameters(), lr=1e-3), None))
    with tp.profile(steps=STEPS, warmup=WARMUP, name="hf-stream", progress=False, clock_hz=0) as prof:
        trainer.train()
    run = prof.run
    assert type(trainer.get_train_dataloader()).__name__ == "DataLoaderDispatcher"
    assert run.steps["samples"].tolist() == rows == [2, 3, 4, 5, 2, 3, 4]
    truth.assert_losses(run.steps["loss"].tolist(), logged_losses(trainer))


def test_tpkits_offload_optimizer_under_a_default_trainer(tmp_path):
    """``tp.offload.CPUOffloadAdamW`` given to a Trainer: the Trainer logs the gradients' norm at
    every step with ``clip_grad_norm_(params, inf)``, a rescale by exactly 1 that moved every
    gradient's version counter, and the optimizer raised GradientChangedError at the first step
    (whatever max_grad_norm). That rescale is skipped now; the losses are AdamW's."""

    def train(make_opt) -> list[float]:  # noqa: ANN001
        torch.manual_seed(0)
        model = truth.tiny_gpt2(sleepy=False)
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / "hf"), per_device_train_batch_size=BATCH, max_steps=5, logging_steps=1,
            report_to=[], save_strategy="no", disable_tqdm=True, use_cpu=True, dataloader_num_workers=0, seed=0,
            max_grad_norm=0.0)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=truth.Tokens(),
                                       optimizers=(make_opt(model.parameters()), None))
        trainer.train()
        assert all(h.get("grad_norm", 1.0) == h.get("grad_norm", 1.0) for h in trainer.state.log_history)  # logged
        return logged_losses(trainer)

    adamw = train(lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0))
    offloaded = train(lambda params: tp.offload.CPUOffloadAdamW(params, lr=1e-3, weight_decay=0.0))
    assert offloaded == pytest.approx(adamw, rel=1e-5)


def test_tpkit_keeps_no_batch_of_the_trainers_alive(tmp_path):
    """Finding the Trainer on the stack reads its frames' locals: on Python up to 3.12 that
    leaves a snapshot of them on the frame, and the epoch loop's first batch stayed alive for
    the whole slice (batches 0, k, k+1 alive at each forward for k, k+1; one batch more of data
    in every step's memory). Each forward sees only the batches the Trainer itself holds."""
    import weakref

    trainer, _ = make_trainer(tmp_path, max_steps=7)
    made: list = []

    def collate(items):  # noqa: ANN001, ANN202
        batch = truth.sleepy_collate(items)
        made.append(weakref.ref(batch["input_ids"]))
        return batch

    trainer.data_collator = collate
    alive: list[list[int]] = []
    trainer.model.register_forward_pre_hook(lambda *_: alive.append([i for i, r in enumerate(made) if r() is not None]))
    with tp.profile(steps=STEPS, warmup=WARMUP, name="alive", progress=False, clock_hz=0):
        trainer.train()
    assert alive[2:] == [[k, k + 1] for k in range(2, len(alive))], alive


def test_auto_find_batch_size_trying_again_inside_the_slice(tmp_path):
    """``auto_find_batch_size``: an out-of-memory error at the first attempt's 4th step makes
    accelerate run the training loop again at a smaller batch (7 for 8), inside one train().
    The slice holds the steps of both runs and says so; the failed step's batch and loss are no
    step's (the next step had 15 samples for 7, and a note called it a skipped update)."""
    trainer, _ = make_trainer(tmp_path)
    trainer.args.auto_find_batch_size = True
    trainer.args.per_device_train_batch_size = trainer._train_batch_size = 8
    batches = {"n": 0}
    rows: list[int] = []

    def collate(items):  # noqa: ANN001, ANN202
        batches["n"] += 1
        if batches["n"] == 4 and len(items) == 8:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return truth.sleepy_collate(items)

    trainer.data_collator = collate
    trainer.model.register_forward_pre_hook(lambda _m, _a, kw: rows.append(int(kw["input_ids"].shape[0])),
                                            with_kwargs=True)
    with tp.profile(steps=STEPS, warmup=WARMUP, name="retry", progress=False, clock_hz=0) as prof:
        trainer.train()
    run = prof.run
    first = rows.count(8)  # the first attempt's steps (the Trainer reads ahead: the error comes before its 3rd)
    assert first >= 1 and rows == [8] * first + [7] * (STEPS + WARMUP - first), rows
    assert run.steps["samples"].tolist() == rows
    losses = logged_losses(trainer)  # the retry's log (the failed attempt's are logged before)
    assert run.steps["loss"].tolist()[first:] == pytest.approx(losses[-(STEPS + WARMUP - first):], rel=1e-5)
    notes = run.meta["notes"]
    assert any("auto_find_batch_size trying again" in n for n in notes), notes
    assert not any("skipped" in n for n in notes), notes


def test_a_locals_dict_the_loop_holds_is_left_as_it_is():
    """Finding the trainer reads each frame's locals and empties the snapshot it leaves; a dict
    the code itself holds (``config = locals()``: in Python 3.11 the very same dict) is never
    emptied (it read {} after the slice)."""

    class Experiment:
        def run(self, lr: float = 0.01, epochs: int = 1) -> dict:
            config = locals()
            model = torch.nn.Linear(8, 1)
            opt = torch.optim.SGD(model.parameters(), lr=lr)
            with tp.profile(steps=2, warmup=0, name="locals", progress=False, clock_hz=0):
                for _ in range(5):
                    model(torch.randn(4, 8)).pow(2).mean().backward()
                    opt.step()
                    opt.zero_grad()
            return config

    config = Experiment().run()
    assert config["lr"] == 0.01 and config["epochs"] == 1, config
