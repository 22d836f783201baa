"""Analysis rules on hand-made frames: exact numbers, every verdict rule."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import sleepy

from tpkit.analysis import steps as analysis
from tpkit.capture import build
from tpkit.capture import slice as slice_mod
from tpkit.schema import BUILTIN_PHASES, USER_PHASE_SOURCE


def spans(rows):
    """Spans by hand: a phase of no built-in name is the user's (``tp.phase``, as capture/slice.py
    records it), ``gc`` the collector's."""
    d = pd.DataFrame(rows, columns=["step", "phase", "start_s", "end_s", "depth"])
    source = np.where(d.phase.isin(BUILTIN_PHASES), "test", np.where(d.phase == "gc", "gen0", USER_PHASE_SOURCE))
    return d.assign(duration_s=d.end_s - d.start_s, source=source)


def test_innermost_builtin_phase_gets_the_time():
    s = spans([
        (0, "data_wait", 0.0, 1.0, 0),
        (0, "forward", 1.0, 5.0, 0),
        (0, "h2d", 1.5, 2.0, 1),          # a copy inside forward is h2d, not forward
        (0, "augment", 2.0, 4.0, 1),      # a user phase inside forward: forward keeps it...
        (0, "h2d", 3.0, 3.25, 2),         # ...except the h2d inside that user phase
        (0, "backward", 5.0, 8.0, 0),
        (0, "optimizer", 8.0, 9.0, 0),
        (1, "optimizer", 9.0, 9.5, 0),
    ])
    out = build.exclusive_phase_times(s).set_index("step")
    assert out.loc[0, "data_wait_s"] == 1.0
    assert out.loc[0, "h2d_s"] == 0.75
    assert out.loc[0, "forward_s"] == 3.25
    assert out.loc[0, "backward_s"] == 3.0
    assert out.loc[0, "optimizer_s"] == 1.0
    assert out.loc[1, "optimizer_s"] == 0.5 and out.loc[1, "forward_s"] == 0.0


def test_user_phase_around_builtins_falls_to_other():
    s = spans([(0, "train_step", 0.0, 10.0, 0), (0, "forward", 1.0, 4.0, 1), (0, "backward", 4.0, 9.0, 1)])
    bounds = pd.DataFrame({"step": [0], "warmup": [False], "start_s": [0.0], "end_s": [10.0],
                           "samples": [5], "loss": [1.0]})
    out = build.step_breakdown(s, bounds).iloc[0]
    assert (out.forward_s, out.backward_s, out.other_s, out.duration_s) == (3.0, 5.0, 2.0, 10.0)
    assert out.throughput == 0.5


def shares(**kw):
    base = dict.fromkeys(analysis.PHASE_COLUMNS, 0.0)
    base.update({f"{k}_s": v for k, v in kw.items()})
    return base


@pytest.mark.parametrize("kw,kind", [
    (dict(data_wait=0.20, forward=0.4, backward=0.4), "input-bound"),
    (dict(data_wait=0.19, forward=0.4, backward=0.41), "input-limited"),
    (dict(data_wait=0.09, forward=0.4, backward=0.51), "compute-bound"),
    (dict(h2d=0.15, forward=0.4, backward=0.45), "copy-bound"),
    (dict(h2d=0.14, forward=0.4, backward=0.46), "compute-bound"),
    (dict(optimizer=0.30, forward=0.3, backward=0.4), "optimizer-bound"),
    (dict(offload=0.30, forward=0.3, backward=0.4), "offload-bound"),
    (dict(other=0.30, forward=0.3, backward=0.4), "overhead-bound"),
    (dict(), "no-steps"),
    (dict(data_wait=0.25, h2d=0.25, forward=0.5), "input-bound"),  # data stalls come first
    (dict(eval=0.30, data_wait=0.3, forward=0.4), "eval-bound"),  # evaluation comes first
    (dict(save=0.30, data_wait=0.3, forward=0.4), "save-bound"),
    (dict(eval=0.30, save=0.35, forward=0.35), "save-bound"),  # the larger interruption first
    # below INTERRUPTION_BOUND the rules judge training alone: 0.17 of the step is 0.2125 of training
    (dict(eval=0.20, data_wait=0.17, forward=0.63), "input-bound"),
    (dict(eval=0.20, other=0.23, forward=0.57), "compute-bound"),  # 0.2875 of training
    (dict(eval=0.20, other=0.25, forward=0.55), "overhead-bound"),  # 0.3125 of training
    (dict(save=0.20, other=0.23, forward=0.57), "compute-bound"),  # a save counted as other made this overhead
    (dict(compile=0.30, data_wait=0.3, forward=0.4), "compile-bound"),
    # a recompile counted as forward made this input-limited: 0.16 of the step is 0.2133 of training
    (dict(compile=0.25, data_wait=0.16, forward=0.59), "input-bound"),
])
def test_verdict_rules(kw, kind):
    assert analysis.verdict(shares(**kw)).kind == kind


