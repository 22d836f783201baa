"""tpkit/analysis/kineto.py: a rank's Run as the Kineto-style trace HTA reads. HolisticTraceAnalysis
is not a tpkit dependency (it lives in a venv of its own, tests/ranks/hta_check.py says how), so
HTA itself runs only where ``HTA_PYTHON`` names an interpreter that has it; the format is checked
here against what HTA's parser and the three analyses read (see the module docstring)."""

from __future__ import annotations

import datetime
import os
import re
import subprocess
import sys

import pytest
from hta_check import hand_made_rank
from ranks_launch import HERE

from tpkit.analysis import kineto

HTA_RANK_RE = re.compile(r'"rank":\s+(\d+)')  # how HTA 0.5.0 reads a file's rank: the first match
NCCL_KERNEL_RE = re.compile(r"^nccl.*Kernel")  # HTA 0.5.0: a communication kernel
NOT_COMPUTE_RE = re.compile(r"(^nccl.*Kernel)|(.*(Memcpy)|(Memset))|(.*Sync)")


@pytest.fixture(scope="module")
def docs():
    return {k: kineto.run_to_kineto(*hand_made_rank(k), rank=k, world_size=2) for k in (0, 1)}


def test_rank_is_found_the_way_hta_finds_it(docs):
    for k, doc in docs.items():
        text = kineto.kineto_json(doc)
        assert int(HTA_RANK_RE.search(text).group(1)) == k
        assert list(doc)[0] == "distributedInfo" and doc["distributedInfo"]["world_size"] == 2


def test_events_have_what_the_parser_keeps(docs):
    ev = docs[0]["traceEvents"]
    complete = [e for e in ev if e["ph"] == "X"]
    assert all(isinstance(e["ts"], int) and isinstance(e["dur"], int) and e["cat"] for e in complete)
    steps = [e for e in complete if e["name"].startswith("ProfilerStep#")]
    assert [e["name"] for e in steps] == [f"ProfilerStep#{i}" for i in range(5)]
    assert all(e["cat"] == "user_annotation" for e in steps)


def test_every_lane_event_has_its_launch(docs):
    ev = [e for e in docs[0]["traceEvents"] if e["ph"] == "X"]
    lane = [e for e in ev if "stream" in e.get("args", {})]
    host = {e["args"]["correlation"]: e for e in ev if e["cat"] == "cuda_runtime"}
    assert lane and all(e["args"]["stream"] >= 0 for e in lane)
    for e in lane:
        launch = host[e["args"]["correlation"]]
        assert launch["ts"] == e["ts"] and "stream" not in launch["args"]


def test_lanes_hold_compute_cut_around_exposed_comm(docs):
    """Rank 0 waits 155 ms per step in an all-reduce at the end of backward, with 60 ms of the
    all-reduce in flight behind backward's compute before it."""
    ev = [e for e in docs[0]["traceEvents"] if e["ph"] == "X" and "stream" in e.get("args", {})]
    comm = [e for e in ev if NCCL_KERNEL_RE.match(e["name"])]
    compute = [e for e in ev if not NOT_COMPUTE_RE.match(e["name"])]
    assert {e["args"]["stream"] for e in comm} == {kineto.COMM_STREAM}
    assert {e["args"]["stream"] for e in compute} == {kineto.COMPUTE_STREAM}
    exposed = [e for e in comm if "exposed" in e["name"]]
    flight = [e for e in comm if "in flight" in e["name"]]
    assert len(exposed) == len(flight) == 5 and all(e["dur"] == 155_000 for e in exposed)
    assert all(e["name"] == "ncclKernel_all_reduce (tpkit exposed wait)" for e in exposed)
    for x in exposed:  # no compute runs while the rank is blocked
        assert not any(c["ts"] < x["ts"] + x["dur"] and x["ts"] < c["ts"] + c["dur"] for c in compute)
    step0 = [e for e in compute if e["args"]["tpkit_step"] == 0]
    assert sum(e["dur"] for e in step0) == 50_000 + 80_000 + 20_000  # forward, backward's compute, optimizer
    assert not any(e["name"] == "tpkit_data_wait" for e in ev)  # input stalls are idle


def test_warmup_left_out_and_real_frames(tmp_path):
    steps, spans, meta = hand_made_rank(0)
    steps.loc[0, "warmup"] = True
    doc = kineto.run_to_kineto(steps, spans, meta, 0, 2)
    names = [e["name"] for e in doc["traceEvents"] if e["ph"] == "X"]
    assert names.count("ProfilerStep#0") == 1 and "ProfilerStep#4" not in names
    assert all(e["args"]["tpkit_step"] != 0 for e in doc["traceEvents"] if e["ph"] == "X" and "tpkit_step" in e["args"])
    meta.pop("start_unix_ns")
    meta["start_time"] = "2026-12-01T11:58:46+00:00"
    doc = kineto.run_to_kineto(steps, spans, meta, 0, 2)
    assert doc["tpkit"]["time_base"].startswith("start_time") and doc["deviceProperties"] == []
    first = min(e["ts"] for e in doc["traceEvents"] if e["ph"] == "X")
    base_us = int(datetime.datetime(2026, 12, 1, 11, 58, 46, tzinfo=datetime.timezone.utc).timestamp()) * 10**6
    assert first == base_us + round(steps.loc[1, "start_s"] * 1e6)  # the first measured step


@pytest.mark.skipif(not os.environ.get("HTA_PYTHON"), reason="HTA_PYTHON (an interpreter with HolisticTraceAnalysis "
                    "0.5.0) not set: HTA is kept out of tpkit's environment")
def test_hta_runs_the_three_analyses(tmp_path):
    p = subprocess.run([sys.executable, str(HERE / "hta_check.py"), "--out", str(tmp_path),
                        "--hta-python", os.environ["HTA_PYTHON"]], text=True, capture_output=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "comp_comm_overlap_pctg" in p.stdout and "FAILED" not in p.stdout
    assert re.search(r"^0\s+0\s+27\.91$", p.stdout, re.M), p.stdout  # rank 0: 60 of 215 ms behind compute
