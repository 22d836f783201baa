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
  its calls stay ``forward``, except on a batch that feeds no forward with grad (an EMA teacher
  evaluated on validation batches): there its calls without grad in eval mode are evaluation,
  unless such batches come in every step (a Mean Teacher's targets made on a batch of their own
  before the labelled one is read: training); so are its calls inside an evaluation of the
  trained model (a teacher evaluated next to the student: after an evaluation call with no
  training work between, and before the next one or before training work that is no forward
  with grad), on batches tpkit sees or not;
- an outermost call without grad of the trained model left in train mode (an evaluation under
  ``torch.no_grad()`` that never calls ``model.eval()``, ``generate()`` called as is), or of a
  model only called without grad left so (an EMA copy, ``AveragedModel(model)``, which keeps the
  student's mode while the loop puts only the student in eval mode: its validation batches had
  been the steps' samples, 24 a step for 8), on the batches of a source that feeds no training:
  one of its batches' stretches holds such a call and no training work (no forward with grad,
  backward, optimizer or offload span), and none holds training work without one (a validation
  loader). It is otherwise the eval-mode case (its batches, waits and the time between its calls
  alike); such calls had been training's forward, their batches the steps' samples (272 a step
  for 16), and eval_s 0. A call on a batch that is then trained on (targets the model makes for
  itself), on batches tpkit does not see, or on a source's batches in every step (pseudo-labels
  made on a batch of their own before the labelled one is read) stays training's ``forward``
  (``_evaluated_in_train_mode``);
- an outermost call without grad of a module without parameters (a loss such as
  ``nn.MSELoss()``, a metric such as torchmetrics'), in whatever mode, when the last model call
  before it was an evaluation call: a loop shares its loss module between training and
  evaluation and never puts it in eval mode, and Lightning puts a metric child in eval mode
  though it never trained. Such a call never makes a batch training's (it did: a loop whose
  evaluation called its loss module had its evaluation batches counted as the steps' samples);
  after a training forward (a figure for the log) it stays ``forward``;
- a batch handed to the loop whose stretch (until the next batch) holds such calls and no
  other forward: the wait for it is ``eval``, and its samples are not the step's. A batch that
  also feeds a training forward (targets made by the same model before its own forward) keeps
  its samples and its ``data_wait``, unless it comes from a source (an iterator, a dataset) every
  batch of which had an evaluation call in its stretch, one of them alone, while another
  source's did not: an evaluation at the top of a step, after the step's batch was read, has
  its last batch's stretch run on into that step's training forward (a source pseudo-labelled
  in eval mode and trained on in every step has no batch for evaluation alone: training).
  Where no seen source's batches lacked evaluation calls (the training batches come from a
  generator tpkit does not see), such a source is the evaluation's where it was not read in
  every step. A batch read right after an evaluation's, from the same
  iterator, that holds no call at all (``if i == n: break`` at the top of an evaluation loop
  reads one more) is the evaluation's too;
- the time between two consecutive evaluation calls of one step (of the trained model, or a
  loss or metric after one) with no training work between them: no other forward, no
  backward, optimizer or offload span, no training batch handed out. An evaluation that
  fetches its batches through a function tpkit does not see (nanoGPT's ``estimate_loss()``
  calling ``get_batch('val')``), or that samples between model calls (minGPT's ``generate()``:
  its argmax and cat), had only its model calls counted as eval: 0.002 s of 0.336 s by the
  loop's clock, the rest training's ``other``. It is charged as ``eval`` spans of their own
  (``GLUE``), under every phase that opens inside it (an h2d copy stays h2d); inside a
  trainer's whole evaluation nothing is added;
- the time after an evaluation's last call up to the loop's next training work (the next
  training batch's wait, a forward with grad, a backward, an optimizer or offload span, the
  step's end), where that evaluation read a batch of evaluation data: its metrics' ``compute()``,
  the logging of its results, ``model.train()`` (``TAIL`` spans, ``_tails``). It had been
  training's ``other``: 170 ms of a 357 ms ``evaluate()``, and the verdict's speed-up 1.58x for
  3.48x. Where no evaluation batch was read (a rollout, ``generate()`` over held tensors) it
  stays other, as the time between such calls does. Before an evaluation's first call
  (``model.eval()``) it stays other too: nothing tells that time from the step's (a log of the
  training loss); ``iter()`` of a validation loader and its waits are eval already.

The phase probe records what it takes (``Recorder.handouts``, ``no_grad_calls``,
``no_grad_train_calls``, ``trained_modules``, ``param_free_modules``: a few integers a call
without grad or a batch); everything is decided here, after the
slice, so that an evaluation at the slice's start (Lightning's sanity check, before the model's
first training call) is seen too. Memory rows at those calls and waits are relabelled the same
way, and the run's notes say what was counted as evaluation.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any, Callable

from ..schema import FILE_LOAD, GC_PHASE, JIT_TRACE, METRIC_CALL, USER_PHASE_SOURCE
from .probes.hook_places import EVALUATORS_WHEN

