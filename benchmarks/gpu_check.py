"""One prepared command that proves tpkit's GPU paths on a real GPU in under 8 minutes (issue 17).

    python benchmarks/gpu_check.py            # on a CUDA machine (one H200: ~7 minutes)
    python benchmarks/gpu_check.py --dry      # anywhere: the CPU half, tiny shapes, < ~60 s

Checks, each printed as PASS / FAIL / SKIP(reason) / INFO with its figure:

  env       CUDA torch, compiled Triton, NVML: present, or exactly what is missing.
  timing    phase times from CUDA events against a known GPU workload (torch.cuda._sleep,
            calibrated in cycles per ms with events) within 10%; host syncs per step that the
            profiler adds (patched sync calls + torch.cuda.set_sync_debug_mode).
  memory    parameters / gradients / optimizer state byte-exact against
            torch.cuda.memory_allocated deltas, activations and the step's peak within 10%
            (and exact, +-1%, from the allocator's own reports); memory_detail=True lists the
            largest allocations at the peak with stacks; a user's own peak counter and
            allocator history survive a slice.
  clocks    NVML SM/memory clock, power, energy, temperature, throttle reasons at 20 and
            100 Hz, aligned with steps; energy per step; sampler cost <= 1% of step time.
  kernels   tpkit's Triton kernels compiled: correct against torch in fp32/bf16 (and FLCE
            under autocast, the chunked RMSNorm path); speed and memory against eager and
            torch.compile (benchmarks/kernels.py's cases and goals), Liger-Kernel as a peer
            when it is installed.
  offload   tp.offload.CPUOffloadAdamW with pinned buffers and its side stream: same update
            as torch AdamW; fits a GPU budget the AdamW state does not; exposed optimizer time
            <= 25% of the step.
  loader    tp.data.Loader's pinned side-stream copies overlap compute (torch.profiler
            timeline: HtoD copies running under kernels), and what tpkit charges as h2d.
  refruns   reference runs (Run.save) of a GPT-2-small slice and a data-starved slice (the
            offload check saves the offload slice) into datasets/reference_runs/<name>/, with
            the machine and versions in their meta.

Every check runs in its own process (a CUDA fault or a hang cannot take the others down) with
its own time budget, under one global deadline (``--deadline-s``, default 470 s). Results go to
``benchmarks/results/gpu_check/results.{csv,md}`` (long format, one row per figure, with the
GPU, driver and versions). ``--dry`` runs what needs no CUDA on the CPU (kernels through
Triton's interpreter, host clocks, the CPU memory and offload paths, reference-run writing into
the output folder, never into datasets/) and marks the rest SKIP(no CUDA); CI runs it
(tests/test_gpu_check.py). Nothing here is ever estimated: a figure is measured or absent.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import csv
import datetime as _dt
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results" / "gpu_check"
REFERENCE_RUNS = ROOT / "datasets" / "reference_runs"
STATUSES = ("PASS", "FAIL", "SKIP", "INFO")
NO_CUDA = "no CUDA"


# -- running from a checkout ------------------------------------------------------------------
def ensure_tpkit() -> str:
    """Make ``import tpkit`` work from this checkout when tpkit is not installed (a GPU image
    whose python3 holds the CUDA torch, no network): the repo root goes on sys.path and
    ``tpkit.kernels`` / ``tpkit.datasets`` are mapped to kernels/ and datasets/, as
    pyproject.toml's package-dir does. Returns how tpkit was found."""
    import importlib.abc
    import importlib.util

    def found(name: str) -> Any:
        try:
            return importlib.util.find_spec(name)
        except (ImportError, ValueError):
            return None

    # tpkit alone is not enough: a check's own process inherits PYTHONPATH (below), which finds
    # the checkout's tpkit/ but not kernels/ and datasets/ under their package names
    spec = found("tpkit")
    if spec is not None and found("tpkit.kernels") is not None and found("tpkit.datasets") is not None:
        return f"installed ({Path(spec.origin or '?').parent})"
    mapped = {"tpkit.kernels": ROOT / "kernels", "tpkit.datasets": ROOT / "datasets"}

    class CheckoutFinder(importlib.abc.MetaPathFinder):
        def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
            folder = mapped.get(name)
            if folder is None:
                return None
            return importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                          submodule_search_locations=[str(folder)])

    sys.path.insert(0, str(ROOT))
    sys.meta_path.insert(0, CheckoutFinder())
    # child processes (the checks', DataLoader workers started by spawn) find it the same way
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return f"from the checkout ({ROOT}), not installed"


def missing_packages() -> list[str]:
    """What tpkit's GPU paths import that this Python lacks (pip names)."""
    import importlib.util

    need = {"torch": "torch", "numpy": "numpy", "pandas": "pandas", "pyarrow": "pyarrow", "psutil": "psutil",
            "tqdm": "tqdm", "triton": "triton", "pynvml": "nvidia-ml-py"}
    return [pip for mod, pip in need.items() if importlib.util.find_spec(mod) is None]


# -- results -----------------------------------------------------------------------------------
@dataclass
class Row:
    """One figure of one check: long format, so tpkit's own charts can plot the CSV."""

    check: str
    item: str
    status: str  # PASS, FAIL, SKIP, INFO (a figure without a goal)
    value: float | None = None
    unit: str = ""
    goal: str = ""
    note: str = ""

    def line(self) -> str:
        status = f"SKIP({self.note})" if self.status == "SKIP" else self.status
        figure = "" if self.value is None else f" {_fmt(self.value)} {self.unit}".rstrip()
        goal = f" [goal {self.goal}]" if self.goal else ""
        note = f"  ({self.note})" if self.note and self.status != "SKIP" else ""
        return f"{status:<5} {self.check}.{self.item}:{figure}{goal}{note}"


def _fmt(v: float) -> str:
    if v == 0 or not math.isfinite(v):
        return str(v)
    if abs(v) >= 1e4 and v == int(v):
        return f"{int(v):,}"
    return f"{v:.4g}" if abs(v) < 1e6 else f"{v:,.0f}"


@dataclass
class Ctx:
    """What a check gets: the mode, where to write, its deadline, and ``add`` for its rows."""

    check: str
    dry: bool
    out: Path
    runs_dir: Path  # where reference runs go (datasets/reference_runs, or out/ when --dry)
    deadline: float  # time.time() by which this check must be done
    rows_file: Path | None = None  # rows are appended here as they come (survives a kill)
    rows: list[Row] = field(default_factory=list)

    @property
    def cuda(self) -> bool:
        return not self.dry

    @property
    def device(self) -> str:
        return "cpu" if self.dry else "cuda"

    def left(self) -> float:
        return self.deadline - time.time()

    def add(self, item: str, status: str, value: float | None = None, unit: str = "", goal: str = "",
            note: str = "") -> Row:
        assert status in STATUSES, status
        row = Row(self.check, item, status, None if value is None else float(value), unit, goal, note)
        self.rows.append(row)
        print(row.line(), flush=True)
        if self.rows_file is not None:
            with self.rows_file.open("a") as f:
                f.write(json.dumps(asdict(row)) + "\n")
        return row

    def check_goal(self, item: str, value: float, ok: bool, unit: str, goal: str, note: str = "") -> Row:
        return self.add(item, "PASS" if ok else "FAIL", value, unit, goal, note)

    def skip_cuda(self, *items: str, goal: str = "") -> None:
        for item in items:
            self.add(item, "SKIP", goal=goal, note=NO_CUDA)


# -- the machine -------------------------------------------------------------------------------
def machine_facts() -> dict[str, Any]:
    """GPU name, driver, CPU, and the versions of everything the checks use (``versions`` as
    one string for the CSV, ``packages`` as a dict for a Run's meta)."""
    from importlib import metadata

    import torch

    sys.path.insert(0, str(HERE))
    from common import machine, versions  # benchmarks/common.py

    packages = {"python": platform.python_version(), "torch": torch.__version__, "cuda": str(torch.version.cuda)}
    for name in ("tpkit", "triton", "nvidia-ml-py", "liger-kernel", "deepspeed"):
        try:
            packages[name] = metadata.version(name)
        except Exception:
            pass
    facts: dict[str, Any] = {"cpu": machine(), "gpu": "none", "driver": "none", "cuda": str(torch.version.cuda),
                             "python": platform.python_version(), "packages": packages}
    extra = [f"{k} {v}" for k, v in packages.items() if k in ("triton", "nvidia-ml-py", "liger-kernel", "deepspeed")]
    facts["versions"] = ", ".join([versions(), *extra])
    if torch.cuda.is_available():
        facts["gpu"] = f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
        try:
            import pynvml

            pynvml.nvmlInit()
            drv = pynvml.nvmlSystemGetDriverVersion()
            facts["driver"] = drv.decode() if isinstance(drv, bytes) else str(drv)
            pynvml.nvmlShutdown()
        except Exception as e:
            facts["driver"] = f"unknown ({type(e).__name__})"
    return facts


