"""Training frameworks seen running the slice: Hugging Face ``Trainer``, Lightning ``Trainer`` and
Keras 3's ``Model.fit`` (its ``stop_training``, which its own early stopping sets); and, for
where an evaluation ends, pytorch-ignite's ``Engine`` and skorch's fit loop (``EVALUATING``).

A slice inside ``trainer.train()`` / ``trainer.fit()`` ends through the framework's own stop
instead of tpkit's ``StopSlice`` exception: its last step is logged and its end hooks run. HF:
its ``control.should_training_stop``, set inside the last optimizer step, so the Trainer ends as
after an early stop, not as at ``max_steps``: its ``on_train_end`` runs, but not the final
evaluation and checkpoint that reaching ``max_steps`` triggers (its flow callback asks for those
only there). Lightning: its fit loop's ``max_steps``, lowered to the step now finishing and put
back when the slice ends, so the fit finishes as after ``max_steps`` (status FINISHED). (``trainer.should_stop``, its early-stopping
switch, is refused while ``min_epochs`` / ``min_steps`` are not met, and then tpkit's
``StopSlice`` interrupted the fit; where it is obeyed, Lightning first runs a whole extra
validation, as early stopping wants: 2 s after a 0.6 s slice with a 40-batch validation set.)
In Lightning's ``validate`` / ``test`` / ``predict`` (``tp.step()`` in a callback) no switch
ends the loop: the slice ends and the trainer runs on, unprofiled. The trainer is found once, at the
first step's end, by walking the frames of the loop for a ``self`` that is one of these
trainers; nothing is imported (a framework that was never imported cannot be running) and
nothing is patched.

fastai's ``Learner`` has no such switch: a fit is stopped at the loop's next training action,
as a plain loop is, by an exception that is fastai's own ``CancelFitException`` as well as
tpkit's ``StopSlice`` (``stop_exception``), so that the fit ends as a callback's cancel ends
it: ``after_cancel_fit`` and ``after_fit`` run, its batch is let go, and ``fit`` returns.
``StopSlice`` alone went through fastai's handlers: no end event ran and ``learn.loss``,
``pred``, ``xb`` and ``yb`` still held the last batch.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any

from ..errors import StopSlice

#: (name, module that defines the class, class name)
_KNOWN: tuple[tuple[str, str, str], ...] = (
    ("fastai.Learner", "fastai.learner", "Learner"),  # (no switch: stop_exception)
    ("transformers.Trainer", "transformers.trainer", "Trainer"),
    ("lightning.Trainer", "lightning.pytorch.trainer.trainer", "Trainer"),
    ("pytorch_lightning.Trainer", "pytorch_lightning.trainer.trainer", "Trainer"),
    # Keras 3's ``Model.fit`` (a Model is a Trainer; on the torch backend, probes/keras_optimizers.py)
    ("keras.Model", "keras.src.trainers.trainer", "Trainer"),
)

#: Frames walked up from the optimizer step at most (Lightning's automatic optimization sits
#: about 40 frames below ``Trainer.fit``).
MAX_FRAMES = 200


class FrameworkTrainer:
    """A framework's trainer running the slice, held weakly."""

    def __init__(self, name: str, trainer: Any) -> None:
        self.name = name
        self._ref = weakref.ref(trainer)
        self.stop_requested = False
        self._lowered: tuple[Any, Any, int] | None = None  # (Lightning's epoch loop, its max_steps, tpkit's)
        self._keras_was: bool | None = None  # a Keras model's stop_training before tpkit set it

    @property
    def trainer(self) -> Any:
        return self._ref()

    def request_stop(self, counted: bool = False) -> bool:
        """Ask the trainer to end after the step now finishing, as its own early stop does.
        ``counted``: Lightning has counted that step already (``tp.step()`` in a callback, after
        the optimizer's step returned); from inside the optimizer's step it has not. Returns
        False when the trainer is gone or has no such switch."""
        trainer = self.trainer
        if trainer is None or self.name == FASTAI:
            return False  # (fastai: stopped at the loop's next training action, ``stop_exception``)
        if self.name == "transformers.Trainer":
            control = getattr(trainer, "control", None)
            if control is None or not hasattr(control, "should_training_stop"):
                return False
            control.should_training_stop = True  # read after on_step_end and the step's logging
        elif self.name == "keras.Model":
            # fit reads it after the batch's callbacks (as its EarlyStopping sets it): its History
            # and on_train_end come as after an early stop; the next fit() clears it
            if not hasattr(trainer, "stop_training"):
                return False
            if self._keras_was is None:
                self._keras_was = bool(trainer.stop_training)
            trainer.stop_training = True
        else:
            loop: Any = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
            if loop is None or not self.fitting() or not isinstance(getattr(loop, "max_steps", None), int):
                return False
            own = loop.max_steps if self._lowered is None else self._lowered[1]
            # the step finishing now is counted once this optimizer step returns (+1 made a fit
            # whose steps tp.step() marks train one batch more, and StopSlice then interrupted it)
            loop.max_steps = int(loop.global_step) + (0 if counted else 1)
            self._lowered = (loop, own, loop.max_steps)
        self.stop_requested = True
        return True

    def fitting(self) -> bool:
        """Whether a Lightning trainer is in ``fit`` (not ``validate``, ``test``, ``predict``);
        a fastai Learner in its fit's epochs (not ``validate``, ``get_preds``)."""
        trainer = self.trainer
        if self.name == FASTAI:
            return trainer is not None and _fastai_fitting(trainer)
        fn = getattr(getattr(trainer, "state", None), "fn", None)
        return trainer is not None and str(getattr(fn, "value", fn)) == "fit"

    def runs_on(self) -> bool:
        """Whether the trainer is in a stage that no switch ends (Lightning's ``validate``,
        ``test``, ``predict``): the slice ends and leaves it running, unprofiled."""
        return (self.name not in ("transformers.Trainer", "keras.Model") and self.trainer is not None
                and not self.fitting())

    def restore(self) -> None:
        """Put back what ``request_stop`` changed (Lightning's ``max_steps``): a later ``fit``
        of the same trainer runs to its own end. Not where Lightning set it since (a tuner puts
        back its own value when its search ends). A Keras model's ``stop_training`` as it was,
        once its ``fit`` is no longer running (one still running reads it yet): left set, the
        model kept a switch its loop never asked for. Idempotent."""
        was, self._keras_was = self._keras_was, None
        model = self.trainer
        if was is not None and model is not None and getattr(model, "stop_training", was) is True:
            if _keras_fitting(model):
                self._keras_was = was  # (its fit reads it still: put back at the next restore)
            else:
                model.stop_training = was
        if self._lowered is not None:
            loop, max_steps, lowered = self._lowered
            self._lowered = None
            if loop.max_steps == lowered:
                loop.max_steps = max_steps

    def model(self) -> Any:
        """The model the trainer trains (Lightning: the LightningModule), or None."""
        trainer = self.trainer
        if trainer is None:
            return None
        if self.name == "transformers.Trainer":
            return getattr(trainer, "model", None)
        if self.name == "keras.Model":
            return trainer
        return getattr(trainer, "lightning_module", None)

    def loss_divisor(self) -> int:
        """What the trainer divides every micro-batch's loss by before its backward, whatever
        the number of micro-batches in the step (1: nothing, or the true count).

        Lightning's automatic optimization divides by ``accumulate_grad_batches`` even in an
        epoch's last, partial window, so there the losses backpropagated sum to less than the
        window's mean loss (which Lightning logs). Hugging Face's Trainer divides by the
        window's own count: its sums are the mean already. Only for one optimizer: with
        several, a step's micro-batches cannot be told from its optimizers' losses."""
        trainer = self.trainer
        if trainer is None or self.name == "transformers.Trainer":
            return 1
        module = getattr(trainer, "lightning_module", None)
        n = getattr(trainer, "accumulate_grad_batches", 1)
        if (not isinstance(n, int) or n <= 1 or module is None
                or not getattr(module, "automatic_optimization", False) or len(getattr(trainer, "optimizers", ())) != 1):
            return 1
        return n

    def stop_exception(self) -> StopSlice | None:
        """What stops the loop at its first training action after a full slice instead of a plain
        ``StopSlice`` (``slice.Profile._stop_now``): in a fastai Learner's fit, an exception that
        is fastai's ``CancelFitException`` too, which its fit catches (``after_cancel_fit``,
        ``after_fit``, its clean-up; ``fit`` returns). None elsewhere (outside a fit, the loop's
        own code after it, it is ``StopSlice``)."""
        trainer = self.trainer
        if self.name != FASTAI or trainer is None:
            return None
        cancel = getattr(sys.modules.get("fastai.callback.core"), "CancelFitException", None)
        if not (isinstance(cancel, type) and issubclass(cancel, Exception)) or not _fastai_fitting(trainer):
            return None
        self.stop_requested = True  # (the Run's stopped_through)
        stop = _STOPS.get(cancel)
        if stop is None:
            stop = _STOPS[cancel] = type("FastaiStopSlice", (cancel, StopSlice), {
                "__doc__": "tpkit's stop of a full slice, as fastai's own cancel of the fit",
                "__init__": _fastai_stop_init})
        return stop()