#: The phase evaluation is counted as (``run.steps.eval_s``).
EVAL = "eval"
#: The source of the ``eval`` spans between consecutive evaluation calls (``EvalSplit.glue``).
GLUE = "between evaluation calls"
#: The source of the ``eval`` spans after an evaluation's last call (``EvalSplit.tails``).
TAIL = "after an evaluation's last call"
#: The phases that are training work: one of them between two evaluation calls keeps the time
#: between them the step's (a loop that computes a metric in eval mode after every step).
_TRAINING_WORK = frozenset({"backward", "optimizer", "offload"})
#: The phases of the calls an evaluation is made of: a model's or a loss's, and a metric's
#: (``metric(preds, target)``, capture/probes/phases.py).
_CALLS = frozenset({"forward", METRIC_CALL})


@dataclass
class EvalSplit:
    """What the Run counts as evaluation, in the Recorder's clock (ns)."""

    calls: list[tuple[int, int]] = field(default_factory=list)  # (start, end) of each evaluation call
    ranges: list[tuple[int, int]] = field(default_factory=list)  # a trainer's whole evaluations (merged)
    waits: set[tuple[int, int]] = field(default_factory=set)  # (start, end) of data_wait spans it read
    samples_by_step: dict[int, int] = field(default_factory=dict)  # raw step -> samples taken out
    batches: int = 0
    handouts: set[int] = field(default_factory=set)  # indexes (in Recorder.handouts) of the batches read for it
    model_calls: int = 0  # evaluation calls of the trained model in the rows' steps
    helper_calls: int = 0  # and of a loss or a metric after them
    runs: dict[str, int] = field(default_factory=dict)  # a trainer's evaluations in the rows' steps, by who ran them
    rows: int = 0  # raw steps below this have a row in run.steps: what the note and describe count
    glue: list[tuple[int, int, int]] = field(default_factory=list)  # (start, end, raw step) between calls
    # stretches between calls with no evaluation data seen among them: left other (a rollout)
    unseen_glue: list[tuple[int, int, int]] = field(default_factory=list)
    # (start, end, raw step) from an evaluation's last call to the loop's next training work
    tails: list[tuple[int, int, int]] = field(default_factory=list)
    unseen_tails: int = 0  # evaluations (in the rows' steps) whose tail was left other: no evaluation batch seen

    def __bool__(self) -> bool:
        return bool(self.calls or self.ranges)

    def in_call(self, t_ns: int) -> bool:
        """Whether ``t_ns`` falls inside an evaluation call or a trainer's evaluation."""
        return _inside(self.calls, t_ns) or _inside(self.ranges, t_ns)


def _inside(intervals: list[tuple[int, int]], t_ns: int) -> bool:
    i = bisect.bisect_right(intervals, (t_ns, 1 << 62)) - 1
    return i >= 0 and intervals[i][0] <= t_ns <= intervals[i][1]


