"""Rotary position embedding on q and k, in ``tpkit.models.apply_rope``'s layout.

x: [B, H, T, D]; the pair (x[..., i], x[..., i + D/2]) is rotated by angle(t, i), given as
cos, sin: [T_max >= T, D/2]. Eager builds x1*c, x2*s, x1*s, x2*c and a cat (five
[B, H, T, D/2]-sized temporaries per tensor, kept for backward); the kernel writes the result
in one pass and backward is the same kernel rotating by the opposite angle, so nothing but
cos and sin is saved.
"""

from __future__ import annotations

import torch

from .backend import cdiv, eager_only, lazy_jit, next_power_of_2, num_warps_for, tl, use_kernel
from .errors import KernelTensorError, check_floating, check_same_device, check_tensor
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


#: Elements of one half-tile (BLOCK_M rows x BLOCK_D columns) a GPU program holds. With
#: 64 x 64 at 4 warps the kernel needed 254 registers on sm_90 (issue 17, 15): the warps now
#: follow the tile (``num_warps_for``: 16 here, 60 registers; 8 would need 122).
GPU_TILE = 4096
CPU_TILE = 16384  # the interpreter's cost is per program: as many rows as fit this tile


def _blocks(half: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_M rows, BLOCK_D columns of one half, num_warps)."""
    block_d = next_power_of_2(half)
    tile = GPU_TILE if device.type == "cuda" else CPU_TILE
    block_m = max(1, min(64 if device.type == "cuda" else tile, tile // block_d))
    return block_m, block_d, num_warps_for(block_m * block_d)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    """x: [B, H, T, D] (any strides) -> rotated copy, contiguous [B, H, T, D]."""
    seq_len, d = x.shape[-2], x.shape[-1]
    half = d // 2
    x2 = x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    y = torch.empty_like(x2)
    n_rows = x2.numel() // d
    block_m, block_d, num_warps = _blocks(half, x.device)
    _rope_kernel[(cdiv(n_rows, block_m),)](
        x2, cos, sin, y, n_rows, seq_len, half, cos.stride(0), sign,
        BLOCK_M=block_m, BLOCK_D=block_d, num_warps=num_warps,
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
    """Autograd for rope: backward is the rotation by the opposite angle (saves cos, sin)."""

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


def check_inputs(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """q, k: [B, H, T, D] with the same B, T and even D (H may differ: grouped-query
    attention); cos, sin: [>= T, D/2]; floating point, one device. RuntimeError kind, as the
    torch reference would raise for mismatched shapes."""
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        check_tensor("rope", name, t)
    if q.dim() != 4 or k.dim() != 4 or q.shape[-1] % 2:
        raise KernelTensorError(f"rope: expected q and k of shape [B, H, T, D] with even D, got "
                                f"{list(q.shape)} and {list(k.shape)}")
    B, _, T, D = q.shape
    if (k.shape[0], k.shape[2], k.shape[3]) != (B, T, D):
        raise KernelTensorError(f"rope: q {list(q.shape)} and k {list(k.shape)} must agree on B, T and D")
    if cos.dim() != 2 or cos.shape[0] < T or cos.shape[1] != D // 2 or sin.shape != cos.shape:
        raise KernelTensorError(f"rope: cos and sin must both be [>= {T}, {D // 2}], got "
                                f"{list(cos.shape)} and {list(sin.shape)}")
    check_floating("rope", (("q", q), ("k", k), ("cos", cos), ("sin", sin)))
    check_same_device("rope", (("q", q), ("k", k), ("cos", cos), ("sin", sin)))


def rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k ([B, H, T, D]) by cos, sin ([T_max, D/2]); gradients flow to q and k."""
    check_inputs(q, k, cos, sin)
    if q.numel() and k.numel() and use_kernel(q, k):  # empty input: nothing to launch
        return _apply(q, k, cos, sin)
    return rope_reference(q, k, cos, sin)
