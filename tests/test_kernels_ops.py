"""Every kernel against plain torch: outputs and every gradient, fp32 and bf16, odd shapes.

Runs the real Triton kernels through Triton's interpreter (TRITON_INTERPRET=1; the
``interpreter`` fixture sets it and checks the interpreter is what runs).
"""

from __future__ import annotations

import importlib
import random

import pytest
import torch

import tpkit.kernels as K
from tpkit.kernels import reference as R
from tpkit.demo.models import rope_cache

# the package exports the function under the module's name: reach the module itself
flce_mod = importlib.import_module("tpkit.kernels.fused_linear_cross_entropy")

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("TPKIT_KERNELS", raising=False)
    assert K.select_backend(torch.zeros(1)) == "interpreter"


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> None:
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    tol = {k: v * scale for k, v in TOL[dtype].items()}
    torch.testing.assert_close(actual.float(), expected.float(), **tol)


def leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def run_both(fn, ref, inputs, seed: int = 0):
    """Forward both with fresh leaves, backward a shared random cotangent; -> (outs, grads) x 2."""
    results = []
    cotangents = None
    for f in (fn, ref):
        xs = [leaf(t) if t.is_floating_point() else t for t in inputs]
        out = f(*xs)
        outs = out if isinstance(out, tuple) else (out,)
        if cotangents is None:
            gen = torch.Generator().manual_seed(seed)
            cotangents = [torch.randn(o.shape, generator=gen).to(o.dtype) for o in outs]
        torch.autograd.backward(outs, cotangents)
        results.append((outs, [x.grad for x in xs if x.is_floating_point()]))
    return results


def check(fn, ref, inputs, dtype, seed=0, scale=1.0):
    (outs, grads), (routs, rgrads) = run_both(fn, ref, inputs, seed)
    for a, b in zip(outs, routs):
        close(a, b, dtype, scale)
    for a, b in zip(grads, rgrads):
        close(a, b, dtype, scale)


def test_kernels_really_run_in_the_interpreter():
    x = torch.randn(3, 37)
    K.rms_norm(x, torch.ones(37), 1e-6)
    from tpkit.kernels.rms_norm import _rms_norm_fwd_kernel

    assert type(_rms_norm_fwd_kernel.jitted()).__name__ == "InterpretedFunction"


# ---------------------------------------------------------------- RMSNorm
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 37), (5, 130), (2, 3, 64), (1, 1)])
def test_rms_norm_matches_torch(shape, dtype):
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    w = (1 + 0.2 * torch.randn(shape[-1], generator=gen)).to(dtype)
    check(lambda x, w: K.rms_norm(x, w, 1e-6), lambda x, w: R.rms_norm_reference(x, w, 1e-6), [x, w], dtype)


def test_rms_norm_mixed_dtypes_follow_the_model():
    """bf16 activations with an fp32 weight give an fp32 output, as tpkit.models.RMSNorm."""
    x = torch.randn(4, 19).to(torch.bfloat16)
    w = torch.randn(19)
    (outs, grads), (routs, rgrads) = run_both(
        lambda x, w: K.rms_norm(x, w, 1e-5), lambda x, w: R.rms_norm_reference(x, w, 1e-5), [x, w]
    )
    assert outs[0].dtype == routs[0].dtype == torch.float32
    close(outs[0], routs[0], torch.bfloat16)
    close(grads[0], rgrads[0], torch.bfloat16)
    close(grads[1], rgrads[1], torch.bfloat16)


# ---------------------------------------------------------------- SwiGLU
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 37), (5, 130), (2, 7, 11)])
def test_swiglu_matches_torch(shape, dtype):
    gen = torch.Generator().manual_seed(2)
    g = (torch.randn(shape, generator=gen) * 3).to(dtype)
    u = torch.randn(shape, generator=gen).to(dtype)
    check(K.swiglu, R.swiglu_reference, [g, u], dtype)


def test_swiglu_spans_several_blocks():
    """More elements than one program's block, not a multiple of it."""
    g, u = torch.randn(3, 2741), torch.randn(3, 2741)
    check(K.swiglu, R.swiglu_reference, [g, u], torch.float32)


