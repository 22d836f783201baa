"""Many ranks without launching any (fast): the straggler rule, its one-line verdict, the merged
timeline and memory peaks on hand-made frames; the comm phase in the steps table (taken out of
the phase it interrupts; overlapped time never charged); runs saved before ``comm_s`` existed
still load; the Ranks chart past altair's 5,000 rows; ``python -m tpkit ranks``; warmup='auto'
refused in a multi-rank launch."""

from __future__ import annotations

import contextlib
import json
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/factories.py
from factories import make_run, table  # noqa: E402

import tpkit as tp  # noqa: E402
from tpkit.analysis.ranks import (  # noqa: E402
    rank_memory_peaks,
    rank_offsets_s,
    rank_stragglers,
    rank_timeline,
    straggler_verdict,
)
from tpkit.capture.build import exclusive_phase_times  # noqa: E402
from tpkit.capture.slice import ONE_RANK_NOTE  # noqa: E402
from tpkit.charts.ranks import rank_step_times, ranks_view  # noqa: E402
from tpkit.schema import SCHEMAS, frame  # noqa: E402


def three_ranks() -> pd.DataFrame:
    """3 ranks, 2 measured steps (+1 warmup). Step 0: rank 2 waits 40 ms more for data, ranks 0
    and 1 wait those 40 ms in collectives. Step 1: rank 1 is 30 ms late in forward."""
    rows = []
    for step in (-1, 0, 1):
        for rank in range(3):
            data, fwd, bwd, comm = 0.010, 0.050, 0.080, 0.002
            if step == 0:
                data += 0.040 if rank == 2 else 0.0
                comm += 0.0 if rank == 2 else 0.040
            if step == 1:
                fwd += 0.030 if rank == 1 else 0.0
                comm += 0.0 if rank == 1 else 0.030
            if step == -1:
                fwd += 0.5 * rank  # warmup: left out
            dur = data + fwd + bwd + comm
            rows.append(dict(rank=rank, step=step, warmup=step < 0, duration_s=dur, data_wait_s=data,
                             forward_s=fwd, backward_s=bwd, comm_s=comm))
    return pd.DataFrame(rows)


def test_stragglers_name_the_rank_and_phase_the_others_waited_for():
    st = rank_stragglers(three_ranks())
    assert list(st.columns) == ["step", "rank", "phase", "excess_s", "collective"]
    assert st[["step", "rank", "phase"]].values.tolist() == [[0, 2, "data_wait"], [1, 1, "forward"]]
    assert st["excess_s"].tolist() == pytest.approx([0.040, 0.030])
    assert st["collective"].isna().all()  # no spans: judged per step


def two_late_ranks() -> tuple[pd.DataFrame, dict[int, pd.DataFrame]]:
    """3 ranks, 2 measured steps of two collectives each, on one clock (truth by construction):
    rank 0 spends 30 ms more in its own code (other) before an all_gather, rank 1 waits 40 ms more
    for data before DDP's all-reduce at the end of backward. At the all_gather ranks 1 and 2 wait
    31 ms and rank 0 1 ms; at the all-reduce ranks 0 and 2 wait 42 ms and rank 1 2 ms."""
    rows, spans = [], {}
    for k in range(3):
        parts = []
        t = 0.0
        for step in (0, 1):
            start = t
            t += 0.030 if k == 0 else 0.0  # other
            ag = 0.001 if k == 0 else 0.031
            parts.append(("comm", t, t + ag, 0, "wait:all_gather"))
            t += ag
            data = 0.010 + (0.040 if k == 1 else 0.0)
            parts.append(("data_wait", t, t + data, 0, "DataLoader"))
            t += data
            parts.append(("forward", t, t + 0.020, 0, "Model"))
            t += 0.020
            ar = 0.002 if k == 1 else 0.042
            parts.append(("backward", t, t + 0.020 + ar, 0, "autograd"))
            parts.append(("comm", t + 0.020, t + 0.020 + ar, 1, "end_of_backward:all_reduce"))
            t += 0.020 + ar
            rows.append(dict(rank=k, step=step, warmup=False, start_s=start, duration_s=t - start, data_wait_s=data,
                             forward_s=0.020, backward_s=0.020, other_s=0.030 if k == 0 else 0.0, comm_s=ag + ar))
        spans[k] = table("spans", step=[0] * 5 + [1] * 5, phase=[p[0] for p in parts],
                         start_s=[p[1] for p in parts], end_s=[p[2] for p in parts], depth=[p[3] for p in parts],
                         source=[p[4] for p in parts])
    return pd.DataFrame(rows), spans


