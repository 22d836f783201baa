"""Host AdamW kernels for the offloading optimizer, and how one is chosen.

A host AdamW step is memory-bound: it reads param, grad, exp_avg, exp_avg_sq and writes
param, exp_avg, exp_avg_sq, 28 bytes per fp32 parameter. On these machines torch's fused CPU
AdamW already moves them at about the in-place streaming bandwidth, and DeepSpeed's cpu_adam
(AVX, OpenMP) is in the same place (benchmarks/results/offload_quiet_run.txt: 93-101% of the
roofline for both). So the choice between them is made by
timing both once per process on the machine at hand, never assumed.

Two kernels, one call shape: ``step(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2,
eps, weight_decay)`` updates one flat host tensor in place; ``step`` is the 1-based step count
after this update.

- ``TorchFusedKernel``: ``torch._fused_adamw_`` (what ``AdamW(fused=True)`` calls). bf16
  moments are supported by upcasting cache-sized chunks, so the bytes that cross the memory
  bus are 20 per parameter instead of 28.
- ``DeepSpeedKernel``: DeepSpeed's ``cpu_adam`` op, JIT-built once (about a minute) into
  ``TORCH_EXTENSIONS_DIR`` (torch's default ``~/.cache/torch_extensions`` when unset); later
  processes load the cached build in seconds. Any failure to import or build falls back to the
  torch kernel with one warning that says why; the failure path never raises.
"""

from __future__ import annotations

import itertools
import os
import statistics
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch

from .errors import OffloadArgumentError

KernelName = Literal["auto", "deepspeed", "torch"]

#: Elements per chunk when bf16 moments are upcast for the fused kernel (fits in L2).
BF16_CHUNK = 1 << 18

_DS_LOCK = threading.Lock()
_DS_OP: Any = None
_DS_ERROR: str | None = None
_AUTO_CHOICE: tuple[str, str] | None = None  # (name, reason), measured once per process
_DS_IDS = itertools.count(1_000_000)  # far from DeepSpeedCPUAdam's own ids (0, 1, 2, ...)


class HostKernel(Protocol):
    """A host AdamW update of one flat fp32 tensor in place (the call shape in the module doc)."""

    name: str

    def step(self, param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
             exp_avg_sq: torch.Tensor, step: int, lr: float, beta1: float, beta2: float,
             eps: float, weight_decay: float) -> None: ...


class TorchFusedKernel:
    """torch's fused CPU AdamW (decoupled weight decay), one tensor at a time."""

    name = "torch"

    def __init__(self) -> None:
        self._scratch: tuple[torch.Tensor, torch.Tensor] | None = None  # bf16 moments only

    def step(self, param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
             exp_avg_sq: torch.Tensor, step: int, lr: float, beta1: float, beta2: float,
             eps: float, weight_decay: float) -> None:
        step_t = torch.tensor(float(step))
        kw: dict[str, Any] = dict(lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
                                  amsgrad=False, maximize=False)
        no_max: list[torch.Tensor] = []  # max_exp_avg_sqs: amsgrad only
        if exp_avg.dtype == param.dtype:
            torch._fused_adamw_([param], [grad], [exp_avg], [exp_avg_sq], no_max, [step_t], **kw)
            return
        # low-precision moments: upcast a chunk into reused scratch buffers (a fresh 1 MB
        # tensor per chunk would be an mmap + page faults + munmap each time), update, round back
        p, g, m, v = param.view(-1), grad.view(-1), exp_avg.view(-1), exp_avg_sq.view(-1)
        if self._scratch is None or self._scratch[0].dtype != param.dtype:
            self._scratch = (torch.empty(BF16_CHUNK, dtype=param.dtype), torch.empty(BF16_CHUNK, dtype=param.dtype))
        m_buf, v_buf = self._scratch
        for lo in range(0, p.numel(), BF16_CHUNK):
            hi = min(lo + BF16_CHUNK, p.numel())
            m32, v32 = m_buf[: hi - lo], v_buf[: hi - lo]
            m32.copy_(m[lo:hi])
            v32.copy_(v[lo:hi])
            torch._fused_adamw_([p[lo:hi]], [g[lo:hi]], [m32], [v32], no_max, [step_t], **kw)
            m[lo:hi].copy_(m32)
            v[lo:hi].copy_(v32)


class DeepSpeedKernel:
    """DeepSpeed's cpu_adam op in AdamW mode. Holds one C++ optimizer id, freed on close."""

    name = "deepspeed"

    def __init__(self, op: Any) -> None:
        self.op = op
        self.opt_id = next(_DS_IDS)
        # lr/betas/eps/wd given here are defaults; every adam_update call passes its own
        op.create_adam(self.opt_id, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, False)

    def step(self, param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
             exp_avg_sq: torch.Tensor, step: int, lr: float, beta1: float, beta2: float,
             eps: float, weight_decay: float) -> None:
        self.op.adam_update(self.opt_id, int(step), lr, beta1, beta2, eps, weight_decay, True,
                            param, grad, exp_avg, exp_avg_sq)

    def close(self) -> None:
        op, self.op = self.op, None
        if op is not None:
            op.destroy_adam(self.opt_id)


