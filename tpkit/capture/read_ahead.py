"""Batches a loop read ahead of the ones it trained on, told from the batches handed to it.

A loop that reads one batch ahead (timm's ``PrefetchLoader``, the CUDA-prefetcher recipes keep
the next batch while the model trains on this one) takes two batches in its first step and one
in each after: the second is the next step's. Counted as the first step's samples, a slice with
no warmup read 20% more samples/s than the loop trained.
"""

from __future__ import annotations

import bisect


def read_ahead(handouts: list[int], eval_batches: set[int], steps: int) -> tuple[int, int]:
    """Batches (and their samples) the first step was handed beyond what every later step was.
    ``handouts`` flat as ``Recorder.handouts``; ``eval_batches`` their indexes read for
    evaluation (not counted); ``steps``: the slice's raw steps. (0, 0) unless at least two later
    steps were each handed the same number of batches."""
    per_step: list[list[int]] = [[] for _ in range(steps)]
    for k in range(len(handouts) // 3):
        step = handouts[3 * k + 2]
        if step < steps and k not in eval_batches:
            per_step[step].append(handouts[3 * k + 1])
    if steps < 3:
        return 0, 0
    each = len(per_step[1])
    extra = len(per_step[0]) - each
    if each == 0 or extra <= 0 or any(len(p) != each for p in per_step[2:]):
        return 0, 0
    return extra, sum(per_step[0][:extra])


def note(batches: int, samples: int) -> str:
    """The run's note on the batches left out of the first step."""
    return (f"the first step was handed {batches} batch(es) more than each later step: a loader that reads ahead "
            f"of the loop (a prefetcher), a batch taken before it, or batches read and skipped to resume (a Trainer "
            f"resuming from a checkpoint over an IterableDataset); their {samples} samples are not counted as the "
            "first step's (the time spent reading them stays its data_wait)")


def discarded(restarts: list[int], spans: list[tuple], handouts: list[int], sources: list[int],
              eval_batches: set[int], steps: int) -> dict[int, list[int]]:
    """Batches read and thrown away: handed to the loop from a DataLoader that then started again
    (its ``iter()``, ``Recorder.restarts``) before any forward. ``zip(loader_a, loader_b)`` whose
    second loader runs out first reads a batch of the first and drops it; ``for i, b in
    enumerate(loader): if i == n: break`` reads one more than it trains on. Counted, they were
    the step's samples (+13%, +60% samples/s). Only the same loader's restart counts (its
    dataset's id, in ``sources``): another loader cycling, or an evaluation before the training
    forward, drops nothing. Returns {raw step: [samples of each batch]}."""
    if not restarts:
        return {}
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
        while r < len(starts) and starts[r] < nxt and restarts[2 * r + 1] != source:
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


def failed(failed_forwards: list[int], spans: list[tuple], handouts: list[int], eval_batches: set[int],
           steps: int) -> dict[int, int]:
    """Batches the loop skipped after their forward raised (a try/except around the forward,
    then ``continue``): handed out since the backward before a forward that raised, with no
    backward after it before the next batch. Counted, they were the step's samples (8 for 4
    trained; in the first step a note blamed a prefetcher). A backward before the next batch
    keeps them: the loop tried the batch again (an out-of-memory retry at a smaller batch).
    ``failed_forwards`` flat as ``Recorder.failed_forwards``; returns {handout index: raw step}."""
    if not failed_forwards:
        return {}
    backwards = sorted(s[1] for s in spans if s[0] == "backward")
    times = handouts[0::3]
    out: dict[int, int] = {}
    for t in failed_forwards[0::2]:
        b = bisect.bisect_right(backwards, t)
        nxt = bisect.bisect_right(times, t)
        if b < len(backwards) and (nxt == len(times) or backwards[b] < times[nxt]):
            continue  # trained after all
        since = bisect.bisect_right(times, backwards[b - 1]) if b else 0
        for k in range(since, nxt):
            step = handouts[3 * k + 2]
            if k not in eval_batches and step < steps and handouts[3 * k + 1]:
                out[k] = step
    return out


def failed_note(batches: int, samples: int) -> str:
    """The run's note on batches whose forward raised and that the loop skipped."""
    return (f"{batches} batch(es) ({samples} samples) went to a forward that raised and to no backward (the loop "
            "skipped them: a try/except around the forward): they are not counted as the steps' samples (the "
            "forward's time until it raised stays forward_s)")
