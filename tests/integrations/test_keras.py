"""Keras 3 on the torch backend, its own ``model.fit`` unchanged under ``tp.profile``.

A Keras optimizer is no ``torch.optim.Optimizer`` (its update runs ``torch._foreach`` ops on the
variables' tensors; probes/keras_optimizers.py): unseen, ``fit`` recorded no step at all ("in a
loop without an optimizer, call tp.step()"), and with ``tp.step()`` in a callback the update read
other (0.5 ms of 1.04 s) and its variables other memory (optimizer_state 0 of 1,060,888 B), under
an OVERHEAD-BOUND verdict. Its checkpoints (``ModelCheckpoint``: h5py, a zip) never pass through
``torch.save``: save_s read 0.

Truth: Keras's own counters and logs (``optimizer.iterations``, the running mean loss it hands
its callbacks, the History of the same fit stopped at the same batch without tpkit), clocks
around the optimizer's ``apply`` and the model's ``save_weights``, and the bytes of the
optimizer's variables.
"""

from __future__ import annotations

import os
import time

import pytest

os.environ.setdefault("KERAS_BACKEND", "torch")  # read once, at Keras's first import
keras = pytest.importorskip("keras")
if keras.backend.backend() != "torch":
    pytest.skip("Keras was imported with another backend", allow_module_level=True)

import numpy as np  # noqa: E402
import truth  # noqa: E402
from truth import TOLERANCE  # noqa: E402

import tpkit as tp  # noqa: E402

BATCH, BATCHES = 32, 8  # batches an epoch
STEPS, WARMUP = 10, 2
SLEEP_S = 0.03  # inside the optimizer's update


def data() -> tuple[np.ndarray, np.ndarray]:
    x = np.random.default_rng(0).standard_normal((BATCH * BATCHES, 64)).astype("float32")
    return x, (x[:, 0] > 0).astype("int64")


def model(optimizer: object) -> keras.Model:
    keras.utils.set_random_seed(1)
    m = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"), keras.layers.Dense(2)])
    m.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return m


class Logged(keras.callbacks.Callback):
    """Keras's own per-batch log: the epoch's running mean loss, and where to stop a fit."""

    def __init__(self, stop_after: int | None = None) -> None:
        super().__init__()
        self.means: list[float] = []
        self.stop_after = stop_after

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.means.append(float(logs["loss"]))
        if self.stop_after is not None and len(self.means) == self.stop_after:
            self.model.stop_training = True


def test_fit_steps_are_its_batches_losses_and_history_unchanged() -> None:
    """``model.fit`` with no tp.step(): a step per batch, ended by the Keras optimizer's update; the
    loss per step Keras's; the slice ends the fit through ``stop_training`` (History returned), and
    that History is the one the same fit stopped at the same batch gives without tpkit."""
    x, y = data()
    n = STEPS + WARMUP  # 12 of 16 batches: the slice ends the fit in its second epoch
    plain, log = model(keras.optimizers.Adam(1e-3)), Logged(stop_after=n)
    want = plain.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, shuffle=False, callbacks=[log]).history

    m, got_log = model(keras.optimizers.Adam(1e-3)), Logged()
    before = truth.hook_state()
    with tp.profile(steps=STEPS, warmup=WARMUP, progress=False) as prof:
        history = m.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, shuffle=False, callbacks=[got_log]).history
    truth.assert_hooks_removed(before)
    run = prof.run
    assert len(run.steps) == n == int(m.optimizer.iterations.numpy())
    assert run.meta.get("stopped_through") == "keras.Model"
    assert history == want  # nothing in Keras's results changed
    assert got_log.means == log.means
    assert m.stop_training is False  # tpkit's stop, read by the fit, is not left on the model
    # Keras logs the epoch's running mean: tpkit's loss per step, averaged the same way
    losses = run.steps.loss.tolist()
    means = [float(np.mean(losses[i - i % BATCHES: i + 1])) for i in range(n)]
    truth.assert_losses(means, log.means, rel=1e-5)


class SlowAdam(keras.optimizers.Adam):
    """A user's optimizer extending the update (defined before the slice), with its own clock."""

    clock: list[float] = []

    def apply(self, grads, trainable_variables=None):  # noqa: ANN001, ANN201
        t = time.perf_counter()
        out = super().apply(grads, trainable_variables)
        time.sleep(SLEEP_S)
        SlowAdam.clock.append(time.perf_counter() - t)
        return out


