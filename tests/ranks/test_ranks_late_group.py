"""A process group created inside the slice (Lightning's ``fit()`` creates its own): collectives
are timed from the moment it comes up. tpkit had looked for a process group only as the slice
started: a Lightning DDP run read ``comm_s`` 0, charged rank 0's wait for its late peer to
backward, and its straggler table named rank 0's backward.

Truth: rank 1 sleeps DELAY_S in every forward (late_group_worker.py); rank 0 waits that long in
DDP's gradient all-reduce.
"""

from __future__ import annotations

import pytest
from ranks_launch import torchrun

import tpkit as tp

DELAY_S, TOL = 0.1, 0.3


@pytest.mark.parametrize("mode", ["wrapped", "lightning", "alias"])
def test_collectives_are_timed_once_the_group_is_up(mode, tmp_path):
    if mode == "lightning":
        pytest.importorskip("lightning")
    torchrun("late_group_worker.py", 2, str(tmp_path), mode, timeout_s=300)
    ranks = tp.load_ranks(tmp_path)
    assert ranks.world_size == 2 and ranks.missing == []
    early = 1 if mode == "alias" else 0  # caught at the first step's end: from the second step on
    for k, run in ranks.runs.items():
        assert run.meta["comm"]["ops"] > 0, k
        noted = any("the process group came up inside the slice" in n for n in run.meta["notes"])
        assert noted == (mode == "alias"), run.meta["notes"]
        if mode == "alias":  # the probe's install at the first step's end is tpkit's time, not the next step's other
            assert run.steps.set_index("step").loc[0, "tpkit_s"] > 0, run.steps[["step", "other_s", "tpkit_s"]]
    rank0 = ranks.runs[0].steps.iloc[early + 1:]  # (the first timed step also holds DDP's setup)
    assert rank0["comm_s"].median() == pytest.approx(DELAY_S, rel=TOL), rank0["comm_s"].tolist()
    assert rank0["backward_s"].median() < DELAY_S / 2
    st = ranks.stragglers()
    rows, at = st.to_dict("records"), st["collective"].fillna("")
    # every timed step: rank 1's sleep in forward held rank 0 back at the gradient all-reduce
    held = st[(st["rank"] == 1) & (st["phase"] == "forward") & at.str.startswith("all_reduce")]
    assert set(range(early, 4)) <= set(held["step"]), rows
    assert held["excess_s"].to_numpy() == pytest.approx(DELAY_S, rel=TOL), rows
    # never the old misreading (rank 0's wait charged to its backward); other rows are only the
    # machine's noise at the second step's bucket broadcast (a collector pause or a descheduled rank)
    assert not ((st["rank"] == 0) & (st["phase"] == "backward")).any(), rows
    assert not ((st["rank"] == 0) & at.str.startswith("all_reduce")).any(), rows
    verdict = ranks.straggler_verdict()
    assert (verdict["rank"], verdict["phase"]) == (1, "forward"), verdict
