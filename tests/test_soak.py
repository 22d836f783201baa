"""Soak: many slices in one IPython shell leave nothing behind and hold memory flat.

200 slices with the default probes (memory and clocks on) through the magic; then 20 more with
the dashboard built and shown each time. Bounds: no hook, patch, tpkit thread, fd or /dev/shm
segment more than after the first slice; RSS grows by at most 25 MiB over 200 slices
(~0.1 MiB per slice: IPython's own history of 200 cells included), and by at most 1.5 MiB per
shown dashboard (a displayed widget stays alive while its output can be seen)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("soak_magic.py")


def soak(slices: int, flags: str) -> list[dict]:
    out = subprocess.run([sys.executable, str(SCRIPT), "--slices", str(slices), "--every", "10", "--flags", flags],
                         capture_output=True, text=True, timeout=900, env={**os.environ, "TPKIT_RUNS": "off"})
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert out.returncode == 0 and rows and "error" not in rows[-1], out.stdout[-2000:] + out.stderr[-2000:]
    return rows


@pytest.mark.slow
def test_200_slices_leave_nothing_behind_and_memory_flat():
    rows = soak(200, " --quiet")
    assert all(r["left"] == [] for r in rows), [r for r in rows if r["left"]]
    first, last = rows[1], rows[-1]  # from slice 10: one-time costs (imports, first profiler) paid
    assert last["threads"] == first["threads"] and last["fds"] == first["fds"]
    assert last["rss_mb"] - first["rss_mb"] <= 25, (first, last)


@pytest.mark.slow
def test_shown_dashboards_leave_nothing_behind():
    rows = soak(21, "")
    assert all(r["left"] == [] for r in rows), [r for r in rows if r["left"]]
    first, last = rows[1], rows[-1]
    assert last["threads"] == first["threads"] and last["fds"] == first["fds"]
    assert (last["rss_mb"] - first["rss_mb"]) / (last["slice"] - first["slice"]) <= 1.5, (first, last)
