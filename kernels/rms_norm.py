"""RMSNorm: y = (x * rsqrt(mean(x^2) + eps)).to(x.dtype) * weight, over the last dimension.

Three layers: the Triton kernels, the host functions ``rms_norm_forward`` /
``rms_norm_backward``, and ``RMSNormFunction`` (autograd). ``rms_norm`` checks its inputs and
picks the kernel or the torch reference through ``backend.select_backend``.

Why it saves memory: eager autograd keeps x.float(), the fp32 normalised x and its rounded
copy for backward; here backward keeps only x and one fp32 ``rstd`` per row and recomputes
the rest. Dtype rules match ``tpkit.models.RMSNorm``: the normalised x is rounded to x's dtype
before the weight multiply and the output has ``promote(x.dtype, weight.dtype)``.

Wide rows: a program holds at most ``MAX_BLOCK_C_GPU`` columns of a row at once. A wider row
is walked in column chunks of that size (``CHUNKED``): forward reads it twice (sum of squares,
then normalise), backward twice (the row's dot product, then dx and dweight). Holding the
whole row instead made backward spill registers to the stack from 16384 columns on sm_90
(issue 17, 15).
"""

from __future__ import annotations

import torch

from .backend import cdiv, eager_only, lazy_jit, next_power_of_2, num_programs_cap, num_warps_for, tl, use_kernel
from .errors import KernelArgumentError, KernelTensorError, check_floating, check_same_device, check_tensor
from .reference import rms_norm_reference

#: Columns of a row one GPU program holds at once (a power of two); wider rows are chunked.
MAX_BLOCK_C_GPU = 4096
#: The interpreter's cost is per program and per loop turn, not per register: whole rows
#: up to this width, and tiles of about ``CPU_TILE`` elements.
MAX_BLOCK_C_CPU = 16384
CPU_TILE = 16384


