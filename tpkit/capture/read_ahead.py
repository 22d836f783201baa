"""Batches a loop read ahead of the ones it trained on, told from the batches handed to it.

A loop that reads one batch ahead (timm's ``PrefetchLoader``, the CUDA-prefetcher recipes keep
the next batch while the model trains on this one) takes two batches in its first step and one
in each after: the second is the next step's. Counted as the first step's samples, a slice with
no warmup read 20% more samples/s than the loop trained.
"""

from __future__ import annotations

import bisect
from collections import Counter


def read_ahead(handouts: list[int], eval_batches: set[int], steps: int,
               untrained: Counter[int] | None = None) -> tuple[int, int]:
    """Batches (and their samples) the first step was handed beyond what every later step was.
    ``handouts`` flat as ``Recorder.handouts``; ``eval_batches`` their indexes read for
    evaluation (not counted); ``steps``: the slice's raw steps; ``untrained``: by raw step,
    batches its forwards raised on (``failed``; one the loop read ahead was handed out in the
    step before). (0, 0) unless at least two later steps were each handed the same number of
    batches."""
    per_step: list[list[int]] = [[] for _ in range(steps)]
    for k in range(len(handouts) // 3):
        step = handouts[3 * k + 2]
        if step < steps and k not in eval_batches:
            per_step[step].append(handouts[3 * k + 1])
    out_of = [untrained[i] if untrained else 0 for i in range(steps)]
    if steps < 3:
        return 0, 0
    each = len(per_step[1]) - out_of[1]
    extra = len(per_step[0]) - out_of[0] - each
    if each <= 0 or extra <= 0 or any(len(p) - o != each for p, o in zip(per_step[2:], out_of[2:])):
        return 0, 0
    return extra, sum(per_step[0][:extra])


def note(batches: int, samples: int) -> str:
    """The run's note on the batches left out of the first step."""
    return (f"the first step was handed {batches} batch(es) more than each later step: a loader that reads ahead "
            f"of the loop (a prefetcher), a batch taken before it, or batches read and skipped to resume (a Trainer "
            f"resuming from a checkpoint over an IterableDataset); their {samples} samples are not counted as the "
            "first step's (the time spent reading them stays its data_wait)")


def discarded(restarts: list[int], spans: list[tuple], handouts: list[int], sources: list[int],
              eval_batches: set[int], steps: int, datasets: dict[int, int] | None = None) -> dict[int, list[int]]:
    """Batches read and thrown away: handed to the loop from a DataLoader that then started again
    (its ``iter()``, ``Recorder.restarts``) before any forward. ``zip(loader_a, loader_b)`` whose
    second loader runs out first reads a batch of the first and drops it; ``for i, b in
    enumerate(loader): if i == n: break`` reads one more than it trains on. Counted, they were
    the step's samples (+13%, +60% samples/s). Only the same loader's restart counts (its
    ``batches.loader_key``, in ``sources``), or that of a DataLoader over the same Dataset
    (``datasets``: ``Recorder.source_datasets``; a loop making its loader anew each epoch,
    whose dropped batch had been counted: 16 samples for 8): another loader cycling, or an
    evaluation before the training forward, drops nothing. Returns {raw step: [samples of
    each batch]}."""
    if not restarts:
        return {}
    datasets = datasets or {}

    def same(key: int, source: int) -> bool:
        return key == source or (key in datasets and datasets[key] == datasets.get(source))
    starts = restarts[0::2]
    forwards = sorted(s[1] for s in spans if s[0] == "forward")
    out: dict[int, list[int]] = {}
    for k in range(len(handouts) // 3):
        t, n, step = handouts[3 * k], handouts[3 * k + 1], handouts[3 * k + 2]
        source = sources[k] if k < len(sources) else 0
        if k in eval_batches or step >= steps or not n or not source:
            continue
        nxt = handouts[3 * (k + 1)] if 3 * (k + 1) < len(handouts) else 1 << 62
        r = bisect.bisect_right(starts, t)
        while r < len(starts) and starts[r] < nxt and not same(restarts[2 * r + 1], source):
            r += 1
        if r < len(starts) and starts[r] < nxt and \
                bisect.bisect_right(forwards, t) == bisect.bisect_right(forwards, starts[r]):
            out.setdefault(step, []).append(n)
    return out


def discarded_note(batches: int, samples: int) -> str:
    """The run's note on batches read and thrown away."""
    return (f"{batches} batch(es) ({samples} samples) were read and dropped before any forward, their loader "
            "then starting again (zip() over loaders of different lengths, a break at the top of an epoch's "
            "loop): they are not counted as the steps' samples (their time stays data_wait)")


def failed(failed_forwards: list[int], spans: list[tuple], handouts: list[int], ids: list[int],
           eval_batches: set[int], steps: int) -> tuple[dict[int, int], list[int]]:
    """Batches the loop skipped after their forward raised (a try/except around the forward,
    then ``continue``), with no backward after it before the next batch. Counted, they were the
    step's samples (8 for 4 trained; in the first step a note blamed a prefetcher). A backward
    before the next batch keeps them: the loop tried the batch again (an out-of-memory retry at
    a smaller batch). The failed batch is the last one handed out, in the forward's step or the
    one before, whose identity (``ids``, ``batches.identity``) is the forward's batch's: a loop
    reading one batch ahead has the next batch out by then (the batches handed out since the
    last backward had been that one: 5 samples out for a skipped 3). With it go the batches
    handed out beside it, no forward between them (two loaders zipped: the loop skips both).
    A forward given a batch changed before it (moved to the GPU, cast) matches none: its batch
    is the one handed out since the last backward (``_since_backward``) unless the loop reads
    ahead, where that one is the next batch and nothing is counted out. ``failed_forwards``
    flat as ``Recorder.failed_forwards``. Returns ({handout index: raw step of the forward that
    raised, whose samples it is counted out of}, the raw steps of the forwards whose batch tpkit
    could not tell)."""
    if not failed_forwards:
        return {}, []
    backwards = sorted(s[1] for s in spans if s[0] == "backward")
    forwards = sorted(s[1] for s in spans if s[0] == "forward")
    times = handouts[0::3]
    out: dict[int, int] = {}
    unknown: list[tuple[int, int]] = []  # (ns, raw step) of forwards whose batch none matched
    for f in range(0, len(failed_forwards), 3):
        t, ident, raised_step = failed_forwards[f:f + 3]
        b = bisect.bisect_right(backwards, t)
        nxt = bisect.bisect_right(times, t)
        if b < len(backwards) and (nxt == len(times) or backwards[b] < times[nxt]):
            continue  # trained after all
        k = _last_with(ids, ident, nxt, handouts, raised_step - 1)
        if k is None:
            unknown.append((t, raised_step))
            continue
        for j in _handed_beside(k, times, forwards):
            if j not in eval_batches and raised_step < steps and handouts[3 * j + 1]:
                out[j] = raised_step
    if unknown:
        guessed = _since_backward(unknown, backwards, times, handouts, eval_batches, steps)
        if guessed and not read_ahead(handouts, eval_batches, steps, Counter([*out.values(), *guessed.values()]))[0]:
            return {**out, **guessed}, []
    return out, [step for _, step in unknown]


def _since_backward(forwards: list[tuple[int, int]], backwards: list[int], times: list[int],
                    handouts: list[int], eval_batches: set[int], steps: int) -> dict[int, int]:
    """The batches handed out between the backward before each forward (ns, raw step) and it:
    that forward's batch where the loop takes each batch after the previous backward."""
    out: dict[int, int] = {}
    for t, raised_step in forwards:
        b = bisect.bisect_right(backwards, t)
        since = bisect.bisect_right(times, backwards[b - 1]) if b else 0
        for k in range(since, bisect.bisect_right(times, t)):
            if k not in eval_batches and raised_step < steps and handouts[3 * k + 1]:
                out[k] = raised_step
    return out


def _last_with(ids: list[int], ident: int, before: int, handouts: list[int], from_step: int) -> int | None:
    """The last handout before index ``before``, of raw step ``from_step`` or later, whose
    identity is ``ident`` (None: none; an identity 0 matches nothing)."""
    k = before - 1
    while ident and k >= 0 and handouts[3 * k + 2] >= from_step:
        if k < len(ids) and ids[k] == ident:
            return k
        k -= 1
    return None


def _handed_beside(k: int, times: list[int], forwards: list[int]) -> range:
    """Handout ``k`` and the ones handed out next to it, no forward starting between them."""
    f = bisect.bisect_right(forwards, times[k])
    after = forwards[f] if f < len(forwards) else 1 << 62
    before = forwards[f - 1] if f else -1
    return range(bisect.bisect_right(times, before), bisect.bisect_left(times, after))


def unmatched_note(forwards: int) -> str:
    """The run's note on forwards that raised, with no backward after them, on no batch tpkit knew."""
    return (f"{forwards} forward(s) raised and the loop went on without a backward (a try/except around the "
            "forward), but tpkit could not tell which batch they were given (none handed out in that step or the "
            "one before had their first tensor: a batch moved, cast or made anew before the forward, in a loop "
            "that reads ahead): their samples stay counted as the steps'")


def failed_note(batches: int, samples: int) -> str:
    """The run's note on batches whose forward raised and that the loop skipped."""
    return (f"{batches} batch(es) ({samples} samples) went to a forward that raised and to no backward (the loop "
            "skipped them: a try/except around the forward): they are not counted as the steps' samples (the "
            "forward's time until it raised stays forward_s)")
