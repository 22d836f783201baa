"""Sampling inside the loop that tpkit counts as training: runs of calls of the trained model
without grad, in train mode, with no batch read and no training work between them.

A loop that samples from the model it trains every few updates (diffusers' train_unconditional.py
calls its ``DDPMPipeline`` with the UNet left in train mode: ~N denoising calls in a row under
the pipeline's no_grad) and an RL loop that calls its policy between environment steps look the
same to tpkit: calls without grad in train mode, no batch read, no backward between them. The
rollout is training (docs/DESIGN_CHANGES.md, evaluation without ``model.eval()``), so such calls
stay ``forward``; where a library bounds the sampling (a diffusers pipeline's ``__call__``,
``probes/hook_places.py``: ``pipeline_calls``) it is ``eval`` whole. Elsewhere the run says what
it counted as forward and how to tell it (``note``): a diffusion loop's sampling had read as 55%
of the step's forward, COMPUTE-BOUND, with no word. A pseudo-label made by one such call before
the model trains on the batch is no run (``RUN_MIN``).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from .evaluation import EvalSplit

#: Calls in a row (no batch read, no training work between them) that make a run: one or two are
#: targets the model makes for itself on the step's batch (pseudo-labels, two views).
RUN_MIN = 3
#: Spans that are training work between two calls, besides a forward with grad.
_TRAINING_WORK = frozenset({"backward", "optimizer", "offload"})


@dataclass
class TrainModeRuns:
    """Runs of ``RUN_MIN`` or more calls without grad of the trained model in train mode."""

    calls: int = 0  # calls in them, in the rows' steps
    runs: int = 0
    seconds: float = 0.0  # the calls' own time (what forward_s holds of them)


def train_mode_runs(train_mode_calls: list[int], no_grad_calls: list[int], trained: set[int],
                    spans: list[tuple], handouts: list[int], ev: EvalSplit, rows: int) -> TrainModeRuns:
    """The runs in the Recorder's buffers (flat as ``Recorder.no_grad_train_calls``: start, end,
    module, raw step; ``spans`` as ``Recorder.spans``; ``handouts`` flat by 3, their times first)
    of calls of a ``trained`` module, in steps below ``rows``, that ``ev`` did not count as
    evaluation (its calls and a trainer's or a pipeline's evaluation spans). A run breaks at a
    batch handed out, a backward, optimizer or offload span, or a forward with grad (a forward
    span inside no call without grad), and at a step's change."""
    calls = sorted((train_mode_calls[i], train_mode_calls[i + 1], train_mode_calls[i + 3])
                   for i in range(0, len(train_mode_calls), 4)
                   if train_mode_calls[i + 2] in trained and train_mode_calls[i + 3] < rows)
    evaluated = set(ev.calls)
    calls = [c for c in calls if (c[0], c[1]) not in evaluated and not ev.in_call(c[0])]
    out = TrainModeRuns()
    if len(calls) < RUN_MIN:
        return out
    no_grad = EvalSplit(calls=sorted((flat[i], flat[i + 1]) for flat in (no_grad_calls, train_mode_calls)
                                     for i in range(0, len(flat), 4)))
    breaks = sorted([*handouts[0::3], *(s[1] for s in spans if s[0] in _TRAINING_WORK),
                     *(s[1] for s in spans if s[0] == "forward" and not no_grad.in_call(s[1]))])
    run: list[tuple[int, int, int]] = []
    for c in [*calls, (1 << 62, 1 << 62, -1)]:  # a sentinel closes the last run
        if run and (c[2] != run[-1][2] or bisect.bisect_left(breaks, run[-1][1]) != bisect.bisect_left(breaks, c[0])):
            if len(run) >= RUN_MIN:
                out.runs += 1
                out.calls += len(run)
                out.seconds += sum(b - a for a, b, _ in run) / 1e9
            run = []
        run.append(c)
    return out


def note(runs: TrainModeRuns) -> str:
    """The run's note on such runs."""
    return (f"{runs.calls} call(s) of the trained model without grad in train mode, in {runs.runs} run(s) of "
            f"{RUN_MIN} or more with no batch read and no backward or optimizer step between them "
            f"({runs.seconds:.3f} s), are counted as training's forward: sampling or generation inside the loop "
            "reads so, as an RL rollout (training) does; where they are sampling or evaluation, put model.eval() "
            "or tp.phase(\"eval\") around them for eval_s")
