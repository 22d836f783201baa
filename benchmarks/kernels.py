"""Benchmark: each tpkit kernel vs torch eager vs torch.compile, time and peak memory.

    python benchmarks/kernels.py                 # on a GPU: sizes up to Llama scale
    python benchmarks/kernels.py --cpu-smoke     # anywhere: tiny sizes, reference vs eager

Every measurement is one long-format row
    op, shape, dtype, mode, peer, p20_ms, p50_ms, p80_ms, peak_bytes, note, machine, versions
written to CSV (``--out``), and the script prints each peer's ratio against tpkit's kernel,
then the issue's goals (RMSNorm fwd+bwd >= 2x eager and >= 1x torch.compile; fused linear
cross-entropy peak memory <= 0.5x eager at vocab 128k with time <= 1.1x eager).

Times: ``triton.testing.do_bench`` quantiles (p20/p50/p80) on a GPU; on the CPU a
perf_counter loop with the same quantiles. ``peak_bytes``: the most memory the call held at
once beyond what was allocated before it (inputs excluded), from
``torch.cuda.max_memory_allocated``; empty on the CPU, where torch does not track it (never
faked). Peers: ``tpkit`` (the Triton kernel; on --cpu-smoke its torch reference path),
``eager`` (plain torch, as tpkit.models computes it), ``compile`` (torch.compile of eager,
GPU only).
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

import tpkit
import tpkit.kernels as K
from tpkit.kernels import reference as R

FIELDS = ["op", "shape", "dtype", "mode", "peer", "p20_ms", "p50_ms", "p80_ms", "peak_bytes",
          "note", "machine", "versions"]
QUANTILES = (0.2, 0.5, 0.8)


@dataclass
class Case:
    op: str
    shape: str  # e.g. "tokens=8192,hidden=4096"
    make: Callable[[torch.device, torch.dtype], list[torch.Tensor]]  # fresh inputs
    tpkit: Callable[..., object]
    eager: Callable[..., object]


def _randn(*shape: int, device: torch.device, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=device, dtype=torch.float32) * scale).to(dtype).requires_grad_()


def cases(cpu_smoke: bool) -> list[Case]:
    """Sizes: tokens x hidden for RMSNorm, tokens x intermediate for SwiGLU, [B, H, T, D] for
    RoPE, tokens x hidden x vocab for the fused loss; the largest are Llama-3-8B's."""
    if cpu_smoke:
        norm, mlp, rope, ce = [(64, 256)], [(64, 688)], [(1, 4, 64, 32)], [(128, 64, 1000)]
    else:
        norm = [(1024, 4096), (4096, 4096), (8192, 4096)]
        mlp = [(1024, 14336), (4096, 14336), (8192, 14336)]
        rope = [(1, 32, 2048, 128), (4, 32, 2048, 128), (1, 32, 8192, 128)]
        ce = [(2048, 4096, 128256), (4096, 4096, 128256), (8192, 4096, 128256)]
    out: list[Case] = []
    for n, c in norm:
        out.append(Case(
            "rms_norm", f"tokens={n},hidden={c}",
            lambda d, t, n=n, c=c: [_randn(n, c, device=d, dtype=t), _randn(c, device=d, dtype=t)],
            lambda x, w: K.rms_norm(x, w, 1e-6), lambda x, w: R.rms_norm_reference(x, w, 1e-6),
        ))
    for n, h in mlp:
        out.append(Case(
            "swiglu", f"tokens={n},intermediate={h}",
            lambda d, t, n=n, h=h: [_randn(n, h, device=d, dtype=t), _randn(n, h, device=d, dtype=t)],
            K.swiglu, R.swiglu_reference,
        ))
    for b, nh, tt, hd in rope:
        def make_rope(d, t, b=b, nh=nh, tt=tt, hd=hd):
            from tpkit.demo.models import rope_cache

            cos, sin = rope_cache(tt, hd)
            return [_randn(b, nh, tt, hd, device=d, dtype=t), _randn(b, nh, tt, hd, device=d, dtype=t),
                    cos.to(d), sin.to(d)]

        out.append(Case("rope", f"B={b},H={nh},T={tt},D={hd}", make_rope, K.rope, R.rope_reference))
    for n, c, v in ce:
        def make_ce(d, t, n=n, c=c, v=v):
            return [_randn(n, c, device=d, dtype=t), _randn(v, c, device=d, dtype=t, scale=0.02),
                    torch.randint(0, v, (n,), device=d)]

        out.append(Case("fused_linear_cross_entropy", f"tokens={n},hidden={c},vocab={v}", make_ce,
                        K.fused_linear_cross_entropy, R.linear_cross_entropy_reference))
    return out