FASTAI = "fastai.Learner"
KERAS = "keras.Model"
#: The method of a Keras model that is a trainer whose switch (``stop_training``) ends it: only
#: ``fit`` reads it (not ``train_on_batch``, which a user's own loop calls).
KERAS_FIT = "fit"
#: fastai's CancelFitException -> the class tpkit raises inside a fit (both it and StopSlice)
_STOPS: dict[type, type] = {}


def _fastai_stop_init(self: StopSlice) -> None:
    """The fastai stop's ``__init__``: ``StopSlice``'s (its message), past fastai's own (which
    sets no message); its fit catches it, as meant: no stop the loop swallowed."""
    StopSlice.__init__(self)
    self.handled_by_tpkit = True


def _fastai_fitting(learner: Any) -> bool:
    """Whether ``learner``'s ``_do_fit`` is on this thread's stack: an exception raised there is
    caught by its ``fit`` (fastai's ``Learner._with_events(..., 'fit', CancelFitException)``).
    Walked once, at the slice's stop."""
    f: FrameType | None = sys._getframe(1)
    n = 0
    while f is not None and n < MAX_FRAMES:
        if f.f_code.co_name == "_do_fit" and frame_self(f) is learner:
            return True
        f, n = f.f_back, n + 1
    return False


def _keras_fitting(model: Any) -> bool:
    """Whether ``model``'s ``fit`` is on this thread's stack. Walked once, at the slice's end."""
    f: FrameType | None = sys._getframe(1)
    n = 0
    while f is not None and n < MAX_FRAMES:
        if f.f_code.co_name == KERAS_FIT and frame_self(f) is model:
            return True
        f, n = f.f_back, n + 1
    return False