def test_two_ranks_late_before_two_collectives_are_both_named_with_their_own_hold():
    """Per step, one straggler against the others' median had named rank 1 with 25 ms (the median
    of 31 and 1 ms taken from its 40) and never rank 0; per collective each rank's hold is the
    longest wait there minus its own."""
    steps, spans = two_late_ranks()
    st = rank_stragglers(steps, spans)
    assert st[["step", "rank", "phase", "collective"]].values.tolist() == [
        [0, 1, "data_wait", "all_reduce (end of backward)"], [0, 0, "other", "all_gather"],
        [1, 1, "data_wait", "all_reduce (end of backward)"], [1, 0, "other", "all_gather"]]
    assert st["excess_s"].tolist() == pytest.approx([0.040, 0.030] * 2)
    v = straggler_verdict(st, steps)
    assert v["line"] == ("rank 1's data_wait held every step back by 40.0 ms (p50) at all_reduce (end of backward); "
                         "rank 0's other held every step back by 30.0 ms (p50) at all_gather")
    assert (v["rank"], v["also"][0]["rank"], v["also"][0]["phase"]) == (1, 0, "other")


def test_verdict_line_and_noise():
    steps = three_ranks()
    v = straggler_verdict(rank_stragglers(steps), steps)
    assert v["line"] == ("rank 2's data_wait held 1 of 2 steps back by 40.0 ms (p50); "
                         "rank 1's forward held 1 of 2 steps back by 30.0 ms (p50)")  # both named
    assert (v["rank"], v["phase"], v["steps"], v["of_steps"]) == (2, "data_wait", 1, 2)
    same = steps[steps["step"] == 0].assign(step=lambda d: d["step"] + 5)
    every = pd.concat([steps[steps["step"] == 0], same])
    assert straggler_verdict(rank_stragglers(every), every)["line"] == \
        "rank 2's data_wait held every step back by 40.0 ms (p50)"
    flat = steps.assign(data_wait_s=0.01, forward_s=0.05 + steps["rank"] * 1e-4, comm_s=0.0, duration_s=0.14)
    quiet = straggler_verdict(rank_stragglers(flat), flat)
    assert quiet["rank"] is None and quiet["line"].startswith("no rank held the others back")


def sleep_every_third_step(data_late_ms: float = 0.0) -> pd.DataFrame:
    """2 ranks, 9 measured steps that end together at a collective (1 ms of it each), as on a
    loaded 2-core machine: each rank's backward wanders by 0-9 ms (scheduling noise: rank 0 late
    by 4-7 ms on 5 steps, rank 1 by 1 ms on one, in its other), and rank 1 sleeps 40 ms (other)
    before its forward on steps 2, 5 and 8: 120 ms in all, by construction. ``data_late_ms``:
    rank 0 also waits that much longer for data on steps 1, 3, 6 and 7."""
    j0 = [9, 4, 3, 8, 9, 5, 8, 5, 0]  # ms of rank 0's backward beyond 20 ms
    j1 = [7, 0, 3, 4, 5, 5, 1, 0, 0]  # ... rank 1's (rank 0's on the sleep's steps)
    other1 = [3, 0, 40, 0, 0, 40, 0, 0, 40]  # rank 1's other: the sleep on 2, 5, 8
    rows = []
    for step in range(9):
        data0 = data_late_ms if step in (1, 3, 6, 7) else 0.0
        own = {0: (0.005 + data0 * 1e-3, 0.020 + j0[step] * 1e-3, 0.0),
               1: (0.005, 0.020 + j1[step] * 1e-3, other1[step] * 1e-3)}
        end = max(sum(o) for o in own.values()) + 0.001
        for rank, (data, bwd, other) in own.items():
            rows.append(dict(rank=rank, step=step, warmup=False, duration_s=end, data_wait_s=data, forward_s=0.0,
                             backward_s=bwd, other_s=other, comm_s=end - (data + bwd + other)))
    return pd.DataFrame(rows)