def test_verdict_on_training_says_what_evaluation_took():
    v = analysis.verdict(shares(eval=0.20, data_wait=0.17, forward=0.63))
    assert v.text == ("INPUT-BOUND: 21% of training time waits for data (evaluation 20% of the step left out); "
                      "the model idles while the loader works (more workers, tp.data.Loader)")
    v = analysis.verdict(shares(eval=0.5, forward=0.5))
    assert v.text.startswith("EVAL-BOUND: 50% of step time is evaluation inside the slice; training alone "
                             "would run up to 2.00x faster")
    v = analysis.verdict(shares(eval=0.1, save=0.1, data_wait=0.17, forward=0.63))  # 0.2125 of training
    assert v.text.startswith("INPUT-BOUND: 21% of training time waits for data (evaluation 10% and checkpoint "
                             "saving 10% of the step left out)")
    v = analysis.verdict(shares(save=0.4, forward=0.6))
    assert v.text.startswith("SAVE-BOUND: 40% of step time is checkpoint saving inside the slice; training alone "
                             "would run up to 1.67x faster: save less often")



def test_no_share_over_the_whole_step_nor_a_negative_speed_up():
    """A span charged whole to the step it began in runs on past that step's end (a framework's
    call that spans several steps): the phases then sum to more than the steps' time. Shares
    are of the larger of the two, and the verdict never reads over 100% or a negative speed-up
    (an ignite trainer run inside an outer Engine had read "EVAL-BOUND: 125% of step time ...
    up to -3.94x faster")."""
    steps = pd.DataFrame({"step": [0, 1], "warmup": [False, False], "duration_s": [0.1, 0.1], "samples": [8, 8],
                          **{c: [0.0, 0.0] for c in analysis.PHASE_COLUMNS}})
    steps["eval_s"] = [0.25, 0.0]
    steps["forward_s"] = [0.0, 0.05]
    got = analysis.phase_shares(steps)
    assert got["eval_s"] == pytest.approx(0.25 / 0.30) and sum(got.values()) == pytest.approx(1.0)
    v = analysis.verdict(got)
    assert v.text.startswith("EVAL-BOUND: 83% of step time is evaluation inside the slice; training alone "
                             "would run up to 6.00x faster"), v.text
    v = analysis.verdict(shares(eval=1.25))
    assert v.text.startswith("EVAL-BOUND: 100% of step time is evaluation inside the slice; training alone "
                             "would run many times faster"), v.text

def test_a_run_that_saw_no_batch_says_other_may_be_its_loader():
    """No batch seen in any step (data_wait 0, no sample counted: a loader tpkit does not see,
    as a torchdata.nodes Loader): the verdict says so and points to tp.watch. A loop spending 71%
    of each step in such a loader's next() had read "Python between phases, logging, .item() syncs"."""
    steps = pd.DataFrame({"step": [0, 1], "warmup": [False, False], "duration_s": [1.0, 1.0], "samples": [0, 0],
                          **{c: [0.0, 0.0] for c in analysis.PHASE_COLUMNS}})
    steps["forward_s"], steps["other_s"] = 0.29, 0.71
    v = analysis.summarize(steps, {"name": "x"}).verdict
    assert v.text == ("OVERHEAD-BOUND: 71% of step time is outside every known phase; no loader was seen "
                      "(data_wait 0, no batch counted), so other may be waiting for data: wrap the loader in "
                      "tp.watch(...), or the function that makes the batches (get_batch = tp.watch(get_batch)); "
                      "else Python between phases, logging, .item() syncs")
    steps["forward_s"], steps["other_s"] = 0.8, 0.2
    assert analysis.summarize(steps, {"name": "x"}).verdict.advice == (
        "no loader was seen (data_wait 0, no batch counted), so other may be waiting for data: wrap the loader "
        "in tp.watch(...), or the function that makes the batches (get_batch = tp.watch(get_batch)) to time it")
    steps["samples"] = 8  # batches seen, counted: the advice as ever
    assert analysis.summarize(steps, {"name": "x"}).verdict.advice == "the input pipeline keeps up"
    assert analysis.summarize(steps, {"name": "x", "batches_seen": 3}).verdict.advice == "the input pipeline keeps up"
    # the samples samples_per_step filled in, no batch handed out: still none seen
    assert analysis.summarize(steps, {"name": "x", "samples_per_step": 8, "batches_seen": 0}).verdict.advice \
        .startswith("no loader was seen")
    steps["forward_s"], steps["other_s"], steps["samples"], steps["data_wait_s"] = 0.19, 0.71, 0, 0.1
    assert analysis.summarize(steps, {"name": "x"}).verdict.advice == "Python between phases, logging, .item() syncs"


