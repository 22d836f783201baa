"""Takes apart what benchmarks/gpu_check.py's first run on a GPU failed (session 26, one H200).

    python benchmarks/gpu_diagnose.py [--out DIR]      # on a CUDA machine, ~40 s

Prints, and writes to ``DIR/diagnose.json``:

  memory   The memory check's truth sequence (bias-free 4 x Linear(4096) + ReLU, batch 2048,
           AdamW) with the allocator's history on: ``memory_allocated`` at each point, and the
           blocks alive after the forward and after the backward that are none of the
           parameters, gradients, batch or saved activations (size and the top frames that
           allocated them). The check read gradients 64 MiB above the gradients' bytes and
           activations 32 MiB below tpkit's figure.
  nvml     The time of each NVML call tpkit's sampler makes (median and max of 50), and of
           each clock backend's ``read()`` as tpkit builds them.
  gil      Whether a Python thread gets to run while the loop's thread is inside CUDA calls:
           a thread that wakes every 10 ms records its wake-ups during the gpu_check's busy
           step (60 bf16 8192^3 matmuls, no sync in the step), with and without a
           ``.item()`` of the step's result at its end (a logged loss); the largest gap between wake-ups.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from gpu_check import ensure_tpkit  # noqa: E402 - the checkout's tpkit, as gpu_check finds it


def _frames(block: dict, n: int = 4) -> list[str]:
    out = []
    for f in block.get("frames", [])[:40]:
        name = f"{Path(f.get('filename', '?')).name}:{f.get('line')} {f.get('name')}"
        if "torch/" in f.get("filename", "") and len(out) > 0:
            continue
        out.append(name)
        if len(out) >= n:
            break
    return out


def diagnose_memory() -> dict:
    import torch

    torch.manual_seed(0)
    width, depth, batch = 4096, 4, 2048
    layers: list = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width, bias=False), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    x = torch.randn(batch, width).cuda()
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    alloc = torch.cuda.memory_allocated
    points: dict[str, int] = {}
    torch.cuda.synchronize()
    points["start (batch on the GPU)"] = alloc()
    model.cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    torch.cuda.synchronize()
    points["after model.cuda()"] = alloc()
    out = model(x)
    loss = out.square().mean()
    torch.cuda.synchronize()
    points["after forward + loss"] = alloc()
    known = {p.data_ptr() for p in model.parameters()} | {x.data_ptr()}

    def alive(label: str) -> list[dict]:
        snap = torch.cuda.memory._snapshot()
        rows = []
        for seg in snap["segments"]:
            for b in seg["blocks"]:
                if b["state"] != "active_allocated":
                    continue
                addr = b.get("address", 0)
                if addr in known:
                    continue
                rows.append({"bytes": b["size"], "requested": b.get("requested_size"), "frames": _frames(b)})
        rows.sort(key=lambda r: -r["bytes"])
        print(f"  alive {label}, beyond parameters and batch: {len(rows)} blocks, "
              f"{sum(r['bytes'] for r in rows):,} B")
        for r in rows[:12]:
            print(f"    {r['bytes']:>12,} B  {' <- '.join(r['frames'])}")
        return rows

    after_fwd = alive("after forward")
    del out
    loss.backward()
    del loss
    torch.cuda.synchronize()
    points["after backward"] = alloc()
    grads = sum(p.grad.untyped_storage().nbytes() for p in model.parameters())
    known |= {p.grad.data_ptr() for p in model.parameters()}
    after_bwd = alive("after backward (gradients also left out)")
    opt.step()
    torch.cuda.synchronize()
    points["after opt.step()"] = alloc()
    torch.cuda.memory._record_memory_history(enabled=None)
    for k, v in points.items():
        print(f"  {k:<28} {v:>14,} B")
    print(f"  gradients' own bytes: {grads:,}")
    return {"points": points, "grads_bytes": grads, "alive_after_forward": after_fwd[:20],
            "alive_after_backward": after_bwd[:20]}


def diagnose_nvml() -> dict:
    import pynvml as nvml

    from tpkit.capture.probes import clock_backends as cb

    nvml.nvmlInit()
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    calls = {
        "GetClockInfo(SM)": lambda: nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM),
        "GetClockInfo(MEM)": lambda: nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_MEM),
        "GetPowerUsage": lambda: nvml.nvmlDeviceGetPowerUsage(h),
        "GetTemperature": lambda: nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU),
        "GetUtilizationRates": lambda: nvml.nvmlDeviceGetUtilizationRates(h),
        "GetTotalEnergyConsumption": lambda: nvml.nvmlDeviceGetTotalEnergyConsumption(h),
        "GetCurrentClocksEventReasons": lambda: nvml.nvmlDeviceGetCurrentClocksEventReasons(h),
    }
    out: dict = {}
    for name, fn in calls.items():
        ts = []
        for _ in range(50):
            t = time.perf_counter()
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - report, go on
                out[name] = f"{type(e).__name__}: {e}"
                break
            ts.append(time.perf_counter() - t)
        if ts:
            out[name] = {"median_us": statistics.median(ts) * 1e6, "max_us": max(ts) * 1e6}
        print(f"  {name:<30} {out[name]}")
    backends = {}
    for b in cb.open_backends():
        ts = []
        for _ in range(20):
            t, c = time.perf_counter(), time.thread_time()
            b.read()
            ts.append((time.perf_counter() - t, time.thread_time() - c))
        backends[b.name] = {"median_wall_us": statistics.median(x[0] for x in ts) * 1e6,
                            "median_cpu_us": statistics.median(x[1] for x in ts) * 1e6}
        print(f"  backend {b.name:<22} {backends[b.name]}")
    out["backends"] = backends
    return out


def diagnose_gil() -> dict:
    import torch

    n, reps = 8192, 60
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)

    def step(sync: bool) -> None:
        c = a
        for _ in range(reps):
            c = torch.tanh(c @ a * n**-0.5)
        m = c.float().mean()
        if sync:
            m.item()  # a loss logged each step: the host waits for the GPU here

    out = {}
    for sync in (False, True):
        for _ in range(3):
            step(sync)
        torch.cuda.synchronize()
        wakes: list[float] = []
        stop = threading.Event()

        def ticker(stop: threading.Event, wakes: list[float]) -> None:
            while not stop.wait(0.01):
                wakes.append(time.perf_counter())

        th = threading.Thread(target=ticker, args=(stop, wakes), daemon=True)
        t0 = time.perf_counter()
        th.start()
        for _ in range(15):
            step(sync)
        torch.cuda.synchronize()
        stop.set()
        th.join()
        span = time.perf_counter() - t0
        gaps = [b - a_ for a_, b in zip([t0, *wakes], wakes)]
        key = "sync each step" if sync else "no sync in the step"
        out[key] = {"span_s": span, "wakes": len(wakes), "rate_hz": len(wakes) / span,
                    "max_gap_ms": max(gaps) * 1e3 if gaps else None,
                    "gaps_over_50ms": sum(1 for g in gaps if g > 0.05)}
        print(f"  {key:<22} {out[key]}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(HERE / "results" / "gpu_check"))
    args = ap.parse_args()
    print("tpkit", ensure_tpkit())
    import torch

    if not torch.cuda.is_available():
        print("no CUDA: nothing to diagnose here")
        return
    result = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
    for name, fn in (("memory", diagnose_memory), ("nvml", diagnose_nvml), ("gil", diagnose_gil)):
        print(f"== {name}", flush=True)
        try:
            result[name] = fn()
        except Exception as e:  # noqa: BLE001 - one part failing leaves the others
            import traceback

            traceback.print_exc()
            result[name] = f"{type(e).__name__}: {e}"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "diagnose.json").write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
