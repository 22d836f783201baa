"""A trainer's setup inside the slice: the ``setup`` phase.

A slice can hold the start of a trainer's run (``Trainer.train()``, Lightning's ``fit()``): the
cell builds the trainer and calls it under ``%%tp_profile``, a sweep's next Trainer trains on
after the one before stopped, ``auto_find_batch_size`` tries again at a smaller batch. What
runs from the previous run's last step (or the slice's start) to the new run's first training
batch builds the trainer, its model wrapper, optimizer and loader, and tears the previous run
down: none of it is training. It had been ``other`` of the step it fell in (0.8-2 s in a 50 ms
step), and the verdict then read OVERHEAD-BOUND with advice about Python between phases.

That stretch is one ``setup`` span, depth 0: whatever a probe saw inside it (a sanity-check
evaluation, a checkpoint loaded, the new loader's workers starting as ``data_wait``) began
later and keeps its own phase (``build.exclusive_phase_times`` charges the innermost, latest
span), so only what no phase covered becomes ``setup``. The phase probe notes when each run
was called (``Recorder.run_starts``); the stretch is found after the slice, where the batches
read for evaluation are known.
"""

from __future__ import annotations

import bisect

from .recorder import Recorder

SETUP = "setup"  # the phase (schema.BUILTIN_PHASES)
SOURCE = "trainer setup"


def setup_spans(rec: Recorder, eval_handouts: set[int], past: int) -> list[tuple]:
    """Raw spans (as ``Recorder.spans``) of the trainers' setups: for each run called in the
    slice, from the last step end before the call (the slice's start if none) to the first batch
    handed out for training after it, in the step that batch fed. ``eval_handouts``: indexes of
    the batches read for evaluation (a Lightning sanity check reads some first); raw steps from
    ``past`` on are not the slice's."""
    ends = [e for e, _ in rec.step_ends]
    times, steps = rec.handouts[0::3], rec.handouts[2::3]
    stretches: dict[tuple[int, int], int] = {}
    for called in rec.run_starts:
        done = bisect.bisect_right(ends, called)  # steps ended before the call
        start = ends[done - 1] if done else rec.first_step_ns
        k = bisect.bisect_right(times, called)
        while k < len(times) and k in eval_handouts:
            k += 1
        if k == len(times) or steps[k] != done or done >= past:
            continue  # no training batch came before a step ended (a run that failed at once)
        stretches[(start, times[k])] = done
    return [(SETUP, s, e, 0, SOURCE, step, None, None) for (s, e), step in sorted(stretches.items())]
