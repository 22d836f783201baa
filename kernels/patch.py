"""Swap a model's modules for kernel-backed twins, and back.

``patch(model)`` replaces, in place:

- RMSNorm modules: tpkit.demo.models.RMSNorm and any module whose class name contains "RMSNorm",
  with a 1-D ``.weight`` and an ``.eps`` (or Hugging Face's ``.variance_epsilon``);
- SwiGLU MLPs: modules with ``gate``/``up``/``down`` (or ``gate_proj``/``up_proj``/
  ``down_proj``) Linears computing down(silu(gate(x)) * up(x));
- tpkit.demo.models.Attention, whose RoPE becomes the rope kernel;
- tpkit.demo.models.LMHeadLoss, whose head + loss becomes fused_linear_cross_entropy.

A module is swapped only if it *behaves* like the pattern: before swapping, patch runs it
once on a small random input (from a private generator: the global RNG does not move) and
compares with the torch reference. So a Gemma-style RMSNorm that scales by 1 + weight, or an
MLP with GELU, is left alone, and so is a tpkit.models module whose forward has changed since
its twin was written. The twins hold the very same submodules and Parameters (shared, never
copied), under the same attribute names, so ``state_dict()`` keys and optimizer parameter
groups are unchanged. ``unpatch(model)`` puts the original module objects back.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from .errors import KernelArgumentError
from .fused_linear_cross_entropy import fused_linear_cross_entropy
from .reference import rms_norm_reference
from .rms_norm import rms_norm
from .rope import rope
from .swiglu import swiglu

KINDS = ("rms_norm", "swiglu", "rope", "lm_head_loss")
_SWAPS_ATTR = "_tpkit_kernel_swaps"
_MLP_NAMES = (("gate", "up", "down"), ("gate_proj", "up_proj", "down_proj"))


@dataclass
class Swap:
    """One module swapped by :func:`patch`."""

    name: str  # qualified name in the model, e.g. "blocks.0.norm1"
    kind: str  # one of KINDS
    original: nn.Module
    replacement: nn.Module

    def __str__(self) -> str:
        return f"{self.name}: {type(self.original).__name__} -> {type(self.replacement).__name__}"


class _Twin(nn.Module):
    """Base of the kernel-backed modules; keeps the original out of the module tree."""

    def __init__(self, original: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "_original", original)  # not a submodule: not in state_dict

    def extra_repr(self) -> str:
        return f"patched from {type(self._original).__name__}"


class KernelRMSNorm(_Twin):
    """An RMSNorm module running the rms_norm kernel, on the original's weight."""

    def __init__(self, original: nn.Module, eps: float) -> None:
        super().__init__(original)
        self.weight = original.weight  # the same Parameter
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., C] -> [..., C]
        return rms_norm(x, self.weight, self.eps)


class KernelSwiGLU(_Twin):
    """A SwiGLU MLP running the swiglu kernel, on the original's Linear modules."""

    def __init__(self, original: nn.Module, names: tuple[str, str, str]) -> None:
        super().__init__(original)
        self._names = names
        for n in names:
            setattr(self, n, getattr(original, n))  # the same Linear modules

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., C] -> [..., C]
        gate, up, down = (getattr(self, n) for n in self._names)
        return down(swiglu(gate(x), up(x)))  # [..., H] hidden activations


