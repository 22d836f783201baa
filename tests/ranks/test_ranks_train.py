"""Trainings under torchrun on CPU gloo with one straggler: DDP, FSDP2 and DeepSpeed ZeRO-2, each
rank profiled by ``tp.profile(save_dir=...)`` (train_worker.py). One rank sleeps 150 ms in one
phase of every step; the others wait for it at their next collective.

Every rank's Run is saved, ``tp.load_ranks`` merges them, the losses are those of the same
training without tpkit, the straggler table names the late rank and its phase with the injected
delay as its excess, the other ranks' ``comm_s`` is the injected delay within 25% (and the late
rank's is small), and the merged view (summary line, Ranks section, one trace per rank) says so.
2 ranks: DDP and FSDP2 (one launch); slow: ZeRO-2 on 2 ranks, DDP, FSDP2 and ZeRO-2 on 4 ranks."""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from ranks_launch import HERE, torchrun

import tpkit as tp

DELAY_S, TOL = 0.15, 0.25
STEPS, WARMUP = 4, 2

#: case -> (launch, framework, ranks, late rank, the phase it is late in, slow, memory probe). Cases
#: of one launch run one after the other in the same processes (one interpreter start for both).
#: Every case runs with the default probes, memory included (FSDP2's DTensor parameters and
#: gradients are counted through their local shards).
CASES = {
    "ddp": ("pair", "ddp", 2, 1, "data_wait", False, True),
    "fsdp2": ("pair", "fsdp2", 2, 1, "forward", False, True),
    "zero2": ("zero2", "zero2", 2, 1, "data_wait", True, True),
    "ddp4": ("four", "ddp", 4, 2, "forward", True, True),
    "fsdp2_4": ("four", "fsdp2", 4, 2, "data_wait", True, True),
    "zero2_4": ("zero2_4", "zero2", 4, 3, "forward", True, True),
    "fsdp2_memory": ("fsdp2_memory", "fsdp2", 2, 1, "forward", True, True),
}


def _param(case: str):
    marks = [pytest.mark.slow] if CASES[case][5] else []
    return pytest.param(case, marks=marks, id=case)


PARAMS = [_param(c) for c in CASES if c != "fsdp2_memory"]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """``get(case)`` -> the case's folder; each launch is made once, the first time a test asks
    for one of its cases (a failed launch is remembered and reported again, not retried)."""
    done: dict[str, Path | Exception] = {}

    def get(case: str) -> Path:
        launch, framework, nproc, late, *_ = CASES[case]
        if launch not in done:
            members = [c for c in CASES if CASES[c][0] == launch]
            if any(CASES[c][1] == "zero2" for c in members):
                pytest.importorskip("deepspeed")
            out = tmp_path_factory.mktemp(launch)
            try:
                torchrun("train_worker.py", nproc, str(out),
                         "--framework", ",".join(CASES[c][1] for c in members),
                         "--delay-phase", ",".join(CASES[c][4] for c in members),
                         "--delay-rank", str(late), "--delay-ms", str(DELAY_S * 1e3),
                         "--steps", str(STEPS), "--warmup", str(WARMUP),
                         "--memory", ",".join("on" if CASES[c][6] else "off" for c in members), timeout_s=600)
                done[launch] = out
            except Exception as e:
                done[launch] = e
        result = done[launch]
        if isinstance(result, Exception):
            raise result
        return result / framework

    return get


@pytest.mark.parametrize("case", PARAMS)
def test_every_rank_saved_and_merged(launched, case):
    _, _, nproc, late, phase, *_ = CASES[case]
    out = launched(case)
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("rank")) == [f"rank{k}" for k in range(nproc)]
    ranks = tp.load_ranks(out)
    assert ranks.world_size == nproc and ranks.missing == [] and ranks.incomplete == []
    for k, run in ranks.runs.items():
        assert run.meta["rank"] == k and run.complete
        assert len(run.steps) == WARMUP + STEPS and len(run.measured_steps) == STEPS
    # the late rank's own phase holds its sleep
    m = ranks.steps[~ranks.steps["warmup"]]
    late_phase_s = m[m["rank"] == late][f"{phase}_s"].median()
    assert late_phase_s == pytest.approx(DELAY_S, rel=TOL)