def test_the_straggler_named_first_costs_the_most_time_and_noise_holds_no_step_back():
    """Ordered by most steps, rank 0's backward (late by 4-7 ms of noise on 5 of 9 steps) had led
    before rank 1's 40 ms sleep on 3, and rank 1's other had held "4 of 9" steps (a 1 ms noise
    step counted). Now: the (rank, phase) whose hold-backs sum highest leads, and a step counts
    only beyond the noise, 3 times the quietest rank's own step-time spread (3 ms here: 9 ms)."""
    steps = sleep_every_third_step()
    st = rank_stragglers(steps)
    assert st.loc[(st["rank"] == 0) & (st["phase"] == "backward"), "step"].tolist() == [1, 3, 4, 6, 7]
    assert st.loc[(st["rank"] == 1) & (st["phase"] == "other"), "step"].tolist() == [0, 2, 5, 8]  # the table: each step
    v = straggler_verdict(st, steps)
    assert v["noise_s"] == pytest.approx(0.009)
    assert (v["rank"], v["phase"], v["steps"], v["of_steps"]) == (1, "other", 3, 9)
    assert v["excess_sum_s"] == pytest.approx(0.120) and v["excess_p50_s"] == pytest.approx(0.040)
    assert v["line"] == "rank 1's other held 3 of 9 steps back by 40.0 ms (p50)"  # the noise named nowhere
    # a real lateness on more steps but less time in all (4 x 24-27 ms) comes second, named beside it
    steps = sleep_every_third_step(data_late_ms=20.0)
    v = straggler_verdict(rank_stragglers(steps), steps)
    assert (v["rank"], v["phase"], v["steps"]) == (1, "other", 3)
    assert [(f["rank"], f["phase"], f["steps"]) for f in v["also"]] == [(0, "data_wait", 4)]


def late_every_step(late_ms: float, jitter_ms: float) -> pd.DataFrame:
    """2 ranks, 9 measured steps of ~75 ms ending together at a collective: rank 1 waits
    ``late_ms`` longer for data on every step, by construction; both ranks' backward wanders by
    0-``jitter_ms`` of scheduling noise (seeded)."""
    rng = random.Random(3)
    rows = []
    for step in range(9):
        own = {0: (0.005, 0.060 + rng.uniform(0, jitter_ms) * 1e-3),
               1: (0.005 + late_ms * 1e-3, 0.060 + rng.uniform(0, jitter_ms) * 1e-3)}
        end = max(sum(o) for o in own.values()) + 0.001
        for rank, (data, bwd) in own.items():
            rows.append(dict(rank=rank, step=step, warmup=False, duration_s=end, data_wait_s=data, forward_s=0.0,
                             backward_s=bwd, other_s=0.0, comm_s=end - (data + bwd)))
    return pd.DataFrame(rows)


@pytest.mark.parametrize(("late_ms", "jitter_ms", "held", "p50_ms"),
                         [(10.0, 12.0, 9, 9.7), (15.0, 12.0, 9, 14.7), (12.0, 16.0, 8, 8.9)])
def test_a_rank_late_every_step_under_jitter_holds_every_step_it_leads(late_ms, jitter_ms, held, p50_ms):
    """A rank late by the same time on every step, under jitter as large: its steps' hold-backs
    spread across the noise floor (3x the quietest rank's spread, 8.7-11.6 ms here), and only
    the steps above it had counted ("5 of 9 steps back by 12.8 ms" for 10 ms late on all 9).
    It holds back every step where it is the longest hold (the jitter of 0-16 ms outran 12 ms
    once: 8 of 9), by the table's own p50 there."""
    steps = late_every_step(late_ms, jitter_ms)
    st = rank_stragglers(steps)
    mine = st[(st["rank"] == 1) & (st["phase"] == "data_wait")]
    assert len(mine) == held
    v = straggler_verdict(st, steps)
    assert (v["rank"], v["phase"], v["steps"], v["of_steps"]) == (1, "data_wait", held, 9)
    assert v["excess_p50_s"] == pytest.approx(mine["excess_s"].median())
    assert v["excess_p50_s"] * 1e3 == pytest.approx(p50_ms, abs=0.05)
    assert v["excess_p50_s"] * 1e3 == pytest.approx(late_ms, abs=3.5)  # the lateness, give or take the jitter
    assert v["noise_s"] > 0.008  # the floor lies inside the spread of its hold-backs


def test_comm_is_taken_out_of_the_phase_it_interrupts_and_overlap_is_never_charged():
    spans = table("spans", step=[0, 0, 0, 0], phase=["forward", "backward", "comm_overlapped", "comm"],
                  start_s=[0.0, 0.1, 0.15, 0.3], end_s=[0.1, 0.5, 0.3, 0.45], depth=[0, 0, 1, 1])
    t = exclusive_phase_times(spans).iloc[0]
    assert t["forward_s"] == pytest.approx(0.1)
    assert t["backward_s"] == pytest.approx(0.25) and t["comm_s"] == pytest.approx(0.15)


