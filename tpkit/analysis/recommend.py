"""Recommendations: pure functions over a Run's frames and meta, each naming a knob to turn.

Every rule reads only measured steps (warmup excluded), states the numbers it saw in
``evidence``, estimates what turning the knob could win in ``expected_gain`` (text) and
``gain`` (a number in ``gain_unit``: ``"x"`` for a speedup of samples/s, ``"bytes"`` for memory
freed), and proposes ``action``: knob -> new value, which the tuner applies and reruns. An
empty ``action`` means the fix lies outside what the tuner turns (power or cooling, a
trainer's evaluation or checkpoint interval).

Knob names (the tuner's ``train_fn(**knobs)`` receives them; a user's own knobs of the same
name are changed in place): ``num_workers``, ``loader`` ("tpkit"), ``pin_memory``,
``non_blocking``, ``fused_optimizer``, ``offload_kernel``, ``core_binding``, ``offload``,
``activation_checkpointing``, ``fused_cross_entropy``, ``batch_size``, ``cuda_graphs``,
``persistent_workers``.

Speedup estimates are of samples/s of the whole loop as it runs, so that they compare and rank:
rules of training's knobs judge shares of training time (evaluation, saving, setup and
compilation left out, as the verdict does) but quote their gain with that time still in the
step. They are upper bounds from Amdahl's law on the measured totals: removing a
phase that takes ``p`` of ``d`` seconds gives at most ``d / (d - p)``; a phase made ``f`` times
faster gives ``d / (d - p + p / f)``. More loader workers are the exception: the gain quoted
is the proposed count's (``data_stall``), not the wait removed. Factors that cannot be
measured from the run are named constants below, each with where it comes from.
"""

from __future__ import annotations

import copy
import math
import warnings
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import pandas as pd

from ..schema import MIB, PHASE_COLUMNS
from .compare import clean_measured
from .loader import CPU_BOUND_SHARE
from .loader import MAX_WORKERS as MAX_LOADER_WORKERS
from .steps import (
    INPUT_LIMITED,
    INTERRUPTIONS,
    NAME_IT,
    ONE_PLACE,
    OPTIMIZER_BOUND,
    OVERHEAD_BOUND,
    TAIL_PLACES,
    USER_PHASE_NAMED,
    USER_PHASES_OF_OTHER,
    WATCH_IT,
    OtherParts,
    batches_seen,
    gc_free_steps,
    gc_pauses,
    measured,
    other_parts,
    place_text,
)

if TYPE_CHECKING:
    from ..run import Run
    from .loader import LoaderVerdict

#: A data wait of this share of step time is worth fixing (TraceML warns at 10%).
DATA_STALL_SHARE = INPUT_LIMITED
#: The wait sits in the loader's starts (its ``iter()``, which starts non-persistent workers each
#: epoch) when the steps holding one have at least this share of the wait and the median step's
#: wait is under this share of the mean.
RESTART_WAIT_SHARE = 0.5
#: Host-to-device copies above this share of step time.
COPY_SHARE = 0.10
#: Optimizer or offload step above this share of step time.
HOST_STEP_SHARE = OPTIMIZER_BOUND
#: Evaluation or checkpoint saving inside the slice above this share of step time.
INTERRUPTION_SHARE = 0.10
#: Peak memory at or above this share of the device's capacity.
MEMORY_NEAR = 0.85
#: A memory category worth freeing holds at least this share of the peak.
MEMORY_CATEGORY_SHARE = 0.25
#: GPU steps faster than this are dominated by kernel launches, not by the kernels.
LAUNCH_BOUND_P50_S = 0.002
#: Time outside every phase above this share of step time.
OVERHEAD_SHARE = OVERHEAD_BOUND
#: Code run every step that could run every this many steps instead (logging, metrics): the
#: gain quoted beside the whole time's removal.
LESS_OFTEN = 10
#: Assumed speedup of the host optimizer step from a fused kernel: conservative next to the
#: ~4.9x measured from torch foreach to fused AdamW on 50M params (docs/MEASURED.md).
FUSED_OPTIMIZER_FACTOR = 2.0
#: Core binding of the host step: ~1.3x (DeepSpeed PR #7474).
CORE_BINDING_FACTOR = 1.3


@dataclass
class Recommendation:
    """One piece of advice: the knob, the evidence, the expected gain and the action to try."""

    kind: str            # the rule: data-stall, data-loader, copies, host-optimizer, ...
    knob: str            # the knob to turn
    title: str           # one line, imperative
    evidence: str        # what was measured, with the numbers
    expected_gain: str   # what turning the knob could win, in words
    gain: float          # the same as a number, in gain_unit (NaN: cannot be estimated)
    gain_unit: str       # "x" (speedup of samples/s) or "bytes" (memory freed)
    action: dict[str, Any] = field(default_factory=dict)  # knob -> new value for the tuner

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_text(self) -> str:
        act = ", ".join(f"{k}={v!r}" for k, v in self.action.items())
        return f"{self.title}\n  evidence: {self.evidence}\n  expected: {self.expected_gain}" + (
            f"\n  try: {act}" if act else "")


# -- small facts about a run -----------------------------------------------------------------

