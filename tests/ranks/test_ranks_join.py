"""DDP with uneven inputs under ``model.join()``: the slice fills on the rank with more data
while the other has joined already. tpkit's StopSlice had skipped Join's protocol: the joined
rank waited in all-reduces that never came (a closed connection, or a hang to the group's
timeout) and the launch failed. The loop runs on to its end now, unprofiled, and the probes come
out as Join exits.

Truth: the batches each rank trained (join_worker.py), the launch's exit status.
"""

from __future__ import annotations

from ranks_launch import torchrun

import tpkit as tp


def test_a_slice_that_fills_inside_join_lets_the_loop_run_on(tmp_path):
    out, _ = torchrun("join_worker.py", 2, str(tmp_path), timeout_s=240)
    assert "rank 0: trained 12, hooks out after Join: True" in out, out[-3000:]
    assert "rank 1: trained 4," in out, out[-3000:]  # its slice never filled: its probes stay to the end
    ranks = tp.load_ranks(tmp_path)
    assert len(ranks.runs[0].steps) == 6 and len(ranks.runs[1].steps) == 4
    assert any("inside DDP's Join" in n for n in ranks.runs[0].meta["notes"]), ranks.runs[0].meta["notes"]
