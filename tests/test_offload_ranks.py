"""Two CPU ranks over gloo, launched like torchrun: each saves its own Run under save_dir,
tp.load_ranks merges them (rank column, slowest rank, skew, the dashboard's Ranks section),
and a rank that dies leaves the survivor's Run saved and marked, within a timeout."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from tpkit.analysis.ranks import rank_skew
from tpkit.errors import RunFormatError
from tpkit.ranks import load_ranks

WORKER = Path(__file__).with_name("rank_worker.py")
TIMEOUT_S = 90  # both processes, imports included; the collective itself times out at 15 s


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(out: Path, mode: str, **extra_env: str) -> list[subprocess.Popen]:
    port = str(_free_port())
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port, TPKIT_RUNS="off", TP_TIMEOUT_S="15", PYTHONUNBUFFERED="1", **extra_env)
        procs.append(subprocess.Popen([sys.executable, str(WORKER), str(out), mode], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


def launch(out: Path, mode: str, **extra_env: str) -> tuple[list[int], list[str], float]:
    t0 = time.monotonic()
    procs = start(out, mode, **extra_env)
    outs, codes = [], []
    for p in procs:
        try:
            o, _ = p.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"a rank hung past {TIMEOUT_S} s")
        outs.append(o)
        codes.append(p.returncode)
    return codes, outs, time.monotonic() - t0


@pytest.mark.slow
def test_two_ranks_merged_with_skew(tmp_path):
    codes, outs, _ = launch(tmp_path, "skew")
    assert codes == [0, 0], outs
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank1"]
    ranks = load_ranks(tmp_path)
    assert ranks.world_size == 2 and ranks.missing == [] and ranks.incomplete == []
    assert ranks.runs[0].meta["rank"] == 0 and ranks.runs[1].meta["world_size"] == 2
    steps = ranks.steps
    assert list(steps.columns[:2]) == ["rank", "step"] and len(steps) == 14
    sk = ranks.skew
    assert len(sk) == 6 and (sk["ranks"] == 2).all()
    assert (sk["slowest_rank"] == 1).all()  # rank 1 sleeps 20 ms more per step
    assert sk["skew_s"].median() == pytest.approx(0.02, abs=0.012)
    s = ranks.summary()
    assert s["slowest_rank"] == 1 and s["slowest_rank_steps"] == 6
    merged = ranks.run
    assert len(merged.meta["ranks"]["step_times"]) == 14
    from tpkit.views.html import section_charts

    titles = [t for t, _ in section_charts(merged)]
    assert "Ranks" in titles
    spec = dict(section_charts(merged))["Ranks"].to_dict()
    assert "vconcat" in spec
    assert "Ranks" not in [t for t, _ in section_charts(ranks.runs[0])]  # a lone rank has no section


@pytest.mark.slow
def test_dead_rank_survivor_saved_and_marked(tmp_path):
    codes, outs, took_s = launch(tmp_path, "die")
    assert codes[1] == 3 and codes[0] == 2, outs  # rank 0's slice failed instead of hanging
    assert took_s < TIMEOUT_S
    assert [p.name for p in tmp_path.iterdir()] == ["rank0"]
    ranks = load_ranks(tmp_path)
    assert ranks.missing == [1] and ranks.incomplete == [0]
    run0 = ranks.runs[0]
    assert not run0.complete and run0.meta["rank_status"] == "failed" and run0.meta["stopped_by"] == "error"
    assert len(run0.steps) >= 3  # the steps before the peer died are kept
    notes = " ".join(ranks.run.meta["notes"])
    assert "rank 1 of 2 left no run" in notes and "rank 0's slice ended early" in notes
    # the merged view names the missing rank: the summary and the dashboard's Ranks section
    assert "missing: rank 1 left no run" in ranks.summary_text()
    from tpkit.views.html import section_charts

    title = dict(section_charts(ranks.run))["Ranks"].to_dict()["title"]["text"]
    assert "missing: rank 1 left no run" in title


@pytest.mark.slow
def test_hung_peer_watchdog_saves_the_survivor_before_the_collective_gives_up(tmp_path):
    """Rank 1 hangs (alive: gloo notices nothing) for 8 s; rank 0's watchdog (2 s without a
    step) saves its partial Run, marked stalled, while rank 1 still hangs."""
    t0 = time.monotonic()
    procs = start(tmp_path, "hang", TPKIT_RANK_TIMEOUT_S="2")
    meta = tmp_path / "rank0" / "meta.json"
    try:
        while not meta.is_file() and time.monotonic() - t0 < 60:
            time.sleep(0.1)
        assert meta.is_file(), "the watchdog saved nothing"
        saved_while_peer_hung = procs[1].poll() is None
        time.sleep(0.3)  # meta.json is written last; let the save finish
        early = load_ranks(tmp_path).runs[0]
    finally:
        outs = [p.communicate(timeout=TIMEOUT_S)[0] for p in procs]
    assert saved_while_peer_hung, outs
    assert early.meta["stopped_by"] == "stalled" and not early.complete and len(early.steps) >= 3
    assert "stalled" in " ".join(early.meta["notes"])
    final = load_ranks(tmp_path).runs[0]  # the slice's own save afterwards keeps the mark
    assert final.meta["stopped_by"] == "stalled" and final.meta["rank_status"] == "failed"
    # what ended it is the stall, not the KeyboardInterrupt the watchdog used to end the slice
    assert final.meta["error"].startswith("no step ended for 2 s"), final.meta["error"]
    assert procs[0].returncode == 2, outs
    # the hung rank's own watchdog fired as well: it saved and interrupted its long step
    assert procs[1].returncode == 2 and load_ranks(tmp_path).runs[1].meta["stopped_by"] == "stalled", outs


def test_skew_on_hand_made_frame():
    steps = pd.DataFrame({"rank": [0, 1, 2] * 2, "step": [0, 0, 0, 1, 1, 1], "warmup": False,
                          "duration_s": [0.10, 0.13, 0.11, 0.20, 0.12, 0.10]})
    sk = rank_skew(steps)
    assert list(sk["slowest_rank"]) == [1, 0] and list(sk["fastest_rank"]) == [0, 2]
    assert sk["skew_s"].tolist() == pytest.approx([0.03, 0.10])
    assert sk["skew_share"].tolist() == pytest.approx([0.03 / 0.13, 0.5])


def test_load_ranks_errors(tmp_path):
    with pytest.raises(RunFormatError, match="not a folder"):
        load_ranks(tmp_path / "nope")
    with pytest.raises(RunFormatError, match="no per-rank runs"):
        load_ranks(tmp_path)