def amdahl(total_s: float, part_s: float, factor: float = math.inf) -> float:
    """Speedup of the whole when ``part_s`` of ``total_s`` becomes ``factor`` times faster
    (``inf``: removed). NaN when nothing was measured."""
    if total_s <= 0:
        return float("nan")
    rest = total_s - part_s + (part_s / factor if math.isfinite(factor) else 0.0)
    return total_s / rest if rest > 0 else float("inf")


def _knobs(meta: dict) -> dict[str, Any]:
    k = meta.get("knobs")
    return dict(k) if isinstance(k, dict) else {}


def _persistent(meta: dict) -> bool:
    """Whether the run's loader keeps its workers between epochs: its ``persistent_workers``
    knob, else what the training batches' DataLoader said (``meta["torch_loader"]``). A
    persistent loader's epochs still begin with a batch made from nothing (its workers stop at
    an epoch's last index): advice had asked it to set ``persistent_workers=True``."""
    return _knobs(meta).get("persistent_workers") is True \
        or (meta.get("torch_loader") or {}).get("persistent_workers") is True


def on_gpu(meta: dict) -> bool:
    """Whether the slice ran with a CUDA device (``meta['devices']`` lists ``cuda:N: name``)."""
    return any(str(d).startswith("cuda") for d in meta.get("devices") or [])


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


@dataclass
class _Totals:
    steps: int
    total_s: float
    phase_s: dict[str, float]
    p50_s: float
    samples_per_step: float
    left_out: str = ""  # the interruptions taken out of ``total_s`` (training time), with their shares of the step
    away_s: float = 0.0  # their time, summed over the steps: in the whole step, out of ``total_s``

    @property
    def of(self) -> str:
        """What the shares are of, as the verdict says it (analysis/steps.py ``verdict``)."""
        return f"training time ({self.left_out} of the step left out)" if self.left_out else "step time"

    @property
    def whole_s(self) -> float:
        """The steps' whole time, interruptions included: what every gain is quoted on. A knob
        of training's leaves an evaluation or a save in the step as it was, so samples/s of the
        loop as it runs moves by ``whole / (whole - saved)``; quoted on training time alone, 1 worker
        for a 30 ms wait in 102 ms steps (40 ms of them evaluation) had read 1.97x where the loop
        ran 1.39x, and ranked above the evaluation's 1.67x."""
        return self.total_s + self.away_s

    def speedup(self, part_s: float, factor: float = math.inf) -> float:
        """``amdahl`` on the whole steps: samples/s of the loop as it runs, interruptions kept."""
        return amdahl(self.whole_s, part_s, factor)

    def share(self, col: str) -> float:
        return self.phase_s.get(col, 0.0) / self.total_s if self.total_s > 0 else 0.0

    def per_step_ms(self, col: str) -> str:
        return _ms(self.phase_s.get(col, 0.0) / self.steps) if self.steps else "n/a"


def _totals(steps: pd.DataFrame, training: bool = False) -> _Totals:
    """The measured steps' sums, over the steps with a finite duration only (as ``compare``
    reads them): a NaN duration left out of the sum but counted in the steps and the phase sums
    had read 1 NaN step of 4 at 100 ms with 30 ms waits as 30 ms of 75 ms, 40%. ``training``:
    what interrupts training (``steps.INTERRUPTIONS``: evaluation, saving, a trainer's setup,
    compilation) left out of the total and the phases, as the verdict judges training (a data
    wait of 21% of steps that were 77% a trainer's setup is 91% of training's time). Shares are
    judged on that total; gains on ``whole_s``, the interruptions kept in the step."""
    m, _ = clean_measured(steps)
    if m.empty:
        return _Totals(0, 0.0, {}, float("nan"), float("nan"))
    phase_s = {c: float(m[c].sum()) for c in PHASE_COLUMNS if c in m.columns}
    # no less than the phases' own sum (a span charged whole to its first step, running on past
    # its end, steps.phase_shares): no share over 100%, no negative gain
    total = max(float(m["duration_s"].sum()), sum(phase_s.values()))
    left_out, away_s = "", 0.0
    if training:
        away = {c: phase_s.pop(c) for c in INTERRUPTIONS if c in phase_s}
        if sum(away.values()) > 0 and total > sum(away.values()):
            away_s = sum(away.values())
            left_out = " and ".join(f"{INTERRUPTIONS[c][1]} {v / total:.0%}" for c, v in away.items() if v > 0)
            total -= away_s
    return _Totals(len(m), total, phase_s, float(m["duration_s"].median()), float(m["samples"].median()), left_out,
                   away_s)


# -- the rules ---------------------------------------------------------------------------------

def current_workers(meta: dict) -> int | None:
    """The loader workers the run used: its ``num_workers`` knob, else what tpkit's loader
    recorded (``meta["loader"]``), else the ``num_workers`` of the torch DataLoader the training
    batches came from (``meta["torch_loader"]``; "now 0" had been said of a 4-worker loader);
    None where none says."""
    for cur in (_knobs(meta).get("num_workers"), (meta.get("loader") or {}).get("num_workers"),
                (meta.get("torch_loader") or {}).get("num_workers")):
        if isinstance(cur, (int, float)) and not isinstance(cur, bool):
            return int(cur)
    return None


