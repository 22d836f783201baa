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
from tpkit.demo.models import rope_cache
from tpkit.kernels import reference as R

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


# ---------------------------------------------------------------- GPU-path defects (issue 17)
# Each mechanism exercised on the CPU: autocast bf16 (1), grad buffers under no_grad (6), the
# device guard of every launch (7), chunked RMSNorm rows under the interpreter (15).
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_fused_linear_cross_entropy_under_autocast_with_fp32_weights(reduction):
    """Issue 17, 1: autocast made the chunk's logits bf16 and the out=/in-place matmuls
    refused the dtype mix. Now it matches eager under the same autocast, grads in fp32."""
    h, w, t = flce_inputs((3, 7), 16, 90, torch.float32, seed=11, n_ignored=2)

    def under_autocast(fn):
        def run(h, w):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return fn(h, w)
        return run

    (outs, grads), (routs, rgrads) = run_both(
        under_autocast(lambda h, w: K.fused_linear_cross_entropy(h, w, t, reduction=reduction, chunk_size=8)),
        under_autocast(lambda h, w: R.linear_cross_entropy_reference(h, w, t, reduction=reduction)),
        [h, w],
    )
    assert outs[0].dtype == torch.float32 and grads[0].dtype == grads[1].dtype == torch.float32
    close(outs[0], routs[0], torch.bfloat16)
    close(grads[0], rgrads[0], torch.bfloat16)
    close(grads[1], rgrads[1], torch.bfloat16, scale=2)  # grad weight: one bf16 rounding per chunk


def test_fused_linear_cross_entropy_mixed_dtypes_without_autocast_raise_like_torch():
    h, w, t = flce_inputs((5,), 8, 20, torch.float32, seed=12)
    with pytest.raises(RuntimeError, match="same dtype"):
        K.fused_linear_cross_entropy(h.bfloat16(), w, t)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_fused_linear_cross_entropy_makes_no_grad_buffers_without_grad_mode(monkeypatch, mode):
    """Issue 17, 6: under no_grad / inference_mode nothing asks for a gradient, so no [N, C]
    or [V, C] buffer and no grad matmul, even for inputs that require grad."""
    calls = []
    real = flce_mod._chunk_grads

    def spy(h, weight, targets, loss_rows, ignore_index, chunk, grad_h, grad_w, row_scale=None):
        calls.append((grad_h, grad_w))
        return real(h, weight, targets, loss_rows, ignore_index, chunk, grad_h, grad_w, row_scale)

    monkeypatch.setattr(flce_mod, "_chunk_grads", spy)
    h, w, t = flce_inputs((4, 5), 8, 60, torch.float32, seed=13, n_ignored=1)
    h.requires_grad_(True)
    w.requires_grad_(True)
    with getattr(torch, mode)():
        loss = K.fused_linear_cross_entropy(h, w, t, chunk_size=8)
        ref = R.linear_cross_entropy_reference(h, w, t)
    assert loss.grad_fn is None
    close(loss, ref, torch.float32)
    assert calls and all(gh is None and gw is None for gh, gw in calls)
    calls.clear()  # with grad mode on, only what requires grad gets a buffer
    K.fused_linear_cross_entropy(h.detach(), w, t, chunk_size=8)
    assert calls and all(gh is None and gw is not None for gh, gw in calls)


def test_every_launch_sets_the_tensors_device(monkeypatch):
    """Issue 17, 7: a launch runs under torch.cuda.device(<its tensors' device>), so a tensor
    on cuda:1 never runs on the current device's stream. CUDA faked at the boundary: every
    launch sees "cuda:1" and enters the (recording) device guard."""
    from tpkit.kernels import backend

    entered = []

    class FakeDeviceGuard:
        def __init__(self, device):
            self.device = device

        def __enter__(self):
            entered.append(str(self.device))

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(backend, "launch_device", lambda args: torch.device("cuda", 1))
    monkeypatch.setattr(torch.cuda, "device", FakeDeviceGuard)
    x = leaf(torch.randn(3, 10))
    K.rms_norm(x, torch.ones(10), 1e-6).sum().backward()
    assert entered == ["cuda:1", "cuda:1"]  # forward and backward
    h, w, t = flce_inputs((6,), 4, 9, torch.float32, seed=14)
    K.fused_linear_cross_entropy(leaf(h), w, t, chunk_size=4).backward()
    K.swiglu(torch.randn(4), torch.randn(4))
    cos, sin = rope_cache(3, 4)
    K.rope(torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4), cos, sin)
    assert len(entered) == 2 + 2 + 1 + 2 and set(entered) == {"cuda:1"}  # 2 FLCE chunks, q and k