def test_old_layouts_still_load(tmp_path):
    old = [(0, False, 0.0, 0.1, 0.1, 8, 0.01, 0.0, 0.04, 0.04, 0.01, 0.0, 0.0, 0.0, 80.0, 1.5)]  # before skipped
    with_skipped = [old[0] + (True,)]
    a, b = frame("steps", old), frame("steps", with_skipped)
    assert list(a.columns) == list(SCHEMAS["steps"]) and a.loc[0, "comm_s"] == 0.0 and not a.loc[0, "skipped"]
    assert b.loc[0, "skipped"] and b.loc[0, "comm_s"] == 0.0
    run = make_run("old", [0.1, 0.2])
    run.save(tmp_path / "old")
    pq = tmp_path / "old" / "steps.parquet"
    pd.read_parquet(pq).drop(columns=["comm_s"]).to_parquet(pq)  # a run saved before comm_s
    again = tp.load(tmp_path / "old")
    assert again.steps["comm_s"].tolist() == [0.0, 0.0]


def test_timeline_lines_ranks_up_and_thins_lanes():
    spans = {k: table("spans", step=[-1, 0, 0, 0, 0], phase=["forward", "data_wait", "forward", "comm", "tpkit"],
                      start_s=[0.0, 1.0, 1.2, 1.25, 1.3], end_s=[0.5, 1.2, 1.5, 1.45, 1.31], depth=[0, 0, 0, 1, 1])
             for k in range(4)}
    metas = {0: {"start_unix_ns": 10_000_000_000}, 1: {"start_unix_ns": 10_500_000_000}, 2: {}, 3: {}}
    off = rank_offsets_s(metas, {k: 1.0 for k in range(4)})
    assert off[0] == 0.0 and off[1] == pytest.approx(0.5)
    assert off[2] == off[3] == pytest.approx(0.25)  # no start stamp: first step at the others' median (1.25)
    tl = rank_timeline(spans, off)
    assert set(tl["phase"]) == {"data_wait", "forward", "comm"} and (tl["step"] >= 0).all()
    assert tl["phase"].iloc[-1] == "comm"  # waits drawn last, over their phase
    r1 = tl[(tl["rank"] == 1) & (tl["phase"] == "data_wait")].iloc[0]
    assert r1["start_s"] == pytest.approx(1.5)
    few = rank_timeline(spans, off, ranks=[3, 1, 0, 2], max_rows=7)
    assert sorted(set(few["rank"])) == [1, 3]  # the preferred lanes that fit


def test_memory_peaks_per_rank():
    mem = {k: table("memory", step=[0, 0, 0, 1], phase=["forward"] * 4, event=["enter", "enter", "peak", "exit"],
                    t_s=[1.0, 1.0, 1.1, 2.0], device="cpu", category=["parameters", "activations", "activations",
                                                                         "parameters"],
                    bytes=[100 * (k + 1), 50, 400, 10]) for k in range(2)}
    p = rank_memory_peaks(mem)
    assert p[["rank", "device", "peak_bytes", "phase"]].values.tolist() == [[0, "cpu", 400, "forward"],
                                                                            [1, "cpu", 400, "forward"]]


def test_rank_chart_past_five_thousand_rows():
    rng = np.random.default_rng(0)
    steps = pd.DataFrame({"rank": np.repeat(np.arange(256), 50), "step": np.tile(np.arange(50), 256),
                          "warmup": False, "duration_s": rng.uniform(0.1, 0.2, 256 * 50)})
    from tpkit.analysis.ranks import rank_skew

    spec = rank_step_times(steps, rank_skew(steps), highlight=37).to_dict()  # altair refuses > 5,000 rows
    text = json.dumps(spec)
    assert "across 256 ranks" in text and "red: rank 37" in text
    rows = sum(len(v) for v in spec["datasets"].values())
    assert rows < 5000
    view = ranks_view(steps.head(20), rank_skew(steps.head(20)), pd.DataFrame(columns=["rank", "step", "phase",
                      "start_s", "end_s"]), pd.DataFrame(columns=["rank", "device", "peak_bytes"]),
                      verdict="rank 3's data_wait held every step back by 42.0 ms (p50)", missing=[5])
    title = view.to_dict()["title"]["text"]
    assert title == ["rank 3's data_wait held every step back by 42.0 ms (p50)", "missing: rank 5 left no run"]