def loader_advice(run: "Run") -> "LoaderVerdict | None":
    """The ONE source of loader-worker advice (summary, loader tab, tuner, report): the
    loader verdict of ``tpkit.analysis.loader`` over the run's loader rows and measured steps,
    with the worker count the run used; None when tpkit's loader recorded nothing."""
    if run.loader is None or run.loader.empty:
        return None
    from .loader import idle_cores, loader_verdict

    share = (run.meta.get("loader") or {}).get("make_cpu_share")
    return loader_verdict(run.loader, steps=run.steps, num_workers=current_workers(run.meta),
                          idle_cores=idle_cores(run.clocks, run.meta),
                          make_cpu_share=share if isinstance(share, (int, float)) else None)


def host_cores(meta: dict) -> int | None:
    """The cores this process could run on during the slice (``meta['host']``: its affinity
    mask's ``usable_cores``, else the host's ``cpu_count``); None where the run does not say."""
    host = meta.get("host") or {}
    for key in ("usable_cores", "cpu_count"):
        n = host.get(key)
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            return n
    return None


@dataclass(frozen=True)
class _Making:
    """How long one batch takes to make, one at a time, and how the run knows it."""

    batch_s: float
    how: str
    cpu_bound: bool | None  # its making mostly on a core (tp.data.Loader measures it); None: not measured


def _making(run: "Run", t: _Totals, workers: int, v: "LoaderVerdict | None") -> _Making:
    """A batch's making time: tp.data.Loader's measured fetch + collate + transfer; with 0
    workers, the loop's wait (it made each batch itself, one at a time); with ``workers``
    that kept the loop waiting, ``workers`` x the whole step (each made one batch per that many
    steps; workers go on making while the loop evaluates or saves)."""
    step_s, wait_s = t.whole_s / t.steps, t.phase_s["data_wait_s"] / t.steps
    if v is not None:
        share = (run.meta.get("loader") or {}).get("make_cpu_share")
        cpu = share >= CPU_BOUND_SHARE if isinstance(share, (int, float)) else None
        return _Making(v.make_s + v.transfer_s, "tpkit's loader measured it", cpu)
    if workers == 0:
        return _Making(wait_s, "the loop made each batch itself, one at a time: its wait", None)
    return _Making(workers * step_s, f"{workers} workers kept the loop waiting: each made a batch every "
                   f"{workers} steps of {_ms(step_s)}", None)


def workers_to_hide(making_s: float, compute_s: float) -> int:
    """Workers that together make a batch while the loop computes one step:
    ceil(making / compute), at most ``MAX_LOADER_WORKERS``."""
    if compute_s <= 0:
        return MAX_LOADER_WORKERS
    return max(1, min(MAX_LOADER_WORKERS, math.ceil(making_s / compute_s - 1e-9)))


def step_with_workers(workers: int, making_s: float, compute_s: float) -> float:
    """A step's time with ``workers`` making batches side by side: the loop's own time, or a
    batch every making / workers where that is longer (each worker needing a core of its own
    where the making computes: the caller caps ``workers`` at the cores)."""
    return max(compute_s, making_s / workers)


def _workers_gain(t: _Totals, workers: int, making: _Making, compute_s: float, assumes: str) -> tuple[str, float]:
    """The speedup ``workers`` give, in words and as a number: of the whole step (``compute_s``, the
    loop's own work, holds its evaluation or saving: workers make batches meanwhile)."""
    step_s = t.whole_s / t.steps
    new_s = step_with_workers(workers, making.batch_s, compute_s)
    speedup = step_s / new_s if new_s > 0 else float("inf")
    return (f"about {speedup:.2f}x samples/s with {_count(workers, 'worker')} ({_ms(step_s)} -> {_ms(new_s)} per step: "
            f"a batch every {_ms(making.batch_s / workers)}, the loop's own work {_ms(compute_s)}; {assumes})",
            speedup)


def data_stall(run: "Run") -> list[Recommendation]:
    """The loop waits for batches: the worker count that hides the wait (with tpkit's loader,
    exactly as many as its verdict says: ``loader_advice``), or tpkit's loader when the run used
    another. The gain quoted is that count's, not the whole wait's: with ``n`` workers a step
    takes about max(the loop's own work, making / n) (it had quoted the wait removed outright,
    51x, for 2 workers that gave 1.97x). Where the wait sits in the steps a loader started its
    workers in (``_restart_steps``), ``persistent_workers=True`` first, and the worker count
    from the other steps only."""
    t = _totals(run.steps, training=True)
    if t.steps == 0 or t.share("data_wait_s") < DATA_STALL_SHARE:
        return []
    m, _ = clean_measured(run.steps)
    starts = _restart_steps(run, m)
    if not starts:
        return _worker_advice(run, t, f"over {t.steps} measured steps")
    out = _restart_advice(run, t, m, starts)
    typical = _totals(m[~m["step"].isin(starts)], training=True)
    if typical.share("data_wait_s") >= DATA_STALL_SHARE:
        out += _worker_advice(run, typical, f"over the {typical.steps} measured steps without a loader start")
    return out


