"""The loader's verdict from ``run.loader`` (pure: a frame in, a small record out).

Per batch the frame says which worker made it and where its time went: ``fetch_s`` (reading
and transforming samples), ``collate_s``, ``transfer_s`` (slot write + view, pinning, device
copy) and ``queue_wait_s`` (how long the finished batch waited for the training loop).

- A batch that waited in the queue was ready before the loop wanted it: the loader kept up.
- A batch that did not wait means the loop waited for it. Then either the workers were all
  busy (more workers would help: "queue empty"), or they had spare time and the work did not
  reach them fast enough ("workers starved": main process too busy, prefetch too small), or
  moving the batch cost more than making it ("transfer-bound").
- More workers need a core to run on: when the loop waited but the host's cores were already
  busy (the workers, the loop and, with ``main_helps``, the main process making batches while
  it waited), another worker would take CPU from the others: "no free core", and the worker
  count stays.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd

from .clocks import host_load
from .steps import measured

#: A loader that keeps up while the loop still waits this share of its steps says what the wait is.
HANDOVER_SHARE = 0.10
#: Another worker needs about this much of an idle core (host utilisation over the slice).
IDLE_CORES_MIN = 0.5
#: Below this share of a batch's making spent on a core (the rest waiting: storage, a network,
#: a sleep), more workers overlap the waits whether or not a core is free.
CPU_BOUND_SHARE = 0.5
#: The most workers a verdict (or a recommendation, tpkit/analysis/recommend.py) asks for.
MAX_WORKERS = 64

VERDICTS = ("healthy", "queue empty", "workers starved", "transfer-bound", "no free core")
COLUMNS = ("batch", "worker", "fetch_s", "collate_s", "queue_wait_s", "transfer_s")


@dataclass(frozen=True)
class LoaderVerdict:
    """The loader's diagnosis: healthy or starved, why, and the worker count it would use."""
    verdict: str  # one of VERDICTS
    workers: int  # the worker count the loader would choose
    reason: str
    make_s: float  # median fetch + collate per batch, in a worker
    transfer_s: float  # median transfer per batch
    ready_fraction: float  # batches that were waiting when the loop asked


def _measured(steps: pd.DataFrame | None) -> pd.DataFrame | None:
    """The measured steps (``steps.measured``) with a duration and a data wait; None if none."""
    if steps is None or steps.empty or not {"duration_s", "data_wait_s"} <= set(steps.columns):
        return None
    rows = measured(steps) if "warmup" in steps.columns else steps
    return None if rows.empty else rows


def loop_step_s(steps: pd.DataFrame) -> float | None:
    """The training loop's own time per step, data wait excluded: the median of
    ``duration_s - data_wait_s`` over the measured (non-warmup) rows of ``run.steps``."""
    rows = _measured(steps)
    return None if rows is None else float((rows["duration_s"] - rows["data_wait_s"].fillna(0.0)).median())


def _handover_words(steps: pd.DataFrame | None) -> str:
    """Where the loader keeps up but the loop still waits ``HANDOVER_SHARE`` of its steps or
    more, what that wait is (empty otherwise)."""
    rows = _measured(steps)
    if rows is None:
        return ""
    wait_s, step_s = float(rows["data_wait_s"].fillna(0.0).median()), float(rows["duration_s"].median())
    if step_s <= 0 or wait_s < HANDOVER_SHARE * step_s:
        return ""
    return (f"; the loop still waited {wait_s * 1e3:.2f} ms of its {step_s * 1e3:.2f} ms steps: the loader's own "
            f"work in the main process to hand a ready batch over (receiving it, reading its slot), which "
            f"more workers do not shorten")


def idle_cores(clocks: pd.DataFrame | None, meta: dict) -> tuple[float, str] | None:
    """How many of this process's cores stood idle during the slice, on average, and the words
    that say so: the whole host's ``cpu_util_pct`` (``clocks.host_load``) over its
    ``host.cpu_count`` cores. Where the process may use fewer cores than the host has
    (``host.usable_cores``: a container, ``taskset``) the host's mean says nothing about those,
    and this returns None, as it does without a utilisation series."""
    host = meta.get("host") or {}
    count, usable = host.get("cpu_count"), host.get("usable_cores")
    if clocks is None or not count or (usable is not None and usable < count):
        return None
    load = host_load(clocks)
    if load is None:
        return None
    idle = count * max(0.0, 100.0 - load["host_pct"]) / 100.0
    return idle, f"the host's {count} cores were {load['host_pct']:.0f}% busy (about {idle:.1f} idle)"