def save_ranks(root: Path, world: int, late: int, late_s: float, skip: tuple[int, ...] = ()) -> None:
    """Hand-made per-rank runs: 5 steps of 100 ms; rank ``late`` waits ``late_s`` longer for data,
    the others that long in collectives."""
    for k in range(world):
        if k in skip:
            continue
        run = make_run("job", [0.1 + late_s] * 5, data_share=0.2, rank=k, world_size=world,
                       start_unix_ns=1_800_000_000_000_000_000)
        if k == late:
            run.steps["data_wait_s"] += late_s
        else:
            run.steps["comm_s"] = late_s
        run.save(root / f"rank{k}")


def test_load_ranks_caches_and_names_missing(tmp_path):
    save_ranks(tmp_path, 4, late=3, late_s=0.042, skip=(1,))
    ranks = tp.load_ranks(tmp_path)
    assert ranks.steps is ranks.steps and ranks.run is ranks.run
    assert ranks.missing == [1]
    s = ranks.summary()
    assert s["straggler"] == "rank 3's data_wait held every step back by 42.0 ms (p50)"
    assert "missing: rank 1 left no run" in ranks.summary_text()
    assert "rank 1 of 4 left no run" in " ".join(ranks.run.meta["notes"])
    assert "<tpkit.RankRuns: 3/4 ranks" in repr(ranks)


def test_cli_ranks(tmp_path, capsys):
    from tpkit.views.cli import main

    save_ranks(tmp_path / "job", 2, late=1, late_s=0.03)
    assert main(["ranks", str(tmp_path / "job"), "--out", str(tmp_path / "r.html"),
                 "--traces", str(tmp_path / "tr")]) == 0
    out = capsys.readouterr().out
    assert "straggler: rank 1's data_wait held every step back by 30.0 ms (p50)" in out
    assert "    4     1 data_wait       30.0" in out
    assert (tmp_path / "r.html").is_file() and sorted(p.name for p in (tmp_path / "tr").iterdir()) == \
        ["rank0.json", "rank1.json"]
    assert main(["ranks", str(tmp_path / "nothing")]) == 1


def test_warmup_auto_refused_in_a_multi_rank_launch(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(tp.TpkitError, match="fixed warmup"):
        with tp.profile(steps=2, warmup="auto", progress=False, memory=False, clocks=False):
            raise AssertionError("the slice must not start")


def test_a_slice_times_the_collectives_of_a_process_group(tmp_path, one_thread):
    """One gloo rank in the test's own process, collectives timed on request (``comm=True``; at
    one rank a slice leaves them out by default): each step runs a synchronous all_reduce of 1,000
    fp32 (4,000 bytes) after backward. The slice counts them exactly, reports each wait as a
    ``comm`` span (its own phase, out of ``other``), and leaves the dispatcher as it found it."""
    import torch
    import torch.distributed as dist

    before = torch._C._dispatch_dump("c10d::allreduce_")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 8)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        t = torch.ones(1000)
        with tp.profile(steps=3, warmup=1, progress=False, memory=False, clocks=False, comm=True) as prof:
            for _ in range(10):
                model(torch.ones(4, 8)).sum().backward()
                dist.all_reduce(t)
                opt.step()
                opt.zero_grad()
    finally:
        dist.destroy_process_group()
    run = prof.run
    assert ONE_RANK_NOTE not in run.meta["notes"]
    assert run.meta["comm"]["by_op"] == {"all_reduce": {"ops": 4, "bytes": 16_000}}
    waits = run.spans[run.spans["phase"] == "comm"]
    assert len(waits) == 4 and set(waits["source"]) == {"wait:all_reduce"}
    per_step = waits.groupby("step")["duration_s"].sum()
    assert run.steps.set_index("step")["comm_s"].to_dict() == pytest.approx(per_step.to_dict())
    assert isinstance(run.meta["start_unix_ns"], int)
    assert torch._C._dispatch_dump("c10d::allreduce_") == before