def gpu_slug() -> str:
    """'NVIDIA H200' -> 'h200': the suffix of reference-run names."""
    import torch

    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    words = [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w and w not in ("nvidia", "tesla", "geforce")]
    return "_".join(words[:2]) or "gpu"


def stamp_meta(run: Any, facts: dict[str, Any], made_by: str, config: dict, dry: bool) -> None:
    """Machine, versions and how the run was made, into ``run.meta`` before it is saved."""
    run.meta["machine"] = {k: facts[k] for k in ("gpu", "driver", "cpu", "cuda", "python")}
    versions = run.meta.get("versions")
    run.meta["versions"] = {**(versions if isinstance(versions, dict) else {}), **facts["packages"]}
    run.meta["reference"] = {"made_by": f"benchmarks/gpu_check.py ({made_by})", "config": config,
                             "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                             "dry_run_on_cpu": dry}


# -- small shared pieces -----------------------------------------------------------------------
def median(xs: Any) -> float:
    xs = [float(x) for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


def rel_err(measured: float, truth: float) -> float:
    return abs(measured - truth) / truth if truth else float("inf")


def measured_steps(run: Any) -> Any:
    return run.steps[~run.steps["warmup"]]


@contextlib.contextmanager
def cuda_budget(bytes_: int) -> Iterator[None]:
    """Cap this process's CUDA allocations at ``bytes_`` for the block (caching allocator)."""
    import torch

    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, bytes_ / total))
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