class KernelRoPEAttention(_Twin):
    """tpkit.demo.models.Attention with the rope kernel in place of apply_rope."""

    def __init__(self, original: nn.Module) -> None:
        super().__init__(original)
        self.n_head = original.n_head
        self.qkv = original.qkv
        self.proj = original.proj

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)  # 3 x [B, T, C]
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        q, k = rope(q, k, cos, sin)  # [B, H, T, D]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class KernelLMHeadLoss(_Twin):
    """tpkit.demo.models.LMHeadLoss whose loss never materialises the [B*T, V] logits."""

    def __init__(self, original: nn.Module) -> None:
        super().__init__(original)
        self.weight = original.weight  # the same Parameter (tied to the embedding in TinyTransformer)

    def forward(self, h: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if targets is None:
            return h @ self.weight.t()  # [B, T, V]: logits were asked for
        return fused_linear_cross_entropy(h, self.weight, targets)  # [] mean loss


def _probe_input(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """Random probe input from a private generator: patching must not move the global RNG
    (an A/B run compares patched and unpatched models on the same random stream)."""
    gen = torch.Generator().manual_seed(0)
    return torch.randn(shape, generator=gen).to(device=like.device, dtype=like.dtype)


def _probe_close(a: torch.Tensor, b: torch.Tensor) -> bool:
    tol = 1e-5 if a.dtype in (torch.float32, torch.float64) else 2e-2
    return a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=tol, atol=tol)


def _twin_agrees(original: nn.Module, twin: nn.Module, *inputs: torch.Tensor) -> bool:
    """The twin (run on the torch reference path: this checks its structure, not the kernels)
    computes what the original does. Guards the tpkit.models twins, which re-state their
    original's forward, against that forward changing."""
    from .backend import reference_only

    try:
        with torch.no_grad(), reference_only():
            return _probe_close(twin(*inputs), original(*inputs))
    except Exception:
        return False


def _rms_norm_eps(module: nn.Module) -> float | None:
    """eps if ``module`` looks like, and computes, an RMSNorm; else None."""
    if isinstance(module, _Twin) or "rmsnorm" not in type(module).__name__.lower():
        return None
    weight = getattr(module, "weight", None)
    eps = getattr(module, "eps", getattr(module, "variance_epsilon", None))
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or not isinstance(eps, (int, float)):
        return None
    try:
        x = _probe_input((3, weight.shape[0]), weight)  # [3, C]
        with torch.no_grad():
            ok = _probe_close(module(x), rms_norm_reference(x, weight, float(eps)))
    except Exception:
        return None
    return float(eps) if ok else None


def _swiglu_names(module: nn.Module) -> tuple[str, str, str] | None:
    if isinstance(module, _Twin):
        return None
    for names in _MLP_NAMES:
        parts = [getattr(module, n, None) for n in names]
        if not all(isinstance(p, nn.Linear) for p in parts):
            continue
        gate, up, down = parts
        try:
            x = _probe_input((2, gate.in_features), gate.weight)  # [2, C]
            with torch.no_grad():
                ok = _probe_close(module(x), down(F.silu(gate(x)) * up(x)))
        except Exception:
            return None
        return names if ok else None
    return None


def _twin_for(module: nn.Module, kinds: tuple[str, ...]) -> tuple[str, nn.Module] | None:
    from tpkit.demo import models  # late: tpkit.models imports nothing from here, but keep it lazy

    if "lm_head_loss" in kinds and type(module) is models.LMHeadLoss:
        twin = KernelLMHeadLoss(module)
        h = _probe_input((1, 3, module.weight.shape[1]), module.weight)  # [1, 3, C]
        targets = torch.tensor([[0, module.weight.shape[0] - 1, 1 % module.weight.shape[0]]],
                               device=module.weight.device)  # [1, 3]
        return ("lm_head_loss", twin) if _twin_agrees(module, twin, h, targets) else None
    if "rope" in kinds and type(module) is models.Attention:
        twin = KernelRoPEAttention(module)
        c = module.qkv.in_features
        x = _probe_input((1, 4, c), module.qkv.weight)  # [1, T=4, C]
        cos, sin = (t.to(x.device) for t in models.rope_cache(4, c // module.n_head))
        return ("rope", twin) if _twin_agrees(module, twin, x, cos, sin) else None
    if "rms_norm" in kinds:
        eps = _rms_norm_eps(module)
        if eps is not None:
            return "rms_norm", KernelRMSNorm(module, eps)
    if "swiglu" in kinds:
        names = _swiglu_names(module)
        if names is not None:
            return "swiglu", KernelSwiGLU(module, names)
    return None


def patch(model: nn.Module, kinds: tuple[str, ...] | list[str] = KINDS) -> list[Swap]:
    """Swap matching submodules of ``model`` in place; returns the swaps made by this call.

    ``kinds`` limits what is swapped (any of ``KINDS``). Patching twice swaps nothing new.
    The model itself (the root) is never replaced, only its descendants."""
    kinds = tuple(kinds)
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise KernelArgumentError(f"unknown kinds {sorted(unknown)}; choose from {KINDS}")
    swaps: list[Swap] = []
    # walk a snapshot, parents before children; skip below anything already swapped
    swapped_prefixes: list[str] = []
    for name, module in list(model.named_modules()):
        if not name or any(name.startswith(p + ".") for p in swapped_prefixes):
            continue
        found = _twin_for(module, kinds)
        if found is None:
            continue
        kind, twin = found
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, twin)
        swaps.append(Swap(name, kind, module, twin))
        swapped_prefixes.append(name)
    if swaps:
        object.__setattr__(model, _SWAPS_ATTR, getattr(model, _SWAPS_ATTR, []) + swaps)
    return swaps


def patched(model: nn.Module) -> list[Swap]:
    """The swaps currently in place on ``model``."""
    return list(getattr(model, _SWAPS_ATTR, []))


def unpatch(model: nn.Module) -> list[Swap]:
    """Put back every original module swapped by :func:`patch`; returns the swaps undone."""
    swaps = patched(model)
    for swap in reversed(swaps):
        parent_name, _, child = swap.name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, swap.original)
    if hasattr(model, _SWAPS_ATTR):
        object.__delattr__(model, _SWAPS_ATTR)
    return swaps


@contextlib.contextmanager
def kernels_enabled(model: nn.Module, kinds: tuple[str, ...] | list[str] = KINDS) -> Iterator[list[Swap]]:
    """``with kernels_enabled(model) as swaps: ...`` patches for the block, then undoes exactly
    the swaps it made (also when the block raises), e.g. for one arm of an A/B run."""
    swaps = patch(model, kinds)
    try:
        yield swaps
    finally:
        remaining = [s for s in patched(model) if s not in swaps]
        unpatch(model)
        if remaining:  # swaps made before this block stay in place
            for swap in remaining:
                parent_name, _, child = swap.name.rpartition(".")
                parent = model.get_submodule(parent_name) if parent_name else model
                setattr(parent, child, swap.replacement)
            object.__setattr__(model, _SWAPS_ATTR, remaining)
