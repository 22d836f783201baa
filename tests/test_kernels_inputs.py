"""Bad input to every kernel fails as torch fails, never with a silent number (issue 15).

Shapes, dtypes, devices and class indices are checked before any launch, with the builtin
error kind torch raises for the same mistake (RuntimeError for tensors, ValueError for
arguments, IndexError for targets out of range), each also a ``tpkit.errors.TpkitError``.
Runs the kernels through Triton's interpreter (TRITON_INTERPRET=1, tests/conftest.py).
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

import tpkit.kernels as K
from tpkit.errors import TpkitError
from tpkit.kernels import reference as R

flce_mod = importlib.import_module("tpkit.kernels.fused_linear_cross_entropy")


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("TPKIT_KERNELS", raising=False)
    assert K.select_backend(torch.zeros(1)) == "interpreter"


def raises_like(torch_kind, match=None):
    """Expect a tpkit kernel error that is also torch's builtin kind."""

    class Both:
        def __enter__(self):
            self.ctx = pytest.raises(torch_kind, match=match)
            self.info = self.ctx.__enter__()
            return self.info

        def __exit__(self, *exc):
            suppressed = self.ctx.__exit__(*exc)
            assert isinstance(self.info.value, TpkitError), type(self.info.value).__mro__
            return suppressed

    return Both()


def test_error_classes_keep_their_builtin_base():
    for cls, base in ((K.KernelTensorError, RuntimeError), (K.KernelArgumentError, ValueError),
                      (K.KernelIndexError, IndexError), (K.KernelBackendError, RuntimeError),
                      (K.KernelTypeError, TypeError)):
        assert issubclass(cls, TpkitError) and issubclass(cls, base) and issubclass(cls, K.KernelError)


# ---------------------------------------------------------------- fused linear cross-entropy
def inputs(n=6, c=8, v=50, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, c, generator=gen, requires_grad=True), torch.randn(v, c, generator=gen) / 3,
            torch.randint(0, v, (n,), generator=gen))


@pytest.mark.parametrize("bad", [99, 50, -5])
def test_targets_out_of_range_raise_like_cross_entropy(bad):
    h, w, t = inputs()
    t[2] = bad
    with pytest.raises(IndexError) as torch_err:
        F.cross_entropy(h.detach() @ w.t(), t)
    with raises_like(IndexError, match=f"Target {bad} is out of bounds") as err:
        K.fused_linear_cross_entropy(h, w, t)
    assert str(err.value) == str(torch_err.value)
    with K.reference_only(), raises_like(IndexError):  # the reference path is checked the same way
        K.fused_linear_cross_entropy(h, w, t)


@pytest.mark.parametrize("ignore_index", [-100, -5, 7])
def test_ignore_index_is_skipped_whatever_its_value(ignore_index):
    """Entries equal to ignore_index are ignored even when out of range (-5) or a real class
    (7), as F.cross_entropy does; everything else must be in range."""
    h, w, t = inputs(seed=1)
    t[::2] = ignore_index
    loss = K.fused_linear_cross_entropy(h, w, t, ignore_index=ignore_index, chunk_size=4)
    loss.backward()
    h2 = h.detach().clone().requires_grad_(True)
    ref = F.cross_entropy(h2 @ w.t(), t, ignore_index=ignore_index)
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h.grad, h2.grad, rtol=1e-5, atol=1e-5)


def test_all_targets_ignored_gives_nan_loss_and_zero_grads_like_torch():
    h, w, t = inputs(seed=2)
    w.requires_grad_(True)
    t[:] = -100
    loss = K.fused_linear_cross_entropy(h, w, t)
    loss.backward()
    assert torch.isnan(loss)
    assert torch.equal(h.grad, torch.zeros_like(h)) and torch.equal(w.grad, torch.zeros_like(w))


def test_kernel_never_reads_past_the_row_for_a_bad_target():
    """Even when the host check is bypassed, an out-of-range target gives NaN, not a number
    read from the next row (the old behaviour: a finite loss)."""
    h, w, t = inputs(seed=3)
    t[1] = 99
    loss, *_ = flce_mod.fused_linear_cross_entropy_forward(h.detach(), w, t, reduction="none",
                                                           need_grad_hidden=False, need_grad_weight=False)
    assert torch.isnan(loss[1]) and torch.isfinite(loss[[0, 2, 3, 4, 5]]).all()


