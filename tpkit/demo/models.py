"""The built-in model: a small decoder-only transformer, nanoGPT-style.

It is what `make demo` profiles, what the tutorials start from, and what
`tpkit.kernels.patch` knows how to swap (RMSNorm, SwiGLU MLP, RoPE, LM head + loss).
Shapes in comments: B batch, T tokens, C channels, H heads, V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class TinyConfig:
    """Shape of the tiny transformer (vocabulary, width, depth, heads, sequence length)."""
    vocab_size: int = 512
    seq_len: int = 64
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 128
    mlp_ratio: float = 8 / 3  # SwiGLU hidden = ratio * d_model, rounded up to a multiple of 8
    eps: float = 1e-6
    tie_weights: bool = True

    @property
    def d_hidden(self) -> int:
        return int(math.ceil(self.mlp_ratio * self.d_model / 8) * 8)


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale (what ``tpkit.kernels.rms_norm`` replaces)."""
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rms = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (x.float() * rms).type_as(x) * self.weight


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, d_model: int, d_hidden: int) -> None:
        super().__init__()
        self.gate = nn.Linear(d_model, d_hidden, bias=False)
        self.up = nn.Linear(d_model, d_hidden, bias=False)
        self.down = nn.Linear(d_hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


def rope_cache(seq_len: int, head_dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [T, head_dim // 2]."""
    inv = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv)
    return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, T, D]; rotates pairs (x[..., :D/2], x[..., D/2:]) by the position angle."""
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d], x[..., d:]
    c, s = cos[: x.shape[-2]].to(x.dtype), sin[: x.shape[-2]].to(x.dtype)
    return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)


class Attention(nn.Module):
    """Causal self-attention with rotary position embeddings."""
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)  # 3 x [B, T, C]
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # [B, H, T, D]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    """One pre-norm transformer block: attention and a SwiGLU MLP, each with a residual."""
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.norm1 = RMSNorm(cfg.d_model, cfg.eps)
        self.attn = Attention(cfg)
        self.norm2 = RMSNorm(cfg.d_model, cfg.eps)
        self.mlp = SwiGLU(cfg.d_model, cfg.d_hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class LMHeadLoss(nn.Module):
    """Final projection to the vocabulary and the mean cross-entropy, in one module so that a
    fused kernel can replace both without materialising the [B*T, V] logits."""

    def __init__(self, d_model: int, vocab_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, d_model))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, h: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        logits = h @ self.weight.t()  # [B, T, V]
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class TinyTransformer(nn.Module):
    """``model(x, y)`` returns the loss; ``model(x)`` the logits."""

    def __init__(self, cfg: TinyConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg = cfg or TinyConfig()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model, cfg.eps)
        self.head = LMHeadLoss(cfg.d_model, cfg.vocab_size)
        if cfg.tie_weights:
            self.head.weight = self.embed.weight  # type: ignore[assignment]  # one storage, counted once by the memory probe
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
        cos, sin = rope_cache(cfg.seq_len, cfg.d_model // cfg.n_head)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(x)  # [B, T, C]
        for block in self.blocks:
            h = block(h, self.rope_cos, self.rope_sin)
        return self.head(self.norm(h), targets)
