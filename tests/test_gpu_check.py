"""benchmarks/gpu_check.py --dry runs end to end on the CPU, so the GPU check never rots.

The dry run is what CI can run of it: every check that needs no CUDA runs for real (kernels
through Triton's interpreter, the CPU memory and offload paths, host clocks, reference-run
writing into the output folder) and PASSes; every CUDA-only figure is SKIP(no CUDA).
"""

from __future__ import annotations

import csv
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"

#: (check, item) -> status in the dry run. PASS: measured on the CPU against its truth.
EXPECTED = {
    ("env", "cuda"): "SKIP", ("env", "nvml"): "SKIP", ("env", "triton"): "PASS",
    ("timing", "forward_ms"): "PASS", ("timing", "backward_ms"): "PASS", ("timing", "optimizer_ms"): "PASS",
    ("timing", "syncs_per_step"): "SKIP",
    ("memory", "parameters"): "PASS", ("memory", "gradients"): "PASS", ("memory", "optimizer_state"): "PASS",
    ("memory", "activations"): "PASS", ("memory", "step_peak"): "SKIP",
    ("memory", "detail_top_allocations"): "SKIP", ("memory", "user_peak_kept"): "SKIP",
    ("memory", "user_history_kept"): "SKIP",
    ("clocks", "host_rows_20hz"): "PASS", ("clocks", "host_rows_100hz"): "PASS",
    ("clocks", "nvml_metrics_20hz"): "SKIP", ("clocks", "nvml_metrics_100hz"): "SKIP",
    ("clocks", "aligned_20hz"): "SKIP", ("clocks", "energy_per_step_20hz"): "SKIP",
    ("clocks", "sampler_cost_100hz"): "SKIP",
    ("kernels", "backend"): "PASS",
    **{("kernels", f"correct_{op}_{dt}"): "PASS"
       for op in ("rms_norm", "rms_norm_chunked", "swiglu", "rope", "fused_linear_cross_entropy")
       for dt in ("fp32", "bf16")},
    ("kernels", "correct_flce_autocast_bf16"): "PASS",
    ("kernels", "goal_rms_norm_speed"): "SKIP", ("kernels", "goal_flce_memory_time"): "SKIP",
    ("kernels", "device_guard"): "SKIP",
    ("offload", "matches_adamw"): "PASS", ("offload", "exposed_share"): "SKIP", ("offload", "budget"): "SKIP",
    ("offload", "saved_offload_dry"): "PASS",
    ("loader", "cpu_path"): "PASS", ("loader", "h2d_overlap_timeline"): "SKIP",
    ("loader", "h2d_exposed_share"): "SKIP", ("loader", "step_vs_resident"): "SKIP",
    ("refruns", "saved_gpt2_small_dry"): "PASS", ("refruns", "saved_data_starved_dry"): "PASS",
}