def test_summary_figures():
    steps = pd.DataFrame({
        "step": [-1, 0, 1, 2, 3], "warmup": [True, False, False, False, False],
        "duration_s": [9.0, 1.0, 2.0, 3.0, 4.0], "samples": [8, 10, 10, 10, 10],
        **{c: [0.0] * 5 for c in analysis.PHASE_COLUMNS},
    })
    steps["forward_s"] = steps["duration_s"] * 0.5
    steps["backward_s"] = steps["duration_s"] * 0.25
    steps["data_wait_s"] = steps["duration_s"] * 0.25
    s = analysis.summarize(steps, {"name": "x", "warmup_steps": 1})
    assert s.steps == 4 and s.samples == 40 and s.total_s == 10.0
    assert s.throughput == 4.0
    assert s.step_p50_s == 2.5 and s.step_p95_s == pytest.approx(3.85)
    assert s.phase_share["forward_s"] == 0.5 and s.data_stall_share == 0.25
    assert s.verdict.kind == "input-bound"


@pytest.mark.parametrize("durations,expected", [
    ([0.5] + [0.1] * 5, True),
    ([0.5] + [0.1] * 4, False),            # too few steps to judge
    ([0.5, 0.2, 0.1, 0.1, 0.1, 0.1], False),
    ([0.5, 0.3, 0.1, 0.11, 0.12, 0.1, 0.11], True),   # within 20% of the median
    ([0.5, 0.3, 0.1, 0.11, 0.13, 0.1, 0.11], False),
    ([0.085, 0.08, 0.08, 0.08, 0.08], False),  # four flat slow steps are not yet the loop's pace
    ([0.085, 0.08, 0.08, 0.08, 0.08, 0.02], False),
    # steady over pairs of steps (logging every other step): 89 ms a pair; the window of pairs
    # needs 10 steps after the first
    ([0.5] + [0.032, 0.057] * 5, True),
    ([0.5] + [0.032, 0.057] * 4, False),
    ([0.5] + [0.015, 0.145] * 5, True),   # a loader's 2 workers handing out in bursts
    ([0.5] + [0.03, 0.06, 0.09] * 5, True),
    ([0.5] + [0.03, 0.06] * 3 + [0.03, 0.12] * 2, False),  # pairs of 90 and 150 ms: not steady
])
def test_warmup_settled_rule(durations, expected):
    assert slice_mod.settled(durations) is expected


def test_a_step_that_mostly_waits_in_collectives_is_comm_bound_not_compute_bound():
    v = analysis.verdict({"forward_s": 0.25, "backward_s": 0.10, "comm_s": 0.60, "other_s": 0.05})
    assert v.kind == "comm-bound" and "60%" in v.evidence
    assert analysis.verdict({"forward_s": 0.70, "backward_s": 0.20, "comm_s": 0.10}).kind == "compute-bound"