@pytest.mark.parametrize("case", PARAMS)
def test_losses_equal_the_run_without_tpkit(launched, case):
    _, _, nproc, *_ = CASES[case]
    for k in range(nproc):
        d = json.loads((launched(case) / "losses" / f"rank{k}.json").read_text())
        assert len(d["plain"]) == WARMUP + STEPS
        assert d["profiled"] == d["plain"]  # the loop's own loss.item(), bit for bit
        assert d["recorded"] == d["plain"]  # run.steps.loss


@pytest.mark.parametrize("case", PARAMS)
def test_straggler_table_names_the_late_rank_and_phase(launched, case):
    _, _, _, late, phase, *_ = CASES[case]
    ranks = tp.load_ranks(launched(case))
    st = ranks.stragglers()  # [step, rank, phase, excess_s, collective]
    measured = st[st["step"] >= 0]
    longest = measured.loc[measured.groupby("step")["excess_s"].idxmax()]  # each step's longest hold
    assert len(longest) == STEPS
    assert (longest["rank"] == late).all() and (longest["phase"] == phase).all()
    assert statistics.median(longest["excess_s"]) == pytest.approx(DELAY_S, rel=TOL)
    # a row for another collective of a step (4 ranks on this 2-core VM: a rank scheduled late by
    # 8-40 ms at a reduce-scatter or all_gather) holds less than the delay
    assert (measured.drop(index=longest.index)["excess_s"] < DELAY_S * (1 - TOL)).all(), measured.to_string()


@pytest.mark.parametrize("case", PARAMS)
def test_other_ranks_comm_matches_the_delay(launched, case):
    """Every rank's comm_s also holds what the collectives themselves cost (gloo's transport): on
    this 2-core VM under a load average of ~10 that was 5-80 ms per step on the late rank too, in
    the same steps as on the others. So the others' comm_s is the delay plus the late rank's own
    comm_s, within 25% of the delay, step by step (median); and never below the delay's 75%. The
    late rank's own comm_s has no bound of its own: with 4 ranks on 2 cores the transport alone
    read 51-203 ms a step from one CI host to the next (it failed a 112 ms bound once); that it
    holds no delay is the step-by-step difference above."""
    _, _, nproc, late, *_ = CASES[case]
    ranks = tp.load_ranks(launched(case))
    m = ranks.steps[~ranks.steps["warmup"]]
    comm = m.pivot(index="step", columns="rank", values="comm_s")
    own = comm[late]  # the late rank never waits for the delay: what the transport cost it
    for k in range(nproc):
        if k == late:
            continue
        waited = (comm[k] - own).median()
        assert waited == pytest.approx(DELAY_S, rel=TOL), (k, comm.round(4).to_dict())
        assert comm[k].median() >= (1 - TOL) * DELAY_S


@pytest.mark.parametrize("case", PARAMS)
def test_merged_view_names_the_straggler(launched, case, tmp_path):
    _, _, nproc, late, phase, *_ = CASES[case]
    ranks = tp.load_ranks(launched(case))
    line = ranks.summary()["straggler"]
    assert line.startswith(f"rank {late}'s {phase} held every step back by "), line
    assert f"straggler: {line}" in ranks.summary_text()
    merged = ranks.run.meta["ranks"]
    assert merged["straggler_rank"] == late and merged["straggler_phase"] == phase
    # the merged view shows the rank that held the others back: its own wait, and the advice on it
    # (rank 0's showed its wait for that rank: COMM-BOUND, advice sized on its smaller data wait)
    assert merged["shown_rank"] == late and ranks.run.meta["rank"] == late
    assert any(f"are rank {late}'s (the rank that held the others back)" in n for n in ranks.run.meta["notes"])
    lanes = {r for r, *_ in merged["timeline"]}
    assert lanes == set(range(nproc))  # one lane per rank
    waits = [(r, b - a) for r, _, p, a, b in merged["timeline"] if p == "comm"]
    assert sum(d for r, d in waits if r != late) > (nproc - 1) * STEPS * DELAY_S * (1 - TOL)
    from tpkit.views.html import section_charts

    spec = dict(section_charts(ranks.run))["Ranks"].to_dict()
    assert line in str(spec["title"])
    # the trace export: one Kineto-style file per rank, the rank where HTA looks for it
    paths = ranks.to_traces(tmp_path / "traces")
    assert [p.name for p in paths] == [f"rank{k}.json" for k in range(nproc)]
    for k, p in enumerate(paths):
        doc = json.loads(p.read_text())
        assert doc["distributedInfo"] == {"backend": "gloo", "rank": k, "world_size": nproc}
        steps = [e for e in doc["traceEvents"] if e["name"].startswith("ProfilerStep#")]
        assert len(steps) == STEPS



