"""The losses backpropagated in each step, summed on their device (``LossSums``), and the
hand-made loss scales taken out of them (``static_scale``)."""

from __future__ import annotations

import math

import torch

from ..recorder import Recorder

#: A constant factor this large, a power of two, applied last to the loss is a loss scale (a
#: static one, by hand: GradScaler's is known from its own call): ``(loss * 1024).backward()``
#: had read 1024x the loss the loop logs, with no word. Smaller factors are weights of the loss.
STATIC_SCALE_MIN = 128.0
_CPU = torch.device("cpu")


def static_scale(tensor: torch.Tensor) -> float:
    """The hand-made loss scale ``tensor`` was multiplied by last, or 0.0: a ``MulBackward0``
    whose other operand is a host scalar (a Python number, or a CPU one-element tensor without
    grad: reading it never waits for a device) and a power of two from ``STATIC_SCALE_MIN``."""
    fn = tensor.grad_fn
    if fn is None or type(fn).__name__ != "MulBackward0":
        return 0.0
    try:
        other = getattr(fn, "_saved_other")  # noqa: B009 - a Node attribute torch does not declare
    except (AttributeError, RuntimeError):  # not saved (the operand needed no grad of the loss)
        return 0.0
    if (not isinstance(other, torch.Tensor) or other.numel() != 1 or other.device.type != "cpu"
            or other.requires_grad):
        return 0.0
    scale = float(other)
    return scale if scale >= STATIC_SCALE_MIN and math.frexp(scale)[0] == 0.5 else 0.0