def test_comm_bound_advice_names_the_knobs_of_the_wrapper_the_model_trained_in():
    """An FSDP1 run (``meta["model"]["class"]`` FullyShardedDataParallel) hears of FSDP1's own
    prefetch knobs, not of DDP's bucket_cap_mb or FSDP2's prefetching, which it has none of; a DDP
    run, or one whose wrapper is not known, still hears of those."""
    from factories import make_run

    run = make_run("fsdp1", [0.1] * 4, data_share=0.05, model={"class": "FullyShardedDataParallel"})
    run.steps["comm_s"] = 0.06
    run.steps["forward_s"] = 0.02
    run.steps["backward_s"] = 0.02
    run.steps["optimizer_s"] = 0.005
    v = run.summary().verdict
    assert v.kind == "comm-bound"
    assert "forward_prefetch=True, backward_prefetch=BackwardPrefetch.BACKWARD_PRE" in v.advice
    assert "bucket_cap_mb" not in v.advice and "FSDP2" not in v.advice
    ddp = analysis.summarize(run.steps, {**run.meta, "model": {"class": "DistributedDataParallel"}})
    assert "DDP bucket_cap_mb" in ddp.verdict.advice
    shares = {"forward_s": 0.25, "backward_s": 0.10, "comm_s": 0.60, "other_s": 0.05}
    assert "DDP bucket_cap_mb, FSDP2 prefetching" in analysis.verdict(shares).advice


def test_siblings_that_overlap_by_a_little_share_the_time_once():
    """On a GPU some spans are stamped by CUDA events and some on the host: the offload span
    inside an optimizer step began 34 us before a ``tpkit`` span beside it ended (an H200's
    offload run). Every instant is charged once, to the deepest span open, the latest begun
    among equals: optimizer + offload + tpkit never exceed the optimizer span."""
    s = spans([
        (0, "optimizer", 0.0, 0.583, 0),
        (0, "tpkit", 0.0001, 0.00035, 1),
        (0, "offload", 0.00032, 0.5829, 1),  # begins before the tpkit span ends
    ])
    out = build.exclusive_phase_times(s).set_index("step").loc[0]
    assert out.offload_s == pytest.approx(0.5829 - 0.00032)
    assert out.tpkit_s == pytest.approx(0.00032 - 0.0001)
    assert out.optimizer_s == pytest.approx(0.583 - 0.5829 + 0.0001)
    assert out.optimizer_s + out.offload_s + out.tpkit_s == pytest.approx(0.583)


# -- where time outside every phase sits ----------------------------------------------------

def test_a_phase_the_user_named_is_what_the_overhead_verdict_names():
    """A phase the user named (``tp.phase("logging")``) takes ~3/4 of each step: its own time is
    other_s (the steps table keeps its columns), and the summary and the verdict name it with its
    share by the loop's clock. They had read "other 77%" and "77% of step time is outside every
    known phase; Python between phases, logging, .item() syncs", no word of 'logging'."""
    run, tail = sleepy.tail_run(named=True)
    s = run.summary()
    m = run.measured_steps
    per_step = s.user_phase_share["logging"] * s.total_s / s.steps
    assert per_step == pytest.approx(float(np.median(tail)), abs=0.005)  # the loop's clock, ~60 ms
    assert s.user_phase_share["logging"] == pytest.approx(float(m["other_s"].sum()) / s.total_s, abs=0.03)
    share = s.user_phase_share["logging"]
    assert f"other {s.phase_share['other_s']:.0%} (of it your phase 'logging' {share:.0%})" in s.to_text()
    assert s.verdict.kind == "overhead-bound"
    assert s.verdict.evidence.endswith(f"of it your phase 'logging' {share:.0%}")
    assert "'logging' is code you named with tp.phase" in s.verdict.advice and "every n steps" in s.verdict.advice
    assert "Python between phases" not in s.verdict.text
    assert ("your phase 'logging' share (in other)", pytest.approx(share * 100), "%") in \
        list(s.to_frame().itertuples(index=False, name=None))


def test_unnamed_time_after_the_update_is_placed_in_the_loops_tail():
    """A logger's 60 ms after each optimizer.step(), no phase around it: the verdict says where in
    the step the time sits (the loop's tail after the update), with its share, and advises to log
    less often and to name the code with tp.phase; it had guessed "Python between phases,
    logging, .item() syncs"."""
    run, tail = sleepy.tail_run(named=False)
    s = run.summary()
    assert s.user_phase_share == {}
    parts = analysis.other_parts(run.steps, run.spans)
    place, frac = parts.top_place()
    assert place == "tail" and frac > 0.9
    other = s.phase_share["other_s"]
    assert other * frac * s.total_s / s.steps == pytest.approx(float(np.median(tail)), abs=0.005)
    assert s.verdict.evidence == (f"{other:.0%} of step time is outside every known phase, {other * frac:.0%} "
                                  "after optimizer.step(), before the next batch is read")
    assert "log and compute metrics less often" in s.verdict.advice
    assert 'with tp.phase("name"):' in s.verdict.advice