def _step(fn: Callable[..., object], inputs: list[torch.Tensor], backward: bool) -> Callable[[], None]:
    """A closure running fn once (and its backward with fixed cotangents)."""
    leaves = [t for t in inputs if t.requires_grad]
    if not backward:
        def fwd() -> None:
            with torch.no_grad():
                fn(*inputs)
        return fwd
    with torch.no_grad():
        probe = fn(*[t.detach() for t in inputs])
    outs = probe if isinstance(probe, tuple) else (probe,)
    cotangents = [torch.randn_like(o) for o in outs]

    def fwd_bwd() -> None:
        out = fn(*inputs)
        torch.autograd.backward(out if isinstance(out, tuple) else (out,), cotangents)
        for t in leaves:  # grads count in this call's peak, then go: the next call starts clean
            t.grad = None

    return fwd_bwd


def _time_cpu(step: Callable[[], None], reps: int) -> tuple[list[float], str]:
    step()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    qs = statistics.quantiles(times, n=10, method="inclusive")  # deciles
    return [qs[1], statistics.median(times), qs[7]], ""  # peak: not tracked on the CPU


def _time_gpu(step: Callable[[], None]) -> tuple[list[float], int]:
    """do_bench quantiles, and the peak memory of one call beyond what was held before it."""
    from triton.testing import do_bench

    step()  # warm-up (and torch.compile's first compile)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    p20, p50, p80 = do_bench(step, quantiles=list(QUANTILES))
    return [p20, p50, p80], peak


def machine_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"cpu: {model} x{os.cpu_count()}"


def versions() -> str:
    parts = [f"tpkit={tpkit.__version__}", f"torch={torch.__version__}"]
    try:
        import triton

        parts.append(f"triton={triton.__version__}")
    except ImportError:
        parts.append("triton=absent")
    if torch.version.cuda:
        parts.append(f"cuda={torch.version.cuda}")
    return " ".join(parts)


def run(
    case_list: list[Case],
    device: torch.device,
    dtype: torch.dtype,
    with_compile: bool,
    measure: Callable[[Callable[[], None]], tuple[list[float], int | str]],
    note: str = "",
    modes: tuple[str, ...] = ("fwd", "fwd_bwd"),
    peers: tuple[str, ...] = ("tpkit", "eager", "compile"),
) -> list[dict[str, object]]:
    """Measure every case x mode x peer; one row each. ``measure(step)`` -> ([p20, p50, p80]
    in ms, peak bytes or "" where unknown). ``modes`` and ``peers`` choose a subset (the
    compile peer only with ``with_compile``)."""
    machine, vers = machine_name(device), versions()
    rows: list[dict[str, object]] = []
    for case in case_list:
        fns: dict[str, Callable[..., object]] = {"tpkit": case.tpkit, "eager": case.eager}
        if with_compile:
            fns["compile"] = torch.compile(case.eager, dynamic=False)
        fns = {k: v for k, v in fns.items() if k in peers}
        for mode in modes:
            for peer, fn in fns.items():
                row: dict[str, object] = dict(
                    op=case.op, shape=case.shape, dtype=str(dtype).replace("torch.", ""), mode=mode,
                    peer=peer, machine=machine, versions=vers, note=note if peer == "tpkit" else "",
                    peak_bytes="", p20_ms=math.nan, p50_ms=math.nan, p80_ms=math.nan,
                )
                inputs = None
                try:
                    inputs = case.make(device, dtype)
                    step = _step(fn, inputs, backward=mode == "fwd_bwd")
                    (row["p20_ms"], row["p50_ms"], row["p80_ms"]), row["peak_bytes"] = measure(step)
                except torch.cuda.OutOfMemoryError:
                    row["note"] = "out of memory"
                del inputs
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                rows.append(row)
                print(f"  {case.op:28s} {case.shape:36s} {mode:8s} {peer:8s} "
                      f"p50 {row['p50_ms']:.3f} ms  peak {row['peak_bytes'] or '-'}", flush=True)
    return rows