def loader_verdict(loader: pd.DataFrame, step_s: float | None = None,
                   num_workers: int | None = None, ready_wait_s: float = 1e-3,
                   max_workers: int | None = None, steps: pd.DataFrame | None = None,
                   idle_cores: tuple[float, str] | None = None,
                   make_cpu_share: float | None = None) -> LoaderVerdict:
    """Judge one run's loader.

    loader: rows of ``run.loader``. step_s: the training loop's own time per batch, data wait
    excluded; or pass ``steps=run.steps`` to derive it (``loop_step_s``). Without either the
    verdict relies on queue waits alone. num_workers: workers the run used (default: distinct
    ``worker`` values). ready_wait_s: a batch counts as "was ready" above this wait.
    idle_cores: ``idle_cores``'s (idle cores, words); without it more workers are assumed to
    find a core. make_cpu_share: the share of the making time its threads spent on a core
    (``meta["loader"]["make_cpu_share"]``); a making that mostly waits needs no free core (the
    verdict had said "no free core" of a loader that slept, and more workers doubled its rate).
    """
    if step_s is None and steps is not None:
        step_s = loop_step_s(steps)
    missing = [c for c in COLUMNS if c not in loader.columns]
    if missing:
        raise ValueError(f"loader frame lacks columns {missing}; expected {list(COLUMNS)}")
    if loader.empty:
        return LoaderVerdict("healthy", num_workers or 0, "no batches recorded", 0.0, 0.0, 1.0)
    # worker -1 is the main process (batches it made while it would have waited): not a worker
    if num_workers is None:
        num_workers = max(1, int(loader.loc[loader["worker"] >= 0, "worker"].nunique()))
    W = num_workers
    make_s = float((loader["fetch_s"] + loader["collate_s"]).median())
    transfer_s = float(loader["transfer_s"].median())
    ready = float((loader["queue_wait_s"] > ready_wait_s).mean())
    cap = max_workers if max_workers is not None else MAX_WORKERS
    per_batch_s = make_s + transfer_s
    # Workers needed so batches come at least as fast as the loop takes them (+20% margin).
    need = max(1, math.ceil(1.2 * per_batch_s / step_s)) if step_s and step_s > 0 else None

    if ready >= 0.8:
        fewer = min(W, need) if need is not None else W
        return LoaderVerdict("healthy", min(fewer, cap), f"{ready:.0%} of batches were ready when the "
                             f"loop asked; the loader keeps up{_handover_words(steps)}", make_s, transfer_s, ready)
    if transfer_s > make_s and transfer_s > 0:
        return LoaderVerdict("transfer-bound", min(W, cap), f"moving a batch ({transfer_s * 1e3:.2f} ms) "
                             f"costs more than making it ({make_s * 1e3:.2f} ms): pin memory, "
                             f"send smaller dtypes (uint8 images) and convert on the device",
                             make_s, transfer_s, ready)
    if need is not None and need <= W:
        return LoaderVerdict("workers starved", W, f"{W} workers could make a batch every "
                             f"{per_batch_s / W * 1e3:.2f} ms but the loop waited anyway: the main "
                             f"process hands work out too slowly; raise prefetch or move work "
                             f"out of the training loop", make_s, transfer_s, ready)
    waited = f"only {ready:.0%} of batches were ready when the loop asked and each takes " \
             f"{per_batch_s * 1e3:.2f} ms to make"
    helped = int((loader["worker"] < 0).sum())
    if helped:
        waited += f" (the main process made {helped} of {len(loader)} itself while it waited)"
    waiting = make_cpu_share is not None and make_cpu_share < CPU_BOUND_SHARE
    if waiting:
        waited += (f"; {make_cpu_share:.0%} of that is on a core, the rest waiting (storage, a network): more "
                   "workers overlap the waits, busy cores or not")
    if idle_cores is not None and idle_cores[0] < IDLE_CORES_MIN and not waiting:
        return LoaderVerdict("no free core", min(W, cap), f"{waited}, but {idle_cores[1]}: another "
                             f"worker would take CPU from the loop and the workers there; make batches "
                             f"cheaper (lighter transforms, samples stored decoded, uint8 sent to the "
                             f"device) or give this process more cores", make_s, transfer_s, ready)
    want = need if need is not None else W + 1
    return LoaderVerdict("queue empty", min(max(want, W + 1 if need is None else want), cap),
                         f"{waited}: add workers", make_s, transfer_s, ready)