def read_rows(folder: Path) -> dict[tuple[str, str], dict[str, str]]:
    with (folder / "results.csv").open() as f:
        return {(r["check"], r["item"]): r for r in csv.DictReader(f)}


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp("gpu_check_dry")
    before = sorted(p.name for p in (ROOT / "datasets" / "reference_runs").glob("*")) \
        if (ROOT / "datasets" / "reference_runs").is_dir() else []
    done = subprocess.run([sys.executable, str(SCRIPT), "--dry", "--out", str(out)], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    after = sorted(p.name for p in (ROOT / "datasets" / "reference_runs").glob("*")) \
        if (ROOT / "datasets" / "reference_runs").is_dir() else []
    assert before == after, "a dry run must never write into datasets/reference_runs"
    return done, out


def test_dry_run_passes_what_the_cpu_can_check_and_skips_the_rest(dry_run):
    done, out = dry_run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = read_rows(out)
    wrong = {key: (rows[key]["status"], rows[key]["note"]) for key in EXPECTED
             if key in rows and rows[key]["status"] != EXPECTED[key]}
    missing = [key for key in EXPECTED if key not in rows]
    assert not missing and not wrong, f"missing {missing}; unexpected {wrong}"
    for key, status in EXPECTED.items():
        if status == "SKIP" and key != ("env", "liger"):
            assert rows[key]["note"] == "no CUDA", (key, rows[key]["note"])
    assert not [k for k, r in rows.items() if r["status"] == "FAIL"]
    first = next(iter(rows.values()))
    assert first["mode"] == "dry (CPU)" and "torch" in first["versions"] and first["gpu"] == "none"


def test_dry_run_writes_the_table_and_loadable_runs(dry_run):
    _, out = dry_run
    md = (out / "results.md").read_text()
    assert md.startswith("# gpu_check: dry (CPU)") and "- GPU: none" in md and "- versions: " in md
    assert "| kernels | correct_rms_norm_chunked_fp32 | PASS |" in md
    assert "| timing | syncs_per_step | SKIP(no CUDA) |" in md
    import tpkit as tp

    for name in ("gpt2_small_dry", "data_starved_dry", "offload_dry"):
        run = tp.load(str(out / "reference_runs" / name))
        assert len(run.steps) > 0
        assert run.meta["reference"]["dry_run_on_cpu"] is True and run.meta["machine"]["gpu"] == "none"


def test_each_check_in_its_own_process_and_the_global_deadline(tmp_path):
    """The GPU default: a check in a child process, its rows handed back; and checks that
    find the global deadline passed are SKIPped, never run."""
    done = subprocess.run([sys.executable, str(SCRIPT), "--dry", "--only", "env", "--isolate", "process",
                           "--out", str(tmp_path / "a")], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = read_rows(tmp_path / "a")
    assert rows[("env", "triton")]["status"] == "PASS" and rows[("env", "cuda")]["note"] == "no CUDA"
    done = subprocess.run([sys.executable, str(SCRIPT), "--dry", "--only", "timing,memory", "--deadline-s", "0",
                           "--out", str(tmp_path / "b")], capture_output=True, text=True, timeout=300, cwd=ROOT)
    rows = read_rows(tmp_path / "b")
    assert {k: r["note"] for k, r in rows.items()} == {("timing", "all"): "global deadline reached",
                                                     ("memory", "all"): "global deadline reached"}


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module


def test_a_failing_check_is_a_fail_row_and_the_others_still_run(tmp_path, monkeypatch):
    gc = load_script()
    for key in ("TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES", "TPKIT_RUNS", "TRITON_DEFAULT_FP_FUSION"):
        monkeypatch.setenv(key, "1" if key == "TRITON_INTERPRET" else "")  # restored after the test

    def broken(ctx):
        ctx.add("first", "PASS", 1.0, "x")
        raise RuntimeError("boom")

    def fine(ctx):
        ctx.add("only", "PASS", 2.0, "x", "== 2")

    monkeypatch.setattr(gc, "CHECKS", {"broken": gc.Check(broken, 10), "fine": gc.Check(fine, 10)})
    assert gc.main(["--dry", "--out", str(tmp_path), "--isolate", "inline"]) == 1  # a FAIL: exit 1
    rows = read_rows(tmp_path)
    assert rows[("broken", "first")]["status"] == "PASS"
    assert rows[("broken", "error")]["status"] == "FAIL" and "RuntimeError: boom" in rows[("broken", "error")]["note"]
    assert rows[("fine", "only")]["status"] == "PASS"


# ---------------------------------------------------------------- GPU-only logic, on made-up inputs
def test_covered_share_counts_copy_time_under_kernels_once():
    gc = load_script()
    share, total = gc.covered_share([(0, 10), (20, 30)], [(2, 5), (4, 8), (25, 40), (100, 200)])
    assert total == 20 and share == (6 + 5) / 20
    assert gc.covered_share([], [(0, 1)]) == (0.0, 0.0)


def test_sync_counter_counts_explicit_and_implicit_syncs_by_iteration(monkeypatch):
    """Explicit syncs are patched calls; implicit ones arrive as torch's sync-debug warnings.
    CUDA faked at the boundary (set_sync_debug_mode needs a CUDA build)."""
    import warnings

    import torch

    gc = load_script()
    modes = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    counter = gc.SyncCounter()
    with counter:
        for i in range(4):
            counter.tag = i
            torch.cuda.synchronize()
            if i == 2:
                warnings.warn("called a synchronizing CUDA operation", stacklevel=1)
    assert modes == ["warn", 0]
    assert counter.per_iteration(1, 2) == 1.5 and counter.per_iteration(0, 3) == 5 / 4
    assert "implicit x1" in counter.kinds(2, 2)
    assert torch.cuda.synchronize.__name__ == "<lambda>"  # restored


def test_speed_rows_check_the_goals_from_benchmark_rows(tmp_path, monkeypatch):
    """The kernels check's goal rows, from hand-made benchmarks/kernels.py rows."""
    gc = load_script()
    real = gc._load_kernel_bench()
    fake_p50 = {("rms_norm", "tpkit"): 1.0, ("rms_norm", "eager"): 2.5, ("rms_norm", "compile"): 1.2,
                ("fused_linear_cross_entropy", "tpkit"): 10.5, ("fused_linear_cross_entropy", "eager"): 10.0,
                ("fused_linear_cross_entropy", "compile"): 9.0}
    peaks = {"tpkit": 4, "eager": 10, "compile": 8}

    class FakeBench:
        Case = real.Case
        _time_gpu = None

        @staticmethod
        def cases(cpu_smoke):
            return real.cases(cpu_smoke=False)

        @staticmethod
        def run(case_list, device, dtype, with_compile, measure, modes=(), peers=("tpkit", "eager", "compile")):
            case = case_list[0]
            return [dict(op=case.op, shape=case.shape, peer=p, p50_ms=fake_p50.get((case.op, p), float("nan")),
                         peak_bytes=peaks[p]) for p in peers]

    monkeypatch.setattr(gc, "_load_kernel_bench", lambda: FakeBench)
    monkeypatch.setattr(gc, "_liger_peers", lambda: {})
    ctx = gc.Ctx("kernels", False, tmp_path, tmp_path, deadline=float("inf"))
    gc._speed_rows(ctx)
    rows = {r.item: r for r in ctx.rows}
    assert rows["goal_rms_norm_speed"].status == "PASS" and rows["goal_rms_norm_speed"].value == 2.5
    assert rows["goal_flce_memory_time"].status == "PASS" and rows["goal_flce_memory_time"].value == 0.4
    assert rows["speed_swiglu"].status == "SKIP" and rows["liger_peer"].status == "SKIP"
    assert (tmp_path / "kernels_long.csv").is_file()


def test_without_cuda_the_gpu_mode_says_what_is_missing_and_runs_nothing(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode == 2 and "sees no CUDA device" in done.stderr and "--dry" in done.stderr
    assert not (tmp_path / "results.csv").exists()