def test_targets_on_a_gpu_are_checked_without_a_host_sync(monkeypatch):
    """On CUDA the range check is torch._assert_async (a device-side assert, as torch's own
    loss): nothing is read back to the host. CUDA faked at the boundary."""

    class OnCuda(torch.Tensor):
        @property
        def is_cuda(self):
            return True

    asserted = []
    monkeypatch.setattr(torch, "_assert_async", lambda cond, msg: asserted.append((bool(cond), msg)))
    t = torch.tensor([0, 99, -100]).as_subclass(OnCuda)
    flce_mod.check_targets(t, 50, -100)  # returns: the failure is the device's to report
    assert asserted == [(False, asserted[0][1])] and "out of bounds" in asserted[0][1]


@pytest.mark.parametrize("case,kind,match", [
    ("batch", ValueError, r"Expected input batch_size \(6\) to match target batch_size \(5\)"),
    ("hidden_size", RuntimeError, "cannot be multiplied"),
    ("weight_1d", RuntimeError, "cannot be multiplied"),
    ("float_targets", RuntimeError, "integer dtype"),
    ("bool_targets", RuntimeError, "integer dtype"),
    ("int_hidden", RuntimeError, "floating-point"),
    ("reduction", ValueError, "not a valid value for reduction"),
    ("chunk", ValueError, "chunk_size"),
    ("not_a_tensor", TypeError, "torch.Tensor"),
])
def test_fused_linear_cross_entropy_rejects_what_torch_rejects(case, kind, match):
    h, w, t = inputs(seed=4)
    kwargs = {}
    if case == "batch":
        t = t[:5]
    elif case == "hidden_size":
        w = torch.randn(50, 7)
    elif case == "weight_1d":
        w = torch.randn(8)
    elif case == "float_targets":
        t = t.float()
    elif case == "bool_targets":
        t = t > 3
    elif case == "int_hidden":
        h, w = torch.ones(6, 8, dtype=torch.int64), torch.ones(50, 8, dtype=torch.int64)
    elif case == "reduction":
        kwargs["reduction"] = "max"
    elif case == "chunk":
        kwargs["chunk_size"] = 0
    elif case == "not_a_tensor":
        t = [0] * 6
    with raises_like(kind, match=match):
        K.fused_linear_cross_entropy(h, w, t, **kwargs)


def test_int32_targets_are_accepted():
    """More permissive than F.cross_entropy (Long only): int32 class indices work."""
    h, w, t = inputs(seed=5)
    torch.testing.assert_close(K.fused_linear_cross_entropy(h, w, t.int()),
                               R.linear_cross_entropy_reference(h, w, t), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- rms_norm, swiglu, rope
@pytest.mark.parametrize("weight_shape", [(36,), (38,), (1,), (37, 1), ()])
def test_rms_norm_weight_of_the_wrong_size_raises_never_reads_past_it(weight_shape):
    x = torch.randn(3, 37)
    with raises_like(RuntimeError, match="expected weight of shape"):
        K.rms_norm(x, torch.ones(weight_shape), 1e-6)
    with K.reference_only(), raises_like(RuntimeError):  # (1,) would broadcast silently in torch
        K.rms_norm(x, torch.ones(weight_shape), 1e-6)


def test_rms_norm_rejects_integer_tensors():
    with raises_like(RuntimeError, match="floating-point"):
        K.rms_norm(torch.ones(2, 4, dtype=torch.int64), torch.ones(4), 1e-6)


def test_swiglu_shapes_broadcast_or_raise():
    g, u = torch.randn(3, 5), torch.randn(5)
    torch.testing.assert_close(K.swiglu(g, u), R.swiglu_reference(g, u))  # broadcast: reference
    with raises_like(RuntimeError, match="do not broadcast"):
        K.swiglu(torch.randn(3, 5), torch.randn(4))
    with raises_like(RuntimeError, match="floating-point"):
        K.swiglu(torch.ones(3, dtype=torch.int32), torch.ones(3))


def rope_cache(t: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.arange(t)[:, None] * torch.rand(d // 2)[None, :]  # [T, D/2]
    return angles.cos(), angles.sin()


@pytest.mark.parametrize("case", ["3d", "odd_d", "k_seq", "short_table", "table_width", "sin_shape"])
def test_rope_rejects_mismatched_shapes(case):
    q = k = torch.randn(1, 2, 5, 8)
    cos, sin = rope_cache(5, 8)
    if case == "3d":
        q = torch.randn(2, 5, 8)
    elif case == "odd_d":
        q = k = torch.randn(1, 2, 5, 7)
    elif case == "k_seq":
        k = torch.randn(1, 2, 4, 8)
    elif case == "short_table":
        cos, sin = rope_cache(4, 8)
    elif case == "table_width":
        cos, sin = rope_cache(5, 6)
    elif case == "sin_shape":
        sin = sin[:, :2]
    with raises_like(RuntimeError):
        K.rope(q, k, cos, sin)