def extensions_dir() -> str:
    """Where torch (and so DeepSpeed) caches JIT-built ops."""
    return os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "torch_extensions")


def load_deepspeed_op() -> tuple[Any, str | None]:
    """DeepSpeed's cpu_adam module, building it on first use; ``(None, why)`` on any failure.

    The outcome is cached for the process: a failed build is not retried on every optimizer.
    """
    global _DS_OP, _DS_ERROR
    with _DS_LOCK:
        if _DS_OP is not None or _DS_ERROR is not None:
            return _DS_OP, _DS_ERROR
        try:
            _DS_OP = _build_deepspeed_op()
        except ImportError as e:
            _DS_ERROR = (f"deepspeed is not installed ({e}); pip install 'tpkit[deepspeed]' "
                         "for its CPU Adam")
        except Exception as e:  # a compiler error, ninja missing, a bad cache: all mean "no op"
            _DS_ERROR = (f"DeepSpeed's cpu_adam op failed to build or load ({type(e).__name__}: "
                         f"{str(e)[:300]}); build cache {extensions_dir()}")
        return _DS_OP, _DS_ERROR


def _build_deepspeed_op() -> Any:
    """Import and JIT-build the op (kept apart so tests can make it fail)."""
    from deepspeed.ops.op_builder import CPUAdamBuilder  # heavy: imported only here

    return CPUAdamBuilder().load(verbose=False)


def _reset_cache_for_tests() -> None:
    global _DS_OP, _DS_ERROR, _AUTO_CHOICE
    _DS_OP, _DS_ERROR, _AUTO_CHOICE = None, None, None


def time_kernel(kernel: HostKernel, numel: int, repeats: int = 5) -> float:
    """Median seconds of one host step of ``kernel`` on ``numel`` fp32 parameters."""
    p, g = torch.randn(numel), torch.randn(numel)
    m, v = torch.zeros(numel), torch.zeros(numel)
    times = []
    for i in range(repeats + 1):  # the first call pays page faults
        t = time.perf_counter()
        kernel.step(p, g, m, v, i + 1, 1e-3, 0.9, 0.999, 1e-8, 0.01)
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


@dataclass
class KernelChoice:
    """The kernel ``select_kernel`` chose and why (measured, requested, or a fallback)."""

    kernel: HostKernel
    reason: str


def select_kernel(requested: KernelName = "auto", moments_dtype: torch.dtype = torch.float32,
                  probe_numel: int = 1 << 22) -> KernelChoice:
    """The host kernel to use, and why.

    ``"torch"`` is always available. ``"deepspeed"`` falls back to torch with a warning when the
    op cannot be had. ``"auto"`` times both on ``probe_numel`` parameters once per process and
    keeps the faster; low-precision moments always use torch (DeepSpeed's op wants moments in
    the parameters' dtype).
    """
    global _AUTO_CHOICE
    if requested not in ("auto", "deepspeed", "torch"):
        raise OffloadArgumentError(f"kernel must be 'auto', 'deepspeed' or 'torch', got {requested!r}")
    if requested == "torch":
        return KernelChoice(TorchFusedKernel(), "requested")
    if moments_dtype != torch.float32:
        if requested == "deepspeed":
            warnings.warn("DeepSpeed's cpu_adam needs fp32 moments here; using torch's fused "
                          "AdamW for low-precision moments", stacklevel=3)
        return KernelChoice(TorchFusedKernel(), f"{moments_dtype} moments need the torch kernel")
    op, why = load_deepspeed_op()
    if op is None:
        warnings.warn(f"{why}. Falling back to torch's fused CPU AdamW.", stacklevel=3)
        return KernelChoice(TorchFusedKernel(), f"fallback: {why}")
    if requested == "deepspeed":
        return KernelChoice(DeepSpeedKernel(op), "requested")
    if _AUTO_CHOICE is None:
        ds = DeepSpeedKernel(op)
        try:
            t_ds = time_kernel(ds, probe_numel)
        finally:
            ds.close()
        t_torch = time_kernel(TorchFusedKernel(), probe_numel)
        name = "deepspeed" if t_ds < t_torch else "torch"
        _AUTO_CHOICE = (name, f"measured on {probe_numel:,} params: deepspeed {t_ds * 1e3:.2f} ms, "
                              f"torch fused {t_torch * 1e3:.2f} ms")
    name, reason = _AUTO_CHOICE
    return KernelChoice(DeepSpeedKernel(op) if name == "deepspeed" else TorchFusedKernel(), reason)