def test_at_one_rank_a_slice_leaves_collectives_untimed_and_says_so(tmp_path, one_thread):
    """A process group of one rank (``torchrun --nproc-per-node 1``, the Trainer's DDP at world 1):
    its collectives have no peer, so by default nothing is hooked (the dispatcher is untouched
    while the slice runs), no step has ``comm`` time, the run's notes say why and how to time them
    anyway; DDP trains to the same parameters as without a profile."""
    import torch
    import torch.distributed as dist

    before = torch._C._dispatch_dump("c10d::allreduce_")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)

    def train(profiled: bool) -> tuple[list, Any, str]:
        torch.manual_seed(0)
        net = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 4))
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        dump = ""
        with tp.profile(steps=3, warmup=1, progress=False, memory=False, clocks=False) if profiled \
                else contextlib.nullcontext() as prof:
            for i in range(4):
                net(torch.full((2, 8), float(i))).pow(2).mean().backward()
                dump = dump or torch._C._dispatch_dump("c10d::allreduce_")
                opt.step()
                opt.zero_grad()
        return [p.detach().clone() for p in net.parameters()], prof, dump

    try:
        plain, _, _ = train(False)
        profiled, prof, during = train(True)
    finally:
        dist.destroy_process_group()
    assert all(torch.equal(a, b) for a, b in zip(plain, profiled))
    assert during == before  # no kernel registered for the collectives while the slice ran
    run = prof.run
    assert ONE_RANK_NOTE in run.meta["notes"] and "comm" not in run.meta
    assert run.steps["comm_s"].tolist() == [0.0] * 4 and (run.spans["phase"] != "comm").all()
    with pytest.raises(tp.TpkitError, match="comm must be"):  # refused when made, before any slice starts
        tp.profile(comm="yes")


def test_the_magic_times_one_rank_collectives_with_comm_on(ip, tmp_path, one_thread):
    """``%tp_profile --comm on`` is ``comm=True``: at one rank the all_reduce of 16 fp32 in each
    step is counted (4 steps, 256 bytes); ``--comm off`` leaves it out without a note."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    ip.user_ns.update(torch=torch, dist=dist, net=torch.nn.Linear(4, 4))
    ip.run_cell("opt = torch.optim.SGD(net.parameters(), lr=0.1)\n"
                "def train(n):\n"
                "    for _ in range(n):\n"
                "        net(torch.ones(2, 4)).sum().backward()\n"
                "        dist.all_reduce(torch.ones(16))\n"
                "        opt.step(); opt.zero_grad()\n")
    try:
        ip.run_line_magic("tp_profile", "--steps 3 --warmup 1 --quiet --no-memory --clock-hz 0 --comm on train(9)")
        on = tp.last_run()
        ip.run_line_magic("tp_profile", "--steps 3 --warmup 1 --quiet --no-memory --clock-hz 0 --comm off train(9)")
        off = tp.last_run()
    finally:
        dist.destroy_process_group()
    assert on.meta["comm"]["by_op"] == {"all_reduce": {"ops": 4, "bytes": 256}}
    assert "comm" not in off.meta and ONE_RANK_NOTE not in off.meta["notes"]


def test_uneven_inputs_are_named_where_one_rank_ran_out_of_batches(tmp_path, capsys):
    """Rank 1's loop ran out of batches after 6 steps (its run: "the loop ended"), rank 0 went on
    into an all-reduce no one joined (its run: cut short by a closed connection): each rank's run
    alone says nothing of why. The merge names the uneven inputs and what to do; the CLI prints
    the ranks' mean loss its README promises."""
    from tpkit.views.cli import main

    for k in range(2):
        run = make_run("job", [0.1] * 6, data_share=0.2, rank=k, world_size=2, loss=[2.0 + k] * 6,
                       start_unix_ns=1_800_000_000_000_000_000)
        if k == 1:
            run.meta.update(complete=True, stopped_by="loop_end")
        else:
            run.meta.update(complete=False, stopped_by="error", error="DistBackendError: Connection closed by peer")
        run.save(tmp_path / "job" / f"rank{k}")
    ranks = tp.load_ranks(tmp_path / "job")
    assert ranks.incomplete == [0]
    line = ("rank 1 ran out of batches (the loop ended after 6 step(s)) while rank 0 went on and ended with an "
            "error in the next step")
    assert any(n.startswith(line) for n in ranks.run.meta["notes"]), ranks.run.meta["notes"]
    assert main(["ranks", str(tmp_path / "job")]) == 0
    out = capsys.readouterr().out
    assert line in out
    assert "stragglers per step" not in out  # no rank held another back (it named rank 0, 0.0 ms, every step)
    # both ranks ended these 6 steps: DDP logged the mean of 2.0 and 3.0 (rank 1's own, 3.0, had been shown)
    assert "loss (the 2 ranks' mean, as a data-parallel trainer logs it): first 2.5000, last 2.5000" in out