def _restart_steps(run: "Run", m: pd.DataFrame) -> list[int]:
    """The measured steps in which a loader's ``iter()`` ran (a ``data_wait`` span whose source
    ends in ``.__iter__``: phases.py ``_wrap_iter``), where they hold the wait: at least
    ``RESTART_WAIT_SHARE`` of it, fewer than half the steps, and the median step's wait under
    that share of the mean. Non-persistent workers start there each epoch (a 2-worker loader of
    4 batches an epoch waited ~120 ms there, ~0 elsewhere); a wait spread over every step, or in
    bursts of ``num_workers`` batches, holds no start and reads []."""
    sp = run.spans
    if sp.empty or m.empty:
        return []
    iters = sp[(sp["phase"] == "data_wait") & sp["source"].astype(str).str.endswith(".__iter__")]
    starts = sorted(set(iters["step"].astype(int)) & set(m["step"].astype(int)))
    wait = m["data_wait_s"].astype("float64")
    total = float(wait.sum())
    held = float(wait[m["step"].isin(starts)].sum())
    if not starts or 2 * len(starts) >= len(m) or total <= 0 or held < RESTART_WAIT_SHARE * total \
            or float(wait.median()) >= RESTART_WAIT_SHARE * float(wait.mean()):
        return []
    return starts


def _restart_advice(run: "Run", t: _Totals, m: pd.DataFrame, starts: list[int]) -> list[Recommendation]:
    """The wait of the loader's starts beyond a typical step's (the median wait of the steps
    without one): ``persistent_workers=True`` keeps the workers between epochs and removes it,
    where the run does not show it set already. Its making is not ``n`` x the step: the mean
    step of such a run (2 workers, 20 ms a batch) had read a 122.6 ms making, and "4 workers,
    about 1.87x" that measured 0.76x, where persistent workers gave 1.5x."""
    wait = m.set_index("step")["data_wait_s"].astype("float64")
    rest = wait[~wait.index.isin(starts)]
    typical_s = float(rest.median()) if not rest.empty else 0.0
    excess_s = float((wait[wait.index.isin(starts)] - typical_s).clip(lower=0.0).sum())
    evidence = (f"data wait is {t.share('data_wait_s'):.0%} of {t.of} over {t.steps} measured steps, "
                f"{excess_s / float(wait.sum()):.0%} of it beyond a typical step's {_ms(typical_s)} in the "
                f"{_count(len(starts), 'step')} where the loader started its workers (its iter(), each epoch: "
                f"step{'s' if len(starts) != 1 else ''} {', '.join(map(str, starts))}): "
                f"{_ms(excess_s / len(starts))} a start")
    known = current_workers(run.meta)
    if _persistent(run.meta) or known == 0:
        return []  # already kept, or no workers to keep: what restarts is the user's own
    speedup = t.speedup(excess_s)
    return [Recommendation("data-restart", "persistent_workers",
                           "Keep the loader's workers between epochs (DataLoader persistent_workers=True)", evidence,
                           f"up to {speedup:.2f}x samples/s over the slice, were the starts' wait beyond a typical "
                           "step's removed", speedup, "x", {"persistent_workers": True})]


def _worker_advice(run: "Run", t: _Totals, scope: str) -> list[Recommendation]:
    """The worker count (or loader) that hides the wait of the steps ``t`` sums."""
    share = t.share("data_wait_s")
    known = current_workers(run.meta)
    cur_n = known or 0
    compute_s = (t.whole_s - t.phase_s["data_wait_s"]) / t.steps  # the loop's own work, between its batches
    evidence = (f"data wait is {share:.0%} of {t.of} ({t.per_step_ms('data_wait_s')} per step of "
                f"{_ms(t.total_s / t.steps)}{_whole(t)}) {scope}")
    v = loader_advice(run)
    making = _making(run, t, cur_n, v)
    if v is not None:
        evidence += (f"; tpkit's loader: {v.verdict}, a batch takes {_ms(v.make_s)} to make per worker: "
                     f"{v.workers} workers keep up")
        if v.workers <= cur_n:  # more workers would not help: say what the loader verdict says
            return [Recommendation("data-loader", "loader", f"Loader {v.verdict}: {v.reason}", evidence,
                                   "more workers would not help; the gain depends on the fix", float("nan"), "x", {})]
        gain, speedup = _workers_gain(t, v.workers, making, compute_s, "the loader's verdict chose the count")
        return [Recommendation("data-stall", "num_workers", f"Use {_count(v.workers, 'loader worker')} ({_now(known)})",
                               evidence, gain, speedup, "x", {"num_workers": v.workers})]
    evidence += f"; a batch takes about {_ms(making.batch_s)} to make ({making.how})"
    return _workers_for_another_loader(run, t, known, making, compute_s, evidence)


def _whole(t: _Totals) -> str:
    """``", the whole step X"`` where shares are of training time (an interruption left out)."""
    return f"; the whole step {_ms(t.whole_s / t.steps)}" if t.away_s > 0 and t.steps else ""


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'s' if n != 1 else ''}"


def _now(known: int | None) -> str:
    return f"now {known}" if known is not None else "the loader's own count not known"


