"""benchmarks/kernels.py runs end to end on the CPU (--cpu-smoke) and writes long-format rows."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tpkit.kernels as K

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


def test_without_gpu_the_full_benchmark_says_so(capsys):
    assert not torch.cuda.is_available()
    assert load_bench().main([]) == 2
    err = capsys.readouterr().err
    assert "no GPU" in err and "--cpu-smoke" in err


def load_bench():
    import importlib.util

    spec = importlib.util.spec_from_file_location("kernels_bench", ROOT / "benchmarks" / "kernels.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module


def test_gpu_measurement_path_at_the_boundary_of_torch_cuda_and_do_bench(monkeypatch):
    """The GPU path on the CPU, with torch.cuda's memory counters, do_bench and torch.compile
    faked at the boundary: rows carry peaks, ratios and goals are computed from them."""
    triton_testing = pytest.importorskip("triton.testing")
    bench = load_bench()
    allocated = {"now": 1000, "peak": 0}
    calls = []

    def fake_do_bench(fn, quantiles):
        fn()
        calls.append(quantiles)
        return [1.0, 2.0, 3.0]

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: allocated["now"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: allocated.update(peak=0))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: allocated["now"] + 4096)
    monkeypatch.setattr(triton_testing, "do_bench", fake_do_bench)
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    case_list = [c for c in bench.cases(cpu_smoke=True) if c.op in ("rms_norm", "fused_linear_cross_entropy")]
    with K.reference_only():
        rows = bench.run(case_list, torch.device("cpu"), torch.float32, True, bench._time_gpu)
    assert len(rows) == 2 * 2 * 3 and {r["peer"] for r in rows} == {"tpkit", "eager", "compile"}
    assert all(r["peak_bytes"] == 4096 and r["p50_ms"] == 2.0 for r in rows)
    assert calls and all(q == [0.2, 0.5, 0.8] for q in calls)
    lines = bench.ratios(rows)
    assert len(lines) == 4 and "tpkit peak memory 1.00x eager's" in lines[0]
    # goals, on hand-made rows at the sizes
    base = dict(mode="fwd_bwd", note="", machine="GPU", versions="v", dtype="bfloat16")
    goal_rows = [
        dict(base, op="rms_norm", shape="tokens=8192,hidden=4096", peer="tpkit", p50_ms=1.0, peak_bytes=10),
        dict(base, op="rms_norm", shape="tokens=8192,hidden=4096", peer="eager", p50_ms=2.5, peak_bytes=30),
        dict(base, op="rms_norm", shape="tokens=8192,hidden=4096", peer="compile", p50_ms=0.9, peak_bytes=20),
        dict(base, op="fused_linear_cross_entropy", shape="tokens=8192,hidden=4096,vocab=128256",
             peer="tpkit", p50_ms=10.5, peak_bytes=4),
        dict(base, op="fused_linear_cross_entropy", shape="tokens=8192,hidden=4096,vocab=128256",
             peer="eager", p50_ms=10.0, peak_bytes=10),
    ]
    goals = bench.goals(goal_rows)
    assert goals[0].endswith("2.50x, 0.90x -> NOT MET")  # slower than torch.compile
    assert goals[1].endswith("0.40x memory, 1.05x time -> MET")