def test_other_parts_by_hand():
    """Each instant no built-in phase covers is the innermost user phase's open there, else placed
    between the built-in phases around it (tpkit's own spans are no place; a collector pause is no
    user phase; collectives in flight behind compute cover nothing)."""
    rows = []
    for k, t in enumerate((0.0, 10.0)):
        rows += [(k, "optimizer", t, t + 0.5, 0),       # zero_grad: the previous update's end
                 (k, "logging", t + 0.5, t + 4.5, 0),    # the user's phase, 4 s...
                 (k, "log_io", t + 1.0, t + 2.0, 1),     # ...1 s of it in a phase nested in it
                 (k, "tpkit", t + 4.5, t + 4.6, 0),
                 (k, "gc", t + 4.7, t + 4.8, 0),         # in the unnamed tail
                 (k, "data_wait", t + 5.0, t + 6.0, 0),
                 (k, "forward", t + 6.0, t + 8.0, 0),
                 (k, "metrics", t + 6.5, t + 7.0, 1),    # a user phase inside forward: forward's
                 (k, "backward", t + 8.5, t + 9.5, 0),   # 0.5 s between forward and backward
                 (k, "optimizer", t + 9.5, t + 10.0, 0),
                 (k, "comm_overlapped", t, t + 10.0, 0)]
    bounds = pd.DataFrame({"step": [0, 1], "warmup": [False, False], "start_s": [0.0, 10.0],
                           "end_s": [10.0, 20.0], "samples": [5, 5], "loss": [1.0, 1.0]})
    steps = build.step_breakdown(spans(rows), bounds)
    assert steps["other_s"].tolist() == pytest.approx([4.9, 4.9])
    parts = analysis.other_parts(steps, spans(rows))
    assert parts.phases == pytest.approx({"logging": 3.0 / 4.9, "log_io": 1.0 / 4.9})
    assert parts.places == pytest.approx({"tail": 0.4 / 4.9, "forward_backward": 0.5 / 4.9})
    s = analysis.summarize(steps, {"name": "x"}, spans=spans(rows))
    assert s.user_phase_share == pytest.approx({"logging": 0.3, "log_io": 0.1})
    assert s.verdict.evidence == ("49% of step time is outside every built-in phase, of it your phases "
                                  "'logging' 30% and 'log_io' 10%")
    assert "other 49% (of it your phases 'logging' 30% and 'log_io' 10%)" in s.to_text()
    assert analysis.summarize(steps, {"name": "x"}).verdict.advice == analysis.GUESS  # no spans: as ever
    assert analysis.other_parts(steps, None) is None


def _per_step(s, frac: float) -> float:
    """Seconds per measured step of a fraction of other."""
    return s.phase_share["other_s"] * frac * s.total_s / s.steps


@pytest.mark.parametrize("order, place, words", [
    ("zero_grad_top", "before_forward", "after the batch is read, before the forward"),
    ("log_before_zero_grad", "tail", "after optimizer.step(), before the next batch is read")])
def test_zero_grad_is_no_place_of_its_own(order, place, words):
    """``zero_grad()`` is an optimizer span, not the update: 50 ms of batch prep after a loop-top
    ``zero_grad()`` sits after the batch is read, before the forward (it had read the loop's tail,
    "after optimizer.step(), before the next forward: log and compute metrics less often"), and
    50 ms of logging between ``step()`` and ``zero_grad()`` in the loop's tail (it had read "between
    optimizer step calls", with no advice of its own)."""
    run, clock = sleepy.gap_run(order)
    s = run.summary()
    top, frac = analysis.other_parts(run.steps, run.spans).top_place()
    assert top == place and frac > 0.9
    assert _per_step(s, frac) == pytest.approx(float(np.median(clock[0])), abs=0.005)  # the loop's clock
    assert f"% {words}" in s.verdict.evidence