def test_a_loop_of_train_on_batch_stops_before_an_update_past_the_slice() -> None:
    """A user's own loop calling ``train_on_batch`` is no fit: nothing in it reads
    ``stop_training``, so it stops as a plain loop does, at its next training action, before that
    call's update. Taken for a fit, its model's ``stop_training`` had been set and left on, and the
    call after the slice's last had run its update before it stopped: ``optimizer.iterations`` 6
    for 5 completed calls. Truth: Keras's own update counter, the loop's count of completed calls."""
    x, y = data()
    m, done = model(keras.optimizers.SGD(1e-2)), 0
    with tp.profile(steps=4, warmup=1, progress=False) as prof:
        for i in range(20):
            m.train_on_batch(x[i % BATCHES * BATCH:][:BATCH], y[i % BATCHES * BATCH:][:BATCH])
            done += 1
    assert len(prof.run.steps) == done == int(m.optimizer.iterations.numpy()) == 5
    assert "stopped_through" not in prof.run.meta
    assert m.stop_training is False

def test_fit_ending_before_the_slice_is_full_says_so() -> None:
    """A fit that runs its epochs before the slice is full: every batch a step, its History as
    without tpkit, and the note says Keras's fit ended by itself (its epochs, not a max_steps)."""
    x, y = data()
    want = model(keras.optimizers.Adam(1e-3)).fit(x, y, batch_size=BATCH, epochs=2, verbose=0, shuffle=False).history
    m = model(keras.optimizers.Adam(1e-3))
    with tp.profile(steps=30, warmup=WARMUP, progress=False) as prof:
        history = m.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, shuffle=False).history
    assert history == want
    assert len(prof.run.steps) == 2 * BATCHES == int(m.optimizer.iterations.numpy())
    assert prof.run.meta["stopped_by"] == "loop_end"
    assert any(n.startswith("keras.Model stopped by itself (its epochs, early stopping or a callback) after 16 steps")
               for n in prof.run.meta["notes"]), prof.run.meta["notes"]


def test_update_is_optimizer_time_and_its_variables_optimizer_state() -> None:
    """``tp.step()`` in a callback: the update (a subclass's ``apply`` whole) is optimizer_s, its
    variables (Adam's moments, its iteration count) optimizer_state, to the byte."""
    x, y = data()
    SlowAdam.clock = []

    class Step(keras.callbacks.Callback):
        def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
            tp.step()

    m = model(SlowAdam(1e-3))
    with tp.profile(steps=STEPS, warmup=WARMUP, progress=False) as prof:
        m.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, shuffle=False, callbacks=[Step()])
    run = prof.run
    measured = run.steps[~run.steps.warmup]
    assert len(measured) == STEPS
    got, want = float(measured.optimizer_s.sum()), sum(SlowAdam.clock[WARMUP:WARMUP + STEPS])
    assert abs(got - want) <= TOLERANCE * want, (got, want)
    state = sum(v.value.nbytes for v in m.optimizer.variables)
    memory = run.memory
    assert int(memory[memory.category == "optimizer_state"].bytes.max()) == state
    assert run.summary().to_dict()["verdict"] != "OVERHEAD-BOUND"


def test_checkpoint_callback_is_save(tmp_path: object) -> None:
    """``ModelCheckpoint`` each epoch (``save_weights`` through h5py, ``save`` to a .keras zip):
    save_s is the saves' own clock."""
    x, y = data()
    for name, weights_only in (("w{epoch}.weights.h5", True), ("m{epoch}.keras", False)):
        m = model(keras.optimizers.Adam(1e-3))
        owner, attr = keras.Model, "save_weights" if weights_only else "save"
        fn, clock = getattr(owner, attr), []

        def timed(self, *args, _fn=fn, _clock=clock, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            t = time.perf_counter()
            out = _fn(self, *args, **kwargs)
            _clock.append((time.perf_counter() - t, int(self.optimizer.iterations.numpy())))
            return out

        setattr(owner, attr, timed)
        try:
            ck = keras.callbacks.ModelCheckpoint(os.path.join(str(tmp_path), name), save_weights_only=weights_only)
            with tp.profile(steps=STEPS, warmup=WARMUP, progress=False) as prof:
                m.fit(x, y, batch_size=BATCH, epochs=3, verbose=0, shuffle=False, callbacks=[ck])
        finally:
            setattr(owner, attr, fn)
        steps = prof.run.steps
        # the first epoch's end is inside the slice; the second epoch's, which the slice's stop
        # ends after its 12th batch, comes after the slice's last step
        assert [at for _, at in clock] == [BATCHES, STEPS + WARMUP]
        got, want = float(steps.save_s.sum()), clock[0][0]
        assert abs(got - want) <= TOLERANCE * want + 0.002, (name, got, clock)