def _workers_for_another_loader(run: "Run", t: _Totals, known: int | None, making: _Making, compute_s: float,
                                evidence: str) -> list[Recommendation]:
    """A loader tpkit did not measure (a torch DataLoader): whether its making computes or
    waits is not known. The count that hides the wait, capped at the cores (making that
    computes needs a core per worker); where more would help a making that waits (storage, a
    network), tp.data.Loader with that count: its run measures the making's share on a core."""
    cur_n = known or 0
    need = max(workers_to_hide(making.batch_s, compute_s), min(cur_n + 1, MAX_LOADER_WORKERS))
    cores = host_cores(run.meta)
    capped = min(need, cores) if cores is not None else need
    out = []
    if capped > cur_n:
        assumes = (f"making that computes needs a core per worker: capped at the host's {cores} cores" if capped < need
                   else "if each worker finds a core or its making waits" if cores is None
                   else f"within the host's {cores} cores")
        gain, speedup = _workers_gain(t, capped, making, compute_s, assumes)
        out.append(Recommendation("data-stall", "num_workers", f"Use {_count(capped, 'loader worker')} ({_now(known)})",
                                  evidence, gain, speedup, "x", {"num_workers": capped}))
    if _knobs(run.meta).get("loader") == "tpkit":
        return out
    if capped < need:  # a figure under an assumption the run cannot check: in words, ranked after the rest
        gain, _ = _workers_gain(t, need, making, compute_s, "if the making waits (storage, a network) rather "
                                "than computes; tp.data.Loader's run measures which")
        speedup = float("nan")
        title = f"Load batches with tp.data.Loader and {need} workers if the making waits rather than computes"
    elif out:
        gain, speedup, title = out[0].expected_gain, out[0].gain, \
            "Load batches with tp.data.Loader (shared-memory slots, threads or processes)"
    else:
        return out
    out.append(Recommendation("data-loader", "loader", title, evidence, gain, speedup, "x",
                              {"loader": "tpkit", "num_workers": need if capped < need else capped}))
    return out


def _interruption(run: "Run", col: str, kind: str, knob: str, title: str, extra: str = "") -> list[Recommendation]:
    """Something that interrupts training inside the slice (``steps.INTERRUPTIONS``) takes a
    visible share: training waits for it. Its knob is the trainer's: named, not turned."""
    t = _totals(run.steps)
    share = t.share(col)
    if t.steps == 0 or share < INTERRUPTION_SHARE:
        return []
    speedup = amdahl(t.total_s, t.phase_s[col])
    _, what, knobs = INTERRUPTIONS[col]
    return [Recommendation(
        kind, knob, title, f"{what} takes {share:.0%} of step time ({t.per_step_ms(col)} per step){extra}",
        f"up to {speedup:.2f}x training samples/s over the slice, were none of its time spent so ({knobs})",
        speedup, "x", {})]


def evaluation(run: "Run") -> list[Recommendation]:
    """Evaluation inside the slice (``eval_steps``, ``val_check_interval``, ``limit_val_batches``)."""
    seen = run.meta.get("evaluation") or {}
    extra = (f" ({seen['calls']} call(s) of the trained model and {seen['batches']} batch(es) in the slice)"
             if seen else "")
    return _interruption(run, "eval_s", "evaluation", "eval_interval", "Evaluate less often, or on fewer batches",
                         extra)


def saving(run: "Run") -> list[Recommendation]:
    """Checkpoints written inside the slice (``save_steps``, ``every_n_train_steps``)."""
    return _interruption(run, "save_s", "saving", "save_interval",
                         "Save checkpoints less often, or in the background")


def compilation(run: "Run") -> list[Recommendation]:
    """torch.compile compiling inside the measured steps (a recompile on a new input shape, an
    evaluation's first call: not only recompiles, as its title had said)."""
    return _interruption(run, "compile_s", "compilation", "dynamic_shapes",
                         "Keep torch.compile's compilations out of the measured steps")


def setup(run: "Run") -> list[Recommendation]:
    """A trainer's setup inside the measured steps (a sweep's next Trainer, train() / fit() called
    again): the slice starts after it, or the warmup covers it. Had no rule: a SETUP-BOUND run
    was told only to add loader workers."""
    return _interruption(run, "setup_s", "setup", "warmup",
                         "Keep the trainer's setup out of the measured steps (profile one train() / fit() "
                         "call, its setup in the warmup)")


def copies(run: "Run") -> list[Recommendation]:
    """Host-to-device copies take a visible share: pinned memory and non-blocking copies let
    them overlap with compute."""
    t = _totals(run.steps, training=True)
    share = t.share("h2d_s")
    if t.steps == 0 or share < COPY_SHARE:
        return []
    knobs = _knobs(run.meta)
    action = {k: True for k in ("pin_memory", "non_blocking") if knobs.get(k) is not True}
    if not action:
        return []  # already pinned and non-blocking: what is left is bandwidth, not a knob
    speedup = t.speedup(t.phase_s["h2d_s"])
    return [Recommendation(
        "copies", "pin_memory", "Pin host batches and copy them with non_blocking=True",
        f"host-to-device copies take {share:.0%} of {t.of} ({t.per_step_ms('h2d_s')} per step)",
        f"up to {speedup:.2f}x samples/s if the copies overlap completely with compute", speedup, "x", action)]


