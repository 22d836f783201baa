"""RMSNorm: y = (x * rsqrt(mean(x^2) + eps)).to(x.dtype) * weight, over the last dimension.

Three layers: the Triton kernels, the host functions ``rms_norm_forward`` /
``rms_norm_backward``, and ``RMSNormFunction`` (autograd). ``rms_norm`` picks the kernel or
the torch reference through ``backend.select_backend``.

Why it saves memory: eager autograd keeps x.float(), the fp32 normalised x and its rounded
copy for backward; here backward keeps only x and one fp32 ``rstd`` per row and recomputes
the rest. Dtype rules match ``tpkit.models.RMSNorm``: the normalised x is rounded to x's dtype
before the weight multiply and the output has ``promote(x.dtype, weight.dtype)``.
"""

from __future__ import annotations

import torch

from .backend import cdiv, eager_only, lazy_jit, next_power_of_2, num_programs_cap, tl, use_kernel
from .reference import rms_norm_reference


@lazy_jit
def _rms_norm_fwd_kernel(
    X, W, Y, RSTD,  # X, Y: [n_rows, n_cols]; W: [n_cols]; RSTD: [n_rows] fp32
    n_rows, n_cols, eps,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    cols = tl.arange(0, BLOCK_C)  # [BC]
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]  # [BM, BC]
    offs = rows[:, None].to(tl.int64) * n_cols + cols[None, :]
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)  # [BM, BC]
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)  # [BM]
    xn = (x * rstd[:, None]).to(X.dtype.element_ty).to(tl.float32)  # rounded like .type_as(x)
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)  # [BC]
    tl.store(Y + offs, (xn * w[None, :]).to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=row_mask)


@lazy_jit
def _rms_norm_bwd_kernel(
    DY, X, W, RSTD, DX, DW_PARTIAL,  # DW_PARTIAL: [n_programs, n_cols] fp32
    n_rows, n_cols, rows_per_program,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Each program walks ``rows_per_program`` rows (a multiple of BLOCK_M) and writes one
    partial row of dweight; the host sums the partials (no atomics: deterministic)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_C)
    col_mask = cols < n_cols
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)  # [BC]
    dw = tl.zeros((BLOCK_C,), dtype=tl.float32)
    first = pid * rows_per_program
    for start in range(0, rows_per_program, BLOCK_M):
        rows = first + start + tl.arange(0, BLOCK_M)  # [BM]
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        offs = rows[:, None].to(tl.int64) * n_cols + cols[None, :]
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)  # [BM, BC]
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)  # [BM]
        xn = x * rstd[:, None]
        dw += tl.sum(dy * xn.to(X.dtype.element_ty).to(tl.float32), axis=0)
        dxn = dy * w[None, :]
        # d/dx of x * rsqrt(mean(x^2) + eps): rstd * (dxn - xn * mean(dxn * xn))
        dot = tl.sum(dxn * xn, axis=1) / n_cols  # [BM]
        dx = rstd[:, None] * (dxn - xn * dot[:, None])
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
    tl.store(DW_PARTIAL + pid * n_cols + cols, dw, mask=col_mask)


def _blocks(n_cols: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_M rows, BLOCK_C columns, num_warps) for one tile: the whole row in one block."""
    block_c = next_power_of_2(n_cols)
    if block_c > 65536:
        raise ValueError(f"rms_norm kernel supports up to 65536 columns, got {n_cols}")
    if device.type == "cuda":
        block_m = max(1, min(64, 4096 // block_c))  # a 4k-element tile per program
    else:  # the interpreter's cost is per program: as many rows as fit a 16k-element tile
        block_m = max(1, 16384 // block_c)
    num_warps = 8 if block_c * block_m >= 4096 else 4
    return block_m, block_c, num_warps


def rms_norm_forward(
    x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., C], weight: [C] -> (y [..., C], rstd [N] fp32) where N = x.numel() // C."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).contiguous()  # [N, C]
    n_rows, n_cols = x2.shape
    y = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    block_m, block_c, num_warps = _blocks(n_cols, x.device)
    grid = (cdiv(n_rows, block_m),)
    _rms_norm_fwd_kernel[grid](
        x2, weight.contiguous(), y, rstd, n_rows, n_cols, eps,
        BLOCK_M=block_m, BLOCK_C=block_c, num_warps=num_warps,
    )
    return y.view(shape), rstd


def rms_norm_backward(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """dy, x: [..., C]; rstd: [N] -> (dx [..., C] in x.dtype, dweight [C] in weight.dtype)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).contiguous()  # [N, C]
    dy2 = dy.reshape(-1, shape[-1]).contiguous()  # [N, C]
    n_rows, n_cols = x2.shape
    dx = torch.empty_like(x2)
    block_m, block_c, num_warps = _blocks(n_cols, x.device)
    n_blocks = cdiv(n_rows, block_m)
    n_programs = max(1, min(n_blocks, num_programs_cap(x.device)))
    rows_per_program = cdiv(n_blocks, n_programs) * block_m  # whole blocks per program
    n_programs = cdiv(n_rows, rows_per_program)
    dw_partial = torch.empty((n_programs, n_cols), dtype=torch.float32, device=x.device)
    _rms_norm_bwd_kernel[(n_programs,)](
        dy2, x2, weight.contiguous(), rstd, dx, dw_partial, n_rows, n_cols, rows_per_program,
        BLOCK_M=block_m, BLOCK_C=block_c, num_warps=num_warps,
    )
    return dx.view(shape), dw_partial.sum(0).to(weight.dtype)


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # type: ignore[override]
        y, rstd = rms_norm_forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
        x, weight, rstd = ctx.saved_tensors
        dx, dw = rms_norm_backward(dy, x, weight, rstd)
        return dx, dw, None


_apply = eager_only(RMSNormFunction.apply)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm of x [..., C] with weight [C]; the Triton kernel when a backend can run it."""
    if x.numel() and use_kernel(x, weight):  # empty input: nothing to launch
        return _apply(x, weight, eps)
    return rms_norm_reference(x, weight, eps)