# ---------------------------------------------------------------- RoPE
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bhtd", [(2, 3, 7, 6), (1, 4, 13, 10), (3, 1, 5, 2)])
def test_rope_matches_torch(bhtd, dtype):
    B, H, T, D = bhtd
    gen = torch.Generator().manual_seed(3)
    cos, sin = rope_cache(T + 4, D)  # a longer table than T, as the model's cache
    q = torch.randn(B, H, T, D, generator=gen).to(dtype)
    k = torch.randn(B, max(1, H // 2), T, D, generator=gen).to(dtype)  # fewer k heads (GQA)
    check(
        lambda q, k: K.rope(q, k, cos, sin), lambda q, k: R.rope_reference(q, k, cos, sin), [q, k], dtype
    )


def test_rope_accepts_transposed_views():
    """The model passes q, k as [B, T, H, D] tensors transposed to [B, H, T, D]."""
    cos, sin = rope_cache(9, 8)
    q = torch.randn(2, 9, 3, 8).transpose(1, 2)
    k = torch.randn(2, 9, 3, 8).transpose(1, 2)
    check(lambda q, k: K.rope(q, k, cos, sin), lambda q, k: R.rope_reference(q, k, cos, sin), [q, k],
          torch.float32)


# ---------------------------------------------------------------- fused linear cross-entropy
def flce_inputs(n_shape, c, v, dtype, seed, n_ignored=0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(*n_shape, c, generator=gen).to(dtype)
    w = (torch.randn(v, c, generator=gen) / c**0.5 * 2).to(dtype)
    t = torch.randint(0, v, n_shape, generator=gen)
    t.view(-1)[:n_ignored] = -100
    return h, w, t


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("n_shape,c,v,chunk", [((3, 13), 16, 130, 8), ((37,), 24, 97, 5), ((5, 2), 9, 1000, None)])
def test_fused_linear_cross_entropy_matches_torch(n_shape, c, v, chunk, reduction, dtype):
    h, w, t = flce_inputs(n_shape, c, v, dtype, seed=4, n_ignored=3)
    check(
        lambda h, w: K.fused_linear_cross_entropy(h, w, t, reduction=reduction, chunk_size=chunk),
        lambda h, w: R.linear_cross_entropy_reference(h, w, t, reduction=reduction),
        [h, w], dtype,
    )


def test_fused_linear_cross_entropy_custom_ignore_index_and_no_weight_grad():
    h, w, t = flce_inputs((11,), 8, 50, torch.float32, seed=5)
    t[::3] = 7  # ignore token 7
    w.requires_grad_(False)
    hh = leaf(h)
    loss = K.fused_linear_cross_entropy(hh, w, t, ignore_index=7, chunk_size=4)
    loss.backward()
    h2 = leaf(h)
    ref = R.linear_cross_entropy_reference(h2, w, t, ignore_index=7)
    ref.backward()
    close(loss, ref, torch.float32)
    close(hh.grad, h2.grad, torch.float32)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_fused_linear_cross_entropy_never_holds_all_logits(monkeypatch, reduction):
    """Every vocab-sized buffer the kernel sees is one chunk, in forward and in backward; with
    "mean" the grads are made in forward, so backward touches no logits at all."""
    seen: list[tuple[str, tuple[int, ...]]] = []
    real = flce_mod._ce_rows
    phase = ["forward"]

    def spy(logits, *args):
        seen.append((phase[0], tuple(logits.shape)))
        return real(logits, *args)

    monkeypatch.setattr(flce_mod, "_ce_rows", spy)
    h, w, t = flce_inputs((4, 10), 16, 300, torch.float32, seed=6)
    h.requires_grad_(True)
    loss = K.fused_linear_cross_entropy(h, w, t, reduction=reduction, chunk_size=8)
    phase[0] = "backward"
    loss.sum().backward()
    assert all(rows <= 8 and cols == 300 for _, (rows, cols) in seen)
    assert sum(rows for p, (rows, _) in seen if p == "forward") == 40
    backward_rows = sum(rows for p, (rows, _) in seen if p == "backward")
    assert backward_rows == (40 if reduction == "none" else 0)


def test_fused_linear_cross_entropy_rejects_bad_reduction():
    h, w, t = flce_inputs((3,), 4, 5, torch.float32, seed=7)
    with pytest.raises(ValueError, match="reduction"):
        K.fused_linear_cross_entropy(h, w, t, reduction="max")


# ---------------------------------------------------------------- property test
@pytest.mark.parametrize("seed", range(6))
def test_random_shapes_property(seed):
    """Seeded random shapes (any size, rarely a power of two) for all four ops, fp32."""
    rng = random.Random(seed)
    rows, cols = rng.randint(1, 40), rng.randint(1, 300)
    x = torch.randn(rows, cols) * rng.uniform(0.1, 10)
    w = torch.randn(cols)
    eps = rng.choice([1e-6, 1e-5, 1e-2])
    check(lambda x, w: K.rms_norm(x, w, eps), lambda x, w: R.rms_norm_reference(x, w, eps), [x, w],
          torch.float32, seed, scale=2)
    check(K.swiglu, R.swiglu_reference, [torch.randn(rows, cols) * 4, torch.randn(rows, cols)],
          torch.float32, seed)
    B, H, T, D = rng.randint(1, 3), rng.randint(1, 4), rng.randint(1, 12), 2 * rng.randint(1, 20)
    cos, sin = rope_cache(T + rng.randint(0, 5), D)
    check(lambda q, k: K.rope(q, k, cos, sin), lambda q, k: R.rope_reference(q, k, cos, sin),
          [torch.randn(B, H, T, D), torch.randn(B, H, T, D)], torch.float32, seed)
    n, c, v = rng.randint(1, 40), rng.randint(1, 40), rng.randint(2, 400)
    h, wv, t = flce_inputs((n,), c, v, torch.float32, seed, n_ignored=rng.randint(0, n - 1))
    chunk = rng.choice([None, 1, rng.randint(1, n)])
    check(lambda h, w: K.fused_linear_cross_entropy(h, w, t, chunk_size=chunk),
          lambda h, w: R.linear_cross_entropy_reference(h, w, t), [h, wv], torch.float32, seed)


def test_empty_inputs_do_not_launch():
    x = torch.randn(0, 37, requires_grad=True)
    y = K.rms_norm(x, torch.ones(37), 1e-6)
    y.sum().backward()
    assert y.shape == (0, 37) and x.grad.shape == (0, 37)
    assert K.swiglu(torch.randn(2, 0), torch.randn(2, 0)).shape == (2, 0)
    cos, sin = rope_cache(4, 6)
    q, k = K.rope(torch.randn(0, 2, 4, 6), torch.randn(0, 2, 4, 6), cos, sin)
    assert q.shape == k.shape == (0, 2, 4, 6)