@pytest.mark.parametrize("case", PARAMS)
def test_each_rank_says_its_loss_is_its_own_and_the_merged_view_shows_the_mean(launched, case):
    """Each rank trains on its own batches: its loss is its own (rank 0's differed from an HF
    Trainer's log_history by 0.46%, which logs the ranks' mean). The merged view shows that mean,
    and says whose samples/s it shows and what the ranks read together."""
    _, _, nproc, *_ = CASES[case]
    ranks = tp.load_ranks(launched(case))
    for k, run in ranks.runs.items():
        assert any(n.startswith(f"the loss is rank {k}'s own") for n in run.meta["notes"])
    by_rank = ranks.steps.pivot(index="step", columns="rank", values="loss")
    merged = ranks.run
    assert merged.steps["loss"].tolist() == pytest.approx(by_rank.mean(axis=1).tolist(), rel=1e-12)
    assert by_rank.nunique(axis=1).gt(1).any()  # the ranks' losses do differ
    total = sum(r.summary().throughput for r in ranks.runs.values())
    assert any(n.startswith(f"merged view of {nproc} rank(s)") and f"{total:,.1f} samples/s" in n
               for n in merged.meta["notes"]), merged.meta["notes"]


@pytest.mark.slow
def test_fsdp2_with_the_memory_probe(launched):
    out = launched("fsdp2_memory")
    ranks = tp.load_ranks(out)
    assert ranks.missing == [] and ranks.incomplete == []
    assert (ranks.memory_peaks["peak_bytes"] > 0).all() and len(ranks.memory_peaks) == 2
    for run in ranks.runs.values():  # each rank's shard of the DTensor parameters and gradients is counted
        mem = run.memory
        exits = mem[(mem["event"] == "exit") & (mem["phase"] == "backward") & (mem["step"] >= 0)]
        by_cat = exits.groupby("category")["bytes"].max()
        assert by_cat.get("parameters", 0) > 0 and by_cat.get("gradients", 0) > 0, by_cat


@pytest.mark.skipif(not os.environ.get("HTA_PYTHON"), reason="HTA_PYTHON (an interpreter with HolisticTraceAnalysis "
                    "0.5.0) not set: HTA is kept out of tpkit's environment (tests/ranks/hta_check.py)")
def test_hta_reads_the_ddp_launch(launched, tmp_path):
    """HTA's temporal breakdown of the DDP launch's traces: the on-time rank 0 spends most of its
    steps in communication (its wait for rank 1), rank 1 most of its steps idle (its data wait)."""
    p = subprocess.run([sys.executable, str(HERE / "hta_check.py"), str(launched("ddp")), "--out", str(tmp_path),
                        "--hta-python", os.environ["HTA_PYTHON"]], text=True, capture_output=True, timeout=300)
    assert p.returncode == 0 and "FAILED" not in p.stdout, p.stdout + p.stderr
    rows = {int(m.group(1)): [float(x) for x in m.group(2).split()]
            for m in re.finditer(r"^(\d)\s+\d\s+((?:[\d.]+\s+){6}[\d.]+)$", p.stdout, re.M)}
    # idle, compute, non-compute, kernel (us), then idle %, compute %, non-compute %
    assert rows[0][6] >= 75 and rows[1][4] >= 75, p.stdout


