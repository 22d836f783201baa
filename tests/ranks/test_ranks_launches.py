"""Which runs make one launch: a folder used by two launches (a 3-rank run, then a 2-rank rerun
into the same ``TPKIT_SAVE_DIR``) had been merged as one, "3 of 3 ranks loaded", the first
launch's stale rank 2 in the skew, the stragglers and the loss mean. And ranks given different
``steps``: tpkit's stop ends one rank's loop and the others die in a collective; the merged view
says the ranks' values differ.

Truth: the launches the test made (their sizes and order), each rank's losses as its loop
computed them (launch_worker.py), the steps each rank was given.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from ranks_launch import torchrun

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/factories.py
from factories import make_run  # noqa: E402

import tpkit as tp  # noqa: E402
from tpkit.errors import RunFormatError  # noqa: E402


def test_a_rerun_into_the_same_folder_loads_the_newest_launch_and_says_what_it_left_out(tmp_path):
    torchrun("launch_worker.py", 3, str(tmp_path), "job", "job", timeout_s=240)
    torchrun("launch_worker.py", 2, str(tmp_path), "job", "job", timeout_s=240)  # the rerun, one rank fewer
    ranks = tp.load_ranks(tmp_path)
    assert sorted(ranks.runs) == [0, 1] and ranks.world_size == 2 and ranks.missing == []
    ids = {k: r.meta["launch"]["id"] for k, r in ranks.runs.items()}
    assert ids[0] == ids[1] and ranks.launch == ids[0]  # one id for the ranks of one launch
    assert [d["ranks"] for d in ranks.left_out] == [[2]]
    old = ranks.left_out[0]["launch"]
    assert old != ids[0] and "another launch ('job', 3 ranks (rank 2 saved)), started" in ranks.left_out[0]["why"]
    text = ranks.summary_text()
    assert text.startswith("2 of 2 ranks loaded (the newest launch under the folder, 1 other(s) left out)"), text
    assert "left out: rank 2 of another launch ('job', 3 ranks (rank 2 saved))" in text
    # the merged loss is the rerun's two ranks' mean, as each rank's loop computed it
    truth = np.mean([json.loads((tmp_path / f"loss{k}.json").read_text()) for k in (0, 1)], axis=0)
    measured = ranks.run.steps[~ranks.run.steps["warmup"]]
    assert measured["loss"].to_numpy() == pytest.approx(truth[1:7], rel=1e-5)
    # the older launch on request: its one rank, the others missing
    first = tp.load_ranks(tmp_path, launch=old)
    assert sorted(first.runs) == [2] and first.world_size == 3 and first.missing == [0, 1]
    mixed = tp.load_ranks(tmp_path, launch="all")
    assert sorted(mixed.runs) == [0, 1, 2]
    assert any(n.startswith("a mix of launches") for n in mixed.run.meta["notes"])
    with pytest.raises(RunFormatError, match="no launch 'nope'"):
        tp.load_ranks(tmp_path, launch="nope")


def test_launches_told_apart_by_id_where_two_claim_one_rank(tmp_path):
    """Hand-made runs of two 2-rank launches (different ids) in one folder under other names:
    the newest loads, and asking for both is refused with the way out."""
    for launch, start in (("aaa", 1_800_000_000_000_000_000), ("bbb", 1_800_000_194_000_000_000)):
        for k in range(2):
            make_run("job", [0.1] * 3, rank=k, world_size=2, start_unix_ns=start + k,
                     launch={"id": launch, "world_size": 2}).save(tmp_path / f"{launch}_rank{k}")
    ranks = tp.load_ranks(tmp_path)
    assert ranks.launch == "bbb" and ranks.left_out[0]["launch"] == "aaa"
    assert "started 194 s before the one loaded" in ranks.left_out[0]["why"]
    with pytest.raises(RunFormatError, match="claim rank 0, from different launches"):
        tp.load_ranks(tmp_path, launch="all")


def test_merged_view_names_different_steps(tmp_path):
    """Runs saved where the check could not run (no process group at the slice's start)."""
    for k, steps in enumerate((10, 7, 10)):
        run = make_run("job", [0.1] * 3, rank=k, world_size=3, steps_requested=steps, warmup_requested=2)
        run.save(tmp_path / f"rank{k}")
    ranks = tp.load_ranks(tmp_path)
    line = ("the ranks were given different slice lengths (steps=10 on ranks 0, 2, steps=7 on rank 1): they stop "
            "their loops at different steps")
    assert line in ranks.summary_text() and any(n.startswith(line) for n in ranks.run.meta["notes"])