def test_launch_device_is_the_first_cuda_tensor():
    from tpkit.kernels.backend import device_guard, launch_device

    class OnCuda2(torch.Tensor):  # a CPU tensor that says it lives on cuda:2
        @property
        def is_cuda(self):
            return True

        @property
        def device(self):
            return torch.device("cuda", 2)

    fake = torch.zeros(1).as_subclass(OnCuda2)
    assert launch_device((torch.zeros(1), 3, fake)) == torch.device("cuda", 2)
    assert launch_device((torch.zeros(1), 1.0)) is None
    with device_guard(None):  # CPU tensors: nothing is entered
        pass


def test_triton_failures_are_kernel_backend_errors(monkeypatch):
    """A Triton compile/launch failure becomes KernelBackendError: a TpkitError and still a
    RuntimeError, saying how to run the reference instead."""
    from triton.runtime.errors import OutOfResources

    from tpkit.errors import TpkitError
    from tpkit.kernels.swiglu import _swiglu_fwd_kernel

    class Failing:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                raise OutOfResources(300000, 232448, "shared memory")
            return run

    _swiglu_fwd_kernel.jitted()
    monkeypatch.setitem(_swiglu_fwd_kernel._jitted, True, Failing())
    with pytest.raises(K.KernelBackendError, match="TPKIT_KERNELS=reference") as info:
        K.swiglu(torch.randn(5), torch.randn(5))
    assert isinstance(info.value, TpkitError) and isinstance(info.value, RuntimeError)
    assert isinstance(info.value.__cause__, OutOfResources)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols,max_block_c,block_m", [(5, 37, 16, None), (37, 50, 16, 2), (3, 64, 32, 1)])
def test_rms_norm_chunked_rows_match_torch(rows, cols, max_block_c, block_m, dtype):
    """Issue 17, 15: rows wider than the block cap are walked in column chunks (forced here
    with a tiny cap so the loops run under the interpreter); block_m=2 over 37 rows gives
    several row blocks per backward program, each adding into its dweight row."""
    from tpkit.kernels.rms_norm import _blocks

    assert _blocks(rows, cols, torch.device("cpu"), max_block_c, block_m)[3]  # chunked
    gen = torch.Generator().manual_seed(15)
    x = (torch.randn(rows, cols, generator=gen) * 2).to(dtype)
    w = (1 + 0.3 * torch.randn(cols, generator=gen)).to(dtype)
    check(lambda x, w: K.rms_norm(x, w, 1e-6, max_block_c=max_block_c, block_m=block_m),
          lambda x, w: R.rms_norm_reference(x, w, 1e-6), [x, w], dtype)


def test_gpu_tiles_cap_the_row_and_follow_warps_to_the_tile():
    """What a GPU launch would pick: whole rows up to 4096 columns, chunks of 4096 beyond
    (no 65536-column limit any more), one row per program once chunked; RoPE's 64 x 64 tile
    on 16 warps. tests/test_kernels_compile.py checks these compile without spilling."""
    from tpkit.kernels import rms_norm as _  # noqa: F401  (the package exports the function)

    rn = importlib.import_module("tpkit.kernels.rms_norm")
    rp = importlib.import_module("tpkit.kernels.rope")
    gpu = torch.device("cuda")
    assert rn._blocks(8192, 4096, gpu) == (1, 4096, 16, False)
    assert rn._blocks(8192, 16384, gpu) == (1, 4096, 16, True)
    assert rn._blocks(8192, 100_000, gpu)[1:] == (4096, 16, True)
    assert rn._blocks(8192, 64, gpu) == (64, 64, 16, False)
    assert rp._blocks(64, gpu) == (64, 64, 16)
    with pytest.raises(ValueError):
        rn._blocks(4, 37, torch.device("cpu"), max_block_c=24)