def accelerate_loss_divisor() -> int:
    """What ``accelerator.backward`` divides every loss by in a loop of its own (not a
    trainer's): the ``gradient_accumulation_steps`` of accelerate's gradient state, even in
    an epoch's last, partial window; 1 where accelerate was not imported or does not
    accumulate (a Hugging Face Trainer gives it 1 and divides by itself), and under DeepSpeed
    (its engine scales the loss). Read from accelerate's shared state, never created here."""
    state = sys.modules.get("accelerate.state")
    gradient_state = getattr(state, "GradientState", None)
    shared = getattr(gradient_state, "_shared_state", None)
    if not shared:
        return 1
    n = (shared.get("plugin_kwargs") or {}).get("num_steps", 1)
    partial = getattr(state, "PartialState", None)
    distributed = str((getattr(partial, "_shared_state", None) or {}).get("distributed_type", ""))
    return n if isinstance(n, int) and n > 1 and "DEEPSPEED" not in distributed else 1


_CO_OPTIMIZED = 0x1  # a function's frame (inspect.CO_OPTIMIZED): its f_locals is a snapshot, not a namespace


def frame_self(f: FrameType) -> Any:
    """The ``self`` of a method's frame. Up to Python 3.12, reading ``f_locals`` leaves a
    snapshot of every local on the frame until it returns: a Trainer's epoch loop kept its first
    batch alive for the whole slice (one batch more of ``data`` at every step, held by tpkit).
    The snapshot is emptied after the read (anything reading ``f_locals`` refreshes it first);
    3.13's write-through proxy holds nothing and is left alone."""
    d = f.f_locals
    obj = d.get("self")
    # (not a dict the code holds too: in 3.11 ``locals()`` returns this very dict; the frame's
    # slot, ``d`` and getrefcount's argument are the 3 references of a snapshot no one holds)
    if type(d) is dict and f.f_code.co_flags & _CO_OPTIMIZED and sys.getrefcount(d) <= 3:
        d.clear()
    return obj


