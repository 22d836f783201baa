"""Plain torch implementations of every tpkit kernel: the fallback path and the tests' truth.

Each one computes exactly what the matching module of ``tpkit.models`` computes (same dtype
rules), so a patched model and an unpatched one can be compared step by step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., C], weight: [C] -> [..., C] in promote(x.dtype, weight.dtype), as tpkit.models.RMSNorm."""
    rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)  # [..., 1] fp32
    return (x.float() * rstd).type_as(x) * weight


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, elementwise; gate, up: [..., H]."""
    return F.silu(gate) * up


def rope_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k: [B, H, T, D]; cos, sin: [T_max >= T, D/2]. Rotates halves, as tpkit.models.apply_rope."""

    def rotate(x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        x1, x2 = x[..., :d], x[..., d:]
        c, s = cos[: x.shape[-2]].to(x.dtype), sin[: x.shape[-2]].to(x.dtype)  # [T, D/2]
        return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)

    return rotate(q), rotate(k)


def linear_cross_entropy_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """hidden: [..., C], weight: [V, C], targets: [...]. Materialises the [N, V] logits."""
    logits = hidden.reshape(-1, hidden.shape[-1]) @ weight.t()  # [N, V]
    return F.cross_entropy(
        logits.float(), targets.reshape(-1), ignore_index=ignore_index, reduction=reduction
    )