def host_step(run: "Run") -> list[Recommendation]:
    """The optimizer (on the host, or offloaded) dominates: a faster kernel, then core binding."""
    t = _totals(run.steps, training=True)
    if t.steps == 0:
        return []
    opt, off = t.share("optimizer_s"), t.share("offload_s")
    names = " ".join(str(o) for o in run.meta.get("optimizers") or [])
    host = not on_gpu(run.meta) or off > 0 or "CPU" in names or "Offload" in names
    if not host or max(opt, off) < HOST_STEP_SHARE:
        return []
    part = t.phase_s.get("optimizer_s", 0.0) + t.phase_s.get("offload_s", 0.0)
    what = "offloaded optimizer step" if off >= opt else "host optimizer step"
    evidence = (f"the {what} takes {(opt + off):.0%} of {t.of} ({_ms(part / t.steps)} per step: "
                f"optimizer {opt:.0%}, offload {off:.0%})" + (f"; optimizers: {names}" if names else ""))
    knobs = _knobs(run.meta)
    out = []
    if off >= opt:
        if knobs.get("offload_kernel") not in ("auto", "deepspeed"):
            s = t.speedup(part, FUSED_OPTIMIZER_FACTOR)
            out.append(Recommendation("host-optimizer", "offload_kernel", "Let offload pick its fastest host kernel",
                                      evidence, f"about {s:.2f}x if the host step runs {FUSED_OPTIMIZER_FACTOR:g}x faster "
                                      "(assumed; measure it)", s, "x", {"offload_kernel": "auto"}))
    elif knobs.get("fused_optimizer") is not True:
        s = t.speedup(part, FUSED_OPTIMIZER_FACTOR)
        out.append(Recommendation("host-optimizer", "fused_optimizer", "Use the fused optimizer kernel (fused=True)",
                                  evidence, f"about {s:.2f}x if the step runs {FUSED_OPTIMIZER_FACTOR:g}x faster "
                                  "(assumed; foreach -> fused measured ~4.9x on 50M params)", s, "x",
                                  {"fused_optimizer": True}))
    if knobs.get("core_binding") is not True:
        s = t.speedup(part, CORE_BINDING_FACTOR)
        out.append(Recommendation("host-optimizer", "core_binding", "Bind the host step's threads to cores",
                                  evidence, f"about {s:.2f}x if the host step gains {CORE_BINDING_FACTOR:g}x "
                                  "(DeepSpeed PR #7474)", s, "x", {"core_binding": True}))
    return out


def capacity_bytes(meta: dict) -> dict[str, int]:
    """device -> bytes the device can hold, from the memory probe's ``meta['memory']
    ['capacity_bytes']`` (or a top-level ``memory_capacity_bytes``)."""
    mem = meta.get("memory")
    cap = mem.get("capacity_bytes") if isinstance(mem, dict) else None
    cap = cap if cap is not None else meta.get("memory_capacity_bytes")
    if isinstance(cap, dict):
        return {str(k): int(v) for k, v in cap.items() if isinstance(v, (int, float)) and v > 0}
    return {}


def peak_by_category(memory: pd.DataFrame, device: str) -> tuple[float, dict[str, float]]:
    """The largest total at one recorded boundary of ``device`` and its bytes by category."""
    d = memory[memory["device"].astype(str) == device]
    if d.empty:
        return 0.0, {}
    keys = ["step", "phase", "event", "t_s"]
    groups = d.groupby(keys, sort=False)
    totals = groups["bytes"].sum()
    rows = groups.get_group(totals.idxmax())
    return float(totals.max()), {str(c): float(b) for c, b in zip(rows["category"], rows["bytes"])}


def memory_pressure(run: "Run") -> list[Recommendation]:
    """Peak memory near the device's capacity: offload optimizer state, checkpoint
    activations, fuse the loss so the logits never exist whole."""
    caps = capacity_bytes(run.meta)
    if run.memory.empty or not caps:
        return []
    knobs = _knobs(run.meta)
    out = []
    for device, cap in sorted(caps.items(), key=lambda kv: (kv[0] == "cpu", kv[0])):  # GPUs first
        peak, cats = peak_by_category(run.memory, device)
        if peak <= 0 or peak / cap < MEMORY_NEAR:
            continue
        share = {c: b / peak for c, b in cats.items()}
        mix = ", ".join(f"{c} {b / MIB:,.0f} MiB" for c, b in sorted(cats.items(), key=lambda kv: -kv[1]) if b > 0)
        evidence = (f"peak {peak / MIB:,.0f} MiB on {device} is {peak / cap:.0%} of its "
                    f"{cap / MIB:,.0f} MiB ({mix})")
        state = cats.get("optimizer_state", 0.0) + cats.get("gradients", 0.0)
        if share.get("optimizer_state", 0.0) + share.get("gradients", 0.0) >= MEMORY_CATEGORY_SHARE \
                and knobs.get("offload") is not True and device != "cpu":
            out.append(Recommendation("memory-offload", "offload", "Offload optimizer state to the host "
                                      "(tp.offload.CPUOffloadAdamW)", evidence,
                                      f"frees up to {state / MIB:,.0f} MiB on {device} (optimizer state and "
                                      "gradients); the host step then costs time", state, "bytes", {"offload": True}))
        act = cats.get("activations", 0.0)
        if share.get("activations", 0.0) >= MEMORY_CATEGORY_SHARE:
            if knobs.get("activation_checkpointing") is not True:
                out.append(Recommendation("memory-activations", "activation_checkpointing",
                                          "Checkpoint activations (recompute them in backward)", evidence,
                                          f"frees most of the {act / MIB:,.0f} MiB of activations for about one "
                                          "extra forward per step", act, "bytes", {"activation_checkpointing": True}))
            if knobs.get("fused_cross_entropy") is not True:
                out.append(Recommendation("memory-activations", "fused_cross_entropy",
                                          "Fuse the LM head with the cross-entropy (tpkit kernels)", evidence,
                                          "the [tokens, vocab] logits and their gradient are never held whole: "
                                          f"part of the {act / MIB:,.0f} MiB of activations", float("nan"), "bytes",
                                          {"fused_cross_entropy": True}))
    return out


