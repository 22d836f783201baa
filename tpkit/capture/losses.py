"""A step's loss, from the losses the phase probe saw go through backward.

The step's loss is the sum of the losses backpropagated in it: what a loop logs when it
accumulates, each micro-batch's loss divided by the accumulation count. Two kinds of loop
backpropagate something else, and the build says so in the run's notes:

- SAM-style steps (backward again after ``zero_grad()`` threw the step's gradients away: the
  first pass only finds where to perturb the weights) report the first pass's loss, as such
  loops log it; with several optimizers (a GAN), one optimizer's ``zero_grad()`` throws away
  nothing of another's, and every loss counts. Where a new batch comes between the
  ``zero_grad()`` and the next backward, the loop skipped an update (a non-finite loss): the
  step's loss is the next iteration's, what its update used (``probes.loss_sums.LossSums``).
- A trainer that divides by more micro-batches than the step had (Lightning's automatic
  optimization, and ``accelerator.backward`` in a loop of its own, divide by the accumulation
  count even in an epoch's last, partial window) has that step's sum scaled to the window's
  mean loss, as the loop logs it. Hugging Face's Trainer divides by the window's own count.
"""

from __future__ import annotations

from .frameworks import accelerate_loss_divisor
from .recorder import Recorder


def step_losses(rec: Recorder, steps: int) -> tuple[dict[int, float], list[str]]:
    """Raw step -> its loss, for the first ``steps`` raw steps, and the notes on how it was found."""
    several = rec.optimizer_count > 1
    losses: dict[int, float] = {}
    for raw, value in (rec.losses + rec.losses_after_reset) if several else rec.losses:
        losses[raw] = losses.get(raw, 0.0) + float(value)  # a tensor: one sync, after the slice
    notes = []
    second_passes = 0 if several else len({raw for raw, _ in rec.losses_after_reset if raw < steps})
    if second_passes:
        notes.append(f"{second_passes} step(s) backpropagated again after zero_grad() had thrown the step's "
                     "gradients away (SAM-style: a second forward and backward on the same batch): a step's loss "
                     "is what went through backward before the gradients were zeroed, the first pass's")
    lossless = [raw for raw in range(steps) if raw not in losses]
    if lossless and rec.unscalar_backwards:
        notes.append(f"{len(lossless)} step(s) have no loss (it reads NaN): the loop's backward() went through "
                     f"{rec.unscalar_backwards} time(s) with a tensor of several elements (a per-sample loss with "
                     "gradient=...) or with gradients weighing its tensors, and tpkit records a step's loss only "
                     "from one-element tensors; call loss.mean().backward() or log the loss yourself")
    elif losses and lossless:
        notes.append(f"{len(lossless)} step(s) had no loss go through backward (its loss reads NaN): the loop "
                     "stepped without a backward there (Lightning's training_step returned None, a guard skipped it)")
    skipped = {raw: k for raw, k in rec.skipped_iterations.items() if raw < steps}
    if skipped:
        notes.append(f"{len(skipped)} step(s) held {sum(skipped.values())} iteration(s) whose update the loop skipped "
                     "(backward, then zero_grad() and a new batch with no optimizer.step() between, as on a "
                     "non-finite loss): such a step's time and samples are both iterations', its loss is what its "
                     "update used")
    micro = {raw: k for raw, k in rec.loss_counts.items() if raw < steps and raw in losses}
    divisor, who = _divisor(rec)
    # only where the loop does accumulate that many: some step has as many micro-batches, none more
    if divisor > 1 and (divisor not in micro.values() or max(micro.values()) > divisor):
        divisor = 1
    partial = sorted(raw for raw, k in micro.items() if k < divisor)
    for raw in partial:  # a window shorter than the trainer divides by: its mean loss, as logged
        losses[raw] *= divisor / micro[raw]
    if partial:
        notes.append(f"{len(partial)} step(s) had fewer micro-batches than the {divisor} that {who} divided each "
                     "micro-batch's loss by before backward (an epoch's last window): their loss is the window's "
                     "mean loss, as the loop logs it, not the smaller sum that went through backward (their "
                     "gradients are that much smaller too)")
    elif divisor == 1 and not several and getattr(rec.framework, "name", "") != "transformers.Trainer":
        notes += _shorter_windows(micro)
    return losses, notes


def _shorter_windows(micro: dict[int, int]) -> list[str]:
    """A loop of its own that accumulates: what its steps with fewer micro-batches than most
    (an epoch's last window) read. tpkit cannot tell whether the loop divided each micro-batch's
    loss by a fixed count or by the window's own, so it leaves the sum that went through backward
    and says what that sum is in either case (Hugging Face's Trainer divides by the window's own
    count: its sums are the mean, and it gets no note)."""
    counts = list(micro.values())
    usual = max(sorted(set(counts)), key=counts.count) if counts else 1
    fewer = sorted(raw for raw, k in micro.items() if k < usual)
    if usual <= 1 or not fewer:
        return []
    ks = sorted({micro[raw] for raw in fewer})
    return [f"{len(fewer)} step(s) had fewer micro-batches ({', '.join(map(str, ks))}) than most steps' {usual} "
            "(an epoch's last window): their loss is the sum that went through backward. Where the loop divides "
            f"each micro-batch's loss by {usual} whatever the window, that sum is the window's mean loss times its "
            f"micro-batches / {usual} (its gradients as much smaller); where it divides by the window's own count, "
            "the sum is the mean"]


def _divisor(rec: Recorder) -> tuple[int, str]:
    """What the loop's trainer divides every micro-batch's loss by (1: nothing to correct), and
    who does."""
    if rec.framework is not None:
        n = rec.framework.loss_divisor()
        return n, f"Lightning (accumulate_grad_batches={n})"
    if rec.accelerate_loader:  # a loop of its own around accelerate: its prepared loader was read
        n = accelerate_loss_divisor()
        return n, f"accelerator.backward (gradient_accumulation_steps={n})"
    return 1, ""
