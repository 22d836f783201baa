"""Rotary position embedding on q and k, in ``tpkit.models.apply_rope``'s layout.

x: [B, H, T, D]; the pair (x[..., i], x[..., i + D/2]) is rotated by angle(t, i), given as
cos, sin: [T_max >= T, D/2]. Eager builds x1*c, x2*s, x1*s, x2*c and a cat (five
[B, H, T, D/2]-sized temporaries per tensor, kept for backward); the kernel writes the result
in one pass and backward is the same kernel rotating by the opposite angle, so nothing but
cos and sin is saved.
"""

from __future__ import annotations

import torch

from .backend import cdiv, eager_only, lazy_jit, next_power_of_2, tl, use_kernel
from .reference import rope_reference


@lazy_jit
def _rope_kernel(
    X, COS, SIN, Y,  # X, Y: [n_rows, 2 * half] with row = (b, h, t); COS, SIN: [T_max, half]
    n_rows, seq_len, half, cos_stride, sign,  # sign: +1 forward, -1 backward (inverse rotation)
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    cols = tl.arange(0, BLOCK_D)  # [BD] over one half
    mask = (rows < n_rows)[:, None] & (cols < half)[None, :]  # [BM, BD]
    pos = rows % seq_len  # [BM] the token index t of each row
    cs_offs = pos[:, None] * cos_stride + cols[None, :]
    # cast the tables to x's dtype first, as apply_rope does
    c = tl.load(COS + cs_offs, mask=mask, other=0.0).to(X.dtype.element_ty).to(tl.float32)
    s = tl.load(SIN + cs_offs, mask=mask, other=0.0).to(X.dtype.element_ty).to(tl.float32) * sign
    offs = rows[:, None].to(tl.int64) * (2 * half) + cols[None, :]
    x1 = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X + offs + half, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + offs, (x1 * c - x2 * s).to(Y.dtype.element_ty), mask=mask)
    tl.store(Y + offs + half, (x1 * s + x2 * c).to(Y.dtype.element_ty), mask=mask)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    """x: [B, H, T, D] (any strides) -> rotated copy, contiguous [B, H, T, D]."""
    if x.dim() != 4 or x.shape[-1] % 2:
        raise ValueError(f"rope expects [B, H, T, D] with even D, got {tuple(x.shape)}")
    seq_len, d = x.shape[-2], x.shape[-1]
    half = d // 2
    if cos.shape[0] < seq_len or cos.shape[-1] != half or sin.shape != cos.shape:
        raise ValueError(f"cos/sin must be [>= {seq_len}, {half}], got {tuple(cos.shape)}, {tuple(sin.shape)}")
    x2 = x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    y = torch.empty_like(x2)
    n_rows = x2.numel() // d
    block_d = next_power_of_2(half)
    if x.device.type == "cuda":
        block_m = max(1, min(64, 4096 // block_d))
    else:  # the interpreter's cost is per program: as many rows as fit a 16k-element tile
        block_m = max(1, 16384 // block_d)
    _rope_kernel[(cdiv(n_rows, block_m),)](
        x2, cos, sin, y, n_rows, seq_len, half, cos.stride(0), sign,
        BLOCK_M=block_m, BLOCK_D=block_d,
    )
    return y


def rope_forward(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [B, Hq, T, D], k: [B, Hk, T, D] -> rotated (q, k)."""
    return _rotate(q, cos, sin, 1.0), _rotate(k, cos, sin, 1.0)


def rope_backward(
    dq: torch.Tensor, dk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotation is orthogonal: its gradient is the rotation by the opposite angle."""
    return _rotate(dq, cos, sin, -1.0), _rotate(dk, cos, sin, -1.0)


class RoPEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):  # type: ignore[override]
        ctx.save_for_backward(cos, sin)
        return rope_forward(q, k, cos, sin)

    @staticmethod
    def backward(ctx, dq: torch.Tensor, dk: torch.Tensor):  # type: ignore[override]
        cos, sin = ctx.saved_tensors
        dq, dk = rope_backward(dq, dk, cos, sin)
        return dq, dk, None, None


_apply = eager_only(RoPEFunction.apply)


def rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k ([B, H, T, D]) by cos, sin ([T_max, D/2]); gradients flow to q and k."""
    if q.numel() and k.numel() and use_kernel(q, k):  # empty input: nothing to launch
        return _apply(q, k, cos, sin)
    return rope_reference(q, k, cos, sin)
