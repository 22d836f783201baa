"""Backend selection: GPU -> Triton, CPU + TRITON_INTERPRET=1 -> interpreter, otherwise the
torch reference with a one-time notice; never Triton's "0 active drivers" error."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import tpkit.kernels as K
from tpkit.kernels import backend
from tpkit.kernels import reference as R


@pytest.fixture
def fresh_notices(monkeypatch):
    monkeypatch.setattr(backend, "_noticed", set())
    monkeypatch.delenv("TPKIT_KERNELS", raising=False)


class FakeCuda:
    is_cuda = True


def test_selection_follows_device_and_environment(monkeypatch, fresh_notices):
    cpu = torch.zeros(1)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert K.select_backend(cpu) == "interpreter"
    assert K.select_backend(cpu, FakeCuda()) == "triton"  # any CUDA tensor: compiled Triton
    monkeypatch.delenv("TRITON_INTERPRET")
    assert K.select_backend(FakeCuda()) == "triton"
    with pytest.warns(backend.KernelBackendNotice, match="TRITON_INTERPRET=1"):
        assert K.select_backend(cpu) == "reference"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the notice is given once only
        assert K.select_backend(cpu) == "reference"


def test_cpu_without_interpreter_falls_back_instead_of_crashing(monkeypatch, fresh_notices):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, w = torch.randn(3, 37, requires_grad=True), torch.randn(37, requires_grad=True)
    with pytest.warns(backend.KernelBackendNotice):
        y = K.rms_norm(x, w, 1e-6)  # would be "0 active drivers" if it launched the kernel
    torch.testing.assert_close(y, R.rms_norm_reference(x, w, 1e-6))
    y.sum().backward()
    assert x.grad is not None and w.grad is not None
    h, W, t = torch.randn(5, 8), torch.randn(11, 8), torch.randint(0, 11, (5,))
    torch.testing.assert_close(
        K.fused_linear_cross_entropy(h, W, t), R.linear_cross_entropy_reference(h, W, t)
    )


def test_reference_can_be_forced(monkeypatch, fresh_notices):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cpu = torch.zeros(1)
    with K.reference_only():
        assert K.select_backend(cpu, FakeCuda()) == "reference"
    assert K.select_backend(cpu) == "interpreter"
    monkeypatch.setenv("TPKIT_KERNELS", "reference")
    assert K.select_backend(FakeCuda()) == "reference"
    monkeypatch.delenv("TPKIT_KERNELS")
    K.force_backend("reference")
    try:
        assert K.select_backend(cpu) == "reference"
    finally:
        K.force_backend(None)
    assert K.select_backend(cpu) == "interpreter"
    with pytest.raises(ValueError):
        K.force_backend("triton")


def test_interpret_set_after_import_takes_effect(monkeypatch):
    """Kernels are jitted at first launch, per mode: TRITON_INTERPRET need not be set before
    ``import tpkit.kernels``."""
    from tpkit.kernels.swiglu import _swiglu_fwd_kernel

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert type(_swiglu_fwd_kernel.jitted()).__name__ == "InterpretedFunction"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert type(_swiglu_fwd_kernel.jitted()).__name__ == "JITFunction"


NO_TRITON = textwrap.dedent(
    """
    import importlib.abc, sys, warnings

    class NoTriton(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "triton" or name.startswith("triton."):
                raise ImportError("No module named 'triton' (blocked by the test)")
            return None

    sys.meta_path.insert(0, NoTriton())
    import torch
    import tpkit.kernels as K
    from tpkit.kernels import backend, reference as R
    from tpkit.models import TinyConfig, TinyTransformer

    assert not backend.triton_available()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        x, w = torch.randn(3, 37), torch.randn(37)
        assert torch.equal(K.rms_norm(x, w, 1e-6), R.rms_norm_reference(x, w, 1e-6))
        model = TinyTransformer(TinyConfig(vocab_size=31, seq_len=8, n_layer=1, n_head=2, d_model=16))
        K.patch(model)
        loss = model(torch.randint(0, 31, (2, 8)), torch.randint(0, 31, (2, 8)))
        loss.backward()
    notices = [str(c.message) for c in caught if issubclass(c.category, backend.KernelBackendNotice)]
    assert len(notices) == 1, notices
    try:
        from tpkit.kernels.rms_norm import _rms_norm_fwd_kernel
        _rms_norm_fwd_kernel.jitted()
        raise SystemExit("jitted() should have raised")
    except ImportError as exc:
        assert "pip install tpkit[triton]" in str(exc)
    print("NOTICE:", notices[0])
    """
)


def test_without_triton_everything_runs_on_the_reference_and_says_what_to_install():
    env = {"TRITON_INTERPRET": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-c", NO_TRITON], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "pip install tpkit[triton]" in done.stdout
