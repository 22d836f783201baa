"""Evaluation that runs inside a slice, told apart from training when the Run is built.

A Trainer evaluating every N steps (``eval_strategy="steps"``, Lightning's
``val_check_interval``), or a loop that calls its own ``evaluate()``, runs the trained model on
other batches between two optimizer steps. Counted as training, the evaluation's model calls
were ``forward`` time, the waits for its batches ``data_wait``, and its batches the step's
samples: a slice with an evaluation every third step read ~1.5x the forward time and over twice
the samples/s of its training (a plain loop, a Trainer and Lightning alike), and the verdict
followed the wrong shares.

What is evaluation here:

- an outermost model call made without grad (``torch.no_grad``, ``inference_mode``) with the
  module in eval mode (``model.eval()``), of a module that the slice also called with grad in
  train mode (the model being trained), or that such a module wraps (DDP's ``.module``,
  torch.compile's ``_orig_mod``: trained through the wrapper, evaluated inside it). A model
  only ever called without grad (a teacher, a reference or target model) is part of the step:
  its calls stay ``forward``;
- a batch handed to the loop whose stretch (until the next batch) holds such calls and no
  other forward: the wait for it is ``eval``, and its samples are not the step's. A batch that
  also feeds a training forward (targets made by the same model before its own forward) keeps
  its samples and its ``data_wait``.

The phase probe records what it takes (``Recorder.handouts``, ``no_grad_calls``,
``trained_modules``: a few integers a call or a batch); everything is decided here, after the
slice, so that an evaluation at the slice's start (Lightning's sanity check, before the model's
first training call) is seen too. Memory rows at those calls and waits are relabelled the same
way, and the run's notes say what was counted as evaluation.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

#: The phase evaluation is counted as (``run.steps.eval_s``).
EVAL = "eval"


@dataclass
class EvalSplit:
    """What the Run counts as evaluation, in the Recorder's clock (ns)."""

    calls: list[tuple[int, int]] = field(default_factory=list)  # (start, end) of each evaluation call
    waits: set[tuple[int, int]] = field(default_factory=set)  # (start, end) of data_wait spans it read
    samples_by_step: dict[int, int] = field(default_factory=dict)  # raw step -> samples taken out
    batches: int = 0

    def __bool__(self) -> bool:
        return bool(self.calls)

    def in_call(self, t_ns: int) -> bool:
        """Whether ``t_ns`` falls inside an evaluation call."""
        i = bisect.bisect_right(self.calls, (t_ns, 1 << 62)) - 1
        return i >= 0 and self.calls[i][0] <= t_ns <= self.calls[i][1]


def split(spans: list[tuple], handouts: list[int], no_grad_calls: list[int], trained: set[int],
          past: int) -> EvalSplit:
    """What was evaluation: ``spans`` as ``Recorder.spans`` gives them, the flat lists and set of
    the Recorder (see the module's docstring); raw steps from ``past`` on are not the slice's."""
    out = EvalSplit()
    calls = sorted((no_grad_calls[i], no_grad_calls[i + 1]) for i in range(0, len(no_grad_calls), 4)
                   if no_grad_calls[i + 2] in trained and no_grad_calls[i + 3] < past)
    if not calls:
        return out
    out.calls = calls
    # every other forward span (training, a teacher's) by its start
    others = sorted(s[1] for s in spans if s[0] == "forward" and not out.in_call(s[1]))
    times = handouts[0::3]
    eval_batch = []
    for k, t in enumerate(times):
        end = times[k + 1] if k + 1 < len(times) else 1 << 62
        has_eval = bisect.bisect_left(calls, (t, -1)) < bisect.bisect_left(calls, (end, -1))
        has_other = bisect.bisect_left(others, t) < bisect.bisect_left(others, end)
        eval_batch.append(has_eval and not has_other)
        if has_eval and not has_other and handouts[3 * k + 2] < past:
            step, n = handouts[3 * k + 2], handouts[3 * k + 1]
            out.samples_by_step[step] = out.samples_by_step.get(step, 0) + n
            out.batches += 1
    # a wait belongs to the first batch handed out at or after its end (a loader that reads one
    # ahead, as accelerate's does, hands the previous batch right after each read)
    for s in spans:
        if s[0] != "data_wait":
            continue
        k = bisect.bisect_left(times, s[2])
        if k < len(times) and eval_batch[k]:
            out.waits.add((s[1], s[2]))
    return out


def relabel_span(split_: EvalSplit, phase: str, start_ns: int, end_ns: int) -> str:
    """A span's phase in the Run: ``eval`` for an evaluation call's forward and its waits."""
    if phase == "forward" and split_.in_call(start_ns):
        return EVAL
    if phase == "data_wait" and (start_ns, end_ns) in split_.waits:
        return EVAL
    return phase


def relabel_memory(split_: EvalSplit, rows: list[tuple], spans: list[tuple]) -> list[tuple]:
    """Memory rows ``(raw_step, phase, event, t_ns, ...)`` with the phase of an evaluation call
    or wait made ``eval`` (``spans`` as for ``split``). A wait's rows are stamped just outside its
    span (the probe runs before the span opens and after it closes): each goes with the nearest
    ``data_wait`` span."""
    if not split_:
        return rows
    waits = sorted((s[1], s[2]) for s in spans if s[0] == "data_wait")
    starts = [a for a, _ in waits]

    def nearest_wait(t: int) -> tuple[int, int] | None:
        i = bisect.bisect_right(starts, t)
        best, gap = None, None
        for j in (i - 1, i):
            if 0 <= j < len(waits):
                a, b = waits[j]
                d = 0 if a <= t <= b else min(abs(t - a), abs(t - b))
                if gap is None or d < gap:
                    best, gap = waits[j], d
        return best

    out = []
    for row in rows:
        phase, t = row[1], row[3]
        if (phase == "forward" and split_.in_call(t)) or (
                phase == "data_wait" and nearest_wait(t) in split_.waits):
            row = (row[0], EVAL, *row[2:])
        out.append(row)
    return out


def note(split_: EvalSplit, eval_s: float) -> str:
    """The run's note on what was counted as evaluation."""
    samples = sum(split_.samples_by_step.values())
    read = (f", and the {split_.batches} batch(es) read for them ({samples} samples)," if split_.batches else ",")
    return (f"evaluation ran inside the slice: {len(split_.calls)} call(s) of the trained model without grad "
            f"in eval mode{read} {eval_s:.3f} s in all, are counted as eval (eval_s), not forward or data_wait, "
            f"and their samples are not the steps' (samples/s is training's). A call of the trained model without grad in "
            f"eval mode that is part of training (targets it makes for itself) is counted as eval too")


def describe(split_: EvalSplit) -> dict[str, Any]:
    """``run.meta["evaluation"]``."""
    return {"calls": len(split_.calls), "batches": split_.batches,
            "samples": sum(split_.samples_by_step.values())}