@lazy_jit
def _rms_norm_fwd_kernel(
    X, W, Y, RSTD,  # X, Y: [n_rows, n_cols]; W: [n_cols]; RSTD: [n_rows] fp32
    n_rows, n_cols, eps,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, CHUNKED: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    row_mask = rows < n_rows
    row_offs = rows[:, None].to(tl.int64) * n_cols  # [BM, 1]
    if not CHUNKED:  # the whole row in one block
        cols = tl.arange(0, BLOCK_C)  # [BC]
        col_mask = cols < n_cols
        mask = row_mask[:, None] & col_mask[None, :]  # [BM, BC]
        x = tl.load(X + row_offs + cols[None, :], mask=mask, other=0.0).to(tl.float32)  # [BM, BC]
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)  # [BM]
        xn = (x * rstd[:, None]).to(X.dtype.element_ty).to(tl.float32)  # rounded like .type_as(x)
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)  # [BC]
        tl.store(Y + row_offs + cols[None, :], (xn * w[None, :]).to(Y.dtype.element_ty), mask=mask)
    else:  # pass 1: sum of squares over column chunks; pass 2: normalise chunk by chunk
        acc = tl.zeros([BLOCK_M], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK_C):
            cols = start + tl.arange(0, BLOCK_C)
            mask = row_mask[:, None] & (cols < n_cols)[None, :]
            x = tl.load(X + row_offs + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            acc += tl.sum(x * x, axis=1)
        rstd = tl.rsqrt(acc / n_cols + eps)  # [BM]
        for start in range(0, n_cols, BLOCK_C):
            cols = start + tl.arange(0, BLOCK_C)
            col_mask = cols < n_cols
            mask = row_mask[:, None] & col_mask[None, :]
            x = tl.load(X + row_offs + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            xn = (x * rstd[:, None]).to(X.dtype.element_ty).to(tl.float32)
            w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
            tl.store(Y + row_offs + cols[None, :], (xn * w[None, :]).to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=row_mask)


@lazy_jit
def _rms_norm_bwd_kernel(
    DY, X, W, RSTD, DX, DW_PARTIAL,  # DW_PARTIAL: [n_programs, n_cols] fp32 (zeros if CHUNKED)
    n_rows, n_cols, rows_per_program,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, CHUNKED: tl.constexpr,
):
    """Each program walks ``rows_per_program`` rows (a multiple of BLOCK_M) and writes one
    partial row of dweight; the host sums the partials (no atomics: deterministic).

    d/dx of x * rsqrt(mean(x^2) + eps) is rstd * (dxn - xn * mean(dxn * xn)), dxn = dy * w."""
    pid = tl.program_id(0)
    first = pid * rows_per_program
    dw_row = DW_PARTIAL + pid.to(tl.int64) * n_cols
    if not CHUNKED:  # the whole row in registers; dweight accumulates there too
        cols = tl.arange(0, BLOCK_C)
        col_mask = cols < n_cols
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)  # [BC]
        dw = tl.zeros((BLOCK_C,), dtype=tl.float32)
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
            dot = tl.sum(dxn * xn, axis=1) / n_cols  # [BM]
            dx = rstd[:, None] * (dxn - xn * dot[:, None])
            tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
        tl.store(dw_row + cols, dw, mask=col_mask)
    else:  # per row block: pass 1 the dot product, pass 2 dx and this program's dweight row
        for start in range(0, rows_per_program, BLOCK_M):
            rows = first + start + tl.arange(0, BLOCK_M)  # [BM]
            row_mask = rows < n_rows
            row_offs = rows[:, None].to(tl.int64) * n_cols  # [BM, 1]
            rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)  # [BM]
            dot = tl.zeros([BLOCK_M], dtype=tl.float32)
            for c0 in range(0, n_cols, BLOCK_C):
                cols = c0 + tl.arange(0, BLOCK_C)
                col_mask = cols < n_cols
                mask = row_mask[:, None] & col_mask[None, :]
                x = tl.load(X + row_offs + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(DY + row_offs + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
                dot += tl.sum(dy * w[None, :] * (x * rstd[:, None]), axis=1)
            dot = dot / n_cols
            for c0 in range(0, n_cols, BLOCK_C):
                cols = c0 + tl.arange(0, BLOCK_C)
                col_mask = cols < n_cols
                mask = row_mask[:, None] & col_mask[None, :]
                x = tl.load(X + row_offs + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(DY + row_offs + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
                xn = x * rstd[:, None]
                dx = rstd[:, None] * (dy * w[None, :] - xn * dot[:, None])
                tl.store(DX + row_offs + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
                # this program's own dweight row: read, add, write (no other program touches it)
                dw = tl.load(dw_row + cols, mask=col_mask, other=0.0)
                dw += tl.sum(dy * xn.to(X.dtype.element_ty).to(tl.float32), axis=0)
                tl.store(dw_row + cols, dw, mask=col_mask)


def _blocks(
    n_rows: int, n_cols: int, device: torch.device, max_block_c: int | None = None, block_m: int | None = None
) -> tuple[int, int, int, bool]:
    """(BLOCK_M rows, BLOCK_C columns, num_warps, chunked) for one program's tile.

    ``max_block_c`` (a power of two) caps the columns held at once; ``block_m`` forces the
    rows per tile. Both exist so tests can make the chunked path run under the interpreter
    on tiny rows."""
    gpu = device.type == "cuda"
    cap = max_block_c or (MAX_BLOCK_C_GPU if gpu else MAX_BLOCK_C_CPU)
    if cap < 1 or cap & (cap - 1):
        raise KernelArgumentError(f"max_block_c must be a power of two, got {cap}")
    block_c = min(next_power_of_2(n_cols), cap)
    chunked = block_c < n_cols
    if block_m is None:
        if gpu:  # a 4k-element tile per program; one row at a time once rows are chunked
            block_m = 1 if chunked else max(1, min(64, MAX_BLOCK_C_GPU // block_c))
        else:  # the interpreter: as many rows as fit its tile, no more than there are
            block_m = max(1, min(next_power_of_2(n_rows), CPU_TILE // block_c))
    return block_m, block_c, num_warps_for(block_m * block_c), chunked


def rms_norm_forward(
    x: torch.Tensor, weight: torch.Tensor, eps: float, max_block_c: int | None = None, block_m: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., C], weight: [C] -> (y [..., C], rstd [N] fp32) where N = x.numel() // C."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).contiguous()  # [N, C]
    n_rows, n_cols = x2.shape
    y = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    bm, bc, num_warps, chunked = _blocks(n_rows, n_cols, x.device, max_block_c, block_m)
    _rms_norm_fwd_kernel[(cdiv(n_rows, bm),)](
        x2, weight.contiguous(), y, rstd, n_rows, n_cols, eps,
        BLOCK_M=bm, BLOCK_C=bc, CHUNKED=chunked, num_warps=num_warps,
    )
    return y.view(shape), rstd


def rms_norm_backward(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
    max_block_c: int | None = None, block_m: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """dy, x: [..., C]; rstd: [N] -> (dx [..., C] in x.dtype, dweight [C] in weight.dtype)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).contiguous()  # [N, C]
    dy2 = dy.reshape(-1, shape[-1]).contiguous()  # [N, C]
    n_rows, n_cols = x2.shape
    dx = torch.empty_like(x2)
    bm, bc, num_warps, chunked = _blocks(n_rows, n_cols, x.device, max_block_c, block_m)
    n_blocks = cdiv(n_rows, bm)
    n_programs = max(1, min(n_blocks, num_programs_cap(x.device)))
    rows_per_program = cdiv(n_blocks, n_programs) * bm  # whole blocks per program
    n_programs = cdiv(n_rows, rows_per_program)
    # chunked programs add into their dweight row chunk by chunk: it must start at zero
    alloc = torch.zeros if chunked else torch.empty
    dw_partial = alloc((n_programs, n_cols), dtype=torch.float32, device=x.device)
    _rms_norm_bwd_kernel[(n_programs,)](
        dy2, x2, weight.contiguous(), rstd, dx, dw_partial, n_rows, n_cols, rows_per_program,
        BLOCK_M=bm, BLOCK_C=bc, CHUNKED=chunked, num_warps=num_warps,
    )
    return dx.view(shape), dw_partial.sum(0).to(weight.dtype)


class RMSNormFunction(torch.autograd.Function):
    """Autograd for rms_norm: saves x, weight and one fp32 rstd per row."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float,  # type: ignore[override]
                max_block_c: int | None = None, block_m: int | None = None) -> torch.Tensor:
        y, rstd = rms_norm_forward(x, weight, eps, max_block_c, block_m)
        ctx.save_for_backward(x, weight, rstd)
        ctx.blocks = (max_block_c, block_m)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
        x, weight, rstd = ctx.saved_tensors
        dx, dw = rms_norm_backward(dy, x, weight, rstd, *ctx.blocks)
        return dx, dw, None, None, None


_apply = eager_only(RMSNormFunction.apply)


def check_inputs(x: torch.Tensor, weight: torch.Tensor) -> None:
    """Shapes, dtypes and devices as torch's ``F.rms_norm`` wants them (RuntimeError kind):
    a weight of the wrong size must raise, never be read past its end."""
    check_tensor("rms_norm", "x", x)
    check_tensor("rms_norm", "weight", weight)
    if x.dim() < 1 or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise KernelTensorError(
            f"rms_norm: expected weight of shape [{x.shape[-1] if x.dim() else '?'}] for x of shape "
            f"{list(x.shape)} (the last dimension is normalised), but got weight of shape {list(weight.shape)}")
    check_floating("rms_norm", (("x", x), ("weight", weight)))
    check_same_device("rms_norm", (("x", x), ("weight", weight)))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *,
             max_block_c: int | None = None, block_m: int | None = None) -> torch.Tensor:
    """RMSNorm of x [..., C] with weight [C]; the Triton kernel when a backend can run it.

    ``max_block_c`` / ``block_m``: tile overrides for tests and tuning (see ``_blocks``)."""
    check_inputs(x, weight)
    if x.numel() and use_kernel(x, weight):  # empty input: nothing to launch
        return _apply(x, weight, float(eps), max_block_c, block_m)
    return rms_norm_reference(x, weight, eps)