def ratios(rows: list[dict[str, object]]) -> list[str]:
    """One line per (op, shape, mode): each peer's time and memory relative to tpkit."""
    lines = []
    keys = dict.fromkeys((r["op"], r["shape"], r["mode"]) for r in rows)
    for op, shape, mode in keys:
        group = {r["peer"]: r for r in rows if (r["op"], r["shape"], r["mode"]) == (op, shape, mode)}
        base = group.get("tpkit")
        if not base or not base["p50_ms"] == base["p50_ms"]:  # NaN: the kernel did not run
            continue
        parts = [f"tpkit {base['p50_ms']:.3f} ms"]
        for peer, r in group.items():
            if peer == "tpkit":
                continue
            speed = r["p50_ms"] / base["p50_ms"]
            part = f"{peer} {r['p50_ms']:.3f} ms (tpkit speedup {speed:.2f}x)"
            if base["peak_bytes"] not in ("", None) and r["peak_bytes"] not in ("", None) and r["peak_bytes"]:
                part += f", tpkit peak memory {base['peak_bytes'] / r['peak_bytes']:.2f}x {peer}'s"
            parts.append(part)
        lines.append(f"{op} [{shape}] {mode}: " + "; ".join(parts))
    return lines


def goals(rows: list[dict[str, object]]) -> list[str]:
    """The issue's goals, checked on the largest measured sizes (GPU rows only)."""
    def get(op: str, shape_has: str, peer: str, mode: str = "fwd_bwd") -> dict[str, object] | None:
        found = [r for r in rows if r["op"] == op and shape_has in str(r["shape"]) and r["peer"] == peer
                 and r["mode"] == mode and r["p50_ms"] == r["p50_ms"]]
        return found[-1] if found else None

    out = []
    t, e, c = (get("rms_norm", "", p) for p in ("tpkit", "eager", "compile"))
    if t and e and c:
        ok = e["p50_ms"] / t["p50_ms"] >= 2 and c["p50_ms"] / t["p50_ms"] >= 1
        out.append(f"goal RMSNorm fwd+bwd >= 2x eager, >= 1x compile [{t['shape']}]: "
                   f"{e['p50_ms'] / t['p50_ms']:.2f}x, {c['p50_ms'] / t['p50_ms']:.2f}x -> {'MET' if ok else 'NOT MET'}")
    t, e = (get("fused_linear_cross_entropy", "vocab=128", p) for p in ("tpkit", "eager"))
    if t and e and t["peak_bytes"] and e["peak_bytes"]:
        mem, speed = t["peak_bytes"] / e["peak_bytes"], t["p50_ms"] / e["p50_ms"]
        ok = mem <= 0.5 and speed <= 1.1
        out.append(f"goal fused linear CE peak <= 0.5x eager, time <= 1.1x eager [{t['shape']}]: "
                   f"{mem:.2f}x memory, {speed:.2f}x time -> {'MET' if ok else 'NOT MET'}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the CPU, reference vs eager")
    ap.add_argument("--out", default="tpkit_runs/kernels_benchmark.csv", help="CSV file to write")
    ap.add_argument("--ops", default="", help="comma-separated subset of ops")
    ap.add_argument("--reps", type=int, default=20, help="timed repetitions per row on the CPU")
    args = ap.parse_args(argv)
    if not args.cpu_smoke and not torch.cuda.is_available():
        print("no GPU here: run with --cpu-smoke to check the script, or on a GPU machine for numbers",
              file=sys.stderr)
        return 2
    ops = {o.strip() for o in args.ops.split(",") if o.strip()} or None
    case_list = [c for c in cases(args.cpu_smoke) if not ops or c.op in ops]
    if args.cpu_smoke:  # no GPU: tpkit's ops take their torch reference path, without a notice
        torch.set_num_threads(1)  # a 2-thread pool wakes late after idle gaps (MEASURED.md)
        with K.reference_only():
            rows = run(case_list, torch.device("cpu"), torch.float32, False,
                       lambda step: _time_cpu(step, args.reps), note="torch reference path (no GPU)")
    else:
        rows = run(case_list, torch.device("cuda"), torch.bfloat16, True, _time_gpu)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    print(f"\n{len(rows)} rows -> {out}   ({rows[0]['machine'] if rows else '-'}; {versions()})")
    for line in ratios(rows) + goals(rows):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