def throttled_clocks(run: "Run") -> list[Recommendation]:
    """A GPU reported power or thermal slowdown during measured steps."""
    if run.clocks.empty or not (run.clocks["metric"] == "throttle_reasons").any():
        return []
    from .clocks import step_throttle

    m = measured(run.steps)
    thr = step_throttle(run.clocks, m)
    if thr.empty or not thr["throttled"].any():
        return []
    hit = set(thr.loc[thr["throttled"], "step"])
    reasons = sorted({r for s in thr.loc[thr["throttled"], "reasons"] for r in s.split(", ") if r})
    devices = sorted(thr.loc[thr["throttled"], "device"].unique())
    dur = m.set_index("step")["duration_s"]
    slow = dur[dur.index.isin(hit)]
    fast = dur[~dur.index.isin(hit)]
    evidence = f"{len(hit)} of {len(m)} measured steps throttled on {', '.join(devices)} ({', '.join(reasons)})"
    if not fast.empty:
        speedup = float(dur.median() / fast.median())
        evidence += f"; median step {_ms(float(slow.median()))} throttled vs {_ms(float(fast.median()))} not"
        gain = f"about {speedup:.2f}x if every step ran like the unthrottled ones"
    else:
        speedup, gain = float("nan"), "unknown: every measured step was throttled"
    thermal = any("thermal" in r for r in reasons)
    title = ("Cool the GPU or lower its power limit: it slows itself down to stay within thermal limits"
             if thermal else "Raise the power limit or lower the load: the GPU caps its clocks at the power limit")
    return [Recommendation("throttled", "power_limit", title, evidence, gain, speedup, "x", {})]


#: Places of the step where a batch source tpkit does not see (a generator, ``get_batch()``)
#: spends its time: between the update and the forward.
BATCH_PLACES = (*TAIL_PLACES, "before_forward")


def _other_where(t: _Totals, parts: OtherParts, seen: bool = True) -> list[Recommendation]:
    """Time outside every phase held by phases the user named (``tp.phase``), or sitting in one
    place of the step (analysis/steps.py ``other_parts``): advice on that code. Its knob is the
    loop's own: named, not turned. Doubling the batch had been the only advice for a phase the user
    named "logging" taking 77% of each step, and for a logger's 30 ms after each update.
    ``seen``: whether any batch was seen (``steps.batches_seen``); where none was, the time between
    the update and the forward is where the batches are made: tp.watch first (a 50 ms ``get_batch()``
    had been advised "Log and compute metrics less often")."""
    other_s = t.phase_s.get("other_s", 0.0)
    if parts.named >= USER_PHASES_OF_OTHER:
        out = []
        for phase, frac in parts.phases.items():
            if frac < USER_PHASE_NAMED:
                continue
            part = other_s * frac
            s, less = t.speedup(part), t.speedup(part, LESS_OFTEN)
            out.append(Recommendation(
                "user-phase", "phase_interval", f"Run your phase '{phase}' less often, or make it cheaper",
                f"your phase '{phase}' (tp.phase) takes {part / t.total_s:.0%} of {t.of} ({_ms(part / t.steps)} per "
                "step), outside every built-in phase",
                f"up to {s:.2f}x samples/s were its time gone; about {less:.2f}x run every {LESS_OFTEN} steps",
                s, "x", {}))
        return out
    place, frac = parts.top_place()
    if frac < ONE_PLACE:
        return []
    part = other_s * frac
    where = place_text(place)
    evidence = f"{part / t.total_s:.0%} of {t.of} is outside every phase {where} ({_ms(part / t.steps)} per step)"
    s = t.speedup(part)
    if not seen and place in BATCH_PLACES:
        return [Recommendation(
            "unseen-loader", "tp.watch", "Time the batches: no loader was seen, and the time sits where the next "
            f"batch is made; {WATCH_IT}", evidence + "; no batch was seen (data_wait 0)",
            f"up to {s:.2f}x samples/s were that time gone (batches made ahead, loader workers)", s, "x", {})]
    if place == "gc":
        return [Recommendation(
            "gc-pause", "gc", "Make fewer objects the collector must walk: it paused the loop inside the wait for "
            "data (not the loader); keep fewer objects alive between steps, or call gc.freeze() once the model "
            "and data are built", evidence, f"up to {s:.2f}x samples/s were those pauses gone", s, "x", {})]
    if place in TAIL_PLACES:
        less = t.speedup(part, LESS_OFTEN)
        return [Recommendation(
            "overhead-tail", "log_interval", "Log and compute metrics less often: the time sits in the loop's tail "
            f"after optimizer.step() (logging, metrics, an LR scheduler; {NAME_IT})", evidence,
            f"up to {s:.2f}x samples/s were that time gone; about {less:.2f}x were it spent every {LESS_OFTEN} steps",
            s, "x", {})]
    return [Recommendation("overhead-place", "tp.phase", f"Find what runs {where}: {NAME_IT}, then make it cheaper",
                           evidence, f"up to {s:.2f}x samples/s were that time gone", s, "x", {})]