def _merged(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


#: The sources of the ``eval`` spans of a framework's call that is an evaluation only where a test
#: says so (``hook_places.EVALUATORS_WHEN``), as capture/probes/phases.py names them.
_EVALUATORS_WHEN = frozenset(f"{module.split('.')[0]}.{owner}.{attr}" for module, owner, attr, _ in EVALUATORS_WHEN)
#: The phases of a model being trained: a backward, an optimizer's step.
_TRAINS = frozenset({"backward", "optimizer"})


def without_training_runs(spans: list[tuple]) -> list[tuple]:
    """``spans`` (as ``Recorder.spans``) less the ``eval`` spans of a framework's evaluation call
    (``EVALUATORS_WHEN``) inside which the model trains (a backward or an optimizer step): such a
    call's test reads the stack only, and an ignite ``Engine`` run from another's handler is its
    trainer as often as an evaluator (a cross-validation or curriculum loop,
    ``Engine(lambda e, k: trainer.run(folds[k]))``). Read as evaluation, the whole training had
    been one eval span: forward 0.0 for 0.207 s by the loop's clock, and the verdict EVAL-BOUND.
    Spans left as they are where there is none."""
    runs = [i for i, s in enumerate(spans) if s[0] == EVAL and s[4] in _EVALUATORS_WHEN]
    if not runs:
        return spans
    trains = sorted(s[1] for s in spans if s[0] in _TRAINS)
    drop = {i for i in runs
            if bisect.bisect_left(trains, spans[i][1]) < bisect.bisect_right(trains, spans[i][2])}
    return [s for i, s in enumerate(spans) if i not in drop] if drop else spans

def split(spans: list[tuple], handouts: list[int], no_grad_calls: list[int], trained: set[int],
          param_free: set[int], past: int, rows: int | None = None,
          sources: list[int] | None = None, train_mode_calls: list[int] | None = None,
          step_ends: list[int] | None = None, shutdowns: list[int] | None = None) -> EvalSplit:
    """What was evaluation: ``spans`` as ``Recorder.spans`` gives them, the flat lists and sets of
    the Recorder (see the module's docstring); raw steps from ``past`` on are not the slice's, and
    what is counted (``describe``) stops at ``rows`` (the steps that have a row: a loop that ended
    early evaluates after its last step too, and that is in no step). ``sources``: per handout,
    the iterator it came from (``Recorder.handout_sources``; 0 or None: not known).
    ``train_mode_calls``: the calls without grad in train mode (``Recorder.no_grad_train_calls``),
    flat as ``no_grad_calls``. ``step_ends``: when each step ended (``Recorder.step_ends``' times):
    without them an evaluation's time after its last call is not told (``_tails``). ``shutdowns``:
    a DataLoader's workers shut down where its iterator was dropped (``Recorder.shutdowns``)."""
    rows = past if rows is None else min(rows, past)
    out = EvalSplit(rows=rows)
    whole = [s for s in spans if s[0] == EVAL and s[5] < past]  # a trainer's evaluate(), as one span
    out.ranges = _merged([(s[1], s[2]) for s in whole])
    last_end = -1
    for s in sorted(whole, key=lambda w: (w[1], -w[2])):
        if s[1] > last_end:  # not inside another: one evaluation
            last_end = s[2]
            if s[5] < rows and s[4] != "tp.phase":  # a trainer's (the loop's own tp.phase("eval") is no run)
                out.runs[s[4]] = out.runs.get(s[4], 0) + 1
    recorded = [no_grad_calls[i:i + 4] for i in range(0, len(no_grad_calls), 4) if no_grad_calls[i + 3] < past]
    if train_mode_calls and sources is not None:
        recorded = sorted(recorded + _evaluated_in_train_mode(
            [train_mode_calls[i:i + 4] for i in range(0, len(train_mode_calls), 4) if train_mode_calls[i + 3] < past],
            spans, handouts, sources, rows, [(a, b) for a, b, _, _ in recorded]))
    calls = sorted((a, b) for a, b, m, _ in recorded if m in trained and m not in param_free)
    # a model only ever called without grad in eval mode (a teacher, an EMA copy), while another is trained
    untrained = sorted((a, b, step) for a, b, m, step in recorded if trained and m not in trained
                       and m not in param_free)
    if not calls and not out.ranges and not untrained:
        return out
    in_range = EvalSplit(calls=out.ranges).in_call
    helpers = sorted((a, b, step) for a, b, m, step in recorded if m in param_free)
    in_helper = EvalSplit(calls=[(a, b) for a, b, _ in helpers]).in_call
    times = handouts[0::3]
    if untrained:
        # its calls are evaluation where a batch's stretch holds them and no forward with grad
        # (an EMA teacher evaluated on validation batches: every call of it had been forward)
        own = [(a, b) for a, b, _ in untrained]
        grad_fwd = sorted(s[1] for s in spans if s[0] == "forward" and not _inside(calls, s[1])
                          and not in_helper(s[1]) and not in_range(s[1]) and not _inside(own, s[1]))
        starts_u = [a for a, _, _ in untrained]
        taken: set[int] = set()
        for k, t in enumerate(times):
            end = times[k + 1] if k + 1 < len(times) else 1 << 62
            lo, hi = bisect.bisect_left(starts_u, t), bisect.bisect_left(starts_u, end)
            if lo < hi and bisect.bisect_left(grad_fwd, t) == bisect.bisect_left(grad_fwd, end):
                taken.update(range(lo, hi))
        picked = [untrained[i] for i in sorted(taken)]
        if rows > 1 and set(range(rows)) <= {step for *_, step in picked}:
            picked = []  # in every step: part of training (a Mean Teacher's targets on a batch of their own)
        chosen = set(picked)
        picked += _inside_evaluation([u for u in untrained if u not in chosen], calls, recorded, spans, grad_fwd)
        calls = sorted(calls + [(a, b) for a, b, _ in picked])
        out.model_calls += sum(1 for *_, step in picked if step < rows)
        if not calls and not out.ranges:
            return out
    out.model_calls += sum(1 for _, _, m, step in recorded if m in trained and m not in param_free and step < rows)
    # every other forward span (training, a teacher's) by its start; a loss or a metric is neither
    others = sorted(s[1] for s in spans if s[0] == "forward" and not _inside(calls, s[1]) and not in_helper(s[1])
                    and not in_range(s[1]))
    # a loss or a metric called without grad is evaluation when the last model call before it was
    starts = [a for a, _ in calls]
    joined = []
    for a, b, step in helpers:
        i, j = bisect.bisect_left(starts, a), bisect.bisect_left(others, a)
        if i and (j == 0 or others[j - 1] < starts[i - 1]):
            joined.append((a, b))
            out.helper_calls += step < rows
    out.calls = calls = sorted(calls + joined)
    holds: list[tuple[bool, bool]] = []  # per batch: its stretch holds (an evaluation call, another forward)
    for k, t in enumerate(times):
        end = times[k + 1] if k + 1 < len(times) else 1 << 62
        holds.append((bisect.bisect_left(calls, (t, -1)) < bisect.bisect_left(calls, (end, -1)),
                      bisect.bisect_left(others, t) < bisect.bisect_left(others, end)))
    # the sources (iterators, datasets) every batch of which had an evaluation call in its
    # stretch, while another source's batches did not: an evaluation at the top of a step, after
    # the step's batch was read, has its last batch's stretch run on into the step's training
    # forward, and that batch is the evaluation's too
    known = sources if sources is not None and len(sources) >= len(times) else []
    with_eval: dict[int, bool] = {}
    eval_alone: set[int] = set()  # sources with a batch whose stretch held evaluation calls alone
    for k, source in enumerate(known[:len(times)]):
        if source:
            with_eval[source] = with_eval.get(source, True) and holds[k][0]
            if holds[k][0] and not holds[k][1]:
                eval_alone.add(source)
    # ... and one of whose batches fed evaluation alone (an evaluation reads several in a row):
    # a batch pseudo-labelled in eval mode in every step, then trained on, is training's. Where
    # no source's batches lacked one (the training batches come from a generator tpkit does not
    # see), a source read in every step may be the training's own: one read only in some steps
    # is an evaluation's (its first batch had been counted as the step's samples, its wait
    # data_wait)
    read_in: dict[int, set[int]] = {}
    for k, source in enumerate(known[:len(times)]):
        read_in.setdefault(source, set()).add(handouts[3 * k + 2])
    eval_sources = {s_ for s_, e in with_eval.items() if e and s_ in eval_alone
                    and (not all(with_eval.values()) or not set(range(rows)) <= read_in[s_])}
    eval_batch: list[bool] = []
    for k, t in enumerate(times):
        has_eval, has_other = holds[k]
        if has_eval and has_other and known and known[k] in eval_sources:
            has_other = False
        # a batch read right after an evaluation's and used for nothing (``if i == n: break`` at
        # the top of its loop reads one more) is the evaluation's too: it had been the next
        # training step's, its wait data_wait
        dropped = (not has_eval and not has_other and bool(eval_batch) and eval_batch[-1] and sources is not None
                   and k < len(sources) and sources[k] != 0 and sources[k] == sources[k - 1])
        is_eval = in_range(t) or (has_eval and not has_other) or dropped
        eval_batch.append(is_eval)
        if is_eval and handouts[3 * k + 2] < past:
            step, n = handouts[3 * k + 2], handouts[3 * k + 1]
            out.samples_by_step[step] = out.samples_by_step.get(step, 0) + n
            out.batches += step < rows
            out.handouts.add(k)
    # evaluation data: a batch read for the evaluation from a source that fed no training batch
    # (a validation loader, ``tp.watch(get_batch)`` called as ``get_batch('val')``)
    training_sources = {known[k] for k in range(min(len(known), len(times))) if not eval_batch[k]}
    eval_data = sorted(t for k, t in enumerate(times) if eval_batch[k]
                       and (k >= len(known) or not known[k] or known[k] not in training_sources))
    training_batches = [t for k, t in enumerate(times) if not eval_batch[k]]
    out.glue, out.unseen_glue = _glue(out, recorded, spans, others, training_batches, in_range, eval_data)
    out.tails, out.unseen_tails = _tails(out, recorded, spans, others, training_batches, in_range, eval_data,
                                         step_ends or [])
    # a loader's workers shut down where its iterator is dropped belong to its own last batch
    # before (a validation loader dropped at its epoch's length, as ignite's evaluator does, or
    # left by ``break``: they had been the next training batch's data_wait)
    shut = dict(zip(shutdowns[0::2], shutdowns[1::2])) if shutdowns and known else {}
    by_source: dict[int, tuple[list[int], list[int]]] = {}  # source -> (its batches' times, their indexes)
    for k, source in enumerate(known[:len(times)] if shut else []):
        at, ks = by_source.setdefault(source, ([], []))
        at.append(times[k])
        ks.append(k)
    # a wait belongs to the first batch handed out at or after its end (a loader that reads one
    # ahead, as accelerate's does, hands the previous batch right after each read); one with no
    # batch after it (the evaluation's loader ran out at the slice's last evaluation) to the last
    for s in spans:
        if s[0] != "data_wait":
            continue
        if s[1] in shut:
            at, ks = by_source.get(shut[s[1]], ([], []))
            i = bisect.bisect_right(at, s[1]) - 1
            if i >= 0:
                if in_range(s[1]) or eval_batch[ks[i]]:
                    out.waits.add((s[1], s[2]))
                continue
        k = min(bisect.bisect_left(times, s[2]), len(times) - 1)
        if in_range(s[1]) or (k >= 0 and eval_batch[k]):
            out.waits.add((s[1], s[2]))
    return out


def _evaluated_in_train_mode(candidates: list[list[int]], spans: list[tuple], handouts: list[int],
                             sources: list[int], rows: int, eval_mode: list[tuple[int, int]]) -> list[list[int]]:
    """The calls without grad in train mode (``candidates``: start, end, module, raw step) of the
    trained model or of one only called without grad (an EMA copy) that are an evaluation: a
    loop that evaluates under ``torch.no_grad()`` without ``model.eval()`` (nothing in its model
    depends on the mode, or ``generate()`` called as is). Those in the stretch (until the next
    batch) of a batch from a source whose batches feed no forward with grad: a source with two
    batches in a row whose stretches hold such a call and no training work (no forward with
    grad, no backward, optimizer or offload span; an evaluation reading one batch stays the
    step's), and none whose stretch holds training work without such a call (a validation
    loader; the batches of an evaluation at the top of a step, after the step's batch was read,
    included). A call on a batch that is then trained on (targets the model makes for itself),
    on batches tpkit does not see (a held list, a rollout's observations), or on a source's
    batches read one at a time between training reads (pseudo-labels made on a batch of their
    own, trained on after the next read) stays the step's ``forward``; an evaluation of two
    batches or more in every step is one (an every-step rule had kept it training: eval 0 for
    0.653 s, 40 samples a step for 8). Counted as training, such an evaluation read eval_s 0 for
    0.345 s by the loop's clock, its forwards in the verdict's compute, and its batches as
    trained samples (272 a step for 16). The probe's cost is only on calls without grad: one
    list extend.
    ``eval_mode``: the other calls without grad (in eval mode, of a loss or a metric), (start, end)."""
    times = handouts[0::3]
    if not candidates or not times or len(sources) < len(times):
        return []
    candidates = sorted(candidates)
    no_grad = sorted([(a, b) for a, b, *_ in candidates] + eval_mode)
    # training work: a forward with grad (a forward span in no call without grad), a backward,
    # an optimizer step, an offload
    work = sorted(s[1] for s in spans if s[0] in _TRAINING_WORK or (s[0] == "forward" and not _inside(no_grad, s[1])))
    starts = [a for a, *_ in candidates]
    alone: set[int] = set()
    trains: set[int] = set()
    stretch: list[tuple[int, int]] = []  # per batch: the candidates in its stretch, as a range
    evaluated_before = False  # the batch before: of the same source, its stretch holding only such calls
    for k, t in enumerate(times):
        end = times[k + 1] if k + 1 < len(times) else 1 << 62
        lo, hi = bisect.bisect_left(starts, t), bisect.bisect_left(starts, end)
        stretch.append((lo, hi))
        worked = bisect.bisect_left(work, t) < bisect.bisect_left(work, end)
        if handouts[3 * k + 2] >= rows:  # past the slice's steps (its calls are not candidates)
            evaluated_before = False
            continue
        evaluated = bool(sources[k]) and lo < hi and not worked
        if evaluated and evaluated_before and sources[k - 1] == sources[k]:
            # two batches in a row of one source, each with such calls and no training work: an
            # evaluation's pass over its loader (a batch labelled without grad and trained on
            # after the next read - self-training, FixMatch - is one such batch between training
            # reads: read as an evaluation, its 4 calls had been 0.163 s of eval)
            alone.add(sources[k])
        elif sources[k] and worked and lo == hi:
            trains.add(sources[k])
        evaluated_before = evaluated
    picked = [candidates[i] for k, (lo, hi) in enumerate(stretch)
              if sources[k] in alone and sources[k] not in trains for i in range(lo, hi)]
    return picked


def _inside_evaluation(untrained: list[tuple[int, int, int]], calls: list[tuple[int, int]],
                       recorded: list[list[int]], spans: list[tuple], grad_fwd: list[int]) -> list[tuple[int, int, int]]:
    """The calls of a model only called without grad (``untrained``: start, end, raw step) made
    inside an evaluation of the trained model (``calls``: its evaluation calls): after one of its
    calls in the same step with no training work between (no forward with grad, ``grad_fwd``
    their starts, no backward, optimizer or offload span), and either before its next call
    with none between, or with no forward with grad before the next training work (a teacher
    evaluated next to the student, after the student's last call). A teacher's calls for the
    step's targets come before the student's forward with grad, so they stay ``forward``. A
    teacher evaluated next to the student on batches tpkit does not see (a held list) had its
    evaluation calls counted as the step's forward (0.216 s for 0.124) and, being another
    forward, kept the time between the evaluation's calls out of it."""
    if not untrained or not calls:
        return []
    kinds = sorted([(s[1], False) for s in spans if s[0] in _TRAINING_WORK] + [(t, True) for t in grad_fwd])
    work = [t for t, _ in kinds]
    step_of = {a: step for a, _, _, step in recorded}
    starts = [a for a, _ in calls]
    out = []
    for a, b, step in untrained:
        i = bisect.bisect_right(starts, a) - 1  # the last evaluation call that started before it
        if (i < 0 or calls[i][1] > a or step_of.get(calls[i][0], -1) != step
                or bisect.bisect_right(work, calls[i][1]) < bisect.bisect_left(work, a)):
            continue  # none, overlapping, in another step, or training work between
        j = bisect.bisect_left(starts, b)
        between = (j < len(calls) and step_of.get(calls[j][0], -1) == step
                   and bisect.bisect_right(work, b) >= bisect.bisect_left(work, calls[j][0]))
        w = bisect.bisect_right(work, b)
        if between or w == len(kinds) or not kinds[w][1]:
            out.append((a, b, step))
    return out


def _glue(split_: EvalSplit, recorded: list[list[int]], spans: list[tuple], others: list[int],
          training_batches: list[int], in_range: Callable[[int], bool],
          eval_data: list[int]) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """The stretches between consecutive evaluation calls (``split_.calls``) of one step that
    hold no training work (``others``: the starts of the other forwards; ``training_batches``:
    when the training batches were handed out) and are in no trainer's evaluation (``in_range``),
    as (counted, left other).

    A run of such stretches back to back (one evaluation's calls) is counted only where a batch
    of evaluation data (``eval_data``: when each was handed out) was read inside it. Calls
    without grad in eval mode with other work between and no such batch are as often a step's
    own: an RL rollout calls the trained policy between environment steps, a GRPO step
    generates from it, then both train on what they made; counted, a rollout's 100 ms of
    environment a step had been eval and the verdict EVAL-BOUND. minGPT's ``generate()`` and an
    evaluation fetching its batches through a function tpkit does not see are alike to tpkit:
    their stretches are left other, and the note says how to have them seen (``tp.watch``)."""
    step_of = {a: step for a, _, _, step in recorded}
    work = sorted([s[1] for s in spans if s[0] in _TRAINING_WORK] + others + training_batches)
    runs: list[list[tuple[int, int, int]]] = []
    last_call = None
    for (a1, b1), (a2, _) in zip(split_.calls, split_.calls[1:]):
        step = step_of.get(a1, -1)
        if a2 <= b1 or step < 0 or step_of.get(a2, -1) != step:
            continue  # overlapping, or across a step's end
        if in_range(b1) or in_range(a2) or bisect.bisect_left(split_.ranges, (b1, -1)) < bisect.bisect_left(
                split_.ranges, (a2, -1)):
            continue  # a trainer's evaluation is eval whole already
        if bisect.bisect_right(work, b1) < bisect.bisect_left(work, a2):
            continue  # training work between them (a metric in eval mode after every step)
        if runs and last_call == a1:
            runs[-1].append((b1, a2, step))  # the same evaluation's next stretch
        else:
            runs.append([(b1, a2, step)])
        last_call = a2
    counted: list[tuple[int, int, int]] = []
    left: list[tuple[int, int, int]] = []
    for run in runs:
        seen = bisect.bisect_left(eval_data, run[0][0]) < bisect.bisect_right(eval_data, run[-1][1])
        (counted if seen else left).extend(run)
    return counted, left


def _tails(split_: EvalSplit, recorded: list[list[int]], spans: list[tuple], others: list[int],
           training_batches: list[int], in_range: Callable[[int], bool], eval_data: list[int],
           step_ends: list[int]) -> tuple[list[tuple[int, int, int]], int]:
    """The time after each evaluation's last call up to the loop's next training work, as
    (start, end, raw step), and how many evaluations (in the rows' steps) had theirs left other.

    An evaluation here is a run of evaluation calls (``split_.calls``) of one step with no training
    work between them (``others``: the starts of the other forwards; a backward, optimizer or
    offload span; ``training_batches``: when the training batches were handed out). Its tail runs
    from its last call's end to the first of: the next training work, the wait for the next
    training batch (the last ``data_wait`` that ends by its handout: a validation loader's final
    read, which hands out nothing, lies before it), a trainer's evaluation, the step's end
    (``step_ends``). It holds the evaluation's metric ``compute()``, the logging of its results and
    ``model.train()``: a loop's ``evaluate()`` of 357 ms by its clock had read eval_s 184 ms, its
    metrics' 170 ms of compute training's other, and the verdict "training alone would run up to
    1.58x faster" for 3.48x. The loop's own work ends it too: a user's ``tp.phase`` opening (a
    tracker upload wrapped as the notes advise) or one around the whole evaluation closing, a
    save, a file read, a trace (an on_epoch_end callback after a validation, wrapped in
    ``tp.phase("upload")``, had read eval 0.287 s for the validation's 0.084 s: the tail covered
    the user's phase, which takes no time from a built-in span); the collector's pauses are cut
    out of it (other, as elsewhere outside a phase).

    Counted only where the evaluation read a batch of evaluation data (``eval_data``) between the
    training work before its first call and its last call, as for the time between its calls
    (``_glue``): an RL rollout or ``generate()`` over held tensors reads none, and what follows
    them is the step's own work. Before the first call nothing is added: ``iter()`` of a validation
    loader and its batches' waits are eval already, ``model.eval()`` and what the loop does before
    the evaluation (a log of the training loss) are not told apart."""
    if not split_.calls or not step_ends:
        return [], 0
    step_of = {a: step for a, _, _, step in recorded}
    work = sorted([s[1] for s in spans if s[0] in _TRAINING_WORK] + others + training_batches)
    batches = sorted(training_batches)
    waits = sorted((s[2], s[1]) for s in spans if s[0] == "data_wait")  # (end, start)
    wait_ends = [e for e, _ in waits]
    range_starts = [a for a, _ in split_.ranges]
    calls = split_.calls
    # the loop's own work after the evaluation, which ends its tail: a user's phase opening
    # (``tp.phase("upload")``), a save, a file read, a TorchScript trace (TensorBoard's add_graph);
    # and a user's phase around the whole evaluation closing (one around each of its batches
    # closes right after its last call: its metrics' compute stays the tail). Not a metric call:
    # the evaluation's own metric on all its predictions, called with grad after its no_grad
    # block, is the tail's (a first version ended it there: eval 0.003 s for 0.369); a training
    # metric comes after the next training forward, which ends the tail anyway
    user = sorted((s[2], s[1]) for s in spans if s[4] == USER_PHASE_SOURCE and s[0] != EVAL)  # (end, start)
    user_ends = [e for e, _ in user]
    moved_on = sorted([a for _, a in user] + [s[1] for s in spans if s[0] in ("save", FILE_LOAD, JIT_TRACE)])
    # the collector's pauses: cut out of a tail, they stay other (as ``analysis.steps.gc_pauses`` reads them)
    pauses = sorted((s[1], s[2]) for s in spans if s[0] == GC_PHASE and s[4] != USER_PHASE_SOURCE)
    tails: list[tuple[int, int, int]] = []
    unseen = 0
    i = 0
    while i < len(calls):
        first, end = calls[i]
        step = step_of.get(first, -1)
        j = i + 1
        while (j < len(calls) and step_of.get(calls[j][0], -1) == step
               and bisect.bisect_right(work, end) >= bisect.bisect_left(work, calls[j][0])):
            end = max(end, calls[j][1])  # the same evaluation's next call: no training work between
            j += 1
        i = j
        if step < 0 or step >= len(step_ends) or in_range(first) or in_range(end):
            continue  # a step with no end (after the slice's last), or inside a trainer's evaluation
        w = bisect.bisect_left(work, first)
        since = max(work[w - 1] if w else -1, step_ends[step - 1] if step else -1)
        if bisect.bisect_right(eval_data, since) == bisect.bisect_right(eval_data, end):
            unseen += step < split_.rows
            continue  # no evaluation batch read: a rollout, generate() over held tensors
        bound = step_ends[step]
        w = bisect.bisect_right(work, end)
        if w < len(work):
            bound = min(bound, work[w])
        r = bisect.bisect_right(range_starts, end)
        if r < len(range_starts):
            bound = min(bound, range_starts[r])
        m = bisect.bisect_right(moved_on, end)
        if m < len(moved_on):
            bound = min(bound, moved_on[m])
        u = bisect.bisect_right(user_ends, end)
        while u < len(user) and user[u][0] < bound:
            if user[u][1] <= first:  # opened before the evaluation's first call: around it
                bound = user[u][0]
                break
            u += 1
        b = bisect.bisect_right(batches, end)
        if b < len(batches) and batches[b] <= bound:
            k = bisect.bisect_right(wait_ends, batches[b]) - 1  # the wait that handed it out
            if k >= 0 and wait_ends[k] > end:
                bound = min(bound, max(end, waits[k][1]))
        p = bisect.bisect_left(pauses, (end, -1))
        while bound > end and p < len(pauses) and pauses[p][0] < bound:
            if pauses[p][0] > end:
                tails.append((end, pauses[p][0], step))
            end, p = max(end, pauses[p][1]), p + 1
        if bound > end:
            tails.append((end, bound, step))
    return tails, unseen


def glue_spans(split_: EvalSplit) -> list[tuple]:
    """Raw spans (as ``Recorder.spans``) of the time between consecutive evaluation calls, and
    after an evaluation's last call (``_tails``)."""
    return ([(EVAL, a, b, 0, GLUE, step, None, None) for a, b, step in split_.glue]
            + [(EVAL, a, b, 0, TAIL, step, None, None) for a, b, step in split_.tails])


def relabel_span(split_: EvalSplit, phase: str, start_ns: int, end_ns: int) -> str:
    """A span's phase in the Run: ``eval`` for an evaluation call's forward and its waits."""
    if phase in _CALLS and split_.in_call(start_ns):
        return EVAL
    if phase == "data_wait" and (start_ns, end_ns) in split_.waits:
        return EVAL
    return phase


def relabel_memory(split_: EvalSplit, rows: list[tuple], spans: list[tuple]) -> list[tuple]:
    """Memory rows ``(raw_step, phase, event, t_ns, device, category, bytes)`` with the phase of
    an evaluation call or wait made ``eval`` (``spans`` as for ``split``). A wait's rows are
    stamped just outside its span (the probe runs before the span opens and after it closes):
    each goes with the nearest ``data_wait`` span.

    At those rows what is beyond the known sets is ``other`` whole: their ``activations`` and
    ``temporaries`` are moved into it. The probe had split it by the raw phase, activations at a
    forward's boundaries and other at a wait's, so the same block (the previous call's output
    kept by the loop, 1 MiB) read other at each wait and activations at the next call's enter:
    the evaluation's activations bar jumped by one output at every call. Other is what the same
    evaluation reads inside a trainer's ``evaluate()`` or ``tp.phase("eval")`` (an eval span's
    boundaries are no forward's), and what it is: activations are what a forward keeps for a
    backward, and an evaluation keeps nothing for one (checkpointing them would free nothing, and
    the memory advice reads the activations at the peak)."""
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
    moved: dict[tuple, int] = {}  # (raw_step, event, t_ns, device) of a relabelled row -> bytes made other
    for row in rows:
        phase, t = row[1], row[3]
        if (phase in _CALLS and split_.in_call(t)) or (
                phase == "data_wait" and nearest_wait(t) in split_.waits):
            if row[5] in ("activations", "temporaries"):
                key = (row[0], row[2], t, row[4])
                moved[key] = moved.get(key, 0) + row[6]
                row = (*row[:6], 0)
            row = (row[0], EVAL, *row[2:])
        out.append(row)
    if moved:
        out = [(*row[:6], row[6] + moved.get((row[0], row[2], row[3], row[4]), 0))
               if row[1] == EVAL and row[5] == "other" else row for row in out]
    return out


def in_rows(split_: EvalSplit, eval_s: float) -> bool:
    """Whether any of the evaluation is in the rows' steps (``eval_s``: their eval time). One that
    ran after the last step (Lightning's at the end of an epoch that ended the loop) is in none:
    the run had noted "0 call(s) ... 0.000 s in all" of it, and ``meta["evaluation"]`` all zeros."""
    return bool(split_.model_calls or split_.helper_calls or split_.batches or split_.runs or eval_s > 0)


def note(split_: EvalSplit, eval_s: float) -> str:
    """The run's note on what was counted as evaluation."""
    samples = _counted_samples(split_)
    read = (f", and the {split_.batches} batch(es) read for them ({samples} samples)," if split_.batches else ",")
    helpers = split_.helper_calls
    with_helpers = f" and {helpers} call(s) of a loss or metric (a module without parameters) after them" if helpers else ""
    runs = ", ".join(f"{n} by {who}" for who, n in split_.runs.items())
    whole = (f"; {sum(split_.runs.values())} evaluation(s) ran by a trainer ({runs}), all of their time is eval, "
             "metrics and the gathering of predictions included" if runs else "")
    glue = [(a, b) for a, b, step in split_.glue if step < split_.rows]
    between = (f"; so is the time between consecutive calls with no training work between them where the "
               f"evaluation read its batches there ({len(glue)} stretch(es), {sum(b - a for a, b in glue) / 1e9:.3f} s)"
               if glue else "")
    unseen = [(a, b) for a, b, step in split_.unseen_glue if step < split_.rows]
    if unseen:
        between += (f"; the time between consecutive calls where no evaluation batch was read ({len(unseen)} "
                    f"stretch(es), {sum(b - a for a, b in unseen) / 1e9:.3f} s: an RL rollout's environment, "
                    "generate()'s sampling, batches fetched by a function tpkit does not see) stays other: calls "
                    "like these are as often the step's own work (a rollout, a GRPO step's generation); where they "
                    "are an evaluation fetching its batches by a function, wrap the function in tp.watch "
                    "(get_batch = tp.watch(get_batch), called as get_batch('val')) and that time is eval; "
                    "any evaluation of yours (held tensors sliced, metrics between calls) is eval as a whole "
                    "inside `with tp.phase(\"eval\"):`")
    tails = [(a, b) for a, b, step in split_.tails if step < split_.rows]
    if tails:
        between += (f"; so is the time after an evaluation's last call up to the loop's next training work (the next "
                    f"training batch's wait, a forward with grad, a backward, an optimizer step, the step's end) where "
                    f"the evaluation read its batches ({len(tails)} stretch(es), "
                    f"{sum(b - a for a, b in tails) / 1e9:.3f} s: its metrics' compute, logging, model.train())")
    plain = split_.model_calls + split_.helper_calls > 0 and not split_.runs
    rest = ""
    if plain:
        rest = (". Before an evaluation's first call (model.eval(), what the loop does before it; iter() of a "
                "validation loader and the waits for its batches are eval) the time stays other: nothing tells it "
                "from the step's")
        if split_.unseen_tails:
            rest += (f"; so does the time after the last call of {split_.unseen_tails} evaluation(s) that read no "
                     "batch tpkit saw (held tensors, a function tpkit does not see: wrap it in tp.watch), and the "
                     "verdict's and recommendations' figures then count it as training (its speed-up, the time "
                     "outside every phase)")
        rest += " (`with tp.phase(\"eval\"):` around your evaluation makes it eval whole)"
    return (f"evaluation ran inside the slice: {split_.model_calls} call(s) of the trained model (or a part of it, "
            f"or of a model only called without grad, on batches that fed no training or inside an evaluation) without grad in eval mode (or in train mode on batches from a source that fed no training){with_helpers}{read} {eval_s:.3f} s in all, are counted as eval (eval_s), not "
            f"forward or data_wait, and their samples are not the steps' (samples/s is training's){between}{whole}{rest}. A call of "
            "the trained model without grad in eval mode that is part of training (targets it makes for itself) is "
            "counted as eval too")


def describe(split_: EvalSplit) -> dict[str, Any]:
    """``run.meta["evaluation"]``: what the rows' steps hold."""
    return {"calls": split_.model_calls, "helper_calls": split_.helper_calls,
            "batches": split_.batches, "samples": _counted_samples(split_),
            "runs": dict(split_.runs)}


def _counted_samples(split_: EvalSplit) -> int:
    return sum(n for step, n in split_.samples_by_step.items() if step < split_.rows)
