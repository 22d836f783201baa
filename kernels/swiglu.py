"""SwiGLU activation: silu(gate) * up, elementwise, as in ``tpkit.models.SwiGLU``.

Three layers: the Triton kernels, ``swiglu_forward`` / ``swiglu_backward``, and
``SwiGLUFunction``. Eager autograd keeps gate, up and silu(gate) for backward; this keeps
gate and up and recomputes the sigmoid, so one [tokens x hidden] activation less per MLP.
"""

from __future__ import annotations

import torch

from .backend import cdiv, eager_only, lazy_jit, tl, use_kernel
from .errors import KernelTensorError, check_floating, check_same_device, check_tensor
from .reference import swiglu_reference

BLOCK_GPU = 1024
BLOCK_CPU = 4096  # the interpreter's cost is per program: fewer, larger blocks


@lazy_jit
def _swiglu_fwd_kernel(G, U, Y, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] over the flat tensors
    mask = offs < n
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    # round silu to the input dtype first: eager computes F.silu(gate) in that dtype
    silu = (g * tl.sigmoid(g)).to(G.dtype.element_ty).to(tl.float32)
    tl.store(Y + offs, (silu * u).to(Y.dtype.element_ty), mask=mask)


@lazy_jit
def _swiglu_bwd_kernel(DY, G, U, DG, DU, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    # d silu(g) / dg = sig * (1 + g * (1 - sig))
    dg = dy * u * sig * (1.0 + g * (1.0 - sig))
    du = dy * silu
    tl.store(DG + offs, dg.to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + offs, du.to(DU.dtype.element_ty), mask=mask)


def _block(device: torch.device) -> int:
    return BLOCK_GPU if device.type == "cuda" else BLOCK_CPU


def swiglu_forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up: [..., H] (same shape) -> silu(gate) * up, [..., H]."""
    g, u = gate.contiguous(), up.contiguous()
    y = torch.empty(g.shape, dtype=torch.promote_types(g.dtype, u.dtype), device=g.device)
    n = g.numel()
    block = _block(g.device)
    _swiglu_fwd_kernel[(cdiv(n, block),)](g, u, y, n, BLOCK=block, num_warps=4)
    return y


def swiglu_backward(
    dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """dy, gate, up: [..., H] -> (dgate, dup), each in its input's dtype."""
    dy, g, u = dy.contiguous(), gate.contiguous(), up.contiguous()
    dg, du = torch.empty_like(g), torch.empty_like(u)
    n = g.numel()
    block = _block(g.device)
    _swiglu_bwd_kernel[(cdiv(n, block),)](dy, g, u, dg, du, n, BLOCK=block, num_warps=4)
    return dg, du


class SwiGLUFunction(torch.autograd.Function):
    """Autograd for swiglu: saves gate and up, recomputes the sigmoid."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(gate, up)
        return swiglu_forward(gate, up)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
        gate, up = ctx.saved_tensors
        return swiglu_backward(dy, gate, up)


_apply = eager_only(SwiGLUFunction.apply)


def check_inputs(gate: torch.Tensor, up: torch.Tensor) -> None:
    """Floating point, one device, shapes that broadcast (as ``F.silu(gate) * up`` wants;
    RuntimeError kind)."""
    check_tensor("swiglu", "gate", gate)
    check_tensor("swiglu", "up", up)
    check_floating("swiglu", (("gate", gate), ("up", up)))
    check_same_device("swiglu", (("gate", gate), ("up", up)))
    if gate.shape != up.shape:
        try:
            torch.broadcast_shapes(gate.shape, up.shape)
        except RuntimeError:
            raise KernelTensorError(f"swiglu: the shapes of gate {list(gate.shape)} and up "
                                    f"{list(up.shape)} do not broadcast") from None


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up with autograd; the Triton kernel when a backend can run it (gate and
    up of one shape; shapes that only broadcast take the torch reference)."""
    check_inputs(gate, up)
    if gate.shape == up.shape and gate.numel() and use_kernel(gate, up):  # empty: nothing to launch
        return _apply(gate, up)
    return swiglu_reference(gate, up)