#: The generator (and pre-0.4.8 plain) method of an ignite Engine's run: a frame of one on the stack
#: is an Engine running.
_IGNITE_RUNNING = frozenset({"_internal_run_as_gen", "_internal_run_legacy"})


def ignite_inner_run(args: tuple, kwargs: dict) -> bool:
    """Whether ``Engine.run(engine, ...)`` (``args``) is called while another Engine runs (from
    a handler of the trainer's: ``evaluator.run(val_loader)``): that run is an evaluation. The
    frames are walked up to ``MAX_FRAMES`` for a running Engine's method; once per ``run``."""
    engine = args[0] if args else None
    engines = sys.modules.get("ignite.engine.engine")
    cls = getattr(engines, "Engine", None)
    if engine is None or not isinstance(cls, type):
        return False
    f: FrameType | None = sys._getframe(1)
    n = 0
    while f is not None and n < MAX_FRAMES:
        if f.f_code.co_name in _IGNITE_RUNNING and f.f_code.co_filename == getattr(engines, "__file__", None):
            obj = frame_self(f)
            if isinstance(obj, cls) and obj is not engine:
                return True
        f, n = f.f_back, n + 1
    return False


def skorch_validation(args: tuple, kwargs: dict) -> bool:
    """Whether skorch's ``run_single_epoch(self, iterator, training, ...)`` is its pass over the
    validation data (``training=False``)."""
    training = kwargs["training"] if "training" in kwargs else (args[2] if len(args) > 2 else True)
    return not training


def skorch_validation_scoring(args: tuple, kwargs: dict) -> bool:
    """Whether skorch's ``EpochScoring.on_epoch_end(self, net, ...)`` scores the validation data
    (``on_train=False``, as the classifier's default ``valid_acc``)."""
    return bool(args) and not getattr(args[0], "on_train", False)


#: The tests of ``hook_places.EVALUATORS_WHEN``, by name.
EVALUATING: dict[str, Callable[[tuple, dict], bool]] = {
    "ignite_inner_run": ignite_inner_run,
    "skorch_validation": skorch_validation,
    "skorch_validation_scoring": skorch_validation_scoring,
}


def find_trainer(frame: FrameType | None) -> FrameworkTrainer | None:
    """The HF or Lightning trainer whose method is on the stack above ``frame``, or None. A
    Keras model only in its own ``fit`` (``KERAS_FIT``): a user's loop calling ``train_on_batch``
    is a plain loop, stopped at its next training action. Taken for a fit, its model's
    ``stop_training`` was set, which no one read: the loop ran one update more, past the slice
    (``optimizer.iterations`` 6 for 5 completed calls), and the switch was left on."""
    classes = [(name, getattr(sys.modules[mod], cls, None)) for name, mod, cls in _KNOWN if mod in sys.modules]
    classes = [(n, c) for n, c in classes if isinstance(c, type)]
    if not classes:
        return None
    f, n = frame, 0
    while f is not None and n < MAX_FRAMES:
        code = f.f_code
        if code.co_argcount and code.co_varnames[0] == "self":
            obj = frame_self(f)
            for name, cls in classes:
                if cls is not None and isinstance(obj, cls) and (name != KERAS or code.co_name == KERAS_FIT):
                    return FrameworkTrainer(name, obj)
        f, n = f.f_back, n + 1
    return None