def test_a_user_phase_around_built_in_phases_owns_only_its_time_outside_them():
    """``tp.phase("train")`` around the loop and ``tp.phase("train_step")`` around prep (30 ms),
    forward, 50 ms of metrics, backward and the update: the gap between its built-in children is
    the step's (between the forward and the backward), only the prep before its first child is
    train_step's, and "train" holds nothing of its own. Both phases had taken all of other, and the
    advice had been "Run your phase 'train_step' less often"."""
    run, clock = sleepy.gap_run("train_step")
    s = run.summary()
    parts = analysis.other_parts(run.steps, run.spans)
    assert _per_step(s, parts.phases["train_step"]) == pytest.approx(float(np.median(clock[0])), abs=0.005)
    assert _per_step(s, parts.phases.get("train", 0.0)) < 0.002
    assert _per_step(s, parts.places["forward_backward"]) == pytest.approx(float(np.median(clock[1])), abs=0.005)
    assert "between the forward and the backward" in s.verdict.evidence and "'train'" not in s.verdict.text


def test_a_users_own_phase_named_gc_is_named():
    """``tp.phase("gc")`` is the user's (its source is tp.phase; the collector's gc spans are
    tpkit's): its 50 ms after each update are named as the user's phase. It had been filtered out by
    its name and read as the loop's tail."""
    run, clock = sleepy.gap_run("phase_gc")
    s = run.summary()
    assert s.user_phase_share["gc"] * s.total_s / s.steps == pytest.approx(float(np.median(clock[0])), abs=0.005)
    assert "your phase 'gc'" in s.verdict.evidence and "(of it your phase 'gc' " in s.to_text()


def test_the_time_line_names_the_users_phases_as_the_verdict_does():
    """A user phase holding 2% of other (1% of the step) is named neither in the time line nor
    in the verdict: both name phases from 5% of other (the time line had named it from 0.5% of the
    step, the verdict not)."""
    rows = []
    for k, t in enumerate((0.0, 10.0)):
        rows += [(k, "data_wait", t, t + 1.0, 0), (k, "forward", t + 1.0, t + 6.0, 0),
                 (k, "tiny", t + 6.0, t + 6.1, 0), (k, "optimizer", t + 9.0, t + 10.0, 0)]
    bounds = pd.DataFrame({"step": [0, 1], "warmup": [False, False], "start_s": [0.0, 10.0],
                           "end_s": [10.0, 20.0], "samples": [5, 5], "loss": [1.0, 1.0]})
    steps = build.step_breakdown(spans(rows), bounds)
    s = analysis.summarize(steps, {"name": "x"}, spans=spans(rows))
    assert s.user_phase_share == pytest.approx({"tiny": 0.01})
    assert "tiny" not in s.verdict.text and "tiny" not in s.to_text()


def test_run_summary_is_kept_until_a_table_or_the_meta_changes(monkeypatch):
    """``run.summary()`` is made once for the run's tables and meta (a notebook's display asked
    three times, a tuner's refresh once per run, ~100 ms each on 3,000 steps) and made again when
    a column is assigned in place or the meta changes; a caller's edits never reach the next
    caller; ``where=False`` never looks for where other sits."""
    import tpkit.analysis.steps as steps_mod

    run, _ = sleepy.tail_run(named=True)
    made, looked = [], []
    summarize, other_parts = steps_mod.summarize, steps_mod.other_parts
    monkeypatch.setattr(steps_mod, "summarize", lambda *a, **k: made.append(1) or summarize(*a, **k))
    monkeypatch.setattr(steps_mod, "other_parts", lambda *a, **k: looked.append(1) or other_parts(*a, **k))
    kept = run.steps.copy()
    first = run.summary()
    first.notes.append("mine")
    again = run.summary()
    assert len(made) == 1 and "mine" not in again.notes and again.verdict.text == first.verdict.text
    assert run.summary(where=False).verdict.text == first.verdict.text and len(made) == 1
    run.steps["other_s"] = run.steps["other_s"] * 0.0  # a column assigned in place
    assert run.summary().phase_share["other_s"] == 0.0 and len(made) == 2
    run.meta["name"] = "renamed"
    assert run.summary().name == "renamed" and len(made) == 3
    looked.clear()
    fresh = type(run)(steps=kept, spans=run.spans, meta=dict(run.meta))
    quick = fresh.summary(where=False)
    assert looked == [] and quick.verdict.kind == fresh.summary().verdict.kind and looked == [1]