def launch_bound(run: "Run") -> list[Recommendation]:
    """Steps so short, or so full of time outside every phase, that fixed per-step costs
    (kernel launches, Python) dominate: larger batches, and CUDA graphs on a GPU.

    Where phases the user named hold most of that time, the advice is theirs (``_other_where``),
    not a larger batch; where it sits in one place of the step, the advice on that place comes
    too. Both are ranked by their gains (``recommendations``): where nothing interrupts training,
    removing a place that holds half of other or more gains at least what a doubled batch does;
    where an evaluation or a save runs in each step, a doubled batch also halves its cost per
    sample and can rank above the place's advice (the docstring had said it never does)."""
    t = _totals(run.steps, training=True)
    if t.steps == 0:
        return []
    gpu = on_gpu(run.meta)
    other = t.share("other_s")
    tiny = gpu and t.p50_s < LAUNCH_BOUND_P50_S
    if not tiny and other < OVERHEAD_SHARE:
        return []
    parts = other_parts(run.steps, run.spans, gc_pauses(run.spans, run.steps)) if other >= OVERHEAD_SHARE else None
    first = _other_where(t, parts, batches_seen(run.steps, run.meta)) if parts is not None else []
    if first and parts is not None and parts.named >= USER_PHASES_OF_OTHER and not tiny:
        return first  # the user's own code: a larger batch is no answer to it
    knobs = _knobs(run.meta)
    cur = knobs.get("batch_size")
    batch = int(cur) if isinstance(cur, (int, float)) and not isinstance(cur, bool) and cur > 0 \
        else int(t.samples_per_step) if t.samples_per_step == t.samples_per_step and t.samples_per_step > 0 else 0
    why = []
    if tiny:
        why.append(f"median step {_ms(t.p50_s)} on a GPU (below {_ms(LAUNCH_BOUND_P50_S)}: launch-bound)")
    if other >= OVERHEAD_SHARE:
        why.append(f"{other:.0%} of {t.of} is outside every phase ({t.per_step_ms('other_s')} per step)")
    evidence = "; ".join(why)
    # Doubling the batch keeps a fixed per-step cost o and doubles the rest of training's d; an
    # interruption's a stays in each step as it was (the loop as it runs: an evaluation every step
    # then serves twice the samples): samples/s gains 2(d + a) / (2d - o + a); a launch-bound step
    # (o ~ d, a = 0) gains up to 2x. With a = 0 this is never above removing a place holding half of
    # o (d / (d - o / 2)); with a > 0 it can be, and recommendations() ranks by the gains as they are.
    fixed = t.total_s if tiny else t.phase_s.get("other_s", 0.0)
    speedup = 2 * t.whole_s / (2 * t.total_s - fixed + t.away_s) if t.total_s > 0 else float("nan")
    out = first
    gain = f"up to {speedup:.2f}x samples/s if the per-step overhead stays fixed"
    if batch:
        out.append(Recommendation("launch-bound", "batch_size", f"Double the batch ({batch} -> {batch * 2})",
                                  evidence, gain, speedup, "x", {"batch_size": batch * 2}))
    else:  # the run does not know its batch: say so rather than guess a value
        out.append(Recommendation("launch-bound", "batch_size", "Use a larger batch (its size was not recorded: "
                                  "pass a batch_size knob or samples_per_step)", evidence, gain, speedup, "x", {}))
    if gpu and knobs.get("cuda_graphs") is not True:
        s = t.speedup(fixed) if not tiny else float("nan")
        out.append(Recommendation("launch-bound", "cuda_graphs", "Capture the step in a CUDA graph "
                                  "(torch.compile mode='reduce-overhead')", evidence,
                                  f"up to {s:.2f}x if the overhead disappears" if s == s else
                                  "removes per-kernel launch cost; the gain shows only when measured", s, "x",
                                  {"cuda_graphs": True}))
    return out


#: Every rule, in the order their advice usually pays off.
RULES = (data_stall, copies, host_step, evaluation, saving, setup, compilation, memory_pressure, throttled_clocks,
         launch_bound)


def recommendations(run: "Run") -> list[Recommendation]:
    """All recommendations for a run, speedups first (largest first), then memory, then the
    rest. A rule that fails on odd data is skipped, never raised: advice is optional. The rules
    judge the collector's pauses inside ``data_wait`` as other (``steps.gc_free_steps``): a full
    collection that landed in ``next()`` had asked for loader workers."""
    judged = gc_free_steps(run.steps, gc_pauses(run.spans, run.steps))
    if judged is not run.steps:
        run = copy.copy(run)
        run.steps = judged
    out: list[Recommendation] = []
    for rule in RULES:
        try:
            out.extend(rule(run))
        except Exception as e:  # noqa: BLE001 - a broken rule must not hide the dashboard
            warnings.warn(f"tpkit: recommendation rule {rule.__name__} failed: {e!r}", RuntimeWarning, stacklevel=2)

    def rank(r: Recommendation) -> tuple[int, float]:
        g = r.gain if r.gain == r.gain else 0.0
        return ({"x": 0, "bytes": 1}.get(r.gain_unit, 2) if r.gain == r.gain else 2, -g)

    return sorted(out, key=rank)


def recommendations_frame(recs: list[Recommendation]) -> pd.DataFrame:
    """Recommendations as a frame (one row each; ``action`` kept as a dict)."""
    cols = ["kind", "knob", "title", "evidence", "expected_gain", "gain", "gain_unit", "action"]
    return pd.DataFrame([r.to_dict() for r in recs], columns=cols)

