"""A rank that fails: torchrun stops the survivors with SIGTERM the moment it exits, and the
healthy rank, then inside tpkit's teardown (gloo's error had just ended its slice), lost its run
in 3 of 3 launches. Both ranks' runs are kept now, each with what ended it.

A rank that hangs in its own code is named as the likely cause (each stalled run says whether it
was waiting in a collective), and after uneven inputs the merged loss is the mean of the ranks
that ended each step.

Truth: the step each rank reached (the failing one raises at its 4th) and the error it raised;
which rank sleeps (launch_worker.py); each rank's losses as its loop computed them.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from ranks_launch import LaunchError, torchrun

import tpkit as tp


def test_a_failing_rank_leaves_both_ranks_runs(tmp_path):
    with pytest.raises(LaunchError) as failed:
        torchrun("fail_worker.py", 2, str(tmp_path), timeout_s=120)
    assert "rank 1 fails at step 4" in str(failed.value)
    runs = {r: tp.load(str(tmp_path / f"rank{r}")) for r in (0, 1)}  # a lost run: no folder to load
    assert runs[1].meta["error"] == "RuntimeError: rank 1 fails at step 4"
    for run in runs.values():
        assert len(run.steps) == 4 and run.meta["complete"] is False
    # the healthy rank: ended by the collective's error (or, had it still been in the loop, by the SIGTERM)
    assert runs[0].meta["stopped_by"] in ("error", "terminated")
    if runs[0].meta["stopped_by"] == "error":
        # its last backward pass waited for the dead peer in DDP's all-reduce until gloo's error:
        # that wait is comm (it had been a backward span of the whole wait on the timeline)
        spans = runs[0].spans
        failed = spans[spans["source"] == "end_of_backward:failed"]
        assert len(failed) == 1 and (failed["phase"] == "comm").all(), spans.tail(6).to_string()
        backward = spans[(spans["phase"] == "backward") & (spans["step"] == failed["step"].iloc[0])].iloc[-1]
        assert failed["duration_s"].iloc[0] > 0.9 * backward["duration_s"]


def test_a_hung_rank_is_named_as_the_likely_cause(tmp_path):
    """Rank 1 sleeps in its own code (no collective) at its 4th iteration; rank 0 blocks in DDP's
    all-reduce waiting for it. Both watchdogs fire: every run had said "this rank stalled (a peer
    died or hangs)" and the merged view named no one. Each run says where its loop was now (in a
    collective or not, from the communication probe; the line, from its stack) and the merged view
    names the rank that was not waiting."""
    with pytest.raises(LaunchError):
        torchrun("launch_worker.py", 2, str(tmp_path), "hang", timeout_s=240, TPKIT_RANK_TIMEOUT_S="4")
    ranks = tp.load_ranks(tmp_path)
    hung, waiting = ranks.runs[1].meta, ranks.runs[0].meta
    assert hung["stopped_by"] == waiting["stopped_by"] == "stalled"
    assert hung["stall"]["in_collective"] is False
    assert "launch_worker.py" in hung["stall"]["at"] and "time.sleep(HANG_S)" in hung["stall"]["at"]
    assert "this rank stalled in its own code, not waiting in any collective (at " in hung["error"]
    assert waiting["stall"]["in_collective"] is True
    assert waiting["stall"]["collective"] == "all_reduce at the end of backward"
    assert waiting["stall"]["waiting_s"] >= 3.5
    assert "this rank stalled, blocked in a collective (all_reduce at the end of backward)" in waiting["error"]
    line = ("hang: rank 1 stalled in its own code, not waiting in any collective: the likely cause (rank 1 at ")
    text = ranks.summary_text()
    assert line in text and "; rank 0 waited for it in all_reduce at the end of backward" in text, text
    assert any(n.startswith(line) for n in ranks.run.meta["notes"])


def test_after_uneven_inputs_the_merged_loss_is_the_mean_of_the_ranks_that_ended_each_step(tmp_path):
    """Rank 1 has 5 batches, rank 0 9 (no Join): rank 0's all-reduce after rank 1's loop ended
    fails, so its run is incomplete, with the 5 steps both ranks ended. DDP trained those steps on
    both ranks' batches; the merged loss had been the complete rank's own (rank 1's), labelled
    "the complete ranks' mean"."""
    with pytest.raises(LaunchError):
        torchrun("launch_worker.py", 2, str(tmp_path), "uneven", timeout_s=240)
    ranks = tp.load_ranks(tmp_path)
    assert ranks.incomplete == [0] and len(ranks.runs[0].steps) == len(ranks.runs[1].steps) == 5
    losses = [json.loads((tmp_path / f"loss{k}.json").read_text()) for k in (0, 1)]
    assert len(losses[0]) == len(losses[1]) == 5
    assert ranks.run.steps["loss"].to_numpy() == pytest.approx(np.mean(losses, axis=0), rel=1e-5)
    assert "loss (the 2 ranks' mean, as a data-parallel trainer logs it)" in ranks.summary_text()