class SyncCounter:
    """Host syncs by iteration: explicit ones (torch.cuda.synchronize, Event/Stream.synchronize,
    patched for the block) and implicit ones (``.item()``, ``.cpu()``, ... reported by
    ``torch.cuda.set_sync_debug_mode('warn')``). ``tag`` is set by the loop each iteration."""

    def __init__(self) -> None:
        self.tag = -1
        self.hits: list[tuple[int, str]] = []

    def __enter__(self) -> "SyncCounter":
        import warnings

        import torch

        self._saved = [(torch.cuda, "synchronize"), (torch.cuda.Event, "synchronize"),
                       (torch.cuda.Stream, "synchronize")]
        self._saved = [(obj, name, getattr(obj, name)) for obj, name in self._saved]
        for obj, name, fn in self._saved:
            setattr(obj, name, self._wrap(fn, f"{getattr(obj, '__name__', 'cuda')}.{name}"))
        self._warn = warnings.catch_warnings()
        self._warn.__enter__()
        warnings.simplefilter("always")
        shown = warnings.showwarning

        def show(message: Any, category: Any, *args: Any, **kwargs: Any) -> None:
            if "synchroniz" in str(message):
                self.hits.append((self.tag, "implicit"))
            else:
                shown(message, category, *args, **kwargs)

        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def _wrap(self, fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self.hits.append((self.tag, name))
            return fn(*args, **kwargs)

        return wrapper

    def __exit__(self, *exc: Any) -> None:
        import torch

        torch.cuda.set_sync_debug_mode(0)
        self._warn.__exit__(*exc)
        for obj, name, fn in self._saved:
            setattr(obj, name, fn)

    def per_iteration(self, first: int, last: int) -> float:
        """Syncs per iteration over iterations ``first..last`` (inclusive)."""
        n = sum(1 for tag, _ in self.hits if first <= tag <= last)
        return n / max(1, last - first + 1)

    def kinds(self, first: int, last: int) -> str:
        seen: dict[str, int] = {}
        for tag, kind in self.hits:
            if first <= tag <= last:
                seen[kind] = seen.get(kind, 0) + 1
        return ", ".join(f"{k} x{v}" for k, v in sorted(seen.items())) or "none"


# -- the GPT-2-small-like model (plain torch, from a config; no download) -----------------------
@dataclass
class GPTConfig:
    vocab_size: int = 50304  # GPT-2's 50257 padded to a multiple of 64
    seq_len: int = 1024
    n_layer: int = 12
    n_head: int = 12
    d_model: int = 768

    @classmethod
    def tiny(cls) -> "GPTConfig":
        return cls(vocab_size=256, seq_len=32, n_layer=2, n_head=2, d_model=32)


def gpt(cfg: GPTConfig) -> Any:
    """nanoGPT's GPT-2: pre-LayerNorm blocks, causal SDPA, GELU MLP, tied LM head."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            c = cfg.d_model
            self.ln1, self.ln2 = nn.LayerNorm(c), nn.LayerNorm(c)
            self.qkv, self.proj = nn.Linear(c, 3 * c), nn.Linear(c, c)
            self.fc, self.out = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, C]
            B, T, C = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
            q, k, v = (t.view(B, T, cfg.n_head, C // cfg.n_head).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, T, D]
            x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
            return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
            self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
            self.blocks = nn.ModuleList(Block() for _ in range(cfg.n_layer))
            self.ln_f = nn.LayerNorm(cfg.d_model)
            self.apply(self._init)

        @staticmethod
        def _init(m: nn.Module) -> None:
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

        def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # [B, T] -> []
            pos = torch.arange(idx.shape[1], device=idx.device)
            x = self.wte(idx) + self.wpe(pos)
            for block in self.blocks:
                x = block(x)
            logits = self.ln_f(x) @ self.wte.weight.t()  # [B, T, V], tied head
            return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))

    return GPT()


def gpt_slice(ctx: Ctx, name: str, cfg: GPTConfig, batch: int, steps: int, warmup: int, opt_kind: str,
              loader_kwargs: dict, dataset_kwargs: dict, clock_hz: float = 20.0, budget_bytes: int | None = None
              ) -> Any:
    """Profile a training slice of the GPT model on SyntheticTokens; returns the Run."""
    import torch
    from torch.utils.data import DataLoader

    import tpkit as tp
    from tpkit.datasets import SyntheticTokens

    torch.manual_seed(0)
    dev = torch.device(ctx.device)
    model = gpt(cfg).to(dev)
    if opt_kind == "offload":
        opt = tp.offload.CPUOffloadAdamW(model.parameters(), lr=3e-4, weight_decay=0.1, kernel=OFFLOAD_KERNEL)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1,
                                fused=dev.type == "cuda")
    ds = SyntheticTokens(n=batch * (steps + warmup + 4), seq_len=cfg.seq_len, vocab_size=cfg.vocab_size,
                         **dataset_kwargs)
    loader = DataLoader(ds, batch_size=batch, shuffle=True, pin_memory=dev.type == "cuda", **loader_kwargs)
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda")
    budget = cuda_budget(budget_bytes) if budget_bytes else contextlib.nullcontext()
    with budget, tp.profile(steps=steps, warmup=warmup, name=name, progress=False, clock_hz=clock_hz) as prof:
        while True:
            for b in loader:
                x, y = b["x"].to(dev, non_blocking=True), b["y"].to(dev, non_blocking=True)
                with autocast:
                    loss = model(x, y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
    return prof.run


# -- check: env --------------------------------------------------------------------------------
def check_env(ctx: Ctx) -> None:
    """What the GPU checks need, found or named exactly."""
    import torch

    facts = machine_facts()
    if ctx.dry:
        ctx.skip_cuda("cuda", "nvml")
    elif torch.cuda.is_available():
        ctx.add("cuda", "PASS", torch.cuda.device_count(), "GPUs",
                note=f"{facts['gpu']}, driver {facts['driver']}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    else:
        ctx.add("cuda", "FAIL", note=f"torch {torch.__version__} sees no CUDA device: install a CUDA build of "
                                     f"torch {torch.__version__.split('+')[0]} into .venv (the Makefile "
                                     f"installs the CPU wheel)")
    from tpkit.kernels import backend

    if not backend.triton_available():
        ctx.add("triton", "FAIL", note="triton is missing: pip install 'tpkit[triton]'")
    elif ctx.dry:
        ok = backend.triton_mode() == "interpreted"
        ctx.add("triton", "PASS" if ok else "FAIL", note="interpreter (TRITON_INTERPRET=1)" if ok
                else "TRITON_INTERPRET=1 was not in effect before triton was imported")
    else:
        import triton

        mode = backend.triton_mode()
        ctx.add("triton", "PASS" if mode == "compiled" else "FAIL",
                note=f"triton {triton.__version__}, {mode}" + ("" if mode == "compiled" else
                                                               ": unset TRITON_INTERPRET"))
    if not ctx.dry:
        try:
            import pynvml

            pynvml.nvmlInit()
            ctx.add("nvml", "PASS", pynvml.nvmlDeviceGetCount(), "GPUs", note=f"driver {facts['driver']}")
            pynvml.nvmlShutdown()
        except ImportError:
            ctx.add("nvml", "FAIL", note="pynvml is missing: pip install 'tpkit[gpu]' (nvidia-ml-py)")
        except Exception as e:
            ctx.add("nvml", "FAIL", note=f"NVML did not start: {type(e).__name__}: {e}")
    try:
        import liger_kernel  # noqa: F401

        ctx.add("liger", "INFO", note="liger-kernel importable: measured as a kernel peer")
    except ImportError:
        ctx.add("liger", "SKIP", note="liger-kernel not installed (optional peer)")


# -- check: timing -----------------------------------------------------------------------------
#: The known workload per step, in ms: a calibrated GPU spin on CUDA, a host sleep on the CPU
#: (longer there: a loaded host wakes a sleeper a few hundred us late).
PHASES_MS_GPU = {"forward": 10.0, "backward": 20.0, "optimizer": 5.0}
PHASES_MS_CPU = {"forward": 50.0, "backward": 100.0, "optimizer": 40.0}


def _sleep_workload(ctx: Ctx, phases_ms: dict[str, float], unit: Callable[[float], None]) -> tuple[Any, Any]:
    """A model and optimizer whose forward, backward and step each do a known amount of work:
    ``unit(ms)`` (a calibrated GPU spin on CUDA, a host sleep on the CPU)."""
    import torch

    class Spin(torch.autograd.Function):
        @staticmethod
        def forward(fctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            unit(phases_ms["forward"])
            return x * 1.0

        @staticmethod
        def backward(fctx: Any, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            unit(phases_ms["backward"])
            return g

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(1024))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return Spin.apply(x * self.w).sum()

    class SpinSGD(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:  # type: ignore[override]
            unit(phases_ms["optimizer"])
            return super().step(closure)

    model = Model().to(ctx.device)
    return model, SpinSGD(model.parameters(), lr=1e-3)


def calibrate_sleep() -> float:
    """GPU cycles of ``torch.cuda._sleep`` per ms, measured with CUDA events (median of 5)."""
    import torch

    cycles = 2_000_000
    rates = []
    torch.cuda._sleep(cycles)  # warm-up
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.cuda._sleep(cycles)
        b.record()
        b.synchronize()
        rates.append(cycles / a.elapsed_time(b))
    return statistics.median(rates)


def check_timing(ctx: Ctx) -> None:
    """Phase times against a known workload; syncs per step the profiler adds."""
    import torch

    import tpkit as tp

    if ctx.cuda:
        torch.cuda._sleep(200_000_000)  # ~0.1 s of spinning: let the SM clock ramp up first
        per_ms = calibrate_sleep()
        unit = lambda ms: torch.cuda._sleep(int(ms * per_ms))  # noqa: E731
        how = f"torch.cuda._sleep at {per_ms / 1e6:.3f} Gcycles/s (event-calibrated before the slice)"
    else:
        unit = lambda ms: time.sleep(ms / 1e3)  # noqa: E731
        how = "time.sleep on the host (CPU path, host timing)"
    phases_ms = PHASES_MS_GPU if ctx.cuda else PHASES_MS_CPU
    model, opt = _sleep_workload(ctx, phases_ms, unit)
    x = torch.randn(1024, device=ctx.device)

    def loop(n: int | None, counter: SyncCounter | None) -> None:
        i = 0
        while n is None or i < n:
            if counter is not None:
                counter.tag = i
            model(x).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            i += 1

    warmup, steps = 3, 10
    counter = SyncCounter() if ctx.cuda else None
    with counter or contextlib.nullcontext():
        with tp.profile(steps=steps, warmup=warmup, name="gpu_check_timing", progress=False) as prof:
            loop(None, counter)
    run = prof.run
    m = measured_steps(run)
    if ctx.cuda:  # the spin counts SM cycles: a clock that moved during the slice moves the truth
        per_ms_after = calibrate_sleep()
        how += f", {per_ms_after / 1e6:.3f} after ({rel_err(per_ms_after, per_ms):.1%} apart)"
    for phase, truth_ms in phases_ms.items():
        got_ms = median(m[f"{phase}_s"]) * 1e3
        err = rel_err(got_ms, truth_ms)
        ctx.check_goal(f"{phase}_ms", got_ms, err <= 0.10, "ms", f"{truth_ms:g} ms +-10%",
                       f"median of {len(m)} steps, error {err:.1%}; truth: {how}")
    if not ctx.cuda:
        ctx.skip_cuda("syncs_per_step")
        return
    # the same loop without the profiler: the syncs the loop itself makes
    base = SyncCounter()
    with base:
        loop(warmup + steps, base)
    first, last = 1, warmup + steps - 2  # not the iterations that start and end the slice
    added = counter.per_iteration(first, last) - base.per_iteration(first, last)
    ctx.check_goal("syncs_per_step", added, added <= 0, "syncs", "0 added per step",
                   f"with tpkit: {counter.kinds(first, last)}; without: {base.kinds(first, last)}; "
                   f"whole slice: {len(counter.hits)} (documented: one at start, one at the end, "
                   f"then the losses)")


# -- check: memory -----------------------------------------------------------------------------
def _mlp(ctx: Ctx) -> tuple[Any, Any, Any]:
    """Bias-free Linear + ReLU stack (sizes multiples of 512 B: the caching allocator rounds
    every block to 512 B, so byte-exact comparisons need tensors that are multiples of it)."""
    import torch

    width, depth, batch = (4096, 4, 2048) if ctx.cuda else (256, 3, 64)
    layers: list[Any] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width, bias=False), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    return model, torch.randn(batch, width), width


def _at(run: Any, device: str, phase: str, event: str, category: str) -> int | None:
    """Bytes of ``category`` at a boundary of the first measured step (None: no such row)."""
    mem = run.memory
    sel = mem[(mem["device"] == device) & (mem["phase"] == phase) & (mem["event"] == event)
              & (mem["category"] == category) & (mem["step"] >= 0)]
    return int(sel.iloc[0]["bytes"]) if len(sel) else None


def check_memory(ctx: Ctx) -> None:
    """The waterfall's categories against the allocator (CUDA) or the tensors (CPU)."""
    import torch

    import tpkit as tp

    torch.manual_seed(0)
    model, x_host, width = _mlp(ctx)
    dev = torch.device(ctx.device)
    alloc = torch.cuda.memory_allocated if ctx.cuda else None
    x = x_host.to(dev)
    sync = torch.cuda.synchronize if ctx.cuda else (lambda: None)

    # truth, from the allocator, around one unprofiled step (CPU: from the tensors). cuBLAS
    # makes a workspace per thread at its first matmul (32 MiB each on an H200: the forward's
    # thread and autograd's), held from then on: a throwaway step on a few rows makes them
    # first, so the deltas below are the step's own (the first GPU run read them as
    # activations and gradients: docs/GPU_RUNS.md)
    model.to(dev)
    model(x[:8]).sum().backward()
    model.zero_grad(set_to_none=True)
    model.to("cpu")
    sync()
    a0 = alloc() if alloc else 0
    model.to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sync()
    params = (alloc() - a0) if alloc else sum(p.untyped_storage().nbytes() for p in model.parameters())
    a1 = alloc() if alloc else 0
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats()
    saved: dict[int, int] = {}  # CPU truth: what autograd saved, by storage, and the outputs

    def pack(t: Any) -> Any:
        st = t.untyped_storage()
        saved[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
        loss = out.square().mean()
    sync()
    if alloc:
        act = alloc() - a1
    else:
        for t in (out, loss):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        for t in [x, *model.parameters()]:
            saved.pop(t.untyped_storage().data_ptr(), None)
        act = sum(saved.values())
    del out
    loss.backward()
    del loss
    sync()
    grads = (alloc() - a1) if alloc else sum(p.grad.untyped_storage().nbytes() for p in model.parameters())
    a2 = alloc() if alloc else 0
    opt.step()
    sync()
    state = (alloc() - a2) if alloc else sum(t.untyped_storage().nbytes() for s in opt.state.values()
                                             for t in s.values() if isinstance(t, torch.Tensor))
    opt.zero_grad(set_to_none=True)
    # the peak of a step with the state already there, as in the profiled steps
    if ctx.cuda:
        sync()
        torch.cuda.reset_peak_memory_stats()
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        peak_truth = torch.cuda.max_memory_allocated() - x.untyped_storage().nbytes()

    batches = [x] * 64
    with tp.profile(steps=4, warmup=2, name="gpu_check_memory", progress=False, clock_hz=0) as prof:
        for xb in tp.watch(batches):  # the batch is known as data
            model(xb).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    run = prof.run
    dname = "cuda:0" if ctx.cuda else "cpu"
    # the rows behind the figures below, for whoever reads a failure
    ctx.out.mkdir(parents=True, exist_ok=True)
    run.memory[run.memory["step"].between(0, 1)].to_csv(ctx.out / "memory_rows.csv", index=False)
    truth_src = "torch.cuda.memory_allocated deltas" if ctx.cuda else "the tensors' storage bytes"
    for cat, truth, phase, event in (("parameters", params, "forward", "enter"),
                                     ("gradients", grads, "backward", "exit"),
                                     ("optimizer_state", state, "optimizer", "exit")):
        got = _at(run, dname, phase, event, cat)
        ctx.check_goal(cat, got if got is not None else float("nan"), got == truth, "bytes",
                       "byte-exact", f"truth {truth:,} B from {truth_src}, at {phase} {event}")
    got = _at(run, dname, "forward", "exit", "activations")
    err = rel_err(got or 0, act)
    ctx.check_goal("activations", got or float("nan"), err <= 0.10, "bytes", "+-10%",
                   f"truth {act:,} B ({'allocated after forward - before' if ctx.cuda else 'tensors autograd saved + outputs'}), "
                   f"error {err:.1%}")
    if ctx.cuda:
        from tpkit.analysis.memory import memory_peak

        # tpkit's own reading of the peak (a step has two optimizer spans, step and zero_grad:
        # summing a phase's rows, as the first GPU run did, counted the peak twice)
        top = memory_peak(run.memory, dname)
        got_peak = int(top["total_bytes"].iloc[0]) - x.untyped_storage().nbytes()
        err = rel_err(float(got_peak), peak_truth)
        bounded = run.meta.get("memory", {}).get("peak_lower_bound", {}).get(dname)
        said = bounded is not None and any("peaks are lower bounds" in n for n in run.meta.get("notes", []))
        # the process's peak counter was raised by the unprofiled steps before the slice, so
        # tpkit can only bound the stretches' peaks from below: it must say so, and stay below
        ok = err <= 0.10 or (said and got_peak <= peak_truth * 1.10)
        ctx.check_goal("step_peak", float(got_peak), ok, "bytes",
                       "+-10%, or a lower bound the run says is one",
                       f"truth {peak_truth:,} B from max_memory_allocated over an unprofiled step, "
                       f"error {err:.1%}; " + (f"the run says: lower bound in {bounded[:40]}..." if said
                                               else "the run says the peak is exact"))
        # since session 28 each stretch's peak comes from the caching allocator's own reports in
        # the profiler stream (MemoryProbe._stream_cuda_peaks): no stretch should be left a lower
        # bound, and the step's peak should be the truth (the first H200 run read 19% low)
        ctx.check_goal("step_peak_exact", float(got_peak), bounded is None and err <= 0.01, "bytes",
                       "+-1%, no stretch a lower bound",
                       f"truth {peak_truth:,} B; error {err:.1%}; stretches the run calls lower bounds: "
                       f"{bounded[:60] if bounded else 'none'}")
        _check_memory_detail_and_user_state(ctx, model, opt, x)
    else:
        ctx.skip_cuda("step_peak", "step_peak_exact", "detail_top_allocations", "user_peak_kept",
                      "user_history_kept", "detail_slice_only")


def _check_memory_detail_and_user_state(ctx: Ctx, model: Any, opt: Any, x: Any) -> None:
    """``memory_detail=True``: the largest allocations alive at the peak, with stacks. And
    the process-global allocator state a user set up before a slice is still theirs after it
    (issue 17, 4): their peak counter, their allocator history."""
    import torch

    import tpkit as tp

    def detail_slice(name: str) -> Any:
        with tp.profile(steps=2, warmup=1, name=name, progress=False, clock_hz=0, memory_detail=True) as prof:
            while True:
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        return prof.run.meta.get("memory", {}).get("top_at_peak", {}).get("cuda:0", {})

    top = detail_slice("gpu_check_memory_detail")
    allocs = top.get("allocations", [])
    with_stacks = [a for a in allocs if a.get("stack")]
    act_bytes = x.untyped_storage().nbytes()  # each activation of the MLP is the batch's size
    ok = len(with_stacks) >= 1 and allocs[0]["bytes"] >= act_bytes
    ctx.check_goal("detail_top_allocations", len(with_stacks), ok, "allocations",
                   f">= 1 with a stack, the largest >= one activation ({act_bytes:,} B)",
                   (f"largest {allocs[0]['bytes']:,} B at {allocs[0]['stack'][:1]}; peak {top.get('peak_bytes', 0):,} B")
                   if allocs else "no allocation listed")

    # the user's own state, set up before the next slice
    marker_bytes = (256 << 20) + 7 * 512  # a size nothing else allocates
    big = torch.empty(marker_bytes, dtype=torch.uint8, device="cuda")
    del big
    user_peak = torch.cuda.max_memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    top = detail_slice("gpu_check_memory_user_state")
    after = torch.cuda.max_memory_allocated()
    ctx.check_goal("user_peak_kept", after, after >= user_peak, "bytes", f">= {user_peak:,} (the user's)",
                   "max_memory_allocated after a slice vs before it")
    size = 5860 * 512  # is an allocation made after the slice still in the user's history?
    probe = torch.empty(size, dtype=torch.uint8, device="cuda")
    snap = torch.cuda.memory._snapshot()
    recorded = any(e.get("action") == "alloc" and e.get("size") == size
                   for trace in snap.get("device_traces", []) for e in trace)
    del probe
    torch.cuda.memory._record_memory_history(enabled=None)
    ctx.check_goal("user_history_kept", float(recorded), recorded, "", "still recording after the slice",
                   "an allocator history the user started before a memory_detail slice")
    stale = [a for a in top.get("allocations", []) if a["bytes"] == marker_bytes]
    ctx.check_goal("detail_slice_only", float(len(stale)), not stale, "stale allocations", "0",
                   "an allocation freed before the slice must not be listed at the slice's peak (the "
                   "user's history was on)")


# -- check: clocks -----------------------------------------------------------------------------
GPU_METRICS = ("sm_clock_mhz", "mem_clock_mhz", "power_w", "energy_j", "temperature_c", "throttle_reasons")


def _busy_model(ctx: Ctx) -> tuple[Any, Any, Callable[[], None]]:
    """A step of ~90 ms of GPU matmuls (60 x 1.1 TFLOP; CPU: a 30 ms sleep) that ends at opt.step."""
    import torch

    n, reps = (8192, 60) if ctx.cuda else (64, 4)
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    a = torch.randn(n, n, device=ctx.device, dtype=dtype)
    w = torch.nn.Parameter(torch.ones(1, device=ctx.device))
    opt = torch.optim.SGD([w], lr=0.0)

    def step() -> None:
        c = a
        for _ in range(reps):
            c = torch.tanh(c @ a * n**-0.5)  # 2 n^3 FLOP each; the scale keeps values ~1 (no denormals)
        if not ctx.cuda:
            time.sleep(0.03)  # the CPU step: mostly idle, so the host sampler's rate is the machine's
        (c.float().mean() * w).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return w, opt, step


def check_clocks(ctx: Ctx) -> None:
    import tpkit as tp

    _, _, step = _busy_model(ctx)
    for _ in range(3):
        step()
    durations: dict[float, list[float]] = {}
    # on the GPU, slices without the sampler before and after the 100 Hz one: drift cancels
    for hz in (20.0, 0.0, 100.0, 0.0) if ctx.cuda else (20.0, 100.0):
        if ctx.left() < 15:
            ctx.add(f"slice_{hz:g}hz", "SKIP", note="time budget")
            continue
        run = tp.profile_fn(step, steps=15, warmup=2, name=f"gpu_check_clocks_{hz:g}hz", progress=False,
                            clock_hz=hz, memory=False)
        m = measured_steps(run)
        durations.setdefault(hz, []).append(median(m["duration_s"]))
        if hz == 0:
            continue
        info = run.meta.get("clocks", {})
        span_s = float(m["end_s"].max() - m["start_s"].min())
        clocks = run.clocks
        if ctx.cuda:
            dev = clocks[clocks["device"] == "cuda:0"]
            have = set(dev["metric"])
            missing = [mm for mm in GPU_METRICS if mm not in have]
            ctx.check_goal(f"nvml_metrics_{hz:g}hz", len(GPU_METRICS) - len(missing), not missing, "metrics",
                           f"all of {', '.join(GPU_METRICS)}",
                           f"missing {missing}; dropped {info.get('dropped')}" if missing else "")
            rows = dev[dev["metric"] == "sm_clock_mhz"]
        else:
            rows = clocks[(clocks["device"] == "cpu") & (clocks["metric"] == "cpu_util_pct")]
            ctx.skip_cuda(f"nvml_metrics_{hz:g}hz")
        inside = rows[(rows["t_s"] >= m["start_s"].min()) & (rows["t_s"] <= m["end_s"].max())]
        rate = len(inside) / span_s if span_s > 0 else 0.0
        if ctx.cuda:
            ctx.check_goal(f"rate_{hz:g}hz", rate, abs(rate - hz) <= 0.1 * hz, "Hz", f"{hz:g} Hz +-10%",
                           f"sm_clock_mhz samples over the measured steps ({span_s:.2f} s); "
                           f"late ticks {info.get('late_samples')}")
            per_step = [((inside["t_s"] >= s) & (inside["t_s"] < e)).sum() for s, e in zip(m["start_s"], m["end_s"])]
            aligned = sum(1 for k in per_step if k >= 1) / max(1, len(per_step))
            ctx.check_goal(f"aligned_{hz:g}hz", aligned, aligned >= 0.9, "of steps", ">= 90% of steps hold a sample",
                           f"median step {durations[hz][-1] * 1e3:.0f} ms")
            _energy_rows(ctx, hz, dev, m)
        else:  # the host sampler on a shared CPU: its rate is a figure, its time base a check
            ctx.add(f"rate_{hz:g}hz", "INFO", rate, "Hz", note=f"cpu_util_pct samples over the measured steps "
                    f"({span_s:.2f} s); late ticks {info.get('late_samples')}")
            ctx.check_goal(f"host_rows_{hz:g}hz", len(inside), len(inside) >= 2, "samples",
                           ">= 2 host samples on the steps' time base")
            ctx.skip_cuda(f"aligned_{hz:g}hz", f"energy_per_step_{hz:g}hz", f"energy_vs_power_{hz:g}hz")
        ctx.add(f"sampler_cpu_{hz:g}hz", "INFO", 100 * float(info.get("sampler_cpu_share", float("nan"))),
                "% of a core", note="the sampler thread's own CPU time over the slice")
    if ctx.cuda and 0.0 in durations and 100.0 in durations:
        off = statistics.mean(durations[0.0])
        cost = durations[100.0][0] / off - 1
        ctx.check_goal("sampler_cost_100hz", 100 * cost, cost <= 0.01, "% step time", "<= 1%",
                       f"median step {durations[100.0][0] * 1e3:.2f} ms at 100 Hz vs {off * 1e3:.2f} ms "
                       f"without the sampler (slices before and after: "
                       f"{', '.join(f'{d * 1e3:.2f}' for d in durations[0.0])} ms)")
    elif not ctx.cuda:
        ctx.skip_cuda("sampler_cost_100hz")


def _energy_rows(ctx: Ctx, hz: float, dev: Any, m: Any) -> None:
    """Energy per measured step from the energy counter; against the power readings' integral."""
    e = dev[dev["metric"] == "energy_j"].sort_values("t_s")
    p = dev[dev["metric"] == "power_w"].sort_values("t_s")
    t0, t1 = float(m["start_s"].min()), float(m["end_s"].max())
    e_in = e[(e["t_s"] >= t0) & (e["t_s"] <= t1)]
    if len(e_in) < 2:
        ctx.add(f"energy_per_step_{hz:g}hz", "FAIL", note="fewer than 2 energy samples over the steps")
        return
    joules = float(e_in["value"].iloc[-1] - e_in["value"].iloc[0])
    dt = float(e_in["t_s"].iloc[-1] - e_in["t_s"].iloc[0])
    per_step = joules / dt * median(m["duration_s"])
    ctx.add(f"energy_per_step_{hz:g}hz", "INFO", per_step, "J/step",
            note=f"{joules:.1f} J over {dt:.2f} s from the energy counter ({joules / dt:.0f} W)")
    p_in = p[(p["t_s"] >= t0) & (p["t_s"] <= t1)]
    if len(p_in):
        mean_w = float(p_in["value"].mean())
        err = rel_err(mean_w, joules / dt)
        ctx.check_goal(f"energy_vs_power_{hz:g}hz", err * 100, err <= 0.15, "% apart", "<= 15%",
                       f"mean power_w {mean_w:.0f} W vs energy counter {joules / dt:.0f} W "
                       f"(power_w is a ~1 s average on recent GPUs: issue 17, 14)")
    bits = {int(v) for v in dev[dev["metric"] == "throttle_reasons"]["value"]}
    seen = 0
    for b in bits:
        seen |= b
    ctx.add(f"throttle_bits_{hz:g}hz", "INFO", seen, "bitmask", note=f"throttle reasons seen: {hex(seen)}")


# -- check: kernels ----------------------------------------------------------------------------
def _load_kernel_bench() -> Any:
    """benchmarks/kernels.py as a module (its name would clash with the repo's kernels/)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("kernels_bench", HERE / "kernels.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[spec.name] = module  # type: ignore[union-attr]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _correct_cases(cuda: bool) -> list[tuple[str, Callable[..., Any], Callable[..., Any], Callable[[Any, Any], list[Any]]]]:
    """(name, kernel fn, reference fn, make(device, dtype) -> inputs): odd shapes, seeded."""
    import torch

    import tpkit.kernels as K
    from tpkit.kernels import reference as R

    def randn(*shape: int, dev: Any, dt: Any, scale: float = 1.0) -> Any:
        gen = torch.Generator().manual_seed(sum(shape))
        return (torch.randn(*shape, generator=gen) * scale).to(dev, dt)

    def cache(t: int, d: int) -> tuple[Any, Any]:
        ang = torch.arange(t)[:, None] / 10000 ** (torch.arange(d // 2)[None, :] / (d // 2))
        return ang.cos(), ang.sin()

    if cuda:
        rows, cols, wide, sw, rope_s, ce = 4099, 4096, 16387, (1000, 3001), (2, 8, 257, 128), (1031, 512, 32003)
    else:
        rows, cols, wide, sw, rope_s, ce = 7, 37, 70, (5, 37), (1, 2, 5, 8), (13, 16, 97)
    cap = None if cuda else 32  # on the CPU the chunked path needs a forced cap

    def flce_make(dev: Any, dt: Any) -> list[Any]:
        n, c, v = ce
        t = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(1)).to(dev)
        t[::7] = -100
        return [randn(n, c, dev=dev, dt=dt), randn(v, c, dev=dev, dt=dt, scale=c ** -0.5), t]

    b, h, tt, d = rope_s
    cs = cache(tt + 3, d)
    return [
        ("rms_norm", lambda x, w: K.rms_norm(x, w, 1e-6), lambda x, w: R.rms_norm_reference(x, w, 1e-6),
         lambda dev, dt: [randn(rows, cols, dev=dev, dt=dt, scale=3), 1 + randn(cols, dev=dev, dt=dt, scale=0.1)]),
        ("rms_norm_chunked", lambda x, w: K.rms_norm(x, w, 1e-6, max_block_c=cap),
         lambda x, w: R.rms_norm_reference(x, w, 1e-6),
         lambda dev, dt: [randn(rows, wide, dev=dev, dt=dt, scale=3), 1 + randn(wide, dev=dev, dt=dt, scale=0.1)]),
        ("swiglu", K.swiglu, R.swiglu_reference,
         lambda dev, dt: [randn(*sw, dev=dev, dt=dt, scale=3), randn(*sw, dev=dev, dt=dt)]),
        ("rope", lambda q, k: K.rope(q, k, *[c.to(q.device) for c in cs]),
         lambda q, k: R.rope_reference(q, k, *[c.to(q.device) for c in cs]),
         lambda dev, dt: [randn(b, h, tt, d, dev=dev, dt=dt), randn(b, h // 2 or 1, tt, d, dev=dev, dt=dt)]),
        ("fused_linear_cross_entropy", lambda hh, w, t: K.fused_linear_cross_entropy(hh, w, t, chunk_size=None if cuda else 4),
         R.linear_cross_entropy_reference, flce_make),
    ]


def _compare(fn: Callable[..., Any], ref: Callable[..., Any], inputs: list[Any], autocast: Any = None
             ) -> float:
    """Max relative error (|a - b| / (atol + |b|) style, worst over outputs and every grad)."""
    import torch

    results = []
    cot = None
    for f in (fn, ref):
        xs = [t.detach().clone().requires_grad_(True) if t.is_floating_point() else t for t in inputs]
        with autocast or contextlib.nullcontext():
            out = f(*xs)
        outs = out if isinstance(out, tuple) else (out,)
        if cot is None:
            gen = torch.Generator().manual_seed(0)
            cot = [torch.randn(o.shape, generator=gen).to(o.device, o.dtype) for o in outs]
        torch.autograd.backward(outs, cot)
        results.append(list(outs) + [x.grad for x in xs if x.is_floating_point()])
    worst = 0.0
    for a, b in zip(*results):
        a, b = a.detach().float(), b.detach().float()
        scale = b.abs().max().clamp_min(1e-6)
        worst = max(worst, float((a - b).abs().max() / scale))
    return worst


def check_kernels(ctx: Ctx) -> None:
    import torch

    from tpkit.kernels import backend

    mode = "compiled Triton" if ctx.cuda else "Triton's interpreter"
    probe = torch.zeros(1, device=ctx.device)
    chosen = backend.select_backend(probe)
    if chosen not in ("triton", "interpreter"):
        ctx.add("backend", "FAIL", note=f"tpkit.kernels would run {chosen!r} here, not Triton")
        return
    ctx.add("backend", "PASS", note=f"{chosen} ({mode})")
    tol = {torch.float32: 1e-4 if ctx.cuda else 1e-5, torch.bfloat16: 3e-2}
    for name, fn, ref, make in _correct_cases(ctx.cuda):
        for dt in (torch.float32, torch.bfloat16):
            tag = "fp32" if dt == torch.float32 else "bf16"
            err = _compare(fn, ref, make(ctx.device, dt))
            ctx.check_goal(f"correct_{name}_{tag}", err, err <= tol[dt], "max rel err", f"<= {tol[dt]:g}",
                           f"outputs and every gradient vs the torch reference, {mode}")
    # fused linear cross-entropy under autocast with fp32 weights (issue 17, 1)
    name, fn, ref, make = _correct_cases(ctx.cuda)[-1]
    ac = torch.autocast(ctx.device, dtype=torch.bfloat16)
    err = _compare(fn, ref, make(ctx.device, torch.float32), autocast=ac)
    ctx.check_goal("correct_flce_autocast_bf16", err, err <= 3e-2, "max rel err", "<= 0.03",
                   "fp32 weights under torch.autocast(bf16), vs eager under the same autocast")
    if not ctx.cuda:
        ctx.skip_cuda("device_guard", "goal_rms_norm_speed", "goal_flce_memory_time", "speed_swiglu",
                      "speed_rope", "liger_peer")
        return
    _device_guard_row(ctx)
    _speed_rows(ctx)


def _device_guard_row(ctx: Ctx) -> None:
    """A launch on cuda:1 while cuda:0 is current (issue 17, 7); needs two GPUs."""
    import torch

    import tpkit.kernels as K
    from tpkit.kernels import reference as R

    if torch.cuda.device_count() < 2:
        ctx.add("device_guard", "SKIP", note="one GPU: needs two")
        return
    with torch.cuda.device(0):
        x, w = torch.randn(513, 4096, device="cuda:1"), torch.randn(4096, device="cuda:1")
        y = K.rms_norm(x, w, 1e-6)
        torch.cuda.synchronize(1)
        err = float((y - R.rms_norm_reference(x, w, 1e-6)).abs().max())
    ctx.check_goal("device_guard", err, err <= 1e-4, "max abs err", "<= 1e-4",
                   "rms_norm on cuda:1 with cuda:0 current")


def _liger_peers() -> dict[str, Callable[..., Any]]:
    """Liger-Kernel's functional ops, when installed (their signatures moved between versions:
    each is probed, and one that does not fit is left out)."""
    try:
        from liger_kernel.transformers import functional as LF
    except ImportError:
        return {}
    peers: dict[str, Callable[..., Any]] = {}
    if hasattr(LF, "liger_rms_norm"):
        peers["rms_norm"] = lambda x, w: LF.liger_rms_norm(x, w, 1e-6)
    if hasattr(LF, "liger_swiglu"):
        peers["swiglu"] = LF.liger_swiglu
    if hasattr(LF, "liger_fused_linear_cross_entropy"):
        def flce(h: Any, w: Any, t: Any) -> Any:
            out = LF.liger_fused_linear_cross_entropy(h, w, t)
            return out[0] if isinstance(out, tuple) else out

        peers["fused_linear_cross_entropy"] = flce
    return peers


def _speed_rows(ctx: Ctx) -> None:
    """benchmarks/kernels.py's cases at the goals' sizes, fwd+bwd: tpkit vs eager vs
    torch.compile (and Liger), timed with do_bench; peak memory from the allocator."""
    import torch

    bench = _load_kernel_bench()
    wanted = [("rms_norm", "tokens=8192,hidden=4096"), ("fused_linear_cross_entropy", "tokens=8192,hidden=4096,vocab=128256"),
              ("swiglu", "tokens=4096,intermediate=14336"), ("rope", "B=4,H=32,T=2048,D=128")]
    by_key = {(c.op, c.shape): c for c in bench.cases(cpu_smoke=False)}
    liger = _liger_peers()
    rows: list[dict[str, Any]] = []
    for op, shape in wanted:
        case = by_key.get((op, shape))
        if case is None:
            ctx.add(f"case_{op}", "FAIL", note=f"benchmarks/kernels.py has no case {op} [{shape}]")
            continue
        if ctx.left() < 40:
            ctx.add(f"case_{op}", "SKIP", note="time budget")
            continue
        rows += bench.run([case], torch.device("cuda"), torch.bfloat16, True, bench._time_gpu, modes=("fwd_bwd",))
        if op in liger and ctx.left() > 20:
            peer = bench.Case(op, shape, case.make, liger[op], case.eager)
            lrows = bench.run([peer], torch.device("cuda"), torch.bfloat16, False, bench._time_gpu,
                              modes=("fwd_bwd",), peers=("tpkit",))
            for r in lrows:
                r["peer"] = "liger"
            rows += lrows
    _write_long_csv(ctx.out / "kernels_long.csv", rows)

    def get(op: str, peer: str) -> dict[str, Any] | None:
        found = [r for r in rows if r["op"] == op and r["peer"] == peer and r["p50_ms"] == r["p50_ms"]]
        return found[-1] if found else None

    t, e, c = get("rms_norm", "tpkit"), get("rms_norm", "eager"), get("rms_norm", "compile")
    if t and e and c:
        vs_e, vs_c = e["p50_ms"] / t["p50_ms"], c["p50_ms"] / t["p50_ms"]
        ctx.check_goal("goal_rms_norm_speed", vs_e, vs_e >= 2 and vs_c >= 1, "x eager", ">= 2x eager, >= 1x compile",
                       f"{vs_c:.2f}x torch.compile; tpkit {t['p50_ms']:.3f} ms [{t['shape']}] fwd+bwd bf16")
    else:
        ctx.add("goal_rms_norm_speed", "FAIL", note="not measured (see kernels_long.csv notes)")
    t, e = get("fused_linear_cross_entropy", "tpkit"), get("fused_linear_cross_entropy", "eager")
    if t and e and t["peak_bytes"] and e["peak_bytes"]:
        mem, tm = t["peak_bytes"] / e["peak_bytes"], t["p50_ms"] / e["p50_ms"]
        ctx.check_goal("goal_flce_memory_time", mem, mem <= 0.5 and tm <= 1.1, "x eager peak",
                       "<= 0.5x eager peak, <= 1.1x eager time", f"time {tm:.2f}x eager; [{t['shape']}] bf16")
    else:
        ctx.add("goal_flce_memory_time", "FAIL", note="not measured (eager may be out of memory: see CSV)")
    for op in ("swiglu", "rope"):
        t, e, c = get(op, "tpkit"), get(op, "eager"), get(op, "compile")
        if t and e:
            ctx.add(f"speed_{op}", "INFO", e["p50_ms"] / t["p50_ms"], "x eager",
                    note=f"{(c['p50_ms'] / t['p50_ms']) if c else float('nan'):.2f}x torch.compile, fwd+bwd bf16")
        else:
            ctx.add(f"speed_{op}", "SKIP", note="not measured")
    for op in liger:
        t, lg = get(op, "tpkit"), get(op, "liger")
        if t and lg:
            ctx.add(f"liger_{op}", "INFO", lg["p50_ms"] / t["p50_ms"], "x liger time",
                    note=f"tpkit peak {t['peak_bytes']:,} B vs liger {lg['peak_bytes']:,} B")
    if not liger:
        ctx.add("liger_peer", "SKIP", note="liger-kernel not installed")


def _write_long_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


# -- check: offload ----------------------------------------------------------------------------
#: torch's fused host AdamW: kernel="auto" would JIT-build DeepSpeed's cpu_adam first (a minute
#: or more, tpkit/offload/kernels.py), which this check's budget cannot hold; the two measure
#: within a few % of each other (benchmarks/results/offload_quiet_run.txt).
OFFLOAD_KERNEL = "torch"

def check_offload(ctx: Ctx) -> None:
    import torch

    import tpkit as tp

    if ctx.cuda:  # this check runs in a process of its own: a tight budget wants few, growable segments
        with contextlib.suppress(Exception):
            torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    # 1. the same update as torch AdamW, through the pinned buffers and the side stream
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 512))
    a, b = copy.deepcopy(base).to(ctx.device), copy.deepcopy(base).to(ctx.device)
    oa = torch.optim.AdamW(a.parameters(), lr=1e-3, weight_decay=0.1)
    ob = tp.offload.CPUOffloadAdamW(b.parameters(), lr=1e-3, weight_decay=0.1, kernel=OFFLOAD_KERNEL)
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        x = torch.randn(64, 512, generator=gen).to(ctx.device)
        for model, opt in ((a, oa), (b, ob)):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    diff = max(float((pa - pb).abs().max()) for pa, pb in zip(a.parameters(), b.parameters()))
    ctx.check_goal("matches_adamw", diff, diff <= 1e-5, "max |dparam|", "<= 1e-5",
                   f"5 steps, {'pinned buffers + side stream' if ctx.cuda else 'CPU path'}")
    del a, b, oa, ob

    # 2. a GPT-2-medium slice on a GPU budget that its AdamW state does not fit: offloaded
    cfg = GPTConfig(n_layer=24, n_head=16, d_model=1024) if ctx.cuda else GPTConfig.tiny()
    batch = 4 if ctx.cuda else 2
    facts = machine_facts()
    budget = None
    if ctx.cuda:
        # measured: parameters + gradients + a step's activations, with no optimizer state
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        probe = gpt(cfg).cuda()
        x = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            probe(x, x).backward()
        torch.cuda.synchronize()
        need = torch.cuda.max_memory_allocated()
        state = 2 * sum(p.numel() * 4 for p in probe.parameters())  # AdamW's exp_avg + exp_avg_sq, fp32
        del probe, x
        torch.cuda.empty_cache()
        budget = need + min(need // 10, state // 2)  # headroom, but less than the state would take
        ctx.add("budget", "INFO", budget / 2**30, "GiB",
                note=f"params + grads + activations {need / 2**30:.2f} GiB plus {(budget - need) / 2**30:.2f} GiB "
                     f"headroom; AdamW's state would need {state / 2**30:.2f} GiB more")
    steps, warmup = (8, 3) if ctx.cuda else (3, 1)
    run = gpt_slice(ctx, f"offload_{gpu_slug()}" if ctx.cuda else "offload_dry", cfg, batch, steps, warmup,
                    "offload", dict(num_workers=2 if ctx.cuda else 0), {}, budget_bytes=budget)
    m = measured_steps(run)
    if ctx.cuda:
        # the offload probe's own account (over every step of the slice): the phase columns
        # are not it, since the side stream's offload spans overlap the optimizer's and the next
        # step's (the first GPU runs summed them and read 0.88 and 1.76 of the step)
        off = run.meta.get("offload", {})
        exposed = float(off.get("exposed_s", float("nan"))) / float(run.steps["duration_s"].sum())
        ctx.check_goal("exposed_share", exposed, exposed <= 0.25, "of step", "<= 25%",
                       f"the offload probe's exposed_s over the slice's steps ({off.get('steps')} steps, "
                       f"overlapped {off.get('overlap_share', float('nan')):.0%} of the offload work; host step "
                       f"{1e3 * float(off.get('host_step_per_step_s', float('nan'))):.0f} ms/step with the "
                       f"{off.get('kernel')} kernel on {off.get('worker_threads')} threads); step "
                       f"{median(m['duration_s']) * 1e3:.0f} ms; {run.summary().verdict.text}")
        ctx.add("pinned_bytes", "INFO", off.get("pinned_bytes", float("nan")), "bytes",
                note=f"host state {off.get('host_state_bytes')} B (issue 17, 8: per-parameter pinning rounds up)")
    else:
        ctx.skip_cuda("budget", "exposed_share", "pinned_bytes", "fits_budget")
    if ctx.cuda:  # it ran under set_per_process_memory_fraction(budget); its peak as tpkit measured it
        mem = run.memory
        peaks = mem[(mem["device"] == "cuda:0") & (mem["event"] == "peak")].groupby(["step", "phase"])["bytes"].sum()
        peak = float(peaks.max()) if len(peaks) else float("nan")
        ctx.check_goal("fits_budget", peak / 2**30, peak <= (budget or 0), "GiB", f"<= {(budget or 0) / 2**30:.2f} GiB",
                       "the slice's highest phase peak (run.memory), run under a per-process cap at the budget")
    _save_reference(ctx, run, "offload slice", dict(model=asdict(cfg), batch=batch, optimizer="CPUOffloadAdamW",
                                                     kernel=OFFLOAD_KERNEL, budget_bytes=budget), facts)


def _save_reference(ctx: Ctx, run: Any, made_by: str, config: dict, facts: dict[str, Any]) -> None:
    """Save ``run`` as a reference run (dry: into the output folder), reload it, one row."""
    import tpkit as tp

    stamp_meta(run, facts, made_by, config, ctx.dry)
    path = ctx.runs_dir / run.name
    run.save(path)
    back = tp.load(str(path))
    ok = len(back.steps) == len(run.steps) and len(back.steps) > 0
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    ctx.check_goal(f"saved_{run.name}", len(back.steps), ok, "steps", "saved and reloaded",
                   f"{where}; {back.summary().verdict.text[:80]}" + (" (dry: CPU, not a reference)" if ctx.dry else ""))


# -- check: loader -----------------------------------------------------------------------------
def covered_share(intervals: list[tuple[float, float]], covers: list[tuple[float, float]]) -> tuple[float, float]:
    """(share of the total length of ``intervals`` that some interval of ``covers`` overlaps,
    total length): how much of the HtoD copy time ran while a kernel ran."""
    covered = total = 0.0
    for s, e in intervals:
        total += e - s
        cur = s
        for a, b in sorted((max(s, a), min(e, b)) for a, b in covers if b > s and a < e):
            if b > cur:
                covered += b - max(a, cur)
                cur = b
    return (covered / total if total else 0.0), total


class _Batches:
    """Map-style dataset whose items are whole batches ([rows, 4096] fp32)."""

    def __init__(self, n: int, rows: int) -> None:
        self.n, self.rows = n, rows

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        import torch

        return torch.full((self.rows, 4096), float(i % 7))


def check_loader(ctx: Ctx) -> None:
    import torch

    import tpkit as tp

    rows = 1024 if ctx.cuda else 16  # 16 MiB per batch on the GPU
    n_mat, reps = (4096, 12) if ctx.cuda else (128, 4)
    w = torch.nn.Parameter(torch.randn(4096, n_mat, device=ctx.device) * 4096**-0.5)
    w2 = torch.nn.Parameter(torch.randn(n_mat, n_mat, device=ctx.device) * n_mat**-0.5)
    opt = torch.optim.SGD([w, w2], lr=0.0)

    def compute(xb: Any) -> None:
        h = torch.tanh(xb @ w)  # [rows, n_mat]
        for _ in range(reps):
            h = torch.tanh(h @ w2)  # values stay ~1: no denormals
        h.float().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    loader = tp.data.Loader(_Batches(64, rows), batch_size=None, num_workers=2, device=ctx.device if ctx.cuda else None,
                            pin_memory=ctx.cuda, mode="process")
    if not ctx.cuda:
        with tp.profile(steps=4, warmup=1, name="gpu_check_loader", progress=False, clock_hz=0) as prof:
            while True:
                for xb in loader:
                    compute(xb)
        run = prof.run
        ctx.check_goal("cpu_path", len(run.loader), len(run.loader) > 0, "batch rows", "run.loader filled",
                       f"{len(measured_steps(run))} steps; {run.summary().verdict.text[:70]}")
        ctx.skip_cuda("h2d_overlap_timeline", "h2d_exposed_share", "step_vs_resident")
        return
    # 1. the timeline: HtoD copies of the loader's side stream under compute kernels
    it = iter(loader)
    for _ in range(3):
        compute(next(it))
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof_t:
        for _ in range(6):
            compute(next(it))
        torch.cuda.synchronize()
    events = [e for e in prof_t.events() if e.device_type.name == "CUDA"]
    copies = [(e.time_range.start, e.time_range.end) for e in events if "htod" in e.name.lower()]
    kernels = [(e.time_range.start, e.time_range.end) for e in events
               if "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]
    share, total = covered_share(copies, kernels)
    ctx.check_goal("h2d_overlap_timeline", share, share >= 0.8 and total > 0, "of HtoD time", ">= 80% under kernels",
                   f"{len(copies)} HtoD copies, {total / 1e3:.2f} ms, in a torch.profiler CUDA trace of 6 steps")
    # 2. what tpkit charges as h2d, and the step against batches already on the GPU
    del it
    with tp.profile(steps=8, warmup=2, name="gpu_check_loader", progress=False, clock_hz=0) as prof:
        while True:
            for xb in loader:
                compute(xb)
    m = measured_steps(prof.run)
    h2d = median(m["h2d_s"] / m["duration_s"])
    ctx.check_goal("h2d_exposed_share", h2d, h2d <= 0.05, "of step", "<= 5%",
                   f"median h2d_s / step; data_wait {median(m['data_wait_s'] / m['duration_s']):.1%} "
                   f"(issue 17, 3: side-stream copies charged as h2d)")
    resident = torch.full((rows, 4096), 1.0, device="cuda")
    t = []
    for _ in range(8):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        compute(resident)
        torch.cuda.synchronize()
        t.append(time.perf_counter() - t0)
    ratio = median(m["duration_s"]) / median(t)
    ctx.check_goal("step_vs_resident", ratio, ratio <= 1.10, "x", "<= 1.10x the step on resident batches",
                   f"profiled loader step {median(m['duration_s']) * 1e3:.1f} ms vs {median(t) * 1e3:.1f} ms")


# -- check: reference runs ---------------------------------------------------------------------
def check_refruns(ctx: Ctx) -> None:
    """A GPT-2-small slice and a data-starved slice, saved as reference runs."""
    facts = machine_facts()
    cuda = ctx.cuda
    cfg = GPTConfig() if cuda else GPTConfig.tiny()
    batch = 8 if cuda else 2
    suffix = gpu_slug() if cuda else "dry"
    steps, warmup = (15, 5) if cuda else (3, 1)
    run = gpt_slice(ctx, f"gpt2_small_{suffix}", cfg, batch, steps, warmup, "adamw",
                    dict(num_workers=4 if cuda else 0), {})
    _save_reference(ctx, run, "GPT-2-small slice", dict(model=asdict(cfg), batch=batch, optimizer="AdamW(fused)",
                                                        autocast="bf16", loader="DataLoader(4 workers, pinned)"), facts)
    if ctx.left() < 30 and cuda:
        ctx.add("saved_data_starved", "SKIP", note="time budget")
        return
    # data-starved: one loader worker spending 25 ms of CPU per sample (200 ms per batch of 8)
    cpu_ms = 25.0 if cuda else 5.0
    run = gpt_slice(ctx, f"data_starved_{suffix}", cfg, batch, 8 if cuda else 3, 2 if cuda else 1, "adamw",
                    dict(num_workers=1), dict(cpu_ms=cpu_ms))
    _save_reference(ctx, run, "data-starved slice", dict(model=asdict(cfg), batch=batch, optimizer="AdamW(fused)",
                                                         loader="DataLoader(1 worker)", cpu_ms_per_sample=cpu_ms), facts)


# -- the runner --------------------------------------------------------------------------------
@dataclass
class Check:
    fn: Callable[[Ctx], None]
    budget_s: float  # on the GPU; the CPU dry run is much shorter


CHECKS: dict[str, Check] = {
    "env": Check(check_env, 20),
    "timing": Check(check_timing, 40),
    "memory": Check(check_memory, 45),
    "clocks": Check(check_clocks, 45),
    "kernels": Check(check_kernels, 150),
    "offload": Check(check_offload, 60),
    "loader": Check(check_loader, 45),
    "refruns": Check(check_refruns, 60),
}


def run_inline(name: str, ctx: Ctx) -> None:
    """Run one check here; an exception becomes a FAIL row, the rest go on."""
    try:
        CHECKS[name].fn(ctx)
    except Exception as e:
        tb = traceback.format_exc(limit=-3).strip().splitlines()
        ctx.add("error", "FAIL", note=f"{type(e).__name__}: {e} | {' / '.join(tb[-3:])}"[:600])
        traceback.print_exc()


def run_isolated(name: str, ctx: Ctx, argv: list[str]) -> None:
    """Run one check in a child process under a hard timeout; its rows come back through a
    file it appends to as it goes, so a check killed half-way keeps what it measured."""
    rows_file = Path(tempfile.mkstemp(prefix=f"gpu_check_{name}_", suffix=".jsonl")[1])
    budget = max(1.0, ctx.left())
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--child", name, "--rows-file", str(rows_file),
           "--child-deadline", str(ctx.deadline)]
    t0 = time.time()
    try:
        done = subprocess.run(cmd, timeout=budget + 10, stderr=subprocess.PIPE, text=True)
        rc, err = done.returncode, done.stderr
    except subprocess.TimeoutExpired as e:
        rc, err = None, (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
    for line in rows_file.read_text().splitlines():
        ctx.rows.append(Row(**json.loads(line)))
    rows_file.unlink(missing_ok=True)
    if rc is None:
        ctx.add("timeout", "FAIL", round(time.time() - t0, 1), "s", note=f"killed after its {budget:.0f} s budget")
    elif rc != 0:
        sys.stderr.write(err[-4000:])
        ctx.add("crash", "FAIL", note=f"exit {rc}: {err.strip().splitlines()[-1] if err.strip() else 'no stderr'}"[:600])
    elif err.strip():
        sys.stderr.write(err[-2000:])


def write_results(out: Path, rows: list[Row], facts: dict[str, Any], dry: bool, wall_s: float) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    mode = "dry (CPU)" if dry else "GPU"
    date = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    csv_path, md_path = out / "results.csv", out / "results.md"
    fields = ["check", "item", "status", "value", "unit", "goal", "note", "gpu", "driver", "cpu", "versions", "mode", "date"]
    with csv_path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in rows:
            w.writerow({**asdict(r), "gpu": facts["gpu"], "driver": facts["driver"], "cpu": facts["cpu"],
                        "versions": facts["versions"], "mode": mode, "date": date})
    counts = {s: sum(1 for r in rows if r.status == s) for s in STATUSES}
    lines = [
        f"# gpu_check: {mode}", "",
        f"- GPU: {facts['gpu']}; driver {facts['driver']}; CUDA {facts['cuda']}",
        f"- CPU: {facts['cpu']}",
        f"- versions: {facts['versions']}",
        f"- date: {date}; wall time {wall_s:.0f} s; "
        + ", ".join(f"{k} {v}" for k, v in counts.items()),
        "", "| check | item | status | figure | goal | note |", "|---|---|---|---|---|---|",
    ]
    for r in rows:
        status = f"SKIP({r.note})" if r.status == "SKIP" else r.status
        figure = "" if r.value is None else f"{_fmt(r.value)} {r.unit}".strip()
        note = "" if r.status == "SKIP" else r.note.replace("|", "/")
        lines.append(f"| {r.check} | {r.item} | {status} | {figure} | {r.goal} | {note} |")
    md_path.write_text("\n".join(lines) + "\n")
    return csv_path, md_path


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry", action="store_true", help="CPU only: tiny shapes, interpreter kernels, CUDA checks skipped")
    ap.add_argument("--only", default="", help=f"comma-separated subset of {', '.join(CHECKS)}")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results/gpu_check; "
                    "--dry: a temporary folder)")
    ap.add_argument("--runs-dir", default=None, help="where reference runs go (default datasets/reference_runs; "
                    "--dry: <out>/reference_runs)")
    ap.add_argument("--deadline-s", type=float, default=470.0, help="global deadline for all checks")
    ap.add_argument("--isolate", choices=("process", "inline"), default=None,
                    help="each check in its own process (default on the GPU) or in this one (default --dry)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--rows-file", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-deadline", type=float, default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def setup_environment(dry: bool) -> None:
    """Before torch or triton is imported: the interpreter for --dry, compiled Triton otherwise."""
    if dry:
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the CPU half, even on a GPU machine
    else:
        os.environ.pop("TRITON_INTERPRET", None)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    os.environ.setdefault("TPKIT_RUNS", "off")  # the checks' slices are not kept in the run store


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_environment(args.dry)
    found = ensure_tpkit()
    missing = missing_packages()
    if missing and not args.child:
        print(f"gpu_check: this Python ({sys.executable}) lacks {', '.join(missing)}: "
              f"pip install {' '.join(missing)} (or carry their wheels); the checks that need them will FAIL",
              file=sys.stderr, flush=True)
    selected = [c.strip() for c in args.only.split(",") if c.strip()] or list(CHECKS)
    unknown = [c for c in selected if c not in CHECKS]
    if unknown:
        print(f"unknown checks {unknown}; choose from {list(CHECKS)}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else (Path(tempfile.mkdtemp(prefix="tpkit_gpu_check_dry_")) if args.dry else RESULTS)
    runs_dir = Path(args.runs_dir) if args.runs_dir else (out / "reference_runs" if args.dry else REFERENCE_RUNS)
    if args.child:  # one check, in a child process
        ctx = Ctx(args.child, args.dry, out, runs_dir, args.child_deadline or time.time() + CHECKS[args.child].budget_s,
                  rows_file=Path(args.rows_file) if args.rows_file else None)
        sys.path.insert(0, str(HERE))
        run_inline(args.child, ctx)
        return 0
    if not args.dry:
        import torch

        if not torch.cuda.is_available():  # nothing to measure: say what is missing, run nothing
            print(f"gpu_check: torch {torch.__version__} in {sys.executable} sees no CUDA device. Run it with a "
                  f"Python whose torch is a CUDA build (make gpu-check GPU_PY=python3 on a GPU image), or "
                  f"--dry for the CPU half.", file=sys.stderr)
            return 2
    isolate = args.isolate or ("inline" if args.dry else "process")
    start = time.time()
    deadline = start + args.deadline_s
    print(f"gpu_check: {'dry run on the CPU' if args.dry else 'GPU'}; checks {', '.join(selected)}; "
          f"deadline {args.deadline_s:.0f} s; results -> {out}; tpkit {found}", flush=True)
    sys.path.insert(0, str(HERE))
    rows: list[Row] = []
    passthrough = ["--dry"] if args.dry else []
    passthrough += ["--out", str(out), "--runs-dir", str(runs_dir)]
    total_budget = sum(CHECKS[c].budget_s for c in selected)
    scale = min(1.0, args.deadline_s / total_budget) if total_budget else 1.0
    for name in selected:
        now = time.time()
        # its own budget (all scaled down when they add up to more than the deadline), and
        # never past the global deadline
        budget = min(CHECKS[name].budget_s * scale, deadline - now)
        ctx = Ctx(name, args.dry, out, runs_dir, now + budget)
        print(f"\n== {name} (budget {budget:.0f} s)", flush=True)
        if budget < 5:
            ctx.add("all", "SKIP", note="global deadline reached")
        elif isolate == "process":
            run_isolated(name, ctx, passthrough)
        else:
            run_inline(name, ctx)
        print(f"== {name}: {time.time() - now:.1f} s", flush=True)
        rows += ctx.rows
    import torch  # noqa: F401  (facts need it; imported late so the environment is set first)

    facts = machine_facts()
    csv_path, md_path = write_results(out, rows, facts, args.dry, time.time() - start)
    fails = [r for r in rows if r.status == "FAIL"]
    print(f"\n{len(rows)} rows: " + ", ".join(f"{s} {sum(1 for r in rows if r.status == s)}" for s in STATUSES)
          + f"; {time.time() - start:.0f} s\n-> {csv_path}\n-> {md_path}", flush=True)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