def test_fsdp2s_unsharded_parameters_are_parameters(tmp_path):
    """FSDP2 all-gathers a block's parameters before its forward (and its backward); with
    ``reshard_after_forward=False`` it keeps them from forward to backward. They are parameters:
    they had read activations (126,976 B at a 2-rank forward's exit, exactly the unsharded
    parameters kept), so a user would have reached for activation checkpointing. Truth: the
    bytes of FSDP2's own all-gather outputs alive after each forward, read in the worker."""
    torchrun("fsdp_memory_worker.py", 2, str(tmp_path), timeout_s=300)
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        kept, resharded = got["False"], got["True"]
        assert set(resharded["kept"]) == {0} and len(set(kept["kept"])) == 1 and kept["kept"][0] > 0
        assert resharded["parameters"] == resharded["shard"]  # the local shards alone
        assert kept["parameters"] == kept["shard"] + kept["kept"][0]  # shards and the unsharded, to the byte
        # what forward saved, about the same both ways (a few hundred bytes of gloo's own buffers
        # come and go with its threads' timing), none of the unsharded parameters among it
        assert abs(kept["activations"] - resharded["activations"]) < kept["kept"][0] // 8
        assert any(n.startswith("FSDP2's unsharded parameters") for n in kept["notes"])


def test_fsdp1s_unsharded_flat_parameters_are_parameters(tmp_path):
    """FSDP1 all-gathers each FlatParameter into its padded unsharded copy before a unit's forward;
    SHARD_GRAD_OP keeps every unit's to the backward, FULL_SHARD the root's. They are parameters:
    they had read activations (SHARD_GRAD_OP: 315,504 B of a 2-rank forward's exit beside 27,488 B
    of real activations; FULL_SHARD the root's 5,136 B), as FSDP2's did before. Truth: the bytes
    of FSDP1's own ``_full_param_padded`` storages alive after each forward, read in the worker."""
    torchrun("fsdp1_memory_worker.py", 2, str(tmp_path), timeout_s=300)
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        grad_op, full = got["SHARD_GRAD_OP"], got["FULL_SHARD"]
        for case in (grad_op, full):
            assert len(set(case["kept"])) == 1 and case["kept"][0] > 0
            assert case["parameters"] == case["shard"] + case["kept"][0]  # shards and the unsharded, to the byte
            assert any(n.startswith("FSDP's unsharded flat parameters") for n in case["notes"])
        assert grad_op["kept"][0] > 10 * full["kept"][0]  # every unit's against the root's alone
        # what forward saved, about the same both ways (gloo's own buffers come and go with its
        # threads' timing), none of the unsharded parameters among it
        assert abs(grad_op["activations"] - full["activations"]) < grad_op["kept"][0] // 8


def test_two_ranks_late_before_different_collectives_are_both_named_with_their_own_delay(tmp_path):
    """3 DDP ranks: rank 1 sleeps 40 ms before each batch (the others wait at DDP's all-reduce),
    rank 0 30 ms after each step, before an all_gather (the others wait there). One straggler per
    step, its excess over the other ranks' median, had read "rank 1's other held every step back by
    24.9 ms (p50)" and never named rank 0. Truth: the sleeps (launch_worker.py)."""
    torchrun("launch_worker.py", 3, str(tmp_path), "two_late", timeout_s=240)
    ranks = tp.load_ranks(tmp_path)
    v = ranks.straggler_verdict()
    named = {(v["rank"], v["phase"]): v} | {(a["rank"], a["phase"]): a for a in v["also"]}
    assert set(named) == {(1, "other"), (0, "other")}, v["line"]
    assert named[(1, "other")]["excess_p50_s"] == pytest.approx(0.040, rel=TOL)
    assert named[(0, "other")]["excess_p50_s"] == pytest.approx(0.030, rel=TOL)
    assert named[(1, "other")]["collectives"] == ["all_reduce (end of backward)"]
    assert named[(0, "other")]["collectives"] == ["all_gather"]
    assert "rank 1's other held every step back by" in v["line"] and "rank 0's other held every step back by" in \
        v["line"]
