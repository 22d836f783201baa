"""A rank that fails: torchrun stops the survivors with SIGTERM the moment it exits, and the
healthy rank, then inside tpkit's teardown (gloo's error had just ended its slice), lost its run
in 3 of 3 launches. Both ranks' runs are kept now, each with what ended it.

Truth: the step each rank reached (the failing one raises at its 4th) and the error it raised.
"""

from __future__ import annotations

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
