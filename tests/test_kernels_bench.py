"""benchmarks/kernels.py runs end to end on the CPU (--cpu-smoke) and writes long-format rows."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_cpu_smoke_writes_long_format_rows_and_prints_ratios(tmp_path):
    out = tmp_path / "kernels.csv"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "kernels.py"), "--cpu-smoke", "--reps", "5",
         "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    with out.open() as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["op", "shape", "dtype", "mode", "peer", "p20_ms", "p50_ms", "p80_ms",
                             "peak_bytes", "note", "machine", "versions"]
    ops = {r["op"] for r in rows}
    assert ops == {"rms_norm", "swiglu", "rope", "fused_linear_cross_entropy"}
    assert {r["peer"] for r in rows} == {"tpkit", "eager"}
    assert {r["mode"] for r in rows} == {"fwd", "fwd_bwd"}
    for r in rows:
        p20, p50, p80 = float(r["p20_ms"]), float(r["p50_ms"]), float(r["p80_ms"])
        assert 0 < p20 <= p50 <= p80
        assert r["peak_bytes"] == ""  # the CPU does not track it: left empty, never faked
        assert r["machine"].startswith("cpu:") and "torch=" in r["versions"]
    assert "tpkit speedup" in done.stdout


def test_without_gpu_the_full_benchmark_says_so():
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "kernels.py")], capture_output=True, text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "no GPU" in done.stderr and "--cpu-smoke" in done.stderr