class LossSums:
    """Per-step sums of the losses backpropagated, kept on the loss's device in preallocated
    chunks of ``CHUNK`` slots: one in-place add per backward (no new tensor per step, no
    sync), nothing of the loop's own tensors kept, read once per chunk after the slice. A loss
    on the CPU is read at once and summed in a chunk of host floats: there is no device to wait
    for, and the in-place add into a float64 tensor chunk cost ~5 us a step where the read costs
    0.2 (both sum in double precision, in the same order: the same sums).

    Each step's first loss puts ``(raw_step, slot)`` in ``rec.losses``; ``float(slot)`` is
    the step's sum (the build reads it so)."""

    CHUNK = 64

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec
        self._chunks: list[torch.Tensor] = []
        self._floats: list[list[float]] = []  # the CPU's chunks: host floats
        self._free: dict[torch.device, tuple[int, int]] = {}  # device -> (chunk, next index)
        self._slots: dict[torch.device, "_Slot"] = {}  # the current step's slot per device
        self._slots_step = -1
        self._host: dict[int, list[float]] = {}
        self._reset_step = -1  # the step whose gradients were zeroed after its first loss
        self._updated = False  # an optimizer stepped since the last loss went through backward

    def add(self, raw_step: int, loss: torch.Tensor) -> None:
        """Add a one-element loss tensor to step ``raw_step``'s sum (or, after the step's
        gradients were zeroed, to ``rec.losses_after_reset``: see ``reset``)."""
        rec = self.rec
        self._updated = False
        after_reset = raw_step == self._reset_step
        if not after_reset:
            counts = rec.loss_counts
            counts[raw_step] = counts.get(raw_step, 0) + 1
        target = rec.losses_after_reset if after_reset else rec.losses
        value = loss if type(loss) is torch.Tensor else loss.detach()  # (an nn.Parameter's detach is a tensor)
        on_host = value.is_cpu and type(value) is torch.Tensor  # read at once (the class doc)
        if not on_host:
            if value is loss:
                value = loss.detach()
            if value.dim():  # a one-element loss of shape (1,) or more; a 0-d one (the usual) skips the reshape's 1.7 us
                value = value.reshape(())
            if type(value) is not torch.Tensor:  # a tensor subclass (DTensor...): a copy of its own
                target.append((raw_step, value.clone()))
                return
        if raw_step != self._slots_step:  # a new step: earlier steps' slots are never added to again
            self._slots, self._slots_step = {}, raw_step
        device = _CPU if on_host else value.device
        slot = self._slots.get(device)
        if slot is None:
            slot = self._slots[device] = self._new_slot(device)
            target.append((raw_step, slot))
        if on_host:
            self._floats[slot[1]][slot[2]] += value.item()
        else:
            self._chunks[slot[1]][slot[2]].add_(value)

    def updated(self) -> None:
        """An optimizer stepped: until the next backward, a ``zero_grad()`` is the loop's ordinary
        one after its update (several updates in one step marked by ``tp.step()``, PPO's
        minibatches), not a reset that throws a backward's gradients away."""
        self._updated = True

    def reset(self, raw_step: int) -> None:
        """``zero_grad()`` in step ``raw_step``: after a loss of the step went through backward,
        the gradients it made are thrown away (SAM's two passes on one batch: the first pass's
        gradients only find where to perturb the weights). What is backpropagated after it in
        the step is kept apart; the build decides what to do with it."""
        if self._reset_step != raw_step and self.rec.loss_counts.get(raw_step, 0) and not self._updated:
            self._reset_step = raw_step
            if raw_step == self._slots_step:
                self._slots = {}
            self.rec.batch_after_reset = self._new_iteration

    def _new_iteration(self) -> None:
        """A batch handed out after the reset, before any optimizer step: not a second pass on
        the same batch but the loop's next iteration, the update of the one before skipped (a
        loop that calls ``zero_grad()`` and ``continue`` on a non-finite loss). The losses
        backpropagated so far in the step are thrown away with their gradients: the step's loss
        is what its update used (it had read the skipped NaN, and a note called it SAM). With
        several optimizers one's ``zero_grad()`` throws nothing of another's away: nothing changes."""
        rec = self.rec
        rec.batch_after_reset = None
        step = self._reset_step
        if step != rec.step_index or rec.optimizer_count > 1:
            return
        self.discard(step)
        rec.skipped_iterations[step] = rec.skipped_iterations.get(step, 0) + 1

    def cancel_reset(self) -> None:
        """The ``zero_grad()`` taken for a reset followed an update after all (one no optimizer
        hook saw): the step's losses are one sum, no second pass, no skipped iteration."""
        self._reset_step = -1
        self.rec.batch_after_reset = None

    def discard(self, raw_step: int) -> None:
        """Step ``raw_step``'s losses so far belong to an iteration whose update never came (one
        the loop skipped, a trainer's run that failed and is tried again): none of them is the step's."""
        rec = self.rec
        rec.batch_after_reset = None
        rec.losses[:] = [e for e in rec.losses if e[0] != raw_step]
        rec.losses_after_reset[:] = [e for e in rec.losses_after_reset if e[0] != raw_step]
        rec.loss_counts.pop(raw_step, None)
        self._reset_step = -1
        if raw_step == self._slots_step:
            self._slots = {}

    def _new_slot(self, device: torch.device) -> "_Slot":
        chunk, index = self._free.get(device, (-1, self.CHUNK))
        if device.type == "cpu":  # host floats (the class doc)
            if index >= self.CHUNK:
                self._floats.append([0.0] * self.CHUNK)
                chunk, index = len(self._floats) - 1, 0
            self._free[device] = (chunk, index + 1)
            return _HostSlot((self, chunk, index))
        if index >= self.CHUNK:
            dtype = torch.float32 if device.type == "mps" else torch.float64  # mps has no float64
            chunk_t = torch.zeros(self.CHUNK, dtype=dtype, device=device)
            self._chunks.append(chunk_t)
            self.rec.own_tensors.append(chunk_t)  # tpkit's own, not the loop's: the memory probe leaves it out
            chunk, index = len(self._chunks) - 1, 0
        self._free[device] = (chunk, index + 1)
        return _Slot((self, chunk, index))

    def value(self, chunk: int, index: int) -> float:
        if chunk not in self._host:
            self._host[chunk] = self._chunks[chunk].tolist()  # one sync per chunk, after the slice
        return float(self._host[chunk][index])


class _Slot(tuple["LossSums", int, int]):
    """``(sums, chunk, index)``: one step's sum, read by ``float(slot)`` after the slice. A tuple:
    made in C, without a frame of tpkit's in the step."""

    __slots__ = ()

    def __float__(self) -> float:
        return self[0].value(self[1], self[2])

    @property
    def is_cuda(self) -> bool:
        """Whether the sum lives on a CUDA device, as a tensor says: the rank watchdog reads no
        loss there (a stalled rank's stream never drains; ``float`` would wait for it)."""
        return bool(self[0]._chunks[self[1]].is_cuda)


class _HostSlot(_Slot):
    """``(sums, chunk, index)`` of a CPU step's sum, in host floats (``LossSums._floats``)."""

    __slots__ = ()

    def __float__(self) -> float:
        return self[0]._floats[self[1]][self[2]]

    @property
    def is_cuda(self) -> bool:
        return False
